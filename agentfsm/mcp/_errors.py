"""`agentfsm.mcp`'s errors (defined here, where the session raises them;
`agentfsm.mcp` is where they are public)."""

from __future__ import annotations

from agentfsm.exceptions import AgentFSMError

__all__ = ("MCPConnectionError", "MCPRequestError")


class MCPConnectionError(AgentFSMError):
    """An MCP server could not be started or reached, did not list its tools,
    or its session is closed or was lost (the message says which)."""

    __module__ = "agentfsm.mcp"


class MCPRequestError(AgentFSMError):
    """An MCP server answered a request (a resource read, a prompt) with an
    error, or with a result that is not one."""

    __module__ = "agentfsm.mcp"
