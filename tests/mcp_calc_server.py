"""An MCP server for tests/test_mcp.py: in process (`make_server()`), over stdio
(`python tests/mcp_calc_server.py`) or over streamable HTTP
(`python tests/mcp_calc_server.py --http`: it prints the port it listens on,
on 127.0.0.1, once it listens).

It counts on the server side what the tests check from the client's: the
sessions opened (`server/discover`, or `initialize` before 2026-07-28), the
calls, and the calls the client cancelled.
"""

from __future__ import annotations

import os
import socket
import sys
from collections import Counter
from typing import Any

import anyio
from mcp.server.context import CallNext, ServerRequestContext
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, TextContent
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

SESSION_METHODS = frozenset({"server/discover", "initialize"})


def make_server() -> MCPServer[Any]:
    """A fresh server (each with its own counts and tools)."""
    seen: Counter[str] = Counter()

    async def count(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> Any:
        seen[ctx.method] += 1
        return await call_next(ctx)

    server: MCPServer[Any] = MCPServer("calc", middleware=[count])
    server.seen = seen  # type: ignore[attr-defined]  # read by in-process tests

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def divide(a: float, b: float) -> float:
        """Divide a by b."""
        return a / b  # b == 0 raises: the server answers is_error

    @server.tool()
    def weather(city: str) -> CallToolResult:
        """The weather in a city (structured, with a text summary)."""
        if city != "Lisbon":
            return CallToolResult(
                content=[TextContent(type="text", text=f"no weather for {city}")],
                is_error=True,
            )
        return CallToolResult(
            content=[TextContent(type="text", text="Sunny, 18 C")],
            structured_content={"sky": "sunny", "celsius": 18},
        )

    @server.tool(structured_output=False)
    def shout(text: str) -> str:
        """Say it loudly (text content only)."""
        return text.upper()

    @server.tool()
    async def slow(seconds: float) -> str:
        """Wait, then answer."""
        await anyio.sleep(seconds)
        return "done"

    @server.tool()
    def stats() -> dict[str, int]:
        """What the server has seen: sessions, calls, cancelled calls, its pid."""
        return {
            "sessions": sum(seen[m] for m in SESSION_METHODS),
            "calls": seen["tools/call"],
            "cancelled": seen["notifications/cancelled"],
            "pid": os.getpid(),
        }

    @server.tool()
    async def grow(ctx: Context) -> str:
        """Add the tool `multiply` and say the tool list changed."""

        def multiply(a: int, b: int) -> int:
            """Multiply two integers."""
            return a * b

        if "multiply" not in {t.name for t in await server.list_tools()}:
            server.add_tool(multiply)
        # Each protocol era has its own way to say it.
        if ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
            await ctx.notify_tools_changed()
        else:
            await ctx.session.send_tool_list_changed()
        return "multiply added"

    return server


async def _serve_http(server: MCPServer[Any]) -> None:
    """Serve streamable HTTP on a port of the system's choosing, printed once
    the socket listens (connections made from then on wait in its backlog)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sys.stdout.write(f"{sock.getsockname()[1]}\n")
    sys.stdout.flush()
    config = uvicorn.Config(
        server.streamable_http_app(), log_level="warning", lifespan="on"
    )
    await uvicorn.Server(config).serve(sockets=[sock])


if __name__ == "__main__":
    calc = make_server()
    if sys.argv[1:] == ["--http"]:
        anyio.run(_serve_http, calc)
    else:
        calc.run("stdio")
