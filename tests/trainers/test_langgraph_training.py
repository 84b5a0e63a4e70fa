"""#32 item 1: a LangGraph agent (examples/agents/langgraph_kv.py, unmodified LangGraph and
LangChain) trains through the proxy on the agent headline's task, key-value lookups whose
answers only its tools can read, with the embedded SmolLM2-135M: its reward rises."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from agentrl.command_line import deferred_validation
from trainers.controller import Trainer
from trainers.presets import kv_agent

ROOT = Path(__file__).resolve().parents[2]
STEPS, WINDOW = 8, 2


@pytest.mark.slow
@pytest.mark.embedded
def test_a_langgraph_agent_learns_to_read_its_tools(tmp_path):
    pytest.importorskip("langgraph")
    with deferred_validation():  # the preset alone names no agent; checked with it below
        preset = kv_agent()
    cfg = dataclasses.replace(
        preset, agent=f"{ROOT / 'examples' / 'agents' / 'langgraph_kv.py'}:agent",
        steps=STEPS, eval_problems=0, run_dir=str(tmp_path / "run"), use_ray=False,
        progress=False, tensorboard=False,
    )
    Trainer(cfg).run()
    rows = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert last >= first + 0.25, rewards
