"""Which compiled kernels are faster than torch on the CPU at hand: measured, not assumed.

The kernels are tuned on an AVX-512 Xeon; on an AVX2-only EPYC VM the decode row GEMM took
0.47x of `F.linear`'s speed at 8 rows and the GRPO-sized rollout 0.61x (issue 14). So the first
time the kernels are built for a CPU, each family is timed against the torch path it replaces,
at the sizes the trainer uses (SmolLM2-135M's widths), alternating and taking medians (about a
second in all); it is used only where it is faster by `MARGIN`. The result is cached per CPU
(model and flags), torch version and kernel source under ~/.cache/agentrl, and logged.

`AGENTRL_CPU_KERNELS` overrides the measurement: `0` turns every family off, `1` every family on
(where the kernels build) without measuring; unset (or empty) is the measured choice. It is read
at each `choice()` call, so one process (the trainer tests) can run both ways.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentrl.backends.cpu import kernels
from agentrl.files import write_atomically

logger = logging.getLogger(__name__)

MARGIN = 1.05
"""A kernel is used when torch takes at least this many times as long."""

_HIDDEN, _INTER, _VOCAB = 576, 1536, 49152  # SmolLM2-135M


@dataclass(frozen=True)
class Choice:
    """Which kernel families to use, and the speed-ups (torch time / kernel time) measured."""

    decode: bool
    decode_wide: bool
    train: bool
    logprobs: bool
    speedups: dict[str, float]


_cached: dict[str, Choice] = {}
"""The choice for each value of AGENTRL_CPU_KERNELS seen ("" for unset)."""


def choice() -> Choice:
    """The kernels to use here: as `AGENTRL_CPU_KERNELS` forces them, else measured once per
    CPU, torch and kernel source (see above)."""
    forced = os.environ.get(kernels.ENV, "")
    got = _cached.get(forced)
    if got is None:
        got = _cached[forced] = _choose(forced)
    return got


def _choose(forced: str) -> Choice:
    if forced not in ("", "0", "1"):
        raise ValueError(
            f"{kernels.ENV}={forced!r}: expected 0 (no CPU kernels), 1 (every kernel family, "
            "unmeasured) or unset (the families measured faster on this CPU)"
        )
    mod = kernels.module()
    if mod is None or forced:
        on = mod is not None and forced == "1"
        return Choice(decode=on, decode_wide=on, train=on, logprobs=on, speedups={})
    path = _cache_path()
    key = kernels.source_key()
    stored = _read(path)
    if set(stored.get(key, {})) == {f.name for f in fields(Choice)}:
        return Choice(**stored[key])  # else absent, or stored before a family was added
    speedups = measure(mod)
    got = Choice(
        decode=speedups["decode"] >= MARGIN,
        decode_wide=speedups["decode_wide"] >= MARGIN,
        train=speedups["train"] >= MARGIN,
        logprobs=speedups["logprobs"] >= MARGIN,
        speedups=speedups,
    )
    logger.info(
        "agentrl CPU kernels on %s (%s): torch/kernel time %s; using %s",
        kernels.cpu_model(), kernels.vector_flags(),
        {k: round(v, 2) for k, v in speedups.items()},
        [k for k in ("decode", "decode_wide", "train", "logprobs") if getattr(got, k)] or "none",
    )
    stored[key] = asdict(got)
    _write(path, stored)
    return got


def measure(mod: object, rounds: int = 5) -> dict[str, float]:
    """torch time / kernel time for each family, medians of `rounds` alternating runs."""
    torch.manual_seed(0)
    return {
        "decode": _ratio(*_decode_pair(mod), rounds),
        "decode_wide": _ratio(*_wide_decode_pair(), rounds),
        "train": _ratio(*_train_pair(mod), rounds),
        "logprobs": _ratio(*_logprob_pair(mod), rounds),
    }


def _decode_pair(mod: Any) -> tuple[Callable[[], object], Callable[[], object]]:
    """8 rows through 16 MLP-sized matrices (56 MB, more than a cache holds: a decode step
    streams its weights from memory)."""
    x = torch.randn(8, _HIDDEN)
    weights = [torch.randn(_INTER, _HIDDEN) for _ in range(16)]

    def with_torch() -> object:
        return [F.linear(x, w) for w in weights]

    def with_kernel() -> object:
        return [mod.row_gemm(x, w) for w in weights]

    return with_torch, with_kernel


def _wide_decode_pair() -> tuple[Callable[[], object], Callable[[], object]]:
    """Decode steps of 64 rows over ~100 cached columns (padded: rows of 48-96 at the start)
    through two layers of SmolLM2-135M's widths (a small vocabulary: the head is the same GEMM
    both ways), the forward's arithmetic against the kernel layer with ATen's GEMMs. Both append
    a column to one cache at each call (its buffer grows once, in the warm-up)."""
    import functools

    from transformers import LlamaConfig, LlamaForCausalLM

    from agentrl.backends.cpu.decode import decode_logits
    from agentrl.engine.kv import BatchCache

    cfg = LlamaConfig(vocab_size=256, hidden_size=_HIDDEN, intermediate_size=_INTER,
                      num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3)
    model = LlamaForCausalLM(cfg).eval()  # SDPA attention, transformers' default on a CPU
    rows, cols = 64, 96
    mask = (torch.arange(cols)[None, :] >= torch.randint(0, cols // 2, (rows, 1))).long()
    kv = [(torch.randn(rows, 3, cols, 64), torch.randn(rows, 3, cols, 64)) for _ in range(2)]
    cache = BatchCache(kv, mask)
    ids, pos = torch.randint(0, 256, (rows,)), mask.sum(-1)

    def step(wide: bool) -> object:
        new_mask = torch.cat([cache.mask, torch.ones_like(cache.mask[:, :1])], dim=1)
        with torch.no_grad():
            out = decode_logits(model, ids, pos, cache.cache, new_mask, wide_kernels=wide)
        cache.mask = new_mask
        return out

    return functools.partial(step, False), functools.partial(step, True)


def _train_pair(mod: object) -> tuple[Callable[[], object], Callable[[], object]]:
    """An RMSNorm and a SiLU gating over 512 tokens, forward and backward."""
    from agentrl.backends.cpu import fused

    x = torch.randn(512, _HIDDEN, requires_grad=True)
    w = torch.randn(_HIDDEN, requires_grad=True)
    gate = torch.randn(512, _INTER, requires_grad=True)
    up = torch.randn(512, _INTER, requires_grad=True)

    def with_torch() -> object:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        z = F.silu(gate) * up
        return torch.autograd.grad((y.sum(), z.sum()), (x, w, gate, up))

    def with_kernel() -> object:
        y = fused.rms_norm(x, w, 1e-5)
        z = fused.swiglu(gate, up)
        return torch.autograd.grad((y.sum(), z.sum()), (x, w, gate, up))

    return with_torch, with_kernel


def _logprob_pair(mod: object) -> tuple[Callable[[], object], Callable[[], object]]:
    """Log-probs and entropies of 64 tokens over SmolLM2's vocabulary, forward and backward."""
    from agentrl.algorithms import logprobs_and_entropy_from_logits
    from agentrl.backends.cpu import fused

    logits = torch.randn(64, _VOCAB, requires_grad=True)
    labels = torch.randint(0, _VOCAB, (64,))

    def with_torch() -> object:
        logp, ent = logprobs_and_entropy_from_logits(logits[None], labels[None], 1.0)
        return torch.autograd.grad((logp.sum() + ent.sum(),), (logits,))

    def with_kernel() -> object:
        got = fused.logprobs_and_entropy(logits, labels, 1.0)
        assert got is not None
        return torch.autograd.grad((got[0].sum() + got[1].sum(),), (logits,))

    return with_torch, with_kernel


def _ratio(base: Callable[[], object], fast: Callable[[], object], rounds: int) -> float:
    base(), fast()  # warm up (allocations, thread pools)
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(rounds):
        for i, fn in enumerate((base, fast)):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return statistics.median(times[0]) / max(statistics.median(times[1]), 1e-9)


def _cache_path() -> Path:
    from agentrl.models.embedded import cache_root

    return cache_root() / "cpu_kernel_choice.json"


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, data: dict[str, dict]) -> None:
    try:
        write_atomically(path, json.dumps(data, indent=1))
    except OSError as e:  # a read-only home: measure again next time
        logger.warning("could not cache the CPU kernel choice at %s: %s", path, e)
