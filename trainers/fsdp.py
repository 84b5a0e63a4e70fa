"""FSDP2 data parallelism for the policy worker: process group, sharding, collectives.

Each of `num_policy_workers` Ray actors holds one shard of the parameters and optimizer state
(`torch.distributed.fsdp.fully_shard`, gloo on CPU, NCCL on GPU) and trains on its slice of the
rollout batch. Advantages are computed on the whole batch (gathered to every rank, so group
baselines and whitening see all sequences) and every loss is normalised by global counts, so a
step on N ranks matches a step on one (tested). The critic (PPO) is sharded and trained the
same way; the reference model is sharded too.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def init_distributed(rank: int, world_size: int, addr: str) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend,
        init_method=addr,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=10),
    )


def shard_model(model: torch.nn.Module) -> None:
    """Shard every decoder layer, then the rest (embeddings, norm, head) at the root."""
    from torch.distributed.fsdp import fully_shard

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    for layer in getattr(decoder, "layers", []):
        fully_shard(layer)
    fully_shard(model)


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_sum(values: list[float]) -> list[float]:
    """Sum floats over ranks (identity on one process)."""
    if world() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (on every rank)."""
    if world() == 1:
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def full_norm(norm: Tensor) -> float:
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict, dict]:
    """Unsharded model (and optimizer) state, on CPU. A collective: call on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return get_model_state_dict(model, options=opts), {}
    return get_state_dict(model, optimizer, options=opts)


def load_full_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=StateDictOptions(full_state_dict=True),
    )


def pad_cat(rows: list[Tensor], width: int) -> Tensor:
    """Concatenate [b_i, t_i] tensors along rows, right-padding each to `width` columns."""
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows])
