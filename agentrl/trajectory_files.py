"""Trajectories on disk: JSON lines, one episode a line, written atomically, with each image
stored once as a PNG named by its content hash in `images/` beside the file."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from agentrl.files import replaced_atomically
from agentrl.types import Trajectory


def image_dir_of(path: str | Path) -> Path:
    """Where the images of a trajectories JSONL file are stored: `images/` beside it, shared
    by the files of one folder (a run's rollouts), each image once."""
    return Path(path).parent / "images"


def save_jsonl(trajectories: Iterable[Trajectory], path: str | Path) -> int:
    """Write trajectories as JSON lines (atomically: a crash leaves the old file intact). Images
    go once each, as PNG named by content hash, to `image_dir_of(path)`; lines hold the hashes."""
    path = Path(path)
    n = 0
    with replaced_atomically(path) as tmp, tmp.open("w") as f:
        for traj in trajectories:
            f.write(traj.to_json(image_dir_of(path) if traj.images else None) + "\n")
            n += 1
    return n


def iter_jsonl(path: str | Path) -> Iterator[Trajectory]:
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield Trajectory.from_json(line, image_dir_of(path))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{lineno}: not a valid trajectory: {e}") from e


def load_jsonl(path: str | Path) -> list[Trajectory]:
    return list(iter_jsonl(path))
