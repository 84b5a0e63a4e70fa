"""What the benchmark scripts share: the machine a record names (the CPU model and its vector
flags), and running one side of a comparison in a child process of its own (so its peak RSS
is its own)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

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


def run_child(script: str, argv: list[str], which: str) -> dict:
    """Run `script argv --child which` and return the JSON of its `RESULT {...}` line."""
    proc = subprocess.run([sys.executable, script, *argv, "--child", which], check=False,
                          capture_output=True, text=True)  # a failure is raised with stderr
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{which} failed:\n{proc.stderr[-3000:]}")
