"""A weight-streaming linear layer for decode steps of a few rows (float32, CPU).

A decode step multiplies every weight matrix by a handful of rows (one token per sample), so it
is bound by reading the weights from memory. The BLAS GEMM behind `F.linear` packs panels of
the weight matrix on every call and at these shapes loses half the memory bandwidth to it: on
the development VM (2 vCPU, AVX-512), SmolLM2-135M's 211 weight matrices take about twice as
long at 8 rows as at 1. `csrc/row_gemm.cpp` reads each weight row once, prefetching ahead, and
multiplies it into all rows (numbers: benchmarks/results/row_gemm.md).

The kernel is compiled on first use with `torch.utils.cpp_extension` (g++ and ninja, ~25 s,
cached under `TORCH_EXTENSIONS_DIR`; the cache key includes the CPU's flags since it is built
with `-march=native`). Without a compiler, or for shapes and dtypes it does not cover, `linear`
is `F.linear`; `AGENTRL_ROW_GEMM=0` in the environment turns the kernel off everywhere (the
engine's `row_gemm=False` does it for one engine). Results differ from `F.linear` by float32 round-off only (a different summation
order), and each row's result does not depend on the other rows in the batch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MAX_ROWS = 12
"""Most rows the kernel takes; beyond this the GEMM's arithmetic catches up with the streaming
(at 16 rows both take ~45 ms for SmolLM2-135M on the development VM)."""

MIN_WEIGHT_NUMEL = 1 << 16
"""Weight matrices of at most this many elements go to `F.linear`: they stay in cache, where
the call's fixed cost dominates and BLAS is faster (8 rows, development VM: 64 x 64 5.8 vs 7.0
us, 256 x 256 14.8 vs 20.5 us; 192 x 576 30.5 vs 22.8 us)."""

_SOURCE = Path(__file__).parent / "csrc" / "row_gemm.cpp"
_lock = threading.Lock()
_module = None
_tried = False


def row_gemm_module():
    """The compiled kernel module (built on first call), or None where it cannot be built."""
    global _module, _tried
    with _lock:
        if not _tried:
            _tried = True
            _module = _build() if os.environ.get("AGENTRL_ROW_GEMM", "1") != "0" else None
        return _module


def _build():
    try:
        from torch.utils.cpp_extension import load

        source = _SOURCE.read_bytes()
        key = hashlib.sha256(source + _cpu_flags().encode() + torch.__version__.encode())
        logger.info("compiling agentrl's row GEMM kernel (once per machine, ~25 s)")
        return load(
            name=f"agentrl_row_gemm_{key.hexdigest()[:12]}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    # No compiler or ninja (RuntimeError, CalledProcessError), a module that will not load.
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as e:
        logger.warning(
            "agentrl's row GEMM kernel could not be built (%s: %s); decoding uses F.linear. "
            "Install g++ and ninja (`apt-get install g++ ninja-build`) to get it.",
            type(e).__name__,
            (str(e).strip().splitlines() or [""])[-1],
        )
        return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def applies(rows: int, weight: torch.Tensor) -> bool:
    """Whether the kernel takes a product of `rows` rows with `weight` (float32 inputs)."""
    return (
        rows <= MAX_ROWS
        and weight.dtype is torch.float32
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and weight.numel() > MIN_WEIGHT_NUMEL
    )


def covers(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` goes to the kernel (once it is built)."""
    return (
        x.dim() == 2
        and x.dtype is torch.float32
        and x.device.type == "cpu"
        and applies(x.shape[0], weight)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the row GEMM kernel where it covers the call."""
    if covers(x, weight):
        module = row_gemm_module()
        if module is not None:
            out = module.row_gemm(x, weight)
            return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)
