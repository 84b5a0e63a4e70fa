"""Test models for the engine tests."""

from __future__ import annotations

import asyncio

import torch
from transformers import LlamaForCausalLM
from transformers.cache_utils import DynamicCache

from agentrl.engine.transformers_engine import TransformersEngine


def sharp_tiny_model(tokenizer, seed: int = 1):
    """The tiny Llama with weights scaled up: random init is near-uniform, and larger weights
    give varied argmaxes, so greedy parity tests compare something."""
    from agentrl.models.tiny import tiny_model

    model = tiny_model(tokenizer, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
    return model


def llama_variant(tokenizer, **config):
    """A tiny Llama with the test model's config updated by `config`, weights ~ N(0, 0.5^2)
    (`hidden_size=256, intermediate_size=512` makes matrices large enough for the row GEMM)."""
    base = sharp_tiny_model(tokenizer)
    cfg = base.config.to_dict()
    cfg.update(config)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        model = LlamaForCausalLM(type(base.config).from_dict(cfg)).eval()
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def prefill_cache(model, prompts):
    """Left-padded prefill through the model's forward: the engine's batch cache and logits."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for u, p in enumerate(prompts):
        ids[u, width - len(p) :] = torch.tensor(p)
        mask[u, width - len(p) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    past = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=past)
    kv = [(lay.keys, lay.values) for lay in past.layers]
    return kv, mask, out.logits[:, -1]


async def generate_together(engine, requests):
    """Completions of `(prompt, params)` requests admitted in one batch (the worker's timing
    alone would not guarantee it: batches of other shapes may round differently)."""
    engine.sleep()
    tasks = [asyncio.create_task(engine.generate(p, s)) for p, s in requests]
    while engine.num_waiting < len(requests):
        await asyncio.sleep(0.001)
    engine.wake()
    return await asyncio.gather(*tasks)


async def generate_with_decode_step(model, tokenizer, requests, decode_step, **engine_options):
    """`requests` sampled together (`generate_together`) by a fresh engine that decodes with
    `decode_step`, and that engine's counters. No prefix cache: a request resumed from cached
    KV may differ in the last float bits."""
    with TransformersEngine(
        model, tokenizer, prefix_cache_bytes=0, decode_step=decode_step, **engine_options
    ) as engine:
        return await generate_together(engine, requests), engine.counters
