"""A run that saves its rollouts also writes the trainer's side of each step, trained/step_N.jsonl
(`agentrl.trained_files`): the trainer's log-probs of the sampled tokens before the update and
the advantages the loss used, one line per trajectory trained on, joined to the rollouts file's
lines by uid."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from agentrl.trained_files import Trained, aligned, save_trained, trained_tokens
from agentrl.trajectory_files import load_jsonl, save_jsonl
from trainers.controller import Trainer


def _rows(run_dir: str | Path, step: int = 1) -> list[dict]:
    path = Path(run_dir) / "trained" / f"step_{step:06d}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def _metrics(run_dir: str | Path) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _initial_logprobs(make_cfg, trajs: list, temperature: float) -> list[list[float]]:
    """Each trajectory's trained tokens' log-probs under the policy before any update: a plain
    padded forward of a fresh worker's model (the same seeded initialisation), no packing."""
    from trainers.policy import PolicyWorker

    model = PolicyWorker(make_cfg(), with_engine=False).model.eval()
    out = []
    with torch.no_grad():
        for t in trajs:
            ids = torch.tensor([t.token_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, -1)
            out.append([float(logp[i - 1, t.token_ids[i]]) for i in trained_tokens(t.loss_mask)])
    return out


def _group_norm(trajs: list) -> list[float]:
    from agentrl.algorithms import compute_advantages
    from agentrl.types import dense_group_ids

    rewards_BT = torch.zeros(len(trajs), 2)
    rewards_BT[:, -1] = torch.tensor([t.total_reward for t in trajs])
    adv_BT, _ = compute_advantages("group_norm", rewards_BT=rewards_BT, mask_BT=torch.ones(
        len(trajs), 2), group_ids_B=torch.tensor(dense_group_ids(trajs)))
    return adv_BT[:, 0].tolist()


def test_a_colocated_run_records_the_pre_update_logprobs_and_advantages(make_cfg):
    """One pass over the batch (the default): its log-probs, taken before its optimizer step,
    are an independent forward's of the initial policy; the step's `mismatch` metric is their
    token mean against the sampler's; the advantages are group_norm's of the rewards."""
    cfg = make_cfg(steps=1)
    Trainer(cfg).run()
    sampled = load_jsonl(Path(cfg.run_dir) / "rollouts" / "step_000001.jsonl")
    rows = _rows(cfg.run_dir)
    assert [r["line"] for r in rows] == list(range(1, len(sampled) + 1))  # none discarded
    assert [r["uid"] for r in rows] == [t.uid for t in sampled]
    assert [r["num_tokens"] for r in rows] == [len(t.token_ids) for t in sampled]
    want = _initial_logprobs(make_cfg, sampled, cfg.rollout.temperature)
    for r, w in zip(rows, want, strict=True):
        assert r["trainer_logprobs"] == pytest.approx(w, abs=1e-4)
    gaps = [t.logprobs[i] - lp for t, r in zip(sampled, rows, strict=True)
            for i, lp in zip(trained_tokens(t.loss_mask), r["trainer_logprobs"], strict=True)]
    [step] = [m for m in _metrics(cfg.run_dir) if "mismatch" in m]
    assert sum(gaps) / len(gaps) == pytest.approx(step["mismatch"], rel=1e-3, abs=1e-7)
    for r, adv in zip(rows, _group_norm(sampled), strict=True):
        assert r["advantages"] == pytest.approx([adv] * len(r["advantages"]), abs=1e-5)
    assert any(abs(a) > 0.1 for r in rows for a in r["advantages"])  # a group had a signal
    # `agentrl view` shows them: per sampled token, sampler minus trainer log-prob.
    from servers.viewer.cli import ViewArgs, open_viewer

    viewer = open_viewer(ViewArgs(target=cfg.run_dir), Path(cfg.run_dir) / "view")
    for line in (1, len(sampled)):
        turn = viewer.turn({"step": "1", "line": str(line), "turn": "0"})
        t, r = sampled[line - 1], rows[line - 1]
        assert turn["mismatch_recorded"]
        assert [a[5] for a in turn["action"]] == pytest.approx(
            [t.logprobs[i] - lp for i, lp in zip(trained_tokens(t.loss_mask),
                                                  r["trainer_logprobs"], strict=True)])
        assert [a[4] for a in turn["action"]] == pytest.approx(r["advantages"])


def test_only_the_trained_trajectories_are_recorded_at_their_lines(
    make_cfg, recorded_rollouts, tmp_path
):
    """Replayed rollouts with every fourth episode discarded, two epochs (the old log-probs
    come from their own pass before the first update): the discarded ones have no line, each
    other trajectory its own line in the rollouts file, and its log-probs are the initial
    policy's."""
    trajs = [dataclasses.replace(t, discard=i % 4 == 1)
             for i, t in enumerate(load_jsonl(recorded_rollouts)[:32])]
    path = tmp_path / "marked.jsonl"
    save_jsonl(trajs, path)
    cfg = make_cfg(replay=str(path), steps=1, epochs_per_step=2)
    Trainer(cfg).run()
    sampled = load_jsonl(Path(cfg.run_dir) / "rollouts" / "step_000001.jsonl")
    rows = _rows(cfg.run_dir)
    kept = [n for n, t in enumerate(sampled, 1) if not t.discard]
    assert len(kept) == 24 and [r["line"] for r in rows] == kept
    assert [r["uid"] for r in rows] == [sampled[n - 1].uid for n in kept]
    want = _initial_logprobs(make_cfg, [sampled[n - 1] for n in kept], cfg.rollout.temperature)
    for r, w in zip(rows, want, strict=True):
        assert r["trainer_logprobs"] == pytest.approx(w, abs=1e-4)


def test_no_saved_rollouts_no_trained_file(make_cfg, recorded_rollouts):
    cfg = make_cfg(replay=str(recorded_rollouts), steps=1, save_rollouts=False)
    trainer = Trainer(cfg)
    trainer.run()
    assert not (Path(cfg.run_dir) / "trained").exists()
    assert trainer.policy.call("trained") == []  # nothing kept in the worker either


def test_a_resume_rewinds_the_trained_files(tmp_path):
    from trainers.checkpoint import rewind_run_files

    for folder in ("rollouts", "trained"):
        (tmp_path / folder).mkdir()
        for s in (1, 2, 3):
            (tmp_path / folder / f"step_{s:06d}.jsonl").write_text("{}\n")
    rewind_run_files(tmp_path, 2)
    for folder in ("rollouts", "trained"):
        assert sorted(p.name for p in (tmp_path / folder).iterdir()) == [
            "step_000001.jsonl", "step_000002.jsonl"]


def _traj(uid: str, mask: list[int]):
    from agentrl.types import TrajectoryBuilder

    b = TrajectoryBuilder()
    b.add_observation([1] * mask.index(1))
    b.add_action([2] * mask.count(1), [-0.5] * mask.count(1))
    t = b.build(terminated=True, truncated=False)
    return dataclasses.replace(t, uid=uid)


def test_save_trained_joins_by_uid_and_refuses_what_does_not_match(tmp_path):
    sampled = [_traj(u, [0, 0, 1, 1]) for u in "abc"]
    path = tmp_path / "trained" / "step_000001.jsonl"
    n = save_trained(path, sampled, [Trained("c", 4, [-1.0, -2.0], [0.5, 0.5]),
                                     Trained("a", 4, [-3.0, -4.0], [1.0, 1.0])])
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert n == 2 and [(r["line"], r["uid"]) for r in rows] == [(1, "a"), (3, "c")]
    lp, adv = aligned(rows[1], json.loads(sampled[2].to_json()))
    assert lp == [None, None, -1.0, -2.0] and adv == [None, None, 0.5, 0.5]
    with pytest.raises(RuntimeError, match="trained trajectory x is not in the step's rollouts"):
        save_trained(path, sampled, [Trained("x", 4, [-1.0, -2.0], [0.0, 0.0])])
    with pytest.raises(RuntimeError, match="but its rollout has 4 tokens and 2 trained ones"):
        save_trained(path, sampled, [Trained("b", 4, [-1.0], [0.0])])
    with pytest.raises(ValueError, match="are not the rollout's"):
        aligned(rows[0], json.loads(sampled[1].to_json()))
    assert path.read_text().count("\n") == 2  # the refused writes left the file as it was


@pytest.mark.ray
@pytest.mark.slow
def test_two_ranks_write_what_one_process_computes(
    ray_cluster, make_cfg, recorded_rollouts, tmp_path
):
    """Two data-parallel Ray ranks (fsdp2, gloo), each training on its slice of a batch with
    discarded episodes: the driver joins their records, in rank order, to the rollouts' lines,
    and they are what one process computes on the whole batch."""
    from trainers.policy import PolicyWorker
    from trainers.rl_step import training_batch

    trajs = [dataclasses.replace(t, discard=i % 4 == 1)
             for i, t in enumerate(load_jsonl(recorded_rollouts)[:32])]
    path = tmp_path / "marked.jsonl"
    save_jsonl(trajs, path)
    cfg = make_cfg(use_ray=True, num_policy_workers=2, backend="fsdp2", micro_batch_size=8,
                   rollout={"mode": "placed"}, replay=str(path), steps=1,
                   run_dir=str(tmp_path / "ranks"))
    Trainer(cfg).run()
    rows = _rows(cfg.run_dir)
    local = PolicyWorker(make_cfg(micro_batch_size=8), with_engine=False)
    batch, group_ids, _ = training_batch(load_jsonl(path), local.cfg.algo,
                                           max_new_tokens=cfg.rollout.max_new_tokens)
    local.train(batch, 0.0, group_ids)
    want = local.trained()
    assert [r["line"] for r in rows] == [n for n in range(1, 33) if n % 4 != 2]
    assert [r["uid"] for r in rows] == [w.uid for w in want]
    for r, w in zip(rows, want, strict=True):
        assert r["trainer_logprobs"] == pytest.approx(w.logprobs, abs=1e-4)
        assert r["advantages"] == pytest.approx(w.advantages, abs=1e-5)


@pytest.mark.ray
@pytest.mark.slow
def test_a_colocated_ray_actor_hands_its_records_to_the_driver(ray_cluster, make_cfg, tmp_path):
    """Colocated on Ray, the batch never leaves the policy actor (`train_collected`); its
    records do, and name every rollout line (none discarded on Digits)."""
    cfg = make_cfg(use_ray=True, steps=1, run_dir=str(tmp_path / "colocated"))
    Trainer(cfg).run()
    sampled = load_jsonl(Path(cfg.run_dir) / "rollouts" / "step_000001.jsonl")
    rows = _rows(cfg.run_dir)
    assert [(r["line"], r["uid"]) for r in rows] == [
        (n, t.uid) for n, t in enumerate(sampled, 1)]
    assert all(len(r["trainer_logprobs"]) == t.num_policy_tokens > 0
               for r, t in zip(rows, sampled, strict=True))
