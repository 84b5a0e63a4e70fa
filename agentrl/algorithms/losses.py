"""Policy, value and entropy terms, and their reduction to a scalar.

Shape suffixes: ``_B`` batch (sequences), ``_T`` tokens (time), ``_V`` vocab. Per-token tensors
are ``[B, T]``; ``mask_BT`` is 1.0 on the action tokens that carry loss.

The per-token surrogates (:func:`policy_loss`, :func:`value_loss`) are kept apart from the
reduction (:func:`aggregate_loss`), so any surrogate can be combined with any normaliser and
with per-token weights such as :func:`agentrl.algorithms.corrections.mismatch_weights`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, Literal, overload

import torch
from torch import Tensor

from agentrl.algorithms._common import lookup, masked_mean, register

PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""Called with keywords ``logp_BT, old_logp_BT, advantages_BT, mask_BT`` and optionally
``clip_low, clip_high, dual_clip``; returns ``(loss_BT, metrics)`` with ``loss_BT`` 0 off-mask."""

LOG_RATIO_CLAMP = 20.0


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> None:
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(
            f"Clip range needs 0 <= clip_low < 1 and clip_high >= 0; got clip_low={clip_low}, "
            f"clip_high={clip_high}."
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020 use 3); got {dual_clip}.")


def _clipped_surrogate(
    log_ratio_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)``, dual-clipped for ``A < 0``; 0 off-mask."""
    ratio_BT = torch.exp(log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    surr1_BT = ratio_BT * advantages_BT
    surr2_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages_BT
    loss_BT = -torch.min(surr1_BT, surr2_BT)
    metrics = {"clip_ratio": masked_mean((surr2_BT < surr1_BT).float(), mask_BT).detach()}
    if dual_clip is not None:
        # Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729): -max(min(s1, s2), c*A) for A < 0.
        bound_BT = -dual_clip * advantages_BT
        dual_BT = (advantages_BT < 0) & (loss_BT > bound_BT)
        loss_BT = torch.where(dual_BT, bound_BT, loss_BT)
        metrics["dual_clip_ratio"] = masked_mean(dual_BT.float(), mask_BT).detach()
    loss_BT = torch.where(mask_BT != 0, loss_BT, torch.zeros_like(loss_BT))
    return loss_BT, metrics


def ppo_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate per token (Schulman et al. 2017, arXiv:1707.06347).

    ``rho_t = exp(clamp(logp_t - old_t, -20, 20))``,
    ``loss_t = -min(rho_t A_t, clamp(rho_t, 1 - clip_low, 1 + clip_high) A_t)``; clip_high >
    clip_low is DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476). With ``dual_clip = c > 1``
    and ``A_t < 0``: ``loss_t = -max(min(...), c A_t)``. All inputs ``[B, T]``; returns the
    un-reduced ``loss_BT`` (0 off-mask) and detached metrics ``clip_ratio`` (share of action
    tokens where the clipped term is the smaller) and ``approx_kl`` (masked mean of old - logp).
    """
    _check_clip(clip_low, clip_high, dual_clip)
    loss_BT, metrics = _clipped_surrogate(
        logp_BT - old_logp_BT, advantages_BT, mask_BT, clip_low, clip_high, dual_clip
    )
    metrics["approx_kl"] = masked_mean(old_logp_BT - logp_BT, mask_BT).detach()
    return loss_BT, metrics


