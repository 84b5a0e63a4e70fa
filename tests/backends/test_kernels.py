"""agentrl's CPU decode kernels (agentrl.backends.cpu.kernels): the row GEMM equals F.linear up
to float32 round-off on the shapes it takes and is F.linear on the others, each row independent
of the batch; the kernel decode step equals the torch one up to round-off across Llama variants,
writes the same KV cache, is what the engine runs for small float32 batches, and is optional."""

from __future__ import annotations

import collections
import functools
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from agentrl.backends.cpu import kernels
from agentrl.backends.cpu.decode import decode_logits
from agentrl.completion import SamplingParams
from agentrl.engine.kv import BatchCache
from tests.engine._models import generate_with_decode_step, llama_variant, prefill_cache

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("ninja") is None,
    reason="the kernel is compiled with g++ and ninja",
)


@pytest.fixture(scope="module")
def module():
    mod = kernels.module()
    assert mod is not None, "the CPU kernels did not build (see the warning logged above)"
    return mod


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 11, kernels.MAX_ROWS])
@pytest.mark.parametrize(("out_features", "in_features"), [(577, 576), (1301, 100), (1024, 96)])
def test_matches_f_linear(module, rows, out_features, in_features):
    # Odd output counts reach the single-row tail, K % 16 != 0 the scalar tail of each sum.
    g = torch.Generator().manual_seed(rows * 7 + in_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    x = torch.randn(rows, in_features * 2, generator=g)[:, ::2]  # not contiguous
    assert kernels.covers(x, w)
    # Any summation order is within K * eps * (|x| @ |w|.T) of the exact product (float64 here).
    x64, w64 = x.double(), w.double()
    bound = in_features * 2.0**-24 * (x64.abs() @ w64.abs().T)
    for bias in (None, b):
        got = kernels.linear(x, w, bias)
        want = F.linear(x, w, bias)
        assert got.shape == want.shape and got.dtype == torch.float32
        exact = F.linear(x64, w64, None if bias is None else bias.double())
        assert bool(((got.double() - exact).abs() <= bound + 2.0**-24 * exact.abs()).all())
        assert not torch.equal(got, want)  # the kernel's own sums, not F.linear's


def test_each_row_does_not_depend_on_the_batch(module):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(700, 576, generator=g)
    x = torch.randn(kernels.MAX_ROWS, 576, generator=g)
    full = kernels.linear(x, w)
    for i in range(len(x)):
        assert torch.equal(kernels.linear(x[i : i + 1], w)[0], full[i])
        assert torch.equal(kernels.linear(x[: i + 1], w), full[: i + 1])


@pytest.mark.parametrize("in_features", [1, 3, 4, 7, 8, 12, 16, 17, 24, 31, 33, 40, 47])
def test_every_tile_and_tail_shape_of_the_row_gemm(module, in_features):
    # The tile depends on the CPU (8 rows x 4 weight rows with AVX-512, 4 x 3 elsewhere) and so
    # does the vector (16, 8 or 4 lanes): these widths leave every remainder of each vector,
    # 1-12 rows every remainder of each row block, and 389 weight rows (split across threads in
    # chunks of 64) every remainder of each weight block.
    g = torch.Generator().manual_seed(in_features)
    w = torch.randn(389, in_features, generator=g)
    x = torch.randn(kernels.MAX_ROWS, in_features, generator=g)
    exact = x.double() @ w.double().T
    bound = in_features * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    singles = torch.stack([module.row_gemm(x[i : i + 1], w)[0] for i in range(len(x))])
    assert bool(((singles.double() - exact).abs() <= bound + 2.0**-24 * exact.abs()).all())
    for rows in range(1, len(x) + 1):
        assert torch.equal(module.row_gemm(x[:rows], w), singles[:rows]), rows


def test_calls_it_does_not_take_are_f_linear(module):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(600, 256, generator=g)
    x = torch.randn(4, 256, generator=g)
    cases = {
        "too many rows": (torch.randn(kernels.MAX_ROWS + 1, 256, generator=g), w),
        "bf16": (x.bfloat16(), w.bfloat16()),
        "small weight": (x, w[:200]),
        "weight not contiguous": (x, torch.randn(256, 600, generator=g).t()),
        "3-D input": (x[None], w),
    }
    for name, (xi, wi) in cases.items():
        assert not kernels.covers(xi, wi), name
        assert torch.equal(kernels.linear(xi, wi), F.linear(xi, wi)), name
    # Autograd: an input that needs gradients goes to F.linear, which has a backward.
    xg = x.clone().requires_grad_()
    out = kernels.linear(xg, w)
    assert out.requires_grad
    out.sum().backward()
    # A matrix product against a plain sum over 256 rows: float32 round-off of the order.
    torch.testing.assert_close(xg.grad, w.sum(0).expand_as(x), rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        assert kernels.covers(xg, w)


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, caplog):
    import torch.utils.cpp_extension as ext

    def broken(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(ext, "load", broken)
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_module", None)
    with caplog.at_level(logging.WARNING, logger="agentrl.backends.cpu.kernels"):
        assert kernels.module() is None
    assert "Ninja is required" in caplog.text and "g++" in caplog.text
    x, w = torch.randn(2, 300), torch.randn(400, 300)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))


