"""Request and per-sample state shared by engine backends, and the checks they all make on input."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.completion import (
    Completion,
    CompletionDelta,
    FinishReason,
    SamplingParams,
    shift_version_changes,
)
from agentrl.engine.base import PromptTooLongError

if TYPE_CHECKING:
    import numpy as np
    import torch


def check_request(
    prompt_ids: Sequence[int], params: SamplingParams, *, vocab_size: int, max_context: int
) -> list[int]:
    """Validate a generate() call before anything is queued; returns the prompt as list[int]."""
    if not isinstance(params, SamplingParams):
        raise TypeError(
            f"generate() takes agentrl.SamplingParams, got {type(params).__name__}; "
            f"build one with SamplingParams(temperature=..., max_tokens=...)"
        )
    if isinstance(prompt_ids, str | bytes):
        raise TypeError("generate() takes token ids, not text; tokenize the prompt first")
    try:
        prompt = [int(t) for t in prompt_ids]
    except (TypeError, ValueError) as e:
        raise TypeError(f"prompt_ids must be a sequence of int token ids: {e}") from None
    if not prompt:
        raise ValueError("prompt_ids is empty; the model needs at least one token to condition on")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
    bad = next((t for t, _ in params.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) + 1 > max_context:
        raise PromptTooLongError(len(prompt), max_context)
    return prompt


def check_score(
    token_ids: Sequence[int], start: int, *, vocab_size: int, max_context: int
) -> list[int]:
    """Validate a score() call (`Engine.score`): token ids in the vocabulary, 1 <= start <=
    len (the first token has no context to be scored in), the sequence within `max_context`;
    returns the ids as list[int]."""
    if isinstance(token_ids, str | bytes):
        raise TypeError("score() takes token ids, not text; tokenize the sequence first")
    ids = [int(t) for t in token_ids]
    if not 1 <= start <= len(ids):
        raise ValueError(f"score(start={start}) must be in [1, {len(ids)}] for {len(ids)} "
                         f"tokens: the first token has no context to be scored in")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if len(ids) > max_context:
        raise PromptTooLongError(len(ids), max_context)
    return ids


def empty_completion(params: SamplingParams, version: int) -> Completion:
    """What a request with `max_tokens=0` gets: no tokens, finish reason "length"."""
    return Completion(
        token_ids=[],
        logprobs=[] if params.logprobs else None,
        finish_reason="length",
        policy_version=version,
    )


def stop_string_hit(text: str, stops: Sequence[str]) -> str | None:
    """The first stop string (in `stops` order) that occurs in `text`."""
    return next((s for s in stops if s and s in text), None)


def cut_at_stop(text: str, stop: str | int | None) -> str:
    """The completion text a user sees: cut before the stop string that ended it (vLLM's rule).

    Completions keep every sampled token (a trainer needs them all); only the text is cut.
    """
    if isinstance(stop, str) and stop:
        i = text.find(stop)
        if i >= 0:
            return text[:i]
    return text


@dataclass(eq=False)
class Sample:
    """One of the n samples of a request while it is being generated."""

    request: Request
    index: int
    generator: torch.Generator | None
    max_tokens: int
    version: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    length: int = 0
    """Real tokens of this sample in the KV cache (prompt + fed completion tokens)."""
    finish: FinishReason | None = None
    stop_reason: str | int | None = None
    matcher: Any = None
    """Where this sample is in its request's grammar (an xgrammar GrammarMatcher), if any."""
    version_changes: list[tuple[int, int]] = field(default_factory=list)
    """(token index, version): the weights changed to that version mid-sample (partial
    rollout), so the tokens from that index on were sampled by it."""

    def switch_version(self, version: int) -> None:
        """The engine now samples with `version`: the next token is the new version's."""
        current = self.version_changes[-1][1] if self.version_changes else self.version
        if version == current:
            return
        if not self.tokens:
            self.version = version
            return
        if self.version_changes and self.version_changes[-1][0] == len(self.tokens):
            self.version_changes[-1] = (len(self.tokens), version)
        else:
            self.version_changes.append((len(self.tokens), version))

    def delta(self, start: int) -> CompletionDelta:
        """The tokens from position `start` on, with the finish reason if the sample is done."""
        params = self.request.params
        begin = start if start >= 0 else max(0, len(self.tokens) + start)
        first, changes = shift_version_changes(self.version_changes, begin, len(self.tokens))
        return CompletionDelta(
            index=self.index,
            token_ids=self.tokens[begin:],
            logprobs=self.logprobs[begin:] if params.logprobs else None,
            top_logprobs=[list(t) for t in self.top[begin:]] if params.top_logprobs else None,
            finish_reason=self.finish,
            policy_version=self.version if first is None else first,
            stop_reason=self.stop_reason,
            version_changes=tuple(changes),
        )

    @property
    def done(self) -> bool:
        return self.finish is not None

    def completion(self) -> Completion:
        params = self.request.params
        return Completion(
            token_ids=list(self.tokens),
            logprobs=list(self.logprobs) if params.logprobs else None,
            finish_reason=self.finish or "abort",
            policy_version=self.version,
            stop_reason=self.stop_reason,
            top_logprobs=[list(t) for t in self.top] if params.top_logprobs else None,
            # A change after the last token (the sample ended right at the update) changed none.
            version_changes=[c for c in self.version_changes if c[0] < len(self.tokens)],
        )


@dataclass(eq=False)
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    vision: VisionPrompt | None = None
    """The prompt's images, for a vision-language model."""
    grammar: Any = None
    """`params.grammar` compiled for the engine's tokenizer (an xgrammar CompiledGrammar)."""
    samples: list[Sample] = field(default_factory=list)
    aborted: bool = False
    failed: bool = False
    """The engine failed this request alone (its caller has the error; the batch goes on)."""
    stream: asyncio.Queue[list[CompletionDelta] | None] | None = None
    """For `generate_stream`: deltas of each step, then None once `future` is resolved."""

    def emit(self, deltas: list[CompletionDelta]) -> None:
        """Hand one step's deltas to the streaming consumer (thread-safe; FIFO with `resolve`)."""
        if self.stream is not None and deltas:
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                self.loop.call_soon_threadsafe(self.stream.put_nowait, deltas)

    def resolve(self, result: list[Completion] | BaseException) -> None:
        """Hand the result to the awaiting coroutine (thread-safe; no-op if it went away)."""

        def _set() -> None:
            if self.future.done():
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)
            if self.stream is not None:
                self.stream.put_nowait(None)

        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
            self.loop.call_soon_threadsafe(_set)

    def finish_all(self) -> None:
        self.resolve([s.completion() for s in self.samples])

    @property
    def key(self) -> list[int]:
        """The prompt as caches see it: image tokens stand for their image's content."""
        return self.vision.key if self.vision is not None else self.prompt

    @property
    def position_offset(self) -> int:
        """Position of token i after the prompt is i + this (mRoPE models shift text after
        images); 0 for plain positions."""
        return self.vision.position_offset if self.vision is not None else 0


@dataclass(eq=False)
class VisionPrompt:
    """A prompt's images and what the model needs to place them (`VisionProcessor`)."""

    images: list[np.ndarray]
    spans: list[tuple[int, int]]
    """[start, end) of each image's tokens in the prompt."""
    key: list[int]
    """`VisionProcessor.key_ids` of the prompt."""
    positions: torch.Tensor | None = None
    """mRoPE position ids [3, len(prompt)], or None for plain positions."""
    position_offset: int = 0
