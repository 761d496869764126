"""An MCP server run as a subprocess over stdio, whose exit status is kept.

The SDK's `stdio_client` hides its process: when the server dies, the session
only sees its output end, and cannot say why. This transport speaks the same
protocol (one JSON-RPC message a line each way, the server in a process group
of its own, stdin closed first and the group terminated if the server lingers,
or if members of it outlive the server) and keeps the process, so that a dead
server is reported with its exit status, or with what it did that ended the
session (`ProcessTransport.ending`). A child that starts a session of its own
(a daemon) leaves the group, and is not stopped.

What the server writes is read line by line as bytes: a line that is not
text in the server's encoding, or longer than `LINE_BYTES`, is logged and
dropped (one bad line does not end the session); a line with a lone surrogate
escape (`"\\ud83d"`, a JavaScript string cut mid-emoji) is read with the
surrogate escaped as text (`agentfsm._text.encodable`).

On Windows the SDK's transport is used as it is (its process job is Windows'
own way to stop a tree); the exit status is then unknown.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import (
    AbstractAsyncContextManager,
    aclosing,
    asynccontextmanager,
    suppress,
)
from types import TracebackType
from typing import Final

import anyio
import mcp_types
from anyio.abc import AsyncResource, ByteReceiveStream, Process
from mcp.client.stdio import (
    StdioServerParameters,
    get_default_environment,
    stdio_client,
)
from mcp.shared.message import SessionMessage

from agentfsm._logging import get_logger
from agentfsm._text import clip, encodable, encodable_data, printable

__all__ = ("LINE_BYTES", "ProcessTransport", "ended")

_GRACE: Final = 2.0
"""Seconds a server has to exit once its stdin is closed (the SDK's), and
then once it is sent SIGTERM, before the tree is killed."""

_POLL: Final = 0.01
"""How often the process's exit is looked for: `Process.wait()` would also
wait for a pipe a child of the server may hold open (as the SDK says)."""

LINE_BYTES: Final = 16 * 1024 * 1024
"""The longest line read from a server, in bytes: a longer one is logged and
dropped unread (a message that big is no answer the model could use, and a
line without end would hold memory without bound)."""

_LOGGED: Final = 20
"""Dropped lines logged per session (a server writing garbage without end
cannot flood the log); the rest are counted in the last warning."""

_QUOTED: Final = 200
"""Characters of a dropped line quoted in its warning."""


class ProcessTransport:
    """A transport for `mcp.Client`: the server's command as a subprocess.

    One use: entered once, it starts the process; left, it stops it.

    Args:
        params: the command, its arguments, environment and working directory.
        server: the server's label, for the log.
    """

    def __init__(self, params: StdioServerParameters, *, server: str = "") -> None:
        self.params = params
        self.server = server or params.command
        self.process: Process | None = None
        """The server's process, once started (POSIX)."""
        self._context: AbstractAsyncContextManager[tuple[object, object]] | None = None
        self._left: str | None = None  # what the server did that ended the session
        self._signalled = False  # whether it was stopped by a signal of ours
        self._dropped = 0

    async def __aenter__(self) -> tuple[object, object]:
        if self._context is not None:
            raise RuntimeError("a ProcessTransport is entered once")
        if sys.platform == "win32":  # pragma: no cover - POSIX CI
            self._context = stdio_client(self.params)
        else:
            self._context = self._run()
        return await self._context.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._context is not None  # entered
        return await self._context.__aexit__(exc_type, exc, tb)

    async def exit_status(self) -> int | None:
        """The process's exit status once it has ended (waiting a little for
        it to be reaped), or None: not started, still running, or unknown."""
        if self.process is None:
            return None
        await _exited(self.process, _GRACE)
        return self.process.returncode

    async def ending(self) -> str:
        """How the server's session ended, as a clause: `its process exited
        with code 3`; or, when the server ended it while still running and
        was then stopped by a signal of ours (which its exit status would
        blame), what it did: `it closed its stdout while still running`."""
        status = await self.exit_status()
        if self._left is not None and self._signalled:
            return f"it {self._left} while still running (agentfsm then stopped it)"
        return f"its process {ended(status)}"

    @asynccontextmanager
    async def _run(self) -> AsyncIterator[tuple[object, object]]:
        params = self.params
        process = self.process = await anyio.open_process(
            [params.command, *params.args],
            env=get_default_environment() | (params.env or {}),
            stderr=sys.stderr,
            cwd=params.cwd,
            start_new_session=True,  # its own process group: the tree is stopped
        )
        # No await until the task group is entered: a cancel in between would
        # leave the process running.
        to_session, from_server = anyio.create_memory_object_stream[
            SessionMessage | Exception
        ](0)
        to_server, from_session = anyio.create_memory_object_stream[SessionMessage](0)

        async def read() -> None:
            assert process.stdout is not None  # opened with pipes
            try:
                lines = _lines(process.stdout, self._drop)
                async with to_session, aclosing(lines):  # closed here, not by GC
                    async for line in lines:
                        message = self._parsed(line)
                        if message is not None:
                            await to_session.send(message)
                # Its stdout ended: the closed stream tells the session.
                if self._left is None:
                    self._left = "closed its stdout"
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass  # the session is gone, or the transport closed stdout
            finally:
                # Read on until the server exits: one flushing its output as it
                # exits must not block on a full pipe (and be killed for it).
                await _drain(process.stdout)

        async def write() -> None:
            assert process.stdin is not None  # opened with pipes
            try:
                async with from_session:
                    async for message in from_session:
                        line = message.message.model_dump_json(
                            by_alias=True, exclude_unset=True
                        )
                        await process.stdin.send(
                            (line + "\n").encode(
                                params.encoding, params.encoding_error_handler
                            )
                        )
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                # The server cannot be written to: end the session's reading too,
                # or a request would wait for an answer that cannot come.
                if self._left is None:
                    self._left = "closed its stdin"
                await to_session.aclose()

        async with anyio.create_task_group() as tg:
            tg.start_soon(read, name="mcp-stdio-read")
            tg.start_soon(write, name="mcp-stdio-write")
            try:
                yield from_server, to_server
            finally:
                # Shielded and bounded: a cancelled caller must not leave the
                # server running, nor wait for it forever.
                with anyio.CancelScope(shield=True):
                    # The session reads no more: the reader turns to draining.
                    await from_server.aclose()
                    await to_server.aclose()
                    self._signalled = await _stop(process)
                    for stream in (to_session, from_session):
                        await stream.aclose()
                    _release(process)
                tg.cancel_scope.cancel()

    def _parsed(self, line: bytes) -> SessionMessage | Exception | None:
        """A line as a message, the error it is (the session surfaces it),
        or None when it is dropped (not text)."""
        params = self.params
        try:
            text = line.decode(params.encoding, params.encoding_error_handler)
        except UnicodeDecodeError as exc:
            self._drop(f"it is not {params.encoding} ({exc.reason})", line)
            return None
        if not text.strip():
            return None
        adapter = mcp_types.jsonrpc_message_adapter
        try:
            return SessionMessage(adapter.validate_json(text, by_name=False))
        except ValueError as exc:
            error = exc
        # Pydantic's parser refuses a lone surrogate escape, which JSON allows
        # (and a JavaScript server writes for a string cut mid-emoji): parsed
        # again by `json`, the surrogate escaped as text, as elsewhere.
        try:
            data = encodable_data(json.loads(text))
            return SessionMessage(adapter.validate_python(data, by_name=False))
        except ValueError:
            pass
        self._drop(f"it is no JSON-RPC message ({clip(str(error), _QUOTED)})", line)
        return error

    def _drop(self, why: str, line: bytes) -> None:
        """Log a line of the server's that is not read (`why`), up to `_LOGGED`."""
        self._dropped += 1
        if self._dropped > _LOGGED:
            return
        quoted = printable(
            encodable(line[: _QUOTED * 4].decode("utf-8", "backslashreplace")),
            newlines=False,
        )
        get_logger().warning(
            "mcp_line_dropped",
            server=self.server,
            why=why,
            line=clip(quoted, _QUOTED),
            bytes=len(line),
            more_not_logged=self._dropped == _LOGGED,
        )


async def _lines(
    stdout: ByteReceiveStream, drop: Callable[[str, bytes], None]
) -> AsyncGenerator[bytes, None]:
    """The lines of `stdout` (without their newline), each found once, in
    linear time; a line over `LINE_BYTES` is `drop`ped without being kept."""
    buffer = bytearray()
    skipping = False  # within a line too long, up to its newline
    async for chunk in stdout:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            if skipping:
                skipping = False
            elif len(buffer) + end - start > LINE_BYTES:
                drop(_too_long(), bytes(buffer[:_QUOTED]))
            else:
                buffer += chunk[start:end]
                yield bytes(buffer)
            buffer.clear()
            start = end + 1
        if not skipping:
            buffer += chunk[start:]
            if len(buffer) > LINE_BYTES:
                drop(_too_long(), bytes(buffer[:_QUOTED]))
                buffer.clear()
                skipping = True
    if buffer.strip() and not skipping:
        yield bytes(buffer)


def _too_long() -> str:
    return f"it is longer than {LINE_BYTES:,} bytes"


async def _drain(stdout: ByteReceiveStream) -> None:
    """Read and discard `stdout` until it ends (or is closed)."""
    with suppress(
        anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError
    ):
        while True:
            await stdout.receive()


def _release(process: Process) -> None:
    """Close asyncio's transport of the process (anyio's `Process` keeps it
    open while a pipe may be, and it warns, late, once the loop is closed)."""
    transport = getattr(process, "_transport", None)  # asyncio's; trio has none
    if transport is not None:
        with suppress(OSError):
            transport.close()


async def _stop(process: Process) -> bool:
    """Close the server's stdin, give it time to exit, then stop its process
    group; whether the server itself had to be signalled."""
    from mcp.os.posix.utilities import terminate_posix_process_tree

    await _close(process.stdin)
    signalled = not await _exited(process, _GRACE)
    # Also when the server exited: its children in its group outlive it
    # (the group's id stays taken while it has members; gone, this is a no-op).
    await terminate_posix_process_tree(process, _GRACE)
    if signalled:
        await _exited(process, _GRACE)
    await _close(process.stdout)
    return signalled


async def _exited(process: Process, seconds: float) -> bool:
    """Whether the process ends within `seconds` (polled: see `_POLL`)."""
    with anyio.move_on_after(seconds):
        while process.returncode is None:  # noqa: ASYNC110 - no event to wait on
            await anyio.sleep(_POLL)
    return process.returncode is not None


async def _close(stream: AsyncResource | None) -> None:
    if stream is not None:
        with suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await stream.aclose()


def ended(status: int | None) -> str:
    """How the process ended, from its exit status: `exited with code 3`,
    `was killed by signal SIGKILL`, or `exited` when the status is unknown."""
    if status is None:
        return "exited"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = str(-status)
        return f"was killed by signal {name}"
    return f"exited with code {status}"
