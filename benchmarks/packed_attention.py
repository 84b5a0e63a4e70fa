"""The update with attention one packed sequence at a time (agentrl.models.packed_attention)
against SDPA over the packed row's whole [L, L] mask (the baseline), in one process.

The work is one RL update of the default math-tir run (`agentrl train --env math-tir`'s
preset: SmolLM2-135M, 16 episodes, micro-batches of 8 packed with their group's prompt shared)
on the episodes of a saved rollouts file. Each round runs the update on both sides, alternating
which goes first, each from the same freshly loaded weights; the sides must compute the same
update (loss and gradient norm printed), and the ratio is of the medians of `time_update` of
each side's second update (the first warms a fresh worker; both run on the same episodes).

    python benchmarks/packed_attention.py                 # samples a step's rollouts first
    python benchmarks/packed_attention.py --rollouts runs/math-tir/rollouts/step_000001.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
from pathlib import Path

import torch
from machine import cpu_description  # benchmarks/machine.py

import trainers.logprobs
from agentrl.trajectory_files import load_jsonl
from trainers.controller import Trainer
from trainers.policy import PolicyWorker
from trainers.presets import math_tir


def sample_rollouts(cfg, out: Path) -> Path:
    """One step of the preset (no eval), its rollouts kept."""
    Trainer(dataclasses.replace(cfg, steps=1, eval_problems=0, run_dir=str(out), use_ray=False,
                                progress=False, tensorboard=False)).run()
    return out / "rollouts" / "step_000001.jsonl"


def update(cfg, trajs: list, segments: bool) -> dict[str, float]:
    keep = trainers.logprobs._segments
    if not segments:
        trainers.logprobs._segments = lambda module: False  # the [L, L] mask path
    try:
        worker = PolicyWorker(cfg, with_engine=False)
        worker.train(trajs, 0.0)  # a first update warms the worker (threads, allocations)
        return worker.train(trajs, 0.0)
    finally:
        trainers.logprobs._segments = keep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=Path, default=None,
                   help="a rollouts file of a math-tir run (default: sample one step now)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("AGENTRL_THREADS", torch.get_num_threads())))
    print(f"machine: {cpu_description()}, torch threads {torch.get_num_threads()}, load "
          f"{os.getloadavg()[0]:.2f}")
    cfg = math_tir()
    path = args.rollouts or sample_rollouts(cfg, Path(tempfile.mkdtemp(prefix="packed-attn-")))
    trajs = [t for t in load_jsonl(path) if not t.discard]
    print(f"{len(trajs)} episodes from {path}, {sum(len(t.token_ids) for t in trajs)} tokens")
    times: dict[str, list[float]] = {"mask": [], "segments": []}
    for r in range(args.rounds):
        order = ("mask", "segments") if r % 2 == 0 else ("segments", "mask")
        got = {}
        for side in order:
            got[side] = update(cfg, trajs, side == "segments")
            times[side].append(got[side]["time_update"])
        print(f"round {r + 1}: " + "  ".join(
            f"{side} {got[side]['time_update']:.2f} s (loss {got[side]['loss']:.6f}, grad norm "
            f"{got[side]['grad_norm']:.5f})" for side in ("mask", "segments")) +
              f"  load {os.getloadavg()[0]:.2f}", flush=True)
    m, s = statistics.median(times["mask"]), statistics.median(times["segments"])
    print(f"\nupdate, median of {args.rounds}: mask {m:.2f} s, segments {s:.2f} s: "
          f"{m / s:.2f}x faster ({s / m:.2f}x the time)")


if __name__ == "__main__":
    main()
