"""A lean decode step for Llama-architecture models, bit-identical to their transformers forward.

A decode step feeds one token per row. Through `LlamaForCausalLM.forward`, a step of
SmolLM2-135M (30 layers, 8 rows, fp32, 2-core CPU) spends ~57 ms in the GEMMs and ~18 ms
(median) around them: `create_causal_mask` each step, a bool mask converted to an additive one in
every layer, `rotate_half` (two slices, a negation and a concatenation per tensor), module calls
with their decorators and output dataclasses. `decode_logits` runs the same arithmetic in the
same order, so logits, sampled tokens and logprobs are bit-identical (tests/engine compares them
exactly), with one additive mask per step and the rotation done by a flip:

    rotate_half(x) * sin == flip(x halves) * [-sin_1, sin_2]    (IEEE negation is exact)

A whole engine step then spends ~10 ms (median) outside the GEMMs: ~3 ms of attention reading
the KV cache from memory, ~1 ms of sampling, and ~2 us of dispatch for each of ~1400 small ops.

It reads the model's own parameters at every step (no copies), so a colocated trainer's
in-place updates are seen at once. Models it does not cover exactly (other classes, LoRA or
quantized projections, module hooks, eager/flash attention, attention dropout in training mode)
get None and the engine runs their forward.

Shapes: `_B` rows, `_T` cache columns, `_V` vocabulary.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NotRequired, TypedDict, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module
from transformers.activations import SiLUActivation
from transformers.integrations import sdpa_attention as _sdpa
from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa
from transformers.models.llama import modeling_llama as _llama

from agentrl.backends.cpu import kernels
from agentrl.engine.kv import BufferLayer

if TYPE_CHECKING:
    from transformers.cache_utils import Cache, CacheLayerMixin

_PACKS_GQA = hasattr(_sdpa, "pack_gqa")
"""Whether the installed transformers' SDPA attention groups a single query's heads over the
KV heads (`pack_gqa`, newer releases) or repeats the KV heads; the lean step does the same, so
it stays bit-identical to the forward of the transformers at hand."""

SILU_CLASSES = (SiLUActivation, nn.SiLU)
"""Activation modules computing exactly `F.silu` (also used by trainers/fused.py)."""


class _Layer(NamedTuple):
    """One decoder layer's parameters (the module's own tensors) and constants."""

    norm_in: torch.Tensor
    eps_in: float
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    scaling: float
    o: torch.Tensor
    o_bias: torch.Tensor | None
    norm_post: torch.Tensor
    eps_post: float
    gate: torch.Tensor
    gate_bias: torch.Tensor | None
    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]


class _Plan(NamedTuple):
    """The whole model's tensors and shapes for one decode step."""

    embed: torch.Tensor
    rotary: nn.Module
    layers: list[_Layer]
    norm: torch.Tensor
    eps: float
    lm_head: torch.Tensor
    lm_head_bias: torch.Tensor | None
    n_heads: int
    n_kv: int
    head_dim: int


