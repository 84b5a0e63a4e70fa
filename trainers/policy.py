"""The policy worker: model, optimizer, (optional) reference and critic, and one RL update.

It runs in a Ray actor (or in-process with `use_ray=False`). In the colocated mode it also
owns the sampling engine, which shares the very nn.Module being trained: weight sync is a
version bump.
"""

from __future__ import annotations

import copy
import functools
import math
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from agentrl import algorithms as A
from trainers import fused, host_memory
from trainers.batch import RolloutBatch, collate, group_sorted, length_sorted, pack
from trainers.config import TrainConfig

_TRIM_AFTER_KV_BYTES = 256 << 20
"""Give the heap back to the OS after the engine freed at least this much KV cache: less is
not worth the page faults of re-touching the memory the update frees and reallocates."""


class NonFiniteLossError(RuntimeError):
    """The loss of an update was NaN or inf; the update was skipped."""


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
        from agentrl.models import load_model, load_tokenizer

        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.rank = rank
        self.tokenizer = load_tokenizer(cfg.actor.model)
        self.model = load_model(cfg.actor.model, dtype=cfg.actor.dtype)
        on_cpu = next(self.model.parameters()).device.type == "cpu"
        if on_cpu:
            host_memory.keep_freed_memory()  # no page faults for each step's fresh tensors
        self.model.train()
        if cfg.actor.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        # The reference model and the critic are copies of the whole model, taken before it is
        # sharded: neither an FSDP2 nor a ZeRO-3 module can be deep-copied.
        self.ref_model = self._frozen_copy() if cfg.algo.kl_coef > 0 else None
        critic = ValueModel(copy.deepcopy(self.model)) if cfg.algo.estimator == "gae" else None
        # After the copies: the critic's backbone keeps autograd's embedding gradient.
        self.embedding_rows_in_place = cfg.backend == "local" and _tied_embedding_rows_in_place(
            self.model
        )
        if cfg.backend == "local" and on_cpu:
            # One pass for each RMSNorm and SiLU gating, forward and backward (trainers/fused.py).
            for model in (self.model, self.ref_model, critic):
                if model is not None:
                    fused.use_fused_kernels(model)
        self.sharded = cfg.backend == "fsdp2"
        if self.sharded:
            from trainers import fsdp

            assert dist_addr is not None and not with_engine
            fsdp.init_distributed(rank, world_size, dist_addr)
            fsdp.shard_model(self.model)
            if self.ref_model is not None:
                fsdp.shard_model(self.ref_model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.actor.lr,
            betas=cfg.actor.betas,
            weight_decay=cfg.actor.weight_decay,
            # The fused kernel (CPU and CUDA) makes one pass over each tensor instead of
            # foreach's several, with no parameter-sized temporaries: 0.11 s instead of 0.52 s
            # per step for SmolLM2-135M on the 2-core CPU. Sharded/ZeRO parameters keep the
            # default implementation.
            fused=True if cfg.backend == "local" and _fusable(self.model) else None,
        )
        self.ds: Any = None
        if cfg.backend == "deepspeed":
            from trainers import zero

            assert dist_addr is not None and not with_engine
            self.ds = zero.initialize(self.model, self.optimizer, cfg, rank, world_size, dist_addr,
                                      max_grad_norm=cfg.actor.max_grad_norm)
        warmup = cfg.actor.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self.critic, self.critic_opt, self.critic_ds = self._make_critic(
            critic, rank, world_size, dist_addr
        )
        self.version = 0
        self.shared_tokens = 0  # prompt tokens not re-encoded thanks to prefix sharing
        self.engine = None
        if with_engine:
            from agentrl.engine import create_engine

            self.engine = create_engine(self.model, tokenizer=self.tokenizer)

    # ------------------------------------------------------------------ setup helpers
    def _frozen_copy(self) -> torch.nn.Module:
        ref = copy.deepcopy(self.model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def _make_critic(
        self, critic: ValueModel | None, rank: int, world_size: int, dist_addr: str | None
    ) -> tuple[ValueModel | None, torch.optim.Optimizer | None, Any]:
        """The critic, its optimizer and (DeepSpeed) its engine, distributed like the policy.

        FSDP2: sharded per decoder layer like the policy. DeepSpeed: a second engine with the
        policy's ZeRO stage, as DeepSpeed-Chat trains its critic. An all-reduce of a replicated
        critic's gradients would be simpler, but would keep a whole critic and its Adam state on
        every rank: the memory ZeRO is there to save. No gradient clipping, as in one process.
        """
        if critic is None:
            return None, None, None
        if self.sharded:
            from trainers import fsdp

            fsdp.shard_model(critic)
        opt = torch.optim.AdamW(critic.parameters(), lr=self.cfg.algo.critic_lr)
        engine = None
        if self.ds is not None:
            from trainers import zero

            assert dist_addr is not None
            engine = zero.initialize(critic, opt, self.cfg, rank, world_size, dist_addr,
                                     max_grad_norm=0.0)
        return critic, opt, engine

    @property
    def _policy_fn(self) -> torch.nn.Module:
        """What the policy's forward passes call: DeepSpeed's engine (at ZeRO-3 it gathers the
        parameters and counts the micro-steps of gradient accumulation), else the model."""
        return self.ds if self.ds is not None else self.model

    @property
    def _critic_fn(self) -> torch.nn.Module:
        assert self.critic is not None
        return self.critic_ds if self.critic_ds is not None else self.critic

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    # ------------------------------------------------------------------ forward passes
    def _forward(
        self,
        model: torch.nn.Module,
        batch: RolloutBatch,
        idx: Tensor,
        n: int,
        *,
        entropy: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Logprobs (and entropies) of the policy tokens of rows `idx`, as [m, n-1] (0 elsewhere).

        With packing (default) the rows are concatenated into one padding-free sequence, and the
        vocabulary projection, log-softmax and entropy run only at the positions that predict a
        policy token (`logits_to_keep`): prompts and observations are most of a multi-turn
        sequence, and the [tokens, vocab] logits are the largest tensors of the step.
        """
        temp = self.cfg.rollout.temperature
        rows, cols = batch.mask[idx, : n - 1].nonzero(as_tuple=True)
        targets = batch.input_ids[idx[rows], cols + 1]
        if self.cfg.packing:
            packed = pack(batch, idx, n, share_prefixes=self._share_prefixes(model))
            flat = packed.index[rows, cols]
            inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids}
            if packed.attention_mask is not None:
                inputs["attention_mask"] = packed.attention_mask
            self.shared_tokens += packed.shared_tokens
        else:
            ids = batch.input_ids[idx, :n]
            attn = (torch.arange(n)[None, :] < batch.lengths[idx][:, None]).long()
            flat = rows * n + cols
            inputs = {"input_ids": ids, "attention_mask": attn}
        with self._autocast():
            if self.cfg.packing and _accepts_logits_to_keep(model):
                # Packed: one row, so the kept positions are exactly the ones we need. A view
                # (`[0]` would cost a zero-filled [T, V] gradient and a copy in the backward).
                logits = model(**inputs, use_cache=False, logits_to_keep=flat).logits.squeeze(0)
            else:
                logits = model(**inputs, use_cache=False).logits
                logits = logits.reshape(-1, logits.shape[-1])[flat]
        # Log-probs, entropies and losses in float32: the helpers upcast bf16 logits themselves.
        logp = batch.mask.new_zeros(len(idx), n - 1)
        # One pass per token each way where the fused kernel applies (float32 CPU); it may write
        # the logits' gradient over the logits, which nothing here reads again.
        got = fused.logprobs_and_entropy(logits, targets, temp, into_logits=True)
        if got is None and entropy:  # one log-softmax for both
            logp_m, ent_m = A.logprobs_and_entropy_from_logits(logits[None], targets[None], temp)
            got = logp_m[0], ent_m[0]
        elif got is None:
            got = A.logprobs_from_logits(logits[None], targets[None], temp)[0], None
        del logits
        logp[rows, cols] = got[0]
        if not entropy:
            return logp, None
        # The entropy is only a logged metric without an entropy bonus.
        ent = batch.mask.new_zeros(len(idx), n - 1)
        ent[rows, cols] = got[1] if self.cfg.algo.entropy_coef > 0 else got[1].detach()
        return logp, ent

    def _autocast(self) -> Any:
        """bf16 autocast for --actor.mixed_precision bf16 (a no-op context otherwise)."""
        device = next(self.model.parameters()).device.type
        enabled = self.cfg.actor.mixed_precision == "bf16"
        return torch.autocast(device, dtype=torch.bfloat16, enabled=enabled)

    def _share_prefixes(self, model: torch.nn.Module) -> bool:
        """Prefix sharing needs a custom attention mask: sdpa and eager take one, flash
        attention's varlen kernels do not."""
        impl = getattr(getattr(_unwrapped(model), "config", None), "_attn_implementation", None)
        return self.cfg.share_prefixes and impl in ("sdpa", "eager")

    def _order(self, batch: RolloutBatch, rows: Sequence[int]) -> list[int]:
        """Micro-batch order: groups together when packing (their prompt is then shared),
        similar lengths together when padding."""
        return group_sorted(batch, rows) if self.cfg.packing else length_sorted(batch, rows)

    @torch.no_grad()
    def _fill(self, batch: RolloutBatch, name: str, model: torch.nn.Module) -> None:
        out = torch.zeros_like(batch.mask)
        # The critic runs on padded rows (its own forward), so it wants rows of similar lengths.
        rows = range(batch.size)
        order = length_sorted(batch, rows) if name == "values" else self._order(batch, rows)
        for idx, n in batch.micro_batches(order, self.cfg.micro_batch_size):
            if name == "values":
                with self._autocast():
                    values = model(batch.input_ids[idx, :n], batch.lengths[idx])
                out[idx, : n - 1] = values.float()
            else:
                out[idx, : n - 1] = self._forward(model, batch, idx, n)[0]
        batch.extras[name] = out * batch.mask

    # ------------------------------------------------------------------ the update
    def train(self, trajectories: list, kl_coef: float) -> dict[str, float]:
        """One RL step on a rollout batch: logprobs, advantages, PPO epochs. Returns metrics."""
        cfg, algo = self.cfg, self.cfg.algo
        t0 = time.perf_counter()
        self.shared_tokens = 0
        if self.engine is not None:
            held = self.engine.kv_bytes
            self.engine.sleep()  # colocated: free the KV caches while training
            if held >= _TRIM_AFTER_KV_BYTES:
                host_memory.trim()  # the engine thread's heap; see trainers/host_memory.py
        batch = collate(trajectories, self.pad_id)
        needs_old = cfg.epochs_per_step * cfg.minibatches_per_step > 1 or (
            algo.mismatch_correction != "none"
        )
        if needs_old:
            self._fill(batch, "old_logp", self._policy_fn)
        if self.ref_model is not None:
            self._fill(batch, "ref_logp", self.ref_model)
        if self.critic is not None:
            self._fill(batch, "values", self._critic_fn)
        kl = None
        if self.ref_model is not None and not algo.kl_as_loss:
            old = batch.extras.get("old_logp", batch.rollout_logp)
            kl = A.kl_estimate(algo.kl_estimator, old, batch.extras["ref_logp"]) * batch.mask
        groups = [t.group if t.group is not None else t.uid for t in trajectories]
        adv, ret = self._advantages(batch, groups, kl, kl_coef)
        batch.extras["advantages"], batch.extras["returns"] = adv, ret
        metrics = self._epochs(batch)
        metrics.update(
            shared_prompt_tokens=float(self.shared_tokens),
            advantage_mean=float(A.masked_mean(adv, batch.mask)),
            advantage_std=float(adv[batch.mask.bool()].std()) if batch.mask.sum() > 1 else 0.0,
            time_update=time.perf_counter() - t0,
        )
        if kl is not None:
            metrics["kl"] = float(A.masked_mean(kl, batch.mask))
        self.version += 1
        if self.engine is not None:
            # Colocated: the engine samples from self.model itself; this only bumps the version.
            self.engine.update_weights({}, self.version)
        return metrics

    def _advantages(
        self, batch: RolloutBatch, groups: list[str], kl: Tensor | None, kl_coef: float
    ) -> tuple[Tensor, Tensor]:
        """Advantages over the whole rollout batch; with data parallelism every rank gathers all
        ranks' rewards/masks (small) so baselines and whitening see every sequence."""
        from trainers import fsdp

        algo = self.cfg.algo
        fields = {
            "rewards": batch.rewards,
            "mask": batch.mask,
            "kl": kl,
            "values": batch.extras.get("values"),
        }
        parts = fsdp.gather_objects(({k: v for k, v in fields.items() if v is not None}, groups))
        width = max(p[0]["mask"].shape[1] for p in parts)
        full = {k: fsdp.pad_cat([p[0][k] for p in parts], width) for k in parts[0][0]}
        all_groups = [g for p in parts for g in p[1]]
        ids = {g: i for i, g in enumerate(dict.fromkeys(all_groups))}
        adv, ret = A.compute_advantages(
            algo.estimator,
            rewards_BT=full["rewards"],
            mask_BT=full["mask"],
            group_ids_B=torch.tensor([ids[g] for g in all_groups]),
            values_BT=full.get("values"),
            gamma=algo.gamma,
            lam=algo.lam if algo.estimator == "gae" else 1.0,
            kl_BT=full.get("kl"),
            kl_coef=kl_coef if kl is not None else 0.0,
        )
        start = sum(p[0]["mask"].shape[0] for p in parts[: self.rank])
        rows, cols = batch.mask.shape
        return adv[start : start + rows, :cols], ret[start : start + rows, :cols]

    def _epochs(self, batch: RolloutBatch) -> dict[str, float]:
        cfg = self.cfg
        rng = random.Random(cfg.seed * 7919 + self.version)
        sums: dict[str, float] = {}
        count = 0
        for _ in range(cfg.epochs_per_step):
            rows = list(range(batch.size))
            rng.shuffle(rows)
            per_mb = batch.size // cfg.minibatches_per_step
            for m in range(cfg.minibatches_per_step):
                mb_rows = rows[m * per_mb : (m + 1) * per_mb]
                for k, v in self._optimizer_step(batch, mb_rows).items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        return {k: v / count for k, v in sums.items()}

    def _optimizer_step(self, batch: RolloutBatch, rows: list[int]) -> dict[str, float]:
        """Accumulate gradients over micro-batches of `rows`, then one optimizer step.

        Losses are normalised by the token / sequence counts of the whole minibatch, so the
        gradient does not depend on how it is split into micro-batches.
        """
        from trainers import fsdp

        cfg, algo = self.cfg, self.cfg.algo
        sel = torch.as_tensor(rows)
        # Global counts (all micro-batches, all ranks): the gradient is then a sum over ranks,
        # and FSDP's reduce-scatter averages, hence the `world` factor on the loss below.
        num_tokens, num_seqs = fsdp.all_sum([float(batch.mask[sel].sum()), float(len(rows))])
        world = fsdp.world()
        totals = {"loss": 0.0, "entropy": 0.0, "clip_ratio": 0.0, "mismatch": 0.0}
        micro = 0
        if self.ds is None:
            self.optimizer.zero_grad(set_to_none=True)
        for idx, n in batch.micro_batches(self._order(batch, rows), cfg.micro_batch_size):
            mask = batch.rows("mask", idx, n)
            logp, ent = self._forward(self._policy_fn, batch, idx, n, entropy=True)
            assert ent is not None
            old = batch.rows("old_logp", idx, n) if "old_logp" in batch.extras else logp.detach()
            loss_bt, m = A.policy_loss(
                algo.policy_loss,
                logp_BT=logp,
                old_logp_BT=old,
                advantages_BT=batch.rows("advantages", idx, n),
                mask_BT=mask,
                clip_low=algo.clip_low,
                clip_high=algo.clip_high,
                dual_clip=algo.dual_clip,
            )
            rollout = batch.rows("rollout_logp", idx, n)
            if algo.mismatch_correction != "none":
                loss_bt = loss_bt * A.mismatch_weights(
                    algo.mismatch_correction, old_logp_BT=old, rollout_logp_BT=rollout, mask_BT=mask
                )
            if algo.entropy_coef > 0:
                loss_bt = loss_bt - algo.entropy_coef * ent
            if algo.kl_as_loss and self.ref_model is not None:
                ref = batch.rows("ref_logp", idx, n)
                loss_bt = loss_bt + algo.kl_coef * A.kl_estimate(algo.kl_estimator, logp, ref)
            loss = A.aggregate_loss(
                loss_bt,
                mask,
                algo.loss_agg,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                constant=cfg.rollout.max_new_tokens if algo.loss_agg == "constant" else None,
            )
            # Decided together, so that no rank waits in a collective another rank skipped.
            (bad,) = fsdp.all_sum([0.0 if math.isfinite(float(loss.detach())) else 1.0])
            if bad:
                self._drop_gradients(micro)
                raise NonFiniteLossError(
                    f"non-finite policy loss {float(loss.detach())} at version {self.version}"
                )
            if self.ds is not None:
                # DeepSpeed divides by its accumulation steps and averages over ranks; undo both
                # so the global-count normalisation above is the only one.
                self.ds.backward(loss * world * self.ds.gradient_accumulation_steps())
                self.ds.step()  # steps (clip, update, zero) only at the accumulation boundary
            else:
                (loss * world).backward()
            micro += 1
            w = float(mask.sum()) / max(num_tokens, 1.0)
            totals["loss"] += float(loss.detach())
            totals["entropy"] += float(A.masked_mean(ent.detach(), mask)) * w
            totals["clip_ratio"] += float(m["clip_ratio"]) * w
            totals["mismatch"] += float(A.logprob_mismatch(logp.detach(), rollout, mask)) * w
        keys = list(totals)
        totals = dict(zip(keys, fsdp.all_sum([totals[k] for k in keys]), strict=True))
        if self.ds is not None:
            norm = self.ds.get_global_grad_norm()
            totals["grad_norm"] = float(norm) if norm is not None else 0.0
        else:
            if cfg.actor.max_grad_norm > 0:
                # FSDP2's gradients are DTensors, whose norm is only known after a collective.
                clip = torch.nn.utils.clip_grad_norm_ if self.sharded else _clip_grad_norm
                totals["grad_norm"] = fsdp.full_norm(
                    clip(list(self.model.parameters()), cfg.actor.max_grad_norm)
                )
            self.optimizer.step()
            # Gradients are not needed until the next backward; free them for the rollout.
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.critic is not None:
            totals["value_loss"] = self._critic_step(batch, rows, num_tokens)
        return totals

    def _drop_gradients(self, micro_done: int) -> None:
        """Forget a skipped step's partial gradients (and, under DeepSpeed, realign its
        accumulation counter so the next step's boundary falls where ours does)."""
        if self.ds is None:
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.ds.zero_grad()
        # ZeRO-3 has already reduced each micro-batch into gradient partitions: this also
        # resets its micro-step count, so the next backward overwrites them.
        self.ds.optimizer.zero_grad(set_to_none=True)
        gas = self.ds.gradient_accumulation_steps()
        if micro_done % gas:
            self.ds.micro_steps += gas - micro_done % gas

    def _critic_step(self, batch: RolloutBatch, rows: list[int], num_tokens: float) -> float:
        """One critic update on `rows`. As for the policy, the loss is normalised by the global
        token count and scaled by `world` (FSDP2 and DeepSpeed average gradients over ranks), so
        N ranks give the update of one process."""
        from trainers import fsdp

        assert self.critic_opt is not None
        world, engine, critic = fsdp.world(), self.critic_ds, self._critic_fn
        if engine is None:
            self.critic_opt.zero_grad(set_to_none=True)
        total = 0.0
        for idx, n in batch.micro_batches(length_sorted(batch, rows), self.cfg.micro_batch_size):
            mask = batch.rows("mask", idx, n)
            with self._autocast():
                values = critic(batch.input_ids[idx, :n], batch.lengths[idx]).float()
            loss_bt = A.value_loss(
                values,
                batch.rows("values", idx, n),
                batch.rows("returns", idx, n),
                mask,
                clip=self.cfg.algo.value_clip,
            )
            loss = (loss_bt * mask).sum() / max(num_tokens, 1.0)
            if engine is not None:
                # Undo DeepSpeed's division by its accumulation steps, as for the policy.
                engine.backward(loss * world * engine.gradient_accumulation_steps())
                engine.step()  # updates only at the accumulation boundary
            else:
                (loss * world).backward()
            total += float(loss.detach())
        if engine is None:
            self.critic_opt.step()
        return fsdp.all_sum([total])[0]

    # ------------------------------------------------------------------ sampling (colocated)
    def collect(self, seeds: list[int], step: int) -> list:
        from trainers.sampling import collect_agent_episodes, collect_for_step

        fn = collect_agent_episodes if self.cfg.agent else collect_for_step
        self.engine.wake()
        self.model.eval()  # no dropout while sampling; the engine shares this module
        try:
            return fn(self.engine, self.cfg, self.tokenizer, seeds, step)
        finally:
            self.model.train()

    def evaluate(self) -> dict[str, Any]:
        from trainers.sampling import evaluate_engine

        self.engine.wake()
        self.model.eval()
        try:
            return evaluate_engine(self.engine, self.cfg, self.tokenizer)
        finally:
            self.model.train()

    # ------------------------------------------------------------------ state
    def _full_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, engine: Any
    ) -> tuple[dict, Any]:
        """Unsharded state of a trained model and its optimizer (a collective when distributed).
        ZeRO partitions optimizer state by rank: under DeepSpeed every rank's part is kept (same
        world size to resume), as DeepSpeed's own load_state_dict expects."""
        from trainers import fsdp, zero

        if engine is not None:
            return zero.full_state(engine)
        if self.sharded:
            return fsdp.full_state(model, optimizer)
        return model.state_dict(), optimizer.state_dict()

    def _load_full_state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        engine: Any,
        model_sd: dict,
        optim_sd: Any,
    ) -> None:
        from trainers import fsdp, zero

        if engine is not None:
            zero.load_full_state(engine, model_sd, optim_sd)
        elif self.sharded:
            fsdp.load_full_state(model, optimizer, model_sd, optim_sd)
        else:
            model.load_state_dict(model_sd)
            optimizer.load_state_dict(optim_sd)

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume (full, unsharded tensors; a collective when distributed)."""
        model_sd, optim_sd = self._full_state(self.model, self.optimizer, self.ds)
        state = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "rng": _rng_state(),
        }
        if self.critic is not None:
            assert self.critic_opt is not None
            state["critic"], state["critic_opt"] = self._full_state(
                self.critic, self.critic_opt, self.critic_ds
            )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load_full_state(
            self.model, self.optimizer, self.ds, state["model"], state["optimizer"]
        )
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        if self.critic is not None:
            assert self.critic_opt is not None
            self._load_full_state(
                self.critic, self.critic_opt, self.critic_ds, state["critic"], state["critic_opt"]
            )
        _set_rng_state(state["rng"])
        if self.engine is not None:
            self.engine.update_weights({}, self.version)

    def named_weights(self) -> dict[str, Tensor]:
        """Full policy weights on every rank (a collective under FSDP2 and ZeRO-3)."""
        if self.sharded:
            from trainers import fsdp

            return fsdp.full_state(self.model, None)[0]
        if self.ds is not None:
            from trainers import zero

            return zero.full_module_state(self.ds)
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def export_hf(self, path: str) -> None:
        # Under FSDP2 and ZeRO-3 gathering the full weights is a collective: every rank calls it.
        weights = self.named_weights() if self.sharded or self._zero3 else None
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=weights)
            self.tokenizer.save_pretrained(path)

    @property
    def _zero3(self) -> bool:
        from trainers import zero

        return self.ds is not None and zero.partitions_weights(self.ds)


class ValueModel(torch.nn.Module):
    """A critic: the policy's backbone with a scalar head. Values are per target position."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
        self.config = lm.config  # read by DeepSpeed set-up (hidden size)
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def get_decoder(self) -> torch.nn.Module:
        """The decoder, whose layers FSDP2 shards one by one (as for the policy)."""
        return self.backbone

    def forward(self, input_ids: Tensor, lengths: Tensor) -> Tensor:
        n = input_ids.shape[1]
        attn = (torch.arange(n)[None, :] < lengths[:, None]).long()
        hidden = self.backbone(input_ids=input_ids, attention_mask=attn).last_hidden_state
        return self.head(hidden).squeeze(-1)[:, :-1]


