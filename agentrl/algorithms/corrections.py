"""Sampler/trainer mismatch corrections: per-token weights for the policy loss.

Shape suffixes: ``_B`` batch (sequences), ``_T`` tokens (time). The engine that samples
(vLLM, SGLang) and the trainer compute slightly different log-probs for the same tokens, so the
batch is off-policy for the trainer. With ``rho_t = exp(old_t - rollout_t)`` (trainer's old
policy over sampler) and bounds ``[low, high]`` (default ``[0.5, 5]``):

- ``tis``: ``w_t = clamp(rho_t, low, high)`` (truncated IS, Yao et al. 2025, "Your efficient
  RL framework secretly brings you off-policy RL training");
- ``icepop``: ``w_t = rho_t * 1[low <= rho_t <= high]`` (tokens outside the band are dropped,
  Ling team, "IcePop", 2025);
- ``seq-mask-tis``: ``rho_seq = exp(masked_mean_t(old - rollout))``;
  ``w_t = 1[low <= rho_seq <= high] * clamp(rho_t, low, high)``.

OpenRLHF 0.11 (``models/loss.py``) documents seq-mask-tis as a sequence mask times a
*truncated* token weight, but its code multiplies by the raw ``exp(old - rollout)``: inside an
accepted sequence a single token can then carry an unbounded weight. Here ``rho_t`` is clamped
to ``[low, high]``, as the comment promises.

Weights are detached and 0 off-mask; multiply the per-token policy loss by them before
:func:`agentrl.algorithms.losses.aggregate_loss`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from agentrl.algorithms._common import lookup, masked_mean

# Keep exp() finite: a ratio beyond e^20 is outside any sensible [low, high] anyway.
_LOG_RATIO_CLAMP = 20.0


def _token_ratio(old_logp_BT: Tensor, rollout_logp_BT: Tensor) -> Tensor:
    return torch.exp((old_logp_BT - rollout_logp_BT).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _tis(*, old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, low: float,
         high: float) -> Tensor:
    return _token_ratio(old_logp_BT, rollout_logp_BT).clamp(low, high)


def _icepop(*, old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, low: float,
            high: float) -> Tensor:
    rho_BT = _token_ratio(old_logp_BT, rollout_logp_BT)
    return rho_BT * ((rho_BT >= low) & (rho_BT <= high))


def _seq_mask_tis(*, old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor, low: float,
                  high: float) -> Tensor:
    seq_log_ratio_B = masked_mean(old_logp_BT - rollout_logp_BT, mask_BT, dim=-1)
    rho_seq_B = torch.exp(seq_log_ratio_B.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    keep_B = (rho_seq_B >= low) & (rho_seq_B <= high)
    return keep_B[:, None] * _token_ratio(old_logp_BT, rollout_logp_BT).clamp(low, high)


MISMATCH_CORRECTIONS: dict[str, Callable[..., Tensor]] = {
    "tis": _tis,
    "icepop": _icepop,
    "seq-mask-tis": _seq_mask_tis,
}
"""Corrections by name; each takes keywords ``old_logp_BT, rollout_logp_BT, mask_BT, low,
high`` and returns un-masked weights ``[B, T]``; use :func:`mismatch_weights`."""


def mismatch_weights(
    name: str,
    *,
    old_logp_BT: Tensor,
    rollout_logp_BT: Tensor,
    mask_BT: Tensor,
    low: float = 0.5,
    high: float = 5.0,
) -> Tensor:
    """Detached per-token loss weights ``[B, T]`` (float32, 0 off-mask) for a named correction."""
    fn = lookup(MISMATCH_CORRECTIONS, name, "mismatch correction")
    if not 0.0 <= low <= high:
        raise ValueError(f"Mismatch bounds need 0 <= low <= high; got low={low}, high={high}.")
    if old_logp_BT.shape != rollout_logp_BT.shape or old_logp_BT.shape != mask_BT.shape:
        raise ValueError(
            f"old_logp_BT {tuple(old_logp_BT.shape)}, rollout_logp_BT "
            f"{tuple(rollout_logp_BT.shape)} and mask_BT {tuple(mask_BT.shape)} must match."
        )
    with torch.no_grad():
        weights_BT = fn(
            old_logp_BT=old_logp_BT.float(), rollout_logp_BT=rollout_logp_BT.float(),
            mask_BT=mask_BT, low=low, high=high,
        )
        return torch.where(mask_BT != 0, weights_BT, torch.zeros_like(weights_BT))


def logprob_mismatch(old_logp_BT: Tensor, rollout_logp_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Scalar ``masked_mean(rollout - old)`` over action tokens, detached (OpenRLHF ``vllm_kl``).

    Log it every step: a value that grows means the sampler and the trainer disagree.
    """
    with torch.no_grad():
        return masked_mean(rollout_logp_BT.float() - old_logp_BT.float(), mask_BT)
