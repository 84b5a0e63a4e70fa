"""Trajectories -> training tensors.

Token tensors are [B, T] (right-padded). Per-target tensors are [B, T-1]: position t holds what
is known about token t+1 (its logprob is read from the logits at t). Rewards sit on the last
policy token of each turn, so multi-turn episodes keep per-step rewards.

Rows of a vision-language batch carry their images (`add_images`): the images each row's
model input needs, the rows' cache keys (`VisionProcessor.key_ids`: image tokens stand for
their image, so only rows with the same screenshots share a prefix) and, for mRoPE models, the
rows' 3-D positions from the model's own rope index, as the engine computed them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from agentrl.anchors import state_ids
from agentrl.models.packed_attention import PackedLayout
from agentrl.segments import episode_key
from agentrl.types import Trajectory, dense_group_ids

if TYPE_CHECKING:
    from agentrl.models.vision import VisionProcessor


@dataclass
class RolloutBatch:
    input_ids: Tensor
    """[B, T] token ids, right-padded with `pad_id`."""
    lengths: Tensor
    """[B] real lengths."""
    mask: Tensor
    """[B, T-1] 1.0 where the target token was sampled by the policy."""
    rollout_logp: Tensor
    """[B, T-1] sampler logprob of each target token (0 elsewhere)."""
    rewards: Tensor
    """[B, T-1] per-step rewards on the last policy token of each turn."""
    group_ids: Tensor
    """[B] integer group of each sequence (same prompt, same group), numbered over the whole
    step (`agentrl.types.dense_group_ids`), so equal ids mean one group on every rank."""
    extras: dict[str, Tensor] = field(default_factory=dict)
    """Filled during the step: old_logp, ref_logp, values, advantages, returns (and pass_logp,
    the log-probs of an update's one pass, kept for the run's trained/ file)."""
    images: list[list[np.ndarray]] | None = None
    """Per row, its images in order (vision-language batches; None otherwise)."""
    spans: list[list[tuple[int, int]]] | None = None
    """Per row, [start, end) of each image's tokens."""
    key_ids: Tensor | None = None
    """[B, T] `input_ids` with image tokens replaced by their image's keys."""
    positions: Tensor | None = None
    """[3, B, T] mRoPE positions (models with 3-D positions; None otherwise)."""
    episodes: list[str] | None = None
    """Per row, its episode (`agentrl.segments.episode_key`): rows of one episode are its
    segments, in order, and share its outcome advantage (None: every row is an episode)."""
    state_ids: Tensor | None = None
    """[B, T-1] int64: on the last policy token of each turn the id of the state it acted from
    (`agentrl.anchors`, GiGPO's anchor states), 0 elsewhere."""

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> RolloutBatch:
        """This batch with every tensor on `device`."""
        return RolloutBatch(
            **{f: getattr(self, f).to(device) for f in _TENSOR_FIELDS},
            extras={k: v.to(device) for k, v in self.extras.items()},
            images=self.images,
            spans=self.spans,
            key_ids=self.key_ids.to(device) if self.key_ids is not None else None,
            positions=self.positions.to(device) if self.positions is not None else None,
            episodes=self.episodes,
            state_ids=self.state_ids.to(device) if self.state_ids is not None else None,
        )

    def micro_batches(
        self, indices: Sequence[int], size: int
    ) -> Iterator[tuple[Tensor, int]]:
        """Yield (row indices, padded length) per micro-batch, trimmed to its longest row.

        Rows are visited in the order given; the caller sorts by length to cut padding.
        """
        for i in range(0, len(indices), size):
            idx = torch.as_tensor(
                list(indices[i : i + size]), dtype=torch.long, device=self.input_ids.device
            )
            yield idx, int(self.lengths[idx].max())

    def rows(self, name: str, idx: Tensor, length: int) -> Tensor:
        """Rows `idx` of a per-target tensor (a field or an extra), trimmed to `length - 1`."""
        t = self.extras[name] if name in self.extras else getattr(self, name)
        return t[idx, : length - 1]


def per_token(batch: RolloutBatch, values_BT: Tensor) -> list[list[float]]:
    """Each row's values at its policy tokens, in token order: what `collate` put at a
    trajectory's trained tokens (`agentrl.trained_files.trained_tokens`), read back."""
    mask_BT = batch.mask.bool().cpu()
    flat = values_BT.detach().float().cpu()[mask_BT].tolist()
    out, start = [], 0
    for n in mask_BT.sum(dim=1).tolist():
        out.append(flat[start : start + n])
        start += n
    return out


