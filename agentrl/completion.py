"""What an engine is asked and what it answers: `SamplingParams`, `Completion` (a whole sample)
and `CompletionDelta` (a streamed piece), with the per-token weight versions they carry (a
partial rollout's sample spans the weights it was sampled with).

Only stdlib and numpy are imported here: `import agentrl` must stay light.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

_INT32_MAX = 2**31 - 1

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request. Mirrors the OpenAI/vLLM names users already know."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables. At most 2**31 - 1 (engines hold it in
    32 bits; a k past the vocabulary keeps every token)."""
    max_tokens: int = 256
    """Most new tokens to sample (the completion stops with finish reason `length`)."""
    stop: tuple[str, ...] = ()
    """Stop strings; the completion is cut before them and they are not part of the text."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the completion (the tokenizer's eos always does). Kept."""
    n: int = 1
    """Number of independent samples for the prompt."""
    seed: int | None = None
    """Per-request seed; the same seed, prompt and weights give the same sample. A 64-bit
    signed integer (what engines seed their generators with)."""
    logprobs: bool = True
    """Return the log-probability of each sampled token."""
    raw_logprobs: bool = False
    """If true, logprobs are of the raw model distribution (before temperature/top-p/top-k)
    rather than of the distribution actually sampled from."""
    top_logprobs: int = 0
    """Also return this many most likely alternatives per position (proxy's `top_logprobs`)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in [-100, 100]) pairs added to the logits before sampling (OpenAI's
    `logit_bias`). The logprobs are then of that biased distribution, the one sampled from
    (with `raw_logprobs`, of the model's own)."""
    grammar: str | None = None
    """A grammar the completion must match, in xgrammar's EBNF (`agentrl.engine.grammar` builds
    them from JSON schemas and tool lists). Tokens it forbids get probability 0 before any other
    processing, so every reported logprob, raw ones too, is of that masked distribution; the
    completion ends once the grammar is complete."""

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(
                f"SamplingParams.max_tokens must be an integer >= 0, got {self.max_tokens!r}"
            )
        if not (isinstance(self.temperature, int | float) and 0 <= self.temperature < math.inf):
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 "
                             f"(0 = greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        # Out-of-range numbers must fail here, alone: inside an engine's batch they fail every
        # request batched with them (#34).
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= _INT32_MAX:
            raise ValueError(f"SamplingParams.top_k must be an integer in [0, {_INT32_MAX}] "
                             f"(0 = off), got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int | np.integer)
                                          and -(2**63) <= self.seed < 2**63):
            raise ValueError(f"SamplingParams.seed must be None or an integer in "
                             f"[{-(2**63)}, {2**63 - 1}], got {self.seed!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise ValueError(
                f"SamplingParams.top_logprobs must be an integer in [0, 20], "
                f"got {self.top_logprobs!r}"
            )
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], int)
                    and pair[0] >= 0 and isinstance(pair[1], int | float)
                    and -100 <= pair[1] <= 100):
                raise ValueError(f"SamplingParams.logit_bias must be (token id >= 0, bias in "
                                 f"[-100, 100]) pairs, got {pair!r}")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise ValueError("SamplingParams.grammar must be a non-empty EBNF string or None; "
                             "build one with agentrl.engine.grammar.json_schema_grammar(...)")
        if isinstance(self.stop, str) or isinstance(self.stop_token_ids, int):
            raise TypeError(
                "SamplingParams.stop / stop_token_ids take a tuple, e.g. stop=('\\n\\n',)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(kw_only=True)
class Completion:
    """One sample: exactly the token ids drawn, their log-probabilities and why it ended."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    policy_version: int = 0
    """Version of the weights that sampled the first token (every token, unless
    `version_changes` says otherwise)."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it, if any."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per position, the most likely (token id, logprob) pairs, if asked for."""
    version_changes: list[tuple[int, int]] = field(default_factory=list)
    """Partial rollout: (i, v) = the weights changed to version v while this completion was
    sampled, and tokens i, i+1, ... were sampled by v (with v's log-probs). Empty when one
    version sampled every token."""

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Completion.finish_reason must be one of {FINISH_REASONS}, "
                f"got {self.finish_reason!r}"
            )
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(
                f"Completion has {len(self.token_ids)} tokens but {len(self.logprobs)} logprobs"
            )
        check_version_changes(self.version_changes, len(self.token_ids), "Completion")

    def token_versions(self) -> list[int]:
        """The version that sampled each token."""
        return expand_versions(self.policy_version, self.version_changes, len(self.token_ids))

    def delta(self, index: int, start: int = 0, stop: int | None = None,
              last: bool = True) -> CompletionDelta:
        """Tokens [start, stop) as choice `index`'s delta, ending the choice if `last`."""
        stop = len(self.token_ids) if stop is None else stop
        first, changes = shift_version_changes(self.version_changes, start, stop)
        return CompletionDelta(
            index=index,
            token_ids=self.token_ids[start:stop],
            logprobs=self.logprobs[start:stop] if self.logprobs is not None else None,
            top_logprobs=(self.top_logprobs[start:stop] if self.top_logprobs is not None
                          else None),
            finish_reason=self.finish_reason if last else None,
            policy_version=self.policy_version if first is None else first,
            stop_reason=self.stop_reason if last else None,
            version_changes=tuple(changes),
        )


def check_version_changes(changes: Sequence[tuple[int, int]], n: int, what: str) -> None:
    """`changes` are (index, version) pairs with 0 < index < n, indices increasing."""
    last = 0
    for i, _ in changes:
        if not last < i < n:
            raise ValueError(f"{what}.version_changes {list(changes)} must have increasing "
                             f"token indices in (0, {n})")
        last = i


def expand_versions(first: int, changes: Sequence[tuple[int, int]], n: int) -> list[int]:
    """Per-token versions of n tokens: `first`, then each (index, version) change."""
    out = [first] * n
    for i, v in changes:
        out[i:] = [v] * (n - i)
    return out


def shift_version_changes(changes: Sequence[tuple[int, int]], start: int, stop: int
                          ) -> tuple[int | None, list[tuple[int, int]]]:
    """The changes that fall in tokens [start, stop), re-based to `start`, and the version of
    token `start` if a change at or before it set one (None: the first version holds)."""
    first: int | None = None
    out: list[tuple[int, int]] = []
    for i, v in changes:
        if i <= start:
            first = v
        elif i < stop:
            out.append((i - start, v))
    return first, out


@dataclass(frozen=True, kw_only=True)
class CompletionDelta:
    """New tokens of one of a request's n completions, as a streaming engine samples them.

    Concatenating a choice's deltas gives exactly its `Completion` (ids, logprobs, top
    logprobs); `finish_reason` is None until the choice's last delta, which may carry no tokens
    (an abort).
    """

    index: int
    """Which of the request's `n` completions these tokens extend."""
    token_ids: list[int]
    logprobs: list[float] | None
    """Log-probability of each new token; None when the request asked for none."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per new token, the most likely (token id, logprob) pairs, if asked for."""
    finish_reason: FinishReason | None = None
    policy_version: int = 0
    """Version of the weights that sampled this delta's first token."""
    stop_reason: str | int | None = None
    """On the last delta: the stop string or stop token id that ended the completion, if any."""
    version_changes: tuple[tuple[int, int], ...] = ()
    """As `Completion.version_changes`, with indices into this delta's tokens."""
