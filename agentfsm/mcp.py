"""The tools of MCP servers as agentfsm tools (`pip install 'agentfsm[mcp]'`).

`mcp_tools(server)` connects to an MCP server (a command run over stdio, a
streamable-HTTP URL, or a server object in the same process) and returns its
tools as ordinary `Tool`s: the model sees the server's names (optionally
prefixed), descriptions and input schemas; a call is a `tools/call` on the
session. Approval (`needs_approval`), interception, tool wrappers and timeouts
apply to them as to any other tool.

The session is the runtime's: opened once, in a task of the runtime, and closed
when the runtime exits, after its last loop has ended; every call of every loop
goes over it. The tool list is fetched once and fetched again when the server
says it changed (`notifications/tools/list_changed`).

Example:
    ```python
    async with Runtime(providers=providers) as runtime:
        calc = await mcp_tools("python calc_server.py", prefix="calc")
        agent = Agent("openai:gpt-4.1-mini", tools=[*calc])
        answer = await agent.run("What is 2 + 3?")  # calls calc_add over MCP
    ```
"""

from __future__ import annotations

try:
    import mcp
except ImportError as exc:  # pragma: no cover - tests/test_mcp.py, TestCli
    raise ImportError(
        "agentfsm.mcp needs the MCP SDK: pip install 'agentfsm[mcp]'"
    ) from exc

import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Literal,
    Self,
    TypeAlias,
    TypedDict,
    Unpack,
    final,
    overload,
)

import anyio
import anyio.lowlevel
import mcp_types
from anyio.abc import TaskGroup, TaskStatus
from mcp.client import Transport
from mcp.client.subscriptions import ListenNotSupportedError, SubscriptionLost
from mcp.server import Server
from mcp.server.mcpserver import MCPServer
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from ._arguments import seconds, timeout_or_none
from ._logging import get_logger
from ._mcp.arguments import Arguments
from ._mcp.options import (
    ApprovalRule,
    ToolFilter,
    approval_rule,
    label_of,
    name_filter,
    names,
    prefix_of,
    reason,
    target_of,
)
from ._mcp.results import tool_result
from ._runtime import Runtime, current_runtime
from .exceptions import AgentFSMError, ConfigurationError, ToolError
from .tools import DEFAULT_TOOL_TIMEOUT, Tool, ToolDefinition, ToolResult

if TYPE_CHECKING:
    from ._jsonschema import SchemaProblem

__all__ = (
    "DEFAULT_CONNECT_TIMEOUT",
    "MCPConnectionError",
    "MCPServerSpec",
    "MCPTool",
    "MCPToolset",
    "MCPToolsetOptions",
    "mcp_tools",
)

DEFAULT_CONNECT_TIMEOUT: Final = 30.0
"""Seconds a server has to start, answer the handshake and list its tools."""

MCPServerSpec: TypeAlias = (
    str | mcp.StdioServerParameters | MCPServer[Any] | Server[Any] | Transport
)
"""Which server to connect to:

- a command line (`"python server.py --flag"`; split like a shell would, and
  not run by one), run as a subprocess speaking MCP over stdin and stdout; a
  command that starts with a `.py` file runs it with this interpreter;
- an `http://` or `https://` URL, spoken to over streamable HTTP;
- `mcp.StdioServerParameters`, for a command with its own environment or
  working directory;
- an `MCPServer` (or low-level `Server`) object, connected in this process
  (for tests);
- any other transport `mcp.Client` takes (an authenticated HTTP client, say).
"""

_LIST_PAGES: Final = 100
"""Pages of `tools/list` followed at most (a server whose cursor never ends
cannot hang the connection)."""


class MCPConnectionError(AgentFSMError):
    """An MCP server could not be started, reached, or listed its tools."""


class MCPToolsetOptions(TypedDict, total=False):
    """Options of `MCPToolset` and `mcp_tools`."""

    name: str | None
    prefix: str | None
    include: Collection[str] | ToolFilter | None
    exclude: Collection[str]
    needs_approval: bool | Collection[str] | ApprovalRule
    timeout: float | None
    execution_mode: Literal["parallel", "sequential"]
    on_change: Callable[[MCPToolset], object] | None
    connect_timeout: float
    mode: str


