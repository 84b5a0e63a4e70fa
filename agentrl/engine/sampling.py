"""Batched token sampling with per-row settings, and the logprobs of what was sampled.

Pure tensor functions, shared by the transformers engine and by tests that recompute logprobs.
Shape suffixes: `_B` batch rows, `_V` vocabulary.

The distribution actually sampled from is
    p = softmax(top_p(top_k(logits / temperature)))
where top-k keeps the k largest logits and top-p keeps the smallest set of most likely tokens
whose mass reaches p (Holtzman et al. 2019, https://arxiv.org/abs/1904.09751); the rest get
-inf. Greedy rows (temperature 0) take the argmax and report raw model logprobs, as vLLM does:
the point mass they sample from would give 0 everywhere and tell a trainer nothing.
"""

from __future__ import annotations

import torch


def filter_top_k_top_p(
    scaled_B_V: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf (ties at the cut are kept).

    top_k_B: int64, 0 disables; top_p_B: float in (0, 1], 1 disables.
    """
    vocab = scaled_B_V.shape[-1]
    sorted_B_V, _ = torch.sort(scaled_B_V, dim=-1, descending=True)
    ranks_V = torch.arange(vocab, device=scaled_B_V.device)
    k_B = torch.where(top_k_B > 0, top_k_B.clamp(max=vocab), torch.full_like(top_k_B, vocab))
    sorted_B_V = sorted_B_V.masked_fill(ranks_V[None, :] >= k_B[:, None], float("-inf"))
    probs_B_V = torch.softmax(sorted_B_V, dim=-1)
    mass_before_B_V = torch.cumsum(probs_B_V, dim=-1) - probs_B_V
    # Drop a token once the more likely ones already hold top_p of the mass; the first stays.
    drop_B_V = (mass_before_B_V >= top_p_B[:, None]) & (ranks_V[None, :] > 0)
    sorted_B_V = sorted_B_V.masked_fill(drop_B_V, float("-inf"))
    kept_B = (sorted_B_V > float("-inf")).sum(dim=-1)
    threshold_B = sorted_B_V.gather(-1, (kept_B - 1)[:, None])
    return scaled_B_V.masked_fill(scaled_B_V < threshold_B, float("-inf"))


def processed_logprobs(
    logits_B_V: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
) -> torch.Tensor:
    """log p of the distribution sampled from (see module docstring); greedy rows: raw logprobs."""
    logits_B_V = logits_B_V.float()
    greedy_B = temperature_B <= 0
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B)
    # x / 1 == x exactly: skip a pass over [B, V] in the common all-T=1 batch.
    scaled_B_V = logits_B_V if bool((temp_B == 1).all()) else logits_B_V / temp_B[:, None]
    needs_filter_B = ~greedy_B & ((top_k_B > 0) | (top_p_B < 1.0))
    if bool(needs_filter_B.any()):
        rows = needs_filter_B.nonzero().squeeze(-1)
        filtered = filter_top_k_top_p(scaled_B_V[rows], top_k_B[rows], top_p_B[rows])
        scaled_B_V = scaled_B_V.index_copy(0, rows, filtered)
    return torch.log_softmax(scaled_B_V, dim=-1)


def sample_tokens(
    logits_B_V: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    uniform_B: torch.Tensor,
    *,
    raw_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverse-CDF sampling with the given uniforms in (0, 1].

    One uniform per row (drawn from the row's own generator) makes seeded requests reproducible
    whatever else shares the batch. Returns (tokens_B int64, logprobs_B, logp_B_V): the logprob
    of each sampled token under the processed distribution, or under the raw model where
    `raw_B`, and the full processed log-distribution.
    """
    logits_B_V = logits_B_V.float()
    logp_B_V = processed_logprobs(logits_B_V, temperature_B, top_k_B, top_p_B)
    cdf_B_V = torch.cumsum(logp_B_V.exp(), dim=-1)
    target_B = uniform_B.to(cdf_B_V) * cdf_B_V[:, -1]
    # First index whose cdf reaches the target: never a zero-probability token (flat cdf).
    sampled_B = torch.searchsorted(cdf_B_V, target_B[:, None]).squeeze(-1)
    sampled_B = sampled_B.clamp(max=logits_B_V.shape[-1] - 1)
    greedy_B = temperature_B <= 0
    tokens_B = sampled_B
    if bool(greedy_B.any()):
        tokens_B = torch.where(greedy_B, logits_B_V.argmax(dim=-1), sampled_B)
    lp_B = logp_B_V.gather(-1, tokens_B[:, None]).squeeze(-1)
    if bool(raw_B.any()):
        raw_lp_B = torch.log_softmax(logits_B_V, dim=-1).gather(-1, tokens_B[:, None]).squeeze(-1)
        lp_B = torch.where(raw_B, raw_lp_B, lp_B)
    return tokens_B, lp_B, logp_B_V
