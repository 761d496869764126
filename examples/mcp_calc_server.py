"""A small MCP server, for examples/mcp_server_tools.py and `agentfsm run --mcp`.

It speaks MCP over stdin and stdout (what an MCP client that starts it expects):

```text
agentfsm run "What is 6 times 7?" --mcp "python examples/mcp_calc_server.py"
```

or, with `--http PORT`, over streamable HTTP at `http://127.0.0.1:PORT/mcp`:

```text
python examples/mcp_calc_server.py --http 8000 &
agentfsm run "What is 6 times 7?" --mcp http://127.0.0.1:8000/mcp
```
"""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server: MCPServer = MCPServer("calc", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@server.tool()
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    if b == 0:
        # The client gets an error result (`is_error`) with this message.
        raise ToolError("cannot divide by zero")
    return a / b


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http"]:
        server.run("streamable-http", port=int(sys.argv[2]))
    else:
        server.run("stdio")