def test_the_environment_variable_turns_it_off(monkeypatch):
    monkeypatch.setenv("AGENTRL_CPU_KERNELS", "0")
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_module", None)
    assert kernels.module() is None


def _decode(model, prompts, steps, cpu_kernels, ids_per_step=None, wide_kernels=False):
    """Decode from a prefilled cache; returns the logits of each step and the final KV."""
    kv, mask, logits = prefill_cache(model, prompts)
    cache = BatchCache([(k.clone(), v.clone()) for k, v in kv], mask.clone())
    pos = mask.sum(-1)
    ids = logits.argmax(-1)
    counters = collections.Counter()
    out = []
    with torch.no_grad():
        for t in range(steps):
            new_mask = torch.cat([cache.mask, torch.ones_like(cache.mask[:, :1])], dim=1)
            step = decode_logits(
                model, ids, pos, cache.cache, new_mask, cpu_kernels=cpu_kernels,
                wide_kernels=wide_kernels, counters=counters,
            )
            assert step is not None
            cache.mask = new_mask
            out.append(step)
            # Both runs feed the same tokens (the torch run's argmax).
            ids, pos = (ids_per_step[t] if ids_per_step else step.argmax(-1)), pos + 1
    return out, cache.kv(), counters["kernel_decode_steps"]


def _assert_steps_close(got, want, kv_got, kv_want, atol=1e-4):
    """Each step's logits and the final KV cache equal up to float32 round-off."""
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=atol)
    for (ka, va), (kb, vb) in zip(kv_got, kv_want, strict=True):
        torch.testing.assert_close(ka, kb, rtol=1e-4, atol=atol)
        torch.testing.assert_close(va, vb, rtol=1e-4, atol=atol)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"hidden_size": 256, "intermediate_size": 512},  # row GEMM for the larger matrices
        {"num_key_value_heads": 4},  # no grouped-query attention
        {"attention_bias": True, "mlp_bias": True},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ],
)
def test_kernel_step_matches_the_torch_step(module, tiny_tokenizer, prompts, config):
    model = llama_variant(tiny_tokenizer, **config)
    batch = [prompts[0], prompts[2], prompts[1], prompts[5]]  # padded rows of four lengths
    want, kv_want, used = _decode(model, batch, 6, cpu_kernels=False)
    assert used == 0
    fed = [w.argmax(-1) for w in want]
    got, kv_got, used = _decode(model, batch, 6, cpu_kernels=True, ids_per_step=fed)
    assert used == 6
    _assert_steps_close(got, want, kv_got, kv_want)
    assert not torch.equal(got[-1], want[-1])  # the kernels' own arithmetic ran


def test_kernel_step_matches_at_extreme_activations_and_long_contexts(module, tiny_tokenizer,
                                                                       prompts):
    # The layer's exp (SiLU gating, attention softmax) is a vectorised polynomial with clamps:
    # gates scaled into the hundreds reach both clamps (exp(-gate) under- and overflowing) and
    # sharpen the softmax, and contexts of 40-60 columns run its vector loop over padded columns.
    model = llama_variant(tiny_tokenizer, hidden_size=256, intermediate_size=512)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.mul_(40.0)
            layer.self_attn.q_proj.weight.mul_(4.0)
    batch = [prompts[0] * 5, prompts[2] * 6, prompts[1] * 9]
    want, kv_want, _ = _decode(model, batch, 5, cpu_kernels=False)
    got, kv_got, used = _decode(
        model, batch, 5, cpu_kernels=True, ids_per_step=[w.argmax(-1) for w in want]
    )
    assert used == 5
    with torch.no_grad():
        layer = model.model.layers[0]
        h = layer.post_attention_layernorm(model.model.embed_tokens(torch.tensor(batch[0])))
        assert float(layer.mlp.gate_proj(h).abs().max()) > 100  # what this test is about
    assert all(bool(torch.isfinite(a).all()) for a in got)
    _assert_steps_close(got, want, kv_got, kv_want, atol=1e-3)


