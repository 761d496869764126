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
says it changed (`notifications/tools/list_changed`). A server's progress
notifications for a call are the call's `function_call.progress` events; its
resources and prompts are read through the toolset (`list_resources`,
`read_resource`, `list_prompts`, `get_prompt`), and the model may read them
through a tool the toolset offers (`resource_tool=True`).

Example:
    ```python
    async with Runtime(providers=providers) as runtime:
        calc = await mcp_tools("python calc_server.py", prefix="calc")
        agent = Agent("openai:gpt-4.1-mini", tools=[*calc])
        answer = await agent.run("What is 2 + 3?")  # calls calc_add over MCP
    ```
"""

from __future__ import annotations

import math

try:
    import mcp
except ImportError as exc:  # pragma: no cover - tests/test_mcp.py, TestCli
    raise ImportError(
        "agentfsm.mcp needs the MCP SDK: pip install 'agentfsm[mcp]'"
    ) from exc

from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AsyncExitStack, suppress
from types import TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Literal,
    Protocol,
    Self,
    TypeAlias,
    TypedDict,
    TypeVar,
    Unpack,
    final,
    overload,
)

import anyio
import anyio.lowlevel
import mcp_types
from anyio.abc import TaskGroup
from mcp.client import Transport
from mcp.server import Server
from mcp.server.mcpserver import MCPServer
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from agentfsm._arguments import seconds, timeout_or_none
from agentfsm._logging import get_logger
from agentfsm._runtime import Runtime, current_runtime
from agentfsm._text import clip
from agentfsm.exceptions import AgentFSMError, ConfigurationError, ToolError
from agentfsm.tools import DEFAULT_TOOL_TIMEOUT, Tool, ToolDefinition, ToolResult

from ._arguments import Arguments
from ._errors import MCPConnectionError, MCPRequestError
from ._options import (
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
from ._progress import reporter
from ._resources import READABLE, URI_CHARS, Readable, contents_text, named_in
from ._results import tool_result
from ._session import Connection, connect_error

if TYPE_CHECKING:
    from mcp_types import BlobResourceContents, TextResourceContents

__all__ = (
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_REQUEST_TIMEOUT",
    "MCPConnectionError",
    "MCPRequestError",
    "MCPServerSpec",
    "MCPTool",
    "MCPToolset",
    "MCPToolsetOptions",
    "mcp_tools",
)

DEFAULT_CONNECT_TIMEOUT: Final = 30.0
"""Seconds a server has to start, answer the handshake and list its tools."""

DEFAULT_REQUEST_TIMEOUT: Final = 60.0
"""Seconds a server has to answer one of the toolset's own requests (a list,
a resource read, a prompt), as a tool call has `DEFAULT_TOOL_TIMEOUT`."""

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
"""Pages of a list (`tools/list`, `resources/list`, ...) followed at most (a
server whose cursor never ends cannot hang the connection)."""

_LIST_ITEMS: Final = 100_000
"""Items of a list past which no further page is fetched (a logged warning
says so): pages of any size cannot make a list without bound."""

_T = TypeVar("_T")


class _Page(Protocol):
    """A page of a list (`tools/list`, ...)."""

    @property
    def next_cursor(self) -> str | None: ...


_Page_T = TypeVar("_Page_T", bound=_Page)

_RELIST_EVERY: Final = 10.0
"""Seconds between two listings of the resources the resource tool makes on
its own (for a URI it does not know): the model asking for one made-up URI
after another cannot have the whole list fetched each time."""

_READ_TOOL: Final = "read_resource"
"""The name of the tool that reads resources (`resource_tool=True`)."""


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
    request_timeout: float
    mode: str
    resource_tool: bool | str


@final
class MCPTool(Tool):
    """A tool of an MCP server: the server's name (prefixed), description and
    input schema; calling it sends `tools/call` over its toolset's session.

    Built by `MCPToolset`. Its arguments are checked against the server's
    schema before they are sent; the server's result becomes a `ToolResult`:
    `is_error` an error output; the text blocks, or the structured content
    (as JSON) when the tool declares an output schema; its image blocks
    `ToolResult.images` (an image refused, one whose bytes are not the type
    it claims say, is a line of the output saying why). The server's progress
    notifications for the call are published as `function_call.progress`.

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
        # The server's schema, not a Python signature, defines the tool; the
        # call path is `Tool`'s whole: the timeout's scope, the approval rule.
        self.spec = spec
        """The tool as the server listed it."""
        self._toolset = toolset
        self._arguments = Arguments(name, spec.input_schema)
        if spec.output_schema is not None:
            # The SDK validates results against it (without retrieving): a
            # schema it cannot use would fail every call.
            from agentfsm._jsonschema import SchemaProblem, check

            try:
                check(spec.output_schema)
            except SchemaProblem as exc:
                raise SchemaProblem(f"output schema {exc}") from None
        super().__init__(
            self._send,
            definition=ToolDefinition(
                name=name,
                description=spec.description or spec.title or "",
                parameters=self._arguments.schema,
            ),
            validate=self._arguments.validate,
            timeout=timeout,
            needs_approval=needs_approval,
            execution_mode=execution_mode,
            on_crash="pause",  # a server's tool is not known to be idempotent
        )

    def __repr__(self) -> str:
        return f"MCPTool({self.name!r}, server={self._toolset.name!r})"

    async def _send(self, /, **arguments: Any) -> ToolResult:
        # Positional-only `self`: an argument may be called "self".
        return await self._toolset._call(self, arguments)


