"""Discarded episodes (their env or sandbox failed) are kept on disk and counted, never trained
on; a step with nothing left to train on is skipped like a non-finite one."""

from __future__ import annotations

import dataclasses

import pytest

from agentrl.trajectory_files import load_jsonl, save_jsonl
from trainers.controller import Trainer
from trainers.workers import TrainingError


def _with_discards(recorded_rollouts, tmp_path, discard):
    trajs = load_jsonl(recorded_rollouts)[:64]
    marked = [dataclasses.replace(t, discard=discard(i)) for i, t in enumerate(trajs)]
    path = tmp_path / "marked.jsonl"
    save_jsonl(marked, path)
    assert [t.discard for t in load_jsonl(path)] == [discard(i) for i in range(64)]
    return path


def test_discarded_episodes_are_counted_and_never_trained_on(
    make_cfg, recorded_rollouts, tmp_path, monkeypatch
):
    from trainers.policy import PolicyWorker

    path = _with_discards(recorded_rollouts, tmp_path, lambda i: i % 4 == 1)
    seen = []
    train = PolicyWorker.train
    monkeypatch.setattr(PolicyWorker, "train",
                        lambda self, trajs, *a: seen.append(trajs) or train(self, trajs, *a))
    cfg = make_cfg(replay=str(path), steps=2)
    Trainer(cfg).run()
    assert [len(t) for t in seen] == [24, 24] and not any(t.discard for b in seen for t in b)
    import json
    from pathlib import Path

    rows = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["discarded"] for r in rows if "reward" in r] == [8.0, 8.0]
    saved = load_jsonl(Path(cfg.run_dir) / "rollouts" / "step_000001.jsonl")
    assert len(saved) == 32 and sum(t.discard for t in saved) == 8


def test_a_step_with_everything_discarded_is_skipped_then_stops(
    make_cfg, recorded_rollouts, tmp_path
):
    path = _with_discards(recorded_rollouts, tmp_path, lambda i: True)
    trajs = load_jsonl(path)
    for i, t in enumerate(trajs):  # the message names the commonest failure, with its count
        t.info["error"] = "RuntimeError('grader crashed')" if i % 4 else "TimeoutError()"
    save_jsonl(trajs, path)
    cfg = make_cfg(replay=str(path), steps=2, max_bad_steps=1)
    with pytest.raises(TrainingError, match=r"32 of 32 episodes were discarded \(their "
                       r"environment or sandbox failed, most often with: RuntimeError\('grader "
                       r"crashed'\) \(24 episodes\); .* Last checkpoint"):
        Trainer(cfg).run()


def test_a_missing_sandbox_stops_the_run_at_once_with_its_fix(make_cfg, capsys):
    """math-tir on a machine without bubblewrap: `agentrl train` exits 1 at the first rollout
    with the sandbox's own message (how to install it, or how to opt into the unisolated tier),
    not after --max_bad_steps steps of "episodes were discarded"."""
    from trainers.controller_run import run

    cfg = make_cfg(env="math-tir", eval_problems=0, steps=3, env_kwargs={
        "split": "train", "num_problems": 8,
        "sandbox_config": {"bwrap_path": "/nonexistent/bwrap"}})
    assert run(cfg) == 1
    err = capsys.readouterr().err
    assert err.startswith("agentrl train: agentrl.sandbox cannot isolate")
    assert "Traceback" not in err
    assert "apt-get install -y bubblewrap" in err and "AGENTRL_SANDBOX_ALLOW_UNISOLATED=1" in err
