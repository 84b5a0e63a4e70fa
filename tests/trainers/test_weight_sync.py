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
        # several engines: one group spans every engine's workers
        ({"rollout": {"engine": "vllm", "mode": "placed", "num_engines": 3}, "use_ray": True}, 4,
         "nccl"),
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
def test_a_broadcast_sync_makes_every_rollout_engine_sample_the_trained_weights(
    make_cfg, tiny_vllm_dir
):
    """The placed-mode path of a GPU run (PolicyWorker.broadcast_weights into
    RolloutWorker.weight_transfer), in one process over gloo, with two engines behind the
    router: one group spans both engines' workers, each tensor is sent once."""
    from trainers.policy import PolicyWorker
    from trainers.rollout_worker import RolloutWorker

    cfg = make_cfg(actor={"model": tiny_vllm_dir, "lr": 1e-2},
                   rollout={"engine": "vllm", "mode": "placed", "prompts_per_step": 4,
                            "num_engines": 2},
                   micro_batch_size=16)
    policy = PolicyWorker(cfg, with_engine=False)
    rollout = RolloutWorker(cfg, weight_transfer="gloo")
    try:
        assert rollout.weight_group() == (0, 3)  # rank 0 and one worker per engine
        initial = {k: v.clone() for k, v in policy.model.state_dict().items()}
        metrics = policy.train(rollout.collect(list(range(4)), 0), 0.0)
        assert metrics["grad_norm"] > 0
        policy.broadcast_weights(rollout, 1, "gloo")
        assert rollout.version() == 1
        sent = policy._broadcast.sender.group
        policy.broadcast_weights(rollout, 2, "gloo")  # over the group the first one opened
        assert rollout.version() == 2 and policy._broadcast.sender.group is sent
        assert [e.version for e in rollout.engine.engines] == [2, 2]
        before = rollout.engine_stats()["routed"]
        after = rollout.collect(list(range(4, 8)), 1)
        assert all(t.policy_versions == [2] * len(t.turns) for t in after)
        routed = [b - a for a, b in zip(before, rollout.engine_stats()["routed"], strict=True)]
        assert min(routed) > 0  # both engines sampled...
        gap, tokens = sampled_logprob_gap(policy, after)
        assert tokens > 20 and gap < 1e-4  # ...the trained weights
        policy.model.load_state_dict(initial)
        assert sampled_logprob_gap(policy, after)[0] > 1e-3  # the sync was not a no-op
    finally:
        policy.close()
        rollout.close()


class _Receiver:
    """An engine's end of the broadcast protocol that records each step (no group)."""

    def __init__(self) -> None:
        self.version, self.max_context, self.steps = 0, 100, []

    def init_weight_transfer(self, info):
        self.steps.append(("init", info["rank_offset"], info["world_size"]))

    def start_weight_transfer(self):
        self.steps.append(("start",))

    def receive_weights(self, info):
        self.steps.append(("receive",))

    def finish_weight_transfer(self, version):
        self.steps.append(("finish", version))
        self.version = version

    def cancel_weight_transfer(self):
        self.steps.append(("cancel",))


class _RemoteReceiver(_Receiver):
    """Stands in for a RemoteEngine (an EngineWorker actor) in the rollout worker."""

    def __init__(self, actor=None, *args) -> None:
        super().__init__()

    def weight_transfer(self, step, *args):
        from agentrl.engine.weight_broadcast import receive_step

        receive_step(self, step, *args)


def test_a_restarted_engine_joins_the_next_weight_group_before_it_samples(make_cfg,
                                                                          monkeypatch):
    """Under a broadcast sync the rollout worker never holds the weights, so an engine restarted
    after a crash waits outside the router: the group's epoch changes (the trainer then opens a
    new group, the new engine in it) and the engine is readmitted once an update reached it."""
    import threading
    import types

    import ray

    from agentrl.engine.router import EngineGone, EngineRouter
    from trainers import rollout_worker

    monkeypatch.setattr(rollout_worker, "RemoteEngine", _RemoteReceiver)
    monkeypatch.setattr(ray, "remote", lambda cls: types.SimpleNamespace(
        options=lambda **kw: types.SimpleNamespace(remote=lambda *a: "actor")))
    worker = rollout_worker.RolloutWorker.__new__(rollout_worker.RolloutWorker)
    worker.cfg = make_cfg(rollout={"engine": "vllm", "mode": "placed", "num_engines": 2})
    worker._transfer, worker._extra_options = "gloo", [{}]
    worker._group_lock, worker._group_epoch = threading.Lock(), 0
    worker._fan, worker._members, worker._joining = None, [], {}
    local, remote = _Receiver(), _RemoteReceiver()
    worker.engine = router = EngineRouter([local, remote], restart=worker._restart_engine)

    def update(version: int) -> None:
        _, world = worker.weight_group()
        worker.weight_transfer("init_weight_transfer", {"rank_offset": 1, "world_size": world})
        for step, *args in (("start_weight_transfer",), ("receive_weights", {}),
                            ("finish_weight_transfer", version)):
            worker.weight_transfer(step, *args)

    assert worker.weight_group() == (0, 3)
    update(1)
    assert local.steps[0] == ("init", 1, 3) and remote.steps[0] == ("init", 2, 3)
    assert local.version == remote.version == 1
    router._lost(1, remote, EngineGone("killed"))
    for _ in range(200):
        if worker._joining:
            break
        threading.Event().wait(0.01)
    [(i, fresh)] = worker._joining.items()
    assert i == 1 and not router.alive[1] and router.engines[1] is remote
    epoch, world = worker.weight_group()
    assert epoch > 0 and world == 3  # the live engine and the one joining
    update(2)
    assert fresh.steps == [("init", 2, 3), ("start",), ("receive",), ("finish", 2)]
    assert router.engines[1] is fresh and router.alive == [True, True] and router.restarts == 1
    assert not worker._joining and router.version == 2
