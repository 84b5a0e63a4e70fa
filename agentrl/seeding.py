"""The one seed derivation: every seed agentrl makes from another (a run's seed -> a step's
sampling seed -> an episode's and a turn's; a run's seed -> a task's problem stream) comes from
`derive_seed`, so the same inputs give the same seed in every process and on every machine."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: int | str) -> int:
    """A 31-bit seed from `parts` (ints and strings, in order), stable across processes
    (BLAKE2b of their repr: Python's `hash` salts strings per process)."""
    if not parts or not all(isinstance(p, int | str) and not isinstance(p, bool) for p in parts):
        raise TypeError(f"derive_seed takes ints and strings, got {parts!r}")
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
