"""What the offline trainers (`agentrl sft`, `agentrl dpo`) share: their common flags, one
model behind one training backend, steps over a shuffled dataset, held-out evaluation,
checkpoints with exact resume, metrics and the final Hugging Face export.

The update is the RL trainer's machinery: the same backends (`--backend`), packing, log-prob
function (`trainers.logprobs.token_logprobs`), checkpoints, MetricsLogger (metrics.jsonl,
TensorBoard, W&B; `agentrl plot`) and progress bar. A trainer implements `train_step` (one
optimizer step on its share of a batch) and `evaluate` (metrics of its share of the held-out
examples), each summing over ranks what it normalises by or reports (`all_sum`).

`--num_workers N` (with `--backend fsdp2` or `deepspeed`) trains data-parallel in N Ray
actors: every rank draws the same batch and takes every N-th example of it (`shard`), padded
with zero-weight repeats so that all ranks run the same forward/backward passes (the
collectives of a sharded model need that); losses are normalised by global counts, so N ranks
make the update of one process. Rank 0 writes the checkpoints and the export; with LoRA every
rank trains its adapters on the shared (sharded) base, and the export merges the gathered ones.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from agentrl.command_line import deferred_validation, validation_deferred
from trainers.config import ActorConfig, check_sharded_4bit

C = TypeVar("C", bound="OfflineConfig")
T = TypeVar("T")


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


@dataclass
class OfflineData(Generic[T]):
    """A trainer's examples, tokenized and checked before any model loads."""

    train: list[T]
    eval: list[T]
    skipped: int = 0
    """Rows or trajectories left out (bad rows with --bad_rows skip, filtered episodes)."""
    truncated: int = 0
    """Sequences cut to --max_len."""


def held_out(row: Any, fraction: float) -> bool:
    """Whether `row` belongs to the held-out split: by a hash of its content, so equal rows
    land on the same side and the split does not depend on the file's order."""
    digest = hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def read_examples(cfg: OfflineConfig, make: Callable[[dict, str], T], *,
                  keys: Mapping[str, str] | None = None) -> tuple[list[T], list[T], int]:
    """(train, held-out, skipped): `make(row, where)` of every row of --dataset (and
    --eval_dataset), before any model loads. A row `make` refuses with a ValueError stops the
    run with its place, or with --bad_rows skip is counted."""
    from agentrl.data import read_rows

    train: list[T] = []
    held: list[T] = []
    skipped = 0
    sources = [(cfg.dataset, False)] + ([(cfg.eval_dataset, True)] if cfg.eval_dataset else [])
    for path, is_eval in sources:
        assert path is not None
        rows = read_rows(path, keys=keys or {}, on_bad=cfg.bad_rows,
                         what="--eval_dataset" if is_eval else "--dataset")
        skipped += len(rows.skipped)
        for row, where in zip(rows.rows, rows.where, strict=True):
            try:
                item = make(row, where)
            except ValueError as e:
                if cfg.bad_rows == "stop":
                    raise ValueError(f"{e} (skip such rows with --bad_rows skip)") from None
                skipped += 1
                continue
            out = held if is_eval or (not cfg.eval_dataset
                                      and held_out(row, cfg.eval_fraction)) else train
            out.append(item)
    if not train:
        raise ValueError(f"--dataset {cfg.dataset}: no training examples left (all held out "
                         f"or skipped); lower --eval_fraction or fix the rows")
    return train, held, skipped


def truncate(trajs: Sequence[Any], max_len: int) -> int:
    """Cut sequences to `max_len` tokens (turns past the cut are dropped); returns how many."""
    from agentrl.types import Turn

    cut = 0
    for t in trajs:
        if len(t.token_ids) <= max_len:
            continue
        cut += 1
        t.token_ids, t.loss_mask = t.token_ids[:max_len], t.loss_mask[:max_len]
        t.logprobs = t.logprobs[:max_len]
        t.turns = [Turn(obs_start=x.obs_start, start=x.start, end=min(x.end, max_len),
                        reward=x.reward, policy_version=x.policy_version,
                        finish_reason="length" if x.end > max_len else x.finish_reason,
                        version_changes=[c for c in x.version_changes
                                         if x.start + c[0] < max_len])
                   for x in t.turns if x.start < max_len]
        t.images = [im for im in t.images if im.end <= max_len]
    return cut


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
        random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(order)
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
        from trainers.export import save_trained

        state = self.full_weights()
        if self.rank == 0:
            save_trained(self.model, self.tokenizer, path, state)

    def full_weights(self) -> dict[str, Any] | None:
        """The trained module's full weights when sharded over ranks (a collective; None in
        one process, where the model holds them)."""
        return dict(self.backend.full_weights()) if self.world > 1 else None


def resume_point(cfg: OfflineConfig) -> Path | None:
    from trainers.checkpoint import latest_checkpoint

    if cfg.resume is None:
        return None
    found = latest_checkpoint(cfg.run_dir) if cfg.resume == "auto" else Path(cfg.resume)
    if found is None:
        raise ValueError(f"--resume auto: no checkpoint in {cfg.run_dir}/checkpoints")
    return found


