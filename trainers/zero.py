"""DeepSpeed ZeRO (stages 1-2) for the policy worker, the alternative to FSDP2.

Ranks are Ray actors like under FSDP2. We keep our own loss normalisation (global token and
sequence counts) and micro-batch loop; DeepSpeed partitions optimizer state (and gradients at
stage 2), reduces gradients, clips and steps at the accumulation boundary. A torch AdamW is
passed in so nothing is JIT-compiled beyond DeepSpeed's one communication op (cached in
TORCH_EXTENSIONS_DIR after the first run, ~40 s on a 2-core CPU).
"""

from __future__ import annotations

import math
import os
from typing import Any
from urllib.parse import urlparse

import torch

from trainers.config import TrainConfig


def micro_batches_per_step(cfg: TrainConfig) -> int:
    """Forward/backward passes per optimizer step on each rank (DeepSpeed's accumulation)."""
    rows = cfg.rollout_batch_size // (cfg.num_policy_workers * cfg.minibatches_per_step)
    return max(1, math.ceil(rows / cfg.micro_batch_size))


def initialize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig,
               rank: int, world_size: int, addr: str) -> Any:
    url = urlparse(addr)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                      MASTER_ADDR=url.hostname or "127.0.0.1", MASTER_PORT=str(url.port))
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro_batches_per_step(cfg),
        "gradient_clipping": cfg.actor.max_grad_norm,
        "zero_optimization": {"stage": cfg.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine
