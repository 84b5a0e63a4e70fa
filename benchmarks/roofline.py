"""The roofline of this machine (CPU or CUDA GPU) for decoding a model: its measured matrix rates
and memory bandwidth, and the tokens/s those allow when B sequences decode one token each.

Measured on the threads torch uses in this process (`torch.get_num_threads()`, printed), the
load average printed beside every figure (a busy machine gives low rates: measure on a quiet
one). Each figure is the fastest of many timed groups of calls after a warm-up (on a CPU, one
call or ~2 ms of calls a group, so that some group can fall where no other job took a thread;
on a shared machine still a low bound; `TIMING` below):
- the achievable peak: one N x N x N matmul (N = 2048 on a CPU, 8192 on a GPU), fp32, and bf16
  on a GPU or on a CPU with avx512_bf16 or amx_bf16 (elsewhere torch's CPU bf16 matmul has no
  bf16 unit to use: skipped, with a line saying so);
- the rate at the decode shapes: one layer's seven projections of the model (q, k, v, o,
  gate, up, down as `F.linear` on [rows, hidden] inputs) for each row count in --batch; the
  weights of one layer stay in cache, so this is compute, not memory; the LM head's FLOPs are
  counted at the same rate;
- memory bandwidth: a streaming read (`sum`) over a 1 GiB (CPU) / 2 GiB (GPU) fp32 buffer.

A decode step of B sequences at mean context L reads every weight once (the embedding too, as
the tied LM head) and the KV cache of every sequence, and does 2 FLOPs per weight per sequence
plus the attention's 4 x L x heads x head_dim per layer per sequence. Its time is bounded below
by max(bytes / bandwidth, FLOPs / matrix rate); tokens/s <= B / that time. The ceiling is given
twice: from the peak rate, and from the rate measured at B rows (the one a decode step can
reach; what benchmarks/generation.py divides by).

    python benchmarks/roofline.py                          # CPU, batch 1 8 32 64 128
    python3 benchmarks/roofline.py --device cuda --measure-only --out /tmp/rates.json
    python3 benchmarks/roofline.py --device cuda --batch 64 256 --out roofline.json
    python benchmarks/roofline.py --rates roofline.json --context 200   # no new measurement
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

BATCHES = (1, 8, 32, 64, 128)
BF16_UNITS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs with a bf16 matmul unit
DTYPES = {"fp32": 4, "bf16": 2}  # bytes per weight / KV value


@dataclass(frozen=True)
class DecodeShape:
    """What a decode step's cost depends on: weights (tied embedding counted once) and KV."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class StepCost:
    """One decode step of `batch` sequences: bytes read from memory and FLOPs done."""

    bytes: int
    flops: int


def shape_of(config: Any) -> DecodeShape:
    """The decode shape of a transformers config (the model built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    heads = config.num_attention_heads
    return DecodeShape(
        params=sum(p.numel() for p in model.parameters()),  # tied weights counted once
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
    )


def decode_shape(model: str) -> DecodeShape:
    """The decode shape of a named model or a model directory (its config only, no weights)."""
    from transformers import AutoConfig

    from agentrl.models import model_dir

    return shape_of(AutoConfig.from_pretrained(str(model_dir(model))))


def layer_projections(shape: DecodeShape) -> list[tuple[int, int]]:
    """(out, in) of one layer's projections: q, k, v, o, gate, up, down."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def step_cost(shape: DecodeShape, batch: int, context: int, value_bytes: int) -> StepCost:
    """Bytes and FLOPs of one decode step of `batch` sequences at mean context `context`."""
    weights = shape.params * value_bytes
    kv = batch * context * shape.layers * 2 * shape.kv_heads * shape.head_dim * value_bytes
    attention = 4 * context * shape.layers * shape.heads * shape.head_dim
    return StepCost(bytes=weights + kv, flops=batch * (2 * shape.params + attention))


def ceiling(cost: StepCost, batch: int, gb_s: float, gflop_s: float) -> tuple[float, str]:
    """(tokens/s, "memory" | "compute"): `batch` tokens per step at the slower of the two."""
    t_mem, t_flop = cost.bytes / (gb_s * 1e9), cost.flops / (gflop_s * 1e9)
    return batch / max(t_mem, t_flop), "memory" if t_mem >= t_flop else "compute"


def bf16_unit(flags: Iterable[str]) -> str | None:
    """The CPU's bf16 matmul unit among its /proc/cpuinfo flags (amx_bf16, avx512_bf16), or None."""
    have = set(flags)
    return next((unit for unit in BF16_UNITS if unit in have), None)


