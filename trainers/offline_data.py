"""The offline trainers' examples: rows of --dataset (and --eval_dataset) made into a trainer's
examples before any model loads, the held-out split by content hash, and sequences cut to
--max_len."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from trainers.offline_config import OfflineConfig

T = TypeVar("T")


@dataclass
class OfflineData(Generic[T]):
    """A trainer's examples, tokenized and checked before any model loads."""

    train: list[T]
    eval: list[T]
    skipped: int = 0
    """Rows or trajectories left out (bad rows with --bad_rows skip, filtered episodes)."""
    truncated: int = 0
    """Sequences cut to --max_len."""


def held_out(row: Any, fraction: float) -> bool:
    """Whether `row` belongs to the held-out split: by a hash of its content, so equal rows
    land on the same side and the split does not depend on the file's order."""
    digest = hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def read_examples(cfg: OfflineConfig, make: Callable[[dict, str], T], *,
                  keys: Mapping[str, str] | None = None) -> tuple[list[T], list[T], int]:
    """(train, held-out, skipped): `make(row, where)` of every row of --dataset (and
    --eval_dataset), before any model loads. A row `make` refuses with a ValueError stops the
    run with its place, or with --bad_rows skip is counted."""
    from agentrl.data import read_rows

    train: list[T] = []
    held: list[T] = []
    skipped = 0
    sources = [(cfg.dataset, False)] + ([(cfg.eval_dataset, True)] if cfg.eval_dataset else [])
    for path, is_eval in sources:
        assert path is not None
        rows = read_rows(path, keys=keys or {}, on_bad=cfg.bad_rows,
                         what="--eval_dataset" if is_eval else "--dataset")
        skipped += len(rows.skipped)
        for row, where in zip(rows.rows, rows.where, strict=True):
            try:
                item = make(row, where)
            except ValueError as e:
                if cfg.bad_rows == "stop":
                    raise ValueError(f"{e} (skip such rows with --bad_rows skip)") from None
                skipped += 1
                continue
            out = held if is_eval or (not cfg.eval_dataset
                                      and held_out(row, cfg.eval_fraction)) else train
            out.append(item)
    if not train:
        raise ValueError(f"--dataset {cfg.dataset}: no training examples left (all held out "
                         f"or skipped); lower --eval_fraction or fix the rows")
    return train, held, skipped


def truncate(trajs: Sequence[Any], max_len: int) -> int:
    """Cut sequences to `max_len` tokens (turns past the cut are dropped); returns how many."""
    from agentrl.types import Turn

    cut = 0
    for t in trajs:
        if len(t.token_ids) <= max_len:
            continue
        cut += 1
        t.token_ids, t.loss_mask = t.token_ids[:max_len], t.loss_mask[:max_len]
        t.logprobs = t.logprobs[:max_len]
        t.turns = [Turn(obs_start=x.obs_start, start=x.start, end=min(x.end, max_len),
                        reward=x.reward, policy_version=x.policy_version,
                        finish_reason="length" if x.end > max_len else x.finish_reason,
                        version_changes=[c for c in x.version_changes
                                         if x.start + c[0] < max_len])
                   for x in t.turns if x.start < max_len]
        t.images = [im for im in t.images if im.end <= max_len]
    return cut
