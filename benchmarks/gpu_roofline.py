"""The roofline of this GPU for decoding a model: its measured bf16/fp32 matrix rates and memory
bandwidth, and the tokens/s those allow when a batch of sequences decodes one token each.

Measured the same way as the engine is timed (CUDA events around repeated work after warm-up):
- matrix products: an N x N x N product (N = 8192), in bf16 and in fp32 (TF32 off, as torch's
  default), on random data, mean of 10 after 3 warm-ups;
- memory: a device-to-device copy of 2 GiB, counting bytes read and written.

A decode step of B sequences at context L reads every weight once (the embedding too, as the
tied LM head) and the KV cache of every sequence, and does 2 FLOPs per weight per sequence plus
the attention's 4 x L x heads x head_dim per layer per sequence. Its time is bounded below by
max(bytes / bandwidth, FLOPs / matrix rate); tokens/s <= B / that time.

    python3 benchmarks/gpu_roofline.py --measure-only --out /tmp/rates.json   # rates only
    python3 benchmarks/gpu_roofline.py --rates /tmp/rates.json --batch 64 256 --context 104
"""

from __future__ import annotations

import argparse
import json


def measure() -> dict:
    import torch

    dev = torch.device("cuda")
    out = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "cuda": torch.version.cuda}

    def timed(fn, reps: int) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    n = 8192
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        s = timed(lambda a=a, b=b: a @ b, 10)
        out[f"{name}_matmul_tflops"] = 2 * n**3 / s / 1e12
        del a, b
    src = torch.empty(2**30, device=dev, dtype=torch.float16)  # 2 GiB
    dst = torch.empty_like(src)
    s = timed(lambda: dst.copy_(src), 10)
    out["copy_gb_s"] = 2 * src.numel() * src.element_size() / s / 1e9
    return out


def decode_shape(model: str) -> dict:
    """Weights and KV geometry of `model` (built on the meta device: no memory, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from agentrl.models import model_dir

    cfg = AutoConfig.from_pretrained(str(model_dir(model)))
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    heads = cfg.num_attention_heads
    return {
        "params": sum(p.numel() for p in m.parameters()),  # tied weights counted once
        "layers": cfg.num_hidden_layers,
        "heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", heads),
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
    }


def bound(shape: dict, rates: dict, batch: int, context: int, dtype: str) -> dict:
    size = 2 if dtype == "bf16" else 4
    kv = batch * context * shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * size
    weights = shape["params"] * size
    flops = batch * (
        2 * shape["params"] + 4 * context * shape["layers"] * shape["heads"] * shape["head_dim"]
    )
    t_mem = (weights + kv) / (rates["copy_gb_s"] * 1e9)
    t_flop = flops / (rates[f"{dtype}_matmul_tflops"] * 1e12)
    return {
        "batch": batch, "context": context, "dtype": dtype,
        "bytes_per_step_mb": (weights + kv) / 2**20,
        "bound": "memory" if t_mem >= t_flop else "compute",
        "roofline_tok_s": batch / max(t_mem, t_flop),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rates", help="a JSON file of earlier measurements (else measure now)")
    p.add_argument("--measure-only", action="store_true")
    p.add_argument("--out", help="write the measurements (and bounds) as JSON here")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--context", type=int, default=104,
                   help="mean context during decode (prompt + half the new tokens)")
    args = p.parse_args()
    if args.rates:
        with open(args.rates) as f:
            rates = json.load(f)["rates"]  # as --out wrote it
    else:
        rates = measure()
    print(f"{rates['gpu']} (torch {rates['torch']}, CUDA {rates['cuda']}): "
          f"bf16 matmul {rates['bf16_matmul_tflops']:.0f} TFLOP/s, fp32 "
          f"{rates['fp32_matmul_tflops']:.1f} TFLOP/s, copy {rates['copy_gb_s']:.0f} GB/s")
    result = {"rates": rates}
    if not args.measure_only:
        shape = decode_shape(args.model)
        result["shape"], result["bounds"] = shape, []
        print(f"{args.model}: {shape['params'] / 1e6:.1f}M parameters, {shape['layers']} layers, "
              f"{shape['kv_heads']} KV heads x {shape['head_dim']}")
        for dtype in ("fp32", "bf16"):
            for b in args.batch:
                r = bound(shape, rates, b, args.context, dtype)
                result["bounds"].append(r)
                print(f"  {dtype} batch {b:4d} context {args.context}: "
                      f"{r['bytes_per_step_mb']:.0f} MB/step, {r['bound']}-bound, "
                      f"roofline {r['roofline_tok_s']:,.0f} tok/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
