"""--eval_every, --keep_best and --keep_last: held-out evals during a run, logged and plotted with
the training curves, the best checkpoint kept whatever --keep_last prunes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainers.checkpoint import best_checkpoint, load_checkpoint
from trainers.controller import Trainer


def test_periodic_evals_and_the_best_checkpoint(make_cfg):
    cfg = make_cfg(steps=7, eval_problems=4, eval_every=2, keep_best="mean_return", keep_last=1,
                   algo={"estimator": "group_norm"})
    summary = Trainer(cfg).run()
    run = Path(cfg.run_dir)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    periodic = {r["step"]: r["eval/mean_return"] for r in rows if "eval/mean_return" in r}
    # Steps 2, 4 and 6; the last step is evaluated by the eval after training instead.
    assert sorted(periodic) == [2, 4, 6]
    assert all("eval/pass@1" in r for r in rows if "eval/mean_return" in r)
    assert sorted(p.name for p in (run / "evals").iterdir()) == [
        "step_000002.jsonl", "step_000004.jsonl", "step_000006.jsonl"]
    # #20 item 2: before and after on the same problems, each with its 95% interval, and the
    # change paired over those problems; one line names what was evaluated.
    from trainers.controller_run import eval_report

    change = summary["eval_change"]
    assert change["pass@1"] == pytest.approx(
        summary["eval_after"]["pass@1"] - summary["eval_before"]["pass@1"])
    assert change["num_problems"] == 4 and change["setting"]["problems"] == 4
    assert change["setting"]["env"] == cfg.env and change["ci95"] >= 0
    for name in ("eval_before", "eval_after"):
        ev = summary[name]
        assert 0.0 <= ev["pass@1_low"] <= ev["pass@1"] <= ev["pass@1_high"] <= 1.0
        assert ev["pass@1_high"] > ev["pass@1_low"]  # Wilson's interval never collapses
    assert f"on {cfg.env} (" in eval_report(summary) and "4 problems x 1 samples" in eval_report(
        summary)
    after = summary["eval_after"]["mean_return"]
    scores = {**periodic, 7: after}
    best_step = max(scores, key=lambda s: (scores[s], -s))  # the first of equal bests
    path, record = best_checkpoint(run)
    assert summary["best"] == record
    assert record["step"] == best_step and record["mean_return"] == scores[best_step]
    assert load_checkpoint(path)[1]["step"] == best_step
    # --keep_last 1: the newest checkpoint, and the best one if it is another.
    kept = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert kept == sorted({"step_000007", f"step_{best_step:06d}"})

    from trainers.plot import plot_run

    written = {p.name for p in plot_run(run)}
    assert {"reward.png", "eval_pass@1.png", "eval_mean_return.png"} <= written


def test_a_resumed_run_compares_with_the_recorded_best(make_cfg):
    """The record in checkpoints/best.json outlives the process: a resumed run keeps the best
    checkpoint of its first part unless it beats it."""
    cfg = make_cfg(steps=2, eval_problems=4, eval_every=1, keep_best="mean_return", keep_last=1)
    Trainer(cfg).run()
    run = Path(cfg.run_dir)
    path, record = best_checkpoint(run)
    record_file = run / "checkpoints" / "best.json"
    record_file.write_text(json.dumps({**record, "mean_return": 2.0}))  # unbeatable
    Trainer(make_cfg(steps=4, eval_problems=4, eval_every=1, keep_best="mean_return",
                     keep_last=1, resume="auto")).run()
    again, kept = best_checkpoint(run)
    assert (again, kept["mean_return"]) == (path, 2.0) and again.is_dir()
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == sorted(
        {path.name, "step_000004"})


def test_the_best_checkpoint_survives_pruning_until_another_is_best(tmp_path):
    from trainers.checkpoint import mark_best, prune_checkpoints, save_checkpoint

    def names():
        return sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))

    first = save_checkpoint(tmp_path, 1, {}, {"step": 1}, keep=1)
    mark_best(tmp_path, first, "pass@1", 0.5, 1)
    save_checkpoint(tmp_path, 2, {}, {"step": 2}, keep=1)
    third = save_checkpoint(tmp_path, 3, {}, {"step": 3}, keep=1)
    assert names() == ["step_000001", "step_000003"]
    mark_best(tmp_path, third, "pass@1", 0.75, 3)
    prune_checkpoints(tmp_path, 1)
    assert names() == ["step_000003"]
    assert best_checkpoint(tmp_path) == (third, {"checkpoint": "step_000003", "step": 3,
                                                 "pass@1": 0.75})
