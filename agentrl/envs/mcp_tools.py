"""An MCP server's tools as an environment's tools: `MCPToolEnv` wraps a task (a `ChatEnv`).

The server (https://modelcontextprotocol.io, the `mcp` package >= 2.3) is started over stdio or
reached over streamable HTTP when the env is built. Its tools are listed into the prompt as
OpenAI function schemas, and the policy's Hermes-style calls,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, run on it:

    from agentrl.envs.mcp_tools import MCPToolEnv

    class StoreTask(agentrl.ChatEnv):        # the task and its reward are yours
        def __init__(self, call_tool):         # optional: the server, to read its state
            self.call_tool = call_tool
        def reset(self, *, seed=None, options=None):
            self.value = str(self.np_random.integers(100))
            return [{"role": "user", "content": f"Store {self.value} under 'x', then say done."}]
        def step(self, text):                  # turns without a tool call come here
            stored = self.call_tool("get", {"key": "x"}).text
            return [], float(stored == self.value), True, False, {}

    env = MCPToolEnv(StoreTask, server={"command": ["python", "kv_server.py"]})
    token_env = agentrl.ChatTokenEnv(env, tokenizer="tiny")   # or register a factory

A turn with tool calls runs them (at most `max_calls_per_turn`) and answers with one `tool`
message each; reward 0, the episode goes on. A tool's own error (`isError`), an unknown tool or
a call that is not JSON is an observation saying so: the policy's mistake, for it to read. A
turn without tool calls goes to the task's `step`, which gives the reward and ends the episode.

The server failing is not the policy's mistake: a call past `call_timeout_s`, or a server that
exits or drops the connection, ends the episode truncated with `info["discard"]` (trainers and
evaluators drop it), `info["error"]` and `info["mcp_failure"]` ("timeout" | "died" | "error"),
the convention of `agentrl.types.Trajectory.discard`. A stdio server that failed is stopped at
once, so a hung tool cannot keep its process; the next `reset` starts a new one.

Server: `{"command": [...], "env": {...}, "cwd": ...}` for stdio (a process of this env's own,
stopped by `close()`; the rollout loop builds an env per episode, so each episode gets a fresh
server), or `{"url": "http://host:port/mcp"}` for streamable HTTP (a session on a server run
elsewhere, which many envs share). A server that cannot start raises `MCPStartError`
(`agentrl.envs.mcp_connection`) when the env is built, with the command and the tail of its
stderr, so a run fails before it trains.

The session with the server, its deadlines and its failures are `agentrl.envs.mcp_connection`'s.
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from agentrl.envs.chat import ChatEnv, StepResult
from agentrl.envs.mcp_connection import (
    MCPConnection,
    MCPServerError,
    MCPServerSpec,
    ToolResult,
    openai_tool,
)
from agentrl.envs.template import Message
from agentrl.envs.tool_calls import ToolCallText, find_tool_calls, fold_tools

logger = logging.getLogger(__name__)

CallTool = Callable[[str, Mapping[str, object]], ToolResult]
"""`call_tool(name, arguments)`: a tool call on the env's server (a task that reads its state)."""

TOOLS_IN = ("system", "template")


