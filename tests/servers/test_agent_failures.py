"""Agents that fail do not stall the others (#32 item 6): an agent that raises, exits non-zero
or sends no request for `timeout_s` is ended (a command agent's process group killed), its
recorded turns kept and discarded with the reason; no command agent outlives the process that
ran it, even one killed by SIGKILL."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.engine.fakes import FakeEngine
from servers.agent_processes import CommandAgent, command_argv
from servers.agents import run_agents
from servers.app import create_app
from tests.processes import alive, still_alive

SCRIPT = Path(__file__).with_name("agent_cmd_fixture.py")
CMD = f"python3 -S {SCRIPT}"




def _run(tok, agent, tasks, **kw):
    return asyncio.run(run_agents(agent, tasks, app=create_app(FakeEngine(tok), tok), **kw))


def test_a_command_agent_runs_in_its_session_and_its_last_line_is_scored(tok):
    answers = []

    def reward(task, answer):
        answers.append(answer)
        return 1.0

    [traj] = _run(tok, CommandAgent(CMD), [{"prompt": "hi", "calls": 2}], reward_fn=reward)
    assert answers == ["Hello! The answer is 42."]  # the last stdout line, not "thinking..."
    assert not traj.discard and traj.total_reward == 1.0 and len(traj.turns) == 2
    assert traj.info["exit_status"] == 0
    assert f"session {traj.info['session_id']}" in traj.info["stderr_tail"]
    assert traj.info["agent"] == {"status": "finished", "tokens": traj.num_policy_tokens}


def test_failed_and_silent_agents_are_ended_and_the_others_go_on(tok, tmp_path):
    pid_file = tmp_path / "pids"
    tasks = [{"prompt": "ok"}, {"prompt": "a", "then": "exit"},
             {"prompt": "b", "then": "spawn_and_hang", "pid_file": str(pid_file)}]
    t0 = time.monotonic()
    ok, failed, silent = _run(tok, CommandAgent(CMD), tasks, timeout_s=1.0,
                              reward_fn=lambda task, answer: 1.0)
    assert time.monotonic() - t0 < 20
    assert not ok.discard and ok.total_reward == 1.0
    # Their recorded turns are kept, discarded, with the reason.
    assert failed.discard and failed.turns and failed.info["exit_status"] == 3
    assert failed.info["agent"]["status"] == "failed" and failed.info["agent"]["cause"] == "exit"
    assert "exited with status 3: the agent gave up" in failed.info["error"]
    assert silent.discard and silent.turns and silent.info["agent"]["status"] == "timed_out"
    assert "sent no request for 1 s" in silent.info["error"]
    # Its process group (the agent and the child it started) was killed.
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) == 2 and still_alive(pids, 5) == []


def test_a_function_agent_that_raises_or_hangs_is_ended(tok):
    import openai

    async def agent(task, base_url, api_key):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as c:
            await c.chat.completions.create(model="agentrl",
                                            messages=[{"role": "user", "content": task}])
        if task == "raise":
            raise RuntimeError("tool broke")
        if task == "hang":
            await asyncio.sleep(600)
        return "done"

    ok, raised, hung = _run(tok, agent, ["ok", "raise", "hang"], timeout_s=0.5,
                            reward_fn=lambda task, answer: 1.0)
    assert not ok.discard and ok.info["agent"]["status"] == "finished"
    assert raised.discard and raised.turns and raised.info["error"] == "RuntimeError: tool broke"
    assert raised.info["agent"] == {"status": "failed", "cause": "raised",
                                    "tokens": raised.num_policy_tokens}
    assert hung.discard and hung.info["agent"]["status"] == "timed_out"


def test_an_agent_that_calls_nothing_leaves_a_discarded_placeholder(tok):
    [traj] = _run(tok, lambda task, url, key: "no call", ["x"], group_prefix="s0-")
    assert traj.discard and traj.token_ids == [] and traj.group == "s0-0"
    assert traj.info["agent"]["cause"] == "no_calls" and traj.info["task_index"] == 0


def test_a_group_whose_episodes_all_fail_is_reported(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="servers.agents"):
        trajs = _run(tok, CommandAgent(CMD), [{"then": "exit"}, {"prompt": "ok"}],
                     n_samples_per_task=2, group_prefix="s3-")
    assert [t.discard for t in trajs] == [True, True, False, False]
    reports = [r.getMessage() for r in caplog.records if "every episode" in r.getMessage()]
    assert len(reports) == 1 and "group s3-0 was discarded (exit)" in reports[0]


def test_a_command_that_cannot_start_is_named_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^--agent_cmd 'no-such-agent-x --go' cannot start: "
                                         r"'no-such-agent-x' is not found on PATH$"):
        command_argv("no-such-agent-x --go")
    script = tmp_path / "agent.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(ValueError, match=r"cannot start: .*agent.sh is not executable"):
        command_argv(str(script))
    with pytest.raises(ValueError, match="cannot start: No closing quotation"):
        command_argv("python3 'agent.py")


_DRIVER = """
import asyncio, sys
from agentrl.engine.fakes import FakeEngine
from agentrl.models import load_tokenizer
from servers.agent_processes import CommandAgent
from servers.agents import run_agents
from servers.app import create_app
tok = load_tokenizer("tiny")
task = {"then": "spawn_and_hang", "pid_file": sys.argv[2]}
asyncio.run(run_agents(CommandAgent(sys.argv[1]), [task], app=create_app(FakeEngine(tok), tok)))
"""


def test_no_command_agent_outlives_a_killed_trainer(tmp_path):
    pid_file = tmp_path / "pids"
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, CMD, str(pid_file)],
                              cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid_file.exists(), "the agent did not start"
        pids = [int(p) for p in pid_file.read_text().split()]
        assert all(map(alive, pids))
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        assert still_alive(pids, 10) == []
    finally:
        driver.kill()
        driver.wait()


def test_an_agents_error_is_logged_with_its_control_sequences_escaped(tok, caplog):
    """What an agent raises (or a command agent writes to stderr) reaches the log as visible
    escapes: printed to a terminal, it cannot set the clipboard or clear the screen."""

    async def agent(task, base_url, api_key):
        raise RuntimeError("boom \x1b]52;c;ZXZpbA==\x07 \x1b[2J \u202e")

    caplog.set_level(logging.WARNING, logger="servers.agents")
    [traj] = _run(tok, agent, [{"prompt": "hi"}], reward_fn=lambda task, answer: 0.0)
    assert traj.discard
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "\\x1b]52" in logged and "\\u202e" in logged
    assert "\x1b" not in logged and "\x07" not in logged and "\u202e" not in logged
