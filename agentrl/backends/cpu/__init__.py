"""agentrl's opt-in CPU speed-ups, in one place: compiled C++ kernels (`kernels.py`, `csrc/`)
for decoding and training, the lean Llama decode step (`decode.py`), fused training kernels
(`fused.py`), gradient shortcuts (`grads.py`) and host-memory settings (`host_memory.py`).

They are chosen once, at start-up, by `agentrl.backends` (the `cpu` training backend, and the
engine options for a CPU device); no other module imports this package. Each compiled kernel
family is used only where it was measured faster on the CPU at hand (`calibrate.py`).
"""

from __future__ import annotations

from typing import Any


def engine_options() -> dict[str, Any]:
    """Keyword arguments for `TransformersEngine` on a CPU: the lean decode step, through the
    compiled kernels where they measured faster here."""
    import functools

    from agentrl.backends.cpu import calibrate
    from agentrl.backends.cpu.decode import decode_logits

    chosen = calibrate.choice()
    return {"decode_step": functools.partial(decode_logits, cpu_kernels=chosen.decode,
                                             wide_kernels=chosen.decode_wide)}
