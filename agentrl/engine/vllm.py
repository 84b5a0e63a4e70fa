"""The vLLM backend (optional extra: `pip install agentrl[vllm]`, CUDA only).

vLLM cannot be installed on the development machines (PyPI has CUDA wheels only), so this module
is written against vLLM's documented V1 API and tested against a fake that behaves as those docs
say (tests/engine/fake_vllm.py), not against vLLM itself:

- `vllm.v1.engine.async_llm.AsyncLLM.from_engine_args(AsyncEngineArgs(...))`;
  `AsyncLLM.generate(prompt, sampling_params, request_id)` is an async generator of
  `RequestOutput`s (`output_kind=RequestOutputKind.FINAL_ONLY` yields just the last one), whose
  `.outputs` are `CompletionOutput`s with `token_ids`, `logprobs` (per position a dict
  token id -> `Logprob(logprob=...)`), `finish_reason` ("stop" | "length" | "abort") and
  `stop_reason` (with `output_kind=RequestOutputKind.DELTA` each output holds only the tokens
  and logprobs new since the previous one: `generate_stream` uses it);
  `abort(request_id)`, `sleep(level)`, `wake_up()`, `reset_prefix_cache()`,
  `collective_rpc(method, args=...)`, `shutdown()`.
- Prompts are `vllm.inputs.TokensPrompt(prompt_token_ids=...)`: never re-tokenized.
- Logprobs: the engine argument `logprobs_mode` picks "processed_logprobs" (after temperature,
  top-k/top-p: our default) or "raw_logprobs"; it is fixed per engine, so a request asking for
  the other kind is refused rather than silently answered with the wrong one.
- Weights: `collective_rpc("agentrl_load_weights", args=(named_tensors,))` runs on every worker
  the method of the worker extension below (`worker_extension_cls` engine argument), which calls
  the model's `load_weights` (vLLM's documented in-place weight loading, as in its RLHF
  examples). Tensors travel pickled, in buckets; cross-machine NCCL broadcast is the trainer's
  weight-sync module's business. Generation is paused around the update where vLLM offers
  `pause_generation`.

AsyncLLM lives in the event loop that created it, so this engine runs it on its own loop thread
and `generate` awaits it from any caller loop (the collector, the proxy, `collect_sync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agentrl.engine.base import NamedTensors
from agentrl.engine.requests import check_request
from agentrl.types import Completion, CompletionDelta, SamplingParams

if TYPE_CHECKING:
    import numpy as np

WORKER_EXTENSION = "agentrl.engine.vllm.WorkerExtension"


class WorkerExtension:
    """Mixed into vLLM's GPU worker (`worker_extension_cls`); runs inside each worker."""

    def agentrl_load_weights(self, named_tensors: list[tuple[str, Any]]) -> int:
        device = self.device  # type: ignore[attr-defined]  # provided by vLLM's Worker
        weights = [(name, t.to(device)) for name, t in named_tensors]
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        return len(weights)


