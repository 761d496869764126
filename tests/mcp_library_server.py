"""An MCP server with progress, resources and prompts, for
tests/test_mcp_features.py: in process (`make_server()`), over stdio
(`python tests/mcp_library_server.py`) or over streamable HTTP
(`python tests/mcp_library_server.py --http [--port N]`: it prints the port it
listens on, on 127.0.0.1, once it listens; `--port` lets a test start it again
where it was).

A small library: books are resources (`library://books/dune` listed, any
`library://books/{title}` served through a template), `find` returns a
resource link, `count` reports progress, `wait` reports progress and then
waits for ever (for a test to kill the server mid-call), `review` is a prompt.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any, TypedDict

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, ResourceLink, TextContent

BOOKS = {"dune": "Dune, by Frank Herbert.", "emma": "Emma, by Jane Austen."}


class Pages(TypedDict):
    """A book's title and length (the output schema of `pages`)."""

    title: str
    pages: int


def make_server() -> MCPServer[Any]:
    """A fresh server."""
    server: MCPServer[Any] = MCPServer("library")

    @server.tool()
    async def count(steps: int, ctx: Context) -> str:
        """Count to `steps`, reporting progress at each step."""
        for step in range(1, steps + 1):
            await ctx.report_progress(step, steps, f"step {step}\x1b[2J")
        return f"counted to {steps}"

    @server.tool()
    async def wait(ctx: Context) -> str:
        """Report that it started, then wait for ever."""
        await ctx.report_progress(0, None, "waiting")
        await anyio.sleep_forever()
        return "never"

    @server.tool()
    def pid() -> int:
        """The server's process id."""
        return os.getpid()

    @server.tool()
    def find(title: str) -> CallToolResult:
        """Find a book: a link to it (a resource the server does not list)."""
        return CallToolResult(
            content=[
                TextContent(type="text", text=f"found {title}"),
                ResourceLink(
                    type="resource_link", uri=f"library://books/{title}", name=title
                ),
            ]
        )

    @server.tool()
    def summary(title: str) -> CallToolResult:
        """A book's summary: text, and structured content without a schema."""
        return CallToolResult(
            content=[TextContent(type="text", text=BOOKS[title])],
            structured_content={"title": title, "text": BOOKS[title]},
        )

    @server.tool()
    def pages(title: str) -> Pages:
        """A book's length (structured, with an output schema)."""
        return Pages(title=title, pages=412)

    @server.resource("library://books/dune", name="dune", mime_type="text/plain")
    def dune() -> str:
        return BOOKS["dune"]

    @server.resource("library://books/{title}", name="book", mime_type="text/plain")
    def book(title: str) -> str:
        return BOOKS.get(title, f"no book called {title}")

    @server.prompt()
    def review(title: str) -> str:
        """Ask for a short review of a book."""
        return f"Write a short review of {title}."

    return server


async def _serve_http(server: MCPServer[Any], port: int) -> None:
    """Serve streamable HTTP on `port` (0: one of the system's choosing),
    printed once the socket listens (connections made from then on wait in
    its backlog)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # started again
    sock.bind(("127.0.0.1", port))
    sock.listen(16)
    sys.stdout.write(f"{sock.getsockname()[1]}\n")
    sys.stdout.flush()
    config = uvicorn.Config(
        server.streamable_http_app(), log_level="warning", lifespan="on"
    )
    await uvicorn.Server(config).serve(sockets=[sock])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", action="store_true")
    parser.add_argument("--port", type=int, default=0)
    options = parser.parse_args()
    library = make_server()
    if options.http:
        anyio.run(_serve_http, library, options.port)
    else:
        library.run("stdio")