def decode_logits(
    model: nn.Module,
    ids_B: torch.Tensor,
    pos_B: torch.Tensor,
    cache: Cache,
    mask_B_T: torch.Tensor,
    *,
    cpu_kernels: bool = False,
    wide_kernels: bool = False,
    counters: collections.Counter | None = None,
) -> torch.Tensor | None:
    """Next-token logits `[B, V]` after feeding `ids_B` at positions `pos_B`, or None when the
    model is not one this step reproduces exactly (call its forward instead).

    `cache` holds T - 1 columns per layer and gets the new keys/values appended; `mask_B_T`
    (1 = real token) covers the cache columns and the new one. Without kernels the step is
    bit-identical to the model's forward. A float32 CPU step may instead run each layer in
    `agentrl.backends.cpu.kernels` (equal up to float32 round-off; see there):
    - `cpu_kernels`, at most `kernels.MAX_ROWS` rows: the whole layer, projections through the
      row GEMM;
    - `wide_kernels`, more rows: the layer with ATen's GEMMs for the projections, and attention,
      rotary embedding, norms and gating in the kernel. The forward's attention repeats each
      KV head for its query heads (a copy of the whole cache per layer) and runs SDPA with a
      padding mask: at 64 rows and 74 columns 81 ms of a 294 ms step (the GEMMs 182 ms).
    `counters["kernel_decode_steps"]` counts the steps that ran in the kernels.
    """
    plan = _plan(model)
    if plan is None:
        return None
    n_heads, n_kv, head_dim = plan.n_heads, plan.n_kv, plan.head_dim
    rows = ids_B.shape[0]
    # Hidden states are [B, hidden] (transformers: [B, 1, hidden]); a linear layer folds the
    # 3-D input to this very matrix, so only the dispatch differs.
    x = F.embedding(ids_B, plan.embed)
    cos, sin = plan.rotary(x, pos_B[:, None])
    few = rows <= kernels.MAX_ROWS
    if (cpu_kernels if few else wide_kernels) and (
        mod := _kernel_module(plan, x, cache)
    ) is not None:
        # `_kernel_module` checked that every layer is a BufferLayer. Past MAX_ROWS no weight
        # is large enough for the row GEMM: ATen multiplies them all.
        min_numel = kernels.MIN_WEIGHT_NUMEL if few else _NO_ROW_GEMM
        _kernel_layers(mod, plan, x, cast("list[BufferLayer]", cache.layers), mask_B_T, cos,
                       sin, min_numel)
        if counters is not None:
            counters["kernel_decode_steps"] += 1
        x = _rms_norm(x, plan.norm, plan.eps)
        return kernels.linear(x, plan.lm_head, plan.lm_head_bias)
    half = head_dim // 2
    cos = cos[:, None]
    sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, None]
    # What `create_causal_mask` builds for one query per row (no mask when nothing is padded),
    # made additive once here instead of in every layer's attention.
    mask = None
    if not bool(mask_B_T.all()):
        mask = torch.zeros(rows, 1, 1, mask_B_T.shape[1], dtype=x.dtype, device=x.device)
        mask.masked_fill_(mask_B_T[:, None, None, :] == 0, float("-inf"))
    groups = n_heads // n_kv
    # A Llama model's cache holds attention layers only (no linear-attention ones).
    attn_layers = cast("list[CacheLayerMixin]", cache.layers)
    for w, layer in zip(plan.layers, attn_layers, strict=True):
        h = _rms_norm(x, w.norm_in, w.eps_in)
        q = F.linear(h, w.q, w.q_bias).view(rows, n_heads, 1, head_dim)
        k = F.linear(h, w.k, w.k_bias).view(rows, n_kv, 1, head_dim)
        v = F.linear(h, w.v, w.v_bias).view(rows, n_kv, 1, head_dim)
        q = _rotate(q, cos, sin_signed)
        k = _rotate(k, cos, sin_signed)
        k, v = layer.update(k, v)
        # The branches of transformers' `sdpa_attention_forward` for one query per row.
        if groups == 1:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=w.scaling)
        elif use_gqa_in_sdpa(mask, k, v):
            o = F.scaled_dot_product_attention(q, k, v, scale=w.scaling, enable_gqa=True)
        elif _PACKS_GQA:  # one query per row: the query heads grouped over the KV heads
            q = q.reshape(rows, n_kv, groups, head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=w.scaling)
        else:  # transformers before `pack_gqa` (5.19, vLLM 0.32's pin): KV heads repeated
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=w.scaling)
        x = x + F.linear(o.reshape(rows, n_heads * head_dim), w.o, w.o_bias)
        h = _rms_norm(x, w.norm_post, w.eps_post)
        gate = w.act(F.linear(h, w.gate, w.gate_bias))
        x = x + F.linear(gate.mul_(F.linear(h, w.up, w.up_bias)), w.down, w.down_bias)
    x = _rms_norm(x, plan.norm, plan.eps)
    return F.linear(x, plan.lm_head, plan.lm_head_bias)


_NO_ROW_GEMM = (1 << 63) - 1
"""`min_numel` for `decode_layer` that sends every projection to ATen's GEMM."""


def _kernel_module(plan: _Plan, x: torch.Tensor, cache: Cache) -> Any:
    """The compiled kernels where they can take this step: float32 on CPU, SiLU MLPs,
    contiguous weights, agentrl's buffered cache."""
    if (
        x.dtype is not torch.float32
        or x.device.type != "cpu"
        or plan.head_dim % 2
        or not all(isinstance(layer, BufferLayer) for layer in cache.layers)
    ):
        return None
    for w in plan.layers:
        if w.act is not F.silu or not all(
            t.dtype is torch.float32 and t.is_contiguous() for t in w if isinstance(t, torch.Tensor)
        ):
            return None
    return kernels.module()


