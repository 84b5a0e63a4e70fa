"""A LangGraph agent on the same task as openai_agents_kv.py, trained the same way:

    agentrl train --preset kv-agent --agent examples/agents/langgraph_kv.py:agent

The usual LangGraph tool loop, written out: a model node (LangChain's `ChatOpenAI` with the
tools bound, speaking Chat Completions to the episode's session), a `ToolNode` that runs the
calls, and `tools_condition` between them; `MAX_TURNS` model calls at most (LangGraph's
recursion limit). The first call must call a tool (`tool_choice="required"`). The tools read
the task's own store (environments/kv_lookup). Nothing in LangGraph or LangChain is changed or
patched.

Needs `langgraph` and `langchain-openai` (`pip install -e ".[examples]"`; `make setup`
installs them).
"""

from __future__ import annotations

import logging
from typing import Any

from langchain_core.messages import AnyMessage, SystemMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from agentrl.http_client import async_http_client
from environments.kv_lookup import AGENT_INSTRUCTIONS as INSTRUCTIONS
from environments.kv_lookup import AGENT_MAX_TOKENS as MAX_TOKENS
from environments.kv_lookup import AGENT_MAX_TURNS as MAX_TURNS
from environments.kv_lookup import list_keys, lookup

logger = logging.getLogger(__name__)


def kv_tools(store: dict[str, str]) -> list[BaseTool]:
    """The task's tools, reading its own store."""

    @tool("lookup")
    def lookup_key(key: str) -> str:
        """Return the value stored under a key."""
        return lookup(store, key)

    @tool("list_keys")
    def list_store_keys() -> str:
        """List the keys in the store."""
        return list_keys(store)

    return [lookup_key, list_store_keys]


def build_graph(llm: ChatOpenAI, tools: list[BaseTool]) -> Any:
    """model -> (tools -> model)* -> end, the tool loop of LangGraph's own examples. The first
    model call must call one tool (as the Agents SDK agent's `tool_choice="required"`), later
    ones may answer."""
    first = llm.bind_tools(tools, tool_choice="required", parallel_tool_calls=False)
    then = llm.bind_tools(tools, parallel_tool_calls=False)

    async def call_model(state: MessagesState) -> dict[str, list[AnyMessage]]:
        used_tools = any(isinstance(m, ToolMessage) for m in state["messages"])
        model = then if used_tools else first
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile()


async def agent(task: dict[str, Any], base_url: str, api_key: str) -> str:
    """One episode: the graph on `task`'s question, its model the session at `base_url`.
    Returns the last model message's text ("" when the graph ran out of turns)."""
    # No client timeout: a call may wait behind a whole batch of episodes; agentrl ends an
    # agent that stops sending requests (--agent_timeout_s).
    async with async_http_client(timeout_s=None) as http:
        llm = ChatOpenAI(model="agentrl", base_url=base_url, api_key=api_key,
                         max_tokens=MAX_TOKENS, temperature=1.0, max_retries=0,
                         http_async_client=http)
        graph = build_graph(llm, kv_tools(task["store"]))
        messages = [SystemMessage(INSTRUCTIONS), ("user", task["question"])]
        try:
            # Each model call and each tool round is a step: 2 * MAX_TURNS - 1 steps allow
            # MAX_TURNS model calls.
            state = await graph.ainvoke({"messages": messages},
                                        {"recursion_limit": 2 * MAX_TURNS - 1})
        except GraphRecursionError:
            logger.debug("agent ran out of turns on %s", task.get("id"))
            return ""
    return str(state["messages"][-1].content)
