"""Attention over a packed row one sequence at a time, instead of through an [L, L] mask.

The trainer packs a micro-batch's sequences into one row (`trainers.batch.pack`), a group's
shared prompt stored once and each sample's rest after it. Through an [L, L] mask, SDPA computes
every block of the row's L x L scores and then throws the masked ones away: the cost grows with
the square of the whole micro-batch, and on a CPU it was 29% of the default math-tir update
(SmolLM2-135M, two micro-batches of 8 samples, L = 908 and 1158; flash attention's backward 101
ms a layer at 1158). `PackedLayout` says where each sequence lies, and `segment_attention`
attends each piece to what it may see: a shared prefix to itself (causal), each rest to its
prefix and itself (causal within the rest), an unshared sequence to itself (causal). The scores
computed fall from L^2 to the sum of p^2/2 + r * (p + r) over the pieces; each piece is the same
softmax over the same keys as before, so only round-off differs.

`register()` installs `segment_attention` as transformers' "sdpa" attention. Every call without
a layout, or with one that does not fit (another sequence length, or attention that is not
causal: a vision tower; a sliding window; soft-capping), goes to transformers' own SDPA
function with the mask it was given, so nothing else changes; the trainer passes the layout as
the `packed_layout` keyword of the model's forward, which transformers hands to every
attention call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

NAME = "sdpa"
"""The attention implementation `register` takes over (and falls back to)."""


@dataclass(frozen=True)
class PackedLayout:
    """A packed row as groups in order: each a shared prefix of `prefix` tokens (0: none),
    then its sequences' `rests` (whole sequences when the prefix is 0), back to back."""

    groups: tuple[tuple[int, tuple[int, ...]], ...]
    device: torch.device | str = "cpu"
    _masks: dict[tuple[int, int], Tensor] = field(default_factory=dict, compare=False,
                                                  repr=False)

    @property
    def length(self) -> int:
        return sum(p + sum(rests) for p, rests in self.groups)

    def mask(self, prefix: int, rest: int) -> Tensor:
        """[rest, prefix + rest] bool (True: may attend): all of the prefix, causal in the rest;
        made once per shape and kept for every layer."""
        key = (prefix, rest)
        if key not in self._masks:
            causal = torch.ones(rest, rest, dtype=torch.bool, device=self.device).tril()
            seen = torch.ones(rest, prefix, dtype=torch.bool, device=self.device)
            self._masks[key] = torch.cat([seen, causal], dim=1)
        return self._masks[key]


def segment_attention(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
    attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention signature: query [1, H, L, D], key and value [1, H_kv, L, D];
    returns [1, L, H, D]. With `packed_layout` (that fits, see the module docstring) piece by
    piece through transformers' SDPA function; otherwise that function as it is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

    layout: PackedLayout | None = kwargs.pop("packed_layout", None)
    L = query.shape[2]
    if (layout is None or query.shape[0] != 1 or key.shape[2] != L or layout.length != L
            or not getattr(module, "is_causal", False) or kwargs.get("is_causal") is False
            or kwargs.get("sliding_window") or kwargs.get("softcap")
            or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None):
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                    **kwargs)
    # One split of each tensor into the row's pieces: its backward is one concatenation (a
    # slice per piece would zero-fill a gradient of the whole row for each).
    sizes = [n for prefix, rests in layout.groups for n in (prefix, *rests)]
    qs, ks, vs = (t.split(sizes, dim=2) for t in (query, key, value))
    pieces: list[Tensor] = []
    i = 0
    for prefix, rests in layout.groups:
        p = i
        if prefix:
            out, _ = sdpa(module, qs[p], ks[p], vs[p], None, dropout=dropout, scaling=scaling,
                          is_causal=True)
            pieces.append(out)
        for r in rests:
            i += 1
            if r == 0:  # a sequence that is all prefix (its tokens were stored there)
                continue
            if prefix:  # the rest attends to the whole prefix, and causally to itself
                k, v = torch.cat([ks[p], ks[i]], dim=2), torch.cat([vs[p], vs[i]], dim=2)
                mask: Tensor | None = layout.mask(prefix, r)[None, None]
            else:
                k, v, mask = ks[i], vs[i], None
            out, _ = sdpa(module, qs[i], k, v, mask, dropout=dropout, scaling=scaling,
                          is_causal=mask is None)
            pieces.append(out)
        i += 1
    return torch.cat(pieces, dim=1), None


def register() -> None:
    """Make `segment_attention` transformers' "sdpa" attention (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, segment_attention)
