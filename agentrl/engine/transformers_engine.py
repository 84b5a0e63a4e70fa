"""The transformers backend: many concurrent `generate` calls batched on one model, CPU or GPU.

A worker thread owns the forward passes. Each iteration it admits waiting requests (the
`Scheduler`), prefills them together and runs one decode step for every running sample (the
`ModelRunner`), drawing each sample's next token (the `Sampler`, in `token_sampling`). Samples
that finish leave the batch, and their slots go to waiting requests at the next iteration
(continuous batching). This class ties the three together and is the `Engine` callers see.

Why not transformers' own continuous batching (`generate_batch`, paged KV)? On the 2-core CPU
machines it ran at ~60 tok/s for 16 requests, below a padded `generate` batch (~150 slot
tokens/s), and it neither samples per-request seeds nor reports logprobs of the processed
distribution. The numbers behind this choice are in benchmarks/results/generation.md.

The model may be the very module a trainer trains (colocated): forward passes run under
`torch.no_grad()` in the worker thread (grad mode is thread-local, so the trainer is
unaffected), the module's train/eval mode is left alone, and `update_weights` with the model's
own tensors costs nothing but a version bump.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import torch

from agentrl.completion import Completion, CompletionDelta, SamplingParams
from agentrl.engine.base import NamedTensors
from agentrl.engine.grammar import GrammarMasks
from agentrl.engine.kv import PrefixCache
from agentrl.engine.model_runner import DecodeStep, ModelRunner, chunks_within
from agentrl.engine.requests import (
    Request,
    Sample,
    check_request,
    check_score,
    empty_completion,
)
from agentrl.engine.scheduler import Scheduler
from agentrl.engine.token_sampling import Drawn, Sampler, model_eos_ids
from agentrl.models.vision import VisionProcessor, is_vision_config, vision_processor
from agentrl.seeding import derive_seed

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class TransformersEngine:
    """Engine over a Hugging Face causal LM (see module docstring).

    Args:
        model: the causal LM; may be the trainer's own module.
        tokenizer: its tokenizer (eos ids, stop-string detection).
        max_batch_size: most samples decoded together; more wait for a free slot.
        device: where to run; default the model's device (the model is moved otherwise).
        version: version of the initial weights.
        prefix_cache_bytes: KV bytes kept for prefix reuse across requests (0 disables).
        max_prefill_tokens: most (padded) prompt tokens encoded in one forward pass.
        seed: seeds the generator of requests without their own seed.
        admission_window: seconds an idle engine waits for further requests after one arrives
            (until none arrived for this long, at most 5 times this in all); 0 admits at once.
        decode_step: `(model, ids_B, pos_B, cache, mask_B_T, counters=...) -> logits_B_V`
            for a decode step, or None where it does not cover the model (the model's forward
            runs then); None (default) always runs the model's forward. The caller picks one
            for the device: `agentrl.backends.engine_options(device)`.
        vision: a vision-language model's `VisionProcessor` (default: the one of the model
            the tokenizer names, `agentrl.models.vision.vision_processor`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = 64,
        device: str | None = None,
        version: int = 0,
        prefix_cache_bytes: int = 1 << 30,
        max_prefill_tokens: int = 8192,
        seed: int | None = None,
        admission_window: float = 0.005,
        decode_step: DecodeStep | None = None,
        vision: VisionProcessor | None = None,
    ) -> None:
        self.scheduler = Scheduler(max_batch_size, admission_window)
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        if param.device != self.device:
            # Typed as nn.Module's `to` (it calls the model's own): transformers wraps its `to`
            # with functools.wraps, which type checkers do not bind as a method.
            module: torch.nn.Module = model
            module.to(self.device)
        self.model = model
        self._tokenizer = tokenizer
        self._version = int(version)
        cfg = model.config.get_text_config()
        self._max_context = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        eos_ids = model_eos_ids(model, tokenizer)
        self.grammars = GrammarMasks(tokenizer, self.vocab_size, eos_ids)
        self.vision: VisionProcessor | None = None
        if is_vision_config(model.config):
            self.vision = vision or vision_processor(tokenizer)
            if self.vision is None:
                raise ValueError(
                    f"{type(model).__name__} is a vision-language model, but no image processor "
                    f"is known for tokenizer {getattr(tokenizer, 'name_or_path', '')!r}; load "
                    f"the tokenizer from the model's directory (agentrl.models.load_tokenizer)"
                )
        self.counters: collections.Counter[str] = collections.Counter()
        self.runner = ModelRunner(
            model, device=self.device, counters=self.counters,
            prefix_cache_bytes=prefix_cache_bytes, max_prefill_tokens=max_prefill_tokens,
            decode_step=decode_step, vision=self.vision,
        )
        self.sampler = Sampler(tokenizer, self.grammars, eos_ids, seed)
        self._step_lock = threading.Lock()
        self._worker = threading.Thread(target=self._loop, name="agentrl-engine", daemon=True)
        self._worker.start()

    # ----------------------------------------------------------------- public API

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end a sample."""
        return self.sampler.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self.sampler.eos_ids = ids

    @property
    def prefix_cache(self) -> PrefixCache:
        return self.runner.prefix_cache

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[np.ndarray] | None = None,
        *,
        request_id: str | None = None,
    ) -> list[Completion]:
        """Sample `params.n` completions of `prompt_ids` (token ids, never re-tokenized).

        Cancelling the awaiting task aborts the request and frees its slots; `abort(request_id)`
        instead makes this call return the tokens so far with finish reason "abort".
        """
        prompt, grammar = await self._checked(prompt_ids, params)
        req = self._submit(prompt, params, images, request_id, stream=False, grammar=grammar)
        if req is None:
            return [empty_completion(params, self._version) for _ in range(params.n)]
        try:
            return await req.future
        except asyncio.CancelledError:
            self.abort(req.id)
            raise

    async def generate_stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[np.ndarray] | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[CompletionDelta]:
        """Like `generate`, but yield each decode step's new tokens as soon as they are sampled.

        Deltas of the `params.n` choices interleave by `index`; a choice's deltas concatenate to
        exactly the `Completion` that `generate` returns, and its last delta carries the finish
        reason (and stop reason). Closing the iterator or cancelling the task iterating it
        aborts the request and frees its slots.
        """
        prompt, grammar = await self._checked(prompt_ids, params)
        req = self._submit(prompt, params, images, request_id, stream=True, grammar=grammar)
        if req is None:
            for i in range(params.n):
                yield empty_completion(params, self._version).delta(i)
            return
        assert req.stream is not None
        sent, finished = [0] * params.n, [False] * params.n
        completed = False
        try:
            while (deltas := await req.stream.get()) is not None:
                for d in deltas:
                    sent[d.index] += len(d.token_ids)
                    finished[d.index] = d.finish_reason is not None
                    yield d
            completed = True
            # Samples that ended without a sampled token (abort, close, sleep) end here.
            for i, c in enumerate(await req.future):
                if not finished[i]:
                    yield c.delta(i, sent[i])
        finally:
            if not completed:
                self.abort(req.id)
                # A failure resolving the future after the consumer left is nobody's to read.
                req.future.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def score(
        self,
        token_ids: Sequence[int],
        images: Sequence[np.ndarray] | None = None,
        *,
        start: int = 1,
    ) -> list[float]:
        """The model's log-probs of `token_ids[start:]` (`Engine.score`): one forward pass, run
        off the caller's loop between two of the worker's steps, nothing sampled or cached."""
        ids = check_score(token_ids, start, vocab_size=self.vocab_size,
                          max_context=self._max_context)
        vision = self.runner.vision_prompt(ids, images) if images else None
        if self.scheduler.closed:
            raise RuntimeError("engine is closed")

        def run() -> list[float]:
            with self._step_lock, torch.no_grad():
                return self.runner.score(ids, vision, start).tolist()

        return await asyncio.to_thread(run)

    async def _checked(self, prompt_ids: Sequence[int], params: SamplingParams
                       ) -> tuple[list[int], Any]:
        """The request checked (`check_request`), and its grammar compiled (GrammarError where
        it cannot be; None without one) off the caller's event loop (the proxy's, serving every
        other request) by `GrammarMasks.compile`, which stops a compile past its timeout or
        when the caller is cancelled."""
        prompt = check_request(
            prompt_ids, params, vocab_size=self.vocab_size, max_context=self._max_context
        )
        if params.grammar is None:
            return prompt, None
        return prompt, await self.grammars.compile(params.grammar)

    def _submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        images: Sequence[np.ndarray] | None,
        request_id: str | None,
        *,
        stream: bool,
        grammar: Any,
    ) -> Request | None:
        """Queue a checked request (with its compiled `grammar`, if any); None when there is
        nothing to sample (max_tokens=0)."""
        vision = self.runner.vision_prompt(prompt, images) if images else None
        if self.scheduler.closed:
            raise RuntimeError("engine is closed")
        if params.max_tokens == 0:
            return None
        loop = asyncio.get_running_loop()
        req = Request(
            request_id or uuid.uuid4().hex, prompt, params, loop, loop.create_future(), vision,
            grammar,
        )
        if stream:
            req.stream = asyncio.Queue()
        self.scheduler.submit(req)
        return req

    def abort(self, request_id: str) -> bool:
        """Stop a request: its samples end with finish reason "abort" and free their slots."""
        return self.scheduler.abort(request_id)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load parameters by name (state dict or iterator of pairs) and switch to `version`.

        Tensors that already are the model's own storage (colocated trainer) are not copied.
        Runs between two decode steps, without waiting for running samples (partial rollout):
        their prompts and tokens so far are encoded again by the new weights (one prefill
        pass), so every token they sample from then on is exactly the new version's, with its
        log-prob, and is recorded as such (`Completion.version_changes`). Cached prefixes
        (old weights' KV) are dropped.
        """
        with self._step_lock, torch.no_grad():
            copied = self.runner.load_weights(named_tensors, self._version)
            changed = int(version) != self._version
            self._version = int(version)
            self.runner.prefix_cache.clear()
            if changed and any(not r.done for r in self.runner.rows):
                self.runner.reencode_running(self._version)
        logger.debug("update_weights: version %d, %d tensors copied", version, copied)

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV cache held: the running batch and the prefix cache."""
        return self.runner.kv_bytes

    def sleep(self) -> None:
        """Abort running samples and free the KV caches; new requests wait for `wake()`."""
        self.scheduler.set_sleeping(True)
        with self._step_lock:
            self._abort_rows(lambda s: True)
            self.runner.clear()
            self.runner.prefix_cache.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        self.scheduler.set_sleeping(False)

    def close(self) -> None:
        """Stop the worker; waiting and running requests end with "abort"."""
        if not self.scheduler.close():
            return
        self._worker.join(timeout=60)
        for req in self.scheduler.drain():
            self._abort_pending(req)
        self._abort_rows(lambda s: True)
        self.runner.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def num_running(self) -> int:
        """Samples holding a batch slot."""
        return sum(not s.done for s in self.runner.rows)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.pending)

    # ----------------------------------------------------------------- worker

    def _loop(self) -> None:
        while True:
            admitted = self.scheduler.next_admission(lambda: self.runner.rows,
                                                     self._abort_pending)
            if admitted is None:
                return
            with self._step_lock:
                try:
                    with torch.no_grad():
                        self._abort_rows(lambda s: s.request.aborted)
                        if admitted:
                            self._prefill(admitted)
                        # Samples can all finish at their first token (max_tokens=1, a stop).
                        if any(not s.done for s in self.runner.rows):
                            self._sample(*self.runner.decode())
                        self.runner.compact()
                except Exception as e:  # the failure goes to the callers, the worker lives on
                    logger.exception("generation step failed")
                    self._fail_all(e, admitted)

    def _new_samples(self, req: Request) -> list[Sample]:
        limit = min(req.params.max_tokens, self._max_context - len(req.prompt))
        samples = []
        for j in range(req.params.n):
            gen = None
            if req.params.seed is not None:
                gen = torch.Generator().manual_seed(derive_seed(req.params.seed, j))
            matcher = None if req.grammar is None else self.grammars.matcher(req.grammar)
            samples.append(Sample(req, j, gen, limit, self._version, length=len(req.prompt),
                                  matcher=matcher))
        req.samples = samples
        return samples

    def _prefill(self, requests: list[Request]) -> None:
        """Encode the admitted requests' prompts and sample their first tokens. A request that
        fails here fails alone: a chunk of prompts that fails is encoded again a prompt at a
        time, and only the requests of a prompt that fails on its own fail (#34)."""
        self.counters["admissions"] += 1
        by_prompt: dict[tuple[int, ...], list[Sample]] = {}
        first: dict[tuple[int, ...], Request] = {}
        for req in requests:  # keyed with the images: equal token ids, other screenshots differ
            try:
                samples = self._new_samples(req)
            except Exception as e:  # noqa: BLE001 - e.g. its grammar's matcher
                self.scheduler.fail(req, e)
                continue
            key = tuple(req.key)
            by_prompt.setdefault(key, []).extend(samples)
            first.setdefault(key, req)
        prompts = sorted(by_prompt, key=len)
        self.runner.prefill_shared_prefix(prompts)
        chunks = chunks_within(prompts, len, self.runner.max_prefill_tokens)
        while chunks:
            chunk = chunks.pop(0)
            try:
                cache, logits = self.runner.prefill_requests([first[p] for p in chunk])
            except Exception as e:  # noqa: BLE001 - retried alone, or failed alone
                if len(chunk) > 1:
                    chunks[:0] = [[p] for p in chunk]
                else:
                    for req in {id(s.request): s.request for s in by_prompt[chunk[0]]}.values():
                        self.scheduler.fail(req, e)
                continue
            index = [u for u, p in enumerate(chunk) for _ in by_prompt[p]]
            samples = [s for p in chunk for s in by_prompt[p]]
            expanded = cache.select(torch.tensor(index, device=self.device))
            assert expanded is not None
            self._sample(samples, logits.index_select(0, torch.tensor(index, device=self.device)))
            self.runner.add_rows(samples, expanded)

    def _sample(self, samples: list[Sample], logits_B_V: torch.Tensor) -> None:
        """Draw the next token of each sample, record it, and finish samples that are done.
        A request that fails here fails alone (`Scheduler.fail`): the others go on (#34)."""
        uniform = self.sampler.uniforms(samples)
        drawn: list[Drawn | None] = self.sampler.draw_isolated(
            samples, logits_B_V, uniform, self.scheduler.fail
        )
        streamed: dict[int, tuple[Request, list[CompletionDelta]]] = {}
        for s, d in zip(samples, drawn, strict=True):
            if d is None or s.done:  # its request failed (in this step)
                continue
            try:
                self.sampler.take(s, *d)
            except Exception as e:  # noqa: BLE001 - the request fails, not the batch
                self.scheduler.fail(s.request, e)
                continue
            self.counters["generated_tokens"] += 1
            if s.request.stream is not None:
                streamed.setdefault(id(s.request), (s.request, []))[1].append(s.delta(-1))
        # One hand-off per request and step, before any request resolves: the consumer sees
        # every token before the end-of-stream marker that `resolve` queues after the deltas.
        for req, deltas in streamed.values():
            if not req.failed:
                req.emit(deltas)
        for s in samples:
            if s.done and not s.request.failed:
                self._on_sample_done(s)

    def _on_sample_done(self, s: Sample) -> None:
        req = s.request
        if s.finish != "abort" and self.runner.prefix_cache.max_bytes and len(s.tokens) > 1:
            # Keep prompt + completion KV: the next turn of a multi-turn episode extends it.
            kv = self.runner.row_prefix(s)
            if kv is not None:
                self.runner.prefix_cache.insert(req.key + s.tokens[:-1], kv)
        if all(x.done for x in req.samples):
            self.scheduler.forget(req)
            req.finish_all()

    def _abort_rows(self, which: Callable[[Sample], bool]) -> None:
        for s in self.runner.rows:
            if not s.done and which(s):
                s.finish = "abort"
                self._on_sample_done(s)

    def _abort_pending(self, req: Request) -> None:
        self.scheduler.forget(req)
        req.samples = self._new_samples(req)
        for s in req.samples:
            s.finish = "abort"
        req.finish_all()

    def _fail_all(self, error: Exception, admitted: list[Request]) -> None:
        requests = {id(s.request): s.request for s in self.runner.rows}
        requests.update({id(r): r for r in admitted})
        self.scheduler.fail_all(error, list(requests.values()))
        self.runner.clear()
