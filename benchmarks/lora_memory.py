"""Peak memory and step time of LoRA against full fine-tuning, on the embedded model.

    python benchmarks/lora_memory.py [--model smollm2-135m-instruct] [--steps 3]

Each configuration runs in its own process (peak RSS is per process): `agentrl sft` steps on
synthetic chats, and RL steps on the digits env (the policy worker in-process, colocated, with a
KL reference: full fine-tuning keeps a reference copy of the model, LoRA switches its adapters
off). Prints one table, ratios against full fine-tuning measured in the same run, with the CPU
model and its vector flags.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from machine import cpu_description  # benchmarks/machine.py


def _sft(model: str, steps: int, lora: int) -> dict:
    import random
    import tempfile
    from pathlib import Path

    from agentrl.models import load_tokenizer
    from trainers.config import ActorConfig
    from trainers.sft import SFTConfig, SFTTrainer, load_sft_data

    tmp = Path(tempfile.mkdtemp())
    rng = random.Random(0)
    words = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "rocket"]
    with (tmp / "chats.jsonl").open("w") as f:
        for _ in range(64):
            w = " ".join(rng.choice(words) for _ in range(40))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Repeat: {w}"},
                                             {"role": "assistant", "content": w}]}) + "\n")
    cfg = SFTConfig(dataset=str(tmp / "chats.jsonl"), eval_fraction=0.0, batch_size=8,
                    micro_batch_size=8, run_dir=str(tmp / "run"), progress=False,
                    tensorboard=False,
                    actor=ActorConfig(model=model, lr=1e-5, lora_rank=lora,
                                      lora_alpha=2 * lora if lora else 16))
    tok = load_tokenizer(model)
    trainer = SFTTrainer(cfg, load_sft_data(cfg, tok), tok)
    PEAK.start()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(trainer.next_items())
        times.append(time.perf_counter() - t0)
    return {"step_s": sorted(times)[len(times) // 2]}


def _rl(model: str, steps: int, lora: int) -> dict:
    from trainers.cli import build_config
    from trainers.policy import PolicyWorker

    argv = ["--env", "digits", "--actor.model", model, "--use_ray", "false",
            "--algo.kl_coef", "0.05", "--rollout.max_new_tokens", "32"]
    if lora:
        argv += ["--actor.lora_rank", str(lora), "--actor.lora_alpha", str(2 * lora)]
    cfg = build_config(argv)
    w = PolicyWorker(cfg)
    PEAK.start()
    times = []
    for step in range(steps):
        trajs = w.collect(list(range(cfg.rollout.prompts_per_step)), step + 1)
        t0 = time.perf_counter()
        w.train(trajs, 0.05)
        times.append(time.perf_counter() - t0)
    return {"step_s": sorted(times)[len(times) // 2]}


class _Peak:
    """The largest RSS of this process seen between `start` and `stop` (sampled every 5 ms),
    against the RSS at `start`: what the training steps add on top of the loaded model."""

    def __init__(self) -> None:
        import os
        import threading

        self._page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.rss())

    def start(self) -> None:
        self.base = self.peak = self.rss()
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return (self.peak - self.base) / 2**30


PEAK = _Peak()


def child(kind: str, model: str, steps: int, lora: int) -> None:
    out = (_sft if kind == "sft" else _rl)(model, steps, lora)
    out["train_gib"] = PEAK.stop()
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "LORA"))
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.model, args.steps, int(args.child[1]))
        return
    rows = []
    for kind in ("sft", "rl"):
        got = {}
        for lora in (0, args.rank):
            done = subprocess.run(
                [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                 "--child", kind, str(lora)], capture_output=True, text=True, check=True)
            got[lora] = json.loads(done.stdout.strip().splitlines()[-1])
        full, lo = got[0], got[args.rank]
        rows.append((kind, full, lo))
    print(f"CPU: {cpu_description()}; model {args.model}; LoRA rank {args.rank} on every "
          f"linear layer; median step time of {args.steps} steps (RL: the update only)")
    print("| | full fine-tuning | LoRA | LoRA / full |")
    print("|---|---|---|---|")
    for kind, full, lo in rows:
        name = "SFT step (8 x ~130 tokens)" if kind == "sft" else "RL step (KL reference)"
        print(f"| {name}: peak RSS of the process | {full['peak_rss_gib']:.2f} GiB | "
              f"{lo['peak_rss_gib']:.2f} GiB | {lo['peak_rss_gib'] / full['peak_rss_gib']:.2f} |")
        print(f"| {name}: memory the steps add (peak during them - RSS before) | "
              f"{full['train_gib']:.2f} GiB | {lo['train_gib']:.2f} GiB | "
              f"{lo['train_gib'] / full['train_gib']:.2f} |")
        print(f"| {name}: step time | {full['step_s']:.2f} s | {lo['step_s']:.2f} s | "
              f"{lo['step_s'] / full['step_s']:.2f} |")


if __name__ == "__main__":
    main()
