"""The trainer on a real local Ray cluster: colocated and placed (separate actors, async)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainers.checkpoint import latest_checkpoint, load_checkpoint
from trainers.controller import Trainer, TrainingError

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    import os

    import ray

    from trainers.ray_utils import init_ray

    os.environ["AGENTRL_RAY_TMP"] = str(tmp_path_factory.mktemp("ray"))
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def _metrics(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_placed_async_mode_syncs_weights_to_a_separate_actor(ray_cluster, make_cfg):
    cfg = make_cfg(use_ray=True, steps=4, rollout={"mode": "placed", "async_depth": 1})
    trainer = Trainer(cfg)
    trainer.run()
    rows = _metrics(cfg.run_dir)
    assert [r["step"] for r in rows if "reward" in r] == [1, 2, 3, 4]
    # Rollouts run one batch ahead: after the first step they are sampled by the previous
    # policy version, never more than async_depth behind.
    lags = [r["policy_lag"] for r in rows if "policy_lag" in r]
    assert lags[0] == 0 and max(lags) <= 1 and max(lags) == 1
    # The rollout actor holds the weights of the last update.
    assert trainer.rollout.call("version") == 4
    policy_w = trainer.policy.call("named_weights")
    rollout_engine_w = trainer.rollout.call("named_weights")
    assert all((policy_w[k] == rollout_engine_w[k]).all() for k in policy_w)


def test_colocated_ray_run_and_dead_actor(ray_cluster, make_cfg):
    import ray

    cfg = make_cfg(use_ray=True, steps=2)
    trainer = Trainer(cfg)
    trainer.run()
    assert len([r for r in _metrics(cfg.run_dir) if "reward" in r]) == 2
    good = latest_checkpoint(cfg.run_dir)
    ray.kill(trainer.policy.obj)
    with pytest.raises(TrainingError, match="Ray worker died"):
        trainer._train_step()
    assert latest_checkpoint(cfg.run_dir) == good
    assert load_checkpoint(good)[1]["step"] == 2


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_two_ranks_match_one_process(ray_cluster, make_cfg, recorded_rollouts, tmp_path, backend):
    """Two data-parallel ranks (gloo) training on halves of a batch give the update of one
    process on the whole batch: advantages see all groups, losses use global counts."""
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    import torch

    from agentrl.types import load_jsonl
    from trainers.policy import PolicyWorker

    trajs = load_jsonl(recorded_rollouts)[:32]
    local = PolicyWorker(make_cfg(), with_engine=False)
    local_metrics = local.train(trajs, 0.0)
    want = local.named_weights()

    cfg = make_cfg(use_ray=True, backend=backend, num_policy_workers=2,
                   rollout={"mode": "placed"}, run_dir=str(tmp_path / backend))
    trainer = Trainer(cfg)
    trainer._start_workers()
    metrics = trainer.policy.call("train", trajs, 0.0)
    got = trainer.policy.call("named_weights")
    assert metrics["loss"] == pytest.approx(local_metrics["loss"], rel=1e-4, abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(local_metrics["grad_norm"], rel=1e-3)
    for k in want:
        # Adam turns float-rounding differences of near-zero gradients into up to ~1% of one
        # step (lr 3e-3); anything structurally wrong is off by whole steps.
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)
    # Checkpoint state round-trips, and export writes a loadable model directory.
    state = trainer.policy.call("state_dict")
    assert state["model"].keys() == want.keys()
    if backend == "deepspeed":
        assert len(state["optimizer"]) == 2  # one ZeRO partition per rank
    trainer.policy.call("load_state_dict", state)
    trainer.policy.call("export_hf", str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "config.json").exists()
