"""Trajectories -> training tensors.

Token tensors are [B, T] (right-padded). Per-target tensors are [B, T-1]: position t holds what
is known about token t+1 (its logprob is read from the logits at t). Rewards sit on the last
policy token of each turn, so multi-turn episodes keep per-step rewards.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from agentrl.types import Trajectory


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
    """[B] integer group of each sequence (same prompt, same group)."""
    extras: dict[str, Tensor] = field(default_factory=dict)
    """Filled during the step: old_logp, ref_logp, values, advantages, returns."""

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def micro_batches(
        self, indices: Sequence[int], size: int
    ) -> Iterator[tuple[Tensor, int]]:
        """Yield (row indices, padded length) per micro-batch, trimmed to its longest row.

        Rows are visited in the order given; the caller sorts by length to cut padding.
        """
        for i in range(0, len(indices), size):
            idx = torch.as_tensor(list(indices[i : i + size]), dtype=torch.long)
            yield idx, int(self.lengths[idx].max())

    def rows(self, name: str, idx: Tensor, length: int) -> Tensor:
        """Rows `idx` of a per-target tensor (a field or an extra), trimmed to `length - 1`."""
        t = self.extras[name] if name in self.extras else getattr(self, name)
        return t[idx, : length - 1]


def collate(trajectories: Sequence[Trajectory], pad_id: int) -> RolloutBatch:
    if not trajectories:
        raise ValueError("cannot train on an empty batch of trajectories")
    B = len(trajectories)
    T = max(len(t.token_ids) for t in trajectories)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T - 1)
    rollout_logp = torch.zeros(B, T - 1)
    rewards = torch.zeros(B, T - 1)
    groups: dict[str, int] = {}
    group_ids = torch.zeros(B, dtype=torch.long)
    for b, traj in enumerate(trajectories):
        n = len(traj.token_ids)
        input_ids[b, :n] = torch.as_tensor(traj.token_ids)
        mask[b, : n - 1] = torch.as_tensor(traj.loss_mask[1:], dtype=torch.float32)
        rollout_logp[b, : n - 1] = torch.as_tensor(traj.logprobs[1:], dtype=torch.float32)
        for turn in traj.turns:
            if turn.end > turn.start:
                rewards[b, turn.end - 2] += turn.reward
        key = traj.group if traj.group is not None else traj.uid
        group_ids[b] = groups.setdefault(key, len(groups))
    lengths = torch.as_tensor([len(t.token_ids) for t in trajectories])
    return RolloutBatch(input_ids, lengths, mask, rollout_logp, rewards, group_ids)


def length_sorted(batch: RolloutBatch, indices: Sequence[int]) -> list[int]:
    """Indices sorted by length, so micro-batches hold similar lengths (less padding)."""
    return sorted(indices, key=lambda i: int(batch.lengths[i]))


def packed_inputs(batch: RolloutBatch, idx: Tensor) -> tuple[Tensor, Tensor, list[int]]:
    """Concatenate rows `idx` into one row with per-sequence position ids (no padding).

    transformers builds a block-diagonal causal mask from position ids that restart at 0 when
    no attention mask and no cache are passed, so each sequence attends only to itself.
    Returns (input_ids [1, L], position_ids [1, L], lengths).
    """
    lengths = [int(batch.lengths[i]) for i in idx]
    ids = torch.cat([batch.input_ids[i, :n] for i, n in zip(idx.tolist(), lengths, strict=True)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    return ids[None], pos[None], lengths

