"""The transformers backend: many concurrent `generate` calls batched on one model, CPU or GPU.

A worker thread owns the forward passes. Each iteration it admits waiting requests (prefilling
them together, each distinct prompt once even when it has n samples, resuming from the longest
cached prefix), then runs one decode step for every running sample. Samples that finish leave
the batch, and their slots go to waiting requests at the next iteration (continuous batching).
The KV cache is a masked, left-aligned batch of rows written in place (see `agentrl.engine.kv`).
Decode steps go through the model's forward unless a `decode_step` is given: on a CPU,
`agentrl.backends.engine_options` gives the lean Llama step of `agentrl.backends.cpu` (through
compiled kernels where they measured faster); prefill always uses the model's forward.

An idle engine waits a few milliseconds after a request arrives for others to join it, so that
requests submitted together (a rollout's episodes, resetting their envs in threads, arrive over
~10 ms) are prefilled in one pass rather than one pass for the first and another for the rest.

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
import difflib
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from agentrl.engine.base import GenerationError, NamedTensors
from agentrl.engine.grammar import GrammarMasks
from agentrl.engine.kv import KV, BatchCache, PrefixCache, filled_kv
from agentrl.engine.requests import (
    Request,
    Sample,
    VisionPrompt,
    check_request,
    stop_string_hit,
)
from agentrl.engine.sampling import sample_tokens
from agentrl.models.vision import VisionProcessor, check_image, is_vision_config, vision_processor
from agentrl.types import Completion, CompletionDelta, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

T = TypeVar("T")
DecodeStep = Callable[..., "torch.Tensor | None"]
"""`(model, ids_B, pos_B, cache, mask_B_T, *, counters) -> next-token logits [B, V] | None`."""
_Drawn = tuple[int, float, list[tuple[int, float]]]
"""A sample's drawn token, its logprob, and its top alternatives (empty unless asked for)."""