def cpu_flags() -> set[str]:
    from agentrl.backends.cpu.kernels import cpu_flags as flags_line

    return set(flags_line().partition(":")[2].split())


def load() -> float:
    return os.getloadavg()[0]


# (seconds a timed group of calls lasts, seconds of groups in all) per figure. A CPU times each
# call alone where it can: on a shared machine a preempted thread stalls the whole parallel call,
# and the shortest groups are the likeliest to miss that. A GPU groups calls to amortise the sync.
TIMING = {"cpu": {"peak": (0.0, 3.0), "rows": (0.002, 1.5), "read": (0.0, 1.0)},
          "cuda": {"peak": (0.05, 1.0), "rows": (0.02, 0.3), "read": (0.02, 0.5)}}


def _best_seconds(fn: Callable[[], object], sync: Callable[[], None],
                  timing: tuple[float, float]) -> float:
    """Seconds per call of `fn`: the fastest of groups of calls lasting ~group_s each, timed
    for ~budget_s in all (at least 3 groups) after a warm-up call."""
    group_s, budget_s = timing
    fn()
    sync()  # warm-up
    t0 = time.perf_counter()
    fn()
    sync()
    reps = max(1, int(group_s / max(time.perf_counter() - t0, 1e-7)))
    best, groups, start = float("inf"), 0, time.perf_counter()
    while groups < 3 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best, groups = min(best, (time.perf_counter() - t0) / reps), groups + 1
    return best


def _gemm_rates(device: str, dtype: Any, shape: DecodeShape | None, rows: Iterable[int],
                sync: Callable[[], None]) -> dict:
    import torch
    import torch.nn.functional as F

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=dtype)

    timing = TIMING["cuda" if device.startswith("cuda") else "cpu"]
    square = 8192 if device.startswith("cuda") else 2048
    a, b = rand(square, square), rand(square, square)
    s = _best_seconds(lambda a=a, b=b: a @ b, sync, timing["peak"])
    out: dict = {"peak": {"n": square, "gflop_s": 2 * square**3 / s / 1e9, "load": load()},
                 "rows": {}}
    del a, b
    if shape is None:
        return out
    weights = [rand(o, i) for o, i in layer_projections(shape)]
    layer_flops = 2 * sum(o * i for o, i in layer_projections(shape))
    for r in rows:
        x, x_down = rand(r, shape.hidden), rand(r, shape.intermediate)

        def layer(x=x, x_down=x_down) -> None:
            for w in weights[:-1]:
                F.linear(x, w)
            F.linear(x_down, weights[-1])

        s = _best_seconds(layer, sync, timing["rows"])
        out["rows"][str(r)] = {"gflop_s": r * layer_flops / s / 1e9, "load": load()}
    return out


def measure(device: str, shape: DecodeShape | None, rows: Iterable[int]) -> dict:
    """This machine's matrix rates (peak and per row count; rows need `shape`) and bandwidth."""
    import torch
    from machine import cpu_description  # benchmarks/machine.py

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rates: dict = {
        "device": device, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "name": torch.cuda.get_device_name(device) if cuda else cpu_description(),
        "cpus": os.cpu_count(), "load_before": load(), "gemm": {},
    }
    dtypes = {"fp32": torch.float32}
    unit = None if cuda else bf16_unit(cpu_flags())
    if cuda or unit:
        dtypes["bf16"] = torch.bfloat16
        rates["bf16_unit"] = unit or "cuda"
    else:
        rates["bf16_skipped"] = ("the CPU has neither avx512_bf16 nor amx_bf16 (/proc/cpuinfo), "
                                 "so torch's bf16 matmul has no bf16 unit to run on")
    rows = list(rows)
    for name, dtype in dtypes.items():
        rates["gemm"][name] = _gemm_rates(device, dtype, shape, rows, sync)
    buf = torch.ones((2 if cuda else 1) * 2**28, device=device)  # 1 or 2 GiB of fp32, touched
    s = _best_seconds(buf.sum, sync, TIMING["cuda" if cuda else "cpu"]["read"])
    rates["read"] = {"gib": buf.numel() * 4 / 2**30,
                     "gb_s": buf.numel() * 4 / s / 1e9, "load": load()}
    return rates


