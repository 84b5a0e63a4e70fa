"""A micro-batch's RL loss, assembled from the pure functions of agentrl/algorithms."""

from __future__ import annotations

from torch import Tensor

from agentrl import algorithms as A
from trainers.batch import RolloutBatch
from trainers.config import TrainConfig
from trainers.logprobs import Rows


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