@final
class MCPTool(Tool):
    """A tool of an MCP server: the server's name (prefixed), description and
    input schema; calling it sends `tools/call` over its toolset's session.

    Built by `MCPToolset`. Its arguments are checked against the server's
    schema before they are sent; the server's result becomes a `ToolResult`:
    `is_error` an error output, structured content (as JSON) preferred over
    the text blocks.

    Raises:
        SchemaProblem: the input or output schema is not a valid one, or has
            a reference that does not resolve within it (the toolset leaves
            the tool out).
    """

    __slots__ = ("_arguments", "_toolset", "spec")

    def __init__(
        self,
        toolset: MCPToolset,
        spec: mcp_types.Tool,
        *,
        name: str,
        timeout: float | None,
        needs_approval: bool | Callable[[dict[str, Any]], bool],
        execution_mode: Literal["parallel", "sequential"],
    ) -> None:
        # `Tool.__init__` reads a Python function's signature; this tool has the
        # server's schema instead, so it sets `Tool`'s fields itself. `Tool`'s
        # call path is kept whole: the timeout's scope, the approval rule.
        self.spec = spec
        """The tool as the server listed it."""
        self._toolset = toolset
        self._arguments = Arguments(name, spec.input_schema)
        if spec.output_schema is not None:
            # The SDK validates results against it (without retrieving): a
            # schema it cannot use would fail every call.
            from ._jsonschema import SchemaProblem, check

            try:
                check(spec.output_schema)
            except SchemaProblem as exc:
                raise SchemaProblem(f"output schema {exc}") from None
        self._describe(
            ToolDefinition(
                name=name,
                description=spec.description or spec.title or "",
                parameters=self._arguments.schema,
            ),
            self._send,
            timeout=timeout,
            needs_approval=needs_approval,
            execution_mode=execution_mode,
            awaits=True,
            on_crash="pause",  # a server's tool is not known to be idempotent
        )

    def __repr__(self) -> str:
        return f"MCPTool({self.name!r}, server={self._toolset.name!r})"

    def validate_arguments(self, arguments: str | Mapping[str, Any]) -> dict[str, Any]:
        """Check the model's arguments (a JSON object) against the server's schema.

        Raises:
            ToolArgumentsError: not a JSON object, or naming each field that
                does not fit the schema and why.
        """
        return self._arguments.validate(arguments)

    async def _send(self, /, **arguments: Any) -> ToolResult:
        # Positional-only `self`: an argument may be called "self".
        return await self._toolset._call(self, arguments)


class MCPToolset(Sequence[MCPTool]):
    """The tools of one MCP server, over one session: an async context manager.

    Entering it connects, negotiates the protocol and lists the tools; leaving
    it closes the session (and stops the server's process). Inside, it is a
    sequence of the server's current tools (`tools=[*toolset]`, or
    `tools=toolset`): a loop keeps the tools its request was made with, a
    request made after the server changed its list gets the new list.

    `mcp_tools` enters one for the runtime's lifetime, which is what a program
    wants; enter one yourself to hold a session for a shorter time.

    A listed tool whose input or output schema is not a valid JSON schema, or
    has a `$ref` that does not resolve within the schema (another document, a
    URL, a file, a pointer to nothing), is left out, with a warning logged
    (`mcp_tool_refused`) naming the server, the tool and the problem: one
    broken tool does not cost the server's others, and no reference is ever
    fetched or read. When `include` names such a tool, connecting fails with a
    `ConfigurationError` saying so instead, as for a tool the server lacks.

    Errors, logs and tool outputs name the server by a short label: `name`,
    or the executable's file name (of a command), or the host and port (of a
    URL), or the server object's name; never the command's arguments or the
    URL's path, query or user info, which may hold a token and would reach
    the model's provider and event logs.

    Args:
        server: which server (see `MCPServerSpec`).
        name: what errors, logs and tool outputs call the server (see above).
        prefix: prepended to every tool name, with an underscore (`"calc"`:
            `add` becomes `calc_add`), so that two servers' tools cannot clash.
        include: the server's tool names to offer (every other is left out), or
            a function of the listed `mcp.types.Tool` that says whether to.
        exclude: the server's tool names to leave out.
        needs_approval: `True` for every tool, the server's names of the tools
            that need approval, or a function of `(listed tool, arguments)`; a
            batch with such a call pauses the loop (see `Tool`).
        timeout: seconds a call may take (`None`: no limit); past it, the call
            is cancelled (the server is told) and its output is an error.
        execution_mode: as `Tool.execution_mode`, for every tool.
        on_change: called with the toolset after its list was fetched again.
        connect_timeout: seconds to connect and list the tools.
        mode: how the SDK negotiates the protocol (`mcp.Client`'s `mode`):
            `"auto"` (the default), `"legacy"` for the initialize handshake.

    Raises:
        ConfigurationError: an option is wrong (the error says which).
    """

    def __init__(
        self, server: MCPServerSpec, **options: Unpack[MCPToolsetOptions]
    ) -> None:
        self._target, derived = target_of(server)
        self.name = label_of(options.get("name"), derived)
        """The server's label, for errors, logs and tool outputs."""
        self._prefix = prefix_of(options.get("prefix"))
        self._include = name_filter("include", options.get("include"))
        self._exclude = names("exclude", options.get("exclude", ()))
        self._approval = approval_rule(options.get("needs_approval", False))
        self._timeout = timeout_or_none(
            "timeout", options.get("timeout", DEFAULT_TOOL_TIMEOUT)
        )
        self._execution_mode = options.get("execution_mode", "parallel")
        if self._execution_mode not in ("parallel", "sequential"):
            raise ConfigurationError(
                "execution_mode must be 'parallel' or 'sequential', "
                f"got {self._execution_mode!r}"
            )
        self._on_change = options.get("on_change")
        self._connect_timeout = seconds(
            "connect_timeout",
            options.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT),
            positive=True,
        )
        self._mode = options.get("mode", "auto")
        if self._mode not in ("auto", "legacy", *MODERN_PROTOCOL_VERSIONS):
            raise ConfigurationError(
                "mode must be 'auto', 'legacy' or one of "
                f"{', '.join(MODERN_PROTOCOL_VERSIONS)}, got {self._mode!r}"
            )
        self._tools: tuple[MCPTool, ...] = ()
        self._client: mcp.Client | None = None
        self._stack: AsyncExitStack | None = None
        self._tg: TaskGroup | None = None
        self._stale: anyio.Event | None = None  # set: the list is to be fetched
        self._state: Literal["new", "open", "closed"] = "new"

    # ------------------------------------------------------------- a sequence

    @property
    def tools(self) -> tuple[MCPTool, ...]:
        """The server's tools as offered now (filtered, prefixed)."""
        return self._tools

    def __len__(self) -> int:
        return len(self._tools)

    @overload
    def __getitem__(self, index: int) -> MCPTool: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[MCPTool, ...]: ...

    def __getitem__(self, index: int | slice) -> MCPTool | tuple[MCPTool, ...]:
        return self._tools[index]

    def __iter__(self) -> Iterator[MCPTool]:
        return iter(self._tools)

    def __repr__(self) -> str:
        return f"MCPToolset({self.name!r}, tools={[t.name for t in self._tools]})"

    @property
    def instructions(self) -> str | None:
        """What the server says about using it, if anything (for the system prompt)."""
        return None if self._client is None else self._client.instructions

    # ---------------------------------------------------------------- session

    async def __aenter__(self) -> Self:
        if self._state != "new":
            raise ConfigurationError(f"the toolset of {self.name} was entered before")
        self._state = "open"
        self._stale = anyio.Event()
        stack = AsyncExitStack()
        # The connect timeout's scope stays open with the session (its deadline
        # lifted once connected): the SDK's task groups are entered inside it,
        # and scopes must be left in the reverse order of entering.
        deadline = stack.enter_context(
            anyio.CancelScope(deadline=anyio.current_time() + self._connect_timeout)
        )
        try:
            client = mcp.Client(
                self._target,
                mode=self._mode,
                message_handler=self._on_message,
                cache=None,  # the toolset keeps the list, and knows when it is stale
            )
            await stack.enter_async_context(client)
            self._client = client
            self._tools = self._offered(await self._list(), first=True)
            tg = self._tg = await stack.enter_async_context(anyio.create_task_group())
            tg.start_soon(self._refresh_when_stale, name=f"mcp-refresh:{self.name}")
            capability = client.server_capabilities.tools
            if (
                capability is not None
                and capability.list_changed
                and client.protocol_version in MODERN_PROTOCOL_VERSIONS
            ):
                # From 2026-07-28 on, change notifications come on a stream the
                # client asks for; before, they come unasked (`_on_message`).
                # Connected once the stream is acknowledged: a change made after
                # `mcp_tools` returned is never missed.
                await tg.start(self._listen, name=f"mcp-listen:{self.name}")
            deadline.deadline = math.inf
        except BaseException as exc:  # noqa: BLE001 - raised, as what it means
            raise await self._failed(stack, deadline, exc) from None
        self._stack = stack
        get_logger().info(
            "mcp_connected",
            server=self.name,
            protocol=client.protocol_version,
            tools=[t.name for t in self._tools],
        )
        return self

    async def _failed(
        self, stack: AsyncExitStack, deadline: anyio.CancelScope, exc: BaseException
    ) -> BaseException:
        """What to raise when connecting failed with `exc`, once what was
        entered is left."""
        self._state = "closed"
        self._client = None
        try:
            await stack.__aexit__(type(exc), exc, exc.__traceback__)
        except BaseException as raised:  # noqa: BLE001 - returned, to be raised
            # The SDK re-raises `exc`, or what leaving failed with (in a group).
            if not deadline.cancelled_caught and not isinstance(
                exc, ConfigurationError
            ):
                exc = raised
        if deadline.cancelled_caught:
            error = MCPConnectionError(
                f"MCP server {self.name} did not connect and list its tools "
                f"within {self._connect_timeout:g}s"
            )
        elif isinstance(exc, ConfigurationError) or not isinstance(exc, Exception):
            return exc  # a wrong `include`, a cancellation from outside
        else:
            error = MCPConnectionError(
                f"cannot connect to MCP server {self.name}: {reason(exc)}"
            )
        error.__cause__ = exc
        return error

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._state = "closed"
        stack, self._stack = self._stack, None
        if self._tg is not None:
            self._tg.cancel_scope.cancel()  # the watchers: nothing left to refresh
        if stack is not None:
            await stack.__aexit__(exc_type, exc, tb)
        self._client = None
        get_logger().info("mcp_closed", server=self.name)

    async def refresh(self) -> tuple[MCPTool, ...]:
        """Fetch the tool list again (the toolset does so on its own when the
        server says it changed) and return the tools offered now."""
        self._tools = self._offered(await self._list(), first=False)
        if self._on_change is not None:
            self._on_change(self)
        return self._tools

    async def _list(self) -> list[mcp_types.Tool]:
        client = self._session()
        listed: list[mcp_types.Tool] = []
        cursor: str | None = None
        for _ in range(_LIST_PAGES):
            page = await client.list_tools(cursor=cursor)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if cursor is None:
                break
        return listed

    def _offered(
        self, listed: Sequence[mcp_types.Tool], *, first: bool
    ) -> tuple[MCPTool, ...]:
        """The listed tools that pass the filters, as `MCPTool`s (the same
        objects as before for tools that did not change)."""
        if first and isinstance(self._include, frozenset):
            # A name the server does not have is a typo, said at once; later
            # lists may drop tools (the server's choice).
            missing = self._include - {t.name for t in listed}
            if missing:
                raise ConfigurationError(
                    f"include names tools MCP server {self.name} does not have: "
                    f"{', '.join(sorted(missing))} (it has: "
                    f"{', '.join(sorted(t.name for t in listed)) or 'none'})"
                )
        from ._jsonschema import SchemaProblem  # imports jsonschema, as listing does

        before = {t.spec.name: t for t in self._tools}
        offered = []
        for spec in listed:
            if not self._wanted(spec):
                continue
            kept = before.get(spec.name)
            if kept is not None and kept.spec == spec:
                offered.append(kept)
                continue
            try:
                tool = self._tool(spec)
            except SchemaProblem as exc:
                self._refuse(spec, exc, first=first)
                continue
            offered.append(tool)
        return tuple(offered)

    def _tool(self, spec: mcp_types.Tool) -> MCPTool:
        return MCPTool(
            self,
            spec,
            name=spec.name if self._prefix is None else f"{self._prefix}_{spec.name}",
            timeout=self._timeout,
            needs_approval=self._approval(spec),
            execution_mode=self._execution_mode,
        )

    def _refuse(
        self, spec: mcp_types.Tool, problem: SchemaProblem, *, first: bool
    ) -> None:
        """Leave out a tool whose schema cannot be used (see the class's
        docstring); an error when `include` named it on connecting."""
        if first and isinstance(self._include, frozenset):
            raise ConfigurationError(
                f"include names tool {spec.name!r} of MCP server {self.name}, "
                f"which cannot be offered: its {problem}"
            )
        get_logger().warning(
            "mcp_tool_refused", server=self.name, tool=spec.name, problem=str(problem)
        )

    def _wanted(self, spec: mcp_types.Tool) -> bool:
        if spec.name in self._exclude:
            return False
        include = self._include
        if include is None:
            return True
        if isinstance(include, frozenset):
            return spec.name in include
        return bool(include(spec))

    def _session(self) -> mcp.Client:
        if self._client is None or self._state != "open":
            raise MCPConnectionError(
                f"the session with MCP server {self.name} is closed"
                + (" (its runtime has exited)" if self._state == "closed" else "")
            )
        return self._client

    async def _call(self, tool: MCPTool, arguments: dict[str, Any]) -> ToolResult:
        try:
            client = self._session()
            result = await client.call_tool(tool.spec.name, arguments)
        except MCPConnectionError as exc:
            raise ToolError(str(exc), tool=tool.name) from exc
        except mcp.MCPError as exc:
            if exc.error.code == mcp_types.CONNECTION_CLOSED:  # the server is gone
                raise ToolError(
                    f"the session with MCP server {self.name} was lost", tool=tool.name
                ) from exc
            # A protocol error (an unknown tool, on some servers): the call failed.
            raise ToolError(
                f"MCP server {self.name} refused the call: {exc.error.message}",
                tool=tool.name,
            ) from exc
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise ToolError(
                f"the session with MCP server {self.name} was lost", tool=tool.name
            ) from exc
        except ValidationError as exc:
            raise ToolError(
                f"MCP server {self.name} sent a result that is not one: {exc}",
                tool=tool.name,
            ) from exc
        except Exception as exc:  # said without the URL a transport's error may quote
            raise ToolError(
                f"the call to MCP server {self.name} failed: {reason(exc)}",
                tool=tool.name,
            ) from exc
        return tool_result(result, tool.spec.output_schema)

    # -------------------------------------------------- list_changed, watched

    async def _on_message(
        self, message: mcp_types.ServerNotification | Exception
    ) -> None:
        """Notifications the session surfaces (before 2026-07-28, change
        notifications come this way). Only marks the list stale: a request
        sent from here would wait on the task that delivers its answer."""
        if isinstance(message, mcp_types.ToolListChangedNotification):
            self._mark_stale()
        await anyio.lowlevel.checkpoint()

    async def _listen(self, *, task_status: TaskStatus[None]) -> None:
        """Follow the server's tool-list changes on a `subscriptions/listen`
        stream (2026-07-28 on), for as long as the session lasts; started once
        the server acknowledged the first stream (changes from then on are seen)."""
        client = self._session()
        started = False
        while True:
            try:
                async with client.listen(tools_list_changed=True) as changes:
                    if not started:
                        started = True
                        task_status.started()
                    async for _ in changes:
                        self._mark_stale()
                return  # the server ended the stream: it sends no more changes
            except ListenNotSupportedError:
                if not started:
                    task_status.started()
                return
            except (SubscriptionLost, mcp.MCPError) as exc:
                # No replay after a lost stream: listen again and fetch the list,
                # since a change may have been missed meanwhile.
                get_logger().warning(
                    "mcp_listen_lost", server=self.name, error=reason(exc)
                )
                if not started:
                    started = True
                    task_status.started()
                self._mark_stale()
                await anyio.sleep(1.0)

    def _mark_stale(self) -> None:
        if self._stale is not None:
            self._stale.set()

    async def _refresh_when_stale(self) -> None:
        while True:
            assert self._stale is not None  # made on entering
            await self._stale.wait()
            # Changes announced while the list is fetched set the new event, so
            # they are fetched once more; a burst of them is fetched once.
            self._stale = anyio.Event()
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - logged; the old list stays
                get_logger().warning(
                    "mcp_refresh_failed", server=self.name, error=reason(exc)
                )


