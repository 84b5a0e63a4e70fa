"""An agent run's evals (#32): the agent on held-out tasks through the proxy, never the preset
env's problems; pass@1 with its interval and the paired change as the math-tir headline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainers.cli import build_config
from trainers.controller import Trainer
from trainers.controller_run import eval_report

AGENT = "tests.trainers.agent_fixture:digits_agent"
REWARD = "tests.trainers.agent_fixture:digits_reward"


def _tasks(path: Path, n: int, start: int = 0) -> str:
    path.write_text("".join(json.dumps({"prompt": f"Count from {i}. Digits only."}) + "\n"
                            for i in range(start, start + n)))
    return str(path)


def test_agent_run_evaluates_the_agent_on_held_out_tasks(make_cfg, tmp_path):
    cfg = make_cfg(steps=1, agent=AGENT, agent_reward=REWARD,
                   agent_tasks=_tasks(tmp_path / "train.jsonl", 8),
                   agent_eval_tasks=_tasks(tmp_path / "eval.jsonl", 6, start=100),
                   eval_problems=5, eval_samples=2, rollout={"prompts_per_step": 2})
    summary = Trainer(cfg).run()
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["num_samples"] == after["num_samples"] == 10  # 5 held-out tasks x 2
    assert before["num_problems"] == 5
    lines = (Path(cfg.run_dir) / "eval_before.jsonl").read_text().splitlines()
    trajs = [json.loads(x) for x in lines]
    # Proxy sessions of the agent (not env episodes), on tasks 0..4 of the held-out file.
    assert all(t["info"]["session_id"] for t in trajs)
    assert {t["info"]["task_index"] for t in trajs} == set(range(5))
    assert all(t["group"].startswith("eval-") for t in trajs)
    change = summary["eval_change"]
    assert change["num_problems"] == 5 and change["setting"]["env"] == f"agent {AGENT}"
    report = eval_report(summary)
    assert report.startswith(f"held-out pass@1 on agent {AGENT}") and "change" in report
    assert "5 problems x 2 samples = 10" in report


def test_agent_command_line_drops_the_presets_env_evals(tmp_path):
    tasks = _tasks(tmp_path / "t.jsonl", 2)
    common = ["--agent", AGENT, "--agent_tasks", tasks, "--agent_reward", REWARD]
    # The math-tir preset evaluates 64 math-tir problems: an agent run without held-out tasks
    # has no evals, and with them evaluates those.
    assert build_config(common).eval_problems == 0
    cfg = build_config([*common, "--agent_eval_tasks", tasks])
    assert cfg.eval_problems == 64 and cfg.agent_eval_tasks == tasks
    with pytest.raises(ValueError, match="--eval_problems 8: an agent run is evaluated on "
                                         "held-out tasks.*--agent_eval_tasks"):
        build_config([*common, "--eval_problems", "8"])


def test_task_files_that_are_not_json_lines_name_file_and_line(make_cfg, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=rf"--agent_tasks: {bad}:3 is not a JSON value"):
        make_cfg(agent=AGENT, agent_tasks=str(bad), agent_reward=REWARD)
    good = _tasks(tmp_path / "good.jsonl", 2)
    with pytest.raises(ValueError, match=rf"--agent_eval_tasks: {bad}:3 is not a JSON value"):
        make_cfg(agent=AGENT, agent_tasks=good, agent_reward=REWARD, agent_eval_tasks=str(bad),
                 eval_problems=2)
    with pytest.raises(ValueError, match="--agent_eval_tasks .*needs --agent"):
        make_cfg(agent_eval_tasks=good)
