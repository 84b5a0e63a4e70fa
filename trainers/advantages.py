"""Advantages over a whole rollout batch, across data-parallel ranks."""

from __future__ import annotations

import torch
from torch import Tensor

from agentrl import algorithms as A
from agentrl.backends.distributed import gather_objects, pad_cat
from trainers.batch import RolloutBatch
from trainers.config import AlgoConfig


def batch_advantages(
    algo: AlgoConfig, batch: RolloutBatch, kl: Tensor | None, kl_coef: float, *, rank: int = 0,
) -> tuple[Tensor, Tensor]:
    """(advantages, returns) of this rank's rows. Every rank gathers all ranks' rewards, masks
    and group ids (small), so group baselines and whitening see every sequence of the step.
    The group ids were numbered once for the whole step, so they are used as they come."""
    fields = {"rewards": batch.rewards, "mask": batch.mask, "kl": kl,
              "values": batch.extras.get("values")}
    parts = gather_objects(({k: v for k, v in fields.items() if v is not None},
                            batch.group_ids.tolist()))
    width = max(p[0]["mask"].shape[1] for p in parts)
    full = {k: pad_cat([p[0][k] for p in parts], width) for k in parts[0][0]}
    adv, ret = A.compute_advantages(
        algo.estimator,
        rewards_BT=full["rewards"],
        mask_BT=full["mask"],
        group_ids_B=torch.tensor([g for p in parts for g in p[1]], device=batch.mask.device),
        values_BT=full.get("values"),
        gamma=algo.gamma,
        lam=algo.lam if algo.estimator == "gae" else 1.0,
        kl_BT=full.get("kl"),
        kl_coef=kl_coef if kl is not None else 0.0,
    )
    start = sum(p[0]["mask"].shape[0] for p in parts[:rank])
    rows, cols = batch.mask.shape
    return adv[start : start + rows, :cols], ret[start : start + rows, :cols]
