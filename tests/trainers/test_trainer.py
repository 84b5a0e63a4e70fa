"""The trainer end to end on the tiny model: learning, exact resume, bad steps, checkpoints. The
tests that reach the CPU kernels' code paths run with them forced on and forced off
(`cpu_kernels` in conftest.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.trainers._grads import catch_gradient
from trainers.checkpoint import latest_checkpoint, load_checkpoint
from trainers.controller import Trainer
from trainers.workers import TrainingError

ALGOS = {
    "ppo": {"estimator": "gae", "critic_lr": 3e-3},
    "reinforce++": {"estimator": "reinforce"},
    "reinforce++-baseline": {"estimator": "reinforce_baseline"},
    "grpo": {"estimator": "group_norm"},
    "dr-grpo": {"estimator": "dr_grpo", "loss_agg": "constant"},
    "rloo": {"estimator": "rloo"},
}


def _rewards(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["reward"] for r in rows if "reward" in r]


def _learning_cases():
    """Every algorithm with the calibrated kernels; GRPO (the default) and PPO (critic and its
    own backend) with the kernels forced on and off, rollouts included (decode kernels)."""
    for name in ALGOS:
        modes = ("kernels_on", "kernels_off") if name in ("grpo", "ppo") else ("calibrated",)
        for mode in modes:
            yield pytest.param(name, mode, id=f"{name}-{mode}" if mode != "calibrated" else name)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "cpu_kernels"), _learning_cases(), indirect=["cpu_kernels"])
def test_learning_raises_reward(name, cpu_kernels, make_cfg):
    cfg = make_cfg(algo=ALGOS[name], steps=25)
    summary = Trainer(cfg).run()
    rewards = _rewards(cfg_path := Path(cfg.run_dir))
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert len(rewards) == 25 and summary["steps"] == 25
    assert last > first + 0.15, f"{name}: reward {first:.3f} -> {last:.3f}"
    assert (cfg_path / "hf" / "config.json").exists()


@pytest.mark.usefixtures("cpu_kernels")
def test_one_step_changes_parameters_and_loss_is_finite(make_cfg, recorded_rollouts):
    from trainers.policy import PolicyWorker

    cfg = make_cfg(replay=str(recorded_rollouts), steps=1)
    worker = PolicyWorker(cfg, with_engine=False)
    before = {k: v.clone() for k, v in worker.model.state_dict().items()}
    from agentrl.trajectory_files import load_jsonl

    metrics = worker.train(load_jsonl(recorded_rollouts)[:32], 0.0)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    changed = [k for k, v in worker.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed


@pytest.mark.usefixtures("cpu_kernels")
def test_micro_batching_does_not_change_the_update(make_cfg, recorded_rollouts):
    from agentrl.trajectory_files import load_jsonl
    from trainers.policy import PolicyWorker

    trajs = load_jsonl(recorded_rollouts)[:32]
    grads = []
    for mbs in (32, 5):
        worker = PolicyWorker(make_cfg(micro_batch_size=mbs, actor={"max_grad_norm": 0.0}),
                              with_engine=False)
        seen = {}
        step = worker.policy.optimizer.step

        def capture(*a, _seen=seen, _w=worker, _step=step, **k):
            _seen.update({n: p.grad.clone() for n, p in _w.model.named_parameters()})
            return _step(*a, **k)

        worker.policy.optimizer.step = capture
        worker.train(trajs, 0.0)
        grads.append(seen)
    # Compare the accumulated gradients (Adam would amplify float noise in near-zero ones).
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-7)


@pytest.mark.usefixtures("cpu_kernels")
def test_resume_is_exact(make_cfg, recorded_rollouts, tmp_path):
    straight = make_cfg(replay=str(recorded_rollouts), steps=4, run_dir=str(tmp_path / "a"))
    Trainer(straight).run()
    first = make_cfg(replay=str(recorded_rollouts), steps=2, run_dir=str(tmp_path / "b"))
    Trainer(first).run()
    resumed = make_cfg(replay=str(recorded_rollouts), steps=4, run_dir=str(tmp_path / "b"),
                       resume="auto")
    Trainer(resumed).run()

    def losses(d):
        rows = [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in rows if "loss" in r]

    assert losses("a") == losses("b")
    wa, _, _ = load_checkpoint(latest_checkpoint(tmp_path / "a"))
    wb, _, _ = load_checkpoint(latest_checkpoint(tmp_path / "b"))
    for k in wa["model"]:
        assert torch.equal(wa["model"][k], wb["model"][k]), k
    assert wa["optimizer"]["state"].keys() == wb["optimizer"]["state"].keys()


def test_a_resumed_run_reads_as_one_run_and_leaves_no_partial_checkpoint(
    make_cfg, recorded_rollouts
):
    """A crash after step 4 was logged but before its checkpoint was complete: the resume from
    step 2 rewinds metrics.jsonl and the rollouts to step 2 (no step logged twice) and removes
    the half-written checkpoint directory."""
    import shutil

    from agentrl.files import partial_writes, temp_path_beside

    cfg = make_cfg(replay=str(recorded_rollouts), steps=4, save_every=2)
    Trainer(cfg).run()
    root = Path(cfg.run_dir) / "checkpoints"
    shutil.rmtree(root / "step_000004")
    (root / "latest").write_text("step_000002")
    partial = temp_path_beside(root / "step_000004")  # as a save cut short leaves it
    partial.mkdir()
    (partial / "worker.pt").write_bytes(b"cut short")
    Trainer(make_cfg(replay=str(recorded_rollouts), steps=4, save_every=2, resume="auto")).run()
    rows = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert sorted(p.name for p in (Path(cfg.run_dir) / "rollouts").iterdir()) == [
        f"step_{s:06d}.jsonl" for s in (1, 2, 3, 4)]
    assert not partial.exists() and not partial_writes(root)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002", "step_000004"]


def test_a_run_ends_without_partial_checkpoints(make_cfg, recorded_rollouts):
    from agentrl.files import temp_path_beside

    cfg = make_cfg(replay=str(recorded_rollouts), steps=1)
    stale = temp_path_beside(Path(cfg.run_dir) / "checkpoints" / "step_000007")
    stale.mkdir(parents=True)
    Trainer(cfg).run()
    assert not stale.exists() and (stale.parent / "step_000001").is_dir()


def test_a_new_run_sets_an_earlier_run_in_its_directory_aside(make_cfg, recorded_rollouts):
    """Run twice into one --run_dir without --resume: the second run's files are its own (two
    steps logged once each, not appended to the first run's), and the first run is kept whole
    beside it, byte for byte."""
    cfg = make_cfg(replay=str(recorded_rollouts), steps=2)
    Trainer(cfg).run()
    run_dir = Path(cfg.run_dir)
    before = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    Trainer(make_cfg(replay=str(recorded_rollouts), steps=2)).run()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    [aside] = run_dir.parent.glob(f"{run_dir.name}.prev-*")
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == before


def test_an_earlier_run_in_the_working_directory_is_not_moved(tmp_path, monkeypatch):
    from trainers.checkpoint import set_aside_earlier_run

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--resume auto"):
        set_aside_earlier_run(".")
    assert (tmp_path / "config.json").exists()
    assert set_aside_earlier_run(tmp_path / "empty") is None


def test_non_finite_loss_skips_then_stops_with_checkpoint(make_cfg, recorded_rollouts):
    from agentrl.algorithms import ADVANTAGE_ESTIMATORS, register_advantage_estimator

    if "nan_test" not in ADVANTAGE_ESTIMATORS:
        def nan_estimator(*, rewards_BT, mask_BT, **_):
            nan = torch.full_like(rewards_BT, float("nan"))
            return nan, nan

        register_advantage_estimator("nan_test", nan_estimator)
    cfg = make_cfg(replay=str(recorded_rollouts), steps=3, max_bad_steps=2,
                   algo={"estimator": "nan_test"})
    with pytest.raises(TrainingError, match="non-finite loss.*Last checkpoint"):
        Trainer(cfg).run()
    path = latest_checkpoint(cfg.run_dir)
    assert path is not None and load_checkpoint(path)[1]["bad_steps"] == 3


def test_crash_while_saving_keeps_previous_checkpoint(make_cfg, recorded_rollouts, monkeypatch):
    cfg = make_cfg(replay=str(recorded_rollouts), steps=1)
    trainer = Trainer(cfg)
    trainer.run()
    good = latest_checkpoint(cfg.run_dir)
    import trainers.checkpoint as ck

    def broken_save(obj, f):
        Path(f).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", broken_save)
    trainer.step += 1
    with pytest.raises(OSError, match="disk full"):
        trainer.save()
    assert latest_checkpoint(cfg.run_dir) == good
    load_checkpoint(good)  # still loads


def test_plot_writes_pngs(make_cfg, recorded_rollouts):
    from trainers.plot import main

    cfg = make_cfg(replay=str(recorded_rollouts), steps=2)
    Trainer(cfg).run()
    assert main([cfg.run_dir]) == 0
    from pathlib import Path

    assert (Path(cfg.run_dir) / "plots" / "reward.png").stat().st_size > 1000


LAYOUTS = {  # how a micro-batch reaches the model
    "shared": {"packing": True, "share_prefixes": True},
    "packed": {"packing": True, "share_prefixes": False},
    "padded": {"packing": False},
}


@pytest.mark.usefixtures("cpu_kernels")
def test_packing_and_prefix_sharing_give_the_same_update_as_padding(make_cfg, recorded_rollouts):
    from agentrl.trajectory_files import load_jsonl
    from trainers.policy import PolicyWorker

    trajs = load_jsonl(recorded_rollouts)[:32]
    metrics, grads = {}, {}
    for name, layout in LAYOUTS.items():
        worker = PolicyWorker(make_cfg(micro_batch_size=8, **layout), with_engine=False)
        step = worker.policy.optimizer.step

        def snapshot(*args, _name=name, _worker=worker, _step=step, **kwargs):
            grads[_name] = {k: p.grad.clone() for k, p in _worker.model.named_parameters()}
            return _step(*args, **kwargs)

        worker.policy.optimizer.step = snapshot
        metrics[name] = worker.train(trajs, 0.0)
    assert metrics["shared"]["shared_prompt_tokens"] > 0
    assert metrics["packed"]["shared_prompt_tokens"] == 0
    for name in ("shared", "packed"):
        got, ref = metrics[name], metrics["padded"]
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-6)
        assert got["entropy"] == pytest.approx(ref["entropy"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)
        # Gradients, not weights after Adam: Adam's first step divides by |g|, so weights whose
        # gradient is near its eps move by round-off-sensitive amounts.
        for k, g in grads["padded"].items():
            scale = float(g.abs().max()) + 1e-12
            torch.testing.assert_close(grads[name][k], g, atol=1e-5 * scale, rtol=1e-3)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_matches_a_plain_forward_at_policy_tokens(make_cfg, recorded_rollouts, layout):
    from agentrl.trajectory_files import load_jsonl
    from trainers.batch import collate
    from trainers.policy import PolicyWorker

    worker = PolicyWorker(make_cfg(**LAYOUTS[layout]), with_engine=False)
    trajs = load_jsonl(recorded_rollouts)[:6]
    batch = collate(trajs, worker.pad_id)
    idx = torch.arange(6)
    n = int(batch.lengths.max())
    with torch.no_grad():
        logp, _ = worker._logprobs(worker.policy, worker.model, batch, (idx, n))
        assert (worker.shared_tokens > 0) == (layout == "shared")
        for b, traj in enumerate(trajs):
            ids = torch.tensor([traj.token_ids])
            ref = torch.log_softmax(worker.model(input_ids=ids).logits[0, :-1], -1)
            ref = ref.gather(-1, ids[0, 1:, None])[:, 0] * batch.mask[b, : len(traj.token_ids) - 1]
            torch.testing.assert_close(logp[b, : len(traj.token_ids) - 1], ref, atol=1e-5, rtol=0)
            # ... and with the sampler's logprobs (same weights, fp32, temperature 1).
            sel = batch.mask[b].bool()
            torch.testing.assert_close(logp[b][sel], batch.rollout_logp[b][sel], atol=1e-4, rtol=0)


@pytest.mark.usefixtures("cpu_kernels")
def test_bf16_mixed_precision_computes_in_bf16_over_float32_weights(make_cfg, recorded_rollouts):
    from agentrl.trajectory_files import load_jsonl
    from trainers.batch import collate
    from trainers.policy import PolicyWorker

    trajs = load_jsonl(recorded_rollouts)[:16]
    workers = {
        "full": PolicyWorker(make_cfg(micro_batch_size=8), with_engine=False),
        "mixed": PolicyWorker(
            make_cfg(micro_batch_size=8, actor={"mixed_precision": "bf16"}), with_engine=False
        ),
    }
    full, mixed = workers["full"], workers["mixed"]
    batch = collate(trajs, full.pad_id)
    idx, n = torch.arange(len(trajs)), int(batch.lengths.max())
    with torch.no_grad():
        logp = {name: w._logprobs(w.policy, w.model, batch, (idx, n))[0]
                for name, w in workers.items()}
    diff = (logp["mixed"] - logp["full"]).abs()[batch.mask.bool()]
    # Same weights, bf16 matmuls: logprobs differ at bf16 precision, not more, not less.
    assert 1e-3 < float(diff.max()) < 0.3 and float(diff.mean()) < 0.05
    # The update's gradient, caught before the optimizer step. (Not the loss: on the first,
    # on-policy step the ratio is exactly 1, so the loss is -mean(advantage) in any precision.)
    grads = {}
    for name, worker in workers.items():
        catch_gradient(worker, grads, name)
        worker.train(trajs, 0.0)
    # bf16 has 8 significant bits (2^-8 = 0.004): the backward ran in bf16 (the gradient is not
    # fp32's) and computed the same gradient to that precision (0.0047 measured).
    rel = float((grads["mixed"] - grads["full"]).norm() / grads["full"].norm())
    assert 1e-4 < rel < 0.03, rel
    # ... while the weights and the optimizer state stay float32.
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    states = mixed.policy.optimizer.state.values()
    assert all(s.dtype == torch.float32 for st in states for s in st.values())


def test_bf16_mixed_precision_needs_float32_weights():
    from trainers.config import ActorConfig

    with pytest.raises(ValueError, match="--actor.mixed_precision bf16.*--actor.dtype float32"):
        ActorConfig(mixed_precision="bf16", dtype="bfloat16")


@pytest.mark.usefixtures("cpu_kernels")
def test_prefix_sharing_handles_identical_and_short_prefixes(make_cfg):
    """Identical samples (the whole row is the shared prefix), a group whose common prefix is
    too short to share, and a singleton: logprobs equal to one plain forward per row."""
    from agentrl.types import Trajectory, Turn
    from trainers.batch import collate, pack
    from trainers.policy import PolicyWorker

    worker = PolicyWorker(make_cfg(), with_engine=False)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, 200, (12,), generator=g).tolist()
    rows = {  # group -> token rows
        "a": [prompt + [7, 8, 9], prompt + [7, 8, 9]],  # identical: all 15 tokens shared
        "b": [[3, 4, 5, 6], [3, 4, 9, 9, 9]],  # shares 2 tokens: below min_shared
        "c": [prompt[:5] + [1, 2]],
        "d": [prompt + [5, 6], prompt + [5, 7, 7]],  # 13 shared
    }
    trajs = [
        Trajectory(token_ids=ids, loss_mask=[0] * 3 + [1] * (len(ids) - 3),
                   logprobs=[0.0] * len(ids),
                   turns=[Turn(obs_start=0, start=3, end=len(ids), reward=1.0)],
                   group=group)
        for group, members in rows.items() for ids in members
    ]
    batch = collate(trajs, worker.pad_id)
    idx, n = torch.arange(len(trajs)), int(batch.lengths.max())
    packed = pack(batch, idx, n)
    assert packed.shared_tokens == 15 + 13
    with torch.no_grad():
        logp, _ = worker._logprobs(worker.policy, worker.model, batch, (idx, n))
        for b, traj in enumerate(trajs):
            ids = torch.tensor([traj.token_ids])
            ref = torch.log_softmax(worker.model(input_ids=ids).logits[0, :-1], -1)
            ref = ref.gather(-1, ids[0, 1:, None])[:, 0] * batch.mask[b, : ids.shape[1] - 1]
            torch.testing.assert_close(logp[b, : ids.shape[1] - 1], ref, atol=1e-5, rtol=0)
