"""KV-cache bookkeeping for the transformers engine: a growable batch cache and a prefix cache.

The batch cache holds one row per running sample. Rows are aligned on a shared column axis and
an attention mask marks which columns hold real tokens, so rows of any length (and rows joined
later, or resumed from a cached prefix) live in one tensor; padding may sit anywhere, the mask
and explicit position ids make it invisible. Keys/values are written in place into buffers that
grow by doubling, so a decode step does not copy the whole cache (transformers' `DynamicLayer`
concatenates, i.e. copies everything, at every step).

The prefix cache keeps the KV of recently seen sequences (prompts, finished samples) under a
byte budget; a new prompt resumes from the longest cached common prefix and prefills only the
rest. That is what makes turn k+1 of a multi-turn episode, and the n samples of a prompt
admitted at different times, skip re-encoding what the engine has already seen.

Shapes: keys/values `[B, H, T, D]` (rows, kv heads, columns, head dim); mask `[B, T]`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, cast

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values)."""


class _FilledLayer(Protocol):
    keys: torch.Tensor
    values: torch.Tensor


def filled_kv(cache: Cache) -> KV:
    """Per layer (keys, values) of a cache a forward pass has filled: attention layers, each
    holding tensors (transformers types them optional, for layers not written yet)."""
    return [(layer.keys, layer.values) for layer in cast("list[_FilledLayer]", cache.layers)]


class BufferLayer(DynamicLayer):
    """A cache layer writing new keys/values in place into a buffer with spare columns."""

    keys: torch.Tensor  # set from the start (DynamicLayer's are None until the first update)
    values: torch.Tensor

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.dtype, self.device = keys.dtype, keys.device
        self.length = keys.shape[-2]
        self.buf_k, self.buf_v = keys, values
        self.keys, self.values = keys[..., : self.length, :], values[..., : self.length, :]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        self.reserve(n)
        self.buf_k[..., self.length : self.length + n, :] = key_states
        self.buf_v[..., self.length : self.length + n, :] = value_states
        self.advance(n)
        return self.keys, self.values

    def reserve(self, n: int) -> None:
        """Make room for `n` more columns (in `buf_k`/`buf_v`, from column `length`)."""
        if self.length + n > self.buf_k.shape[-2]:
            self._grow(max(self.length + n, 2 * self.buf_k.shape[-2], 16))

    def advance(self, n: int) -> None:
        """Take `n` columns written into the buffers past `length` as part of the cache."""
        self.length += n
        self.keys = self.buf_k[..., : self.length, :]
        self.values = self.buf_v[..., : self.length, :]

    def _grow(self, capacity: int) -> None:
        b, h, _, d = self.buf_k.shape
        k = self.buf_k.new_zeros(b, h, capacity, d)
        v = self.buf_v.new_zeros(b, h, capacity, d)
        k[..., : self.length, :] = self.buf_k[..., : self.length, :]
        v[..., : self.length, :] = self.buf_v[..., : self.length, :]
        self.buf_k, self.buf_v = k, v

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0


