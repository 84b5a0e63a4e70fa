"""The lean Llama decode step (agentrl.backends.cpu.decode): bit-identical to the transformers
forward, used by the engine where it applies, and bypassed where it would not reproduce the
model."""

from __future__ import annotations

import pytest
import torch

from agentrl.backends.cpu.decode import decode_logits
from agentrl.completion import SamplingParams
from agentrl.engine.kv import BatchCache
from agentrl.engine.transformers_engine import TransformersEngine
from tests.engine._models import (
    generate_with_decode_step,
    llama_variant,
    prefill_cache,
    sharp_tiny_model,
)


def _decode_both(model, prompts, steps):
    """Greedy-decode `steps` tokens from the same cache twice, lean and with the model's forward;
    returns the logits of every step from both."""
    kv, mask, logits = prefill_cache(model, prompts)
    lean = BatchCache([(k.clone(), v.clone()) for k, v in kv], mask.clone())
    ref = BatchCache([(k.clone(), v.clone()) for k, v in kv], mask.clone())
    pos = mask.sum(-1)
    ids = logits.argmax(-1)
    got, want = [], []
    with torch.no_grad():
        for _ in range(steps):
            new_mask = torch.cat([lean.mask, torch.ones_like(lean.mask[:, :1])], dim=1)
            a = decode_logits(model, ids, pos, lean.cache, new_mask)
            assert a is not None
            b = model(
                input_ids=ids[:, None],
                attention_mask=new_mask,
                position_ids=pos[:, None],
                past_key_values=ref.cache,
                logits_to_keep=1,
            ).logits[:, -1]
            lean.mask = ref.mask = new_mask
            got.append(a)
            want.append(b)
            ids, pos = a.argmax(-1), pos + 1
    return got, want


@pytest.mark.parametrize("padded", [True, False])
def test_lean_step_is_bit_identical_to_the_forward(model, tiny_tokenizer, prompts, padded):
    # Padded rows take the additive-mask attention; unpadded ones transformers' mask-free GQA path.
    batch = [prompts[0], prompts[2], prompts[1]] if padded else [prompts[2], prompts[2]]
    got, want = _decode_both(model, batch, steps=6)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], got[1])  # the steps compare different logits


@pytest.mark.parametrize(
    "config",
    [
        {"num_key_value_heads": 4},  # no grouped-query attention
        {"attention_bias": True, "mlp_bias": True},
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        {"dtype": torch.bfloat16},  # the norms compute in fp32 and cast back
    ],
)
def test_lean_step_matches_llama_variants(tiny_tokenizer, prompts, config):
    config = dict(config)
    dtype = config.pop("dtype", torch.float32)
    model = llama_variant(tiny_tokenizer, **config).to(dtype)
    got, want = _decode_both(model, [prompts[0], prompts[3]], steps=4)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == dtype and torch.equal(a, b)


async def test_engine_samples_the_same_with_and_without_the_lean_step(
    model, tiny_tokenizer, prompts
):
    requests = [
        (prompts[0], SamplingParams(temperature=1.0, max_tokens=14, n=3, seed=5)),
        (prompts[1], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=10, n=2, seed=6)),
        (prompts[2], SamplingParams(temperature=0, max_tokens=12, top_logprobs=2)),
        (prompts[3], SamplingParams(temperature=1.2, top_k=8, max_tokens=9, seed=7)),
    ]
    results = {}
    for lean in (True, False):
        # No CPU kernels (their sums round differently; tests/backends/test_kernels.py).
        results[lean], counters = await generate_with_decode_step(
            model, tiny_tokenizer, requests, decode_logits if lean else None, max_batch_size=8
        )
        assert (counters["lean_decode_steps"] > 0) == lean
        assert counters["lean_decode_steps"] in (0, counters["decode_steps"])
    assert results[True] == results[False]  # tokens, logprobs and top logprobs, exactly
    assert sum(len(c.token_ids) for cs in results[True] for c in cs) > 50


async def test_hooks_make_the_engine_use_the_forward(tiny_tokenizer, prompts):
    model = sharp_tiny_model(tiny_tokenizer)
    target = 7

    def force(module, args, out):
        out = out.clone()
        out[..., target] += 1e4
        return out

    with TransformersEngine(
        model, tiny_tokenizer, prefix_cache_bytes=0, decode_step=decode_logits
    ) as engine:
        params = SamplingParams(temperature=0, max_tokens=6)
        [free] = await engine.generate(prompts[0], params)
        assert engine.counters["lean_decode_steps"] == engine.counters["decode_steps"] > 0
        assert free.token_ids[1:] != [target] * 5
        handle = model.lm_head.register_forward_hook(force)
        try:
            steps = engine.counters["lean_decode_steps"]
            [forced] = await engine.generate(prompts[0], params)
            assert forced.token_ids == [target] * 6  # the hook ran at every step
            assert engine.counters["lean_decode_steps"] == steps
        finally:
            handle.remove()


def test_models_it_does_not_reproduce_get_none(tiny_tokenizer, prompts):
    eager = sharp_tiny_model(tiny_tokenizer)
    eager.set_attn_implementation("eager")
    lora_like = sharp_tiny_model(tiny_tokenizer)
    lora_like.model.layers[1].mlp.up_proj = torch.nn.Sequential(
        lora_like.model.layers[1].mlp.up_proj
    )
    for m in (eager, lora_like):
        kv, mask, logits = prefill_cache(m, [prompts[0]])
        cache = BatchCache(kv, mask)
        new_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        with torch.no_grad():
            out = decode_logits(m, logits.argmax(-1), mask.sum(-1), cache.cache, new_mask)
        assert out is None
