"""Random multi-turn batches for the algorithm tests.

A row is ``prompt (mask 0) | action | observation (mask 0) | action | ... | padding (mask 0)``
with 1-3 turns of uneven length; each turn's reward sits on its last action token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class Batch:
    """A random batch; every tensor has a value on every token, mask 0 included."""

    rewards_BT: Tensor
    """Step rewards on the last action token of each turn, 0 elsewhere."""
    mask_BT: Tensor
    """1.0 on action tokens."""
    group_ids_B: Tensor
    """Non-contiguous ids, groups of 2-4 samples, shuffled."""
    values_BT: Tensor
    """Critic values (random everywhere)."""
    kl_BT: Tensor
    """Per-token KL (random everywhere)."""
    logp_BT: Tensor
    """Log-probs near -1 (random everywhere)."""


def make_batch(seed: int, *, group_sizes: tuple[int, ...] = (2, 3, 4, 3), T: int = 24) -> Batch:
    """A deterministic random batch of ``sum(group_sizes)`` rows of length ``T``."""
    gen = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=gen))

    B = sum(group_sizes)
    mask_BT = torch.zeros(B, T)
    rewards_BT = torch.zeros(B, T)
    for b in range(B):
        t = randint(0, 3)
        num_turns = randint(1, 3)
        for turn in range(num_turns):
            length = randint(1, 4)
            mask_BT[b, t : t + length] = 1.0
            # Some steps get no reward, as in sparse multi-turn tasks.
            if randint(0, 3) > 0:
                rewards_BT[b, t + length - 1] = float(torch.randn((), generator=gen))
            t += length
            if turn < num_turns - 1:
                t += randint(1, 3)
    ids = torch.tensor([7, 3, 12, 5, 9, 1][: len(group_sizes)])
    group_ids_B = ids.repeat_interleave(torch.tensor(group_sizes))
    perm = torch.randperm(B, generator=gen)
    return Batch(
        rewards_BT=rewards_BT[perm],
        mask_BT=mask_BT[perm],
        group_ids_B=group_ids_B[perm],
        values_BT=torch.randn(B, T, generator=gen),
        kl_BT=torch.rand(B, T, generator=gen) * 0.2,
        logp_BT=-torch.rand(B, T, generator=gen) * 2.0,
    )
