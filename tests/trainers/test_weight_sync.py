"""How weights reach the rollout engine: the plan for each kind of run (pure), and the broadcast
sync between a policy worker and a rollout worker with the real vLLM (gloo standing in for NCCL,
which needs GPUs: tests/gpu/test_vllm_gpu.py runs NCCL)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.trainers._logprobs import sampled_logprob_gap
from trainers.weight_sync import engine_weight_transfer, weight_sync_plan

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture
def vllm_installed(monkeypatch):
    """Configs naming the vllm engine validate where vLLM is not installed too."""
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "vllm" else find(name, *a))


@pytest.mark.parametrize(
    ("changes", "gpus", "plan"),
    [
        # colocated: the policy actor's own engine, CPU or GPU
        ({}, 0, "in_process"),
        ({"rollout": {"engine": "vllm"}, "actor": {"device": "cuda"}, "use_ray": True}, 1,
         "in_process"),
        # placed on CPUs: byte buckets through Ray
        ({"rollout": {"engine": "vllm", "mode": "placed"}, "use_ray": True}, 0, "rpc"),
        ({"rollout": {"mode": "placed"}, "actor": {"device": "cpu"}, "use_ray": True}, 4, "rpc"),
        # placed vLLM on GPUs under Ray: NCCL from trainer rank 0 into the engine's workers
        ({"rollout": {"engine": "vllm", "mode": "placed"}, "actor": {"device": "cuda"},
          "use_ray": True}, 2, "nccl"),
        ({"rollout": {"engine": "vllm", "mode": "placed"}, "use_ray": True}, 2, "nccl"),  # auto
        ({"rollout": {"engine": "vllm", "mode": "placed", "tensor_parallel_size": 2},
          "backend": "fsdp2", "num_policy_workers": 2, "use_ray": True}, 8, "nccl"),
        # ...but not the transformers engine (no broadcast receiver), nor one process (one GPU)
        ({"rollout": {"mode": "placed"}, "actor": {"device": "cuda"}, "use_ray": True}, 2, "rpc"),
        ({"rollout": {"engine": "vllm", "mode": "placed"}, "actor": {"device": "cuda"}}, 2, "rpc"),
        # replaying recorded rollouts, placed: nothing samples
        ({"rollout": {"mode": "placed"}, "replay": "r.jsonl"}, 0, "none"),
    ],
)
def test_the_plan_for_each_kind_of_run(make_cfg, vllm_installed, changes, gpus, plan):
    cfg = make_cfg(**changes)
    assert weight_sync_plan(cfg, gpus) == plan
    assert engine_weight_transfer(plan) == ("nccl" if plan == "nccl" else None)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_a_broadcast_sync_makes_the_rollout_engine_sample_the_trained_weights(
    make_cfg, tiny_vllm_dir
):
    """The placed-mode path of a GPU run (PolicyWorker.broadcast_weights into
    RolloutWorker.weight_transfer), in one process over gloo."""
    from trainers.policy import PolicyWorker
    from trainers.sampling import RolloutWorker

    cfg = make_cfg(actor={"model": tiny_vllm_dir, "lr": 1e-2},
                   rollout={"engine": "vllm", "mode": "placed", "prompts_per_step": 4},
                   micro_batch_size=16)
    policy = PolicyWorker(cfg, with_engine=False)
    rollout = RolloutWorker(cfg, weight_transfer="gloo")
    try:
        initial = {k: v.clone() for k, v in policy.model.state_dict().items()}
        metrics = policy.train(rollout.collect(list(range(4)), 0), 0.0)
        assert metrics["grad_norm"] > 0
        policy.broadcast_weights(rollout, 1, 2, "gloo")
        assert rollout.version() == 1
        policy.broadcast_weights(rollout, 2, 2, "gloo")  # over the group the first one opened
        assert rollout.version() == 2
        after = rollout.collect(list(range(4, 8)), 1)
        assert all(t.policy_versions == [2] * len(t.turns) for t in after)
        gap, tokens = sampled_logprob_gap(policy, after)
        assert tokens > 20 and gap < 1e-4
        policy.model.load_state_dict(initial)
        assert sampled_logprob_gap(policy, after)[0] > 1e-3  # the sync was not a no-op
    finally:
        policy.close()
        rollout.close()
