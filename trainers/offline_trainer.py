"""One offline trainer: one model behind one training backend, stepping through a shuffled
dataset, with checkpoints for exact resume and the final Hugging Face export.

The update is the RL trainer's machinery: the same backends (`--backend`), packing, log-prob
function (`trainers.logprobs.token_logprobs`) and checkpoints. A trainer implements
`train_step` (one optimizer step on its share of a batch) and `evaluate` (metrics of its share
of the held-out examples), each summing over ranks what it normalises by or reports
(`all_sum`). With N data-parallel ranks (trainers/offline_ranks.py) every rank draws the same
batch and takes every N-th example of it (`shard`), padded with zero-weight repeats so that all
ranks run the same forward/backward passes (the collectives of a sharded model need that);
losses are normalised by global counts, so N ranks make the update of one process. Rank 0
writes the checkpoints and the export; with LoRA every rank trains its adapters on the shared
(sharded) base, and the export merges the gathered ones.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from agentrl.command_line import deferred_validation
from agentrl.seeding import derive_seed
from trainers.offline_config import OfflineConfig

T = TypeVar("T")


class OfflineTrainer:
    """One model behind one backend, trained on `train` examples by steps of --batch_size."""

    kind = "offline"
    """Names the trainer in its checkpoints (a resume checks it)."""

    def __init__(self, cfg: OfflineConfig, train: list[Any], held: list[Any],
                 tokenizer: Any, *, rank: int = 0, dist_addr: str = "") -> None:
        import torch

        from agentrl.backends import (
            DistSpec,
            OptimizerSpec,
            create_backend,
            resolve_backend_name,
            resolve_device,
        )
        from agentrl.models.lora import load_policy
        from trainers.config import TrainConfig

        torch.manual_seed(cfg.seed)
        self.cfg, self.train, self.held, self.tokenizer = cfg, train, held, tokenizer
        a = cfg.actor
        self.device = resolve_device(a.device)
        self.model = load_policy(a.model, dtype=a.dtype, device=self.device,
                                 lora_rank=a.lora_rank, lora_alpha=a.lora_alpha,
                                 lora_targets=a.lora_targets, lora_dropout=a.lora_dropout,
                                 load_in_4bit=a.load_in_4bit)
        if a.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.rank, self.world = rank, cfg.num_workers
        dist = DistSpec(rank=rank, world_size=self.world, addr=dist_addr,
                        zero_stage=cfg.zero_stage,
                        micro_batches_per_step=-(-self.per_rank // cfg.micro_batch_size))
        self.backend = create_backend(resolve_backend_name(cfg.backend, self.device), dist)
        self.backend.setup(self.trained_module(self.model), OptimizerSpec(
            lr=a.lr, betas=a.betas, weight_decay=a.weight_decay, warmup_steps=a.warmup_steps,
            max_grad_norm=a.max_grad_norm), self.device)
        # The log-prob function's settings, as the RL trainer passes them (temperature 1);
        # only carried, not an RL run's config to check.
        with deferred_validation():
            self.tcfg = TrainConfig(actor=a, backend=cfg.backend, packing=cfg.packing,
                                    share_prefixes=False, micro_batch_size=cfg.micro_batch_size,
                                    use_ray=False, seed=cfg.seed)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id)
        per_epoch = math.ceil(len(train) / cfg.batch_size)
        self.total_steps = cfg.max_steps or per_epoch * cfg.epochs
        self.step, self.epoch, self.pos = 0, 0, 0
        self.order = self._epoch_order(0)

    # ---------------------------------------------------------------- what a trainer adds
    def trained_module(self, model: Any) -> Any:
        """What the backend trains: the language model itself, or a module around it."""
        return model

    def train_step(self, items: list[Any]) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Metrics of the held-out examples (empty without any)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- data
    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.train)))
        random.Random(derive_seed(self.cfg.seed, "epoch", epoch)).shuffle(order)
        return order

    def next_items(self) -> list[Any]:
        """The next --batch_size examples of the epoch's shuffled order (an epoch's last step
        may be shorter: steps never mix two epochs); the same on every rank."""
        if self.pos >= len(self.order):
            self.epoch += 1
            self.order, self.pos = self._epoch_order(self.epoch), 0
        take = self.order[self.pos : self.pos + self.cfg.batch_size]
        self.pos += len(take)
        return [self.train[i] for i in take]

    def advance(self) -> dict[str, float]:
        """One optimizer step on this rank's share of the next batch; its metrics."""
        metrics = self.train_step(self.next_items())
        self.step += 1
        return metrics

    def shard(self, items: Sequence[T], size: int | None = None) -> tuple[list[T], list[float]]:
        """This rank's share of `items` (every world-th) and each one's weight, padded with
        weight-0 repeats to `size` (default: the largest share), the same on every rank: all
        ranks then run the same passes (a sharded model's collectives need that), and a step
        the same number of micro-batches (DeepSpeed's accumulation boundary)."""
        mine = list(items[self.rank :: self.world])
        pad = max(size or -(-len(items) // self.world), len(mine)) - len(mine)
        return mine + [items[0]] * pad, [1.0] * len(mine) + [0.0] * pad

    @property
    def per_rank(self) -> int:
        """Examples of a full step on each rank (shorter steps are padded to it)."""
        return -(-self.cfg.batch_size // self.world)

    def batch(self, trajs: Sequence[Any]) -> Any:
        from trainers.batch import collate

        return collate(list(trajs), self.pad_id).to(self.device)

    def logprobs(self, module: Any, batch: Any, rows: Any) -> Any:
        """Log-probs of the target tokens of `rows` under `module`, `[m, n-1]` (0 elsewhere)."""
        from trainers.logprobs import token_logprobs

        return token_logprobs(self.tcfg, self.backend, module, batch, rows)[0]

    # ---------------------------------------------------------------- checkpoints
    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def save(self) -> Path | None:
        """A checkpoint (rank 0 writes it and returns its path; gathering the state is a
        collective every rank joins)."""
        from trainers.checkpoint import rng_state, save_checkpoint

        state = {"backend": self.backend.state_dict(), "rng": rng_state(),
                 "extra": self.extra_state()}
        if self.rank != 0:
            return None
        trainer = {"step": self.step, "epoch": self.epoch, "pos": self.pos,
                   "order": self.order, "kind": self.kind, "world": self.world}
        return save_checkpoint(self.cfg.run_dir, self.step, state, trainer,
                               keep=self.cfg.keep_last)

    def restore(self, path: Path) -> None:
        from trainers.checkpoint import load_checkpoint, set_rng_state

        state, trainer, _ = load_checkpoint(path)
        if trainer.get("kind") != self.kind:
            raise ValueError(f"{path} is not an `agentrl {self.kind}` checkpoint (it is "
                             f"{trainer.get('kind', 'an RL run')}'s)")
        if self.cfg.backend == "deepspeed" and trainer.get("world", 1) != self.world:
            raise ValueError(f"{path} was saved by {trainer.get('world', 1)} DeepSpeed workers; "
                             f"resume it with --num_workers {trainer.get('world', 1)}")
        self.backend.load_state_dict(state["backend"])
        set_rng_state(state["rng"])
        self.load_extra_state(state.get("extra", {}))
        self.step, self.epoch, self.pos = trainer["step"], trainer["epoch"], trainer["pos"]
        self.order = list(trainer["order"])

    def export_hf(self, path: Path) -> None:
        """A plain Hugging Face directory of the trained model; with LoRA, the adapters too
        (RUN_DIR/adapter) and `path` holds the merged model. Rank 0 writes them."""
        from agentrl.models.lora import save_trained

        state = self.full_weights()
        if self.rank == 0:
            save_trained(self.model, self.tokenizer, path, state)

    def full_weights(self) -> dict[str, Any] | None:
        """The trained module's full weights when sharded over ranks (a collective; None in
        one process, where the model holds them)."""
        return dict(self.backend.full_weights()) if self.world > 1 else None
