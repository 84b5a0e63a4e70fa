"""agentrl's CPU kernels (float32): decode steps of a few rows, and when they are used; the
trainer's fused norm, gating and log-prob/entropy.

A decode step feeds one token per row. At a handful of rows it is bound by reading the weights
from memory, and the BLAS GEMM behind `F.linear` packs panels of the weight matrix on every
call, losing half the bandwidth to it: on the development VM (2 vCPU, AVX-512) SmolLM2-135M's
211 weight matrices take about twice as long at 8 rows as at 1. Around the GEMMs, a Llama layer
is ~45 small tensor operations whose Python and dispatch costs exceed their arithmetic.
`csrc/cpu_decode.cpp` has

- `row_gemm`: reads each weight row once (prefetching ahead) and multiplies it into all rows;
- `decode_layer`: a whole decoder layer in one call (norms, projections through `row_gemm`,
  rotary embedding, the KV-cache write, attention, gating, residuals). Past `MAX_ROWS` rows
  the same layer runs with ATen's GEMMs (the "wide" family): what it saves there is the
  forward's attention, which copies the KV cache once per layer to repeat its heads.

`csrc/cpu_train.cpp`, in the same module, has the trainer's fused RMSNorm, SiLU gating and
token log-prob/entropy over the vocabulary (forward and backward); `fused.py` uses them.

Numbers: benchmarks/results/cpu_decode.md (`benchmarks/cpu_decode.py`).

The module is compiled on first use with `torch.utils.cpp_extension` (g++ and ninja, ~40 s,
cached under `TORCH_EXTENSIONS_DIR`; the cache key includes the CPU's flags since it is built
with `-march=native`). Without a compiler, everything here falls back to the torch path;
`AGENTRL_CPU_KERNELS=0` in the environment turns the kernels off everywhere (read at each call, so
tests can switch it). Whether a built kernel is used is measured on the CPU at hand
(`calibrate.py`; `AGENTRL_CPU_KERNELS=1` uses every family without measuring). Results equal the
torch path up to float32 round-off (other summation orders), and each row's result does not
depend on the other rows.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MAX_ROWS = 12
"""Most rows the kernels take; beyond this the GEMM's arithmetic catches up with the streaming
(at 16 rows both take about as long for SmolLM2-135M on the development VM)."""

MIN_WEIGHT_NUMEL = 1 << 16
"""Weight matrices of at most this many elements go to BLAS: they stay in cache, where the
call's fixed cost dominates and BLAS is faster (8 rows, development VM: 64 x 64 5.8 vs 7.0 us,
256 x 256 14.8 vs 20.5 us; 192 x 576 30.5 vs 22.8 us)."""

ENV = "AGENTRL_CPU_KERNELS"
"""`0`: no kernel anywhere; `1`: every kernel family, whatever `calibrate` measured; unset: the
families measured faster here."""

_CSRC = Path(__file__).parent / "csrc"
_lock = threading.Lock()
_module = None
_tried = False
build_error: str | None = None
"""Why the kernels could not be built (None if they were, or were not tried)."""


def module() -> Any:
    """The compiled kernels (built on the first call), or None where they cannot be built or
    are turned off (`AGENTRL_CPU_KERNELS=0`)."""
    global _module, _tried
    if os.environ.get(ENV) == "0":  # before the build: turned off, nothing is compiled
        return None
    with _lock:
        if not _tried:
            _tried = True
            _module = _build()
        return _module


def _build() -> Any:
    global build_error
    try:
        return compile_sources(_CSRC)
    # No compiler or ninja (RuntimeError, CalledProcessError), a module that will not load.
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as e:
        build_error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"
        logger.warning(
            "agentrl's CPU kernels could not be built (%s); decoding and training use torch. "
            "Install g++ and ninja (`apt-get install g++ ninja-build`) to get them.",
            build_error,
        )
        return None


def compile_sources(csrc: Path, prefix: str = "agentrl_cpu_kernels") -> Any:
    """Compile the `.cpp` files of `csrc` (with its headers) into one module, cached under a name
    keyed by their contents, the CPU's flags and the torch version, and by where the sources,
    torch and Python's headers are: the build command names those paths, so two checkouts (or
    environments) sharing one build directory would rebuild it for each other at every start.
    Raises where it cannot."""
    import sysconfig

    from torch.utils.cpp_extension import load

    files = sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h"))
    paths = (csrc.resolve(), Path(torch.__file__).parent, sysconfig.get_paths()["include"])
    where = hashlib.sha256("\n".join(map(str, paths)).encode()).hexdigest()[:6]
    from torch.utils.cpp_extension import _get_build_directory

    name = f"{prefix}_{source_key(csrc)}_{where}"
    clear_stale_lock(Path(_get_build_directory(name, verbose=False)))
    logger.info("compiling agentrl's CPU kernels (once per machine, ~40 s)")
    return load(
        name=name,
        sources=[str(p) for p in files if p.suffix == ".cpp"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )


STALE_LOCK_S = 600
"""A build takes about a minute; a build lock older than this was left by a killed build."""


def clear_stale_lock(build_dir: Path) -> bool:
    """Remove torch's build lock if a killed build left it: torch waits on it forever, so every
    later start would hang. True if one was removed."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    logger.warning("removing a build lock left by a killed build %.0f min ago: %s", age / 60, lock)
    lock.unlink(missing_ok=True)
    return True


def source_key(csrc: Path = _CSRC) -> str:
    """A short hash of the kernel sources, the CPU's flags and the torch version: what a build
    (and a measurement of it) depends on."""
    key = hashlib.sha256(cpu_flags().encode() + torch.__version__.encode())
    for path in sorted(p for p in csrc.iterdir() if p.suffix in (".cpp", ".h")):
        key.update(path.name.encode() + path.read_bytes())
    return key.hexdigest()[:12]


def cpu_model() -> str:
    """The CPU's model name (for benchmark records and the calibration log)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def vector_flags() -> str:
    """The CPU's SIMD extensions that matter for the kernels (avx2, avx512*, amx*, fma)."""
    flags = cpu_flags().split()
    keep = ("avx", "fma", "amx", "sve", "neon", "asimd")
    return " ".join(sorted({f for f in flags if f.startswith(keep)}))


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def applies(rows: int, weight: torch.Tensor) -> bool:
    """Whether the row GEMM takes a product of `rows` rows with `weight` (float32 inputs)."""
    return (
        rows <= MAX_ROWS
        and weight.dtype is torch.float32
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and weight.numel() > MIN_WEIGHT_NUMEL
    )


def covers(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` goes to the row GEMM (once it is built)."""
    return (
        x.dim() == 2
        and x.dtype is torch.float32
        and x.device.type == "cpu"
        and applies(x.shape[0], weight)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the row GEMM where it covers the call."""
    if covers(x, weight):
        mod = module()
        if mod is not None:
            out = mod.row_gemm(x, weight)
            return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)