class MCPToolEnv(ChatEnv):
    """A task (`ChatEnv`) whose tools are an MCP server's (module docstring).

    Args:
        task: the task: a `ChatEnv` (its `reset` gives the prompt, its `step` gets the turns
            without tool calls and gives the reward), or a function taking `call_tool` and
            returning one, for a task that reads the server's state.
        server: `{"command": [...], "env": {...}, "cwd": ...}` (stdio) or `{"url": ...}`
            (streamable HTTP), or an `MCPServerSpec`.
        call_timeout_s: longest a tool call may take; past it the episode is discarded and a
            stdio server stopped. Keep `max_calls_per_turn * call_timeout_s` under the
            rollout's `env_timeout_s` (300 s in training) so this deadline is the one that acts.
        start_timeout_s: longest the server may take to start and list its tools.
        max_calls_per_turn: calls run per turn; further ones answer that they were not run.
        max_result_chars: a tool's answer is cut to this many characters.
        tools_in: "system" (default) writes the schemas into the system message in the Hermes
            wording, which every chat template shows; "template" passes them as `tools` to
            the chat template, for a template that renders them in the Hermes format
            (Qwen2.5/3). SmolLM2's template ignores `tools`.
        new_server_per_episode: start a new stdio server (a new HTTP session) at every reset
            after the first, so a stateful server's state does not carry over; otherwise a
            new one starts only after the old one failed.
    """

    def __init__(
        self,
        task: ChatEnv | Callable[[CallTool], ChatEnv],
        server: MCPServerSpec | Mapping[str, object],
        *,
        call_timeout_s: float = 30.0,
        start_timeout_s: float = 60.0,
        max_calls_per_turn: int = 8,
        max_result_chars: int = 4000,
        tools_in: str = "system",
        new_server_per_episode: bool = False,
    ) -> None:
        for name, value in (("call_timeout_s", call_timeout_s),
                            ("start_timeout_s", start_timeout_s)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name, count in (("max_calls_per_turn", max_calls_per_turn),
                            ("max_result_chars", max_result_chars)):
            if not isinstance(count, int) or count < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {count!r}")
        if tools_in not in TOOLS_IN:
            hint = difflib.get_close_matches(str(tools_in), TOOLS_IN, n=1)
            mean = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ValueError(f"tools_in must be one of {TOOLS_IN}, got {tools_in!r}{mean}")
        self.spec = MCPServerSpec.from_config(server)
        self.call_timeout_s = float(call_timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.max_calls_per_turn = max_calls_per_turn
        self.max_result_chars = max_result_chars
        self.tools_in = tools_in
        self.new_server_per_episode = new_server_per_episode
        self._connection = MCPConnection(self.spec, start_timeout_s=self.start_timeout_s)
        try:
            self.task = task if isinstance(task, ChatEnv) else task(self.call_tool)
            if not isinstance(self.task, ChatEnv):
                raise TypeError(f"task must be a ChatEnv or a function returning one, got "
                                f"{type(self.task).__name__}")
            if self.task.tools:
                raise ValueError(f"{type(self.task).__name__} has tools of its own; with "
                                 f"MCPToolEnv the tools are the server's")
        except BaseException:
            self._connection.close()
            raise
        self.server_tools = [openai_tool(t) for t in self._connection.tools]
        self.tool_names = [t.name for t in self._connection.tools]
        self.tools = self.server_tools if tools_in == "template" else None
        self._fresh = True
        self._num_calls = self._num_errors = 0

    def call_tool(self, name: str, arguments: Mapping[str, object]) -> ToolResult:
        """A call on the server with the env's deadline (`MCPServerError` if the server fails)."""
        return self._connection.call(name, arguments, self.call_timeout_s)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        if not self._fresh and (self.new_server_per_episode or not self._connection.alive):
            self._restart()
        self._fresh = False
        if hasattr(self, "np_random"):
            self.task.np_random = self.np_random
        out = self.task.reset(seed=seed, options=options)
        messages, info = out if isinstance(out, tuple) else (out, {})
        messages = [dict(m) for m in messages]
        if self.tools_in == "system":
            messages = fold_tools(messages, self.server_tools)
        self._num_calls = self._num_errors = 0
        return messages, {**info, **self._counts()}

    def _restart(self) -> None:
        self._connection.close()
        self._connection = MCPConnection(self.spec, start_timeout_s=self.start_timeout_s)
        tools = [openai_tool(t) for t in self._connection.tools]
        if tools != self.server_tools:
            self._connection.close()  # and again at the next reset: the prompt would be wrong
            raise MCPServerError("error", f"the MCP server `{self.spec.describe()}` lists other "
                                 f"tools since it restarted than the prompt shows; build a new env")

    def step(self, assistant_text: str) -> StepResult:
        calls = find_tool_calls(assistant_text)
        try:
            if not calls:
                new, reward, terminated, truncated, info = self.task.step(assistant_text)
                return list(new), reward, terminated, truncated, {**info, **self._counts()}
            messages = [self._run(call, i) for i, call in enumerate(calls)]
        except MCPServerError as e:
            logger.warning("MCP episode discarded: %s", e)
            info = {**self._counts(), "discard": True, "error": repr(e), "mcp_failure": e.kind,
                    "truncated_by": "mcp_server"}
            return [], 0.0, False, True, info
        return messages, 0.0, False, False, self._counts()

    def _run(self, call: ToolCallText, index: int) -> Message:
        error = self._refusal(call, index)
        if error is None:
            self._num_calls += 1
            result = self.call_tool(call.name, call.arguments)
            if not result.is_error:
                return self._message(call.name, result.text or "(no output)")
            error = result.text if result.text.startswith("Error") else f"Error: {result.text}"
        self._num_errors += 1
        return self._message(call.name, error)

    def _refusal(self, call: ToolCallText, index: int) -> str | None:
        """Why a call is not run (None: it is)."""
        if index >= self.max_calls_per_turn:
            return f"(call not run: at most {self.max_calls_per_turn} tool calls per turn)"
        if call.error is not None:
            return call.error
        if call.name not in self.tool_names:
            hint = difflib.get_close_matches(call.name, self.tool_names, n=1)
            mean = f" Did you mean {hint[0]!r}?" if hint else ""
            return f"Error: unknown tool {call.name!r}.{mean} The tools are: " + ", ".join(
                self.tool_names)
        return None

    def _message(self, name: str, text: str) -> Message:
        if len(text) > self.max_result_chars:
            cut = len(text) - self.max_result_chars
            text = f"{text[:self.max_result_chars]}... [{cut} more characters cut]"
        return {"role": "tool", "name": name, "content": text}

    def _counts(self) -> dict[str, int]:
        return {"num_tool_calls": self._num_calls, "num_tool_errors": self._num_errors}

    def close(self) -> None:
        """Close the task, then the server (its process is gone when this returns)."""
        try:
            self.task.close()
        finally:
            self._connection.close()
