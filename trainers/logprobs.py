"""The trainer's one log-prob function: of the sampled tokens, under the policy, the policy
before the update, or the reference model, with the same packing and arithmetic for each."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from agentrl.backends import TrainBackend
from agentrl.backends.device import autocast
from agentrl.models import packed_attention
from agentrl.models.vision import VisionProcessor
from trainers.batch import RolloutBatch, pack
from trainers.config import TrainConfig

Rows = tuple[Tensor, int]
"""A micro-batch: row indices into the batch and their padded length n."""


def token_logprobs(
    cfg: TrainConfig, backend: TrainBackend, module: nn.Module, batch: RolloutBatch, rows: Rows,
    *, entropy: bool = False, vision: VisionProcessor | None = None,
) -> tuple[Tensor, Tensor | None, int]:
    """Log-probs (and entropies) of the policy tokens of `rows` under `module` (what `backend`
    trains or holds), as [m, n-1] (0 elsewhere), and the prompt tokens prefix sharing saved.

    With packing (default) the rows are concatenated into one padding-free sequence, and the
    vocabulary projection, log-softmax and entropy run only at the positions that predict a
    policy token (`logits_to_keep`): prompts and observations are most of a multi-turn
    sequence, and the [tokens, vocab] logits are the largest tensors of the step. The entropy
    carries a gradient only with an entropy bonus (otherwise it is a logged metric).

    A vision-language batch (`trainers.batch.add_images`) also passes the rows' images
    (`vision`: the policy's processor) and, for mRoPE models, their 3-D positions; packed, the
    text positions go first ([4, 1, L]) so that the model derives the per-sequence causal mask
    from them, as it does for text.
    """
    idx, n = rows
    r, c = batch.mask[idx, : n - 1].nonzero(as_tuple=True)
    targets = batch.input_ids[idx[r], c + 1]
    shared = 0
    if cfg.packing:
        packed = pack(batch, idx, n, share_prefixes=cfg.share_prefixes and _masks(module))
        flat = packed.index[r, c]
        inputs: dict[str, Any] = {"input_ids": packed.input_ids,
                                  "position_ids": packed.position_ids}
        if packed.mrope is not None:
            inputs["position_ids"] = torch.cat([packed.position_ids[None], packed.mrope])
        if packed.attention_mask is not None:
            inputs["attention_mask"] = packed.attention_mask
        if _segments(module):
            packed_attention.register()
            inputs["packed_layout"] = packed.layout
        shared = packed.shared_tokens
        if packed.images:
            inputs.update(_image_inputs(batch, packed.images, vision))
    else:
        flat = r * n + c
        inputs = padded_inputs(batch, rows, vision)
    with autocast(backend.device, cfg.actor.mixed_precision):
        if cfg.packing and _accepts_logits_to_keep(module):
            # Packed: one row, so the kept positions are exactly the ones we need. A view
            # (`[0]` would cost a zero-filled [T, V] gradient and a copy in the backward).
            logits = module(**inputs, use_cache=False, logits_to_keep=flat).logits.squeeze(0)
        else:
            logits = module(**inputs, use_cache=False).logits
            logits = logits.reshape(-1, logits.shape[-1])[flat]
    # In float32 (bf16 logits are upcast); the logits are not used again.
    got, ent_t = backend.token_logprobs(logits, targets, cfg.rollout.temperature, entropy=entropy)
    del logits
    logp = batch.mask.new_zeros(len(idx), n - 1)
    logp[r, c] = got
    if ent_t is None:
        return logp, None, shared
    ent = batch.mask.new_zeros(len(idx), n - 1)
    ent[r, c] = ent_t if cfg.algo.entropy_coef > 0 else ent_t.detach()
    return logp, ent, shared


def padded_inputs(
    batch: RolloutBatch, rows: Rows, vision: VisionProcessor | None
) -> dict[str, Tensor]:
    """The model inputs of `rows` as right-padded rows of length n: ids, attention mask and,
    for a vision-language batch, the rows' images and (mRoPE) their 3-D positions. What the
    unpacked log-prob forward and the critic both run on."""
    idx, n = rows
    cols = torch.arange(n, device=batch.input_ids.device)
    inputs = {"input_ids": batch.input_ids[idx, :n],
              "attention_mask": (cols[None, :] < batch.lengths[idx][:, None]).long()}
    if batch.positions is not None:
        inputs["position_ids"] = batch.positions[:, idx, :n]
    if batch.images:
        images = [im for i in idx.tolist() for im in batch.images[i]]
        if images:
            inputs.update(_image_inputs(batch, images, vision))
    return inputs


def _image_inputs(
    batch: RolloutBatch, images: list[np.ndarray], vision: VisionProcessor | None
) -> dict[str, Tensor]:
    if vision is None:
        raise ValueError("a batch with images needs the policy's VisionProcessor")
    dev = batch.input_ids.device
    return {k: t.to(dev) for k, t in vision.model_inputs(images).items()}


def _masks(module: nn.Module) -> bool:
    """Prefix sharing needs a custom attention mask: sdpa and eager take one, flash
    attention's varlen kernels do not."""
    impl = getattr(getattr(_unwrapped(module), "config", None), "_attn_implementation", None)
    return impl in ("sdpa", "eager")


def _segments(module: nn.Module) -> bool:
    """Attention one packed sequence at a time (`agentrl.models.packed_attention`): for a
    model on transformers' SDPA whose forward passes keyword arguments on to its attention."""
    inner = _unwrapped(module)
    impl = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if impl != packed_attention.NAME:
        return False
    try:
        params = inspect.signature(inner.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _accepts_logits_to_keep(module: nn.Module) -> bool:
    """transformers causal LMs compute logits only at `logits_to_keep` positions (any logit
    soft-capping included); FSDP wrappers keep the signature, DeepSpeed's engine passes it on."""
    try:
        return "logits_to_keep" in inspect.signature(_unwrapped(module).forward).parameters
    except (TypeError, ValueError):
        return False


def _unwrapped(module: nn.Module) -> nn.Module:
    """The model inside a DeepSpeed engine or peft's LoRA wrapper (which have their own
    forward signatures; both pass the model's keyword arguments on)."""
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and isinstance(module, deepspeed.DeepSpeedEngine):
        module = module.module
    get_base = getattr(module, "get_base_model", None)
    if callable(get_base) and hasattr(module, "peft_config"):
        module = get_base()
    return module
