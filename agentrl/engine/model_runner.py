"""The transformers engine's model runner: the forward passes over its batch of running samples.

It holds the running samples (`rows`) and their KV cache, a masked, left-aligned batch of rows
written in place (see `agentrl.engine.kv`), row for row; and the prefix cache, from which a new
prompt resumes the longest cached prefix. Prefill encodes admitted prompts together, each
distinct prompt once even when it has n samples. Decode steps go through the model's forward
unless a `decode_step` is given: on a CPU, `agentrl.backends.engine_options` gives the lean
Llama step of `agentrl.backends.cpu` (through compiled kernels where they measured faster);
prefill always uses the model's forward.

The model may be the very module a trainer trains (colocated): the caller runs the passes under
`torch.no_grad()` in its worker thread (grad mode is thread-local, so the trainer is
unaffected), the module's train/eval mode is left alone, and loading the model's own tensors
copies nothing.
"""

from __future__ import annotations

import collections
import difflib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from agentrl.engine.base import NamedTensors
from agentrl.engine.kv import KV, BatchCache, PrefixCache, filled_kv
from agentrl.engine.requests import Request, Sample, VisionPrompt
from agentrl.models.vision import VisionProcessor, check_image

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T = TypeVar("T")
DecodeStep = Callable[..., "torch.Tensor | None"]
"""`(model, ids_B, pos_B, cache, mask_B_T, *, counters) -> next-token logits [B, V] | None`."""

_MIN_SHARED_TOKENS_SAVED = 128
"""Encode the common start of an admission's prompts once on its own only when that saves at
least this many token encodings ((prompts - 1) x its length): the extra forward pass reads all
the weights once more. SmolLM2 on the 2-core CPU: a 30-token system prompt shared by 2 or 4
prompts prefilled slower on its own (175 -> 246 ms, 266 -> 289 ms), a ~250-token one faster
(2 prompts 1572 -> 738 ms, 4 prompts 816 -> 619 ms; noisy VM, ad-hoc A/B)."""


