"""How the trainer's process hands host memory back to the OS (glibc; a no-op elsewhere).

A CPU training step allocates ~1.2 GB afresh (gradients, activations saved for the backward,
the vocabulary-sized logits) and frees it again. By default glibc serves allocations above its
mmap threshold (dynamic, at most 32 MiB) with fresh mappings and returns freed heap tops to the
OS, so every step page-faults that memory in again: ~300k minor faults per update for
SmolLM2-135M on the development VM (`resource.getrusage` around `PolicyWorker.train`).
`keep_freed_memory` raises the mmap threshold to its maximum and stops automatic trimming, so
freed memory stays in the heap for the next step's allocations: ~90-170k faults per update,
peak RSS +2% (benchmarks/results/grpo_vs_trl.md).

`trim` still gives the heap back on request: the engine's KV cache, freed before the update,
lives in its worker thread's arena, which the update (in another thread) does not reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's limit on 64-bit
_INT_MAX = 2**31 - 1  # mallopt takes an int: no automatic trim below 2 GiB of free heap top


def keep_freed_memory() -> bool:
    """Keep freed memory (below 32 MiB a block) in the heap instead of unmapping or trimming
    it; says whether the allocator took the settings."""
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


def trim() -> None:
    """Return the free memory of every heap to the OS (`malloc_trim(0)`)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc() -> Any:
    """glibc, looked up once (find_library runs ldconfig), or None where it is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None
