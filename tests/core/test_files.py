"""agentrl.files: the one atomic write (trajectories, images, checkpoints, run files, caches)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from agentrl.files import partial_writes, replaced_atomically, temp_path_beside, write_atomically


def test_temporary_names_are_unique_and_hidden(tmp_path):
    names = {temp_path_beside(tmp_path / "a.jsonl") for _ in range(1000)}
    assert len(names) == 1000
    assert all(n.parent == tmp_path and n.name.startswith(".a.jsonl.") for n in names)


def test_a_failed_write_keeps_the_old_content_and_leaves_nothing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_atomically(path, "old\n")
    with pytest.raises(RuntimeError), replaced_atomically(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash")
    assert path.read_text() == "old\n" and not partial_writes(tmp_path)


def test_a_directory_is_replaced_whole(tmp_path):
    target = tmp_path / "step_000002"
    for content in ("first", "second"):
        with replaced_atomically(target) as tmp:
            tmp.mkdir()
            (tmp / "worker.pt").write_text(content)
    assert [p.name for p in target.iterdir()] == ["worker.pt"]
    assert (target / "worker.pt").read_text() == "second" and not partial_writes(tmp_path)


def _writers(write: Callable[[Any], None], payloads: list[Any], times: int) -> list[BaseException]:
    """Each payload written `times` times by a thread of its own, all at once; their errors."""
    errors: list[BaseException] = []

    def run(payload: Any) -> None:
        try:
            for _ in range(times):
                write(payload)
        except BaseException as e:  # noqa: BLE001 (returned to the test)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_concurrent_writers_never_mix(tmp_path):
    """Two writers of one file (threads of one process: same pid) each leave a whole file; with
    a fixed temporary name one's rename could publish the other's half-written file."""
    path = tmp_path / "traj.jsonl"
    payloads = [f"{i}\n" * 20_000 for i in range(8)]
    errors = _writers(lambda text: write_atomically(path, text), payloads, times=5)
    assert not errors and path.read_text() in payloads and not partial_writes(tmp_path)


def test_concurrent_trajectory_saves_never_mix(tmp_path):
    """save_jsonl wrote every writer's file through one fixed `NAME.tmp`: two writers of one
    path truncated each other's file or renamed it away from under the other."""
    from agentrl.trajectory_files import load_jsonl, save_jsonl
    from agentrl.types import Trajectory

    path = tmp_path / "rollouts.jsonl"
    batches = [[Trajectory(token_ids=[i] * 50, loss_mask=[0] * 50, logprobs=[0.0] * 50,
                           turns=[]) for _ in range(400)] for i in range(6)]
    errors = _writers(lambda batch: save_jsonl(batch, path), batches, times=3)
    loaded = load_jsonl(path)
    assert not errors and len(loaded) == 400 and len({t.token_ids[0] for t in loaded}) == 1