def gspo_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the PPO surrogate on the sequence ratio (Zheng et al. 2025, arXiv:2507.18071).

    ``s_i = exp(sum_t mask (logp - old) / sum_t mask)`` (geometric mean of token ratios).
    Implemented as GSPO-token (paper eq. 13): ``s_it = sg[s_i] * pi_t / sg[pi_t]``, which has
    the value ``s_i`` on every token, and, with one advantage per sequence and a per-sequence
    token-mean (``aggregate_loss(..., "seq-mean-token-mean")``, the paper's reduction), exactly
    the gradient of the sequence-level objective. Clip defaults 3e-4 / 4e-4 as in the paper.
    Shapes and metrics as :func:`ppo_loss`.
    """
    _check_clip(clip_low, clip_high, dual_clip)
    seq_log_ratio_B = masked_mean(logp_BT - old_logp_BT, mask_BT, dim=-1)
    log_ratio_BT = logp_BT - logp_BT.detach() + seq_log_ratio_B.detach()[:, None]
    loss_BT, metrics = _clipped_surrogate(
        log_ratio_BT, advantages_BT, mask_BT, clip_low, clip_high, dual_clip
    )
    metrics["approx_kl"] = masked_mean(old_logp_BT - logp_BT, mask_BT).detach()
    return loss_BT, metrics


CISPO_CLIP_LOW = 1.0
"""CISPO's default lower epsilon: the weight's lower bound ``1 - 1 = 0`` binds no ratio, as the
paper sets eps_low "to a large value" so as to impose no lower bound."""
CISPO_CLIP_HIGH = 3.0
"""CISPO's default upper epsilon (weights capped at 4). The paper tunes eps_high without giving
its value; 4 is Tinker's default cap for CISPO (TRL and NeMo-RL suggest 5 and 6)."""


def check_cispo_clip(
    clip_low: float | None,
    clip_high: float | None,
    *,
    names: tuple[str, str] = ("clip_low", "clip_high"),
) -> tuple[float, float]:
    """CISPO's ``(clip_low, clip_high)``, ``None`` taking the defaults; ``ValueError`` naming
    ``names`` (the caller's flags) where ``[1 - clip_low, 1 + clip_high]`` is empty or inverted.

    The range must hold the on-policy weight 1 and be more than that one point: ``clip_low >=
    0`` (``>= 1`` means no lower bound), ``clip_high >= 0``, not both 0.
    """
    low = CISPO_CLIP_LOW if clip_low is None else clip_low
    high = CISPO_CLIP_HIGH if clip_high is None else clip_high
    if low >= 0 and high >= 0 and low + high > 0:
        return low, high
    lower, upper = 1.0 - low, 1.0 + high
    if math.isnan(lower) or math.isnan(upper):
        what = "has no bound (NaN)"
    elif lower > upper:
        what = "is inverted (its lower bound is above its upper bound)"
    elif lower == upper:
        what = "is empty (one point: every weight would be 1)"
    else:
        what = "leaves out the on-policy weight 1"
    raise ValueError(
        f"{names[0]}={low:g} and {names[1]}={high:g} give CISPO the clip range [1 - {names[0]}, "
        f"1 + {names[1]}] = [{lower:g}, {upper:g}], which {what}; use {names[0]} >= 0 and "
        f"{names[1]} >= 0, not both 0 (the defaults {CISPO_CLIP_LOW:g} and "
        f"{CISPO_CLIP_HIGH:g}: no lower bound, as in the paper, and a cap of "
        f"{1 + CISPO_CLIP_HIGH:g})."
    )


def cispo_loss(
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float = CISPO_CLIP_LOW,
    clip_high: float = CISPO_CLIP_HIGH,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE weighted by the clipped, stop-gradient importance ratio (MiniMax-M1,
    MiniMax 2025, arXiv:2506.13585, eq. 4).

    ``r_t = exp(clamp(logp_t - old_t, -20, 20))``, ``w_t = sg(clamp(r_t, 1 - clip_low, 1 +
    clip_high))``, ``loss_t = -w_t A_t logp_t``, so ``grad loss_t = -w_t A_t grad logp_t`` on
    every action token: the ratio is bounded, never the update, so no token's gradient is dropped
    (PPO's ``min`` zeroes the gradient of the tokens outside its range, often the rare tokens that
    turn a chain of thought). The paper averages over all tokens of the batch
    (``aggregate_loss(..., "token-mean")``), imposes no lower bound (eps_low large: here
    ``clip_low >= 1``) and tunes eps_high; defaults :data:`CISPO_CLIP_LOW` 1 and
    :data:`CISPO_CLIP_HIGH` 3 (weights in ``[0, 4]``). A range that is empty or inverted is
    refused (:func:`check_cispo_clip`); ``dual_clip`` has no term to bound here and is refused.
    All inputs ``[B, T]``; returns ``loss_BT`` (0 off-mask) and detached metrics ``clip_ratio``
    (share of action tokens whose weight was clipped) and ``approx_kl`` (masked mean of old -
    logp).
    """
    check_cispo_clip(clip_low, clip_high)
    if dual_clip is not None:
        raise ValueError(
            f"dual_clip={dual_clip:g} bounds PPO's clipped surrogate for negative advantages; "
            f"CISPO has no such term (its weight is capped at 1 + clip_high): leave dual_clip "
            f"unset."
        )
    log_ratio_BT = (logp_BT - old_logp_BT).detach()  # sg: the weight is a constant
    ratio_BT = torch.exp(log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weight_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = -weight_BT * advantages_BT * logp_BT
    loss_BT = torch.where(mask_BT != 0, loss_BT, torch.zeros_like(loss_BT))
    return loss_BT, {
        "clip_ratio": masked_mean((weight_BT != ratio_BT).float(), mask_BT).detach(),
        "approx_kl": masked_mean(old_logp_BT - logp_BT, mask_BT).detach(),
    }


POLICY_LOSSES: dict[str, PolicyLoss] = {"ppo": ppo_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def register_policy_loss(name: str, fn: PolicyLoss, *, overwrite: bool = False) -> None:
    """Make ``fn`` (see :data:`PolicyLoss`) available as ``policy_loss(name, ...)``."""
    register(POLICY_LOSSES, name, fn, "policy loss", overwrite)


def policy_loss(
    name: str,
    *,
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token policy surrogate ``loss_BT`` (not reduced) and detached metrics.

    ``clip_low`` / ``clip_high`` left ``None`` take the loss's own defaults (0.2 / 0.2 for
    ``ppo``, 3e-4 / 4e-4 for ``gspo``, 1 / 3 for ``cispo``). Reduce with :func:`aggregate_loss`.
    """
    fn = lookup(POLICY_LOSSES, name, "policy loss")
    for other_name, other in (("old_logp_BT", old_logp_BT), ("advantages_BT", advantages_BT),
                              ("mask_BT", mask_BT)):
        if other.shape != logp_BT.shape:
            raise ValueError(
                f"{other_name} must have the shape of logp_BT {tuple(logp_BT.shape)}; "
                f"got {tuple(other.shape)}."
            )
    clips = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip}
    return fn(
        logp_BT=logp_BT, old_logp_BT=old_logp_BT, advantages_BT=advantages_BT, mask_BT=mask_BT,
        **{key: value for key, value in clips.items() if value is not None},
    )


def _sum_tokens(loss_BT: Tensor, mask_BT: Tensor) -> Tensor:
    return torch.where(mask_BT != 0, loss_BT * mask_BT, torch.zeros_like(loss_BT)).sum(-1)


def _token_mean(loss_BT: Tensor, mask_BT: Tensor, num_tokens: Tensor | float,
                num_seqs: Tensor | float, constant: float | None) -> Tensor:
    return _sum_tokens(loss_BT, mask_BT).sum() / num_tokens


def _seq_mean_token_mean(loss_BT: Tensor, mask_BT: Tensor, num_tokens: Tensor | float,
                         num_seqs: Tensor | float, constant: float | None) -> Tensor:
    per_seq_B = _sum_tokens(loss_BT, mask_BT) / mask_BT.sum(-1).clamp_min(1e-8)
    return per_seq_B.sum() / num_seqs


def _seq_mean_token_sum(loss_BT: Tensor, mask_BT: Tensor, num_tokens: Tensor | float,
                        num_seqs: Tensor | float, constant: float | None) -> Tensor:
    return _sum_tokens(loss_BT, mask_BT).sum() / num_seqs


def _constant(loss_BT: Tensor, mask_BT: Tensor, num_tokens: Tensor | float,
              num_seqs: Tensor | float, constant: float | None) -> Tensor:
    if constant is None or constant <= 0:
        raise ValueError(
            f"Loss aggregation 'constant' needs constant > 0 (Dr. GRPO uses the maximum number "
            f"of new tokens); got constant={constant}."
        )
    return _sum_tokens(loss_BT, mask_BT).sum() / (constant * num_seqs)


LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "constant": _constant,
}


