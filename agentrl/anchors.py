"""GiGPO's anchor states: which environment state each turn of a trajectory acted from.

GiGPO (`agentrl.algorithms.gigpo`) compares the steps that episodes of one group took from the
same state. A turn's state is named, in order of preference, by

1. the env: `info["state_key"]` (any value, compared as its `str`) returned by the `reset` or
   `step` before the turn, recorded as `Turn.state_key`. An env whose observations are not
   its state (higher/lower hints, tool outputs) or that has a natural state (a grid cell, a
   page URL) should give one;
2. otherwise the observation the env returned before the turn: its tokens
   (`token_ids[obs_start:start]`) and the content of the images placed among them.

Ids are 63-bit hashes (never 0, which the tensors use for "no step"), equal in every process.
Only stdlib is imported here.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Sequence

from agentrl.types import Trajectory, Turn

_ID_MASK = (1 << 63) - 1


def _hash(kind: bytes, payload: bytes) -> int:
    digest = hashlib.blake2b(kind + b"\0" + payload, digest_size=8).digest()
    return (int.from_bytes(digest, "little") & _ID_MASK) or 1


def turn_state_id(traj: Trajectory, turn: Turn) -> int:
    """The id of the state `turn` of `traj` acted from (module docstring); never 0."""
    if turn.state_key is not None:
        return _hash(b"key", turn.state_key.encode())
    tokens = array("q", traj.token_ids[turn.obs_start : turn.start])  # 8 bytes a token
    payload = len(tokens).to_bytes(8, "little") + tokens.tobytes()
    for image in traj.images:
        if turn.obs_start <= image.start < turn.start:
            payload += b"|" + image.sha256.encode()
    return _hash(b"obs", payload)


def state_ids(traj: Trajectory) -> list[int]:
    """`turn_state_id` of each turn of `traj`, in order."""
    return [turn_state_id(traj, t) for t in traj.turns]


def state_visits(trajs: Sequence[Trajectory], group_ids: Sequence[int]
                 ) -> Counter[tuple[int, int]]:
    """How many steps past each episode's first acted from each `(group, state id)`. The
    segments of one episode count as the episode (only its first segment's first turn is its
    first step)."""
    counts: Counter[tuple[int, int]] = Counter()
    for traj, group in zip(trajs, group_ids, strict=True):
        first_segment = int(traj.info.get("segment", 0)) == 0
        ids = state_ids(traj)
        counts.update((group, s) for s in (ids[1:] if first_segment else ids))
    return counts


def recurring_states(trajs: Sequence[Trajectory], group_ids: Sequence[int]) -> int:
    """How many anchor states (a group's state, past each episode's first turn, that two or
    more of its steps acted from) the batch has: GiGPO's step level is GRPO's where it is 0."""
    return sum(n >= 2 for n in state_visits(trajs, group_ids).values())


def names_states(trajs: Sequence[Trajectory]) -> bool:
    """Whether any turn carries a state key from its env."""
    return any(t.state_key is not None for traj in trajs for t in traj.turns)
