"""Deterministic fake engines for tests and the overhead benchmark (no model, no torch).

`FakeEngine` answers with scripted text after a fixed latency; it does not stream, so callers
that can take such an engine (the proxy, the router) show their generate-then-chunk path with
it. `StreamingFakeEngine` also streams it token by token with a fixed per-token latency. Both
follow the `Engine` contract: `n` choices, `max_tokens` -> finish `length`, stop strings cut the
text, logprobs aligned with the ids, cancellation aborts (and is counted in `aborted`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol, TypedDict, Unpack

import numpy as np

from agentrl.completion import Completion, CompletionDelta, FinishReason, SamplingParams
from agentrl.engine.base import NamedTensors, PromptTooLongError
from agentrl.engine.requests import check_score

Reply = Callable[[str, int], str]
"""(decoded prompt, choice index) -> the text the fake model 'samples'."""


class TextTokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the fakes use."""

    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class FakeEngineOptions(TypedDict, total=False):
    """`FakeEngine`'s keyword arguments."""

    reply: Reply | str
    latency_s: float
    max_context: int
    version: int
    token_ids_for: Callable[[str], list[int]] | None


def fake_logprob(token: int) -> float:
    """The log-prob the fakes give token id `token`, sampled or scored."""
    return -0.01 * (1 + token % 7)


def default_reply(prompt: str, choice: int) -> str:
    suffix = f" (choice {choice})" if choice else ""
    return f"Hello! The answer is 42.{suffix}"


class FakeEngine:
    """Answers every prompt with `reply(decoded prompt, choice)`, tokenized by `token_ids_for`
    (default: the tokenizer), ending with EOS unless a stop string cut it. It records each
    request in `requests`; `fail_with` makes `generate` raise it."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        reply: Reply | str = default_reply,
        latency_s: float = 0.0,
        max_context: int = 2048,
        version: int = 0,
        token_ids_for: Callable[[str], list[int]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.reply: Reply = (lambda _p, _i: reply) if isinstance(reply, str) else reply
        self.latency_s = latency_s
        self._max_context = max_context
        self.version = version
        self.token_ids_for = token_ids_for or (
            lambda text: list(tokenizer.encode(text, add_special_tokens=False))
        )
        self.eos = tokenizer.eos_token_id
        self.requests: list[tuple[list[int], SamplingParams, int]] = []
        self.scored: list[tuple[list[int], int, int]] = []
        """(token ids, start, number of images) of each `score` call."""
        self.aborted = 0
        self.active = 0
        self.fail_with: Exception | None = None
        self.closed = self.sleeping = False

    @property
    def max_context(self) -> int:
        return self._max_context

    def _sample(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[Completion]:
        if len(prompt_ids) >= self._max_context:
            raise PromptTooLongError(len(prompt_ids), self._max_context)
        prompt = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        out = []
        for i in range(params.n):
            text = self.reply(prompt, i)
            stop = None
            for s in params.stop:
                at = text.find(s)
                if at >= 0 and (stop is None or at < text.find(stop)):
                    stop = s
            if stop is not None:
                text = text[: text.find(stop)]
            ids = self.token_ids_for(text)
            if stop is None and self.eos is not None:  # (no EOS to append without one)
                ids = [*ids, self.eos]
            finish: FinishReason = "stop"
            if len(ids) > params.max_tokens:
                ids, finish = ids[: params.max_tokens], "length"
            lps = [fake_logprob(t) for t in ids]
            top = None
            if params.top_logprobs:
                top = [
                    [(t, lp)] + [((t + k) % 200 + 3, lp - k) for k in range(1, params.top_logprobs)]
                    for t, lp in zip(ids, lps, strict=True)
                ]
            out.append(Completion(token_ids=ids, logprobs=lps, finish_reason=finish,
                                  policy_version=self.version, top_logprobs=top,
                                  stop_reason=stop))
        return out

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[np.ndarray] | None = None,
    ) -> list[Completion]:
        self.requests.append((list(prompt_ids), params, len(images or ())))
        if self.fail_with is not None:
            raise self.fail_with
        completions = self._sample(prompt_ids, params)
        self.active += 1
        try:
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.active -= 1
        return completions

    async def score(
        self,
        token_ids: Sequence[int],
        images: Sequence[np.ndarray] | None = None,
        *,
        start: int = 1,
    ) -> list[float]:
        """The log-probs its `generate` reports for the same tokens, `fake_logprob(t)`;
        records the call in `scored`."""
        ids = check_score(token_ids, start, vocab_size=1 << 31, max_context=self._max_context)
        self.scored.append((ids, start, len(images or ())))
        return [fake_logprob(t) for t in ids[start:]]

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """No weights to load: the replies stay, tagged with `version` from now on."""
        self.version = version

    def sleep(self) -> None:
        self.sleeping = True

    def wake(self) -> None:
        self.sleeping = False

    def close(self) -> None:
        self.closed = True


class StreamingFakeEngine(FakeEngine):
    """Also streams: first token after `latency_s`, then one token every `token_latency_s`;
    `fail_after_tokens` makes the stream raise after that many tokens."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        token_latency_s: float = 0.0,
        **kw: Unpack[FakeEngineOptions],
    ) -> None:
        super().__init__(tokenizer, **kw)
        self.token_latency_s = token_latency_s
        self.fail_after_tokens: int | None = None

    async def generate_stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[np.ndarray] | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        self.requests.append((list(prompt_ids), params, len(images or ())))
        completions = self._sample(prompt_ids, params)
        self.active += 1
        sent = 0
        try:
            await asyncio.sleep(self.latency_s)
            longest = max(len(c.token_ids) for c in completions)
            for j in range(longest):
                for i, c in enumerate(completions):
                    if j >= len(c.token_ids):
                        continue
                    if self.fail_after_tokens is not None and sent >= self.fail_after_tokens:
                        raise RuntimeError("fake engine failure")
                    sent += 1
                    yield c.delta(i, j, j + 1, last=j == len(c.token_ids) - 1)
                if self.token_latency_s:
                    await asyncio.sleep(self.token_latency_s)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted += 1
            raise
        finally:
            self.active -= 1