_MIN_SHARED_TOKENS_SAVED = 128
"""Encode the common start of an admission's prompts once on its own only when that saves at
least this many token encodings ((prompts - 1) x its length): the extra forward pass reads all
the weights once more. SmolLM2 on the 2-core CPU: a 30-token system prompt shared by 2 or 4
prompts prefilled slower on its own (175 -> 246 ms, 266 -> 289 ms), a ~250-token one faster
(2 prompts 1572 -> 738 ms, 4 prompts 816 -> 619 ms; noisy VM, ad-hoc A/B)."""


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
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        param = next(model.parameters())
        self.device = torch.device(device) if device is not None else param.device
        if param.device != self.device:
            # Typed as nn.Module's `to` (it calls the model's own): transformers wraps its `to`
            # with functools.wraps, which type checkers do not bind as a method.
            module: torch.nn.Module = model
            module.to(self.device)
        self.model = model
        self._tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.admission_window = admission_window
        self.decode_step = decode_step
        self._version = int(version)
        cfg = model.config.get_text_config()
        self._max_context = int(getattr(cfg, "max_position_embeddings", 0) or 2048)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_ids = _eos_ids(model, tokenizer)
        self.grammars = GrammarMasks(tokenizer, self.vocab_size, self.eos_ids)
        self.vision: VisionProcessor | None = None
        if is_vision_config(model.config):
            self.vision = vision or vision_processor(tokenizer)
            if self.vision is None:
                raise ValueError(
                    f"{type(model).__name__} is a vision-language model, but no image processor "
                    f"is known for tokenizer {getattr(tokenizer, 'name_or_path', '')!r}; load "
                    f"the tokenizer from the model's directory (agentrl.models.load_tokenizer)"
                )
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self._rng = torch.Generator().manual_seed(
            int(np.random.SeedSequence(seed).generate_state(1)[0])
        )
        self._cv = threading.Condition()
        self._step_lock = threading.Lock()
        self._pending: collections.deque[Request] = collections.deque()
        self._by_id: dict[str, Request] = {}
        self._batch: BatchCache | None = None
        self._rows: list[Sample] = []
        self._closed = self._sleeping = False
        self.counters: collections.Counter[str] = collections.Counter()
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
            return [_empty_completion(params, self._version) for _ in range(params.n)]
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
                yield _empty_completion(params, self._version).delta(i)
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

    async def _checked(self, prompt_ids: Sequence[int], params: SamplingParams
                       ) -> tuple[list[int], Any]:
        """The request checked (`check_request`), and its grammar compiled (GrammarError where
        it cannot be; None without one) in a worker thread: a large schema, or the first
        grammar's vocabulary scan, takes long enough to stall the caller's event loop (the
        proxy's, serving every other request)."""
        prompt = check_request(
            prompt_ids, params, vocab_size=self.vocab_size, max_context=self._max_context
        )
        if params.grammar is None:
            return prompt, None
        return prompt, await asyncio.to_thread(self.grammars.compile, params.grammar)

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
        vision = self._vision_prompt(prompt, images) if images else None
        if self._closed:
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
        with self._cv:
            if req.id in self._by_id:
                raise ValueError(f"request id {req.id!r} is already running")
            self._by_id[req.id] = req
            self._pending.append(req)
            self._cv.notify_all()
        return req

    def _vision_prompt(self, prompt: list[int], images: Sequence[np.ndarray]) -> VisionPrompt:
        """Check a prompt's images against its image tokens and place them (ImageError, a
        ValueError, when they do not fit)."""
        if self.vision is None:
            raise ValueError(
                "this TransformersEngine serves a text-only model; images need a vision-language "
                "model (pass images=None)"
            )
        imgs = [check_image(im) for im in images]
        spans = self.vision.spans(prompt, imgs)
        positions = self.vision.positions(self.model, prompt, imgs)
        pos, offset = positions if positions is not None else (None, 0)
        return VisionPrompt(imgs, spans, self.vision.key_ids(prompt, imgs), pos, offset)

    def abort(self, request_id: str) -> bool:
        """Stop a request: its samples end with finish reason "abort" and free their slots."""
        with self._cv:
            req = self._by_id.get(request_id)
            if req is None:
                return False
            req.aborted = True
            self._cv.notify_all()
        return True

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load parameters by name (state dict or iterator of pairs) and switch to `version`.

        Tensors that already are the model's own storage (colocated trainer) are not copied.
        Runs between two decode steps, without waiting for running samples (partial rollout):
        their prompts and tokens so far are encoded again by the new weights (one prefill
        pass), so every token they sample from then on is exactly the new version's, with its
        log-prob, and is recorded as such (`Completion.version_changes`). Cached prefixes
        (old weights' KV) are dropped.
        """
        targets = self.model.state_dict(keep_vars=True)
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        copied = 0
        with self._step_lock, torch.no_grad():
            for name, tensor in items:
                target = targets.get(name)
                if target is None:
                    target = targets.get(_strip_wrappers(name))
                if target is None:
                    hint = difflib.get_close_matches(name, list(targets), n=1)
                    raise ValueError(
                        f"update_weights: the model has no parameter {name!r}"
                        + (f"; did you mean {hint[0]!r}?" if hint else "")
                        + f" (version stays {self._version}; earlier tensors were applied)"
                    )
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)} but the model "
                        f"expects {tuple(target.shape)}"
                    )
                if target.data_ptr() == tensor.data_ptr() and target.device == tensor.device:
                    continue
                target.data.copy_(tensor)
                copied += 1
            changed = int(version) != self._version
            self._version = int(version)
            self.prefix_cache.clear()
            if changed and any(not r.done for r in self._rows):
                self._reencode_running()
        logger.debug("update_weights: version %d, %d tensors copied", version, copied)

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV cache held: the running batch and the prefix cache."""
        batch = self._batch
        return (batch.nbytes() if batch is not None else 0) + self.prefix_cache.nbytes

    def sleep(self) -> None:
        """Abort running samples and free the KV caches; new requests wait for `wake()`."""
        with self._cv:
            self._sleeping = True
        with self._step_lock:
            self._abort_rows(lambda s: True)
            self._batch, self._rows = None, []
            self.prefix_cache.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        with self._cv:
            self._sleeping = False
            self._cv.notify_all()

    def close(self) -> None:
        """Stop the worker; waiting and running requests end with "abort"."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._worker.join(timeout=60)
        with self._cv:
            pending = list(self._pending)
            self._pending.clear()
        for req in pending:
            self._abort_pending(req)
        self._abort_rows(lambda s: True)
        self._batch, self._rows = None, []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def num_running(self) -> int:
        """Samples holding a batch slot."""
        return sum(not s.done for s in self._rows)

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    # ----------------------------------------------------------------- worker

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (
                    self._sleeping or (not self._pending and not self._rows)
                ):
                    self._cv.wait()
                if self._closed:
                    return
                if not self._rows and self.admission_window > 0:
                    self._await_companions()
                admitted = self._admit()
            with self._step_lock:
                try:
                    with torch.no_grad():
                        self._reap_aborted()
                        if admitted:
                            self._prefill(admitted)
                        # Samples can all finish at their first token (max_tokens=1, a stop).
                        if any(not s.done for s in self._rows):
                            self._decode()
                        self._compact()
                except Exception as e:  # the failure goes to the callers, the worker lives on
                    logger.exception("generation step failed")
                    self._fail_all(e, admitted)

    def _await_companions(self) -> None:
        """Idle, with a request waiting: give requests submitted along with it a chance to
        arrive (caller holds `_cv`; submissions notify it)."""
        deadline = time.monotonic() + 5 * self.admission_window
        while not self._closed and not self._sleeping:
            waiting = len(self._pending)
            self._cv.wait(timeout=self.admission_window)
            if len(self._pending) == waiting or time.monotonic() >= deadline:
                return

    def _admit(self) -> list[Request]:
        """Pop waiting requests that fit (caller holds `_cv`)."""
        for req in [r for r in self._pending if r.aborted]:
            self._pending.remove(req)
            self._abort_pending(req)
        live = sum(not s.done for s in self._rows)
        free = self.max_batch_size - live
        waiting = sum(r.params.n for r in self._pending)
        # Admit in chunks: each admission is a prefill pass plus a copy of the batch cache.
        if live and free < min(waiting, max(1, self.max_batch_size // 8)):
            return []
        admitted: list[Request] = []
        while self._pending:
            n = self._pending[0].params.n
            if n > free and (live or admitted):
                break
            admitted.append(self._pending.popleft())
            free -= n
        return admitted

    def _new_samples(self, req: Request) -> list[Sample]:
        limit = min(req.params.max_tokens, self._max_context - len(req.prompt))
        samples = []
        for j in range(req.params.n):
            gen = None
            if req.params.seed is not None:
                gen = torch.Generator().manual_seed(hash((req.params.seed, j)) & (2**63 - 1))
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
                self._fail_request(req, e)
                continue
            key = tuple(req.key)
            by_prompt.setdefault(key, []).extend(samples)
            first.setdefault(key, req)
        prompts = sorted(by_prompt, key=len)
        self._prefill_shared_prefix(prompts)
        chunks = _chunks(prompts, len, self.max_prefill_tokens)
        while chunks:
            chunk = chunks.pop(0)
            try:
                cache, logits = self._prefill_chunk([first[p] for p in chunk])
            except Exception as e:  # noqa: BLE001 - retried alone, or failed alone
                if len(chunk) > 1:
                    chunks[:0] = [[p] for p in chunk]
                else:
                    for req in {id(s.request): s.request for s in by_prompt[chunk[0]]}.values():
                        self._fail_request(req, e)
                continue
            index = [u for u, p in enumerate(chunk) for _ in by_prompt[p]]
            samples = [s for p in chunk for s in by_prompt[p]]
            expanded = cache.select(torch.tensor(index, device=self.device))
            assert expanded is not None
            self._sample(samples, logits.index_select(0, torch.tensor(index, device=self.device)))
            self._batch = (
                expanded if self._batch is None else BatchCache.concat([self._batch, expanded])
            )
            self._rows = self._rows + samples

    def _reencode_running(self) -> None:
        """The running samples' KV cache, computed again by the weights just loaded (caller
        holds the step lock, under no_grad): each continues as if its prompt and tokens so far
        had been prefilled by the new version, which samples (and scores) all its next tokens."""
        live = sorted((r for r in self._rows if not r.done), key=lambda r: r.length)
        self._batch, self._rows = None, []
        for chunk in _chunks(live, lambda r: r.length, self.max_prefill_tokens):
            fed = [r.tokens[: r.length - len(r.request.prompt)] for r in chunk]
            cache, _ = self._prefill_ids(
                [r.request.prompt + f for r, f in zip(chunk, fed, strict=True)],
                [list(r.request.key) + f for r, f in zip(chunk, fed, strict=True)],
                [r.request.vision for r in chunk],
            )
            self._batch = cache if self._batch is None else BatchCache.concat([self._batch, cache])
            self._rows = self._rows + chunk
        for r in live:
            r.switch_version(self._version)
        self.counters["reencoded_samples"] += len(live)

    def _prefill_shared_prefix(self, prompts: list[tuple[int, ...]]) -> None:
        """Encode a long common start of an admission's prompts (a system prompt, a task
        header) once, into the prefix cache, where each prompt's own prefill then finds it:
        encoded with the prompts, it would be encoded once per prompt. `prompts` are cache
        keys; the common start stops before the first image."""
        if len(prompts) < 2 or not self.prefix_cache.max_bytes:
            return
        common = list(os.path.commonprefix(prompts))
        common = common[: next((i for i, t in enumerate(common) if t < 0), len(common))]
        saved = (len(prompts) - 1) * len(common)
        if saved < _MIN_SHARED_TOKENS_SAVED or self.prefix_cache.covers(common):
            return
        self.counters["shared_prefix_prefills"] += 1
        self._prefill_ids([common], [common], [None])

    def _prefill_chunk(self, requests: list[Request]) -> tuple[BatchCache, torch.Tensor]:
        return self._prefill_ids(
            [r.prompt for r in requests], [r.key for r in requests], [r.vision for r in requests]
        )

    def _prefill_ids(
        self,
        prompts: list[list[int]],
        keys: list[list[int]],
        visions: list[VisionPrompt | None],
    ) -> tuple[BatchCache, torch.Tensor]:
        """Encode prompts (resuming cached prefixes, looked up by their keys); returns their
        cache and last logits. A cached prefix never ends inside an image: the images after
        it are encoded, and their pixels passed, with the rest of the prompt."""
        hits = [
            _cut_at_image(self.prefix_cache.lookup(k, len(k) - 1), v)
            for k, v in zip(keys, visions, strict=True)
        ]
        n_cached = max(c for c, _ in hits)
        width = max(len(p) - c for p, (c, _) in zip(prompts, hits, strict=True))
        rows = len(prompts)
        mrope = self.vision is not None and self.vision.mrope
        ids = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, n_cached + width, dtype=torch.long)
        pos = torch.zeros(3, rows, width, dtype=torch.long) if mrope else torch.zeros(
            rows, width, dtype=torch.long
        )
        new_images: list[np.ndarray] = []
        for u, (p, (c, _), v) in enumerate(zip(prompts, hits, visions, strict=True)):
            suffix = p[c:]
            ids[u, width - len(suffix) :] = torch.tensor(suffix)
            if mrope:
                pos[:, u, width - len(suffix) :] = (
                    _mrope_positions(v, len(p))[:, c:]
                    if v is not None and v.positions is not None else torch.arange(c, len(p))
                )
            else:
                pos[u, width - len(suffix) :] = torch.arange(c, len(p))
            mask[u, n_cached - c : n_cached] = 1
            mask[u, n_cached + width - len(suffix) :] = 1
            if v is not None:
                new_images += [im for im, (a, _) in zip(v.images, v.spans, strict=True) if a >= c]
        reused = sum(c for c, _ in hits)
        self.counters["prefill_tokens"] += sum(map(len, prompts)) - reused
        self.counters["reused_tokens"] += reused
        if n_cached:
            prefixes = _stack_prefixes(hits, n_cached)
            past = BatchCache(prefixes, mask[:, :n_cached].to(self.device)).cache
        else:
            past = DynamicCache()
        image_inputs: dict[str, torch.Tensor] = {}
        if new_images:
            assert self.vision is not None
            self.counters["prefill_images"] += len(new_images)
            image_inputs = {
                k: t.to(self.device) for k, t in self.vision.model_inputs(new_images).items()
            }
        mask = mask.to(self.device)
        out = self._forward(
            input_ids=ids.to(self.device),
            attention_mask=mask,
            position_ids=pos.to(self.device),
            past_key_values=past,
            use_cache=True,
            logits_to_keep=1,
            **image_inputs,
        )
        cache = BatchCache(filled_kv(past), mask)
        for u, k in enumerate(keys):
            if self.prefix_cache.max_bytes and not self.prefix_cache.covers(k):
                self.prefix_cache.insert(k, cache.row_prefix(u))
        return cache, out.logits[:, -1, :]

    def _decode(self) -> None:
        batch = self._batch
        assert batch is not None and batch.rows == len(self._rows)
        last = [s.tokens[-1] if s.tokens else 0 for s in self._rows]
        ids_B = torch.tensor(last, device=self.device)
        pos_B = torch.tensor(
            [s.length + s.request.position_offset for s in self._rows], device=self.device
        )
        mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
        logits_B_V = None
        if self.decode_step is not None:
            logits_B_V = self.decode_step(
                self.model, ids_B, pos_B, batch.cache, mask, counters=self.counters
            )
            self.counters["lean_decode_steps"] += logits_B_V is not None
        if logits_B_V is None:
            out = self._forward(
                input_ids=ids_B[:, None],
                attention_mask=mask,
                position_ids=pos_B[:, None],
                past_key_values=batch.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits_B_V = out.logits[:, -1, :]
        batch.mask = mask
        self.counters["decode_steps"] += 1
        self.counters["decode_slots"] += len(self._rows)
        for s in self._rows:
            s.length += 1
        live = [i for i, s in enumerate(self._rows) if not s.done]
        if len(live) < len(self._rows):
            index = torch.tensor(live, dtype=torch.long, device=self.device)
            logits_B_V = logits_B_V.index_select(0, index)
        self._sample([self._rows[i] for i in live], logits_B_V)

    def _forward(self, **inputs: object) -> Any:
        """The model's forward with its KV cache, also when a colocated trainer turned on
        gradient checkpointing: transformers then drops the cache of a module in training mode
        (`use_cache=False`, `past_key_values=None`), so decoding would see one token of context.
        Checkpointing saves memory for a backward pass; this thread computes none (no_grad)."""
        gc = [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False)
              ] if self.model.training and self.model.is_gradient_checkpointing else []
        flags: list[Any] = gc  # plain bool attributes, not submodules
        for m in flags:
            m.gradient_checkpointing = False
        try:
            return self.model(**inputs)
        finally:
            for m in flags:
                m.gradient_checkpointing = True

    def _sample(self, samples: list[Sample], logits_B_V: torch.Tensor) -> None:
        """Draw the next token of each sample, record it, and finish samples that are done.
        A request that fails here fails alone (`_fail_request`): the others go on (#34)."""
        uniform = [1.0 - float(torch.rand(1, generator=s.generator or self._rng)) for s in samples]
        drawn: list[_Drawn | None]
        try:
            drawn = [*self._draw(samples, logits_B_V, uniform)]
        except Exception as e:  # noqa: BLE001 - found and failed request by request below
            logger.warning("drawing a batch of %d samples failed (%r); drawing request by "
                           "request", len(samples), e)
            drawn = self._draw_each_request(samples, logits_B_V, uniform)
        streamed: dict[int, tuple[Request, list[CompletionDelta]]] = {}
        for s, d in zip(samples, drawn, strict=True):
            if d is None or s.done:  # its request failed (in this step)
                continue
            try:
                self._take(s, *d)
            except Exception as e:  # noqa: BLE001 - the request fails, not the batch
                self._fail_request(s.request, e)
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

    def _draw(self, samples: list[Sample], logits_B_V: torch.Tensor, uniform: list[float]
              ) -> list[_Drawn]:
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
        biased = _with_logit_bias(logits_B_V, params)
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

    def _draw_each_request(self, samples: list[Sample], logits_B_V: torch.Tensor,
                           uniform: list[float]) -> list[_Drawn | None]:
        """`_draw` request by request, once the whole batch's draw failed: a request whose own
        draw fails too is failed (None for its samples); the others get what the batch's draw
        would have given them."""
        rows_of: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            rows_of.setdefault(id(s.request), []).append(i)
        out: list[_Drawn | None] = [None] * len(samples)
        for rows in rows_of.values():
            index = torch.tensor(rows, dtype=torch.long, device=logits_B_V.device)
            try:
                drawn = self._draw([samples[i] for i in rows], logits_B_V.index_select(0, index),
                                   [uniform[i] for i in rows])
            except Exception as e:  # noqa: BLE001 - this request is the one to fail
                self._fail_request(samples[rows[0]].request, e)
                continue
            for i, d in zip(rows, drawn, strict=True):
                out[i] = d
        return out

    def _take(self, s: Sample, tok: int, lp: float, top: list[tuple[int, float]]) -> None:
        """Record a drawn token in its sample, and finish the sample if it is done."""
        s.tokens.append(tok)
        s.logprobs.append(lp)
        if s.matcher is not None and not s.matcher.is_terminated():
            s.matcher.accept_token(tok)
        if s.request.params.top_logprobs:
            s.top.append(top)
        self._check_finished(s, tok)

    def _check_finished(self, s: Sample, tok: int) -> None:
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
        text = cast(str, self._tokenizer.decode(tail, skip_special_tokens=True))  # one id list
        return stop_string_hit(text, stops)

    def _on_sample_done(self, s: Sample) -> None:
        req = s.request
        if s.finish != "abort" and self.prefix_cache.max_bytes and len(s.tokens) > 1:
            # Keep prompt + completion KV: the next turn of a multi-turn episode extends it.
            row = self._rows.index(s) if s in self._rows else -1
            if row >= 0 and self._batch is not None:
                self.prefix_cache.insert(req.key + s.tokens[:-1], self._batch.row_prefix(row))
        if all(x.done for x in req.samples):
            with self._cv:
                self._by_id.pop(req.id, None)
            req.finish_all()

    def _compact(self) -> None:
        """Drop finished rows from the batch once enough of them have piled up."""
        if self._batch is None:
            return
        live = [i for i, s in enumerate(self._rows) if not s.done]
        dead = len(self._rows) - len(live)
        if dead == 0:
            return
        if live and dead < max(1, len(self._rows) // 8):
            return
        self._batch = self._batch.select(torch.tensor(live, dtype=torch.long, device=self.device))
        self._rows = [self._rows[i] for i in live]

    def _reap_aborted(self) -> None:
        self._abort_rows(lambda s: s.request.aborted)

    def _abort_rows(self, which: Callable[[Sample], bool]) -> None:
        for s in self._rows:
            if not s.done and which(s):
                s.finish = "abort"
                self._on_sample_done(s)

    def _abort_pending(self, req: Request) -> None:
        self._by_id.pop(req.id, None)
        req.samples = self._new_samples(req)
        for s in req.samples:
            s.finish = "abort"
        req.finish_all()

    def _fail_request(self, req: Request, error: Exception) -> None:
        """End one request with a GenerationError, and only it: its samples finish (their rows
        leave the batch at the next compaction) and its caller gets the error."""
        logger.error("request %s failed; the requests batched with it go on", req.id,
                     exc_info=error)
        for s in req.samples:
            if not s.done:
                s.finish = "abort"
        with self._cv:
            self._by_id.pop(req.id, None)
        req.failed = True
        req.resolve(GenerationError(f"generation failed for this request: {error!r}"))

    def _fail_all(self, error: Exception, admitted: list[Request]) -> None:
        requests = {id(s.request): s.request for s in self._rows}
        requests.update({id(r): r for r in admitted})
        for req in requests.values():
            with self._cv:
                self._by_id.pop(req.id, None)
            req.resolve(GenerationError(f"generation failed: {error!r}"))
        self._batch, self._rows = None, []


def _chunks(items: list[T], length: Callable[[T], int], max_tokens: int) -> list[list[T]]:
    """`items` (sorted by length: shortest first) in runs whose padded size, rows x longest,
    stays within `max_tokens` (a run holds at least one)."""
    out: list[list[T]] = [[]]
    for x in items:
        if out[-1] and (len(out[-1]) + 1) * length(x) > max_tokens:
            out.append([])
        out[-1].append(x)
    return out


def _mrope_positions(v: VisionPrompt, length: int) -> torch.Tensor:
    """mRoPE positions [3, length] of a prompt and the tokens sampled after it (text after the
    prompt: the next position on all three axes, shifted by the vision offset)."""
    assert v.positions is not None
    have = v.positions.shape[1]
    if length <= have:
        return v.positions
    more = torch.arange(have, length) + v.position_offset
    return torch.cat([v.positions, more.expand(3, -1).to(v.positions)], dim=1)


def _empty_completion(params: SamplingParams, version: int) -> Completion:
    return Completion(
        token_ids=[],
        logprobs=[] if params.logprobs else None,
        finish_reason="length",
        policy_version=version,
    )


def _cut_at_image(hit: tuple[int, KV | None], vision: VisionPrompt | None) -> tuple[int, KV | None]:
    """A cached prefix shortened to the start of an image it would end inside of."""
    c, kv = hit
    if vision is None or kv is None:
        return hit
    for a, b in vision.spans:
        if a < c < b:
            c = a
            break
    if c == 0:
        return 0, None
    return c, [(k[:, :, :c], v[:, :, :c]) for k, v in kv]


def _stack_prefixes(hits: list[tuple[int, KV | None]], width: int) -> KV:
    """Left-pad each row's cached prefix to `width` columns and stack them row-wise."""
    template = next(kv for _, kv in hits if kv is not None)
    out: KV = []
    for layer, (k0, v0) in enumerate(template):
        b, h, _, d = len(hits), k0.shape[1], k0.shape[2], k0.shape[3]
        keys = k0.new_zeros(b, h, width, d)
        values = v0.new_zeros(b, h, width, d)
        for u, (c, kv) in enumerate(hits):
            if kv is not None and c:
                keys[u, :, width - c :] = kv[layer][0][0]
                values[u, :, width - c :] = kv[layer][1][0]
        out.append((keys, values))
    return out


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for src in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple):
            ids.update(int(x) for x in src)
    return frozenset(ids)


def _strip_wrappers(name: str) -> str:
    """Names from DDP/FSDP/torch.compile wrappers carry prefixes the bare module lacks."""
    for prefix in ("module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def _with_logit_bias(logits_B_V: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
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
