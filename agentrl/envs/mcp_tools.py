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
elsewhere, which many envs share). A server that cannot start raises `MCPStartError` when the
env is built, with the command and the tail of its stderr, so a run fails before it trains.

The MCP client is async; each connection runs it on an event-loop thread of its own, so a sync
`step` can wait for a call with a deadline.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import difflib
import json
import logging
import math
import os
import re
import shlex
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agentrl.envs.chat import ChatEnv, StepResult
from agentrl.envs.template import Message

if TYPE_CHECKING:
    from mcp import Client
    from mcp_types import CallToolResult, Tool

logger = logging.getLogger(__name__)

_INSTALL = "pip install 'mcp>=2.3,<3'"
_STDERR_TAIL_LINES = 20
_STDERR_TAIL_CHARS = 2000
_CLOSE_TIMEOUT_S = 15.0  # the SDK's stdio shutdown: 0.5 s flush, 2 s grace, 2 s TERM, 2 s KILL


def _require_mcp() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError as e:
        raise ImportError(f"MCP tools need the `mcp` package (>= 2.3): {_INSTALL}") from e


class MCPStartError(RuntimeError):
    """An MCP server could not be started or reached (raised when the env is built)."""


class MCPServerError(RuntimeError):
    """An MCP server failed during an episode: `kind` is "timeout", "died" or "error"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclasses.dataclass(frozen=True, kw_only=True)
class MCPServerSpec:
    """Where the tools come from: a command to run (stdio) or a URL (streamable HTTP)."""

    command: tuple[str, ...] = ()
    """stdio: the program and its arguments, e.g. ("python", "kv_server.py")."""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """stdio: environment variables, over the MCP SDK's safe defaults (HOME, PATH, ...); the
    rest of this process's environment is not passed."""
    cwd: str | None = None
    """stdio: the server's working directory (default: this process's)."""
    url: str | None = None
    """Streamable HTTP: the server's MCP endpoint, e.g. "http://127.0.0.1:8000/mcp"."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "command", tuple(self.command))
        if bool(self.command) == bool(self.url):
            raise ValueError(
                "an MCP server is either {'command': [program, *args]} (stdio) or "
                "{'url': 'http://host:port/mcp'} (streamable HTTP); got "
                + ("both" if self.command else "neither")
            )
        if not all(isinstance(part, str) and part for part in self.command):
            raise TypeError(f"command must be a list of non-empty strings, got {self.command!r}")
        if self.url is not None and not re.match(r"^https?://", self.url):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise TypeError(f"env must map names to string values, got {dict(self.env)!r}")
        if self.url is not None and (self.env or self.cwd):
            raise ValueError("env and cwd apply to a server started by command, not to a url")

    @classmethod
    def from_config(cls, config: MCPServerSpec | Mapping[str, object]) -> MCPServerSpec:
        """A spec from a mapping as written in JSON: {"command": [...], "env": {...}} or
        {"url": ...}; unknown keys are refused with a did-you-mean."""
        if isinstance(config, MCPServerSpec):
            return config
        if not isinstance(config, Mapping):
            raise TypeError(f"server must be a mapping like {{'command': [...]}} or "
                            f"{{'url': ...}}, got {type(config).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in config:
            if key not in known:
                hint = difflib.get_close_matches(str(key), known, n=1)
                mean = f" Did you mean {hint[0]!r}?" if hint else ""
                raise ValueError(f"unknown MCP server key {key!r}.{mean} Known: {known}")
        command = config.get("command", ())
        if isinstance(command, str):
            raise TypeError(f"command must be a list (program and arguments), not a string; "
                            f"e.g. {shlex.split(command)!r}")
        return cls(**config)  # type: ignore[arg-type]

    def describe(self) -> str:
        """The command line or the URL, for messages."""
        return shlex.join(self.command) if self.command else str(self.url)


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a tool call returned: its text (text blocks joined; other blocks described, or the
    structured result as JSON when there is no text) and whether the tool reported an error."""

    text: str
    is_error: bool = False