async def mcp_tools(
    server: MCPServerSpec,
    *,
    runtime: Runtime | None = None,
    **options: Unpack[MCPToolsetOptions],
) -> MCPToolset:
    """Connect to an MCP server for the runtime's lifetime and return its tools.

    The session is opened in a task of the runtime (`runtime`, or the current
    context's) and closed when the runtime exits, after its last loop has
    ended. Calls of every loop share it.

    Args:
        server: which server (see `MCPServerSpec`).
        runtime: the runtime to hold the session (default: the current one).
        **options: see `MCPToolset` (`prefix`, `include`, `exclude`,
            `needs_approval`, `timeout`, ...).

    Raises:
        ConfigurationError: an option is wrong, or `include` names a tool the
            server does not have or whose schema cannot be used (see
            `MCPToolset`).
        MCPConnectionError: the server could not be started or reached, or did
            not list its tools within `connect_timeout`.
        NoRuntimeError: no `runtime` given and none is current.

    Example:
        ```python
        async with Runtime() as runtime:
            calc = await mcp_tools("python calc_server.py", prefix="calc",
                                   needs_approval={"divide"})
            loop_id = runtime.run_loop("a", "2 + 3?", InferenceInput(
                model="openai:gpt-4.1-mini", context=ModelContext(), tools=calc))
        ```
    """
    holder = current_runtime() if runtime is None else runtime
    toolset = MCPToolset(server, **options)
    return await holder.enter_async_context(toolset, name=f"mcp:{toolset.name}")
