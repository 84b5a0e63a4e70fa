"""The headline's agents (examples/agents/: an OpenAI Agents SDK agent and a LangGraph agent)
through the real proxy, their model a scripted policy: one that calls the tool and reads its
answer succeeds, one that answers without the tool or with the wrong key fails, and every
episode is one trajectory with a turn per model call."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from agentrl.engine.fakes import FakeEngine
from agentrl.plugins import load_callable
from environments.kv_lookup import make_tasks, reward
from servers.agents import run_agents
from servers.app import create_app
from servers.config import ProxyConfig

ROOT = Path(__file__).resolve().parents[2]
AGENTS = {"openai-agents": ("agents", "openai_agents_kv.py"),
          "langgraph": ("langgraph", "langgraph_kv.py")}
# SmolLM2's template shows a tool's answer as its own turn.
TOOL_TURN = re.compile(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", re.DOTALL)


def _question_key(prompt: str) -> str:
    return re.findall(r"'(\w+)'", prompt.rsplit("<|im_start|>user", 1)[-1])[-1]


def _call(name: str, arguments: dict, *, newlines: bool = False) -> str:
    """A Hermes tool call, as SmolLM2 would write it (with or without the newlines)."""
    nl = "\n" if newlines else ""
    return f"<tool_call>{nl}{json.dumps({'name': name, 'arguments': arguments})}{nl}</tool_call>"


def reads_the_tool(prompt: str, _choice: int) -> str:
    """Calls lookup with the asked key, then answers with what came back."""
    answers = TOOL_TURN.findall(prompt)
    if answers:
        return f"The value is {answers[-1]}."
    return _call("lookup", {"key": _question_key(prompt)}, newlines=True)


def wrong_key(prompt: str, _choice: int) -> str:
    """Looks up another key of the store (listed by list_keys first), then answers with it."""
    answers = TOOL_TURN.findall(prompt)
    if len(answers) == 2:
        return f"The value is {answers[-1]}."
    if answers:
        other = next(k for k in answers[0].split(", ") if k != _question_key(prompt))
        return _call("lookup", {"key": other})
    return _call("list_keys", {})


def guesses(prompt: str, _choice: int) -> str:
    return "The value is 1234."


def _run(agent_name: str, tokenizer, reply, tasks):
    module, file = AGENTS[agent_name]
    pytest.importorskip(module)
    agent = load_callable(f"{ROOT / 'examples' / 'agents' / file}:agent")
    app = create_app(FakeEngine(tokenizer, reply=reply), tokenizer,
                     config=ProxyConfig(aliases=("embedded",)))
    return asyncio.run(run_agents(agent, tasks, app=app, reward_fn=reward))


@pytest.mark.parametrize("agent_name", sorted(AGENTS))
def test_an_agent_that_reads_its_tool_succeeds(agent_name, embedded_tokenizer):
    tasks = make_tasks("eval")[:4]
    trajs = _run(agent_name, embedded_tokenizer, reads_the_tool, tasks)
    assert [t.total_reward for t in trajs] == [1.0] * 4
    for t, task in zip(trajs, tasks, strict=True):
        # One session, one trajectory: the tool call's turn and the answer's, the second
        # prompt extending the first with the tool's answer (no drift).
        assert len(t.turns) == 2 and not t.discard and t.info["drift"] is False
        text = embedded_tokenizer.decode(t.token_ids)
        assert f"<|im_start|>tool\nThe value of '{task['key']}' is {task['answer']}." in text
        assert text.count("<|im_start|>system") == 1 and text.count('"name": "lookup"') == 2


@pytest.mark.parametrize("agent_name", sorted(AGENTS))
def test_an_agent_that_skips_or_misreads_its_tool_fails(agent_name, embedded_tokenizer):
    tasks = make_tasks("eval")[:4]
    assert [t.total_reward for t in _run(agent_name, embedded_tokenizer, guesses, tasks)] == [
        0.0] * 4
    trajs = _run(agent_name, embedded_tokenizer, wrong_key, tasks)
    assert [t.total_reward for t in trajs] == [0.0] * 4
    assert all(len(t.turns) == 3 for t in trajs)  # list_keys, lookup, answer
