"""GRPO step time and peak memory: agentrl vs TRL's GRPOTrainer, same work, same machine.

The work (from the issue): SmolLM2-135M-Instruct (the embedded model, fp32, CPU), 8 chat
prompts, 2 prompts per step x 4 generations, at most 32 new tokens, lr 1e-6, beta 0,
temperature 1, reward -|20 - len(completion)| / 20. Each side runs with its own defaults
otherwise: TRL's GRPOConfig turns gradient checkpointing on, agentrl leaves it off (its peak
memory must still be no higher than TRL's; `--agentrl-gc` turns it on for agentrl too). Each
side runs in its own subprocess so peak RSS is its own. Per-step time is the median over steps
after the first (warm-up); with --rounds N the two sides alternate N times and the speedup is the
median of the rounds' ratios (this VM's speed drifts between minutes).

    .venv/bin/pip install -e ".[bench]"     # TRL 1.16 (not part of the default set-up)
    .venv/bin/python benchmarks/grpo_vs_trl.py --steps 8 --rounds 3
    .venv/bin/python benchmarks/grpo_vs_trl.py --no-trl-gc          # matched: no checkpointing
    python3 benchmarks/grpo_vs_trl.py --device cuda --bf16          # one GPU (gpu_check.sh)

On a GPU the memory ratio compares peak CUDA memory (torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from machine import run_child  # benchmarks/machine.py
from workloads import QUESTIONS, trl_step_timer  # benchmarks/workloads.py

PROMPTS = QUESTIONS[:8]


def length_reward(text: str) -> float:
    return -abs(20 - len(text)) / 20


def run_agentrl(steps: int, use_ray: bool, gc: bool, bf16: bool, device: str) -> dict:
    import agentrl
    from trainers.config import ActorConfig, AlgoConfig, RolloutConfig, TrainConfig
    from trainers.controller import Trainer

    agentrl.register(
        "bench/LengthReward-v0",
        agentrl.RewardEnv,
        dataset=[{"prompt": p} for p in PROMPTS],
        reward_fn=lambda prompt, response, label: length_reward(response),
    )
    # The run directory (checkpoint, HF export: ~2 GB) only serves this measurement.
    run_dir = tempfile.mkdtemp(prefix="agentrl-bench-")
    cfg = TrainConfig(
        env="bench/LengthReward-v0",
        actor=ActorConfig(
            model="smollm2-135m-instruct",
            lr=1e-6,
            device=device,
            gradient_checkpointing=gc,
            mixed_precision="bf16" if bf16 else "no",
        ),
        algo=AlgoConfig(estimator="group_norm", kl_coef=0.0),
        rollout=RolloutConfig(
            n_samples_per_prompt=4, prompts_per_step=2, max_new_tokens=32, temperature=1.0
        ),
        steps=steps,
        micro_batch_size=8,
        use_ray=use_ray,
        run_dir=run_dir,
        progress=False,
        tensorboard=False,
        seed=42,
    )
    t0 = time.perf_counter()
    try:
        Trainer(cfg).run()
        total = time.perf_counter() - t0
        with open(f"{run_dir}/metrics.jsonl") as f:
            rows = [json.loads(x) for x in f]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "step_times": [r["time_step"] for r in rows],
        "phases": {k: [r[f"time_{k}"] for r in rows] for k in ("rollout", "update")},
        "total_s": total,
    }


def run_trl(steps: int, bf16: bool, device: str, gc: bool) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from agentrl.models.embedded import embedded_dir, make_trainable

    path = str(embedded_dir())
    out_dir = tempfile.mkdtemp(prefix="trl-bench-")  # save_strategy="no": stays small
    model = AutoModelForCausalLM.from_pretrained(path)
    make_trainable(model)
    tok = AutoTokenizer.from_pretrained(path)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])

    def reward(completions, **_):
        return [length_reward(c[0]["content"]) for c in completions]

    times: list[float] = []

    cfg = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        num_generations=4,
        max_completion_length=32,
        max_steps=steps,
        learning_rate=1e-6,
        beta=0.0,
        temperature=1.0,
        seed=42,
        use_vllm=False,
        bf16=bf16,
        fp16=False,
        use_cpu=device == "cpu",
        gradient_checkpointing=gc,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[trl_step_timer(times)],
    )
    gen = _time_trl_generation(trainer, times)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    # Generation happens inside the optimizer step that consumes it: the rest is the update.
    gen_s = gen["seconds"][: len(times)]
    return {
        "step_times": times,
        "phases": {
            "generate": gen_s,
            "update": [t - g for t, g in zip(times, gen_s, strict=False)],
        },
        "generate_tok_s": [n / s for n, s in zip(gen["tokens"], gen["seconds"], strict=False)],
        "total_s": time.perf_counter() - t0,
    }


def _time_trl_generation(trainer: Any, times: list[float]) -> dict[str, list]:
    """Wrap GRPOTrainer._generate (TRL 1.16: prompts in, completion ids among what it returns)
    to record the seconds and completion tokens of each optimizer step's generation."""
    out: dict[str, list] = {"seconds": [], "tokens": []}
    inner = trainer._generate

    def timed(prompts: list) -> Any:
        t0 = time.perf_counter()
        res = inner(prompts)
        if len(out["seconds"]) > len(times):  # a second generation within one step: sum them
            out["seconds"][-1] += time.perf_counter() - t0
        else:
            out["seconds"].append(time.perf_counter() - t0)
            out["tokens"].append(0)
        completion_ids = res[1]
        out["tokens"][-1] += sum(len(c) for c in completion_ids)
        return res

    trainer._generate = timed
    return out


