"""`agentfsm.mcp`'s options, checked: which server, which tools, their names
and approval rules."""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable, Collection
from functools import partial
from pathlib import PurePath
from typing import Any, Final, TypeAlias
from urllib.parse import urlsplit

import mcp
import mcp_types
from mcp.server import Server
from mcp.server.mcpserver import MCPServer

from agentfsm._errors import error_text
from agentfsm._text import printable
from agentfsm.exceptions import ConfigurationError

__all__ = (
    "ApprovalRule",
    "ToolFilter",
    "approval_rule",
    "label_of",
    "name_filter",
    "names",
    "prefix_of",
    "reason",
    "scrubbed",
    "target_of",
)

ToolFilter: TypeAlias = Callable[[mcp_types.Tool], bool]
"""Whether to offer a tool the server listed."""

ApprovalRule: TypeAlias = Callable[[mcp_types.Tool, dict[str, Any]], bool]
"""Whether a call of a listed tool, with these arguments, needs approval."""

_PREFIX: Final = re.compile(r"[A-Za-z0-9_-]+")
_URL: Final = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://[^\s'\"<>]+")


def target_of(server: Any) -> tuple[Any, str]:
    """The server as `mcp.Client` takes it, and its label (see `label_of`)."""
    if isinstance(server, str):
        text = server.strip()
        if text.startswith(("http://", "https://")):
            return text, _host_of(text)
        try:
            argv = shlex.split(text)
        except ValueError as exc:
            # shlex's message names no part of the command (its arguments may
            # hold a token).
            raise ConfigurationError(f"MCP server command: {exc}") from None
        if not argv:
            raise ConfigurationError("the MCP server command is empty")
        label = _base_name(argv[0])
        if argv[0].endswith(".py"):
            # A script alone runs on this interpreter, whose packages it expects
            # (`python` on PATH may be another one).
            argv.insert(0, sys.executable)
        return mcp.StdioServerParameters(command=argv[0], args=argv[1:]), label
    if isinstance(server, mcp.StdioServerParameters):
        return server, _base_name(server.command)
    if isinstance(server, MCPServer | Server):
        return server, printable(server.name, newlines=False)
    if hasattr(server, "__aenter__"):  # an `mcp.client.Transport`
        return server, type(server).__name__
    raise ConfigurationError(
        "an MCP server is a command line, an http(s) URL, StdioServerParameters, "
        f"an MCPServer or a transport, not {type(server).__name__}"
    )


def label_of(name: Any, derived: str) -> str:
    """What errors, logs and tool outputs call the server: `name` when the
    user gave one, else `derived` (from `target_of`). Never the command's
    arguments or the URL's path, query or user info, which may hold a token:
    tool outputs go to the model's provider and to event logs."""
    if name is None:
        return derived
    if not isinstance(name, str) or not name.strip():
        raise ConfigurationError(f"name must be a non-empty str, got {name!r}")
    return printable(name, newlines=False)


def _base_name(command: str) -> str:
    """The executable's file name, without its directory."""
    return printable(PurePath(command).name or command, newlines=False)


def _host_of(url: str) -> str:
    """What a server's URL is called: its host and port (no user info, path
    or query)."""
    return printable(_host_port(url) or "at a URL without a host", newlines=False)


def _host_port(url: str) -> str | None:
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is no number, a bad IPv6 literal
        return None
    if not host:
        return None
    host = f"[{host}]" if ":" in host else host
    return host if port is None else f"{host}:{port}"


def scrubbed(text: str) -> str:
    """Third-party error text with each URL in it cut to its scheme, host and
    port (an HTTP client's error quotes the URL, query and user info included)."""
    return _URL.sub(lambda m: f"{m['scheme']}://{_host_port(m[0]) or ''}/...", text)


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
    """The first error inside `exc` (an SDK task group's group, say), as text,
    its URLs `scrubbed`."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = scrubbed(error_text(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