def _fusable(model: torch.nn.Module) -> bool:
    """Whether torch's fused AdamW takes these parameters (floating, on CPU or CUDA)."""
    return all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in model.parameters()
    )


def _tied_embedding_rows_in_place(model: torch.nn.Module) -> bool:
    """Add the input embedding's gradient rows in place into the weight's `.grad` if the weight
    is shared with the lm_head, and say whether it is.

    Through autograd, both uses of a tied weight feed one gradient accumulation: the lm_head's
    dense [vocab, hidden] gradient and the embedding's (a zero-filled dense one, or a sparse one
    with `sparse=True`) are summed out of place, ~36 ms and a fresh 113 MB tensor a backward for
    SmolLM2-135M on CPU. Here the lookup reads a detached weight and a hook on its output adds
    the few looked-up rows (`index_add_`) into `.grad`, which then holds the lm_head's gradient
    as autograd produced it. The sum is the same, up to float32 round-off in the order of the
    additions; the padding row gets no gradient, as with `nn.Embedding(padding_idx=...)`. For the
    local backend only, FSDP2 and DeepSpeed owning the gradients.
    """
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embedding) is not torch.nn.Embedding or head is None:
        return False
    if head.weight is not embedding.weight:
        return False
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return False
    # A partial of the module (not a closure over its weight): copies of the model get their own.
    embedding.forward = functools.partial(_embedding_rows_in_place_forward, embedding)
    return True


