"""A step's agent counts (#32 item 7): agents started, finished, failed by cause and timed out;
their segments and drift; tokens sampled per agent."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agentrl.engine.fakes import FakeEngine
from servers.agent_processes import CommandAgent
from servers.agents import run_agents
from servers.app import create_app
from trainers.config import AlgoConfig
from trainers.rl_step import agent_metrics, training_batch

CMD = f"python3 -S {Path(__file__).parents[1] / 'servers' / 'agent_cmd_fixture.py'}"


def test_a_steps_agents_are_counted_by_how_they_ended(tiny_tokenizer):
    tok = tiny_tokenizer
    tasks = [{"prompt": "ok", "calls": 2}, {"prompt": "ok"}, {"then": "exit"}, {"then": "hang"}]
    trajs = asyncio.run(run_agents(CommandAgent(CMD), tasks, timeout_s=1.0,
                                   app=create_app(FakeEngine(tok), tok),
                                   reward_fn=lambda task, answer: 1.0))
    _, _, metrics = training_batch(trajs, AlgoConfig(), max_new_tokens=64)
    segments = [t for t in trajs if t.turns]
    drift = sum(bool(t.info["drift"]) for t in segments)
    assert {k: v for k, v in metrics.items() if k.startswith("agent")} == {
        "agents_started": 4.0, "agents_finished": 2.0, "agents_failed": 1.0,
        "agents_failed_exit": 1.0, "agents_timed_out": 1.0,
        "agent_segments": float(len(segments)), "agent_drift": float(drift),
        "agent_calls_capped": 0.0,
    }
    assert len(segments) == 4 + drift
    assert metrics["tokens_per_agent"] == sum(t.num_policy_tokens for t in trajs) / 4 > 0
    assert agent_metrics([t for t in trajs if False], max_new_tokens=64) == {}
