"""A session with an MCP server (https://modelcontextprotocol.io, the `mcp` package >= 2.3) that
sync code can use with deadlines: `MCPConnection`.

The MCP client is async; a connection runs it on an event-loop thread of its own, and `call`
waits for a tool call at most its timeout. The server is `MCPServerSpec`: a command started
over stdio (a process of the connection's own, its stderr kept in a temporary file whose tail
goes into error messages) or a streamable-HTTP URL (a session on a server run elsewhere).
`agentrl.envs.mcp_tools.MCPToolEnv` makes the tools an environment's.

Failures are sorted by whose they are. A tool's own error and a JSON-RPC error answer are the
caller's to read (`ToolResult.is_error`). The server failing raises `MCPServerError`: "timeout"
(a call past its deadline), "died" (it exited or the connection ended) or "error" (anything
else); the connection is then stopped, a stdio server's process with it (stdin closed, then
its process group terminated and killed, the MCP SDK's shutdown). A server that cannot start
raises `MCPStartError` with its command or URL and the tail of its stderr.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import difflib
import json
import logging
import os
import re
import shlex
import tempfile
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

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
    """An MCP server could not be started or reached (raised when its connection is built)."""


class MCPServerError(RuntimeError):
    """An MCP server failed after it started: `kind` is "timeout", "died" or "error"."""

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