def best_rates(first: dict, second: dict) -> dict:
    """Two measurements of the same machine, each figure the faster of the two (with its load):
    on a shared machine the slower one is the one other jobs took more from."""
    best = dict(first)
    if "gflop_s" in first or "gb_s" in first:
        key = "gflop_s" if "gflop_s" in first else "gb_s"
        return first if first[key] >= second[key] else second
    for k, v in first.items():
        if isinstance(v, dict) and isinstance(second.get(k), dict):
            best[k] = best_rates(v, second[k])
    return best


def ceilings(shape: DecodeShape, rates: dict, batch: int, context: int, dtype: str) -> dict:
    """The decode ceiling at `batch` from the peak rate and (when measured) the rate at `batch`
    rows, with which of memory and compute bounds each."""
    cost = step_cost(shape, batch, context, DTYPES[dtype])
    gemm = rates["gemm"][dtype]
    peak, peak_bound = ceiling(cost, batch, rates["read"]["gb_s"], gemm["peak"]["gflop_s"])
    out = {"batch": batch, "context": context, "dtype": dtype, "mib_per_step": cost.bytes / 2**20,
           "gflop_per_step": cost.flops / 1e9, "peak_tok_s": peak, "peak_bound": peak_bound,
           "rows_tok_s": None, "rows_bound": None}
    if str(batch) in gemm["rows"]:
        out["rows_tok_s"], out["rows_bound"] = ceiling(
            cost, batch, rates["read"]["gb_s"], gemm["rows"][str(batch)]["gflop_s"])
    return out


def flops_text(gflop_s: float) -> str:
    return f"{gflop_s / 1e3:,.1f} TFLOP/s" if gflop_s >= 1e4 else f"{gflop_s:,.1f} GFLOP/s"


def print_rates(rates: dict) -> None:
    print(f"{rates['name']}, {rates['cpus']} CPUs, torch {rates['torch']} on "
          f"{rates['threads']} threads (torch.get_num_threads()); load average before "
          f"{rates['load_before']:.2f}")
    for name, gemm in rates["gemm"].items():
        peak = gemm["peak"]
        print(f"  {name} matmul {peak['n']}^3: {flops_text(peak['gflop_s'])} "
              f"(load {peak['load']:.2f})")
        for r, m in gemm["rows"].items():
            print(f"  {name} one layer's projections at {r:>4} rows: "
                  f"{flops_text(m['gflop_s'])} (load {m['load']:.2f})")
    if "bf16_unit" in rates:
        print(f"  bf16 measured: the device has {rates['bf16_unit']}")
    if "bf16_skipped" in rates:
        print(f"  bf16 skipped: {rates['bf16_skipped']}")
    read = rates["read"]
    print(f"  streaming read of {read['gib']:.0f} GiB: {read['gb_s']:,.1f} GB/s "
          f"(load {read['load']:.2f})")


def ceiling_text(c: dict) -> str:
    rows = (f"{c['rows_tok_s']:,.0f} tok/s ({c['rows_bound']}) at the {c['batch']}-row rate"
            if c["rows_tok_s"] is not None else f"no rate measured at {c['batch']} rows")
    return f"{rows}; {c['peak_tok_s']:,.0f} tok/s ({c['peak_bound']}) at the peak rate"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rates", help="a JSON file --out wrote: its rates, measured nothing anew")
    p.add_argument("--measure-only", action="store_true",
                   help="peak rates and bandwidth only: no model (so no rates at decode rows)")
    p.add_argument("--out", help="write the rates (and ceilings) as JSON here")
    p.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--context", type=int, default=104,
                   help="mean context during decode (prompt + half the new tokens)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads(N) first (0: torch's default, as the engines run)")
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    shape = None if args.measure_only else decode_shape(args.model)
    if args.rates:
        with open(args.rates) as f:
            rates = json.load(f)["rates"]
    else:
        rates = measure(args.device, shape, args.batch)
    print_rates(rates)
    result: dict = {"rates": rates}
    if shape is not None:
        result["model"], result["shape"], result["ceilings"] = args.model, asdict(shape), []
        print(f"{args.model}: {shape.params / 1e6:.1f}M parameters, {shape.layers} layers, "
              f"{shape.heads} heads / {shape.kv_heads} KV heads x {shape.head_dim}; decode "
              f"ceiling at mean context {args.context}:")
        for dtype in rates["gemm"]:
            for b in args.batch:
                c = ceilings(shape, rates, b, args.context, dtype)
                result["ceilings"].append(c)
                print(f"  {dtype} batch {b:4d}: {c['mib_per_step']:,.0f} MiB and "
                      f"{c['gflop_per_step']:,.1f} GFLOP a step; {ceiling_text(c)}")
    print(f"load average after: {load():.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