class MCPToolset(Sequence[Tool]):
    """The tools of one MCP server, over one session: an async context manager.

    Entering it connects, negotiates the protocol and lists the tools; leaving
    it closes the session (and stops the server's process). Inside, it is a
    sequence of the server's current tools (`tools=[*toolset]`, or
    `tools=toolset`): a loop keeps the tools its request was made with, a
    request made after the server changed its list gets the new list. Each is
    an `MCPTool`, but for the resource reader (`resource_tool`), last.

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

    **A server that goes away.** A call that finds the session gone is an
    error output saying so: a stdio server "is not running: its process
    exited with code 3" (for that call and every later one: the process is
    not started again, as it may crash again and its state is gone); an HTTP
    server's connection "was lost", and the next call connects again (a new
    session), so a server that was restarted serves it.

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
        request_timeout: seconds the server has to answer one of the
            toolset's own requests: a list (all its pages), a resource read,
            a prompt, the list fetched again after a change; past it the
            request fails with an `MCPRequestError` naming the server and the
            request.
        mode: how the SDK negotiates the protocol (`mcp.Client`'s `mode`):
            `"auto"` (the default), `"legacy"` for the initialize handshake.
        resource_tool: `True` offers one more tool, `read_resource` (prefixed
            like the others; a str names it), with which the model reads a
            resource by its URI: one the server listed, or one a tool's result
            named (a resource link, an embedded resource). Any other URI is
            refused before it reaches the server. Off by default: a server's
            resources may be more than its tools let the model see.

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
        self._request_timeout = seconds(
            "request_timeout",
            options.get("request_timeout", DEFAULT_REQUEST_TIMEOUT),
            positive=True,
        )
        self._mode = options.get("mode", "auto")
        if self._mode not in ("auto", "legacy", *MODERN_PROTOCOL_VERSIONS):
            raise ConfigurationError(
                "mode must be 'auto', 'legacy' or one of "
                f"{', '.join(MODERN_PROTOCOL_VERSIONS)}, got {self._mode!r}"
            )
        self._reader = self._resource_tool(options.get("resource_tool", False))
        self._link = Connection(
            self._target,
            server=self.name,
            mode=self._mode,
            connect_timeout=self._connect_timeout,
            message_handler=self._on_message,
            on_stale=self._mark_stale,
        )
        self._readable = Readable()
        self._relisted = -math.inf  # when the resource tool last listed
        self._tools: tuple[Tool, ...] = ()
        self._stack: AsyncExitStack | None = None
        self._tg: TaskGroup | None = None
        self._stale: anyio.Event | None = None  # set: the list is to be fetched

    # ------------------------------------------------------------- a sequence

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The server's tools as offered now (filtered, prefixed), and the
        resource reader last when there is one."""
        return self._tools

    @property
    def resource_tool(self) -> Tool | None:
        """The tool with which the model reads resources (`resource_tool`)."""
        return self._reader

    def __len__(self) -> int:
        return len(self._tools)

    @overload
    def __getitem__(self, index: int) -> Tool: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Tool, ...]: ...

    def __getitem__(self, index: int | slice) -> Tool | tuple[Tool, ...]:
        return self._tools[index]

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools)

    def __repr__(self) -> str:
        return f"MCPToolset({self.name!r}, tools={[t.name for t in self._tools]})"

    @property
    def instructions(self) -> str | None:
        """What the server says about using it, if anything (for the system prompt)."""
        session = self._link.current
        return None if session is None else session.client.instructions

    # ---------------------------------------------------------------- session

    async def __aenter__(self) -> Self:
        if self._link.state != "new":
            raise ConfigurationError(f"the toolset of {self.name} was entered before")
        self._stale = anyio.Event()
        stack = AsyncExitStack()
        try:
            tg = self._tg = await stack.enter_async_context(anyio.create_task_group())
            with anyio.move_on_after(self._connect_timeout) as deadline:
                session = await self._link.open(tg)
                self._tools = self._offered(await self._list(), first=True)
            if deadline.cancelled_caught:
                raise self._timed_out()
            tg.start_soon(self._refresh_when_stale, name=f"mcp-refresh:{self.name}")
        except BaseException as exc:  # noqa: BLE001 - raised, as what it means
            raise await self._failed(stack, exc) from None
        self._stack = stack
        get_logger().info(
            "mcp_connected",
            server=self.name,
            protocol=session.client.protocol_version,
            tools=[t.name for t in self._tools],
        )
        return self

    def _timed_out(self) -> MCPConnectionError:
        return MCPConnectionError(
            f"MCP server {self.name} did not connect and list its tools "
            f"within {self._connect_timeout:g}s"
        )

    async def _failed(self, stack: AsyncExitStack, exc: BaseException) -> BaseException:
        """What to raise when connecting failed with `exc`, once what was
        entered is left."""
        self._link.state = "closed"
        if self._link.current is not None:
            self._link.current.release.set()
        # The task group re-raises `exc`, or wraps it in a group: `exc` is
        # what is raised, as what it means.
        with suppress(BaseException):
            await stack.__aexit__(type(exc), exc, exc.__traceback__)
        return connect_error(self.name, exc)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack = self._stack, None
        try:
            await self._link.close()  # by its holder task, where the SDK entered it
        finally:
            if self._tg is not None:
                self._tg.cancel_scope.cancel()  # the watchers: nothing left to refresh
            if stack is not None:
                await stack.__aexit__(exc_type, exc, tb)
        get_logger().info("mcp_closed", server=self.name)

    # ------------------------------------------------------------ the tools

    async def refresh(self) -> tuple[Tool, ...]:
        """Fetch the tool list again (the toolset does so on its own when the
        server says it changed) and return the tools offered now.

        Raises:
            MCPConnectionError: the session is closed or was lost.
            MCPRequestError: the server did not answer within
                `request_timeout`, or answered with an error.
        """
        self._tools = self._offered(await self._list(), first=False)
        if self._on_change is not None:
            self._on_change(self)
        return self._tools

    async def _list(self) -> list[mcp_types.Tool]:
        pages = await self._all(
            lambda client, cursor: client.list_tools(cursor=cursor),
            "tools/list",
            lambda page: len(page.tools),
        )
        return [tool for page in pages for tool in page.tools]

    async def _all(
        self,
        fetch: Callable[[mcp.Client, str | None], Awaitable[_Page_T]],
        method: str,
        size: Callable[[_Page_T], int],
    ) -> list[_Page_T]:
        """Every page of a list (up to `_LIST_PAGES` pages, or until
        `_LIST_ITEMS` items of `size` each), `fetch`ed by cursor, within
        `request_timeout` (the whole list: one request of the toolset)."""
        what = f"the {method} request"
        pages: list[_Page_T] = []
        with anyio.move_on_after(self._request_timeout) as deadline:
            cursor: str | None = None
            items = 0
            for _ in range(_LIST_PAGES):
                page = await self._link.request(_at(fetch, cursor), what=what)
                pages.append(page)
                items += size(page)
                cursor = page.next_cursor
                if cursor is None:
                    break
                if items >= _LIST_ITEMS:
                    get_logger().warning(
                        "mcp_list_cut", server=self.name, method=method, items=items
                    )
                    break
        if deadline.cancelled_caught:
            raise self._unanswered(what)
        return pages

    async def _ask(
        self, send: Callable[[mcp.Client], Awaitable[_T]], method: str
    ) -> _T:
        """`send` over the session, within `request_timeout`."""
        what = f"the {method} request"
        with anyio.move_on_after(self._request_timeout):
            return await self._link.request(send, what=what)
        raise self._unanswered(what)

    def _unanswered(self, what: str) -> MCPRequestError:
        return MCPRequestError(
            f"MCP server {self.name} did not answer {what} within "
            f"{self._request_timeout:g}s (request_timeout)"
        )

    def _offered(
        self, listed: Sequence[mcp_types.Tool], *, first: bool
    ) -> tuple[Tool, ...]:
        """The listed tools that pass the filters, as `MCPTool`s (the same
        objects as before for tools that did not change), then the reader."""
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
        from agentfsm._jsonschema import (
            SchemaProblem,  # imports jsonschema, as listing does
        )

        before = {t.spec.name: t for t in self._tools if isinstance(t, MCPTool)}
        offered: list[Tool] = []
        for spec in listed:
            if not self._wanted(spec):
                continue
            if self._reader is not None and self._named(spec) == self._reader.name:
                self._refuse(
                    spec,
                    f"name is the resource tool's, {self._reader.name!r}",
                    first=first,
                )
                continue
            kept = before.get(spec.name)
            if kept is not None and kept.spec == spec:
                offered.append(kept)
                continue
            try:
                tool = self._tool(spec)
            except SchemaProblem as exc:
                self._refuse(spec, str(exc), first=first)
                continue
            offered.append(tool)
        if self._reader is not None:
            offered.append(self._reader)
        return tuple(offered)

    def _named(self, spec: mcp_types.Tool) -> str:
        return spec.name if self._prefix is None else f"{self._prefix}_{spec.name}"

    def _tool(self, spec: mcp_types.Tool) -> MCPTool:
        return MCPTool(
            self,
            spec,
            name=self._named(spec),
            timeout=self._timeout,
            needs_approval=self._approval(spec),
            execution_mode=self._execution_mode,
        )

    def _refuse(self, spec: mcp_types.Tool, problem: str, *, first: bool) -> None:
        """Leave out a tool that cannot be offered (see the class's
        docstring); an error when `include` named it on connecting."""
        if first and isinstance(self._include, frozenset):
            raise ConfigurationError(
                f"include names tool {spec.name!r} of MCP server {self.name}, "
                f"which cannot be offered: its {problem}"
            )
        get_logger().warning(
            "mcp_tool_refused", server=self.name, tool=spec.name, problem=problem
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

    async def _call(self, tool: MCPTool, arguments: dict[str, Any]) -> ToolResult:
        try:
            result = await self._link.request(
                lambda client: client.call_tool(
                    tool.spec.name, arguments, progress_callback=reporter()
                ),
                what="the call",
            )
        except (MCPConnectionError, MCPRequestError) as exc:
            raise ToolError(str(exc), tool=tool.name) from exc
        self._readable.add(named_in(result.content))
        return tool_result(result, tool.spec.output_schema)

    # ------------------------------------------------- resources and prompts

    async def list_resources(self) -> list[mcp_types.Resource]:
        """The server's resources (every page, up to 100); none when the
        server offers no resources. Each becomes readable by the model
        through the resource tool.

        Raises:
            MCPConnectionError: the session is closed, or the server went away.
            MCPRequestError: the server answered with an error, or did not
                answer within `request_timeout`.
        """
        if not await self._offers("resources"):
            return []
        pages = await self._all(
            lambda client, cursor: client.list_resources(cursor=cursor),
            "resources/list",
            lambda page: len(page.resources),
        )
        listed = [resource for page in pages for resource in page.resources]
        self._readable.add(r.uri for r in listed)
        return listed

    async def list_resource_templates(self) -> list[mcp_types.ResourceTemplate]:
        """The server's resource templates (every page, up to 100): URIs with
        parameters (`file:///{path}`) that `read_resource` may read once they
        are filled in. The model's resource tool does not read them: it reads
        only URIs the server listed or a tool returned.

        Raises:
            MCPConnectionError: the session is closed, or the server went away.
            MCPRequestError: the server answered with an error, or did not
                answer within `request_timeout`.
        """
        if not await self._offers("resources"):
            return []
        pages = await self._all(
            lambda client, cursor: client.list_resource_templates(cursor=cursor),
            "resources/templates/list",
            lambda page: len(page.resource_templates),
        )
        return [template for page in pages for template in page.resource_templates]

    async def read_resource(
        self, uri: str
    ) -> list[TextResourceContents | BlobResourceContents]:
        """Read a resource of the server: its contents (text, or base64 blobs).

        Raises:
            MCPConnectionError: the session is closed, or the server went away.
            MCPRequestError: the server answered with an error (no such
                resource, say), or did not answer within `request_timeout`.
        """
        _text_argument("uri", uri)
        result = await self._ask(
            lambda client: client.read_resource(uri), "resources/read"
        )
        return list(result.contents)

    async def list_prompts(self) -> list[mcp_types.Prompt]:
        """The server's prompts (every page, up to 100); none when the server
        offers no prompts.

        Raises:
            MCPConnectionError: the session is closed, or the server went away.
            MCPRequestError: the server answered with an error, or did not
                answer within `request_timeout`.
        """
        if not await self._offers("prompts"):
            return []
        pages = await self._all(
            lambda client, cursor: client.list_prompts(cursor=cursor),
            "prompts/list",
            lambda page: len(page.prompts),
        )
        return [prompt for page in pages for prompt in page.prompts]

    async def get_prompt(
        self, name: str, arguments: Mapping[str, str] | None = None
    ) -> mcp_types.GetPromptResult:
        """A prompt of the server, filled in with `arguments`: its messages
        (`result.messages`, each a role and a content block).

        Raises:
            ConfigurationError: `name` is no str, or `arguments` not str to str.
            MCPConnectionError: the session is closed, or the server went away.
            MCPRequestError: the server answered with an error (no such
                prompt, a required argument missing), or did not answer
                within `request_timeout`.
        """
        _text_argument("name", name)
        values: dict[Any, Any] = dict(arguments or {})
        if not all(
            isinstance(k, str) and isinstance(v, str) for k, v in values.items()
        ):
            raise ConfigurationError(
                f"a prompt's arguments are str to str, got {values!r}"
            )
        return await self._ask(
            lambda client: client.get_prompt(name, values), "prompts/get"
        )

    async def _offers(self, capability: Literal["resources", "prompts"]) -> bool:
        session = await self._link.session()
        return getattr(session.client.server_capabilities, capability) is not None

    def _resource_tool(self, option: Any) -> Tool | None:
        """The tool the model reads resources with, when `option` asks for it."""
        if option is False:
            return None
        if option is True:
            name = _READ_TOOL
        elif isinstance(option, str) and option.strip():
            name = option
        else:
            raise ConfigurationError(
                f"resource_tool must be True, False or a tool name, got {option!r}"
            )
        if self._prefix is not None:
            name = f"{self._prefix}_{name}"

        async def read_resource(uri: str) -> str:
            """Read a resource by its URI.

            Args:
                uri: the resource's URI, as the server listed it or a tool's
                    result named it (a resource link).
            """
            return await self._read_for_model(uri)

        return Tool(
            read_resource,
            name=name,
            description=(
                f"Read a resource of MCP server {self.name} by its URI: one it "
                "listed, or one a tool's result named (a resource link)."
            ),
            timeout=self._timeout,
            needs_approval=self._approval(
                mcp_types.Tool(name=_READ_TOOL, input_schema={"type": "object"})
            ),
            execution_mode=self._execution_mode,
        )

    async def _read_for_model(self, uri: str) -> str:
        """A read the model asked for: only of a URI it may read.

        Raises:
            ToolError: the URI is not one the model may read, or the read failed.
        """
        assert self._reader is not None  # the tool that calls this exists
        tool = self._reader.name
        if len(uri) > URI_CHARS:
            raise ToolError(
                f"the URI is {len(uri):,} characters long: this tool reads "
                f"URIs of up to {URI_CHARS:,} characters",
                tool=tool,
            )
        if uri not in self._readable and self._may_relist():
            try:
                await self.list_resources()  # it may be new since
            except AgentFSMError as exc:
                raise ToolError(str(exc), tool=tool) from exc
        if uri not in self._readable:
            raise ToolError(self._unreadable(uri), tool=tool)
        try:
            contents = await self.read_resource(uri)
        except AgentFSMError as exc:
            raise ToolError(str(exc), tool=tool) from exc
        return contents_text(contents)

    def _may_relist(self) -> bool:
        """Whether the resource tool may list the resources now (at most
        once every `_RELIST_EVERY` seconds); if so, it is taken as listing."""
        now = anyio.current_time()
        if now - self._relisted < _RELIST_EVERY:
            return False
        self._relisted = now
        return True

    def _unreadable(self, uri: str) -> str:
        """Why the model may not read `uri`, as true as is known."""
        quoted = f"{clip(uri, 200)!r}"
        if self._readable.forgot:
            return (
                f"{quoted} is not among the last {READABLE:,} resources MCP "
                f"server {self.name} listed or a tool returned (older ones are "
                "forgotten; the list is fetched again at most every "
                f"{_RELIST_EVERY:g}s): only those can be read"
            )
        return (
            f"{quoted} is no resource MCP server {self.name} listed "
            "or a tool returned: only those can be read"
        )

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


def _at(
    fetch: Callable[[mcp.Client, str | None], Awaitable[_T]], cursor: str | None
) -> Callable[[mcp.Client], Awaitable[_T]]:
    """`fetch` of the page at `cursor`."""
    return lambda client: fetch(client, cursor)


def _text_argument(what: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigurationError(f"{what} must be a str, got {type(value).__name__}")
    return value


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