def aggregate_loss(
    loss_BT: Tensor,
    mask_BT: Tensor,
    mode: str,
    *,
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
    constant: float | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` over ``mask_BT`` to a scalar.

    - ``token-mean``: ``sum_{i,t} m l / N_tokens`` (OpenRLHF, DAPO);
    - ``seq-mean-token-mean``: ``sum_i (sum_t m l / sum_t m) / N_seqs`` (GRPO paper, GSPO);
    - ``seq-mean-token-sum``: ``sum_{i,t} m l / N_seqs``;
    - ``constant``: ``sum_{i,t} m l / (constant * N_seqs)`` (Dr. GRPO, Liu et al. 2025,
      arXiv:2503.20783, with constant = max new tokens).

    ``num_tokens`` (action tokens) and ``num_seqs`` (sequences with at least one action token)
    must be the global counts of the whole optimizer step, summed over micro-batches and
    data-parallel ranks: then summing the micro-batch losses gives the same gradient however
    the batch is split. They default to the local counts of this call.
    """
    fn = lookup(LOSS_AGGREGATIONS, mode, "loss aggregation mode")
    if loss_BT.shape != mask_BT.shape:
        raise ValueError(
            f"loss_BT {tuple(loss_BT.shape)} and mask_BT {tuple(mask_BT.shape)} must match."
        )
    if constant is not None and mode != "constant":
        warnings.warn(f"constant={constant} is ignored by loss aggregation {mode!r}.",
                      stacklevel=2)
    if num_tokens is None:
        num_tokens = mask_BT.sum().clamp_min(1.0)
    if num_seqs is None:
        num_seqs = (mask_BT.sum(-1) > 0).sum().clamp_min(1).to(loss_BT.dtype)
    return fn(loss_BT, mask_BT, num_tokens, num_seqs, constant)


def value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    mask_BT: Tensor,
    clip: float | None = 0.5,
) -> Tensor:
    """Clipped value loss per token (OpenRLHF ``ValueLoss``; PPO2 baselines).

    ``V_clip = V_old + clamp(V - V_old, -clip, clip)``,
    ``loss_t = 0.5 * max((V_clip - R)^2, (V - R)^2)``; ``clip=None`` gives ``0.5 (V - R)^2``.
    Shapes ``[B, T]``; returns ``loss_BT`` (0 off-mask), to be reduced by :func:`aggregate_loss`.
    """
    unclipped_BT = (values_BT - returns_BT) ** 2
    if clip is None:
        loss_BT = 0.5 * unclipped_BT
    else:
        clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
        loss_BT = 0.5 * torch.max((clipped_BT - returns_BT) ** 2, unclipped_BT)
    return torch.where(mask_BT != 0, loss_BT, torch.zeros_like(loss_BT))


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}.")


def logprobs_from_logits(
    logits_BTV: Tensor, labels_BT: Tensor, temperature: float = 1.0
) -> Tensor:
    """``log softmax(logits / temperature)[label]`` per token: ``[B, T, V], [B, T] -> [B, T]``.

    Computed one sequence at a time in float32 (float64 logits stay float64), so the extra
    memory is one ``[T, V]`` slice rather than a second ``[B, T, V]`` tensor (the logits
    themselves may be bf16). The gradient is that of
    :func:`logprobs_and_entropy_from_logits`.
    """
    return _log_softmax_terms(logits_BTV, labels_BT, temperature, entropy=False)[0]


def entropy_from_logits(logits_BTV: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` per token: ``[B, T, V] -> [B, T]``.

    ``H = -sum_v p_v log p_v``; use the same temperature as the log-probs. One sequence at a
    time in float32, like :func:`logprobs_from_logits`.
    """
    return _log_softmax_terms(logits_BTV, None, temperature, entropy=True)[1]


def logprobs_and_entropy_from_logits(
    logits_BTV: Tensor, labels_BT: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """:func:`logprobs_from_logits` and :func:`entropy_from_logits` from one log-softmax.

    With ``z = logits / temperature`` and ``p = softmax(z)``: ``logp = log p[label]`` and
    ``H = -sum_v p_v log p_v``, ``[B, T, V], [B, T] -> ([B, T], [B, T])``. The backward is one
    pass over the saved ``p``, ``dlogp/dz = onehot(label) - p`` and ``dH/dz = -p (log p + H)``,
    written straight into the logits' gradient: autograd's own chain (zeros and a scatter for
    the gather, the log-softmax backward, a stack of the sequences) writes three more
    ``[B, T, V]`` tensors, and a separate entropy computes the softmax again.
    """
    return _log_softmax_terms(logits_BTV, labels_BT, temperature, entropy=True)


@overload
def _log_softmax_terms(
    logits_BTV: Tensor, labels_BT: Tensor | None, temperature: float, *, entropy: Literal[True]
) -> tuple[Tensor, Tensor]: ...
@overload
def _log_softmax_terms(
    logits_BTV: Tensor, labels_BT: Tensor | None, temperature: float, *, entropy: bool
) -> tuple[Tensor, Tensor | None]: ...
def _log_softmax_terms(
    logits_BTV: Tensor, labels_BT: Tensor | None, temperature: float, *, entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``labels_BT`` and, if ``entropy``, entropies, ``[B, T]``; through
    :class:`_LogProbEntropy` when a gradient is to flow back to the logits. Without labels
    (the entropy alone) the log-probs are those of token 0, for the caller to drop."""
    _check_temperature(temperature)
    if labels_BT is None:
        labels_BT = logits_BTV.new_zeros(logits_BTV.shape[:2], dtype=torch.long)
    if torch.is_grad_enabled() and logits_BTV.requires_grad:
        return _LogProbEntropy.apply(logits_BTV, labels_BT, temperature, entropy)
    logp_BT, ent_BT, _ = _forward_rows(logits_BTV, labels_BT, temperature, entropy, False)
    return logp_BT, ent_BT


def _forward_rows(
    logits_BTV: Tensor, labels_BT: Tensor, temperature: float, entropy: bool, keep_probs: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(logp_BT, ent_BT or None, probs_BTV or None)``, one sequence at a time."""
    dtype = torch.promote_types(logits_BTV.dtype, torch.float32)
    logp_BT = logits_BTV.new_empty(labels_BT.shape, dtype=dtype)
    ent_BT = logits_BTV.new_empty(labels_BT.shape, dtype=dtype) if entropy else None
    probs_BTV = logits_BTV.new_empty(logits_BTV.shape, dtype=dtype) if keep_probs else None
    for b, (logits_TV, labels_T) in enumerate(zip(logits_BTV, labels_BT, strict=True)):
        logp_TV = torch.log_softmax(_scaled(logits_TV, temperature), dim=-1)
        logp_BT[b] = logp_TV.gather(-1, labels_T.long().unsqueeze(-1)).squeeze(-1)
        if probs_BTV is not None or ent_BT is not None:
            p_TV = torch.exp(logp_TV, out=probs_BTV[b] if probs_BTV is not None else None)
            # In place, logp_TV being done with: on CPU a fresh [T, V] of a 49k vocabulary is
            # page-faulted in at a cost like the product's own.
            if ent_BT is not None:
                ent_BT[b] = -logp_TV.mul_(p_TV).sum(-1)
    return logp_BT, ent_BT, probs_BTV


def _scaled(logits_TV: Tensor, temperature: float) -> Tensor:
    """Upcast logits / temperature (no [T, V] division at temperature 1: x / 1 == x)."""
    z_TV = logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32))
    return z_TV if temperature == 1.0 else z_TV / temperature


class _LogProbEntropy(torch.autograd.Function):
    """Log-probs and (optionally) entropies with the one-pass backward of
    :func:`logprobs_and_entropy_from_logits`; saves ``p``, as ``log_softmax`` saves its output."""

    @staticmethod
    def forward(
        ctx: Any, logits_BTV: Tensor, labels_BT: Tensor, temperature: float, entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        logp_BT, ent_BT, probs_BTV = _forward_rows(
            logits_BTV, labels_BT, temperature, entropy, True
        )
        ctx.set_materialize_grads(False)  # an unused entropy (a logged metric) costs nothing
        ctx.save_for_backward(probs_BTV, labels_BT, ent_BT)
        ctx.temperature, ctx.logits_dtype = temperature, logits_BTV.dtype
        return logp_BT, ent_BT

    @staticmethod
    @torch.autograd.function.once_differentiable  # the backward is not itself differentiable
    def backward(
        ctx: Any, grad_logp_BT: Tensor | None, grad_ent_BT: Tensor | None
    ) -> tuple[Tensor, None, None, None]:
        probs_BTV, labels_BT, ent_BT = ctx.saved_tensors
        grad_BTV = probs_BTV.new_empty(probs_BTV.shape, dtype=ctx.logits_dtype)
        in_place = grad_BTV.dtype == probs_BTV.dtype
        for b, p_TV in enumerate(probs_BTV):
            dz_TV = grad_BTV[b] if in_place else torch.empty_like(p_TV)
            if grad_logp_BT is None:
                dz_TV.zero_()
            else:  # g (onehot(label) - p)
                g_T = grad_logp_BT[b]
                torch.mul(p_TV, -g_T[:, None], out=dz_TV)
                dz_TV.scatter_add_(-1, labels_BT[b, :, None].long(), g_T[:, None])
            if grad_ent_BT is not None:  # -h p (log p + H); xlogy is 0 where p underflowed
                term_TV = torch.special.xlogy(p_TV, p_TV).add_(p_TV * ent_BT[b, :, None])
                dz_TV.sub_(term_TV.mul_(grad_ent_BT[b, :, None]))
            if ctx.temperature != 1.0:
                dz_TV.div_(ctx.temperature)
            if not in_place:
                grad_BTV[b] = dz_TV
        return grad_BTV, None, None, None