class MCPConnection:
    """One session with an MCP server, its client running on an event-loop thread of its own.

    Built: the server is started (stdio) or reached (HTTP) and its tools listed, or
    `MCPStartError` is raised with the reason. `call` waits for a tool call at most
    `timeout_s`; a timeout or a lost server raises `MCPServerError` and stops the connection
    (a stdio server's process is stopped: stdin closed, then its process group terminated).
    `close()` waits until the process is gone. Not picklable: it holds a process.
    """

    def __init__(self, spec: MCPServerSpec, *, start_timeout_s: float = 60.0) -> None:
        _require_mcp()
        self.spec = spec
        # Closed by close(): the file outlives this call.
        self._stderr = (tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")  # noqa: SIM115
                        if spec.command else None)
        self._client: Client | None = None
        self._scope: Any = None  # the session's anyio CancelScope, set on the loop thread
        self._stopping = False
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"mcp {spec.describe()[:40]}")
        self._thread.start()
        self._ready: concurrent.futures.Future[list[Tool]] = concurrent.futures.Future()
        self._main = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        _OPEN.add(self)
        try:
            self.tools: list[Tool] = self._ready.result(timeout=start_timeout_s)
        except concurrent.futures.TimeoutError:
            why = (f"did not finish the MCP handshake within {start_timeout_s:g} s "
                   f"(start_timeout_s){self.stderr_tail()}")
            self.close()
            raise MCPStartError(f"the MCP server `{spec.describe()}` {why}") from None
        except BaseException as e:
            why = f"{_reason(e)}{self.stderr_tail()}"
            self.close()
            raise MCPStartError(f"could not start the MCP server `{spec.describe()}`: "
                                f"{why}") from e

    def __reduce__(self) -> Any:
        raise TypeError("an MCPConnection holds a live server and cannot be pickled; build a "
                        "new env from its spec in the other process")

    async def _serve(self) -> None:
        import anyio
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters, stdio_client

        with anyio.CancelScope() as scope:
            self._scope = scope
            if self._stopping:
                scope.cancel()
            try:
                if self.spec.command:
                    params = StdioServerParameters(
                        command=self.spec.command[0], args=list(self.spec.command[1:]),
                        env=dict(self.spec.env) or None, cwd=self.spec.cwd)
                    assert self._stderr is not None
                    client = Client(stdio_client(params, errlog=self._stderr), cache=None)
                else:
                    client = Client(str(self.spec.url), cache=None)
                async with client:
                    tools = await _list_tools(client)
                    self._client = client
                    self._ready.set_result(tools)
                    await anyio.sleep_forever()
            except BaseException as e:
                if not self._ready.done():
                    self._ready.set_exception(e)
                raise
        if not self._ready.done():
            self._ready.set_exception(MCPStartError("closed before it started"))

    @property
    def alive(self) -> bool:
        """The session is up (not stopped, and the server has not gone away)."""
        return self._client is not None and not self._stopping and not self._main.done()

    def call(self, name: str, arguments: Mapping[str, object], timeout_s: float) -> ToolResult:
        """Run a tool. A tool's error (or the server's JSON-RPC error answer) comes back as a
        `ToolResult` with `is_error`; the server failing raises `MCPServerError`."""
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        if not self.alive or self._client is None:
            raise self._fail("died", f"the MCP server `{self.spec.describe()}` is not running"
                             f"{self._main_error()}")
        coro = self._client.call_tool(name, dict(arguments))
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop has closed under us
            coro.close()
            raise self._fail("died", f"the MCP server `{self.spec.describe()}` is closed") from None
        waits: list[concurrent.futures.Future[Any]] = [future, self._main]
        done, _ = concurrent.futures.wait(waits, timeout=timeout_s,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        if future in done:
            try:
                return _tool_result(future.result())
            except MCPError as e:
                if e.code != CONNECTION_CLOSED:  # the server answered with an error
                    return ToolResult(f"{e.error.message}", is_error=True)
                raise self._fail("died", f"the MCP server `{self.spec.describe()}` closed the "
                                 f"connection during {name!r}{self.stderr_tail()}") from e
            except Exception as e:
                raise self._fail("error", f"the MCP call {name!r} to `{self.spec.describe()}` "
                                 f"failed: {_reason(e)}{self.stderr_tail()}") from e
        future.cancel()
        if self._main in done:
            raise self._fail("died", f"the connection to the MCP server `{self.spec.describe()}` "
                             f"ended during {name!r}{self._main_error()}{self.stderr_tail()}")
        stopped = "its process was stopped" if self.spec.command else "the session was closed"
        raise self._fail("timeout", f"the MCP tool {name!r} of `{self.spec.describe()}` did "
                         f"not answer within {timeout_s:g} s (call_timeout_s); {stopped}")

    def _fail(self, kind: str, message: str) -> MCPServerError:
        self.stop()
        return MCPServerError(kind, message)

    def _main_error(self) -> str:
        if not self._main.done() or self._main.cancelled():
            return ""
        error = self._main.exception()
        return f" ({_reason(error)})" if error is not None else ""

    def stderr_tail(self) -> str:
        """'; its stderr ends with:' and the last lines a stdio server wrote ('' if none)."""
        if self._stderr is None or self._stderr.closed:
            return ""
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        raw = os.pread(fd, _STDERR_TAIL_CHARS * 4, max(0, size - _STDERR_TAIL_CHARS * 4))
        lines = raw.decode("utf-8", "replace").rstrip().splitlines()[-_STDERR_TAIL_LINES:]
        text = "\n".join(lines)[-_STDERR_TAIL_CHARS:]
        return f"; its stderr ends with:\n{text}" if text.strip() else "; its stderr is empty"

    def stop(self) -> None:
        """End the session without waiting (a stdio server is then stopped on the loop
        thread); `close()` waits for it."""
        self._stopping = True
        try:
            self._loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:  # the loop is already closed
            pass

    def _cancel(self) -> None:
        if self._scope is not None:
            self._scope.cancel()

    def close(self) -> None:
        """Stop the session and wait until a stdio server's process is gone. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        try:
            self._main.exception(timeout=_CLOSE_TIMEOUT_S)
        except concurrent.futures.CancelledError:
            pass
        except concurrent.futures.TimeoutError:
            logger.warning("the MCP server `%s` did not stop within %g s", self.spec.describe(),
                           _CLOSE_TIMEOUT_S)
        try:
            asyncio.run_coroutine_threadsafe(_cancel_tasks(), self._loop).result(timeout=5.0)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():
            self._loop.close()
        if self._stderr is not None:
            self._stderr.close()
        _OPEN.discard(self)


async def _cancel_tasks() -> None:
    """Cancel what is left on a connection's loop (calls abandoned at their deadline)."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


_OPEN: set[MCPConnection] = set()


@atexit.register
def _close_open_connections() -> None:
    """No stdio server outlives this process when an env was never closed."""
    for connection in list(_OPEN):
        connection.close()


async def _list_tools(client: Client) -> list[Tool]:
    tools: list[Tool] = []
    cursor: str | None = None
    for _ in range(100):  # a paginator that never ends cannot hang the start
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return tools


def _reason(error: BaseException) -> str:
    """The innermost error of an anyio exception group, as 'Type: message'."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _tool_result(result: CallToolResult) -> ToolResult:
    parts: list[str] = []
    for block in result.content:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(str(getattr(block, "text", "")))
        elif kind == "resource" and hasattr(getattr(block, "resource", None), "text"):
            parts.append(str(block.resource.text))  # type: ignore[union-attr]
        else:
            mime = getattr(block, "mime_type", None) or getattr(block, "uri", None) or ""
            parts.append(f"[{kind or 'content'} {mime}]".replace(" ]", "]"))
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return ToolResult("\n".join(parts), is_error=bool(result.is_error))


def openai_tool(tool: Tool) -> dict[str, object]:
    """An MCP tool as an OpenAI function schema (what chat templates render as `tools`)."""
    function: dict[str, object] = {"name": tool.name, "description": tool.description or "",
                                   "parameters": dict(tool.input_schema)}
    return {"type": "function", "function": function}


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
_CALL_FORMAT = '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'


@dataclasses.dataclass(frozen=True)
class ToolCallText:
    """One Hermes-style call found in the policy's text: a name and arguments, or an error."""

    name: str = ""
    arguments: Mapping[str, object] = dataclasses.field(default_factory=dict)
    error: str | None = None


def find_tool_calls(text: str) -> list[ToolCallText]:
    """The `<tool_call>{json}</tool_call>` blocks in `text`, in order; a block left unclosed at
    the end counts (the policy stopped right after it). Arguments may be a JSON string."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
            args = obj.get("arguments", {}) if isinstance(obj, dict) else None
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as e:
            calls.append(ToolCallText(error=f"Error: the tool call is not valid JSON ({e}). "
                                            f"Write {_CALL_FORMAT}"))
            continue
        name = obj.get("name") if isinstance(obj, dict) else None
        if not isinstance(name, str) or not isinstance(args, dict):
            calls.append(ToolCallText(error=f"Error: a tool call needs a string \"name\" and an "
                                            f"object of \"arguments\". Write {_CALL_FORMAT}"))
            continue
        calls.append(ToolCallText(name=name, arguments=args))
    return calls


_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def fold_tools(messages: list[Message], tools: Sequence[Mapping[str, object]]) -> list[Message]:
    """The tool schemas in the system message, in the Hermes wording Qwen's template uses (for
    chat templates that ignore `tools`, such as SmolLM2's)."""
    block = _TOOLS_PREAMBLE + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    block += _TOOLS_POSTAMBLE
    if messages and messages[0].get("role") == "system" and isinstance(
            messages[0].get("content"), str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


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
