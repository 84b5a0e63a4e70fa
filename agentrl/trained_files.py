"""The trainer's side of a step's rollouts: `RUN_DIR/trained/step_NNNNNN.jsonl` (#35 item 2).

A run's rollouts (`rollouts/step_NNNNNN.jsonl`) are written as sampled, before the step trains,
and never rewritten. What the update computed for each trajectory it trained on goes to a file
of its own, one line a trajectory, in the order of the rollouts file:

    {"line": 3, "uid": "9f0c...", "num_tokens": 412,
     "trainer_logprobs": [-0.71, ...], "advantages": [1.12, ...]}

- `line`: the trajectory's line in the rollouts file (1-based); `uid` (`Trajectory.uid`) and
  `num_tokens` (its `token_ids`) check the join.
- `trainer_logprobs`: the trainer's log-prob of each trained token under the policy before the
  update: the "old" log-probs of the PPO ratio (with a single pass over the batch, that pass's
  own, taken before its one optimizer step). A trained token is one the policy sampled that
  the loss sees: `loss_mask[i] == 1` for i >= 1 (`trained_tokens`), in order.
- `advantages`: the advantage the loss used for each of those tokens.

Sampler minus trainer log-prob is the per-token mismatch whose token mean the step logs as
`mismatch` (with one pass over the batch). Only trajectories the step trained on have a line:
not the discarded ones, nor the groups dynamic filtering dropped; a skipped step has no file.
The folder is not rollouts/, so that a reader of a folder of trajectory files
(`agentrl sft --trajectories RUN_DIR/rollouts`) never meets it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.files import write_atomically
from agentrl.types import Trajectory

TRAINED_DIR = "trained"


@dataclass(frozen=True)
class Trained:
    """What the update computed for one trajectory (the values of its `trained_tokens`)."""

    uid: str
    num_tokens: int
    logprobs: list[float]
    advantages: list[float]


def trained_file_of(rollouts_file: str | Path) -> Path:
    """`RUN_DIR/trained/step_N.jsonl` for `RUN_DIR/rollouts/step_N.jsonl`."""
    path = Path(rollouts_file)
    return path.parent.parent / TRAINED_DIR / path.name


def trained_tokens(loss_mask: Sequence[int | bool]) -> list[int]:
    """The positions of the tokens a trajectory is trained on: sampled by the policy, and not
    the first token (no logit predicts it)."""
    return [i for i in range(1, len(loss_mask)) if loss_mask[i]]


def save_trained(
    path: str | Path, sampled: Sequence[Trajectory], trained: Iterable[Trained]
) -> int:
    """Write `trained` (atomically) as the trainer's file of the rollouts file that holds
    `sampled`, in its order, each line naming its trajectory's line there; returns the lines
    written. A record whose trajectory is not among `sampled`, or whose token counts differ
    from it, is a bug in the caller: RuntimeError."""
    lines: dict[str, list[int]] = {}
    for n, traj in enumerate(sampled, 1):
        lines.setdefault(traj.uid, []).append(n)
    rows = []
    for rec in trained:
        if not lines.get(rec.uid):
            raise RuntimeError(f"trained trajectory {rec.uid} is not in the step's rollouts")
        line = lines[rec.uid].pop(0)
        traj = sampled[line - 1]
        want = len(trained_tokens(traj.loss_mask))
        if (rec.num_tokens, len(rec.logprobs), len(rec.advantages)) != (
                len(traj.token_ids), want, want):
            raise RuntimeError(
                f"trained trajectory {rec.uid}: {rec.num_tokens} tokens, {len(rec.logprobs)} "
                f"log-probs and {len(rec.advantages)} advantages, but its rollout has "
                f"{len(traj.token_ids)} tokens and {want} trained ones")
        rows.append((line, rec))
    rows.sort(key=lambda r: r[0])
    write_atomically(path, "".join(
        json.dumps({"line": line, "uid": rec.uid, "num_tokens": rec.num_tokens,
                    "trainer_logprobs": rec.logprobs, "advantages": rec.advantages}) + "\n"
        for line, rec in rows))
    return len(rows)


def aligned(trained: Any, rollout: dict[str, Any]) -> tuple[list[float | None], list[float | None]]:
    """A trained file's line (parsed JSON) as (trainer log-probs, advantages) aligned with the
    rollout record's `token_ids` (None where a token was not trained). TypeError or
    ValueError, saying what, for a line that is not one, or not this record's."""
    if not isinstance(trained, dict):
        raise TypeError("not a trained record (a JSON object)")
    ids, mask = rollout.get("token_ids") or [], rollout.get("loss_mask") or []
    theirs = (trained.get("uid"), trained.get("num_tokens"))
    if theirs != (rollout.get("uid"), len(ids)):
        raise ValueError(f"its uid/num_tokens {theirs} are not the rollout's "
                         f"{(rollout.get('uid'), len(ids))}")
    positions = trained_tokens(mask)
    out: list[list[float | None]] = []
    for key in ("trainer_logprobs", "advantages"):
        values = trained.get(key)
        if not isinstance(values, list) or len(values) != len(positions):
            raise ValueError(f"{key}: {len(positions)} values expected (one per trained token)")
        full: list[float | None] = [None] * len(ids)
        for i, v in zip(positions, values, strict=True):
            if not isinstance(v, int | float) or isinstance(v, bool):
                raise TypeError(f"{key}: {v!r} is not a number")
            full[i] = float(v) if math.isfinite(v) else None
        out.append(full)
    return out[0], out[1]
