"""Reward shaping on scalar rewards and DAPO dynamic filtering of prompt groups.

Shape suffixes: ``_B`` batch (sequences), ``_G`` group (the samples of one prompt).
All functions act on per-sequence scalars and are applied before the advantage baseline.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from agentrl.algorithms._common import group_index, group_sum, lookup


def overlong_penalty(
    rewards_B: Tensor,
    response_lengths_B: Tensor,
    *,
    max_new_tokens: int,
    buffer: int,
    factor: float,
) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13).

    ``exceed = len - (L - b)``; where ``exceed > 0``: ``r -= min(exceed, b) / b * factor``,
    with ``L = max_new_tokens`` and ``b = buffer``. Shapes ``[B] -> [B]``.
    """
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(
            f"overlong_penalty needs 0 < buffer <= max_new_tokens; got buffer={buffer}, "
            f"max_new_tokens={max_new_tokens}."
        )
    if rewards_B.shape != response_lengths_B.shape:
        raise ValueError(
            f"rewards_B {tuple(rewards_B.shape)} and response_lengths_B "
            f"{tuple(response_lengths_B.shape)} must match."
        )
    exceed_B = response_lengths_B.to(rewards_B.dtype) - (max_new_tokens - buffer)
    return rewards_B - exceed_B.clamp(0, buffer) / buffer * factor


def truncation_penalty(rewards_B: Tensor, truncated_B: Tensor, coef: float) -> Tensor:
    """ProRL penalty for responses cut by the length budget (finish_reason = length).

    Where ``truncated_B``: ``coef >= 0`` scales, ``r *= coef`` (0 zeroes the reward);
    ``coef < 0`` replaces, ``r = coef``. Other rewards are unchanged. Shapes ``[B] -> [B]``.
    """
    if rewards_B.shape != truncated_B.shape:
        raise ValueError(
            f"rewards_B {tuple(rewards_B.shape)} and truncated_B {tuple(truncated_B.shape)} "
            "must match."
        )
    penalised_B = rewards_B * coef if coef >= 0 else torch.full_like(rewards_B, coef)
    return torch.where(truncated_B.bool(), penalised_B, rewards_B)


def _keep_by_mean(scores_B: Tensor, index_B: Tensor, counts_G: Tensor, low: float,
                  high: float) -> Tensor:
    mean_G = group_sum(scores_B, index_B, counts_G.numel()) / counts_G
    return (mean_G > low) & (mean_G < high)


def _keep_by_std(scores_B: Tensor, index_B: Tensor, counts_G: Tensor, low: float,
                 high: float) -> Tensor:
    # std > 0 iff max > min; comparing extremes is exact where a float std of equal scores
    # (e.g. three 0.1) can come out as a tiny positive number.
    max_G = torch.full(counts_G.shape, -torch.inf, dtype=scores_B.dtype, device=scores_B.device)
    min_G = torch.full_like(max_G, torch.inf)
    max_G = max_G.scatter_reduce(0, index_B, scores_B, "amax")
    min_G = min_G.scatter_reduce(0, index_B, scores_B, "amin")
    return max_G > min_G


FILTER_CRITERIA: dict[str, Callable[..., Tensor]] = {"mean": _keep_by_mean, "std": _keep_by_std}


def dynamic_filter(
    scores_B: Tensor,
    group_ids_B: Tensor,
    *,
    low: float = 0.0,
    high: float = 1.0,
    criterion: str = "mean",
) -> Tensor:
    """DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476): which samples to keep.

    A group (samples sharing a group id) is kept whole iff ``low < mean(scores) < high``
    (``criterion="mean"``: drops all-correct and all-wrong groups for 0/1 rewards) or iff its
    scores are not all equal, i.e. ``std > 0`` (``criterion="std"``, for non-binary rewards;
    ``low``/``high`` unused). Groups with one sample have std 0. Returns bool ``keep_B``.
    """
    fn = lookup(FILTER_CRITERIA, criterion, "dynamic filter criterion")
    if scores_B.dim() != 1 or scores_B.shape != group_ids_B.shape:
        raise ValueError(
            f"scores_B and group_ids_B must be 1-D of equal length; got {tuple(scores_B.shape)} "
            f"and {tuple(group_ids_B.shape)}."
        )
    _, index_B, counts_G = group_index(group_ids_B)
    scores_B = scores_B.double()
    return fn(scores_B, index_B, counts_G.to(scores_B.dtype), low, high)[index_B]