class ModelRunner:
    """Forward passes of one model over the running samples (see module docstring).

    Args:
        model: the causal LM, already on `device`.
        device: where the passes run.
        counters: the engine's counters (tokens prefilled, reused, decode steps, ...).
        prefix_cache_bytes: KV bytes kept for prefix reuse across requests (0 disables).
        max_prefill_tokens: most (padded) prompt tokens encoded in one forward pass.
        decode_step: a faster decode step, or None (see `TransformersEngine`).
        vision: a vision-language model's `VisionProcessor`, None for a text model.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        device: torch.device,
        counters: collections.Counter[str],
        prefix_cache_bytes: int,
        max_prefill_tokens: int,
        decode_step: DecodeStep | None,
        vision: VisionProcessor | None,
    ) -> None:
        self.model = model
        self.device = device
        self.counters = counters
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.max_prefill_tokens = max_prefill_tokens
        self.decode_step = decode_step
        self.vision = vision
        self.batch: BatchCache | None = None
        self.rows: list[Sample] = []
        """The samples holding a row of `batch` (finished ones until the next compaction)."""

    def clear(self) -> None:
        """Drop every row and its KV."""
        self.batch, self.rows = None, []

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV cache held: the running batch and the prefix cache."""
        batch = self.batch
        return (batch.nbytes() if batch is not None else 0) + self.prefix_cache.nbytes

    def vision_prompt(self, prompt: list[int], images: Sequence[np.ndarray]) -> VisionPrompt:
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

    def load_weights(self, named_tensors: NamedTensors, current_version: int) -> int:
        """Copy parameters by name into the model; returns how many were copied (tensors that
        already are the model's own storage are not). Errors name `current_version`, the one
        that stays in use."""
        targets = self.model.state_dict(keep_vars=True)
        items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        copied = 0
        for name, tensor in items:
            target = targets.get(name)
            if target is None:
                target = targets.get(_strip_wrappers(name))
            if target is None:
                hint = difflib.get_close_matches(name, list(targets), n=1)
                raise ValueError(
                    f"update_weights: the model has no parameter {name!r}"
                    + (f"; did you mean {hint[0]!r}?" if hint else "")
                    + f" (version stays {current_version}; earlier tensors were applied)"
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
        return copied

    def add_rows(self, samples: list[Sample], cache: BatchCache) -> None:
        """Append samples and their KV rows to the batch."""
        self.batch = cache if self.batch is None else BatchCache.concat([self.batch, cache])
        self.rows = self.rows + samples

    def row_prefix(self, s: Sample) -> KV | None:
        """The KV of sample `s` (prompt and tokens so far), None if it holds no row."""
        row = self.rows.index(s) if s in self.rows else -1
        if row < 0 or self.batch is None:
            return None
        return self.batch.row_prefix(row)

    def compact(self) -> None:
        """Drop finished rows from the batch once enough of them have piled up."""
        if self.batch is None:
            return
        live = [i for i, s in enumerate(self.rows) if not s.done]
        dead = len(self.rows) - len(live)
        if dead == 0:
            return
        if live and dead < max(1, len(self.rows) // 8):
            return
        self.batch = self.batch.select(torch.tensor(live, dtype=torch.long, device=self.device))
        self.rows = [self.rows[i] for i in live]

    def reencode_running(self, version: int) -> None:
        """The running samples' KV cache, computed again by the weights just loaded, `version`
        (caller holds the engine's step lock, under no_grad): each continues as if its prompt
        and tokens so far had been prefilled by the new version, which samples (and scores) all
        its next tokens."""
        live = sorted((r for r in self.rows if not r.done), key=lambda r: r.length)
        self.clear()
        for chunk in chunks_within(live, lambda r: r.length, self.max_prefill_tokens):
            fed = [r.tokens[: r.length - len(r.request.prompt)] for r in chunk]
            cache, _ = self.prefill_ids(
                [r.request.prompt + f for r, f in zip(chunk, fed, strict=True)],
                [list(r.request.key) + f for r, f in zip(chunk, fed, strict=True)],
                [r.request.vision for r in chunk],
            )
            self.add_rows(chunk, cache)
        for r in live:
            r.switch_version(version)
        self.counters["reencoded_samples"] += len(live)

    def prefill_shared_prefix(self, prompts: list[tuple[int, ...]]) -> None:
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
        self.prefill_ids([common], [common], [None])

    def prefill_requests(self, requests: list[Request]) -> tuple[BatchCache, torch.Tensor]:
        """`prefill_ids` of the requests' prompts."""
        return self.prefill_ids(
            [r.prompt for r in requests], [r.key for r in requests], [r.vision for r in requests]
        )

    def prefill_ids(
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
        out = self.forward(
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

    def score(self, ids: list[int], vision: VisionPrompt | None, start: int) -> torch.Tensor:
        """Log-probs [len - start] of `ids[start:]` under the model, from one forward over the
        whole sequence (no cache read or written), logits kept only where they predict a scored
        token; the arithmetic is the trainer's (`agentrl.algorithms.logprobs_from_logits`,
        float32, temperature 1). The caller holds the engine's step lock, under no_grad."""
        from agentrl.algorithms import logprobs_from_logits

        n = len(ids)
        if vision is not None and vision.positions is not None:
            pos = _mrope_positions(vision, n)[:, None]
        else:
            pos = torch.arange(n)[None]
        image_inputs: dict[str, torch.Tensor] = {}
        if vision is not None and vision.images:
            assert self.vision is not None
            image_inputs = {
                k: t.to(self.device) for k, t in self.vision.model_inputs(vision.images).items()
            }
        self.counters["scored_tokens"] += n
        out = self.forward(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=pos.to(self.device),
            use_cache=False,
            logits_to_keep=n - start + 1,  # positions start-1 .. n-1; the last predicts nothing
            **image_inputs,
        )
        labels = torch.tensor([ids[start:]], device=self.device)
        return logprobs_from_logits(out.logits[:, :-1], labels)[0]

    def decode(self) -> tuple[list[Sample], torch.Tensor]:
        """One decode step of every row: the unfinished samples and their next-token logits."""
        batch = self.batch
        assert batch is not None and batch.rows == len(self.rows)
        last = [s.tokens[-1] if s.tokens else 0 for s in self.rows]
        ids_B = torch.tensor(last, device=self.device)
        pos_B = torch.tensor(
            [s.length + s.request.position_offset for s in self.rows], device=self.device
        )
        mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
        logits_B_V = None
        if self.decode_step is not None:
            logits_B_V = self.decode_step(
                self.model, ids_B, pos_B, batch.cache, mask, counters=self.counters
            )
            self.counters["lean_decode_steps"] += logits_B_V is not None
        if logits_B_V is None:
            out = self.forward(
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
        self.counters["decode_slots"] += len(self.rows)
        for s in self.rows:
            s.length += 1
        live = [i for i, s in enumerate(self.rows) if not s.done]
        if len(live) < len(self.rows):
            index = torch.tensor(live, dtype=torch.long, device=self.device)
            logits_B_V = logits_B_V.index_select(0, index)
        return [self.rows[i] for i in live], logits_B_V

    def forward(self, **inputs: object) -> Any:
        """The model's forward with its KV cache, also when a colocated trainer turned on
        gradient checkpointing: transformers then drops the cache of a module in training mode
        (`use_cache=False`, `past_key_values=None`), so decoding would see one token of context.
        Checkpointing saves memory for a backward pass; the runner computes none (no_grad)."""
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


def chunks_within(items: list[T], length: Callable[[T], int], max_tokens: int) -> list[list[T]]:
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


def _strip_wrappers(name: str) -> str:
    """Names from DDP/FSDP/torch.compile wrappers carry prefixes the bare module lacks."""
    for prefix in ("module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(prefix, "")
    return name
