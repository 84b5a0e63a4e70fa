"""SFT step time and peak memory: `agentrl sft` vs TRL's SFTTrainer, same data, same machine.

The work: SmolLM2-135M-Instruct (the embedded model, fp32, CPU), 96 single-turn chats of ~120
tokens (a user message, an assistant reply), 8 conversations per optimizer step in one
micro-batch, lr 1e-5, loss on the assistant reply only (TRL: prompt-completion rows, its
completion-only loss). Each side otherwise runs with its own defaults (agentrl packs the
micro-batch into one padding-free sequence; TRL pads, and turns gradient checkpointing on), and
in its own subprocess, so peak RSS is its own. Per-step time is the median over the steps
after the first (warm-up); the two sides alternate `--rounds` times and the speed-up is the
median of the rounds' ratios (this VM's speed drifts between minutes).

    .venv/bin/pip install -e ".[bench]"     # TRL 1.16 (not part of the default set-up)
    .venv/bin/python benchmarks/sft_vs_trl.py --steps 6 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import tempfile
import time

from machine import cpu_description, run_child  # benchmarks/machine.py
from workloads import trl_step_timer  # benchmarks/workloads.py

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "rocket", "garden",
         "window", "yellow", "silver", "planet", "coffee", "bridge", "mountain"]


def conversations(n: int = 96) -> list[tuple[str, str]]:
    rng = random.Random(0)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(40, 60))]
        out.append((f"Repeat these words: {' '.join(words[:20])}", " ".join(words)))
    return out


def run_agentrl(steps: int) -> dict:
    from agentrl.models import load_tokenizer
    from trainers.config import ActorConfig
    from trainers.sft import SFTConfig, SFTTrainer, load_sft_data

    tmp = tempfile.mkdtemp(prefix="agentrl-sft-bench-")
    path = os.path.join(tmp, "chats.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"messages": [{"role": "user", "content": user},
                                              {"role": "assistant", "content": reply}]}) + "\n"
                     for user, reply in conversations())
    cfg = SFTConfig(dataset=path, eval_fraction=0.0, batch_size=8, micro_batch_size=8,
                    run_dir=os.path.join(tmp, "run"), progress=False, tensorboard=False,
                    actor=ActorConfig(lr=1e-5))
    tok = load_tokenizer(cfg.actor.model)
    trainer = SFTTrainer(cfg, load_sft_data(cfg, tok), tok)
    times, tokens = [], []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            m = trainer.train_step(trainer.next_items())
            times.append(time.perf_counter() - t0)
            tokens.append(m["tokens"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"step_times": times, "loss_tokens": tokens}


def run_trl(steps: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from agentrl.models.embedded import embedded_dir, make_trainable

    path = str(embedded_dir())
    out_dir = tempfile.mkdtemp(prefix="trl-sft-bench-")
    model = AutoModelForCausalLM.from_pretrained(path)
    make_trainable(model)
    tok = AutoTokenizer.from_pretrained(path)
    data = Dataset.from_list([
        {"prompt": [{"role": "user", "content": user}],
         "completion": [{"role": "assistant", "content": reply}]}
        for user, reply in conversations()])
    times: list[float] = []

    cfg = SFTConfig(output_dir=out_dir, per_device_train_batch_size=8,
                    gradient_accumulation_steps=1, max_steps=steps, learning_rate=1e-5,
                    use_cpu=True, bf16=False, fp16=False, logging_steps=1, report_to="none",
                    save_strategy="no", seed=0, completion_only_loss=True)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=data, processing_class=tok,
                         callbacks=[trl_step_timer(times)])
    try:
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {"step_times": times,
            "gradient_checkpointing": bool(cfg.gradient_checkpointing),
            "packing": bool(cfg.packing)}


def _child(which: str, steps: int) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 2)
    out = run_trl(steps) if which == "trl" else run_agentrl(steps)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", choices=("agentrl", "trl"))
    opts = p.parse_args()
    if opts.child:
        _child(opts.child, opts.steps)
        return
    ratios, rows = [], []
    for r in range(opts.rounds):
        trl = run_child(__file__, ["--steps", str(opts.steps)], "trl")
        ours = run_child(__file__, ["--steps", str(opts.steps)], "agentrl")
        t_trl = statistics.median(trl["step_times"][1:])
        t_ours = statistics.median(ours["step_times"][1:])
        ratios.append(t_trl / t_ours)
        rows.append((r + 1, t_ours, t_trl, ours["peak_rss_mb"], trl["peak_rss_mb"]))
    print(f"CPU: {cpu_description()}; {opts.steps} steps per side (median after the first); TRL "
          f"gradient checkpointing {trl['gradient_checkpointing']}, packing {trl['packing']}")
    print("| round | agentrl s/step | TRL s/step | speed-up (TRL / agentrl) | agentrl peak RSS "
          "| TRL peak RSS | memory (agentrl / TRL) |")
    print("|---|---|---|---|---|---|---|")
    for (r, a, t, ma, mt), ratio in zip(rows, ratios, strict=True):
        print(f"| {r} | {a:.2f} | {t:.2f} | {ratio:.2f}x | {ma / 1024:.2f} GiB | "
              f"{mt / 1024:.2f} GiB | {ma / mt:.2f} |")
    print(f"median speed-up: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
