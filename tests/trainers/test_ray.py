"""The trainer on a real local Ray cluster: colocated and placed (separate actors, async)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainers.checkpoint import latest_checkpoint, load_checkpoint
from trainers.controller import Trainer
from trainers.workers import TrainingError

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _metrics(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_placed_async_mode_syncs_weights_to_a_separate_actor(ray_cluster, make_cfg):
    # 16 epochs a step make an update (~0.4 s) outlast the next batch's first tokens: with the
    # default 1 (~0.06 s against a ~0.2 s collect) an update could land before the batch ahead
    # sampled anything, so that (partial rollout) it was all the new version: lag 0 at every
    # step, as one CI run saw.
    cfg = make_cfg(use_ray=True, steps=4, epochs_per_step=16,
                   rollout={"mode": "placed", "async_depth": 1})
    trainer = Trainer(cfg)
    trainer.run()
    rows = _metrics(cfg.run_dir)
    assert [r["step"] for r in rows if "reward" in r] == [1, 2, 3, 4]
    # Rollouts run one batch ahead: after the first step they are sampled by the previous
    # policy version, never more than async_depth behind.
    lags = [r["policy_lag"] for r in rows if "policy_lag" in r]
    assert lags[0] == 0 and max(lags) <= 1 and max(lags) == 1
    # Partial rollout: a batch still being sampled when an update lands goes on with the new
    # weights, so a turn may hold two versions; never one older than the lag allows.
    from agentrl.trajectory_files import load_jsonl

    for k in range(1, 5):
        for t in load_jsonl(Path(cfg.run_dir) / "rollouts" / f"step_{k:06d}.jsonl"):
            for turn in t.turns:
                assert turn.versions == sorted(set(turn.versions))
                assert max(0, k - 2) <= min(turn.versions) <= max(turn.versions) <= k - 1
    # The rollout actor holds the weights of the last update.
    assert trainer.rollout.call("version") == 4
    policy_w = trainer.policy.call("named_weights")
    rollout_engine_w = trainer.rollout.call("named_weights")
    assert all((policy_w[k] == rollout_engine_w[k]).all() for k in policy_w)


def test_a_killed_engine_actor_is_restarted_and_the_run_goes_on(ray_cluster, make_cfg):
    """#16 items 1-2: --rollout.num_engines 2 puts an EngineWorker actor beside the rollout
    worker's engine, and episodes spread over both; killing it mid-run costs no trajectory:
    its calls go to the live engine, it is restarted with the current weights, and the run
    finishes with every step, later ones sampled on both engines again, every turn of step k
    with version k - 1 (both engines always hold the same weights)."""
    import threading
    import time

    import ray

    from agentrl.trajectory_files import load_jsonl

    cfg = make_cfg(use_ray=True, steps=6, rollout={"mode": "placed", "num_engines": 2})
    trainer = Trainer(cfg)
    seen: dict = {}

    def kill_after_two_steps() -> None:
        metrics = Path(cfg.run_dir) / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if metrics.exists() and metrics.read_text().count('"reward"') >= 2:
                break
            time.sleep(0.1)
        seen["before"] = trainer.rollout.call("engine_stats")["routed"]
        ray.kill(trainer.engine_actors[0])

    killer = threading.Thread(target=kill_after_two_steps)
    trainer.on_started.append(killer.start)
    trainer.run()
    killer.join()
    rows = _metrics(cfg.run_dir)
    assert [r["step"] for r in rows if "reward" in r] == [1, 2, 3, 4, 5, 6]
    stats = trainer.rollout.call("engine_stats")
    assert stats["restarts"] == 1 and all(stats["alive"]), stats
    assert min(seen["before"]) > 0  # both engines sampled before the kill
    assert stats["routed"][1] > seen["before"][1] + stats["retried"]  # and the new one after
    for step in range(1, 7):
        trajs = load_jsonl(Path(cfg.run_dir) / "rollouts" / f"step_{step:06d}.jsonl")
        assert len(trajs) == cfg.rollout_batch_size and not any(t.discard for t in trajs)
        assert {v for t in trajs for v in t.policy_versions} == {step - 1}


def test_colocated_ray_run_and_dead_actor(ray_cluster, make_cfg):
    import ray

    cfg = make_cfg(use_ray=True, steps=2)
    trainer = Trainer(cfg)
    trainer.run()
    assert len([r for r in _metrics(cfg.run_dir) if "reward" in r]) == 2
    good = latest_checkpoint(cfg.run_dir)
    ray.kill(trainer.policy.obj)
    _wait_until_dead(trainer.policy.obj)  # kill is asynchronous
    with pytest.raises(TrainingError, match="Ray worker died"):
        trainer._train_step()
    assert latest_checkpoint(cfg.run_dir) == good
    assert load_checkpoint(good)[1]["step"] == 2


def _wait_until_dead(actor, timeout_s: float = 60.0) -> None:
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the killed actor is still alive")


PPO = {"estimator": "gae", "critic_lr": 3e-3}
DATA_PARALLEL = {
    "fsdp2": {"backend": "fsdp2"},
    "zero2": {"backend": "deepspeed", "zero_stage": 2},
    "fsdp2-ppo": {"backend": "fsdp2", "algo": PPO},
    "zero3-ppo": {"backend": "deepspeed", "zero_stage": 3, "algo": PPO},
}


@pytest.mark.parametrize("case", list(DATA_PARALLEL))
def test_two_ranks_match_one_process(ray_cluster, make_cfg, recorded_rollouts, tmp_path, case):
    """Two data-parallel ranks (gloo) training on halves of a batch give the updates of one
    process on the whole batch: advantages see all groups, losses use global counts, the critic
    (ppo cases) trains like the policy. Two micro-batches per rank, so gradient accumulation
    (which ZeRO-3 only gets right through its engine) is exercised; two updates, so the second
    uses the values of a trained critic."""
    options = dict(DATA_PARALLEL[case])
    if options["backend"] == "deepspeed":
        pytest.importorskip("deepspeed")
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.trajectory_files import load_jsonl
    from agentrl.types import dense_group_ids
    from trainers.policy import PolicyWorker

    trajs = load_jsonl(recorded_rollouts)
    batches = [trajs[:32], trajs[32:64]]
    algo = options.pop("algo", {})
    cfg = make_cfg(use_ray=True, num_policy_workers=2, micro_batch_size=8, algo=algo,
                   rollout={"mode": "placed"}, run_dir=str(tmp_path / case), **options)
    trainer = Trainer(cfg)
    trainer._start_workers()  # the ranks start up while the one-process reference trains
    local = PolicyWorker(make_cfg(micro_batch_size=8, algo=algo), with_engine=False)
    local_metrics = [local.train(b, 0.0) for b in batches]
    want = local.named_weights()

    # The controller numbers the step's groups once; each rank gets its slice of the ids.
    metrics = [trainer.policy.call("train", batches[0], 0.0, dense_group_ids(batches[0]))]
    first = trainer.policy.call("state_dict")
    metrics.append(trainer.policy.call("train", batches[1], 0.0, dense_group_ids(batches[1])))
    got = trainer.policy.call("named_weights")
    for m, lm in zip(metrics, local_metrics, strict=True):
        assert m["loss"] == pytest.approx(lm["loss"], rel=1e-4, abs=1e-6)
        assert m["grad_norm"] == pytest.approx(lm["grad_norm"], rel=1e-3)
        if algo:
            assert m["value_loss"] == pytest.approx(lm["value_loss"], rel=1e-4, abs=1e-8)
    # Adam turns float-rounding differences of near-zero gradients into up to ~1% of one step
    # (lr 3e-3); anything structurally wrong is off by whole steps.
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)
    state = trainer.policy.call("state_dict")
    if algo:
        critic = local.critic.state_dict()["model"]
        assert state["critic"]["model"].keys() == critic.keys()
        for k in critic:
            torch.testing.assert_close(state["critic"]["model"][k], critic[k], rtol=1e-4, atol=1e-4)

    # Checkpoints hold full tensors; loading the one taken after the first update brings its
    # weights back onto the shards / ZeRO partitions of every rank.
    assert first["model"].keys() == want.keys()
    if options["backend"] == "deepspeed":
        assert len(first["optimizer"]) == 2  # one ZeRO partition per rank
    trainer.policy.call("load_state_dict", first)
    again = trainer.policy.call("state_dict")
    def weights(s, name):  # the policy's state is the top level, the critic's a section
        return s["model"] if name == "policy" else s["critic"]["model"]

    for name in ("policy", "critic") if algo else ("policy",):
        w_first, w_state, w_again = (weights(s, name) for s in (first, state, again))
        assert not all(torch.equal(w_first[k], w_state[k]) for k in w_first)
        for k in w_first:
            assert torch.equal(w_again[k], w_first[k]), (name, k)
    trainer.policy.call("export_hf", str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).state_dict()
    for k in want:
        assert torch.equal(exported[k], first["model"][k]), k


def test_two_lora_ranks_match_one_process_and_sync_merged_weights(
    ray_cluster, make_cfg, recorded_rollouts, tmp_path
):
    """LoRA over two FSDP2 policy ranks (frozen base and trainable adapters in one sharded
    unit): with a KL reference (the base, adapters off) they train the adapters one process
    trains on the whole batch; the rollout engine loads the merged W + scale * B A gathered
    from the shards; the checkpoint holds the untouched base and optimizer state for the
    adapters only, and loads back; rank 0 exports adapters and the merged model as one process
    does. (LoRA on ZeRO-2: tests/trainers/test_offline_ranks.py.)"""
    import torch
    from safetensors.torch import load_file

    from agentrl.models import load_model
    from agentrl.trajectory_files import load_jsonl
    from agentrl.types import dense_group_ids
    from trainers.policy import PolicyWorker

    trajs = load_jsonl(recorded_rollouts)
    batches = [trajs[:16], trajs[16:32]]
    lora = {"lora_rank": 4, "lora_alpha": 8, "lr": 1e-2}
    # Batches of 4 prompts x 4 samples; two epochs: the KL is then taken from the policy as it
    # moves (not from the sampler's log-probs, which are the base's here); two micro-batches
    # per rank.
    step = {"micro_batch_size": 4, "epochs_per_step": 2, "actor": lora,
            "algo": {"kl_coef": 0.1}}
    cfg = make_cfg(use_ray=True, num_policy_workers=2, run_dir=str(tmp_path / "run"),
                   backend="fsdp2", rollout={"mode": "placed", "prompts_per_step": 4}, **step)
    trainer = Trainer(cfg)
    trainer._start_workers()
    local = PolicyWorker(make_cfg(rollout={"prompts_per_step": 4}, **step), with_engine=False)
    assert local.ref is None and local.has_ref  # the base with adapters off, no copy
    local_metrics = [local.train(b, 0.1) for b in batches]
    metrics = [trainer.policy.call("train", b, 0.1, dense_group_ids(b)) for b in batches]
    for m, lm in zip(metrics, local_metrics, strict=True):
        assert m["loss"] == pytest.approx(lm["loss"], rel=1e-4, abs=1e-6)
        assert m["grad_norm"] == pytest.approx(lm["grad_norm"], rel=1e-3)
    # (`kl` is rank 0's share of the batch.) The reference is the base: the adapters moved the
    # policy off it, and the KL penalty shaped the rewards whose loss matched above.
    assert abs(metrics[1]["kl"]) > 1e-3

    base = load_model("tiny").state_dict()
    got, want = trainer.policy.call("named_weights"), local.named_weights()
    assert got.keys() == want.keys() == base.keys()  # the plain model's names
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)
    assert max(float((got[k] - base[k]).abs().max()) for k in base) > 1e-3
    trainer.step = 2
    trainer._sync_weights()
    engine = trainer.rollout.call("named_weights")
    for k in base:
        assert torch.equal(engine[k], got[k]), k

    state = trainer.policy.call("state_dict")
    model_state = state["model"]
    assert model_state.keys() == local.policy.state_dict()["model"].keys()
    for k, v in model_state.items():
        if "lora_" not in k:
            assert torch.equal(v, base[k.removeprefix("base_model.model.").replace(
                ".base_layer.", ".")]), k
    held = state["optimizer"]["state"]
    assert held and all("lora_" in k for k in held)
    trainer.policy.call("train", batches[0], 0.1, dense_group_ids(batches[0]))
    trainer.policy.call("load_state_dict", state)
    again = trainer.policy.call("named_weights")
    for k in got:
        assert torch.equal(again[k], got[k]), k

    hf = tmp_path / "run" / "hf"
    trainer.policy.call("export_hf", str(hf))
    exported = load_model(str(hf)).state_dict()
    for k in got:
        assert torch.equal(exported[k], got[k]), k
    adapter = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    for k, v in model_state.items():
        if "lora_" in k:
            assert torch.equal(adapter[k.replace(".default", "")], v), k


def test_cpu_actors_split_the_cluster_and_get_its_threads(ray_cluster, make_cfg):
    """Each CPU actor asks for its share of the cluster's CPUs; Ray sets an actor's torch
    threads from what it asked for (an actor that asked for none computes on one thread)."""
    import ray

    from trainers.ray_utils import actor_options

    colocated, _ = actor_options(make_cfg(use_ray=True), rollout=False)
    assert colocated == [{"num_cpus": 2}]
    ranks, rollout = actor_options(make_cfg(use_ray=True, num_policy_workers=2, backend="fsdp2",
                                            rollout={"mode": "placed"}), rollout=True)
    assert [r["num_cpus"] for r in ranks] == [pytest.approx(2 / 3)] * 2
    assert [r["num_cpus"] for r in rollout] == [pytest.approx(2 / 3)]
    _, engines = actor_options(make_cfg(use_ray=True, rollout={"mode": "placed",
                                                               "num_engines": 3}), rollout=True)
    assert [r["num_cpus"] for r in engines] == [pytest.approx(0.5)] * 3  # 4 actors share 2

    @ray.remote
    def threads() -> int:
        import torch

        return torch.get_num_threads()

    assert ray.get(threads.options(**colocated[0]).remote()) == 2
