"""The narrow protocols the proxy depends on, so tests build the real app from fakes.

`GenerateEngine` is the part of `agentrl.engine.Engine` the proxy uses. `StreamingEngine` is an
optional extension: engines that have it stream tokens as they are sampled; for the others the
proxy generates the whole completion and then sends it in chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from agentrl.types import Completion, SamplingParams


@runtime_checkable
class GenerateEngine(Protocol):
    @property
    def max_context(self) -> int: ...

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[np.ndarray] | None = None,
    ) -> list[Completion]: ...


class TokenDelta(Protocol):
    """New tokens of one choice. `finish_reason` is None until the choice's last delta."""

    @property
    def index(self) -> int: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[float] | None: ...
    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]] | None: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def policy_version(self) -> int: ...


@runtime_checkable
class StreamingEngine(Protocol):
    def generate_stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[np.ndarray] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Yield deltas of all `params.n` choices as they are sampled (interleaved by index).

        Closing the iterator (or cancelling the task iterating it) aborts the request.
        """
        ...


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the proxy uses."""

    eos_token_id: int | None

    @property
    def all_special_ids(self) -> list[int]: ...
    def __len__(self) -> int: ...
    def apply_chat_template(self, conversation: list, **kwargs: object) -> str: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...
    def get_vocab(self) -> dict[str, int]: ...
