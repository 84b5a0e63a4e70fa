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
import time
from typing import Any

import numpy as np
import torch
from torch import Tensor

from agentrl import algorithms as A
from trainers.batch import RolloutBatch, collate, length_sorted, packed_inputs
from trainers.config import TrainConfig


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
        self.model.train()
        if cfg.actor.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.sharded = cfg.backend == "fsdp2"
        if self.sharded:
            from trainers import fsdp

            assert dist_addr is not None and not with_engine
            fsdp.init_distributed(rank, world_size, dist_addr)
            fsdp.shard_model(self.model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.actor.lr,
            betas=cfg.actor.betas,
            weight_decay=cfg.actor.weight_decay,
        )
        self.ds: Any = None
        if cfg.backend == "deepspeed":
            from trainers import zero

            assert dist_addr is not None and not with_engine
            self.ds = zero.initialize(self.model, self.optimizer, cfg, rank, world_size, dist_addr)
        warmup = cfg.actor.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self.ref_model = self._frozen_copy() if cfg.algo.kl_coef > 0 else None
        self.critic, self.critic_opt = (
            self._make_critic() if cfg.algo.estimator == "gae" else (None, None)
        )
        self.version = 0
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

    def _make_critic(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        critic = ValueModel(copy.deepcopy(self.model))
        opt = torch.optim.AdamW(critic.parameters(), lr=self.cfg.algo.critic_lr)
        return critic, opt

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
        if self.cfg.packing:
            ids, pos, lengths = packed_inputs(batch, idx)
            offsets = torch.tensor([0, *lengths[:-1]]).cumsum(0)
            flat = offsets[rows] + cols
            inputs = {"input_ids": ids, "position_ids": pos}
        else:
            ids = batch.input_ids[idx, :n]
            attn = (torch.arange(n)[None, :] < batch.lengths[idx][:, None]).long()
            flat = rows * n + cols
            inputs = {"input_ids": ids, "attention_mask": attn}
        targets = ids.reshape(-1)[flat + 1]
        if _accepts_logits_to_keep(model) and ids.shape[0] == 1:
            # Packed: one row, so the kept positions are exactly the ones we need.
            logits = model(**inputs, use_cache=False, logits_to_keep=flat).logits[0]
        else:
            logits = model(**inputs, use_cache=False).logits
            logits = logits.reshape(-1, logits.shape[-1])[flat]
        logp = batch.mask.new_zeros(len(idx), n - 1)
        logp[rows, cols] = A.logprobs_from_logits(logits[None], targets[None], temperature=temp)[0]
        ent = None
        if entropy:
            with torch.set_grad_enabled(self.cfg.algo.entropy_coef > 0 and torch.is_grad_enabled()):
                ent = batch.mask.new_zeros(len(idx), n - 1)
                ent[rows, cols] = A.entropy_from_logits(logits[None], temperature=temp)[0]
        return logp, ent

    @torch.no_grad()
    def _fill(self, batch: RolloutBatch, name: str, model: torch.nn.Module) -> None:
        out = torch.zeros_like(batch.mask)
        order = length_sorted(batch, range(batch.size))
        for idx, n in batch.micro_batches(order, self.cfg.micro_batch_size):
            if name == "values":
                out[idx, : n - 1] = model(batch.input_ids[idx, :n], batch.lengths[idx])
            else:
                out[idx, : n - 1] = self._forward(model, batch, idx, n)[0]
        batch.extras[name] = out * batch.mask

    # ------------------------------------------------------------------ the update
    def train(self, trajectories: list, kl_coef: float) -> dict[str, float]:
        """One RL step on a rollout batch: logprobs, advantages, PPO epochs. Returns metrics."""
        cfg, algo = self.cfg, self.cfg.algo
        t0 = time.perf_counter()
        if self.engine is not None:
            self.engine.sleep()  # colocated: free the KV caches while training
            _trim_host_memory()
        batch = collate(trajectories, self.pad_id)
        needs_old = cfg.epochs_per_step * cfg.minibatches_per_step > 1 or (
            algo.mismatch_correction != "none"
        )
        if needs_old:
            self._fill(batch, "old_logp", self.model)
        if self.ref_model is not None:
            self._fill(batch, "ref_logp", self.ref_model)
        if self.critic is not None:
            self._fill(batch, "values", self.critic)
        kl = None
        if self.ref_model is not None and not algo.kl_as_loss:
            old = batch.extras.get("old_logp", batch.rollout_logp)
            kl = A.kl_estimate(algo.kl_estimator, old, batch.extras["ref_logp"]) * batch.mask
        groups = [t.group if t.group is not None else t.uid for t in trajectories]
        adv, ret = self._advantages(batch, groups, kl, kl_coef)
        batch.extras["advantages"], batch.extras["returns"] = adv, ret
        metrics = self._epochs(batch)
        metrics.update(
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
        for idx, n in batch.micro_batches(length_sorted(batch, rows), cfg.micro_batch_size):
            mask = batch.rows("mask", idx, n)
            logp, ent = self._forward(self.model, batch, idx, n, entropy=True)
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
                totals["grad_norm"] = fsdp.full_norm(
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.actor.max_grad_norm)
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
        gas = self.ds.gradient_accumulation_steps()
        if micro_done % gas:
            self.ds.micro_steps += gas - micro_done % gas

    def _critic_step(self, batch: RolloutBatch, rows: list[int], num_tokens: float) -> float:
        assert self.critic is not None and self.critic_opt is not None
        self.critic_opt.zero_grad(set_to_none=True)
        total = 0.0
        for idx, n in batch.micro_batches(length_sorted(batch, rows), self.cfg.micro_batch_size):
            mask = batch.rows("mask", idx, n)
            values = self.critic(batch.input_ids[idx, :n], batch.lengths[idx])
            loss_bt = A.value_loss(
                values,
                batch.rows("values", idx, n),
                batch.rows("returns", idx, n),
                mask,
                clip=self.cfg.algo.value_clip,
            )
            loss = (loss_bt * mask).sum() / max(num_tokens, 1.0)
            loss.backward()
            total += float(loss.detach())
        self.critic_opt.step()
        return total

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
    def _model_and_optim_state(self) -> tuple[dict, Any]:
        from trainers import fsdp

        if self.sharded:
            return fsdp.full_state(self.model, self.optimizer)
        if self.ds is not None:
            # ZeRO partitions optimizer state by rank: keep every rank's part (same world size
            # to resume), as DeepSpeed's own load_state_dict expects.
            return self.model.state_dict(), fsdp.gather_objects(self.ds.optimizer.state_dict())
        return self.model.state_dict(), self.optimizer.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume (full, unsharded tensors; a collective under FSDP2)."""
        model_sd, optim_sd = self._model_and_optim_state()
        state = {
            "model": model_sd,
            "optimizer": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "rng": _rng_state(),
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_opt"] = self.critic_opt.state_dict()  # type: ignore[union-attr]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.sharded:
            from trainers import fsdp

            fsdp.load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        elif self.ds is not None:
            self.model.load_state_dict(state["model"])
            self.ds.optimizer.load_state_dict(state["optimizer"], load_from_fp32_weights=False)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state["version"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])  # type: ignore[union-attr]
        _set_rng_state(state["rng"])
        if self.engine is not None:
            self.engine.update_weights({}, self.version)

    def named_weights(self) -> dict[str, Tensor]:
        if self.sharded:
            from trainers import fsdp

            return fsdp.full_state(self.model, None)[0]
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def export_hf(self, path: str) -> None:
        # Under FSDP2 gathering the full weights is a collective: every rank calls it.
        weights = self.named_weights() if self.sharded else None
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=weights)
            self.tokenizer.save_pretrained(path)


class ValueModel(torch.nn.Module):
    """A critic: the policy's backbone with a scalar head. Values are per target position."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
        self.head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, lengths: Tensor) -> Tensor:
        n = input_ids.shape[1]
        attn = (torch.arange(n)[None, :] < lengths[:, None]).long()
        hidden = self.backbone(input_ids=input_ids, attention_mask=attn).last_hidden_state
        return self.head(hidden).squeeze(-1)[:, :-1]


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """transformers causal LMs compute logits only at `logits_to_keep` positions (any logit
    soft-capping included); FSDP wrappers keep the signature."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _trim_host_memory() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise): on CPU the KV cache
    freed by `engine.sleep()` would still count against the training step's peak memory."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, looked up once (find_library runs ldconfig), or None elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


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
