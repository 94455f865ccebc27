"""A small MCP server for the adapter tests, run as a stdio subprocess:

    python tests/envs/mcp_test_server.py

Tools: `add` (two integers), `lookup` (a fixed table; an unknown key is a tool error the
model sees), `fail` (raises an unexpected exception: an ``isError`` result with a generic
message), `pid` (the server's process id, so a test can kill it), `sleep` (a hung tool) and `crash`
(exits at once).
"""

from __future__ import annotations

import os

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

TABLE = {"apple": "red", "banana": "yellow", "cherry": "dark red", "lime": "green", "plum": "purple"}

server = MCPServer("steprl-test", instructions="Arithmetic and a fruit colour table.", log_level="CRITICAL")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def lookup(key: str) -> str:
    """The colour of a fruit."""
    if key not in TABLE:
        raise ToolError(f"no entry for {key[:32]!r}; known: {', '.join(sorted(TABLE))}")
    return TABLE[key]


@server.tool()
def fail() -> str:
    """Always fails."""
    raise RuntimeError("boom")


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
async def sleep(seconds: float) -> str:
    """Sleep, then say so (a hung tool, for timeout tests)."""
    await anyio.sleep(seconds)
    return "awake"


@server.tool()
def crash() -> str:
    """Exit the server process at once."""
    os._exit(3)


if __name__ == "__main__":
    server.run("stdio")
