"""Batched token sampling with per-row settings, and the logprobs of what was sampled.

Pure tensor functions, shared by the transformers engine and by tests that recompute logprobs,
and the transformers engine's `Sampler`, which applies them to its running samples.
Shape suffixes: `_B` batch rows, `_V` vocabulary.

The distribution actually sampled from is
    p = softmax(top_p(top_k(logits / temperature)))
where top-k keeps the k largest logits and top-p keeps the smallest set of most likely tokens
whose mass reaches p (Holtzman et al. 2019, https://arxiv.org/abs/1904.09751); the rest get
-inf. Greedy rows (temperature 0) take the argmax and report raw model logprobs, as vLLM does:
the point mass they sample from would give 0 everywhere and tell a trainer nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from agentrl.completion import SamplingParams
from agentrl.engine.requests import Request, Sample, stop_string_hit

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from agentrl.engine.grammar import GrammarMasks

logger = logging.getLogger(__name__)

Drawn = tuple[int, float, list[tuple[int, float]]]
"""A sample's drawn token, its logprob, and its top alternatives (empty unless asked for)."""


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


def with_logit_bias(logits_B_V: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The logits with each row's `logit_bias` added (the same tensor when none has one)."""
    rows = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits_B_V
    out = logits_B_V.clone()
    for i, bias in rows:
        ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=out.device)
        vals = torch.tensor([b for _, b in bias], dtype=out.dtype, device=out.device)
        out[i].index_add_(0, ids, vals)
    return out


def model_eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The token ids that end a sample: the tokenizer's EOS and the model's generation config's."""
    ids: set[int] = set()
    for src in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple):
            ids.update(int(x) for x in src)
    return frozenset(ids)


class Sampler:
    """The transformers engine's sampler: each running sample's next token from its row of
    logits (grammar mask, logit bias, temperature / top-k / top-p, top logprobs), recorded in
    the sample, which it finishes at a stop token, EOS, a stop string or its token limit.

    Args:
        tokenizer: decodes a sample's last tokens to look for stop strings.
        grammars: the engine's grammar masks (`params.grammar`).
        eos_ids: token ids that end a sample.
        seed: seeds the generator of requests without their own seed.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, grammars: GrammarMasks,
                 eos_ids: frozenset[int], seed: int | None) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.eos_ids = eos_ids
        self._rng = torch.Generator().manual_seed(
            int(np.random.SeedSequence(seed).generate_state(1)[0])
        )

    def uniforms(self, samples: list[Sample]) -> list[float]:
        """One uniform in (0, 1] per sample, from its own generator (seeded requests) or the
        sampler's."""
        return [1.0 - float(torch.rand(1, generator=s.generator or self._rng)) for s in samples]

    def draw(self, samples: list[Sample], logits_B_V: torch.Tensor, uniform: list[float]
             ) -> list[Drawn]:
        """Each sample's next token, its logprob and the top alternatives its request asks
        for. Each row's draw depends on that row alone (its logits, settings and uniform)."""
        params = [s.request.params for s in samples]
        dev = logits_B_V.device
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        raw = torch.tensor([p.raw_logprobs for p in params], dtype=torch.bool, device=dev)
        # The grammar's mask comes first: every logprob below, raw ones too, is of the masked
        # distribution (vLLM masks at the same point).
        self.grammars.apply(logits_B_V, [s.matcher for s in samples])
        biased = with_logit_bias(logits_B_V, params)
        tokens, lps, logp_B_V = sample_tokens(
            biased, temp, top_k, top_p, torch.tensor(uniform), raw_B=raw
        )
        if biased is not logits_B_V and bool(raw.any()):  # raw: the model's own, unbiased
            own = torch.log_softmax(logits_B_V.float(), -1).gather(1, tokens[:, None])[:, 0]
            lps = torch.where(raw, own.to(lps.dtype), lps)
        want_top = max(p.top_logprobs for p in params)
        top_vals: list[list[float]] = [[] for _ in samples]
        top_ids: list[list[int]] = [[] for _ in samples]
        if want_top:
            src = torch.where(raw[:, None], torch.log_softmax(logits_B_V.float(), -1), logp_B_V)
            vals_B_K, ids_B_K = src.topk(want_top, dim=-1)
            top_vals, top_ids = vals_B_K.tolist(), ids_B_K.tolist()
        return [
            (tok, lp, [(t, v) for t, v in zip(ids[:k], vals[:k], strict=True)
                       if v > float("-inf")])
            for tok, lp, ids, vals, k in zip(tokens.tolist(), lps.tolist(), top_ids, top_vals,
                                             [p.top_logprobs for p in params], strict=True)
        ]

    def draw_isolated(self, samples: list[Sample], logits_B_V: torch.Tensor,
                      uniform: list[float], fail: Callable[[Request, Exception], None]
                      ) -> list[Drawn | None]:
        """`draw`, and where the whole batch's draw fails, `draw` request by request: a
        request whose own draw fails too goes to `fail` (None for its samples); the others get
        what the batch's draw would have given them (#34)."""
        try:
            return [*self.draw(samples, logits_B_V, uniform)]
        except Exception as e:  # noqa: BLE001 - found and failed request by request below
            logger.warning("drawing a batch of %d samples failed (%r); drawing request by "
                           "request", len(samples), e)
        rows_of: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            rows_of.setdefault(id(s.request), []).append(i)
        out: list[Drawn | None] = [None] * len(samples)
        for rows in rows_of.values():
            index = torch.tensor(rows, dtype=torch.long, device=logits_B_V.device)
            try:
                drawn = self.draw([samples[i] for i in rows], logits_B_V.index_select(0, index),
                                  [uniform[i] for i in rows])
            except Exception as e:  # noqa: BLE001 - this request is the one to fail
                fail(samples[rows[0]].request, e)
                continue
            for i, d in zip(rows, drawn, strict=True):
                out[i] = d
        return out

    def take(self, s: Sample, tok: int, lp: float, top: list[tuple[int, float]]) -> None:
        """Record a drawn token in its sample, and finish the sample if it is done."""
        s.tokens.append(tok)
        s.logprobs.append(lp)
        if s.matcher is not None and not s.matcher.is_terminated():
            s.matcher.accept_token(tok)
        if s.request.params.top_logprobs:
            s.top.append(top)
        self.check_finished(s, tok)

    def check_finished(self, s: Sample, tok: int) -> None:
        p = s.request.params
        if tok in p.stop_token_ids:
            s.finish, s.stop_reason = "stop", tok
        elif tok in self.eos_ids:
            s.finish = "stop"
        elif p.stop and (hit := self._stop_hit(s, p.stop)) is not None:
            s.finish, s.stop_reason = "stop", hit
        elif len(s.tokens) >= s.max_tokens:
            s.finish = "length"

    def _stop_hit(self, s: Sample, stops: Sequence[str]) -> str | None:
        # The stop string was absent after the previous token, so it ends in the newest one;
        # decoding a short tail is enough (a token holds at least one byte of text).
        tail = s.tokens[-(max(len(x.encode()) for x in stops) + 4) :]
        text = cast(str, self.tokenizer.decode(tail, skip_special_tokens=True))  # one id list
        return stop_string_hit(text, stops)
