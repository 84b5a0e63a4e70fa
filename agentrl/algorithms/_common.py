"""Helpers shared by the algorithm modules: registry look-up and masked statistics.

Shape suffixes: ``_B`` batch (sequences), ``_T`` tokens, ``_G`` group.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
from torch import Tensor

F = TypeVar("F", bound=Callable[..., object])


def lookup(registry: Mapping[str, F], name: str, kind: str) -> F:
    """Return ``registry[name]``; a ``ValueError`` with a "did you mean" otherwise."""
    if name in registry:
        return registry[name]
    close = difflib.get_close_matches(name, list(registry), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"Unknown {kind} {name!r}; expected one of {sorted(registry)}.{hint}"
    )


def register(registry: dict[str, F], name: str, fn: F, kind: str, overwrite: bool) -> None:
    """Add ``fn`` under ``name``; refuse to replace an entry unless ``overwrite``."""
    if not callable(fn):
        raise TypeError(f"A {kind} must be callable; got {type(fn).__name__} for {name!r}.")
    if name in registry and not overwrite:
        raise ValueError(
            f"A {kind} named {name!r} is already registered; pick another name or pass "
            "overwrite=True to replace it."
        )
    registry[name] = fn


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is non-zero (weighted by ``mask``).

    Masked-out entries are ignored even when they hold inf/nan (e.g. log-probs of padding).
    An empty selection gives 0 rather than nan.
    """
    masked = torch.where(mask != 0, x * mask, torch.zeros_like(x))
    if dim is None:
        return masked.sum() / mask.sum().clamp_min(1e-8)
    return masked.sum(dim) / mask.sum(dim).clamp_min(1e-8)


def group_index(group_ids_B: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Map arbitrary group ids to ``0..G-1``.

    Returns ``(unique_ids_G, index_B, counts_G)`` so that ``unique_ids_G[index_B] == group_ids_B``.
    """
    if group_ids_B.dim() != 1:
        raise ValueError(f"group_ids_B must be 1-D [B]; got shape {tuple(group_ids_B.shape)}.")
    return torch.unique(group_ids_B, return_inverse=True, return_counts=True)


def group_sum(x_B: Tensor, index_B: Tensor, num_groups: int) -> Tensor:
    """Sum of ``x_B`` within each group: ``[G]``."""
    return torch.zeros(num_groups, dtype=x_B.dtype, device=x_B.device).index_add_(0, index_B, x_B)
