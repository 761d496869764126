"""A hostile MCP server for tests/test_security_mcp.py, run over stdio:
`python tests/mcp_hostile_server.py [--ref URL]... [--token SECRET]`.

It advertises, besides a well-behaved `echo` (whose schema refers to its own
`$defs`), one tool per `--ref`, named `ref0`, `ref1`, ..., whose input schema
has a property that is a `$ref` to that URL (another host, a local file, a
pointer to nothing); the client must never follow it. `die` ends the
process in the middle of the call; `refuse` answers the call with a
protocol error. `--token` is taken and ignored: it stands for a secret a
server is started with, which the client must never repeat.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import anyio
import mcp_types
from mcp import MCPError
from mcp.server import Server
from mcp.server.stdio import stdio_server


def tools(refs: list[str]) -> list[mcp_types.Tool]:
    """What the server lists."""
    listed = [
        mcp_types.Tool(
            name="echo",
            description="Say the text back.",
            input_schema={
                "type": "object",
                "$defs": {"Text": {"type": "string"}},
                "properties": {"text": {"$ref": "#/$defs/Text"}},
                "required": ["text"],
            },
        ),
        mcp_types.Tool(
            name="die", description="Exit mid-call.", input_schema={"type": "object"}
        ),
        mcp_types.Tool(
            name="refuse", description="Refuse.", input_schema={"type": "object"}
        ),
    ]
    listed.extend(
        mcp_types.Tool(
            name=f"ref{index}",
            description=f"A tool whose schema refers to {ref}.",
            input_schema={"type": "object", "properties": {"x": {"$ref": ref}}},
        )
        for index, ref in enumerate(refs)
    )
    return listed


def make_server(refs: list[str]) -> Server[Any]:
    async def list_tools(
        _: Any, __: mcp_types.PaginatedRequestParams | None
    ) -> mcp_types.ListToolsResult:
        return mcp_types.ListToolsResult(tools=tools(refs))

    async def call_tool(
        _: Any, params: mcp_types.CallToolRequestParams
    ) -> mcp_types.CallToolResult:
        arguments = params.arguments or {}
        if params.name == "die":
            os._exit(3)  # no answer, no cleanup: the process is gone
        if params.name == "refuse":
            raise MCPError(code=mcp_types.INVALID_PARAMS, message="no, thank you")
        text = str(arguments.get("text", arguments))
        return mcp_types.CallToolResult(
            content=[mcp_types.TextContent(type="text", text=text)]
        )

    return Server("hostile", on_list_tools=list_tools, on_call_tool=call_tool)


async def main(refs: list[str]) -> None:
    server = make_server(refs)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(
            read_stream, write_stream, server.create_initialization_options()
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ref", action="append", default=[])
    parser.add_argument("--token")
    anyio.run(main, parser.parse_args().ref)
