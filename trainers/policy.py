"""The policy worker: one RL update on top of training backends (agentrl/backends).

It runs in a Ray actor (or in-process with `use_ray=False`). The policy, and where the
algorithm needs them a frozen reference and a critic, each sit behind a backend of the
configured kind on the configured device; the worker computes log-probs with one function
(`trainers.logprobs.token_logprobs`) and the advantages and losses with trainers/rl_step.py,
and hands each loss to its backend.
Colocated, it also owns the sampling engine, which shares the very nn.Module being trained:
weight sync is a version bump. It then keeps the batch it sampled and runs the step's
selection and shaping on it in place (`collect_step`, `train_collected`).
"""

from __future__ import annotations

import copy
import functools
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from agentrl import algorithms as A
from agentrl.backends import (
    DistSpec,
    OptimizerSpec,
    TrainBackend,
    create_backend,
    resolve_backend_name,
    resolve_device,
)
from agentrl.backends.device import autocast
from agentrl.backends.distributed import all_sum
from agentrl.models.lora import adapters_off, is_lora, load_policy, merged_weights
from agentrl.seeding import derive_seed
from agentrl.trained_files import Trained
from agentrl.types import Trajectory
from trainers import rl_step
from trainers.batch import (
    RolloutBatch,
    add_images,
    collate,
    group_sorted,
    length_sorted,
    per_token,
)
from trainers.config import TrainConfig
from trainers.logprobs import Rows, padded_inputs, token_logprobs


