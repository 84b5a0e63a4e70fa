"""An OpenAI Agents SDK agent, as its users write one, trained by RL through agentrl's gateway.

    agentrl train --preset kv-agent --agent examples/agents/openai_agents_kv.py:agent

The agent answers a question about a private key-value store that only its two function tools
can read (`lookup(key)`, `list_keys()`; environments/kv_lookup has the tasks, the tools'
answers and the reward). It uses the SDK's default model class, `OpenAIResponsesModel`, which
speaks the Responses API, pointed at the episode's session by its base URL; the SDK runs its
usual loop (model call, tool calls, model call again, ...) for up to `MAX_TURNS` model calls.
The first call must call a tool (`tool_choice="required"`, which the SDK lifts once a tool has
run), so a call is always well-formed: what is scored is which tool, which key, and whether the
answer repeats what the tool returned.
Nothing in the SDK is changed or patched: agentrl records every token of every call in the
session and trains on them.

Needs `openai-agents` (`pip install -e ".[examples]"`; `make setup` installs it).
"""

from __future__ import annotations

import logging
from typing import Any

import openai
from agents import (
    Agent,
    AgentsException,
    FunctionTool,
    ModelSettings,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)

from agentrl.http_client import async_http_client
from environments.kv_lookup import AGENT_INSTRUCTIONS as INSTRUCTIONS
from environments.kv_lookup import AGENT_MAX_TOKENS as MAX_TOKENS
from environments.kv_lookup import AGENT_MAX_TURNS as MAX_TURNS
from environments.kv_lookup import list_keys, lookup

logger = logging.getLogger(__name__)


def kv_tools(store: dict[str, str]) -> list[FunctionTool]:
    """The task's tools, reading its own store."""

    @function_tool(name_override="lookup")
    def lookup_key(key: str) -> str:
        """Return the value stored under a key.

        Args:
            key: The key to look up.
        """
        return lookup(store, key)

    @function_tool(name_override="list_keys")
    def list_store_keys() -> str:
        """List the keys in the store."""
        return list_keys(store)

    return [lookup_key, list_store_keys]


async def agent(task: dict[str, Any], base_url: str, api_key: str) -> str:
    """One episode: the SDK agent on `task`'s question, its model the session at `base_url`.
    Returns the agent's final answer ("" when the SDK gave up, e.g. after MAX_TURNS calls)."""
    # No client timeout: a call may wait behind a whole batch of episodes; agentrl ends an
    # agent that stops sending requests (--agent_timeout_s).
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                http_client=async_http_client(timeout_s=None))
    bot = Agent(
        name="kv",
        instructions=INSTRUCTIONS,
        tools=kv_tools(task["store"]),
        model=OpenAIResponsesModel(model="agentrl", openai_client=client),
        # The first call must be one tool call (the proxy constrains sampling to the tools'
        # schemas); once a tool has run, the SDK resets tool_choice and the model may answer.
        model_settings=ModelSettings(temperature=1.0, max_tokens=MAX_TOKENS,
                                     tool_choice="required", parallel_tool_calls=False),
    )
    try:
        result = await Runner.run(bot, task["question"], max_turns=MAX_TURNS,
                                  run_config=RunConfig(tracing_disabled=True))
    except AgentsException as e:
        # Too many turns, a call to an unknown tool, ...: for RL an episode like any other,
        # scored 0; its turns are recorded all the same.
        logger.debug("agent gave up: %s: %s", type(e).__name__, e)
        return ""
    finally:
        await client.close()
    return str(result.final_output)
