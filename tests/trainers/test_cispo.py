"""`--algo.policy_loss cispo` (MiniMax-M1's clipped IS-weight policy optimization) learns the
digits task end to end, as the other losses do in test_trainer.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainers._grads import catch_gradient
from trainers.controller import Trainer


@pytest.mark.slow
def test_cispo_learns_the_digits_task(make_cfg):
    # Two epochs on each batch: the second is off-policy, so the clipped importance weight
    # (not the on-policy ratio 1 of a single pass, where CISPO's gradient is REINFORCE's) takes
    # part. The clip bounds are CISPO's own defaults: none below, a cap of 4.
    cfg = make_cfg(algo={"policy_loss": "cispo"}, epochs_per_step=2, steps=25)
    assert (cfg.algo.clip_low, cfg.algo.clip_high) == (None, None)
    summary = Trainer(cfg).run()
    rows = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").open()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert len(rewards) == 25 and summary["steps"] == 25
    assert last > first + 0.15, f"cispo: reward {first:.3f} -> {last:.3f}"


# The gradient is caught by wrapping optimizer.step, which torch's scheduler notices.
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("correction", ["none", "tis"])
def test_on_policy_cispo_takes_ppos_step_with_the_mismatch_correction(
    make_cfg, recorded_rollouts, correction
):
    """At the on-policy ratio 1 (one pass over the batch) CISPO's gradient is REINFORCE's, and
    so is PPO's: the two losses give the trainer the same gradient, sampler/trainer mismatch
    weights included, though their loss values differ (-A logp against -A)."""
    from agentrl.trajectory_files import load_jsonl
    from trainers.policy import PolicyWorker

    trajs = load_jsonl(recorded_rollouts)[:16]
    # A sampler that disagrees with the trainer, so the mismatch weights are far from 1.
    gen = torch.Generator().manual_seed(0)
    for traj in trajs:
        noise = 0.5 * torch.randn(len(traj.logprobs), generator=gen)
        traj.logprobs = [lp + float(e) for lp, e in zip(traj.logprobs, noise, strict=True)]
    grads, losses = {}, {}
    for loss in ("ppo", "cispo"):
        cfg = make_cfg(micro_batch_size=8, algo={"policy_loss": loss,
                                                  "mismatch_correction": correction})
        worker = PolicyWorker(cfg, with_engine=False)
        catch_gradient(worker, grads, loss)
        losses[loss] = worker.train(trajs, 0.0)["loss"]
    assert grads["ppo"].norm() > 0 and losses["cispo"] != pytest.approx(losses["ppo"])
    torch.testing.assert_close(grads["cispo"], grads["ppo"], rtol=1e-5, atol=1e-8)
