"""The flags every offline trainer (`agentrl sft`, `agentrl dpo`, `agentrl rm`) takes, checked
once with all of them applied; each trainer's config adds its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agentrl.command_line import validation_deferred
from trainers.config import ActorConfig, check_sharded_4bit


@dataclass(frozen=True, kw_only=True)
class OfflineConfig:
    """Flags every offline trainer takes."""

    dataset: str | None = None
    """A .jsonl, .json or .parquet file or a `datasets` save_to_disk directory."""
    eval_dataset: str | None = None
    """Held-out rows (default: --eval_fraction of --dataset, picked by content hash)."""
    eval_fraction: float = 0.05
    """Share of --dataset held out when there is no --eval_dataset."""
    bad_rows: Literal["stop", "skip"] = "stop"
    """A row that is not JSON or lacks its keys: stop with its line number, or skip and count."""
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(lr=1e-5))
    backend: str = "auto"
    """Training backend (agentrl/backends): local, cpu, fsdp2, deepspeed or auto."""
    epochs: int = 1
    max_steps: int = 0
    """Stop after this many optimizer steps (0: after --epochs)."""
    batch_size: int = 16
    """Examples per optimizer step."""
    micro_batch_size: int = 8
    """Examples per forward/backward pass (gradients accumulate over a step)."""
    max_len: int = 2048
    """Longer sequences are cut to this many tokens (counted in `truncated`)."""
    packing: bool = True
    """Concatenate a micro-batch's sequences into one, without padding."""
    eval_every: int = 0
    """Also evaluate every N steps (always before and after)."""
    save_every: int = 0
    """Save a checkpoint every N steps (one is always saved at the end)."""
    keep_last: int = 2
    num_workers: int = 1
    """Data-parallel ranks, each a Ray actor with its share of every batch (needs --backend
    fsdp2 or deepspeed); the CPUs or GPUs are split between them."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage (--backend deepspeed)."""
    resume: str | None = None
    """A checkpoint directory, or `auto` for the run directory's latest."""
    seed: int = 0
    run_dir: str = "runs/latest"
    tensorboard: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"--eval_fraction must be in [0, 1), got {self.eval_fraction}")
        for name in ("epochs", "batch_size", "micro_batch_size", "max_len", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps < 0 or self.eval_every < 0 or self.save_every < 0:
            raise ValueError("--max_steps, --eval_every and --save_every must be >= 0")
        if self.num_workers < 1:
            raise ValueError(f"--num_workers must be >= 1, got {self.num_workers}")
        if self.num_workers > 1:
            from agentrl.backends import DISTRIBUTED

            if self.backend not in DISTRIBUTED:
                raise ValueError(f"--num_workers {self.num_workers} trains data-parallel: it "
                                 f"needs --backend {' or '.join(DISTRIBUTED)}, got --backend "
                                 f"{self.backend}")
            check_sharded_4bit(self.actor, self.backend, self.zero_stage, "--num_workers")
            if self.batch_size < self.num_workers:
                raise ValueError(f"--batch_size {self.batch_size} gives some of the "
                                 f"{self.num_workers} workers nothing: raise it")
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"--zero_stage must be 1, 2 or 3, got {self.zero_stage}")