class VLLMEngine:
    """Engine over vLLM's AsyncLLM (see module docstring; tested against a fake of vLLM).

    Args:
        model: model name or local path, as vLLM takes it.
        version: version of the initial weights.
        raw_logprobs: report raw model logprobs instead of the processed distribution's.
        bucket_bytes: most bytes per `collective_rpc` call when updating weights.
        **engine_kwargs: more `AsyncEngineArgs` (gpu_memory_utilization, dtype, ...).
    """

    def __init__(
        self,
        model: str,
        *,
        version: int = 0,
        raw_logprobs: bool = False,
        bucket_bytes: int = 256 << 20,
        **engine_kwargs: Any,
    ) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise ImportError(
                "the vllm backend needs vLLM (CUDA only): pip install 'agentrl[vllm]'; "
                "on CPU use backend='transformers'"
            ) from e
        self._raw = raw_logprobs
        self._version = int(version)
        self.bucket_bytes = bucket_bytes
        args = {
            "model": model,
            "enable_sleep_mode": True,
            "enable_prefix_caching": True,
            "logprobs_mode": "raw_logprobs" if raw_logprobs else "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION,
            **engine_kwargs,
        }
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="agentrl-vllm", daemon=True
        )
        self._thread.start()

        async def _make() -> Any:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

        self.llm = self._call(_make())
        self._max_context = int(self.llm.model_config.max_model_len)
        self.vocab_size = int(self.llm.model_config.get_vocab_size())
        self._tokenizer = None

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._call(self.llm.get_tokenizer())
        return self._tokenizer

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[np.ndarray] | None = None,
        *,
        request_id: str | None = None,
    ) -> list[Completion]:
        """Sample `params.n` completions; cancelling the caller aborts the vLLM request."""
        prompt = self._check(prompt_ids, params)
        rid = request_id or uuid.uuid4().hex
        fut = asyncio.run_coroutine_threadsafe(
            self._generate(prompt, params, images, rid), self._loop
        )
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            self.abort(rid)
            raise

    async def generate_stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[np.ndarray] | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Yield the new tokens of the `params.n` choices as vLLM outputs them (DELTA kind).

        A choice's last delta carries its finish reason. Closing the iterator or cancelling
        the task iterating it aborts the vLLM request.
        """
        prompt = self._check(prompt_ids, params)
        rid = request_id or uuid.uuid4().hex
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue[list[CompletionDelta] | Exception | None] = asyncio.Queue()

        def put(item: list[CompletionDelta] | Exception | None) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                caller.call_soon_threadsafe(queue.put_nowait, item)

        fut = asyncio.run_coroutine_threadsafe(
            self._stream(prompt, params, images, rid, put), self._loop
        )
        completed = False
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                for d in item:
                    yield d
            completed = True
        finally:
            if not completed:
                fut.cancel()
                self.abort(rid)

    def _check(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        prompt = check_request(
            prompt_ids, params, vocab_size=self.vocab_size, max_context=self._max_context
        )
        if params.logprobs and params.raw_logprobs != self._raw:
            kind = "raw" if params.raw_logprobs else "processed"
            raise ValueError(
                f"this vLLM engine reports {'raw' if self._raw else 'processed'} logprobs "
                f"(vLLM fixes logprobs_mode per engine); it cannot return {kind} ones. Create "
                f"the engine with raw_logprobs={params.raw_logprobs}"
            )
        return prompt

    async def _stream(
        self,
        prompt: list[int],
        params: SamplingParams,
        images: Any,
        rid: str,
        put: Callable[[list[CompletionDelta] | Exception | None], None],
    ) -> None:
        """Runs on the vLLM loop: hands each output's deltas to `put`, then None."""
        from vllm.sampling_params import RequestOutputKind

        version = self._version
        finished = [False] * params.n
        try:
            async for out in self.llm.generate(
                prompt=self._prompt(prompt, images),
                sampling_params=self._to_vllm(params, RequestOutputKind.DELTA),
                request_id=rid,
            ):
                deltas = [
                    _delta(o, params, version)
                    for o in sorted(out.outputs, key=lambda o: o.index)
                    if o.token_ids or o.finish_reason is not None
                ]
                for d in deltas:
                    finished[d.index] = finished[d.index] or d.finish_reason is not None
                put(deltas)
            # Choices vLLM ended without a finish reason (an abort) end here.
            empty: list[float] | None = [] if params.logprobs else None
            put(
                [
                    CompletionDelta(
                        index=i,
                        token_ids=[],
                        logprobs=empty,
                        finish_reason="abort",
                        policy_version=version,
                    )
                    for i, done in enumerate(finished)
                    if not done
                ]
            )
        except Exception as e:
            put(e)  # the caller's iteration raises it
            raise
        finally:
            put(None)

    async def _generate(
        self, prompt: list[int], params: SamplingParams, images: Any, rid: str
    ) -> list[Completion]:
        from vllm.sampling_params import RequestOutputKind

        version = self._version
        final = None
        async for out in self.llm.generate(
            prompt=self._prompt(prompt, images),
            sampling_params=self._to_vllm(params, RequestOutputKind.FINAL_ONLY),
            request_id=rid,
        ):
            final = out
        if final is None:
            return [
                Completion(
                    token_ids=[], logprobs=None, finish_reason="abort", policy_version=version
                )
            ] * params.n
        return [
            _completion(o, params, version) for o in sorted(final.outputs, key=lambda o: o.index)
        ]

    def _prompt(self, prompt: list[int], images: Any) -> Any:
        from vllm.inputs import TokensPrompt

        inputs: dict[str, Any] = {"prompt_token_ids": prompt}
        if images:
            inputs["multi_modal_data"] = {"image": list(images)}
        return TokensPrompt(**inputs)

    def _to_vllm(self, params: SamplingParams, output_kind: Any) -> Any:
        from vllm import SamplingParams as VSamplingParams

        want = max(params.top_logprobs, 0)
        return VSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_tokens,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            seed=params.seed,
            logprobs=want if params.logprobs or want else None,
            output_kind=output_kind,
        )

    def abort(self, request_id: str) -> bool:
        asyncio.run_coroutine_threadsafe(self.llm.abort(request_id), self._loop)
        return True

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Send the tensors to every worker in buckets and switch to `version`."""
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        self._call(self._update(items, version))

    async def _update(self, items: Iterable[tuple[str, Any]], version: int) -> None:
        pause = getattr(self.llm, "pause_generation", None)
        if pause is not None:
            await pause()
        try:
            bucket: list[tuple[str, Any]] = []
            size = 0
            for name, tensor in items:
                bucket.append((name, tensor.detach().cpu()))
                size += tensor.numel() * tensor.element_size()
                if size >= self.bucket_bytes:
                    await self.llm.collective_rpc("agentrl_load_weights", args=(bucket,))
                    bucket, size = [], 0
            if bucket:
                await self.llm.collective_rpc("agentrl_load_weights", args=(bucket,))
            await self.llm.reset_prefix_cache()  # cached KV came from the old weights
            self._version = int(version)
        finally:
            resume = getattr(self.llm, "resume_generation", None)
            if pause is not None and resume is not None:
                await resume()

    def sleep(self) -> None:
        """Level 1: weights to CPU, KV cache freed (vLLM sleep mode)."""
        self._call(self.llm.sleep(level=1))

    def wake(self) -> None:
        self._call(self.llm.wake_up())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self.llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


def _tokens(out: Any, params: SamplingParams) -> tuple[list[int], list[float] | None, Any]:
    """Token ids, their logprobs (if asked for) and top logprobs (if asked for) of an output."""
    ids = [int(t) for t in out.token_ids]
    lps = top = None
    if out.logprobs is not None:
        lps = [float(d[t].logprob) for t, d in zip(ids, out.logprobs, strict=True)]
        if params.top_logprobs:
            top = [
                sorted(((int(k), float(v.logprob)) for k, v in d.items()), key=lambda kv: -kv[1])[
                    : params.top_logprobs
                ]
                for d in out.logprobs
            ]
    return ids, lps if params.logprobs else None, top


def _finish(out: Any) -> Any:
    if out.finish_reason is None:
        return None
    return out.finish_reason if out.finish_reason in ("stop", "length", "abort") else "abort"


def _completion(out: Any, params: SamplingParams, version: int) -> Completion:
    ids, lps, top = _tokens(out, params)
    return Completion(
        token_ids=ids,
        logprobs=lps,
        finish_reason=_finish(out) or "abort",
        policy_version=version,
        stop_reason=out.stop_reason,
        top_logprobs=top,
    )


def _delta(out: Any, params: SamplingParams, version: int) -> CompletionDelta:
    ids, lps, top = _tokens(out, params)
    finish = _finish(out)
    return CompletionDelta(
        index=int(out.index),
        token_ids=ids,
        logprobs=lps,
        top_logprobs=top,
        finish_reason=finish,
        policy_version=version,
        stop_reason=out.stop_reason if finish is not None else None,
    )
