"""The RL step's pure computation (trainers/rl_step.py) and where it runs: in the colocated
worker on the batch it sampled, or in the driver on a batch passing through; both take the same
steps, and the adaptive KL coefficient resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.types import Trajectory, TrajectoryBuilder
from trainers import rl_step

# DAPO's filtering and overlong penalty, ProRL's truncation penalty and the adaptive KL
# coefficient, all at once: every computation the step makes besides advantages and losses.
ALGO = {"dynamic_filter": "std", "overlong_buffer": 4, "overlong_factor": 0.5,
        "truncation_penalty": 0.5, "kl_coef": 0.05, "kl_target": 0.01, "kl_horizon": 100}


def _episode(group: str, reward: float) -> Trajectory:
    b = TrajectoryBuilder(group=group)
    b.add_observation([5, 6, 7])
    b.add_action([8, 9], [-0.5, -0.5]).reward = reward
    return b.build(terminated=True, truncated=False)


def _rows(run_dir: str) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_refill_samples_rounds_until_full_and_keeps_whole_groups():
    rounds = iter([
        [_episode("b", 0.0), _episode("b", 0.0)],  # no signal: dropped
        [_episode("c", 0.0), _episode("c", 1.0), _episode("d", 1.0), _episode("d", 0.5)],
    ])
    kept = rl_step.informative([_episode("a", 0.0), _episode("a", 1.0)], "std")
    got = rl_step.refill(kept, lambda: next(rounds), criterion="std", want=4, group_size=2)
    assert [t.group for t in got] == ["a", "a", "c", "c"]  # full: "d" is left over
    flat = [_episode("e", 1.0), _episode("e", 1.0)]
    assert rl_step.refill([], lambda: flat, criterion="std", want=4, group_size=2) == []


def test_summarize_counts_what_the_driver_logs():
    fine, broken = _episode("a", 1.0), _episode("a", 0.0)
    broken.discard, broken.info["error"] = True, "TimeoutError()"
    got = rl_step.summarize([fine, broken], rounds=2, keep=False)
    assert (got.num_episodes, got.num_kept, got.policy_tokens, got.rounds) == (2, 1, 2, 2)
    assert got.discard_error == ", most often with: TimeoutError() (1 episode)"
    assert got.trajectories is None and got.min_version == 0


def test_a_colocated_batch_stays_in_the_worker(make_cfg, monkeypatch):
    """Colocated, the driver sends the worker no trajectory and, saving no rollouts, gets none
    back: the worker filters, shapes and trains on the batch it sampled."""
    from trainers.controller import Trainer
    from trainers.workers import Handle

    sent, got = [], []
    submit, result = Handle.submit, Handle.result

    def spy_submit(self, method, *args, group=None):
        sent.append((method, args))
        return submit(self, method, *args, group=group)

    def spy_result(self, future):
        got.append(result(self, future))
        return got[-1]

    monkeypatch.setattr(Handle, "submit", spy_submit)
    monkeypatch.setattr(Handle, "result", spy_result)
    cfg = make_cfg(steps=2, save_rollouts=False, algo=ALGO)
    Trainer(cfg).run()
    methods = [m for m, _ in sent]
    assert methods.count("collect_step") == methods.count("train_collected") == 2
    assert "train" not in methods and "collect" not in methods

    def trajectories(x):
        return isinstance(x, Trajectory) or (
            isinstance(x, list | tuple) and any(trajectories(i) for i in x))

    assert not any(trajectories(a) for _, args in sent for a in args)
    summaries = [g for g in got if isinstance(g, rl_step.Sampled)]
    assert len(summaries) == 2 and all(s.trajectories is None for s in summaries)
    assert [r["reward"] for r in _rows(cfg.run_dir)]  # and it trained


def test_colocated_and_placed_take_the_same_steps(make_cfg, tmp_path):
    """The worker's step (colocated) and the driver's (placed) are one computation: same
    episodes kept, rewards shaped alike, same KL coefficient and prompts used."""
    from trainers.checkpoint import latest_checkpoint, load_checkpoint
    from trainers.controller import Trainer

    runs = {}
    for mode in ("colocated", "placed"):
        cfg = make_cfg(steps=2, algo=ALGO, rollout={"mode": mode},
                       run_dir=str(tmp_path / mode))
        Trainer(cfg).run()
        runs[mode] = (_rows(cfg.run_dir), load_checkpoint(latest_checkpoint(cfg.run_dir))[1])
    (coloc, coloc_state), (placed, placed_state) = runs["colocated"], runs["placed"]
    for a, b in zip(coloc, placed, strict=True):
        for k in ("reward", "reward_std", "response_tokens", "truncated", "discarded",
                  "policy_lag"):
            assert a[k] == b[k], k
        for k in ("kl_coef", "kl", "loss", "advantage_mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
    assert coloc[0]["kl_coef"] != 0.05  # the adaptive coefficient moved
    assert coloc_state["data_pos"] == placed_state["data_pos"]
    assert coloc_state["kl_coef"] == pytest.approx(placed_state["kl_coef"], rel=1e-6)


def test_the_adaptive_kl_coefficient_resumes_exactly(make_cfg, recorded_rollouts, tmp_path):
    from trainers.controller import Trainer

    def run(name, steps, resume=None):
        cfg = make_cfg(replay=str(recorded_rollouts), steps=steps, algo=ALGO, resume=resume,
                       run_dir=str(tmp_path / name))
        Trainer(cfg).run()
        return [(r["step"], r["kl_coef"]) for r in _rows(cfg.run_dir)]

    straight = run("a", 3)
    run("b", 2)
    assert run("b", 3, resume="auto") == straight
    assert len({c for _, c in straight}) == 3  # it changed every step
