"""A toolset's session with its MCP server (`Connection`): held open by a
task of the toolset, its requests' errors said as what they mean, and opened
again for a server at a URL that went away.

A session (`Session`) ends when the server goes away: a stdio server's process
exited, an HTTP server stopped answering or forgot the session. Its holder
task closes the client in the task that opened it (the SDK's task groups must
be left where they were entered); a request only asks it to (`end`) and waits.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final, Literal, TypeVar, final

import anyio
import mcp
import mcp_types
from anyio.abc import TaskGroup, TaskStatus
from mcp.client.session import MessageHandlerFnT
from mcp.client.subscriptions import ListenNotSupportedError, SubscriptionLost
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from agentfsm._logging import get_logger
from agentfsm.exceptions import ConfigurationError
from agentfsm.mcp._errors import MCPConnectionError, MCPRequestError
from agentfsm.mcp._options import reason
from agentfsm.mcp._stdio import ProcessTransport

__all__ = ("Connection", "Session", "connect_error", "is_lost")

_T = TypeVar("_T")

_CLOSING: Final = 10.0
"""Seconds a call waits for a lost session to be closed (the SDK's and the
transport's own shutdown is bounded well within it)."""


def is_lost(exc: mcp.MCPError) -> bool:
    """Whether the SDK's error says the connection is gone (not that the
    server refused a request): closed, or a session the server forgot (the
    streamable-HTTP client's `Session terminated`, for a 404 on its id)."""
    error = exc.error
    return error.code == mcp_types.CONNECTION_CLOSED or (
        error.code == mcp_types.INVALID_REQUEST
        and error.message == "Session terminated"
    )


@final
class Session:
    """An open `mcp.Client`, and how it ended once it has."""

    __slots__ = ("_said", "client", "ended", "lost", "release", "transport")

    def __init__(self, client: mcp.Client, transport: ProcessTransport | None) -> None:
        self.client = client
        """The SDK's client, entered by the holder task."""
        self.transport = transport
        """The stdio server's transport (its process), or None."""
        self.release = anyio.Event()
        """Set to ask the holder task to close the session."""
        self.ended = anyio.Event()
        """Set once the holder task has closed it."""
        self.lost: str | None = None
        """Why it ended when nobody asked it to (the first error seen)."""
        self._said: str | None = None

    @property
    def open(self) -> bool:
        """Whether calls may still go over it."""
        return not self.release.is_set()

    async def end(self, why: str | None) -> None:
        """Close it (the server is gone) and wait until it is closed; `why`
        is why it ended unless closing it says better (the transport's error,
        where the request only saw the connection close)."""
        self.release.set()
        with anyio.move_on_after(_CLOSING):
            await self.ended.wait()
        if self.lost is None:
            self.lost = why

    async def gone(self, server: str, *, reconnects: bool) -> str:
        """What a call that found the session gone says (the same each time)."""
        if self._said is None:
            self._said = await self._describe(server, reconnects=reconnects)
        return self._said

    async def _describe(self, server: str, *, reconnects: bool) -> str:
        if self.transport is not None:
            return (
                f"MCP server {server} is not running: {await self.transport.ending()}"
            )
        why = f" ({self.lost})" if self.lost else ""
        then = "; the next call connects again" if reconnects else ""
        return f"the connection to MCP server {server} was lost{why}{then}"


@final
class Connection:
    """A toolset's session with its server, over the toolset's life: opened
    in a task of the toolset's task group (`open`), and opened again, for a
    server at a URL, by the first request that finds it lost (`session`).

    Args:
        target: the server as `mcp.Client` takes it (a command's parameters
            are run by `ProcessTransport`, which keeps the exit status).
        server: the server's label (see `label_of`).
        mode: `mcp.Client`'s `mode`.
        connect_timeout: seconds to open a session.
        message_handler: `mcp.Client`'s `message_handler`.
        on_stale: called when the server's tool list may have changed.
    """

    __slots__ = (
        "_connect_timeout",
        "_message_handler",
        "_mode",
        "_on_stale",
        "_reconnecting",
        "_target",
        "_tg",
        "current",
        "reconnects",
        "server",
        "state",
    )

    def __init__(
        self,
        target: Any,
        *,
        server: str,
        mode: str,
        connect_timeout: float,
        message_handler: MessageHandlerFnT,
        on_stale: Callable[[], None],
    ) -> None:
        self._target = target
        self.server = server
        self._mode = mode
        self._connect_timeout = connect_timeout
        self._message_handler = message_handler
        self._on_stale = on_stale
        # Only a URL is connected to again: a stdio server that died may die
        # again (and its state is gone); a transport object is entered once.
        self.reconnects = isinstance(target, str)
        self.current: Session | None = None
        """The last session opened (open, or found gone)."""
        self.state: Literal["new", "open", "closed"] = "new"
        self._reconnecting = anyio.Lock()
        self._tg: TaskGroup | None = None

    async def open(self, tg: TaskGroup) -> Session:
        """Open the first session, held by a task of `tg`.

        Raises:
            MCPConnectionError: the server could not be started or reached.
        """
        self._tg = tg
        self.state = "open"
        session = self.current = await self._connect()
        return session

    async def close(self) -> None:
        """Close the session (in its holder task) and wait until it is."""
        self.state = "closed"
        session, self.current = self.current, None
        if session is not None:
            session.release.set()
            await session.ended.wait()

    async def request(
        self, send: Callable[[mcp.Client], Awaitable[_T]], *, what: str
    ) -> _T:
        """`send(client)` over the open session, its errors said as what they
        mean (`what` names the request in them).

        Raises:
            MCPConnectionError: the session is closed, or the server went away.
            MCPRequestError: the server answered with an error, or with a
                result that is not one.
        """
        session = await self.session()
        try:
            return await send(session.client)
        except mcp.MCPError as exc:
            if is_lost(exc):
                raise await self._lost(session, exc) from exc
            # A protocol error (an unknown tool, on some servers): it failed.
            raise MCPRequestError(
                f"MCP server {self.server} refused {what}: {exc.error.message}"
            ) from exc
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            raise await self._lost(session, exc) from exc
        except ValidationError as exc:
            raise MCPRequestError(
                f"MCP server {self.server} sent a result that is not one: {exc}"
            ) from exc
        except Exception as exc:  # said without the URL a transport's error may quote
            raise MCPRequestError(
                f"{what} to MCP server {self.server} failed: {reason(exc)}"
            ) from exc

    async def session(self) -> Session:
        """The open session: the current one, or (for a server at a URL
        whose session was lost) a new one.

        Raises:
            MCPConnectionError: the toolset is closed, the session was lost
                (and is not opened again), or opening it again failed.
        """
        session = self.current
        if session is None or self.state != "open":
            raise MCPConnectionError(
                f"the session with MCP server {self.server} is closed"
                + (" (its runtime has exited)" if self.state == "closed" else "")
            )
        if session.open:
            return session
        if not self.reconnects:
            raise MCPConnectionError(await self._gone(session))
        async with self._reconnecting:
            if self.current is session:  # no other request connected meanwhile
                await session.end(None)
                await self._reconnect()
        current = self.current
        if current is None or not current.open:
            raise MCPConnectionError(await self._gone(current or session))
        return current

    async def _reconnect(self) -> None:
        with anyio.move_on_after(self._connect_timeout) as deadline:
            try:
                self.current = await self._connect()
            except MCPConnectionError as exc:
                cause = exc.__cause__
                raise self._unreachable(
                    str(exc) if cause is None else reason(cause)
                ) from exc
        if deadline.cancelled_caught:
            raise self._unreachable(f"no answer within {self._connect_timeout:g}s")
        get_logger().info("mcp_reconnected", server=self.server)
        self._on_stale()  # its tools may have changed meanwhile

    def _unreachable(self, why: str) -> MCPConnectionError:
        return MCPConnectionError(
            f"the connection to MCP server {self.server} was lost, and connecting "
            f"again failed ({why}); the next call tries again"
        )

    async def _gone(self, session: Session) -> str:
        return await session.gone(self.server, reconnects=self.reconnects)

    async def _lost(self, session: Session, exc: BaseException) -> MCPConnectionError:
        """The session was found gone by a request: closed, and said so."""
        await session.end(reason(exc))
        return MCPConnectionError(await self._gone(session))

    async def _connect(self) -> Session:
        assert self._tg is not None  # opened
        try:
            session: Session = await self._tg.start(
                self._hold, name=f"mcp-session:{self.server}"
            )
        except Exception as exc:
            raise connect_error(self.server, exc) from exc
        return session

    async def _hold(self, *, task_status: TaskStatus[Session]) -> None:
        """Hold a session open until it is released, or lost (the server went
        away: the SDK's task group ends with the transport's error)."""
        target = self._target
        transport = None
        if isinstance(target, mcp.StdioServerParameters):
            target = transport = ProcessTransport(target, server=self.server)
        client = mcp.Client(
            target,
            mode=self._mode,
            message_handler=self._message_handler,
            cache=None,  # the toolset keeps the list, and knows when it is stale
        )
        session = Session(client, transport)
        started = False
        try:
            async with client, anyio.create_task_group() as tg:
                if _listens(client):
                    # From 2026-07-28 on, change notifications come on a stream
                    # the client asks for; before, they come unasked (the
                    # message handler). Connected once the stream is
                    # acknowledged: a change made after `mcp_tools` returned
                    # is never missed.
                    await tg.start(
                        self._listen, session, name=f"mcp-listen:{self.server}"
                    )
                started = True
                task_status.started(session)
                await session.release.wait()
                tg.cancel_scope.cancel()
        except Exception as exc:
            if not started:
                raise
            if session.lost is None:
                session.lost = reason(exc)
            get_logger().warning(
                "mcp_session_lost", server=self.server, error=session.lost
            )
        finally:
            session.release.set()
            session.ended.set()

    async def _listen(self, session: Session, *, task_status: TaskStatus[None]) -> None:
        """Follow the server's tool-list changes on a `subscriptions/listen`
        stream (2026-07-28 on), for as long as the session lasts; started once
        the server acknowledged the first stream (changes from then on are seen)."""
        started = False
        while True:
            try:
                async with session.client.listen(tools_list_changed=True) as changes:
                    if not started:
                        started = True
                        task_status.started()
                    async for _ in changes:
                        self._on_stale()
                return  # the server ended the stream: it sends no more changes
            except ListenNotSupportedError:
                if not started:
                    task_status.started()
                return
            except (SubscriptionLost, mcp.MCPError) as exc:
                if isinstance(exc, mcp.MCPError) and is_lost(exc):
                    # The server went away: the session ends (its holder
                    # says why, from the transport's error).
                    session.release.set()
                    if not started:
                        task_status.started()
                    return
                # No replay after a lost stream: listen again and fetch the list,
                # since a change may have been missed meanwhile.
                get_logger().warning(
                    "mcp_listen_lost", server=self.server, error=reason(exc)
                )
                if not started:
                    started = True
                    task_status.started()
                self._on_stale()
                await anyio.sleep(1.0)


def _listens(client: mcp.Client) -> bool:
    capability = client.server_capabilities.tools
    return (
        capability is not None
        and bool(capability.list_changed)
        and client.protocol_version in MODERN_PROTOCOL_VERSIONS
    )


def connect_error(server: str, exc: BaseException) -> BaseException:
    """What connecting failing with `exc` raises: a wrong `include` as it is,
    a cancellation as it is, anything else as an `MCPConnectionError`."""
    inner = exc
    while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
        inner = inner.exceptions[0]
    if isinstance(inner, ConfigurationError | MCPConnectionError):
        return inner
    if not isinstance(exc, Exception):
        return exc
    error = MCPConnectionError(f"cannot connect to MCP server {server}: {reason(exc)}")
    error.__cause__ = exc
    return error