class PolicyWorker:
    def __init__(
        self,
        cfg: TrainConfig,
        *,
        with_engine: bool = True,
        rank: int = 0,
        world_size: int = 1,
        dist_addr: str | None = None,
    ) -> None:
        from agentrl.models import load_tokenizer
        from agentrl.models.value import ValueModel
        from agentrl.models.vision import vision_processor

        torch.manual_seed(cfg.seed)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = resolve_device(cfg.actor.device)
        backend = resolve_backend_name(cfg.backend, self.device)
        dist = DistSpec(rank=rank, world_size=world_size, addr=dist_addr or "",
                        zero_stage=cfg.zero_stage,
                        micro_batches_per_step=cfg.micro_batches_per_rank)
        self.tokenizer = load_tokenizer(cfg.actor.model)
        a = cfg.actor
        self.model = load_policy(a.model, dtype=a.dtype, device=self.device,
                                 lora_rank=a.lora_rank, lora_alpha=a.lora_alpha,
                                 lora_targets=a.lora_targets, lora_dropout=a.lora_dropout,
                                 load_in_4bit=a.load_in_4bit)
        self.lora = is_lora(self.model)
        self.vision = vision_processor(self.tokenizer)
        if cfg.actor.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
            # transformers also hooks the embeddings to make their output require grad, which
            # only reentrant checkpointing of frozen embeddings needs. The hook would keep the
            # colocated engine off the lean decode step (it runs no hooked model): 2.7x slower
            # rollouts with checkpointing on (benchmarks/results/grpo_vs_trl.md).
            self.model.disable_input_require_grads()
        # The reference model and the critic are copies of the whole model, taken before it is
        # sharded: neither an FSDP2 nor a ZeRO-3 module can be deep-copied.
        # With LoRA the reference is the base itself, adapters off: no copy.
        self.ref_is_base = self.lora and cfg.algo.kl_coef > 0
        ref = copy.deepcopy(self.model) if cfg.algo.kl_coef > 0 and not self.lora else None
        critic = None
        if cfg.algo.estimator == "gae":
            critic = (_critic_from(cfg.algo.critic_init, self.model) if cfg.algo.critic_init
                      else ValueModel(copy.deepcopy(self.model)))
        optim = OptimizerSpec(lr=cfg.actor.lr, betas=cfg.actor.betas,
                              weight_decay=cfg.actor.weight_decay,
                              warmup_steps=cfg.actor.warmup_steps,
                              max_grad_norm=cfg.actor.max_grad_norm)
        self.policy = _backend(backend, dist, self.model, optim, self.device)
        self.ref = _backend(backend, dist, ref, None, self.device) if ref is not None else None
        # The critic is not clipped, as DeepSpeed-Chat trains it.
        self.critic = _backend(backend, dist, critic, OptimizerSpec(lr=cfg.algo.critic_lr),
                               self.device) if critic is not None else None
        self.version = 0
        self.shared_tokens = 0  # prompt tokens not re-encoded thanks to prefix sharing
        self.engine: Any = None
        self._collected: list[Trajectory] = []  # colocated: the batch collect_step sampled
        self._trained: list[Trained] = []  # the last update's, for the run's trained/ file
        self._broadcast: Any = None  # placed on GPUs: rank 0's end of the weight broadcast
        # The transformers engine samples from self.model itself: a weight sync is a version
        # bump. vLLM holds its own copy, loaded after every update.
        self.shares_weights = cfg.rollout.engine == "transformers"
        # On-policy distillation: the teacher scores every batch (trainers/distillation.py).
        self.teacher: Any = None
        if cfg.algo.teacher is not None:
            from trainers.distillation import teacher_engine

            self.teacher = teacher_engine(cfg, self.device)
        if with_engine:
            from trainers.rollout_engines import make_engine

            self.engine = make_engine(cfg, self.model, self.tokenizer, self.device)

    @property
    def has_ref(self) -> bool:
        return self.ref is not None or self.ref_is_base

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    # ------------------------------------------------------------------ forward passes
    def _logprobs(
        self, backend: TrainBackend, module: nn.Module, batch: RolloutBatch, rows: Rows,
        *, entropy: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        logp, ent, shared = token_logprobs(self.cfg, backend, module, batch, rows,
                                           entropy=entropy, vision=self.vision)
        self.shared_tokens += shared
        return logp, ent

    def _order(self, batch: RolloutBatch, rows: Sequence[int]) -> list[int]:
        """Micro-batch order: groups together when packing (their prompt is then shared),
        similar lengths together when padding."""
        return group_sorted(batch, rows) if self.cfg.packing else length_sorted(batch, rows)

    @torch.no_grad()
    def _fill(self, batch: RolloutBatch, name: str, backend: TrainBackend) -> None:
        out = torch.zeros_like(batch.mask)
        # The critic runs on padded rows (its own forward), so it wants rows of similar lengths.
        order = length_sorted(batch, range(batch.size)) if name == "values" else self._order(
            batch, range(batch.size))
        for idx, n in batch.micro_batches(order, self.cfg.micro_batch_size):
            if name == "values":
                out[idx, : n - 1] = self._values(backend.module, batch, (idx, n))
            else:
                out[idx, : n - 1] = self._logprobs(backend, backend.module, batch, (idx, n))[0]
        batch.extras[name] = out * batch.mask

    def _values(self, module: nn.Module, batch: RolloutBatch, rows: Rows) -> Tensor:
        inputs = padded_inputs(batch, rows, self.vision)
        with autocast(self.device, self.cfg.actor.mixed_precision):
            return module(**inputs).float()

    # ------------------------------------------------------------------ the update
    def _training_batch(self, trajectories: list, group_ids: Sequence[int] | None
                        ) -> RolloutBatch:
        """The trajectories as a batch on this worker's device, images included; colocated,
        the engine is put to sleep first (its KV caches freed while training)."""
        if self.engine is not None:
            held = int(getattr(self.engine, "kv_bytes", 0))
            self.engine.sleep()
            self.policy.release_host_memory(held)
        batch = collate(trajectories, self.pad_id, group_ids)
        add_images(batch, trajectories, self.vision, self.model)
        return batch.to(self.device)

    def train(
        self, trajectories: list, kl_coef: float, group_ids: Sequence[int] | None = None
    ) -> dict[str, float]:
        """One RL step on a rollout batch: logprobs, advantages, PPO epochs. Returns metrics.

        `group_ids`: the trajectories' groups as numbered for the whole step
        (`agentrl.types.dense_group_ids`); a data-parallel rank gets its slice. Default: numbered
        here, for a worker that trains on the whole batch.
        """
        cfg, algo = self.cfg, self.cfg.algo
        t0 = time.perf_counter()
        self.shared_tokens = 0
        self._trained = []
        batch = self._training_batch(trajectories, group_ids)
        if cfg.epochs_per_step * cfg.minibatches_per_step > 1 or algo.mismatch_correction != "none":
            self._fill(batch, "old_logp", self.policy)
        elif cfg.save_rollouts:  # one pass: its log-probs, before its optimizer step, are kept
            batch.extras["pass_logp"] = torch.zeros_like(batch.mask)
        if self.ref is not None:
            self._fill(batch, "ref_logp", self.ref)
        elif self.ref_is_base:
            with adapters_off(self.model):
                self._fill(batch, "ref_logp", self.policy)
        if self.critic is not None:
            self._fill(batch, "values", self.critic)
        if self.teacher is not None:
            from trainers.distillation import teacher_logprobs

            batch.extras["teacher_logp"] = teacher_logprobs(
                self.teacher, trajectories, batch.mask.shape[1]).to(self.device) * batch.mask
        kl = None
        if self.has_ref and not algo.kl_as_loss:
            old = batch.extras.get("old_logp", batch.rollout_logp)
            kl = A.kl_estimate(algo.kl_estimator, old, batch.extras["ref_logp"]) * batch.mask
        adv, ret = rl_step.batch_advantages(algo, batch, kl, kl_coef, rank=self.rank)
        batch.extras["advantages"], batch.extras["returns"] = adv, ret
        metrics = self._epochs(batch)
        if cfg.save_rollouts:
            before = batch.extras["old_logp" if "old_logp" in batch.extras else "pass_logp"]
            self._trained = [
                Trained(t.uid, len(t.token_ids), logp, t_adv) for t, logp, t_adv in zip(
                    trajectories, per_token(batch, before), per_token(batch, adv), strict=True)]
        metrics.update(
            shared_prompt_tokens=float(self.shared_tokens),
            advantage_mean=float(A.masked_mean(adv, batch.mask)),
            advantage_std=float(adv[batch.mask.bool()].std()) if batch.mask.sum() > 1 else 0.0,
            time_update=time.perf_counter() - t0,
        )
        if kl is not None:
            metrics["kl"] = float(A.masked_mean(kl, batch.mask))
        if self.teacher is not None:  # the k1 reverse-KL estimate the distillation descends
            student = batch.extras.get("old_logp", batch.rollout_logp)
            metrics["teacher_kl"] = float(A.masked_mean(
                student - batch.extras["teacher_logp"], batch.mask))
        self.version += 1
        self._sync_engine()
        return metrics

    def imitate(self, trajectories: list, epochs: int, batch_size: int) -> dict[str, float]:
        """The supervised warm-up (`--warmup.*`): `epochs` passes over the trajectories (every
        rank gets them all, in the same order) in batches of `batch_size`, one optimizer step
        a batch on the cross-entropy of its action tokens (the loss over the batch's tokens on
        all ranks; this rank computes its share of each batch). The engine samples from the
        new weights afterwards; the weight version stays (the warm-up is no RL step).
        Returns the first and last epochs' mean loss per token, the steps and the time."""
        from agentrl.algorithms.preference import sft_loss

        t0 = time.perf_counter()
        # One group: with packing, a micro-batch encodes the episodes' common prefix (an env's
        # instructions and examples) once (`trainers.batch.pack`).
        batch = self._training_batch(trajectories, [0] * len(trajectories))
        rng = random.Random(derive_seed(self.cfg.seed, "warmup"))
        losses: list[float] = []
        steps = 0
        for _ in range(epochs):
            order = list(range(batch.size))
            rng.shuffle(order)
            total = tokens = 0.0
            for start in range(0, len(order), batch_size):
                if len(order[start : start + batch_size]) < self.world_size:
                    break  # a last batch too small for every rank to have a share
                mine = order[start : start + batch_size][self.rank :: self.world_size]
                sel = torch.as_tensor(mine, device=self.device, dtype=torch.long)
                num_tokens = all_sum([float(batch.mask[sel].sum())])[0]

                def loss_fn(module: nn.Module, rows: Rows, num_tokens: float = num_tokens
                            ) -> tuple[Tensor, dict[str, float]]:
                    logp, _ = self._logprobs(self.policy, module, batch, rows)
                    idx, n = rows
                    loss = sft_loss(logp, batch.mask[idx, : n - 1], num_tokens)
                    return loss, {"loss": float(loss.detach())}

                step_loss = self._gradients(batch, mine, loss_fn, ("loss",))["loss"]
                self.policy.optimizer_step()
                total += step_loss * num_tokens
                tokens += num_tokens
                steps += 1
            losses.append(total / max(tokens, 1.0))
        self._sync_engine()
        return {"loss_first_epoch": losses[0], "loss_last_epoch": losses[-1],
                "optimizer_steps": float(steps), "episodes": float(batch.size),
                "action_tokens": float(batch.mask.sum()),
                "time_warmup": time.perf_counter() - t0}

    def trained(self) -> list[Trained]:
        """What the last `train` computed for each of its trajectories, in order: the trainer's
        log-probs before the update and the advantages (`agentrl.trained_files`); empty
        unless the run saves rollouts. Handed over once."""
        out, self._trained = self._trained, []
        return out

    def _sync_engine(self) -> None:
        if self.engine is not None:
            weights = {} if self.shares_weights else self.named_weights()
            self.engine.update_weights(weights, self.version)

    def _epochs(self, batch: RolloutBatch) -> dict[str, float]:
        cfg = self.cfg
        rng = random.Random(derive_seed(cfg.seed, "minibatches", self.version))
        sums: dict[str, float] = {}
        count = 0
        for _ in range(cfg.epochs_per_step):
            rows = list(range(batch.size))
            rng.shuffle(rows)
            per_mb = batch.size // cfg.minibatches_per_step
            for m in range(cfg.minibatches_per_step):
                stats = self._optimizer_step(batch, rows[m * per_mb : (m + 1) * per_mb])
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        return {k: v / count for k, v in sums.items()}

    def _optimizer_step(self, batch: RolloutBatch, rows: list[int]) -> dict[str, float]:
        """Accumulate gradients over micro-batches of `rows`, then one optimizer step.

        Losses are normalised by the token / sequence counts of the whole minibatch on all
        ranks, so the gradient does not depend on how it is split into micro-batches or ranks.
        """
        sel = torch.as_tensor(rows, device=self.device)
        num_tokens, num_seqs = all_sum([float(batch.mask[sel].sum()), float(len(rows))])
        loss_fn = functools.partial(self._policy_loss, batch, num_tokens, num_seqs)
        totals = self._gradients(batch, rows, loss_fn,
                                 ("loss", "entropy", "clip_ratio", "mismatch"))
        totals.update(self.policy.optimizer_step())
        if self.critic is not None:
            totals["value_loss"] = self._critic_step(batch, rows, num_tokens)
        return totals

    def _gradients(self, batch: RolloutBatch, rows: list[int],
                   loss_fn: Callable[[nn.Module, Rows], tuple[Tensor, dict[str, float]]],
                   keys: tuple[str, ...]) -> dict[str, float]:
        """Accumulate the policy's gradients of `loss_fn` over micro-batches of `rows` (this
        rank's): its metrics `keys`, summed over the micro-batches and all ranks."""
        totals = dict.fromkeys(keys, 0.0)
        for mb in batch.micro_batches(self._order(batch, rows), self.cfg.micro_batch_size):
            m = self.policy.forward_backward(mb, loss_fn)
            for k in totals:
                totals[k] += m[k]
        return dict(zip(totals, all_sum(list(totals.values())), strict=True))

    def _policy_loss(
        self, batch: RolloutBatch, num_tokens: float, num_seqs: float, module: nn.Module,
        rows: Rows,
    ) -> tuple[Tensor, dict[str, float]]:
        logp, ent = self._logprobs(self.policy, module, batch, rows, entropy=True)
        assert ent is not None
        kept = batch.extras.get("pass_logp")
        if kept is not None:  # the update's one pass (see train)
            kept[rows[0], : rows[1] - 1] = logp.detach()
        return rl_step.policy_loss(self.cfg, batch, rows, logp, ent, num_tokens=num_tokens,
                                   num_seqs=num_seqs, with_ref=self.has_ref)

    def _critic_step(self, batch: RolloutBatch, rows: list[int], num_tokens: float) -> float:
        """One critic update on `rows`; as for the policy, the loss is normalised by the global
        token count, so N ranks give the update of one process."""
        assert self.critic is not None

        def loss_fn(module: nn.Module, mb: Rows) -> tuple[Tensor, dict[str, float]]:
            values = self._values(module, batch, mb)
            return rl_step.value_loss(self.cfg, batch, mb, values, num_tokens=num_tokens)

        total = 0.0
        for mb in batch.micro_batches(length_sorted(batch, rows), self.cfg.micro_batch_size):
            total += self.critic.forward_backward(mb, loss_fn)["value_loss"]
        self.critic.optimizer_step()
        return all_sum([total])[0]

    # ------------------------------------------------------------------ sampling (colocated)
    def collect(self, seeds: list[int], step: int) -> list:
        from trainers.episodes import collect_agent_episodes, collect_for_step

        fn = collect_agent_episodes if self.cfg.agent_run else collect_for_step
        return self._sampling(fn, seeds, step)

    def collect_step(self, seeds: list[list[int]], step: int) -> rl_step.Sampled:
        """Colocated: sample the step's batch and keep it here for `train_collected`: prompts
        `seeds[0]`, and with dynamic filtering refills from `seeds[1:]` (one list a round).
        Returns its summary, with the trajectories if the run saves them (the driver writes
        them); the driver advances its prompts by the rounds used."""
        algo, rounds = self.cfg.algo, iter(seeds)
        used = 0

        def more() -> list[Trajectory]:
            nonlocal used
            used += 1
            return self.collect(next(rounds), step)

        batch = more()
        if algo.dynamic_filter != "none":
            batch = rl_step.refill(
                rl_step.informative(batch, algo.dynamic_filter), more,
                criterion=algo.dynamic_filter, want=self.cfg.rollout_batch_size,
                group_size=self.cfg.rollout.n_samples_per_prompt,
                max_rounds=min(rl_step.MAX_REFILLS, len(seeds) - 1))
        image_token = self.vision.image_token_id if self.vision is not None else None
        rl_step.discard_placeholders(batch, image_token)
        self._collected = batch
        return rl_step.summarize(batch, rounds=used, keep=self.cfg.save_rollouts)

    def train_collected(self, kl_coef: float) -> dict[str, float]:
        """Colocated: `train` on the batch `collect_step` kept, its episodes chosen and shaped
        here (`rl_step.training_batch`); the metrics include the rollout's."""
        trajs, group_ids, rollout = rl_step.training_batch(
            self._collected, self.cfg.algo, max_new_tokens=self.cfg.rollout.max_new_tokens)
        self._collected = []
        metrics = self.train(trajs, kl_coef, group_ids)
        metrics.update(rollout)
        return metrics

    def evaluate(self) -> dict[str, Any]:
        from trainers.episodes import evaluate_engine

        return self._sampling(evaluate_engine)

    def _sampling(self, fn: Any, *args: Any) -> Any:
        if self.engine is None:
            raise RuntimeError("this policy worker has no engine (placed mode, or closed after "
                               "the run): sample with the rollout worker or a new Trainer")
        self.engine.wake()
        self.model.eval()  # no dropout while sampling; the engine shares this module
        try:
            return fn(self.engine, self.cfg, self.tokenizer, *args)
        finally:
            self.model.train()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything to resume (full, unsharded tensors; a collective when distributed)."""
        from trainers.checkpoint import rng_state

        state = {**self.policy.state_dict(), "version": self.version, "rng": rng_state()}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from trainers.checkpoint import set_rng_state

        self.policy.load_state_dict(state)
        self.version = int(state["version"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        set_rng_state(state["rng"])
        self._sync_engine()

    def named_weights(self) -> dict[str, Tensor]:
        """Full policy weights (a collective under FSDP2 and ZeRO-3, which may leave all but
        rank 0 empty-handed); with LoRA, the merged weights under the plain model's names (what
        an engine loads), merged from the gathered adapters and base."""
        weights = dict(self.policy.full_weights())
        return merged_weights(self.model, weights) if self.lora else weights

    def broadcast_weights(self, rollout: Any, version: int, backend: str = "nccl") -> None:
        """Placed mode on GPUs: every rank gathers the full weights (a collective when sharded),
        rank 0 broadcasts them into the rollout worker's engines (trainers/weight_sync.py)."""
        weights = iter(self.named_weights().items()) if self.lora else self.policy.full_weights()
        if self.rank != 0:
            for _ in weights:
                pass
            return
        if self._broadcast is None:
            from trainers.weight_sync import BroadcastSync

            tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
            self._broadcast = BroadcastSync(backend, tied)
        self._broadcast.send(rollout, weights, version)

    def export_hf(self, path: str) -> None:
        """RUN_DIR/hf (and with LoRA RUN_DIR/adapter), written by rank 0."""
        from agentrl.models.lora import save_trained

        # Gathering sharded weights is a collective: every rank calls it.
        state = dict(self.policy.full_weights()) if self.cfg.num_policy_workers > 1 else None
        if self.rank == 0:
            save_trained(self.model, self.tokenizer, Path(path), state)

    def node(self) -> str:
        """The Ray node this worker runs on."""
        from trainers.ray_utils import current_node

        return current_node()

    def close(self) -> None:
        """Stop the engine (vLLM's engine process with it) before the actor goes away."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.teacher is not None:
            self.teacher.close()
            self.teacher = None
        if self._broadcast is not None:
            self._broadcast.close()
            self._broadcast = None


def _critic_from(path: str, policy: nn.Module) -> nn.Module:
    """A reward model as the critic's start: it reads the policy's tokens, so the two must
    share a vocabulary."""
    from agentrl.models.value import load_reward_model

    critic = load_reward_model(path).train()
    theirs = critic.config.get_text_config().vocab_size
    ours = getattr(policy, "config").get_text_config().vocab_size  # noqa: B009 (nn.Module)
    if theirs != ours:
        raise ValueError(f"--algo.critic_init {path}: its vocabulary ({theirs} tokens) is not the "
                         f"policy's ({ours}); train the reward model from the policy's model")
    return critic


def _backend(
    name: str, dist: DistSpec, model: nn.Module, optim: OptimizerSpec | None,
    device: torch.device,
) -> TrainBackend:
    backend = create_backend(name, dist)
    backend.setup(model, optim, device)
    return backend
