"""Fused CPU kernels for the training forward and backward of Llama-style models (float32).

Through autograd, an `LlamaRMSNorm` is ~6 tensor operations forward and ~10 backward, and the
gated MLP's `silu(gate) * up` 2 forward and 3 backward, each a pass over [tokens, width] with its
own dispatch and temporaries. For SmolLM2-135M (61 norms, 30 MLPs) on the 2-core CPU that is
~0.1 s of a ~2.3 s GRPO update. `use_fused_kernels(model)` replaces these modules, once at the cpu
backend's set-up, by `FusedRMSNorm` and `FusedSwiGLUMLP`, which compute through
`agentrl.backends.cpu.kernels` (csrc/cpu_train.cpp): one pass forward, one backward. Results equal
autograd's up to float32 round-off (other summation orders, a polynomial exp); tests compare
values and gradients.

A replacement holds the very parameters and child modules of the module it replaces, under the
same names, so the model's `state_dict` (checkpoints, exports, the weights synced to an engine)
has the same keys, order and tensors; its `replaces` attribute names the replaced class (the lean
decode step reads the parameters as that class's), and it takes over the module's hooks. Where
the kernels do not apply (not float32 on CPU, or turned off) it computes as the replaced module
did.

`logprobs_and_entropy` is the same for the loss's input: the policy tokens' log-probs and the
entropies over the vocabulary, one pass per token each way (see there).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from agentrl.backends.cpu import kernels
from agentrl.backends.cpu.decode import SILU_CLASSES
from agentrl.backends.cpu.grads import take_over_hooks


class _RMSNorm(torch.autograd.Function):
    """`mod` is the kernels' module, taken once by the caller (and kept for the backward)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, mod: Any) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y, r = mod.rms_norm_forward(x2, weight, eps)
        ctx.save_for_backward(x2, weight, r)
        ctx.mod = mod
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x2, weight, r = ctx.saved_tensors
        dx, dw = ctx.mod.rms_norm_backward(dy.reshape(x2.shape).contiguous(), x2, weight, r)
        return dx.view(dy.shape), dw, None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor, mod: Any) -> Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.mod = mod
        return mod.swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, None]:
        gate, up = ctx.saved_tensors
        dg, du = ctx.mod.swiglu_backward(dy.contiguous(), gate, up)
        return dg, du, None


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
    """`weight * x * rsqrt(mean(x^2) + eps)` over the last dimension, one pass each way (the
    kernels must be built)."""
    return _RMSNorm.apply(x, weight, float(eps), kernels.module())


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """`silu(gate) * up`, one pass each way (the kernels must be built)."""
    return _SwiGLU.apply(gate, up, kernels.module())


def _applies(*tensors: Tensor) -> bool:
    return all(t.dtype is torch.float32 and t.device.type == "cpu" for t in tensors)


class FusedRMSNorm(nn.Module):
    """A Llama-style RMSNorm, `weight * (x * rsqrt(mean(x^2) + eps))`, through the fused kernel:
    the replaced module's `weight` (the same Parameter) and `variance_epsilon`."""

    replaces: type[nn.Module]
    """The replaced module's class."""

    def __init__(self, weight: nn.Parameter, eps: float, replaces: type[nn.Module]) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps
        self.replaces = replaces

    @classmethod
    def from_module(cls, norm: nn.Module) -> FusedRMSNorm:
        """The fused stand-in for `norm`, sharing its weight and hooks; TypeError unless `norm`
        computes exactly `LlamaRMSNorm.forward`."""
        if not _is_llama_rms_norm(norm):
            raise TypeError(f"FusedRMSNorm replaces a Llama-style RMSNorm, got {type(norm)}")
        weight, eps = cast(nn.Parameter, norm.weight), cast(float, norm.variance_epsilon)
        fused = cls(weight, float(eps), type(norm))
        take_over_hooks(fused, norm)
        return fused

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        mod = kernels.module()
        if (
            mod is None
            or not _applies(x, weight)
            or weight.dim() != 1
            or x.shape[-1] != weight.shape[0]
        ):
            # The replaced module's own arithmetic: from_module checked that its forward is
            # this code, which reads only `weight` and `variance_epsilon`.
            return LlamaRMSNorm.forward(cast(LlamaRMSNorm, self), x)
        return _RMSNorm.apply(x, weight, self.variance_epsilon, mod)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused kernel"