def _steal_ticks() -> int | None:
    """CPU time the hypervisor gave to other guests (all CPUs, clock ticks), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8])  # cpu user nice system idle iowait irq softirq steal
    except (OSError, IndexError, ValueError):
        return None


def _child(opts: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 2)
    steal0, t0 = _steal_ticks(), time.perf_counter()
    if opts.child == "trl":
        out = run_trl(opts.steps, opts.bf16, opts.device, not opts.no_trl_gc)
    else:
        out = run_agentrl(opts.steps, opts.ray, opts.agentrl_gc, opts.bf16, opts.device)
    if opts.device.startswith("cuda"):
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    steal1, wall = _steal_ticks(), time.perf_counter() - t0
    if steal0 is not None and steal1 is not None:
        # Share of this child's CPU time (all CPUs x wall time) that ran other guests instead.
        ticks = os.sysconf("SC_CLK_TCK") * wall * (os.cpu_count() or 1)
        out["steal"] = (steal1 - steal0) / ticks
    # ru_maxrss covers this process; Ray workers are separate processes (use_ray=False here).
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1, help="alternate TRL and agentrl this often")
    p.add_argument("--child", choices=["agentrl", "trl"])
    p.add_argument(
        "--ray", action="store_true", help="agentrl with Ray actors (RSS not comparable)"
    )
    p.add_argument(
        "--agentrl-gc",
        action="store_true",
        help="gradient checkpointing on the agentrl side too (TRL's GRPOConfig has it on by "
        "default; agentrl's default is off, memory permitting)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="both sides in bf16 mixed precision (TRL: bf16=True, its GRPOConfig default; "
        "agentrl: --actor.mixed_precision bf16) instead of the issue's fp32",
    )
    p.add_argument(
        "--no-trl-gc",
        action="store_true",
        help="turn TRL's gradient checkpointing off (its GRPOConfig default is on): with "
        "--agentrl-gc left off, both sides then run without it",
    )
    p.add_argument(
        "--device", default="cpu",
        help="cpu, or cuda for both sides on one GPU (TRL: use_cpu=False)",
    )
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    # The VM's speed drifts by tens of percent between minutes: alternate the two sides and
    # compare each round's pair, rather than one long run of each.
    rounds: list[dict[str, dict]] = []
    for k in range(args.rounds):
        rounds.append({})
        for name in ("trl", "agentrl"):
            try:
                rounds[-1][name] = run_child(__file__, sys.argv[1:], name)
            except RuntimeError:
                # Keep what the other side measured: it cost as much to get.
                for done, r in rounds[-1].items():
                    print(f"round {k + 1} {done} (before the failure): " + json.dumps(r))
                raise
    precision = "bf16 mixed" if args.bf16 else "fp32"
    from agentrl.backends.cpu import calibrate, kernels

    print(
        f"steps={args.steps} (median over steps 2..{args.steps}), rounds={args.rounds}, "
        f"cpus={os.cpu_count()}, device {args.device}, {precision}, gradient checkpointing: "
        f"agentrl {'on' if args.agentrl_gc else 'off'}, TRL {'off' if args.no_trl_gc else 'on'}"
        f"\nCPU: {kernels.cpu_model()} [{kernels.vector_flags()}]"
        + (f"; agentrl's CPU kernels in use: {calibrate.choice()}" if args.device == "cpu" else "")
    )
    speedups, mem_ratios = [], []
    for k, res in enumerate(rounds):
        med = {}
        for name, r in res.items():
            med[name] = statistics.median(r["step_times"][1:] or r["step_times"])
            steps_s = ", ".join(f"{t:.2f}" for t in r["step_times"])
            steal = f"  CPU stolen by the host {r['steal']:.0%}" if "steal" in r else ""
            print(
                f"round {k + 1} {name:8s} median {med[name]:6.2f} s/step  peak RSS "
                f"{r['peak_rss_mb']:7.0f} MB  steps [{steps_s}]{steal}"
            )
            for phase, times in r.get("phases", {}).items():
                print(f"{'':17s}{phase:8s} median {statistics.median(times[1:] or times):.2f} s")
            if r.get("generate_tok_s"):
                rates = r["generate_tok_s"]
                print(f"{'':17s}generate median {statistics.median(rates[1:] or rates):.0f} tok/s")
            if "peak_cuda_mb" in r:
                print(f"{'':17s}peak CUDA memory {r['peak_cuda_mb']:.0f} MB")
        speedups.append(med["trl"] / med["agentrl"])
        mem = "peak_cuda_mb" if args.device.startswith("cuda") else "peak_rss_mb"
        mem_ratios.append(res["agentrl"][mem] / res["trl"][mem])
        print(f"round {k + 1} speedup {speedups[-1]:.2f}x, memory ratio {mem_ratios[-1]:.2f}")
    print(
        f"speedup agentrl vs TRL: {statistics.median(speedups):.2f}x per step (median of "
        f"rounds: {', '.join(f'{x:.2f}' for x in speedups)}); memory ratio agentrl/TRL: "
        f"{max(mem_ratios):.2f} (worst round)"
    )


if __name__ == "__main__":
    main()
