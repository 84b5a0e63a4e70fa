"""The decode-step cost model and the bf16 flag detection of benchmarks/roofline.py (nothing
here is timed: the measurements themselves are run by hand, benchmarks/results/roofline.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# benchmarks/ holds scripts, not a package: load the file itself (sys.path left alone)
_spec = importlib.util.spec_from_file_location(
    "benchmarks_roofline", Path(__file__).parents[2] / "benchmarks" / "roofline.py")
assert _spec and _spec.loader
roofline = sys.modules["benchmarks_roofline"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(roofline)


def tiny_shape() -> roofline.DecodeShape:
    from transformers import LlamaConfig

    return roofline.shape_of(LlamaConfig(
        vocab_size=10, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def test_shape_counts_every_weight_once():
    shape = tiny_shape()
    # embedding 10x8 (tied head) + 2 x (q 64 + k 32 + v 32 + o 64 + 3 x 96 MLP + 2 norms x 8)
    # + final norm 8
    assert shape.params == 80 + 2 * 496 + 8
    assert (shape.layers, shape.heads, shape.kv_heads, shape.head_dim) == (2, 4, 2, 2)
    assert roofline.layer_projections(shape) == [
        (8, 8), (4, 8), (4, 8), (8, 8), (12, 8), (12, 8), (8, 12)]


def test_step_cost_by_hand():
    cost = roofline.step_cost(tiny_shape(), batch=3, context=5, value_bytes=4)
    weights = 1080 * 4
    kv = 3 * 5 * 2 * 2 * 2 * 2 * 4  # batch x context x layers x (K, V) x kv_heads x dim x bytes
    assert cost.bytes == weights + kv == 5280
    # 2 per weight + attention 4 x context x layers x heads x head_dim, per sequence
    assert cost.flops == 3 * (2 * 1080 + 4 * 5 * 2 * 4 * 2) == 7440
    half = roofline.step_cost(tiny_shape(), batch=3, context=5, value_bytes=2)
    assert half.bytes == 5280 // 2 and half.flops == 7440


def test_ceiling_takes_the_slower_of_memory_and_compute():
    cost = roofline.StepCost(bytes=5280, flops=7440)
    # memory 1 s, compute 2 s: compute-bound, 3 tokens in 2 s
    assert roofline.ceiling(cost, 3, gb_s=5280e-9, gflop_s=3720e-9) == \
        pytest.approx((1.5, "compute"))
    assert roofline.ceiling(cost, 3, gb_s=1320e-9, gflop_s=7440e-9) == \
        pytest.approx((0.75, "memory"))


def test_ceilings_use_the_rate_at_that_row_count_when_measured():
    rates = {"read": {"gb_s": 5280e-9},
             "gemm": {"fp32": {"peak": {"gflop_s": 7440e-9}, "rows": {"3": {"gflop_s": 3720e-9}}}}}
    at3 = roofline.ceilings(tiny_shape(), rates, 3, 5, "fp32")
    assert at3["peak_tok_s"] == pytest.approx(3.0) and at3["peak_bound"] == "memory"
    assert at3["rows_tok_s"] == pytest.approx(1.5) and at3["rows_bound"] == "compute"
    at4 = roofline.ceilings(tiny_shape(), rates, 4, 5, "fp32")
    assert at4["rows_tok_s"] is None and "no rate measured at 4 rows" in \
        roofline.ceiling_text(at4)


def test_smollm2_shape_and_flops_per_token():
    from transformers import LlamaConfig

    shape = roofline.shape_of(LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True))
    assert shape.params == 134_515_008
    assert roofline.step_cost(shape, 1, 0, 4).flops / 1e9 == pytest.approx(0.269, abs=1e-3)


def test_bf16_unit_from_cpu_flags(monkeypatch):
    assert roofline.bf16_unit({"avx", "avx2", "fma"}) is None  # this AVX2-only EPYC
    assert roofline.bf16_unit({"avx512f", "avx512_bf16"}) == "avx512_bf16"
    assert roofline.bf16_unit({"avx512_bf16", "amx_bf16", "amx_tile"}) == "amx_bf16"
    from agentrl.backends.cpu import kernels

    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags\t\t: fpu avx2 avx512_bf16")
    assert roofline.cpu_flags() == {"fpu", "avx2", "avx512_bf16"}
    assert roofline.bf16_unit(roofline.cpu_flags()) == "avx512_bf16"


def test_best_rates_keeps_the_faster_of_each_figure():
    first = {"threads": 2, "read": {"gb_s": 9.0, "load": 1.0},
             "gemm": {"fp32": {"peak": {"n": 2048, "gflop_s": 30.0, "load": 8.0},
                               "rows": {"16": {"gflop_s": 20.0, "load": 8.0}}}}}
    second = {"threads": 2, "read": {"gb_s": 7.0, "load": 3.0},
              "gemm": {"fp32": {"peak": {"n": 2048, "gflop_s": 40.0, "load": 2.0},
                                "rows": {"16": {"gflop_s": 0.6, "load": 9.0}}}}}
    best = roofline.best_rates(first, second)
    assert best["read"] == {"gb_s": 9.0, "load": 1.0}
    assert best["gemm"]["fp32"]["peak"] == {"n": 2048, "gflop_s": 40.0, "load": 2.0}
    assert best["gemm"]["fp32"]["rows"]["16"]["gflop_s"] == 20.0
    assert first["gemm"]["fp32"]["peak"]["gflop_s"] == 30.0  # inputs left as they were
