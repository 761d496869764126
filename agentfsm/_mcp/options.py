"""`agentfsm.mcp`'s options, checked: which server, which tools, their names
and approval rules."""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable, Collection
from functools import partial
from typing import Any, Final, TypeAlias

import mcp
import mcp_types
from mcp.server import Server
from mcp.server.mcpserver import MCPServer

from agentfsm.exceptions import ConfigurationError

__all__ = (
    "ApprovalRule",
    "ToolFilter",
    "approval_rule",
    "name_filter",
    "names",
    "prefix_of",
    "reason",
    "target_of",
)

ToolFilter: TypeAlias = Callable[[mcp_types.Tool], bool]
"""Whether to offer a tool the server listed."""

ApprovalRule: TypeAlias = Callable[[mcp_types.Tool, dict[str, Any]], bool]
"""Whether a call of a listed tool, with these arguments, needs approval."""

_PREFIX: Final = re.compile(r"[A-Za-z0-9_-]+")


def target_of(server: Any) -> tuple[Any, str]:
    """The server as `mcp.Client` takes it, and what errors and logs call it."""
    if isinstance(server, str):
        text = server.strip()
        if text.startswith(("http://", "https://")):
            return text, _without_userinfo(text)
        try:
            argv = shlex.split(text)
        except ValueError as exc:
            raise ConfigurationError(f"MCP server command {server!r}: {exc}") from None
        if not argv:
            raise ConfigurationError("the MCP server command is empty")
        if argv[0].endswith(".py"):
            # A script alone runs on this interpreter, whose packages it expects
            # (`python` on PATH may be another one).
            argv.insert(0, sys.executable)
        return mcp.StdioServerParameters(command=argv[0], args=argv[1:]), text
    if isinstance(server, mcp.StdioServerParameters):
        return server, shlex.join([server.command, *server.args])
    if isinstance(server, MCPServer | Server):
        return server, server.name
    if hasattr(server, "__aenter__"):  # an `mcp.client.Transport`
        return server, type(server).__name__
    raise ConfigurationError(
        "an MCP server is a command line, an http(s) URL, StdioServerParameters, "
        f"an MCPServer or a transport, not {type(server).__name__}"
    )


def _without_userinfo(url: str) -> str:
    """The URL as logs may show it (no `user:password@`)."""
    return re.sub(r"(?<=//)[^/@]*@", "", url, count=1)


def prefix_of(prefix: Any) -> str | None:
    """The prefix, when tool names may start with it."""
    if prefix is not None and (
        not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix)
    ):
        raise ConfigurationError(
            "prefix must be letters, digits, '_' or '-' (as tool names), "
            f"got {prefix!r}"
        )
    return prefix


def names(option: str, value: Any) -> frozenset[str]:
    """A collection of tool names (a str alone is refused: it is no list)."""
    if isinstance(value, str) or not isinstance(value, Collection):
        raise ConfigurationError(
            f"{option} takes a collection of tool names (a list or a set), "
            f"got {type(value).__name__}"
        )
    if not all(isinstance(name, str) for name in value):
        raise ConfigurationError(f"{option} takes tool names (str), got {value!r}")
    return frozenset(value)


def name_filter(option: str, value: Any) -> frozenset[str] | ToolFilter | None:
    """Tool names, a filter function, or `None` (every tool)."""
    if value is None:
        return None
    if callable(value) and not isinstance(value, Collection):
        rule: ToolFilter = value
        return rule
    return names(option, value)


def approval_rule(
    rule: Any,
) -> Callable[[mcp_types.Tool], bool | Callable[[dict[str, Any]], bool]]:
    """`needs_approval` as a function of the listed tool that gives its
    `Tool.needs_approval`."""
    if isinstance(rule, bool):
        return lambda _: rule
    if callable(rule) and not isinstance(rule, Collection):
        return lambda spec: partial(rule, spec)
    wanted = names("needs_approval", rule)
    return lambda spec: spec.name in wanted


def reason(exc: BaseException) -> str:
    """The first error inside `exc` (an SDK task group's group, say), as text."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
