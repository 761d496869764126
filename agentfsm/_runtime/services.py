"""What a runtime holds open besides its loops: async context managers (an MCP
session, say) entered by `Runtime.enter_async_context` and closed on its exit.

Each one lives in a task of its own, in a task group entered before the loops'
task group and left after it. Its own task, because a context manager that
opens a task group or a cancel scope must be left in the task that entered it,
and the runtime is left from whichever task entered the runtime; before and
after the loops, because the loops use what it holds (the session their tools
call) until the last of them has ended.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any, Final, TypeVar

import anyio
from anyio.abc import TaskGroup, TaskStatus

from agentfsm._logging import get_logger

__all__ = ("CLOSE_TIMEOUT", "Services")

T = TypeVar("T")

CLOSE_TIMEOUT: Final = 10.0
"""Seconds the services have to close once the loops have ended; those still
open then are cancelled (a server that never answers cannot hold the exit)."""


class _Held:
    """One entered context manager: told to close by `stop`, `done` once closed."""

    __slots__ = ("done", "name", "stop")

    def __init__(self, name: str) -> None:
        self.name = name
        self.stop = anyio.Event()
        self.done = anyio.Event()


class Services:
    """The context managers a runtime holds open, closed last entered first."""

    __slots__ = ("_held", "_tg")

    def __init__(self) -> None:
        self._tg: TaskGroup | None = None
        self._held: list[_Held] = []

    async def open(self) -> None:
        """Enter the task group (before the loops' task group is)."""
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg

    async def enter(self, context: AbstractAsyncContextManager[T], name: str) -> T:
        """Enter `context` in a task of its own and return what it gave.

        Raises:
            Exception: whatever entering `context` raised (nothing stays open).
        """
        assert self._tg is not None
        held = _Held(name)
        value: T = await self._tg.start(self._hold, context, held, name=name)
        self._held.append(held)
        return value

    async def _hold(
        self,
        context: AbstractAsyncContextManager[Any],
        held: _Held,
        *,
        task_status: TaskStatus[Any],
    ) -> None:
        try:
            entered = False
            async with context as value:
                entered = True
                task_status.started(value)
                await held.stop.wait()
        except Exception:
            if not entered:
                raise  # to `enter`'s caller, through `start`
            # A service failing while it is open (a server process that died,
            # say) must not cancel the loops through the task group: the calls
            # that use it fail on their own, as error outputs.
            get_logger().exception("service_failed", service=held.name)
        finally:
            held.done.set()

    async def close(self) -> None:
        """Close every service, last entered first, and leave the task group
        (after the loops' task group was left).

        The closing is shielded, since the runtime may be leaving because it was
        cancelled, and bounded by `CLOSE_TIMEOUT`, past which the services still
        open are cancelled.
        """
        tg, self._tg = self._tg, None
        if tg is None:
            return
        held, self._held = self._held, []
        if held:  # (most runtimes hold nothing: the scopes cost ~15 µs)
            # These scopes are left before the task group's: scopes must nest.
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
                for one in reversed(held):
                    one.stop.set()
                    await one.done.wait()
            if not all(one.done.is_set() for one in held):
                tg.cancel_scope.cancel()  # those still open past the timeout
        await tg.__aexit__(None, None, None)