_TENSOR_FIELDS = ("input_ids", "lengths", "mask", "rollout_logp", "rewards", "group_ids")


def collate(
    trajectories: Sequence[Trajectory], pad_id: int, group_ids: Sequence[int] | None = None
) -> RolloutBatch:
    """Pad the trajectories into a batch. `group_ids`: their groups as numbered for the whole
    step (a rank's slice of them); default: `dense_group_ids(trajectories)`."""
    if not trajectories:
        raise ValueError("cannot train on an empty batch of trajectories")
    if group_ids is None:
        group_ids = dense_group_ids(trajectories)
    if len(group_ids) != len(trajectories):
        raise ValueError(f"{len(group_ids)} group ids for {len(trajectories)} trajectories")
    B = len(trajectories)
    T = max(len(t.token_ids) for t in trajectories)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T - 1)
    rollout_logp = torch.zeros(B, T - 1)
    rewards = torch.zeros(B, T - 1)
    states = torch.zeros(B, T - 1, dtype=torch.long)
    for b, traj in enumerate(trajectories):
        n = len(traj.token_ids)
        input_ids[b, :n] = torch.as_tensor(traj.token_ids)
        mask[b, : n - 1] = torch.as_tensor(traj.loss_mask[1:], dtype=torch.float32)
        rollout_logp[b, : n - 1] = torch.as_tensor(traj.logprobs[1:], dtype=torch.float32)
        for turn, state in zip(traj.turns, state_ids(traj), strict=True):
            if turn.end > turn.start:
                rewards[b, turn.end - 2] += turn.reward
                states[b, turn.end - 2] = state
    lengths = torch.as_tensor([len(t.token_ids) for t in trajectories])
    groups = torch.as_tensor(list(group_ids), dtype=torch.long)
    return RolloutBatch(input_ids, lengths, mask, rollout_logp, rewards, groups,
                        episodes=[episode_key(t) for t in trajectories], state_ids=states)


def add_images(
    batch: RolloutBatch, trajectories: Sequence[Trajectory], vision: VisionProcessor | None,
    model: Any,
) -> None:
    """Give a collated batch its rows' images, keys and positions (see module docstring); a
    batch without images is left as it is. `model` is the policy (its rope index)."""
    if not any(t.images for t in trajectories):
        return
    if vision is None:
        raise ValueError(
            "the trajectories carry images but the policy is a text-only model; train them "
            "with the vision-language model that sampled them (--actor.model)"
        )
    batch.images = [[im.pixels for im in t.images] for t in trajectories]
    batch.spans = []
    keys = batch.input_ids.clone()
    positions = None
    if vision.mrope:
        positions = torch.arange(keys.shape[1]).expand(3, *keys.shape).clone()
    for b, (t, ims) in enumerate(zip(trajectories, batch.images, strict=True)):
        n = len(t.token_ids)
        batch.spans.append(vision.spans(t.token_ids, ims))
        keys[b, :n] = torch.as_tensor(vision.key_ids(t.token_ids, ims))
        if positions is not None:
            got = vision.positions(model, t.token_ids, ims)
            assert got is not None
            positions[:, b, :n] = got[0]
    dev = batch.input_ids.device
    batch.key_ids = keys.to(dev)
    batch.positions = positions.to(dev) if positions is not None else None


def length_sorted(batch: RolloutBatch, indices: Sequence[int]) -> list[int]:
    """Indices sorted by length, so micro-batches hold similar lengths (less padding)."""
    return sorted(indices, key=lambda i: int(batch.lengths[i]))


def group_sorted(batch: RolloutBatch, indices: Sequence[int]) -> list[int]:
    """Indices with each group's rows together (then by length), so that a packed micro-batch
    holds whole groups and their shared prompt is encoded once (see `pack`)."""
    return sorted(indices, key=lambda i: (int(batch.group_ids[i]), int(batch.lengths[i])))


@dataclass
class Packed:
    """Rows of a micro-batch concatenated into one padding-free sequence."""

    input_ids: Tensor
    """[1, L] token ids."""
    position_ids: Tensor
    """[1, L] position of each token in its own sequence."""
    attention_mask: Tensor | None
    """[1, 1, L, L] bool (True: may attend) when prefixes are shared; None otherwise, and
    transformers derives the block-diagonal causal mask from the restarting position ids."""
    index: Tensor
    """[rows, n] where token t of each row sits in the packed sequence."""
    layout: PackedLayout
    """Where each sequence lies in the row, for attention one sequence at a time
    (`agentrl.models.packed_attention`)."""
    images: list[np.ndarray] = field(default_factory=list)
    """The images whose tokens the packed sequence holds, in order."""
    mrope: Tensor | None = None
    """[3, 1, L] mRoPE positions (models with 3-D positions)."""

    @property
    def shared_tokens(self) -> int:
        """Tokens saved by sharing prefixes (0 without sharing)."""
        return int((self.index >= 0).sum()) - self.input_ids.shape[1]


