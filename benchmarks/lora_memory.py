"""Peak memory and step time of LoRA and QLoRA against full fine-tuning, on the embedded model.

    python benchmarks/lora_memory.py [--model smollm2-135m-instruct] [--steps 3]

Each configuration runs in its own process (peak RSS is per process): `agentrl sft` steps on
synthetic chats, and RL steps on the digits env (the policy worker in-process, colocated, with a
KL reference: full fine-tuning keeps a reference copy of the model, LoRA switches its adapters
off). QLoRA is LoRA on the base loaded in 4 bits (NF4, bitsandbytes). Prints one table, ratios
against full fine-tuning measured in the same run, with the CPU model and its vector flags.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from machine import cpu_description  # benchmarks/machine.py


def _sft(model: str, steps: int, lora: int, four_bit: bool) -> dict:
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
                                      lora_alpha=2 * lora if lora else 16,
                                      load_in_4bit=four_bit))
    tok = load_tokenizer(model)
    trainer = SFTTrainer(cfg, load_sft_data(cfg, tok), tok)
    PEAK.start()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(trainer.next_items())
        times.append(time.perf_counter() - t0)
    return {"step_s": sorted(times)[len(times) // 2], "tensors_gib": _tensors(trainer.model)}


def _tensors(*models: object) -> float:
    """GiB of the models' state (weights, buffers, bitsandbytes' packing state), each storage
    counted once (tied weights, a colocated engine's shared model)."""
    seen: dict[int, int] = {}
    for model in models:
        for t in model.state_dict().values():  # type: ignore[attr-defined]
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values()) / 2**30


def _rl(model: str, steps: int, lora: int, four_bit: bool) -> dict:
    from trainers.cli import build_config
    from trainers.policy import PolicyWorker

    argv = ["--env", "digits", "--actor.model", model, "--actor.lr", "1e-5", "--use_ray", "false",
            "--algo.kl_coef", "0.05", "--rollout.max_new_tokens", "32"]
    if lora:
        argv += ["--actor.lora_rank", str(lora), "--actor.lora_alpha", str(2 * lora)]
    if four_bit:
        argv += ["--actor.load_in_4bit", "true"]
    cfg = build_config(argv)
    w = PolicyWorker(cfg)
    PEAK.start()
    times = []
    for step in range(steps):
        trajs = w.collect(list(range(cfg.rollout.prompts_per_step)), step + 1)
        t0 = time.perf_counter()
        w.train(trajs, 0.05)
        times.append(time.perf_counter() - t0)
    held = [w.model] if w.ref is None else [w.model, w.ref.module]  # full: a reference copy
    return {"step_s": sorted(times)[len(times) // 2], "tensors_gib": _tensors(*held)}


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


def child(kind: str, model: str, steps: int, lora: int, four_bit: bool) -> None:
    out = (_sft if kind == "sft" else _rl)(model, steps, lora, four_bit)
    out["train_gib"] = PEAK.stop()
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--child", nargs=3, metavar=("KIND", "LORA", "FOUR_BIT"))
    args = ap.parse_args()
    if args.child:
        kind, lora, four_bit = args.child
        child(kind, args.model, args.steps, int(lora), four_bit == "1")
        return
    setups = {"full fine-tuning": (0, 0), "LoRA": (args.rank, 0), "QLoRA": (args.rank, 1)}
    rows = []
    for kind in ("sft", "rl"):
        got = {}
        for name, (lora, four_bit) in setups.items():
            done = subprocess.run(
                [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                 "--child", kind, str(lora), str(four_bit)], capture_output=True, text=True,
                check=True)
            got[name] = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append((kind, got))
    print(f"CPU: {cpu_description()}; model {args.model}; (Q)LoRA rank {args.rank} on every "
          f"linear layer; median step time of {args.steps} steps (RL: the update only)")
    print("| | full fine-tuning | LoRA | QLoRA | LoRA / full | QLoRA / full |")
    print("|---|---|---|---|---|---|")
    measures = {"the model's tensors (with RL's reference copy)": ("tensors_gib", "GiB"),
                "peak RSS of the process": ("peak_rss_gib", "GiB"),
                "memory the steps add (peak during them - RSS before)": ("train_gib", "GiB"),
                "step time": ("step_s", "s")}
    for kind, got in rows:
        name = "SFT step (8 x ~130 tokens)" if kind == "sft" else "RL step (KL reference)"
        for what, (key, unit) in measures.items():
            full, lo, q = (got[s][key] for s in setups)
            print(f"| {name}: {what} | {full:.2f} {unit} | {lo:.2f} {unit} | {q:.2f} {unit} | "
                  f"{lo / full:.2f} | {q / full:.2f} |")


if __name__ == "__main__":
    main()
