"""Losses for learning from preferences and demonstrations, as pure functions on tensors.

A pair is a chosen and a rejected response to one prompt. Each function takes per-pair
tensors `[B]` and returns per-pair losses `[B]` (the caller sums them and divides by the number
of pairs of the whole step, on every rank, as the RL losses are normalised), plus what it
reports.

Sequence log-likelihoods are sums over the response's tokens, log pi(y|x) = sum_t log pi(y_t |
x, y_<t), as in the papers below.

DPO (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290), with the implicit reward
    r(y) = beta * (log pi(y|x) - log pi_ref(y|x)),   h = r(y_w) - r(y_l),
    loss = -log sigmoid(h).
Conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences"): each label is wrong
with probability eps (`label_smoothing`),
    loss = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h).
IPO (Azar et al. 2023, https://arxiv.org/abs/2310.12036, eq. 17) regresses the log-ratio
difference onto 1 / (2 tau) (tau = `beta`):
    h' = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)),
    loss = (h' - 1 / (2 beta))^2.
(OpenRLHF's IPO is the same on summed log-probs; TRL's averages them over tokens first.)

Bradley-Terry reward model (Ouyang et al. 2022): scalar rewards r_w, r_l of the two responses,
    loss = -log sigmoid(r_w - r_l - m)          ("sigmoid", optional margin m per pair)
    loss = log(1 + exp(r_l - r_w))              ("logexp", OpenRLHF's LogExpLoss; the same
                                                  function of r_w - r_l, without a margin)
both computed stably (softplus).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

PREFERENCE_LOSSES = ("dpo", "ipo")
REWARD_MODEL_LOSSES = ("sigmoid", "logexp")


@dataclass(frozen=True)
class PreferenceLoss:
    loss_B: Tensor
    """Per-pair loss."""
    chosen_reward_B: Tensor
    """beta * (log pi - log pi_ref) of the chosen response (detached)."""
    rejected_reward_B: Tensor
    """The same for the rejected response (detached)."""


def sequence_logprobs(logp_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Sum of the response tokens' log-probs of each row: log pi(y|x), `[B, T] -> [B]`."""
    return (logp_B_T * mask_B_T).sum(dim=-1)


def preference_loss(
    policy_chosen_B: Tensor,
    policy_rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float,
    kind: str = "dpo",
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """DPO (`label_smoothing` > 0: conservative DPO) or IPO on sequence log-likelihoods."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if kind not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss {kind!r}; choose one of {PREFERENCE_LOSSES}")
    chosen_ratio = policy_chosen_B - ref_chosen_B
    rejected_ratio = policy_rejected_B - ref_rejected_B
    h = chosen_ratio - rejected_ratio
    if kind == "ipo":
        if label_smoothing:
            raise ValueError("label_smoothing is conservative DPO's; IPO does not take it")
        loss = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        loss = (1.0 - label_smoothing) * F.softplus(-beta * h)
        if label_smoothing:
            loss = loss + label_smoothing * F.softplus(beta * h)
    return PreferenceLoss(loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def reward_model_loss(
    chosen_B: Tensor, rejected_B: Tensor, *, kind: str = "sigmoid",
    margin_B: Tensor | None = None,
) -> Tensor:
    """Per-pair Bradley-Terry loss of scalar rewards (see the module docstring)."""
    if kind not in REWARD_MODEL_LOSSES:
        raise ValueError(f"unknown reward-model loss {kind!r}; choose one of "
                         f"{REWARD_MODEL_LOSSES}")
    diff = chosen_B - rejected_B
    if kind == "logexp":
        if margin_B is not None:
            raise ValueError("the logexp loss takes no margin; use kind='sigmoid' with margins")
        return F.softplus(-diff)
    if margin_B is not None:
        diff = diff - margin_B
    return F.softplus(-diff)


def sft_loss(logp_B_T: Tensor, mask_B_T: Tensor, num_tokens: float) -> Tensor:
    """Negative log-likelihood of the masked (target) tokens, summed and divided by
    `num_tokens`, the target tokens of the whole step on every rank."""
    return -(logp_B_T * mask_B_T).sum() / max(num_tokens, 1.0)


def pairwise_accuracy(chosen_B: Tensor, rejected_B: Tensor) -> float:
    """Fraction of pairs whose chosen response scores higher (ties count half)."""
    if chosen_B.numel() == 0:
        return 0.0
    wins = (chosen_B > rejected_B).float() + 0.5 * (chosen_B == rejected_B).float()
    return float(wins.mean())


__all__ = [
    "PREFERENCE_LOSSES",
    "REWARD_MODEL_LOSSES",
    "PreferenceLoss",
    "pairwise_accuracy",
    "preference_loss",
    "reward_model_loss",
    "sequence_logprobs",
    "sft_loss",
]
