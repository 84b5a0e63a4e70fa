"""The Engine protocol: what every sampler backend offers to rollouts, the proxy and eval.

One protocol for every engine (the transformers and vLLM backends, the router over many, the
fakes in `agentrl.engine.fakes`), streaming included; its one delta type is
`agentrl.completion.CompletionDelta`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from agentrl.completion import Completion, CompletionDelta, SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch

NamedTensors = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]


class PromptTooLongError(ValueError):
    """The prompt (plus at least one new token) does not fit in the model's context."""

    def __init__(self, prompt_len: int, max_context: int) -> None:
        self.prompt_len = prompt_len
        self.max_context = max_context
        super().__init__(
            f"prompt has {prompt_len} tokens but the model's context is {max_context}; "
            f"shorten the prompt (or the conversation) to at most {max_context - 1} tokens"
        )


class GenerationError(RuntimeError):
    """The engine failed while generating (not the request's fault); every affected request
    gets this error. Rollouts let it propagate instead of recording it per episode."""


@runtime_checkable
class Engine(Protocol):
    """A policy that samples tokens.

    `generate` is async so that many episodes can await it concurrently while the backend
    batches their requests. Cancelling the awaiting task aborts the request and frees its slot.
    `generate_stream` hands out the same completions token by token as they are sampled (the
    proxy's streaming responses).
    """

    @property
    def version(self) -> int:
        """Version of the weights in use; every Completion carries the version it came from."""
        ...

    @property
    def max_context(self) -> int:
        """Most tokens (prompt + completion) a sequence may hold."""
        ...

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[np.ndarray] | None = None,
    ) -> list[Completion]:
        """Sample `params.n` completions of `prompt_ids`."""
        ...

    def generate_stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[np.ndarray] | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Yield deltas of all `params.n` choices as they are sampled (interleaved by index).

        A choice's deltas concatenate to the `Completion` that `generate` would return; its
        last delta carries the finish reason. Closing the iterator (or cancelling the task
        iterating it) aborts the request.
        """
        ...

    async def score(
        self,
        token_ids: Sequence[int],
        images: Sequence[np.ndarray] | None = None,
        *,
        start: int = 1,
    ) -> list[float]:
        """The model's log-probs of `token_ids[start:]`, each given the tokens before it:
        `log p(token_ids[i] | token_ids[:i])` for i in start..len-1, of the raw distribution
        (temperature 1, no top-k/top-p). A prefill, nothing is sampled: how a teacher or a
        reference model reads another policy's tokens. `images` as for `generate` (a
        vision-language model's placeholders expanded in `token_ids`)."""
        ...

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load new parameters (a state dict or an iterator of (name, tensor)) as `version`."""
        ...

    def sleep(self) -> None:
        """Free memory held for generation (KV cache, weights copy) while training runs."""
        ...

    def wake(self) -> None:
        """Restore what `sleep` freed."""
        ...

    def close(self) -> None:
        """Stop for good: free the model's memory and end the engine's threads and processes
        (vLLM's engine runs in processes of its own). Calling it twice is harmless."""
        ...
