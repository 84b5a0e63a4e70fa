"""A training step goes on without the agents that failed; a step whose agents all fail is
skipped and reported, and the run stops after --max_bad_steps of them (#32 item 6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainers.controller import Trainer
from trainers.workers import TrainingError

FIX = "tests.trainers.agent_fixture"


def _tasks(path: Path, fail: list[bool]) -> str:
    path.write_text("".join(json.dumps({"prompt": f"Count from {i}.", "fail": f}) + "\n"
                            for i, f in enumerate(fail)))
    return str(path)


def test_a_step_trains_on_the_agents_that_did_not_fail(make_cfg, tmp_path):
    cfg = make_cfg(steps=1, agent=f"{FIX}:flaky_agent", agent_reward=f"{FIX}:digits_reward",
                   agent_tasks=_tasks(tmp_path / "t.jsonl", [False, True]),
                   rollout={"prompts_per_step": 2, "n_samples_per_prompt": 2},
                   seed=0)
    Trainer(cfg).run()
    [row] = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text()
             .splitlines() if "reward" in x]
    rollouts = [json.loads(x) for x in
                (Path(cfg.run_dir) / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    failed = [t for t in rollouts if t.get("discard")]
    assert row["discarded"] == len(failed) > 0 and len(rollouts) > len(failed)
    assert all(t["turns"] and t["info"]["error"] == "RuntimeError: the agent's tool broke"
               for t in failed)
    # The run summary's per-step agent counts (#32 item 7).
    assert row["agents_started"] == 4 and row["agents_failed"] == row["agents_failed_raised"]
    assert row["agents_failed"] == len({t["info"]["session_id"] for t in failed})
    assert row["agents_finished"] == 4 - row["agents_failed"] and row["agents_timed_out"] == 0
    assert row["tokens_per_agent"] > 0 and row["agent_segments"] >= 4


def test_a_run_whose_agents_all_fail_stops_instead_of_retrying(make_cfg, tmp_path):
    cfg = make_cfg(steps=5, agent=f"{FIX}:flaky_agent", agent_reward=f"{FIX}:digits_reward",
                   agent_tasks=_tasks(tmp_path / "t.jsonl", [True]), max_bad_steps=1,
                   rollout={"prompts_per_step": 1, "n_samples_per_prompt": 2})
    with pytest.raises(TrainingError, match=r"2 steps were skipped.*the agent's tool broke"):
        Trainer(cfg).run()
