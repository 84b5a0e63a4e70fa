"""The toy preference task of the DPO and reward-model tests: the chosen reply repeats the
prompt's words, the rejected one is other words, so the pairs are separable."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, TypeVar

from trainers.config import ActorConfig

C = TypeVar("C")

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "rocket"]


def write_pairs(path: Path, n: int = 160, seed: int = 0, **columns: Any) -> Path:
    """`n` draws of {"prompt", "chosen", "rejected", **columns} rows (a draw whose two replies
    are the same is left out) written to `path`."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            w, other = (" ".join(rng.sample(WORDS, 2)) for _ in range(2))
            if w != other:
                f.write(json.dumps({"prompt": f"Repeat: {w}", "chosen": w, "rejected": other,
                                    **columns}) + "\n")
    return path


def pair_config(config: type[C], tmp_path: Path, *, columns: dict[str, Any] | None = None,
                **flags: Any) -> C:
    """`config` on the tiny model (lr 1e-3) in tmp_path, quiet, training on `write_pairs` rows
    (with `columns`) with 15% of them held out; `flags` override."""
    base = {"actor": ActorConfig(model="tiny", lr=1e-3), "run_dir": str(tmp_path / "run"),
            "progress": False, "tensorboard": False, "eval_fraction": 0.15,
            "dataset": str(write_pairs(tmp_path / "pairs.jsonl", **(columns or {})))}
    return config(**{**base, **flags})
