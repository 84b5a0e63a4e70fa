"""Collectives shared by the distributed backends (identities on one process).

Advantages are computed on the whole batch, gathered to every rank, and every loss is
normalised by global counts, so N ranks give the update of one process (tests/trainers).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from agentrl.backends.device import process_group_backend


def init_process_group(rank: int, world_size: int, addr: str, device: torch.device) -> None:
    """Join the ranks' process group (NCCL on cuda, gloo on cpu); once per process."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        process_group_backend(device),
        init_method=addr,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(minutes=10),
    )


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_sum(values: list[float]) -> list[float]:
    """Sum floats over ranks (identity on one process)."""
    if world() == 1:
        return values
    # NCCL reduces only GPU tensors.
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (on every rank)."""
    if world() == 1:
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def pad_cat(rows: list[Tensor], width: int) -> Tensor:
    """Concatenate [b_i, t_i] tensors along rows, right-padding each to `width` columns."""
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows])