def run_offline(cfg: OfflineConfig, trainer: OfflineTrainer | RankGroup, resume: Path | None,
                summary: dict[str, Any]) -> dict[str, Any]:
    """Train to the end, evaluating before, every --eval_every steps and after; returns the
    summary with the evaluations, the last checkpoint and the exported model."""
    from trainers.metrics import MetricsLogger

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    if resume is not None:
        trainer.restore(resume)
    log = MetricsLogger(run_dir, tensorboard=cfg.tensorboard, total_steps=trainer.total_steps,
                        progress=cfg.progress, config=asdict(cfg))
    try:
        if resume is None:
            before = {f"eval/{k}": v for k, v in trainer.evaluate().items()}
            if before:
                log.log(0, before)
                summary["eval_before"] = before
        while trainer.step < trainer.total_steps:
            metrics = trainer.advance()
            if cfg.eval_every and trainer.step % cfg.eval_every == 0:
                metrics.update({f"eval/{k}": v for k, v in trainer.evaluate().items()})
            log.log(trainer.step, metrics)
            log.progress(trainer.step, metrics)
            if cfg.save_every and trainer.step % cfg.save_every == 0:
                trainer.save()
        after = {f"eval/{k}": v for k, v in trainer.evaluate().items()}
        if after:
            log.log(trainer.step, after)
            summary["eval_after"] = after
        summary["checkpoint"] = str(trainer.save())
        trainer.export_hf(run_dir / "hf")
        summary["hf_model"] = str(run_dir / "hf")
        summary["steps"] = trainer.step
    finally:
        log.close()
    return summary


def train_offline(cfg: C, load: Callable[[C, Any], OfflineData[Any]],
                  trainer: Callable[[C, OfflineData[Any], Any], OfflineTrainer],
                  unit: str) -> dict[str, Any]:
    """Load the data (before any model), build the trainer, train: the summary of the run,
    counting its `unit`s ("examples", "pairs")."""
    from agentrl.models import load_tokenizer

    tokenizer = load_tokenizer(cfg.actor.model)
    data = load(cfg, tokenizer)
    resume = resume_point(cfg)
    summary: dict[str, Any] = {"run_dir": cfg.run_dir, f"train_{unit}": len(data.train),
                               f"eval_{unit}": len(data.eval), "skipped": data.skipped,
                               "truncated": data.truncated}
    if cfg.num_workers == 1:
        return run_offline(cfg, trainer(cfg, data, tokenizer), resume, summary)
    group = RankGroup.start(cfg, trainer, data, tokenizer)
    try:
        return run_offline(cfg, group, resume, summary)
    finally:
        group.close()


class RankGroup:
    """The N data-parallel ranks of `--num_workers N`, each a Ray actor holding one trainer:
    every call goes to all of them (the collectives inside need every rank) and answers with
    rank 0's result. It offers what `run_offline` uses of a trainer."""

    def __init__(self, actors: list[Any], total_steps: int, *, owns_ray: bool) -> None:
        self.actors, self.total_steps, self.step = actors, total_steps, 0
        self.owns_ray = owns_ray  # whether `start` started (or joined) Ray, for `close` to stop

    @classmethod
    def start(cls, cfg: OfflineConfig, make: Callable[..., OfflineTrainer],
              data: OfflineData[Any], tokenizer: Any) -> RankGroup:
        import ray

        from trainers.ray_utils import free_tcp_address, init_ray

        owns_ray = not ray.is_initialized()
        init_ray()
        gpus = int(ray.cluster_resources().get("GPU", 0))
        cuda = gpus > 0 and cfg.actor.device in ("auto", "cuda")
        if cuda and gpus < cfg.num_workers:
            raise ValueError(f"--num_workers {cfg.num_workers} needs a GPU each; the cluster "
                             f"has {gpus}")
        cpus = float(ray.cluster_resources().get("CPU", 1)) / cfg.num_workers
        opts = {"num_gpus": 1, "num_cpus": 1} if cuda else {
            "num_cpus": math.floor(cpus) if cpus >= 1 else cpus}
        addr = free_tcp_address()
        actors: list[Any] = [
            ray.remote(_Rank).options(**opts).remote(make, cfg, data, tokenizer, r, addr)
            for r in range(cfg.num_workers)]
        total = int(ray.get(actors[0].attr.remote("total_steps")))
        return cls(actors, total, owns_ray=owns_ray)

    def _all(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get([a.call.remote(method, *args) for a in self.actors])[0]

    def restore(self, path: Path) -> None:
        self._all("restore", path)
        import ray

        self.step = int(ray.get(self.actors[0].attr.remote("step")))

    def advance(self) -> dict[str, float]:
        metrics = self._all("advance")
        self.step += 1
        return metrics

    def evaluate(self) -> dict[str, float]:
        return self._all("evaluate")

    def save(self) -> Path:
        return self._all("save")

    def export_hf(self, path: Path) -> None:
        self._all("export_hf", path)

    def close(self) -> None:
        """End the ranks, and Ray if `start` started it (a caller's Ray stays up, its CPUs or
        GPUs free again)."""
        import ray

        from trainers.ray_utils import shutdown_ray

        for actor in self.actors:
            ray.kill(actor)
        if self.owns_ray:
            shutdown_ray()


class _Rank:
    """One rank's trainer in its Ray actor."""

    def __init__(self, make: Callable[..., OfflineTrainer], cfg: OfflineConfig,
                 data: OfflineData[Any], tokenizer: Any, rank: int, addr: str) -> None:
        self.trainer = make(cfg, data, tokenizer, rank=rank, dist_addr=addr)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.trainer, method)(*args)

    def attr(self, name: str) -> Any:
        return getattr(self.trainer, name)


def cli_main(config_cls: type[C], run: Callable[[C], dict[str, Any]], prog: str,
             doc: str | None, argv: list[str]) -> int:
    """Parse `argv` into `config_cls` (checked once, with the flags applied), run, print the
    summary; a ValueError is a clear message and exit code 2."""
    from agentrl.command_line import parse_flags
    from trainers.quiet import quiet_third_party

    try:
        cfg = parse_flags(config_cls, argv, prog=prog, doc=doc)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    quiet_third_party()
    try:
        summary = run(cfg)
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0

