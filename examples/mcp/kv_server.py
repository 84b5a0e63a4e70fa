"""A key-value store as an MCP server, built with the `mcp` package's MCPServer (FastMCP in mcp 1).

    python examples/mcp/kv_server.py              # stdio: what MCPToolEnv's {"command": [...]} runs
    python examples/mcp/kv_server.py --http 8000  # streamable HTTP at http://127.0.0.1:8000/mcp

Each stdio process holds its own store, so an episode that starts its own server starts empty.
"""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("kv")
_store: dict[str, str] = {}


@app.tool()
def put(key: str, value: str) -> str:
    """Store `value` under `key` (replacing what was there)."""
    _store[key] = value
    return f"stored {key!r}"


@app.tool()
def get(key: str) -> str:
    """The value stored under `key`."""
    if key not in _store:
        raise ToolError(f"no value under {key!r}; the keys are {sorted(_store)}")
    return _store[key]


@app.tool()
def keys() -> list[str]:
    """Every key in the store."""
    return sorted(_store)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http"]:
        app.run("streamable-http", port=int(sys.argv[2]))
    else:
        app.run()