class BatchCache:
    """The running rows' KV (as a transformers `Cache`) plus the mask over its columns."""

    def __init__(self, kv: KV, mask: torch.Tensor) -> None:
        self.cache = Cache(layers=[BufferLayer(k, v) for k, v in kv])
        self.mask = mask

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def columns(self) -> int:
        return int(self.mask.shape[1])

    @property
    def layers(self) -> list[BufferLayer]:
        """The cache's layers, all BufferLayers (built so above)."""
        return cast("list[BufferLayer]", self.cache.layers)

    def kv(self) -> KV:
        return [(layer.keys, layer.values) for layer in self.layers]

    def nbytes(self) -> int:
        return sum(lay.buf_k.nbytes + lay.buf_v.nbytes for lay in self.layers)

    def row_prefix(self, row: int) -> KV:
        """Contiguous copy of one row's real columns, `[1, H, L, D]` per layer."""
        cols = self.mask[row].nonzero().squeeze(-1)
        return [
            (k[row : row + 1].index_select(2, cols), v[row : row + 1].index_select(2, cols))
            for k, v in self.kv()
        ]

    def select(self, rows: torch.Tensor) -> BatchCache | None:
        """Keep `rows` (in that order) and drop leading columns no kept row uses."""
        if rows.numel() == 0:
            return None
        mask = self.mask.index_select(0, rows)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        kv = [
            (k[:, :, start:].index_select(0, rows), v[:, :, start:].index_select(0, rows))
            for k, v in self.kv()
        ]
        return BatchCache(kv, mask[:, start:].contiguous())

    @staticmethod
    def concat(parts: list[BatchCache]) -> BatchCache:
        """Stack caches row-wise, left-padding shorter ones with masked columns."""
        width = max(p.columns for p in parts)
        n_layers = len(parts[0].cache.layers)
        kv: KV = []
        for i in range(n_layers):
            ks, vs = zip(*(_left_pad(p.kv()[i], width) for p in parts), strict=True)
            kv.append((torch.cat(ks, 0), torch.cat(vs, 0)))
        masks = [torch.nn.functional.pad(p.mask, (width - p.columns, 0)) for p in parts]
        return BatchCache(kv, torch.cat(masks, 0))


def _left_pad(kv: tuple[torch.Tensor, torch.Tensor], width: int) -> tuple[torch.Tensor, ...]:
    k, v = kv
    pad = width - k.shape[2]
    if pad == 0:
        return k, v
    return (
        torch.nn.functional.pad(k, (0, 0, pad, 0)),
        torch.nn.functional.pad(v, (0, 0, pad, 0)),
    )


class PrefixCache:
    """LRU store of sequences' KV, looked up by longest common token prefix, under a byte budget."""

    def __init__(self, max_bytes: int, min_match: int = 4) -> None:
        self.max_bytes = max_bytes
        self.min_match = min_match
        self.nbytes = 0
        self.hits = 0
        self.reused_tokens = 0
        self._entries: OrderedDict[tuple[int, ...], tuple[np.ndarray, KV, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def lookup(self, tokens: list[int], limit: int) -> tuple[int, KV | None]:
        """Longest cached prefix of `tokens`, at most `limit` long: (length, per-layer slices)."""
        if not self._entries or limit < self.min_match:
            return 0, None
        query = np.asarray(tokens[:limit], dtype=np.int64)
        best, best_key = 0, None
        for key, (arr, _, _) in self._entries.items():
            n = min(len(arr), len(query))
            if n <= best:
                continue
            eq = arr[:n] == query[:n]
            lcp = n if eq.all() else int(np.argmin(eq))
            if lcp > best:
                best, best_key = lcp, key
        if best < self.min_match or best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        kv = self._entries[best_key][1]
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in kv]

    def covers(self, tokens: list[int]) -> bool:
        """Whether some entry already starts with all of `tokens`."""
        arr = np.asarray(tokens, dtype=np.int64)
        return any(
            len(a) >= len(arr) and bool((a[: len(arr)] == arr).all())
            for a, _, _ in self._entries.values()
        )

    def insert(self, tokens: list[int], kv: KV) -> None:
        """Store `kv` (`[1, H, len(tokens), D]` per layer); entries it extends are dropped."""
        if self.max_bytes <= 0 or len(tokens) < self.min_match:
            return
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if nbytes > self.max_bytes:
            return
        arr = np.asarray(tokens, dtype=np.int64)
        for key in [
            key
            for key, (a, _, _) in self._entries.items()
            if len(a) <= len(arr) and bool((arr[: len(a)] == a).all())
        ]:
            self._drop(key)
        self._entries[tuple(tokens)] = (arr, kv, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        _, _, nbytes = self._entries.pop(key)
        self.nbytes -= nbytes
