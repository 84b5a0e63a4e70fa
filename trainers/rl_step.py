"""The RL step's pure computation, run where the batch is: which episodes train (discards,
DAPO dynamic filtering and refill), reward shaping, the rollout metrics, advantages over the
whole step, a micro-batch's policy and value losses, and the adaptive KL coefficient.

Colocated, the policy worker samples the batch and runs all of it in place
(`PolicyWorker.collect_step`, `train_collected`): the trajectories never travel to the driver
and back, and reach it at all only to be written to the rollouts file. Placed or replaying,
the batch is in the driver already, on its way from the rollout worker (or the file) to the
policy ranks, and the driver runs the selection and shaping there; the ranks compute the
advantages and losses.

An episode in several segments (a chat template that rewrote history, `agentrl.segments`)
is one sample everywhere a sample is counted: in dynamic filtering and refills, reward shaping
(its last segment), the rollout metrics and the advantages (each segment gets the episode's);
its segments are separate sequences only in the batch the losses see.

Tensors: `_B` sequences, `_T` target tokens (the `RolloutBatch` layout, trainers/batch.py).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from agentrl import algorithms as A
from agentrl.anchors import names_states, recurring_states
from agentrl.backends.distributed import gather_objects, pad_cat
from agentrl.segments import by_episode, episode_reward, flatten, template_segments
from agentrl.types import Trajectory, dense_group_ids
from trainers.batch import RolloutBatch
from trainers.config import STEP_ESTIMATORS, AlgoConfig, TrainConfig
from trainers.logprobs import Rows

logger = logging.getLogger(__name__)

MAX_REFILLS = 4
"""Dynamic filtering samples at most this many more rounds of prompts to refill a step."""


# ---------------------------------------------------------------------- which episodes train
def informative(trajs: Sequence[Trajectory], criterion: str) -> list[Trajectory]:
    """DAPO dynamic filtering: drop groups whose rewards carry no signal (and discarded
    episodes, whose rewards mean nothing). Groups as `dense_group_ids` numbers them; an
    episode's score is the sum over its segments."""
    kept = [segs for segs in by_episode(trajs) if not any(t.discard for t in segs)]
    if not kept:
        return []
    keep_B = A.dynamic_filter(
        torch.tensor([episode_reward(segs) for segs in kept]),
        torch.tensor(dense_group_ids([segs[0] for segs in kept])),
        criterion=criterion,
    )
    return flatten([segs for segs, k in zip(kept, keep_B.tolist(), strict=True) if k])


