"""`agentrl train --agent_cmd "CMD ARGS"` (#32 item 2): agents in another interpreter or
language train through their sessions. One process per episode, the task on stdin, the last
stdout line scored; their tokens reach the trainer and the reward rises on the digits task."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainers.cli import build_config
from trainers.controller import Trainer

HERE = Path(__file__).parent
PY_AGENT = HERE.parent / "servers" / "agent_cmd_fixture.py"
REWARD = "tests.trainers.agent_fixture:digits_reward"


def _tasks(path: Path) -> str:
    path.write_text("".join(json.dumps({"prompt": f"Count from {i}. Digits only.",
                                        "max_tokens": 8}) + "\n" for i in range(16)))
    return str(path)


def _trains(make_cfg, tmp_path: Path, command: str) -> None:
    cfg = make_cfg(steps=12, agent_cmd=command, agent_tasks=_tasks(tmp_path / "tasks.jsonl"),
                   agent_reward=REWARD, agent_concurrency=8)
    Trainer(cfg).run()
    rows = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward" in r]
    assert len(rows) == 12
    # The sessions' tokens reached the trainer, token-exact with their sampler logprobs.
    assert all(r["response_tokens"] > 0 and abs(r["mismatch"]) < 1e-3 for r in rows)
    trajs = [json.loads(x) for x in
             (Path(cfg.run_dir) / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    assert trajs and all(t["info"]["exit_status"] == 0 and not t.get("discard") for t in trajs)
    first = sum(r["reward"] for r in rows[:4]) / 4
    last = sum(r["reward"] for r in rows[-4:]) / 4
    assert last > first, (first, last)


@pytest.mark.slow
def test_a_python_agent_in_another_virtualenv_trains(make_cfg, tmp_path):
    """A stdlib-only script (urllib) run by the python of a venv without agentrl."""
    venv = tmp_path / "venv"
    base = shutil.which("python3") or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    _trains(make_cfg, tmp_path, f"{venv / 'bin' / 'python'} {PY_AGENT}")


@pytest.fixture(scope="module")
def node_agent(tmp_path_factory) -> Path:
    """tests/trainers/node_agent with the `openai` npm package installed beside it (a copy in a
    temp dir: nothing is written into the repository); skipped where npm cannot install it."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed")
    where = tmp_path_factory.mktemp("node_agent")
    for name in ("agent.mjs", "package.json"):
        shutil.copy(HERE / "node_agent" / name, where / name)
    done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--silent"], cwd=where,
                          capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        pytest.skip(f"npm could not install the openai package: {done.stderr[-300:]}")
    return where / "agent.mjs"


@pytest.mark.slow
def test_a_node_agent_using_the_openai_package_trains(make_cfg, tmp_path, node_agent):
    _trains(make_cfg, tmp_path, f"node {node_agent}")


def test_an_agent_cmd_that_cannot_start_is_refused_before_any_model_loads(tmp_path):
    tasks = _tasks(tmp_path / "tasks.jsonl")
    with pytest.raises(ValueError, match=r"^--agent_cmd 'no-such-agent-x run' cannot start: "
                                         r"'no-such-agent-x' is not found on PATH$"):
        build_config(["--agent_cmd", "no-such-agent-x run", "--agent_tasks", tasks,
                      "--agent_reward", REWARD])
    with pytest.raises(ValueError, match="pass --agent .* or --agent_cmd .*, not both"):
        build_config(["--agent_cmd", "python3 a.py", "--agent", "m:f", "--agent_tasks", tasks,
                      "--agent_reward", REWARD])
    cfg = build_config(["--agent_cmd", "python3 a.py", "--agent_tasks", tasks,
                        "--agent_reward", REWARD, "--agent_concurrency", "3"])
    assert cfg.agent_run and cfg.agent_concurrency == 3 and cfg.eval_problems == 0


def test_the_session_environment_points_every_sdk_at_the_session():
    from servers.agent_processes import session_env

    env = session_env("http://127.0.0.1:5/sessions/ep3-ab/v1", "key")
    assert env == {"OPENAI_BASE_URL": "http://127.0.0.1:5/sessions/ep3-ab/v1",
                   "OPENAI_API_KEY": "key", "ANTHROPIC_BASE_URL": "http://127.0.0.1:5/sessions/ep3-ab",
                   "ANTHROPIC_API_KEY": "key", "AGENTRL_SESSION_ID": "ep3-ab"}