def _kernel_layers(
    mod: Any,
    plan: _Plan,
    x: torch.Tensor,
    cache_layers: Sequence[BufferLayer],
    mask_B_T: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    min_numel: int,
) -> None:
    """All decoder layers through `mod.decode_layer`, updating `x` [B, hidden] in place;
    weights of more than `min_numel` elements go through the row GEMM."""
    rows = x.shape[0]
    live = mask_B_T.to(torch.bool).contiguous()
    cos = cos.reshape(rows, -1).contiguous()
    sin = sin.reshape(rows, -1).contiguous()
    for w, layer in zip(plan.layers, cache_layers, strict=True):
        layer.reserve(1)
        mod.decode_layer(
            x, w.norm_in, w.eps_in,
            w.q, w.q_bias, w.k, w.k_bias, w.v, w.v_bias, w.o, w.o_bias,
            w.norm_post, w.eps_post,
            w.gate, w.gate_bias, w.up, w.up_bias, w.down, w.down_bias,
            layer.buf_k, layer.buf_v, layer.length, live, cos, sin,
            plan.n_heads, plan.n_kv, w.scaling, min_numel,
        )  # fmt: skip
        layer.advance(1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`LlamaRMSNorm.forward`, op for op."""
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    return weight * (h * torch.rsqrt(var.add_(eps))).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` with the halves swapped by a flip (see module doc)."""
    b, h, t, d = x.shape
    swapped = x.view(b, h, t, 2, d // 2).flip(-2).view(b, h, t, d)
    return (x * cos).add_(swapped * sin_signed)


def _plan(model: nn.Module) -> _Plan | None:
    """The model's tensors for `decode_logits`, or None unless every module is the stock Llama
    one, without hooks, in a configuration the lean step reproduces.

    Built at every step, so swapped modules (LoRA, parametrizations), new hooks and replaced
    parameters are seen at once; the walk reads the modules' dicts directly (~0.16 ms for 30
    layers, where going through `nn.Module.__getattr__` took ~0.8 ms).
    """
    if _module._global_forward_hooks or _module._global_forward_pre_hooks:
        return None
    if type(model) is not _llama.LlamaForCausalLM or _hooked(model):
        return None
    cfg = model.config
    if (
        cfg._attn_implementation != "sdpa"
        or not getattr(cfg, "is_causal", True)
        or (model.training and cfg.attention_dropout != 0)
        or cfg.num_key_value_heads is None  # never (LlamaConfig sets it); narrows the type
    ):
        return None
    try:
        inner = _child(model, "model", _llama.LlamaModel)
        embed = _child(inner, "embed_tokens", nn.Embedding)
        layers = _child(inner, "layers", nn.ModuleList)
        norm = _child(inner, "norm", _llama.LlamaRMSNorm)
        lm_head = _child(model, "lm_head", nn.Linear)
        if embed.max_norm is not None or len(layers) != cfg.num_hidden_layers:
            return None
        plan = [_layer_plan(layer) for layer in layers._modules.values()]
        attn = _child(_child(layers, "0", _llama.LlamaDecoderLayer), "self_attn",
                      _llama.LlamaAttention)
        head = _params(lm_head)
        return _Plan(
            _params(embed)["weight"],
            _child(inner, "rotary_emb", _llama.LlamaRotaryEmbedding),
            plan,
            _params(norm)["weight"],
            norm.variance_epsilon,
            head["weight"],
            head["bias"],
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            attn.head_dim,
        )
    except (_Unsupported, KeyError):  # KeyError: a weight that is no longer a parameter
        return None


def _layer_plan(layer: nn.Module) -> _Layer:
    if type(layer) is not _llama.LlamaDecoderLayer or _hooked(layer):
        raise _Unsupported
    attn = _child(layer, "self_attn", _llama.LlamaAttention)
    mlp = _child(layer, "mlp", _llama.LlamaMLP)
    n_in = _child(layer, "input_layernorm", _llama.LlamaRMSNorm)
    post = _child(layer, "post_attention_layernorm", _llama.LlamaRMSNorm)
    q, k, v, o = (_params(_child(attn, n, nn.Linear)) for n in _ATTN_PROJ)
    gate, up, down = (_params(_child(mlp, n, nn.Linear)) for n in _MLP_PROJ)
    act = mlp._modules["act_fn"]
    if act is None or _hooked(act):
        raise _Unsupported
    act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu if type(act) in SILU_CLASSES else act
    return _Layer(
        _params(n_in)["weight"], n_in.variance_epsilon,
        q["weight"], q["bias"], k["weight"], k["bias"], v["weight"], v["bias"], attn.scaling,
        o["weight"], o["bias"],
        _params(post)["weight"], post.variance_epsilon,
        gate["weight"], gate["bias"], up["weight"], up["bias"], down["weight"], down["bias"],
        act_fn,
    )  # fmt: skip


_ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


class _Unsupported(Exception):
    """A module the lean step does not reproduce exactly."""


_M = TypeVar("_M", bound=nn.Module)


def _child(parent: nn.Module, name: str, cls: type[_M]) -> _M:
    m = parent._modules.get(name)
    # The cpu backend's training stand-ins (fused.FusedRMSNorm, fused.FusedSwiGLUMLP,
    # grads.RowsInPlaceEmbedding) hold the replaced module's parameters under the same names
    # and say which class they replace: the step reads them as that class's.
    if m is None or (m.__dict__.get("replaces") or type(m)) is not cls or _hooked(m):
        raise _Unsupported
    return cast(_M, m)  # read as `cls`: checked above (or a stand-in that replaces it)


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


class _Params(TypedDict):
    """`_parameters` of a stock module: its weight, and its bias where it has one (None when
    turned off). A weight replaced by a plain tensor is missing (KeyError)."""

    weight: torch.Tensor
    bias: NotRequired[torch.Tensor | None]


if TYPE_CHECKING:

    def _params(m: nn.Module) -> _Params:
        """`m._parameters`, typed."""
        ...

else:  # a C call, not a Python one: the walk runs at every step
    _params = operator.attrgetter("_parameters")
