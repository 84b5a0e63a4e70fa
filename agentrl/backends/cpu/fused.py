"""Fused CPU kernels for the training forward and backward of Llama-style models (float32).

Through autograd, an `LlamaRMSNorm` is ~6 tensor operations forward and ~10 backward, and the
gated MLP's `silu(gate) * up` 2 forward and 3 backward, each a pass over [tokens, width] with its
own dispatch and temporaries. For SmolLM2-135M (61 norms, 30 MLPs) on the 2-core CPU that is
~0.1 s of a ~2.3 s GRPO update. `use_fused_kernels(model)` routes these modules' forwards through
`agentrl.backends.cpu.kernels` (csrc/cpu_train.cpp): one pass forward, one backward. Results equal
autograd's up to float32 round-off (other summation orders, a polynomial exp); tests compare
values and gradients.

The modules keep their type, parameters and hooks (the engine's decode step, checkpoints and
exports see the same model); only `forward` is set on the instance, and it falls back to the
module's own forward where the kernels do not apply (not float32 on CPU, or not built).

`logprobs_and_entropy` is the same for the loss's input: the policy tokens' log-probs and the
entropies over the vocabulary, one pass per token each way (see there).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from agentrl.backends.cpu import kernels


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y, r = kernels.module().rms_norm_forward(x2, weight, eps)
        ctx.save_for_backward(x2, weight, r)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, None]:
        x2, weight, r = ctx.saved_tensors
        dx, dw = kernels.module().rms_norm_backward(
            dy.reshape(x2.shape).contiguous(), x2, weight, r
        )
        return dx.view(dy.shape), dw, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        return kernels.module().swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        dg, du = kernels.module().swiglu_backward(dy.contiguous(), gate, up)
        return dg, du


class _LogProbEntropy(torch.autograd.Function):
    """`algorithms.logprobs_and_entropy_from_logits` for one packed sequence [T, V]: saves the
    logits (alive anyway as the lm_head's output) and the per-token log-sum-exp, not p."""

    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, labels: Tensor, temperature: float, into_logits: bool
    ) -> tuple[Tensor, Tensor]:
        logits, labels = logits.contiguous(), labels.long().contiguous()
        logp, ent, lse = kernels.module().logprob_entropy_forward(logits, labels, temperature)
        ctx.set_materialize_grads(False)  # an unused entropy (a logged metric) costs nothing
        ctx.save_for_backward(logits, labels, lse, ent)
        ctx.temperature, ctx.into_logits = temperature, into_logits
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad_logp: Tensor | None, grad_ent: Tensor | None
    ) -> tuple[Tensor | None, None, None, None]:
        if grad_logp is None and grad_ent is None:
            return None, None, None, None
        logits, labels, lse, ent = ctx.saved_tensors
        dz = kernels.module().logprob_entropy_backward(
            logits, labels, lse, ent, grad_logp, grad_ent, ctx.temperature, ctx.into_logits
        )
        if ctx.into_logits:  # any other saved use of the logits now fails loudly in autograd
            torch.autograd.graph.increment_version(logits)
        return dz, None, None, None


def logprobs_and_entropy(
    logits_TV: Tensor, labels_T: Tensor, temperature: float, *, into_logits: bool = False
) -> tuple[Tensor, Tensor] | None:
    """Log-probs of `labels_T` and entropies of softmax(logits / temperature), `[T, V], [T] ->
    ([T], [T])`, in one pass per token each way; None where the kernels do not apply (not
    float32 on CPU, or not built), for the caller to use `algorithms`' function. Values and
    gradients equal that function's up to float32 round-off.

    Through torch (`logprobs_and_entropy_from_logits`) the forward writes the log-softmax and p
    and reads them back for the gather and the entropy: ~52 ms for SmolLM2's 256 x 49k logits
    on the 2-core CPU, here ~7 ms. With `into_logits` the backward writes the logits' gradient
    over the logits themselves (a fresh 50 MB tensor costs ~15 ms of page faults there): for a
    caller that holds the logits for nothing else, since their values are gone after it."""
    # The cheap checks first: a tensor that is not float32 on the CPU never builds the kernels.
    if logits_TV.dim() != 2 or not _applies(logits_TV) or temperature <= 0:
        return None
    if kernels.module() is None:
        return None
    return _LogProbEntropy.apply(logits_TV, labels_T, float(temperature), into_logits)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`weight * x * rsqrt(mean(x^2) + eps)` over the last dimension, one pass each way."""
    return _RMSNorm.apply(x, weight, float(eps))


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up`, one pass each way."""
    return _SwiGLU.apply(gate, up)


def _applies(*tensors: Tensor) -> bool:
    return all(t.dtype is torch.float32 and t.device.type == "cpu" for t in tensors)


def _rms_norm_forward(norm: Any, x: Tensor) -> Tensor:  # a Llama-style RMSNorm module
    weight = norm.weight
    if not _applies(x, weight) or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        return type(norm).forward(norm, x)
    return _RMSNorm.apply(x, weight, float(norm.variance_epsilon))


def _mlp_forward(mlp: Any, x: Tensor) -> Tensor:  # a Llama-style SiLU-gated MLP module
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    if not _applies(gate, up):  # bf16 weights or autocast: the module's own arithmetic
        return mlp.down_proj(mlp.act_fn(gate) * up)
    return mlp.down_proj(_SwiGLU.apply(gate, up))


def use_fused_kernels(model: nn.Module) -> int:
    """Route the model's RMSNorms and SiLU-gated MLPs through the fused kernels; returns how
    many modules were routed (0 where the kernels are not built, turned off with
    `AGENTRL_CPU_KERNELS=0`, or the model has no such modules)."""
    if kernels.module() is None:
        return 0
    routed = 0
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") and _is_llama_rms_norm(module):
            module.forward = functools.partial(_rms_norm_forward, module)
            routed += 1
        elif name.endswith("MLP") and _is_gated_silu_mlp(module):
            module.forward = functools.partial(_mlp_forward, module)
            routed += 1
    return routed


def _is_llama_rms_norm(module: nn.Module) -> bool:
    """`weight * (x * rsqrt(mean(x^2) + eps))` exactly (Llama, Mistral, Qwen2/3): not Gemma's
    `1 + weight`, which has `type(module).forward` of its own."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    forward = type(module).forward
    return (
        (forward is LlamaRMSNorm.forward or _same_code(forward, LlamaRMSNorm.forward))
        and isinstance(getattr(module, "weight", None), nn.Parameter)
        and hasattr(module, "variance_epsilon")
    )


def _is_gated_silu_mlp(module: nn.Module) -> bool:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))` with SiLU (the Llama MLP's forward)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from agentrl.backends.cpu.decode import SILU_CLASSES

    forward = type(module).forward
    return (
        (forward is LlamaMLP.forward or _same_code(forward, LlamaMLP.forward))
        and all(isinstance(getattr(module, n, None), nn.Linear) for n in _MLP)
        and type(module.act_fn) in SILU_CLASSES
    )


_MLP = ("gate_proj", "up_proj", "down_proj")


def _same_code(a: Any, b: Any) -> bool:
    """Whether two functions have the same bytecode and constants (transformers copies the
    Llama modules into other models' files as separate classes)."""
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if ca is None or cb is None:
        return False
    return (ca.co_code, ca.co_consts, ca.co_names) == (cb.co_code, cb.co_consts, cb.co_names)
