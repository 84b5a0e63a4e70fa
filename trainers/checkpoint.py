"""Atomic checkpoints: everything an exact resume needs.

Layout: `run_dir/checkpoints/step_000004/{worker.pt, trainer_state.json, queue.jsonl}` plus
`run_dir/checkpoints/latest` naming the newest. A checkpoint is written to a temporary
directory and renamed into place, and `latest` is replaced atomically after that, so a crash
while saving leaves the previous checkpoint usable. The newest `keep` are kept, and the one
`checkpoints/best` names (`--keep_best`, with its metric in `best.json`) is never pruned.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from agentrl.files import partial_writes, replaced_atomically, write_atomically
from agentrl.trained_files import TRAINED_DIR
from agentrl.trajectory_files import load_jsonl, save_jsonl
from agentrl.types import Trajectory


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    worker_state: dict[str, Any],
    trainer_state: dict[str, Any],
    queue: list[Trajectory] | None = None,
    *,
    keep: int = 2,
) -> Path:
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    with replaced_atomically(final) as tmp:
        tmp.mkdir()
        torch.save(worker_state, tmp / "worker.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        save_jsonl(queue or [], tmp / "queue.jsonl")
    write_atomically(root / "latest", final.name)
    prune_checkpoints(run_dir, keep)
    return final


def mark_best(run_dir: str | Path, path: Path, metric: str, value: float, step: int) -> None:
    """Name `path` the best checkpoint (atomically, as `latest`), with what made it best."""
    root = checkpoint_root(run_dir)
    write_atomically(root / "best.json", json.dumps(
        {"checkpoint": path.name, "step": step, metric: value}, indent=2))
    write_atomically(root / "best", path.name)


def best_checkpoint(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint `mark_best` named and its record, or None."""
    root = checkpoint_root(run_dir)
    if not (root / "best").exists() or not (root / "best.json").exists():
        return None
    path = root / (root / "best").read_text().strip()
    return (path, json.loads((root / "best.json").read_text())) if path.is_dir() else None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    root = checkpoint_root(run_dir)
    marker = root / "latest"
    if not marker.exists():
        return None
    path = root / marker.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], list[Trajectory]]:
    path = Path(path)
    if not (path / "worker.pt").exists() or not (path / "trainer_state.json").exists():
        raise ValueError(
            f"{str(path)!r} is not an agentrl checkpoint (expected worker.pt and "
            f"trainer_state.json); pass a run's checkpoints/step_NNNNNN directory or --resume auto"
        )
    worker = torch.load(path / "worker.pt", weights_only=False)
    trainer = json.loads((path / "trainer_state.json").read_text())
    queue = load_jsonl(path / "queue.jsonl") if (path / "queue.jsonl").exists() else []
    return worker, trainer, queue


def remove_partial(run_dir: str | Path) -> list[Path]:
    """Delete what a save cut short left behind (half-written checkpoint directories and
    markers: `agentrl.files.partial_writes`); returns what it removed. Called at resume and at
    the end of a run, when no save of this run is in progress."""
    gone = partial_writes(checkpoint_root(run_dir))
    for p in gone:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return gone


def set_aside_earlier_run(run_dir: str | Path) -> Path | None:
    """A new run (not `--resume`) into a directory that holds an earlier run's files would mix
    its metrics, rollouts and checkpoints with them (metrics.jsonl is appended to, `--resume
    auto` would later pick the older run's newest checkpoint). The earlier run is renamed, whole,
    to `RUN_DIR.prev-<UTC time>` beside it, and the new run starts in an empty RUN_DIR; returns
    where the earlier run went (None: nothing to set aside). A directory is a run's when it
    holds `config.json` (the first file a run writes)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        return None
    here = Path.cwd().resolve()
    if run_dir.resolve() in (here, *here.parents, Path.home().resolve()):
        raise ValueError(
            f"--run_dir {run_dir} holds an earlier run and is this directory (or one above it): "
            f"pass --resume auto to continue that run, or a --run_dir of its own for a new one"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside = run_dir.with_name(f"{run_dir.name}.prev-{stamp}")
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir.with_name(f"{run_dir.name}.prev-{stamp}-{n}")
    run_dir.rename(aside)
    return aside


def rewind_run_files(run_dir: str | Path, step: int) -> None:
    """Make the run's files read as one uninterrupted run up to `step` (the checkpoint a run
    resumes from): metrics.jsonl loses the lines of later steps (rewritten atomically), and
    the rollouts (with their trained/ files) and periodic evals of later steps are removed;
    the resumed run writes them again."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        lines = metrics.read_text().splitlines(keepends=True)
        kept = [x for x in lines if x.strip() and json.loads(x).get("step", 0) <= step]
        if len(kept) != len(lines):
            write_atomically(metrics, "".join(kept))
    for folder in ("rollouts", TRAINED_DIR, "evals"):
        for f in (run_dir / folder).glob("step_*.jsonl"):
            if int(f.stem.removeprefix("step_")) > step:
                f.unlink()


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints and the one `checkpoints/best` names."""
    root = checkpoint_root(run_dir)
    best = (root / "best").read_text().strip() if (root / "best").exists() else None
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        if old.name != best:
            shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    """The random generators' states (torch, numpy, Python), for an exact resume."""
    import random

    import numpy as np

    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
