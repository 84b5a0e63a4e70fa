"""DeepSpeed ZeRO (stages 1-3) for the policy worker, the alternative to FSDP2.

Ranks are Ray actors like under FSDP2. We keep our own loss normalisation (global token and
sequence counts) and micro-batch loop; DeepSpeed partitions optimizer state (and gradients at
stage 2, and parameters at stage 3), reduces gradients, clips and steps at the accumulation
boundary. Forward passes run through the engine (`engine(...)`): at stage 3 it gathers each
layer's parameters and counts micro-steps, without which accumulated gradients overwrite each
other. A torch AdamW is passed in so nothing is JIT-compiled beyond DeepSpeed's one
communication op (cached in TORCH_EXTENSIONS_DIR after the first run, ~40 s on a 2-core CPU).

Checkpoints hold the full (gathered) module state plus every rank's optimizer partition, so a
resume needs the same world size, as DeepSpeed's own `load_state_dict` does.
"""

from __future__ import annotations

import math
import os
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor

from trainers.config import TrainConfig


def micro_batches_per_step(cfg: TrainConfig) -> int:
    """Forward/backward passes per optimizer step on each rank (DeepSpeed's accumulation)."""
    rows = cfg.rollout_batch_size // (cfg.num_policy_workers * cfg.minibatches_per_step)
    return max(1, math.ceil(rows / cfg.micro_batch_size))


def initialize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    rank: int,
    world_size: int,
    addr: str,
    *,
    max_grad_norm: float,
) -> Any:
    """A DeepSpeed engine training `model` with `optimizer` (call once per trained model; the
    process group is set up by the first call)."""
    url = urlparse(addr)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                      MASTER_ADDR=url.hostname or "127.0.0.1", MASTER_PORT=str(url.port))
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if cfg.zero_stage == 3 and hidden:
        # Keep only parameters below 10 x hidden (norms, biases) whole on every rank, as the
        # transformers integration's "auto" does; DeepSpeed's fixed 1e5 would keep every
        # matrix of a small model whole, so nothing would be partitioned.
        zero["stage3_param_persistence_threshold"] = 10 * hidden
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro_batches_per_step(cfg),
        "gradient_clipping": max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def partitions_weights(engine: Any) -> bool:
    """Whether each rank holds only a slice of every parameter (ZeRO-3)."""
    return bool(engine.zero_optimization_partition_weights())


def full_module_state(engine: Any) -> dict[str, Tensor]:
    """The module's full state on CPU, on every rank (a collective under ZeRO-3)."""
    import deepspeed

    module = engine.module
    with deepspeed.zero.GatheredParameters(
        list(module.parameters()), enabled=partitions_weights(engine)
    ):
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def full_state(engine: Any) -> tuple[dict[str, Tensor], list[dict]]:
    """(full module state, every rank's optimizer partition in rank order). A collective."""
    from trainers import fsdp

    return full_module_state(engine), fsdp.gather_objects(engine.optimizer.state_dict())


def load_full_state(engine: Any, module_sd: dict[str, Tensor], optim_sd: list[dict]) -> None:
    """Inverse of `full_state`: every rank loads the full module state (under ZeRO-3 rank 0's
    copy is re-partitioned over the ranks on leaving the gather), then its optimizer partition."""
    import deepspeed

    module = engine.module
    with deepspeed.zero.GatheredParameters(
        list(module.parameters()), modifier_rank=0, enabled=partitions_weights(engine)
    ):
        module.load_state_dict(module_sd)
    # Stage 1-2 rebuild their fp32 master partitions from the weights just loaded; stage 3
    # restores them (and its weight partitions) from the saved partitions, the same values.
    engine.optimizer.load_state_dict(optim_sd, load_from_fp32_weights=False)