def pack(batch: RolloutBatch, idx: Tensor, n: int, *, share_prefixes: bool = True,
         min_shared: int = 8) -> Packed:
    """Concatenate rows `idx` (trimmed to `n` tokens) into one sequence without padding.

    With `share_prefixes`, the rows of one group (samples of the same prompt) store their
    longest common prefix once: [prefix, rest of row 1, rest of row 2, ...], each rest attending
    to the prefix and to itself. The prefix's hidden states are the same for every row (same
    tokens, same positions), so logprobs and gradients are those of the unshared rows while the
    prompt is encoded once per group instead of once per sample: in GRPO-style batches the
    prompt is often half of the tokens. Groups sharing fewer than `min_shared` tokens are packed
    whole.
    """
    rows = idx.tolist()
    lengths = [int(batch.lengths[i]) for i in rows]
    keys = batch.key_ids if batch.key_ids is not None else batch.input_ids
    buckets: dict[int, list[int]] = {}
    for u, r in enumerate(rows):
        key = int(batch.group_ids[r]) if share_prefixes else -1 - u
        buckets.setdefault(key, []).append(u)
    ids_parts, pos_parts, seg_parts, owner_parts = [], [], [], []
    mrope_parts: list[Tensor] = []
    images: list[np.ndarray] = []

    def take(r: int, a: int, b: int) -> None:
        """Row r's tokens [a, b): their ids, positions and images."""
        ids_parts.append(batch.input_ids[r, a:b])
        pos_parts.append(torch.arange(a, b, device=dev))
        if batch.positions is not None:
            mrope_parts.append(batch.positions[:, r, a:b])
        if batch.images is not None and batch.spans is not None:
            images.extend(im for im, (s, _) in zip(batch.images[r], batch.spans[r], strict=True)
                          if a <= s < b)

    dev = batch.input_ids.device
    index = torch.full((len(rows), n), -1, dtype=torch.long, device=dev)
    offset = 0
    groups: list[tuple[int, tuple[int, ...]]] = []
    for seg, members in enumerate(buckets.values()):
        shared = 0
        if len(members) > 1:
            seqs = [keys[rows[u], : lengths[u]] for u in members]
            shared = _common_prefix(seqs)
            if batch.spans is not None:  # never split an image between prefix and rest
                shared = min([a for a, b in batch.spans[rows[members[0]]] if a < shared < b],
                             default=shared)
            if shared < min_shared:
                shared = 0
        if shared:
            take(rows[members[0]], 0, shared)
            seg_parts.append(torch.full((shared,), seg, device=dev))
            owner_parts.append(torch.full((shared,), -1, device=dev))
            for u in members:
                index[u, :shared] = torch.arange(offset, offset + shared, device=dev)
            offset += shared
        groups.append((shared, tuple(lengths[u] - shared for u in members)))
        for u in members:
            m = lengths[u] - shared
            take(rows[u], shared, lengths[u])
            seg_parts.append(torch.full((m,), seg, device=dev))
            owner_parts.append(torch.full((m,), u, device=dev))
            index[u, shared : lengths[u]] = torch.arange(offset, offset + m, device=dev)
            offset += m
    ids, pos = torch.cat(ids_parts)[None], torch.cat(pos_parts)[None]
    mask = None
    if offset < sum(lengths):
        seg_ids, owner, p = torch.cat(seg_parts), torch.cat(owner_parts), pos[0]
        mask = (
            (seg_ids[:, None] == seg_ids[None, :])
            & (p[None, :] <= p[:, None])
            & ((owner[None, :] == -1) | (owner[None, :] == owner[:, None]))
        )[None, None]
    mrope = torch.cat(mrope_parts, dim=1)[:, None] if mrope_parts else None
    return Packed(ids, pos, mask, index, PackedLayout(tuple(groups), dev), images, mrope)


def _common_prefix(seqs: Sequence[Tensor]) -> int:
    """Length of the longest prefix shared by all sequences."""
    width = min(len(s) for s in seqs)
    first = seqs[0][:width]
    same = torch.ones(width, dtype=torch.bool, device=first.device)
    for s in seqs[1:]:
        same &= s[:width] == first
    diff = (~same).nonzero()
    return int(diff[0]) if len(diff) else width
