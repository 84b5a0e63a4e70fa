"""agentrl's CPU decode kernels (agentrl.backends.cpu.kernels) against the torch path, in one
process.

1. Every weight matrix of the model (SmolLM2-135M: 211 matrices, 540 MB in float32) multiplied
   by R rows, R in --rows: one decode step's projections, F.linear vs the row GEMM, alternating.
2. The GRPO benchmark's rollout (2 chat prompts x 4 samples, 32 new tokens, temperature 1) on
   two engines over the same model, `cpu_kernels=False` (baseline: the lean torch step) and
   `cpu_kernels=True`, alternating.
3. With --baseline-rev REV (a git revision of this repository): the same rollout with the
   kernels built from REV's csrc (agentrl/backends/cpu/csrc, or agentrl/engine/csrc before
   issue 14) against the current ones, every sample 32
   tokens long (EOS ignored), alternating: a kernel change's effect.

    .venv/bin/python benchmarks/cpu_decode.py
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import time

import torch
import torch.nn.functional as F


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def projections(model, rows_list: list[int], reps: int) -> None:
    from agentrl.backends.cpu import kernels

    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    mb = sum(w.numel() for w in weights) * 4 / 2**20
    print(f"{len(weights)} weight matrices, {mb:.0f} MB float32")
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        base, fast = [], []
        for _ in range(reps):
            base.append(median_ms(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights], 1))
            fast.append(
                median_ms(lambda xs=xs: [kernels.linear(xs[w.shape[1]], w) for w in weights], 1)
            )
        b, f = statistics.median(base), statistics.median(fast)
        used = "kernel" if kernels.applies(rows, weights[0]) else "F.linear (too many rows)"
        print(f"  {rows:2d} rows: F.linear {b:6.1f} ms  row_gemm {f:6.1f} ms  {b / f:.2f}x  "
              f"[{used}]")


def rollouts(model, tok, rounds: int) -> None:
    from agentrl.backends.cpu.decode import decode_logits
    from agentrl.completion import SamplingParams
    from agentrl.engine.transformers_engine import TransformersEngine

    questions = ["What is 2+3?", "What is 7*6?"]
    prompts = []
    for q in questions:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    params = SamplingParams(max_tokens=32, temperature=1.0, n=4)
    engines = {
        flag: TransformersEngine(model, tok, prefix_cache_bytes=0, seed=0,
                                 decode_step=functools.partial(decode_logits, cpu_kernels=flag))
        for flag in (False, True)
    }

    async def one(engine) -> float:
        t = time.perf_counter()
        await asyncio.gather(*[engine.generate(p, params) for p in prompts])
        return time.perf_counter() - t

    times = {False: [], True: []}
    for flag, engine in engines.items():  # warm-up (and the kernel's build)
        asyncio.run(one(engine))
    for _ in range(rounds):
        for flag, engine in engines.items():
            times[flag].append(asyncio.run(one(engine)))
    b, f = statistics.median(times[False]), statistics.median(times[True])
    steps = {flag: e.counters["decode_steps"] for flag, e in engines.items()}
    print(
        f"GRPO-sized rollout (8 rows, 32 tokens), median of {rounds}: "
        f"cpu_kernels=False {b:.2f} s  cpu_kernels=True {f:.2f} s  {b / f:.2f}x "
        f"(decode steps {steps[False]} / {steps[True]}, "
        f"kernel steps {engines[True].counters['kernel_decode_steps']})"
    )
    for e in engines.values():
        e.close()


def against_baseline(model, tok, rev: str, rounds: int) -> None:
    import io
    import pathlib
    import subprocess
    import tarfile
    import tempfile

    from agentrl.backends.cpu import kernels
    from agentrl.backends.cpu.decode import decode_logits
    from agentrl.completion import SamplingParams
    from agentrl.engine.transformers_engine import TransformersEngine

    repo = pathlib.Path(__file__).resolve().parents[1]
    for csrc in ("agentrl/backends/cpu/csrc", "agentrl/engine/csrc"):  # after / before issue 14
        listed = subprocess.run(["git", "ls-tree", rev, csrc], cwd=repo, capture_output=True,
                                check=False)
        if listed.returncode == 0 and listed.stdout:
            break
    archive = subprocess.run(
        ["git", "archive", rev, csrc], cwd=repo, check=True, capture_output=True
    ).stdout
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tmp, filter="data")
        baseline = kernels.compile_sources(pathlib.Path(tmp, csrc), "agentrl_cpu_kernels_baseline")
    mods = {"baseline": baseline, "current": kernels.module()}
    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False))
        for q in ("What is 2+3?", "What is 7*6?")
    ]
    engine = TransformersEngine(model, tok, prefix_cache_bytes=0, seed=0,
                                decode_step=functools.partial(decode_logits, cpu_kernels=True))
    engine.eos_ids = frozenset()  # every sample decodes 32 tokens: the same work on both sides
    params = SamplingParams(max_tokens=32, temperature=1.0, n=4)
    times: dict[str, list[float]] = {name: [] for name in mods}
    try:
        for k in range(rounds + 1):
            for name, mod in mods.items():
                kernels._module = mod  # read at every decode step
                t = time.perf_counter()
                asyncio.run(_gather(engine, prompts, params))
                if k:  # round 0 warms up
                    times[name].append(time.perf_counter() - t)
    finally:
        kernels._module = mods["current"]
        engine.close()
    b, f = statistics.median(times["baseline"]), statistics.median(times["current"])
    print(f"rollout, 8 rows x 32 tokens, median of {rounds}: kernels at {rev} {b:.2f} s, "
          f"current kernels {f:.2f} s: {b / f:.2f}x")


async def _gather(engine, prompts, params):
    return await asyncio.gather(*[engine.generate(p, params) for p in prompts])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", default="1,4,8,12,16")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--baseline-rev", help="only compare against the kernels of this git revision")
    args = ap.parse_args()
    from agentrl.backends.cpu import kernels
    from agentrl.models import load_model, load_tokenizer

    torch.set_num_threads(os.cpu_count() or 2)
    if kernels.module() is None:
        raise SystemExit("agentrl's CPU kernels did not build (see the warning above)")
    model = load_model(args.model).eval()
    tok = load_tokenizer(args.model)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs: {kernels.cpu_model()} "
          f"[{kernels.vector_flags()}], {args.model}")
    if args.baseline_rev:
        against_baseline(model, tok, args.baseline_rev, args.rounds)
        return
    with torch.no_grad():
        projections(model, [int(r) for r in args.rows.split(",")], args.reps)
    rollouts(model, tok, args.rounds)


if __name__ == "__main__":
    main()
