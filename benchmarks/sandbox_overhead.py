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
import ctypes
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from agentrl.sandbox import ExecResult, Sandbox, SandboxConfig, Session

CODE = "print(6 * 7)"
VARIANTS = ("bare", "one-shot", "session")
PR_SET_CHILD_SUBREAPER = 36


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; fine for a few hundred samples."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def children_cpu_s() -> float:
    """CPU of reaped descendants: unlike wall time, barely moved by other jobs' load."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(call: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, reaped-children CPU seconds) of one call."""
    cpu, start = children_cpu_s(), time.perf_counter()
    call()
    return time.perf_counter() - start, children_cpu_s() - cpu


def calls(sb: Sandbox, session: Session) -> dict[str, Callable[[], None]]:
    def bare() -> None:
        out = subprocess.run([sb.python, "-I", "-u", "-c", CODE], capture_output=True,
                             check=True)
        assert out.stdout == b"42\n"

    def checked(run: Callable[[str], ExecResult]) -> Callable[[], None]:
        def call() -> None:
            result = run(CODE)
            assert result.status == "ok" and result.stdout == "42\n", result
        return call

    return {"bare": bare, "one-shot": checked(sb.run), "session": checked(session.run)}


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


def report(walls: dict[str, list[float]], cpus: dict[str, list[float]], runs: int) -> None:
    print(f"{'variant':<10} {'median ms':>10} {'p90 ms':>8} {'CPU ms':>8}  ({runs} runs each)")
    medians = {}
    for name in VARIANTS:
        medians[name] = statistics.median(walls[name]) * 1e3
        # A warm session's interpreter is reaped only at close: its CPU is not visible here.
        cpu = "n/a" if name == "session" else f"{statistics.median(cpus[name]) * 1e3:.2f}"
        print(f"{name:<10} {medians[name]:>10.2f} {percentile(walls[name], 0.9) * 1e3:>8.2f} "
              f"{cpu:>8}")
    for name in ("one-shot", "session"):
        overhead = medians[name] - medians["bare"]
        verdict = "meets" if overhead <= 30 else "MISSES"
        print(f"overhead of {name} over bare: {overhead:+.2f} ms median ({verdict} <= 30 ms)")
    cpu_overhead = (statistics.median(cpus["one-shot"]) - statistics.median(cpus["bare"])) * 1e3
    print(f"CPU overhead of one-shot over bare: {cpu_overhead:+.2f} ms median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls per variant")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    # bwrap leaves its (dead) init to the process's reaper; as a subreaper we reap it ourselves
    # (the sandbox does so when it can), so its CPU shows up in RUSAGE_CHILDREN.
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    sb = Sandbox(SandboxConfig())
    walls: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpus: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with sb.session() as session:
        variants = calls(sb, session)
        for i in range(args.warmup + args.runs):
            for name in VARIANTS:  # Interleaved: load changes hit all three alike.
                wall, cpu = measure(variants[name])
                if i >= args.warmup:
                    walls[name].append(wall)
                    cpus[name].append(cpu)
    print("\n".join(describe_machine(sb)))
    # Other jobs on a shared 2-core machine inflate every variant; read the numbers with this.
    print(f"load average before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f}")
    print(f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    report(walls, cpus, args.runs)


if __name__ == "__main__":
    main()