class FusedSwiGLUMLP(nn.Module):
    """A Llama-style gated MLP, `down_proj(silu(gate_proj(x)) * up_proj(x))`, with the gating
    through the fused kernel: the replaced module's own projections and activation."""

    replaces: type[nn.Module]
    """The replaced module's class."""

    def __init__(
        self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, act_fn: nn.Module,
        replaces: type[nn.Module],
    ) -> None:
        super().__init__()
        # Registered in the replaced module's order: same parameter order (and so the same
        # optimizer state layout in checkpoints) and state_dict order.
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.act_fn = act_fn
        self.replaces = replaces

    @classmethod
    def from_module(cls, mlp: nn.Module) -> FusedSwiGLUMLP:
        """The fused stand-in for `mlp`, sharing its children and hooks; TypeError unless `mlp`
        computes exactly `LlamaMLP.forward` with SiLU."""
        if not _is_gated_silu_mlp(mlp):
            raise TypeError(
                f"FusedSwiGLUMLP replaces a SiLU-gated Llama-style MLP, got {type(mlp)}"
            )
        gate, up, down = (cast(nn.Linear, getattr(mlp, name))
                          for name in ("gate_proj", "up_proj", "down_proj"))
        fused = cls(gate, up, down, cast(nn.Module, mlp.act_fn), type(mlp))
        take_over_hooks(fused, mlp)
        return fused

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        mod = kernels.module()
        if mod is None or not _applies(gate, up):  # bf16 weights or autocast: plain arithmetic
            return self.down_proj(self.act_fn(gate) * up)
        return self.down_proj(_SwiGLU.apply(gate, up, mod))


def use_fused_kernels(model: nn.Module) -> int:
    """Replace the model's Llama-style RMSNorms and SiLU-gated MLPs by `FusedRMSNorm` and
    `FusedSwiGLUMLP` (in place; the state_dict is unchanged); returns how many modules were
    replaced (0 where the kernels are not built, turned off with `AGENTRL_CPU_KERNELS=0`, or the
    model has no such modules). Idempotent."""
    if kernels.module() is None:
        return 0
    swaps: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name:  # not the root itself
            continue
        kind = type(module).__name__
        if kind.endswith("RMSNorm") and _is_llama_rms_norm(module):
            swaps.append((name, FusedRMSNorm.from_module(module)))
        elif kind.endswith("MLP") and _is_gated_silu_mlp(module):
            swaps.append((name, FusedSwiGLUMLP.from_module(module)))
    for name, fused in swaps:
        model.set_submodule(name, fused)
    return len(swaps)


def _is_llama_rms_norm(module: nn.Module) -> bool:
    """`weight * (x * rsqrt(mean(x^2) + eps))` exactly (Llama, Mistral, Qwen2/3): not Gemma's
    `1 + weight`, which has `type(module).forward` of its own. Its state is the one weight
    (what a `FusedRMSNorm` holds)."""
    forward = type(module).forward
    return (
        (forward is LlamaRMSNorm.forward or _same_code(forward, LlamaRMSNorm.forward))
        and isinstance(module._parameters.get("weight"), nn.Parameter)
        and len(module._parameters) == 1
        and not module._buffers
        and not module._modules
        and hasattr(module, "variance_epsilon")
    )


def _is_gated_silu_mlp(module: nn.Module) -> bool:
    """`down_proj(act_fn(gate_proj(x)) * up_proj(x))` with SiLU (the Llama MLP's forward), its
    state in those linear layers, registered in the Llama order (a `FusedSwiGLUMLP` registers
    them in that order: the same parameter and state_dict order)."""
    forward = type(module).forward
    return (
        (forward is LlamaMLP.forward or _same_code(forward, LlamaMLP.forward))
        and tuple(module._modules) == (*_MLP, "act_fn")
        and all(isinstance(module._modules[n], nn.Linear) for n in _MLP)
        and type(module._modules["act_fn"]) in SILU_CLASSES
        and not module._parameters
        and not module._buffers
    )


_MLP = ("gate_proj", "up_proj", "down_proj")


def _same_code(a: Any, b: Any) -> bool:
    """Whether two functions have the same bytecode and constants (transformers copies the
    Llama modules into other models' files as separate classes)."""
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if ca is None or cb is None:
        return False
    return (ca.co_code, ca.co_consts, ca.co_names) == (cb.co_code, cb.co_consts, cb.co_names)