def refill(
    kept: list[Trajectory], more: Callable[[], list[Trajectory]], *, criterion: str, want: int,
    group_size: int, max_rounds: int = MAX_REFILLS,
) -> list[Trajectory]:
    """Sample more (`more()`, one round of prompts) until `want` informative episodes are in
    hand, or give up after `max_rounds` and train on the accepted groups: unlike OpenRLHF,
    accepted groups are never dropped. Whole groups of `group_size` episodes (with all their
    segments), at most `want` episodes; empty when every group was rejected."""
    episodes = by_episode(kept)
    for _ in range(max_rounds):
        if len(episodes) >= want:
            break
        episodes += by_episode(informative(more(), criterion))
    if not episodes:
        return []
    n = max(group_size, (min(len(episodes), want) // group_size) * group_size)
    return flatten(episodes[:n])


def discard_placeholders(trajs: Sequence[Trajectory], image_token: int | None) -> None:
    """A vision-language policy that sampled its image placeholder token wrote something no
    model input can hold (the model puts an image wherever that token is): the episode is
    discarded (kept in the rollouts file, counted, not trained on). An env episode that went
    on after it already failed at its next turn; this catches the last turn's, and proxy
    sessions'. `image_token`: the policy's placeholder (None for a text-only model)."""
    if image_token is None:
        return
    for t in trajs:
        if not t.discard and any(i == image_token and m
                                 for i, m in zip(t.token_ids, t.loss_mask, strict=True)):
            t.discard = True
            t.info["error"] = ("the policy sampled its image placeholder token; the episode "
                               "cannot be scored with images and is not trained on")


@dataclass(frozen=True)
class Sampled:
    """A step's sampled batch as the driver sees it: what it logs and checks, and the
    trajectories where it holds them (None where the colocated worker keeps them and the run
    saves no rollouts)."""

    num_episodes: int
    num_kept: int
    """Episodes not discarded: what the step trains on (an episode in segments counts once)."""
    discard_error: str
    """', most often with: <error> (k episodes)' of the discarded ones, or ''."""
    min_version: int | None
    """The oldest policy version that sampled a kept token (None: no token)."""
    policy_tokens: int
    """Tokens the policy sampled in the kept episodes."""
    rounds: int
    """Rounds of prompts sampled (1 + the refills)."""
    trajectories: list[Trajectory] | None


def summarize(trajs: list[Trajectory], *, rounds: int = 1, keep: bool = True) -> Sampled:
    """The `Sampled` of a batch, with the trajectories themselves if `keep`."""
    kept = [t for t in trajs if not t.discard]
    episodes, kept_episodes = by_episode(trajs), by_episode(kept)
    versions = [v for t in kept for v in t.policy_versions]
    errors = collections.Counter(str(t.info["error"]) for t in trajs
                                 if t.discard and "error" in t.info)
    error = ""
    if errors:
        text, k = errors.most_common(1)[0]
        error = f", most often with: {text[:500]} ({k} episode{'s' if k > 1 else ''})"
    return Sampled(num_episodes=len(episodes), num_kept=len(kept_episodes), discard_error=error,
                   min_version=min(versions) if versions else None,
                   policy_tokens=sum(t.num_policy_tokens for t in kept), rounds=rounds,
                   trajectories=trajs if keep else None)


# ---------------------------------------------------------------------- rewards and metrics
def shape_rewards(
    trajs: list[Trajectory], algo: AlgoConfig, *, max_new_tokens: int
) -> list[Trajectory]:
    """DAPO overlong and ProRL truncation penalties, applied (in place) to the last turn's
    reward (an episode's last segment's) before any baseline; dynamic filtering is not applied
    here (see AlgoConfig.dynamic_filter)."""
    if not algo.overlong_buffer and algo.truncation_penalty is None:
        return trajs
    last = [segs[-1] for segs in by_episode(trajs)]
    _shape_last_turns(last, algo, max_new_tokens=max_new_tokens)
    return trajs


def _shape_last_turns(trajs: list[Trajectory], algo: AlgoConfig, *, max_new_tokens: int) -> None:
    rewards_B = torch.tensor([t.turns[-1].reward if t.turns else 0.0 for t in trajs])
    if algo.overlong_buffer:
        lengths_B = torch.tensor([t.turns[-1].end - t.turns[-1].start for t in trajs])
        rewards_B = A.overlong_penalty(rewards_B, lengths_B, max_new_tokens=max_new_tokens,
                                       buffer=algo.overlong_buffer, factor=algo.overlong_factor)
    if algo.truncation_penalty is not None:
        truncated_B = torch.tensor([t.turns[-1].finish_reason == "length" for t in trajs])
        rewards_B = A.truncation_penalty(rewards_B, truncated_B, algo.truncation_penalty)
    for t, r in zip(trajs, rewards_B.tolist(), strict=True):
        if t.turns:
            t.turns[-1].reward = float(r)


def rollout_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Means over the episodes trained on (rewards as shaped; an episode in segments is one,
    its info its last segment's), and the step's counts: drift (text that changed under the
    policy) apart from the segments a chat template's rewriting started."""
    episodes = by_episode(trajs)
    n = max(len(episodes), 1)
    rewards = [episode_reward(segs) for segs in episodes]
    last = [segs[-1] for segs in episodes]
    mean = sum(rewards) / n
    return {
        "reward": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "response_tokens": sum(t.num_policy_tokens for t in trajs) / n,
        "turns": sum(len(t.turns) for t in trajs) / n,
        "truncated": sum(t.truncated for t in last) / n,
        "segments_per_episode": len(trajs) / n,
        "template_segments": float(template_segments(trajs)),
        "drift_events": float(sum(int(t.info.get("drift_events", 0)) for t in last)),
        "env_errors": float(sum("error" in t.info for t in last)),
    }


def capped_calls(trajs: Sequence[Trajectory], cap: int) -> int:
    """Agent calls (proxy sessions' turns) cut at `cap` tokens: finish reason "length" after
    exactly `cap` sampled tokens, the per-call cap of calls that set no max_tokens (#32)."""
    return sum(t.finish_reason == "length" and t.end - t.start == cap
               for traj in trajs if "session_id" in traj.info for t in traj.turns)


def agent_metrics(trajs: Sequence[Trajectory], *, max_new_tokens: int) -> dict[str, float]:
    """A step's counts over its agent sessions, discarded ones included ({} for env runs, #32
    item 7): agents started, finished, failed (in all and by cause: agents_failed_<cause>) and
    timed out; their segments (a session's trajectories) and the segments drift started (a
    client that changed text; not those a chat template's rewriting started); the
    tokens sampled per agent; the calls cut at the per-call cap."""
    sessions: dict[str, list[Trajectory]] = {}
    for t in trajs:
        if "session_id" in t.info:
            sessions.setdefault(str(t.info["session_id"]), []).append(t)
    if not sessions:
        return {}
    ended = [segs[0].info.get("agent", {"status": "finished"}) for segs in sessions.values()]
    causes = collections.Counter(str(e.get("cause")) for e in ended if e["status"] == "failed")
    segments = [t for segs in sessions.values() for t in segs if t.turns]
    return {
        "agents_started": float(len(sessions)),
        "agents_finished": float(sum(e["status"] == "finished" for e in ended)),
        "agents_failed": float(sum(causes.values())),
        **{f"agents_failed_{cause}": float(n) for cause, n in sorted(causes.items())},
        "agents_timed_out": float(sum(e["status"] == "timed_out" for e in ended)),
        "agent_segments": float(len(segments)),
        "agent_drift": float(sum(bool(t.info.get("drift")) for t in segments)),
        "tokens_per_agent": sum(t.num_policy_tokens for t in segments) / len(sessions),
        "agent_calls_capped": float(capped_calls(trajs, max_new_tokens)),
    }


def training_batch(
    sampled: Sequence[Trajectory], algo: AlgoConfig, *, max_new_tokens: int
) -> tuple[list[Trajectory], list[int], dict[str, float]]:
    """What a step trains on: the undiscarded episodes with their rewards shaped, their groups
    numbered once for the whole step (data-parallel ranks get slices of both), and the rollout
    metrics of the shaped episodes."""
    trajs = shape_rewards([t for t in sampled if not t.discard], algo,
                          max_new_tokens=max_new_tokens)
    metrics = rollout_metrics(trajs)
    metrics.update(agent_metrics(sampled, max_new_tokens=max_new_tokens))
    group_ids = dense_group_ids(trajs)
    if algo.estimator == "gigpo":
        metrics["anchor_states"] = float(check_anchor_states(trajs, group_ids))
    return trajs, group_ids, metrics


_WARNED: set[str] = set()


def check_anchor_states(trajs: Sequence[Trajectory], group_ids: Sequence[int]) -> int:
    """The batch's recurring anchor states (`agentrl.anchors.recurring_states`); the first
    batch whose env names no state (no `info["state_key"]`) and whose observations never recur
    within a group logs, once a process, that gigpo is plain GRPO there."""
    recurring = recurring_states(trajs, group_ids)
    if recurring == 0 and not names_states(trajs) and "no_anchors" not in _WARNED:
        _WARNED.add("no_anchors")
        logger.warning(
            "--algo.estimator gigpo: the env names no state (info['state_key']) and no "
            "observation recurred among a group's episodes past their first turn, so there is "
            "no step-level group and gigpo is plain GRPO (group_norm) here. Give each reset and "
            "step an info['state_key'] naming the env state, or use --algo.estimator "
            "group_norm.")
    return recurring


def next_kl_coef(kl_coef: float, observed_kl: float, algo: AlgoConfig, *, n_steps: int) -> float:
    """The KL coefficient after a step that measured `observed_kl` over `n_steps` episodes:
    adaptive with --algo.kl_target (`agentrl.algorithms.adaptive_kl_coef`), else unchanged."""
    if algo.kl_target is None:
        return kl_coef
    return A.adaptive_kl_coef(kl_coef, observed_kl, target=algo.kl_target,
                              horizon=algo.kl_horizon, n_steps=n_steps)


# ---------------------------------------------------------------------- advantages and losses
def batch_advantages(
    algo: AlgoConfig, batch: RolloutBatch, kl: Tensor | None, kl_coef: float, *, rank: int = 0,
) -> tuple[Tensor, Tensor]:
    """(advantages, returns) of this rank's rows. Every rank gathers all ranks' rewards, masks
    and group ids (small), so group baselines and whitening see every sequence of the step.
    The group ids were numbered once for the whole step, so they are used as they come.
    With a teacher (on-policy distillation) the advantages are
    `agentrl.algorithms.distillation_advantages` of the batch's `teacher_logp` and the
    student's log-probs (the trainer's before the update where it computed them, else the
    sampler's), per token; pure distillation runs no estimator (returns = advantages)."""
    if algo.pure_distillation:
        adv = _distilled(algo, batch, None)
        return adv, adv
    adv, ret = _estimated(algo, batch, kl, kl_coef, rank)
    if algo.teacher is not None:
        adv = _distilled(algo, batch, adv)
    return adv, ret


def _distilled(algo: AlgoConfig, batch: RolloutBatch, env_adv: Tensor | None) -> Tensor:
    student = batch.extras.get("old_logp", batch.rollout_logp)
    return A.distillation_advantages(batch.extras["teacher_logp"], student, batch.mask,
                                     env_advantages_BT=env_adv, teacher_coef=algo.teacher_coef)


def _estimated(
    algo: AlgoConfig, batch: RolloutBatch, kl: Tensor | None, kl_coef: float, rank: int
) -> tuple[Tensor, Tensor]:
    """The estimator's (advantages, returns) of this rank's rows, over every rank's."""
    fields = {"rewards": batch.rewards, "mask": batch.mask, "kl": kl,
              "values": batch.extras.get("values"),
              "state_ids": batch.state_ids if algo.estimator in STEP_ESTIMATORS else None}
    parts = gather_objects(({k: v for k, v in fields.items() if v is not None},
                            batch.group_ids.tolist(), batch.episodes))
    width = max(p[0]["mask"].shape[1] for p in parts)
    full = {k: pad_cat([p[0][k] for p in parts], width) for k in parts[0][0]}
    adv_BT, ret_BT = A.compute_advantages(
        algo.estimator,
        rewards_BT=full["rewards"],
        mask_BT=full["mask"],
        group_ids_B=torch.tensor([g for p in parts for g in p[1]], device=batch.mask.device),
        values_BT=full.get("values"),
        gamma=algo.gamma,
        lam=algo.lam if algo.estimator == "gae" else 1.0,
        kl_BT=full.get("kl"),
        kl_coef=kl_coef if kl is not None else 0.0,
        episode_ids_B=_episode_ids([p[2] for p in parts], batch.mask.device),
        state_ids_BT=full.get("state_ids"),
        step_weight=algo.step_weight,
        step_gamma=algo.step_gamma,
    )
    start = sum(p[0]["mask"].shape[0] for p in parts[:rank])
    rows, cols = batch.mask.shape
    return adv_BT[start : start + rows, :cols], ret_BT[start : start + rows, :cols]


def _episode_ids(keys: list[list[str] | None], device: torch.device) -> Tensor | None:
    """Each row's episode over all ranks' rows (`RolloutBatch.episodes`), numbered; None where
    every row is an episode of its own (nothing to lay end to end)."""
    if any(part is None for part in keys):
        return None
    flat = [k for part in keys for k in part or ()]
    numbers: dict[str, int] = {}
    ids = [numbers.setdefault(k, len(numbers)) for k in flat]
    if len(numbers) == len(flat):
        return None
    return torch.tensor(ids, device=device)


def policy_loss(
    cfg: TrainConfig, batch: RolloutBatch, rows: Rows, logp: Tensor, ent: Tensor, *,
    num_tokens: float, num_seqs: float, with_ref: bool,
) -> tuple[Tensor, dict[str, float]]:
    """The policy loss of `rows` given their log-probs and entropies [m, n-1]: the clipped
    surrogate, the mismatch correction, the entropy bonus and the KL term as configured,
    aggregated with the minibatch's global token / sequence counts (so micro-batching and data
    parallelism do not change the gradient). Metrics are weighted by this micro-batch's share
    of the tokens, so they sum to the minibatch's."""
    algo, (idx, n) = cfg.algo, rows
    mask = batch.rows("mask", idx, n)
    old = batch.rows("old_logp", idx, n) if "old_logp" in batch.extras else logp.detach()
    loss_bt, m = A.policy_loss(
        algo.policy_loss, logp_BT=logp, old_logp_BT=old,
        advantages_BT=batch.rows("advantages", idx, n), mask_BT=mask,
        clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
    )
    rollout = batch.rows("rollout_logp", idx, n)
    if algo.mismatch_correction != "none":
        loss_bt = loss_bt * A.mismatch_weights(
            algo.mismatch_correction, old_logp_BT=old, rollout_logp_BT=rollout, mask_BT=mask
        )
    if algo.entropy_coef > 0:
        loss_bt = loss_bt - algo.entropy_coef * ent
    if algo.kl_as_loss and with_ref:
        ref = batch.rows("ref_logp", idx, n)
        loss_bt = loss_bt + algo.kl_coef * A.kl_estimate(algo.kl_estimator, logp, ref)
    loss = A.aggregate_loss(
        loss_bt, mask, algo.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
        constant=cfg.rollout.max_new_tokens if algo.loss_agg == "constant" else None,
    )
    w = float(mask.sum()) / max(num_tokens, 1.0)
    return loss, {
        "loss": float(loss.detach()),
        "entropy": float(A.masked_mean(ent.detach(), mask)) * w,
        "clip_ratio": float(m["clip_ratio"]) * w,
        "mismatch": float(A.logprob_mismatch(logp.detach(), rollout, mask)) * w,
    }


def value_loss(
    cfg: TrainConfig, batch: RolloutBatch, rows: Rows, values: Tensor, *, num_tokens: float
) -> tuple[Tensor, dict[str, float]]:
    """The clipped value loss of `rows` given the critic's values [m, n-1], normalised by the
    minibatch's global token count."""
    idx, n = rows
    mask = batch.rows("mask", idx, n)
    loss_bt = A.value_loss(values, batch.rows("values", idx, n), batch.rows("returns", idx, n),
                           mask, clip=cfg.algo.value_clip)
    loss = (loss_bt * mask).sum() / max(num_tokens, 1.0)
    return loss, {"value_loss": float(loss.detach())}