def _embedding_rows_in_place_forward(embedding: torch.nn.Embedding, input_ids: Tensor) -> Tensor:
    weight = embedding.weight
    out = F.embedding(input_ids, weight.detach(), embedding.padding_idx)
    if torch.is_grad_enabled() and weight.requires_grad:
        out.requires_grad_()
        out.register_hook(functools.partial(_add_embedding_rows, embedding, input_ids))
    return out


def _add_embedding_rows(embedding: torch.nn.Embedding, ids: Tensor, grad: Tensor) -> None:
    weight = embedding.weight
    rows = grad.reshape(-1, grad.shape[-1])
    flat = ids.reshape(-1)
    if embedding.padding_idx is not None:
        keep = flat != embedding.padding_idx
        rows, flat = rows[keep], flat[keep]
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    weight.grad.index_add_(0, flat, rows.to(weight.grad.dtype))


def _clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> Tensor:
    """`torch.nn.utils.clip_grad_norm_` (same formula, NaN and inf handled alike) with two
    shortcuts for float32 CPU gradients (SmolLM2-135M's, cold caches: 60 -> 29 ms for the norm):

    - the norm comes from one dot product per tensor (a sum of squares: equal to torch's
      per-tensor `vector_norm`s up to float32 round-off), which reads the gradients ~2x
      faster than `vector_norm` on this CPU;
    - there is no scaling when it would scale by exactly 1.0, i.e. when `max_norm / (norm +
      1e-6) >= 1` (torch's formula): torch multiplies every gradient anyway to spare
      accelerators a host sync, which we pay for the logged norm regardless (~30 ms a step).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if grads and all(g.dtype is torch.float32 and g.device.type == "cpu" for g in grads):
        squares = [torch.dot(g.reshape(-1), g.reshape(-1)) for g in grads]
        norm = torch.stack(squares).sum().sqrt()
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    if not bool(max_norm / (norm + 1e-6) >= 1.0):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """transformers causal LMs compute logits only at `logits_to_keep` positions (any logit
    soft-capping included); FSDP wrappers keep the signature, DeepSpeed's engine passes it on."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(_unwrapped(model).forward).parameters
    except (TypeError, ValueError):
        return False


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DeepSpeed engine (which has its own forward signature and config)."""
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine):
        return model.module
    return model


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
