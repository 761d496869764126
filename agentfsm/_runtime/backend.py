"""What differs between asyncio and trio, in one place: anyio's backend classes
found once, a worker's switch into a loop's context, and coroutine stepping.

- `primitives()`: `anyio.CancelScope()` and `anyio.Event()` find the running
  backend (a sniffio lookup) and then call its class; a runtime finds the
  classes once, and its loops call them directly.
- A worker runs each loop in a copy of its starter's context: on asyncio by
  stepping the loop's coroutine inside `Context.run` (`in_context`), on trio by
  switching the task's own context (`in_trio_context`).
"""

from __future__ import annotations

import asyncio  # noqa: TID251 - the asyncio backend's event (`AsyncioEvent`)
import sys
from collections.abc import Callable, Coroutine
from contextvars import Context
from typing import Any, Self

import anyio
from anyio import EventStatistics
from anyio.lowlevel import checkpoint

from agentfsm._in_context import in_context

__all__ = (
    "AsyncioEvent",
    "Primitives",
    "in_context",
    "in_trio_context",
    "primitives",
    "trio_task",
)


class Primitives:
    """The anyio classes the hot path makes instances of."""

    __slots__ = ("cancel_scope", "event")

    def __init__(
        self,
        cancel_scope: Callable[..., anyio.CancelScope],
        event: Callable[[], anyio.Event],
    ) -> None:
        self.cancel_scope = cancel_scope
        self.event = event


def primitives() -> Primitives:
    """The running backend's `CancelScope` and `Event` classes (on asyncio,
    `AsyncioEvent` for anyio's)."""
    event: Callable[[], anyio.Event] = type(anyio.Event())
    if event.__module__ == "anyio._backends._asyncio":
        event = AsyncioEvent
    return Primitives(type(anyio.CancelScope()), event)


class AsyncioEvent(anyio.Event):
    """anyio's `Event` on asyncio, with asyncio's own `Event` inlined.

    anyio's asyncio event holds an `asyncio.Event` and forwards to it: a
    second object per event, a coroutine more per wait, and asyncio's check
    of which event loop the event belongs to (a lock taken on its first wait).
    Each loop makes one event for whoever waits for its end and one for its
    worker's next loop, and a subscriber one each time it waits: this one
    waits on a future of the running loop directly (~6,000 instructions less
    an event, `make bench-instructions`; bench/PERFORMANCE.md). Same
    behaviour: `set` wakes every waiter, a waiter cancelled meanwhile is
    dropped, and `wait` on a set event is a checkpoint (anyio's rule).
    """

    __slots__ = ("_value", "_waiters")

    def __new__(cls) -> Self:
        return object.__new__(cls)

    def __init__(self) -> None:
        self._value = False
        self._waiters: list[asyncio.Future[None]] = []

    def set(self) -> None:
        if self._value:
            return
        self._value = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def is_set(self) -> bool:
        return self._value

    async def wait(self) -> None:
        if self._value:
            await checkpoint()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            self._waiters.remove(waiter)

    def statistics(self) -> EventStatistics:
        return EventStatistics(len(self._waiters))


def trio_task() -> Any:
    """The running trio task, or None when the event loop is not trio's."""
    trio = sys.modules.get("trio")
    if trio is None:
        return None
    try:
        return trio.lowlevel.current_task()
    except RuntimeError:
        return None


async def in_trio_context(
    task: Any, context: Context, coro: Coroutine[Any, Any, None]
) -> None:
    """Await `coro` with the trio task running in `context`.

    trio runs each step of a task in `task.context` and swaps it itself when a
    thread calls back in (`from_thread.run` runs in the waiting task, in the
    thread's context), which stepping the coroutine inside `Context.run` would
    override: so on trio the task's own context is switched instead.
    """
    import trio

    own = task.context
    task.context = context
    try:
        await trio.lowlevel.cancel_shielded_checkpoint()  # the next step runs in it
        await coro
    finally:
        task.context = own