@pytest.mark.parametrize("config", [{}, {"num_key_value_heads": 4}, {"attention_bias": True}])
def test_wide_kernel_step_matches_the_torch_step(module, tiny_tokenizer, prompts, config):
    """Past MAX_ROWS the layer runs with ATen's GEMMs and the kernel's attention; rows of
    different lengths are padded, so the mask matters."""
    model = llama_variant(tiny_tokenizer, hidden_size=256, intermediate_size=512, **config)
    batch = [prompts[i % len(prompts)] * (1 + i % 3) for i in range(kernels.MAX_ROWS + 5)]
    want, kv_want, used = _decode(model, batch, 4, cpu_kernels=True)
    assert used == 0  # the few-rows family does not take a wide step
    fed = [w.argmax(-1) for w in want]
    got, kv_got, used = _decode(model, batch, 4, cpu_kernels=False, ids_per_step=fed,
                                wide_kernels=True)
    assert used == 4
    _assert_steps_close(got, want, kv_got, kv_want)
    assert not torch.equal(got[-1], want[-1])  # the kernel's own arithmetic ran


def test_kernel_step_is_not_taken_where_it_does_not_apply(module, tiny_tokenizer, prompts):
    model = llama_variant(tiny_tokenizer)
    too_many = [prompts[i % len(prompts)] for i in range(kernels.MAX_ROWS + 1)]
    assert _decode(model, too_many, 2, cpu_kernels=True)[2] == 0
    assert _decode(model, too_many[:-1], 2, cpu_kernels=False, wide_kernels=True)[2] == 0
    assert _decode(model.to(torch.bfloat16), too_many, 2, cpu_kernels=True,
                   wide_kernels=True)[2] == 0
    assert _decode(model.to(torch.bfloat16), [prompts[0]], 2, cpu_kernels=True)[2] == 0
    gelu = llama_variant(tiny_tokenizer, hidden_act="gelu")
    got, _, used = _decode(gelu, [prompts[0], prompts[1]], 3, cpu_kernels=True)
    want, _, _ = _decode(gelu, [prompts[0], prompts[1]], 3, cpu_kernels=False)
    assert used == 0 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


async def test_engine_decodes_with_the_kernels(module, tiny_tokenizer, prompts):
    model = llama_variant(tiny_tokenizer, hidden_size=256, intermediate_size=512)
    requests = [
        (prompts[0], SamplingParams(temperature=0, max_tokens=12)),
        (prompts[1], SamplingParams(temperature=1.0, max_tokens=10, n=3, seed=5)),
        (prompts[2], SamplingParams(temperature=0, max_tokens=8)),
    ]
    results = {}
    for cpu_kernels in (True, False):
        step = functools.partial(decode_logits, cpu_kernels=cpu_kernels)
        results[cpu_kernels], counters = await generate_with_decode_step(
            model, tiny_tokenizer, requests, step, max_batch_size=8
        )
        steps = counters["decode_steps"]
        assert counters["lean_decode_steps"] == steps > 0
        assert counters["kernel_decode_steps"] == (steps if cpu_kernels else 0)
    lp_fast, lp_plain = [], []
    for cs_fast, cs_plain in zip(results[True], results[False], strict=True):
        for a, b in zip(cs_fast, cs_plain, strict=True):
            # Greedy rows pick the same tokens; sampled rows (same seeds) do too unless a
            # round-off lands on a sampling boundary, which these seeds do not hit.
            assert a.token_ids == b.token_ids
            lp_fast += a.logprobs
            lp_plain += b.logprobs
    assert len(lp_fast) > 30
    torch.testing.assert_close(torch.tensor(lp_fast), torch.tensor(lp_plain), rtol=0, atol=1e-4)


def test_a_lock_left_by_a_killed_build_is_removed_a_fresh_one_kept(tmp_path):
    """torch waits forever on a build's lock file; a killed build leaves one behind."""
    import os
    import time

    from agentrl.backends.cpu import kernels

    lock = tmp_path / "lock"
    lock.touch()
    assert not kernels.clear_stale_lock(tmp_path) and lock.exists()  # a build may be running
    old = time.time() - kernels.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    assert kernels.clear_stale_lock(tmp_path) and not lock.exists()
    assert not kernels.clear_stale_lock(tmp_path)  # none there
