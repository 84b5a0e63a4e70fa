"""Per-call cost of the sandbox over a bare interpreter (target: median overhead <= 30 ms).

Measures, interleaved so machine noise hits all three alike, the wall time of:
  (a) bare: `python3 -I -u -c CODE` as a plain subprocess (no isolation at all),
  (b) one-shot: `Sandbox.run(CODE)` (fresh interpreter under every available layer),
  (c) session: `Session.run(CODE)` on a warm session (what math-tir's tool calls pay).
Same interpreter and the same tiny program everywhere, so the difference is the sandbox.

    .venv/bin/python benchmarks/sandbox_overhead.py --runs 200
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from agentrl.sandbox import ExecResult, Sandbox, SandboxConfig

CODE = "print(6 * 7)"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; fine for a few hundred samples."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bare(python: str) -> float:
    start = time.perf_counter()
    out = subprocess.run([python, "-I", "-u", "-c", CODE], capture_output=True, check=True)
    assert out.stdout == b"42\n"
    return time.perf_counter() - start


def timed(run: Callable[[str], ExecResult]) -> float:
    start = time.perf_counter()
    result = run(CODE)
    assert result.status == "ok" and result.stdout == "42\n", result
    return time.perf_counter() - start


def describe_machine(sb: Sandbox) -> list[str]:
    bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True,
                           check=False).stdout.strip()
    layers = ", ".join(name for name, on in sb.layers.items() if on)
    inactive = ", ".join(name for name, on in sb.layers.items() if not on) or "none"
    return [
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}",
        (f"python (host): {platform.python_version()}; sandbox interpreter: "
         f"{sb.python}; {bwrap or 'bubblewrap missing'}"),
        f"active layers: {layers}; inactive: {inactive}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls per variant")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    sb = Sandbox(SandboxConfig())
    times: dict[str, list[float]] = {"bare": [], "one-shot": [], "session": []}
    with sb.session() as session:
        for i in range(args.warmup + args.runs):
            sample = {"bare": bare(sb.python), "one-shot": timed(sb.run),
                      "session": timed(session.run)}
            if i >= args.warmup:
                for name, value in sample.items():
                    times[name].append(value)
    print("\n".join(describe_machine(sb)))
    # Other jobs on a shared 2-core machine inflate every variant; read the numbers with this.
    print(f"load average before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f}")
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    print(f"{'variant':<10} {'median ms':>10} {'p90 ms':>8}  ({args.runs} runs each)")
    medians = {}
    for name, values in times.items():
        medians[name] = statistics.median(values) * 1e3
        print(f"{name:<10} {medians[name]:>10.2f} {percentile(values, 0.9) * 1e3:>8.2f}")
    for name in ("one-shot", "session"):
        overhead = medians[name] - medians["bare"]
        verdict = "meets" if overhead <= 30 else "MISSES"
        print(f"overhead of {name} over bare: {overhead:+.2f} ms median ({verdict} <= 30 ms)")


if __name__ == "__main__":
    main()
