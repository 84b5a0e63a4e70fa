"""What a benchmark record names about the machine: the CPU model and its vector flags."""

from __future__ import annotations

import platform

VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_description() -> str:
    """e.g. 'AMD EPYC (avx2, avx512_bf16, avx512f)'."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                  if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines()
                  if ln.startswith("flags")), [])
    return f"{model} ({', '.join(sorted(f for f in flags if f in VECTOR_FLAGS))})"
