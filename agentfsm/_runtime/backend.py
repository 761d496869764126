"""What differs between asyncio and trio, in one place: anyio's backend classes
found once, a parallel batch's tasks, a worker's switch into a loop's context,
and coroutine stepping.

- `primitives()`: `anyio.CancelScope()` and `anyio.Event()` find the running
  backend (a sniffio lookup) and then call its class; a runtime finds the
  classes once, and its loops call them directly. On asyncio, it picks this
  module's `AsyncioEvent` and `run_asyncio_tasks` over anyio's event and task
  group.
- A worker runs each loop in a copy of its starter's context: on asyncio by
  stepping the loop's coroutine inside `Context.run` (`in_context`), on trio by
  switching the task's own context (`in_trio_context`).
"""

from __future__ import annotations

import asyncio  # noqa: TID251 - the asyncio backend's event and tasks
import sys
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import Context
from functools import partial
from typing import Any, Self, TypeAlias

import anyio
from anyio import EventStatistics
from anyio.lowlevel import checkpoint

from agentfsm._in_context import in_context

__all__ = (
    "AsyncioEvent",
    "Primitives",
    "TaskRunner",
    "in_context",
    "in_trio_context",
    "primitives",
    "run_asyncio_tasks",
    "run_tasks",
    "trio_task",
)

TaskRunner: TypeAlias = Callable[
    [int, Callable[[], Awaitable[None]], str], Awaitable[None]
]
"""`run_tasks(count, task, name)`, or the asyncio backend's `run_asyncio_tasks`."""


class Primitives:
    """The anyio classes the hot path makes instances of, and how it runs tasks."""

    __slots__ = ("cancel_scope", "event", "run_tasks")

    def __init__(
        self,
        cancel_scope: Callable[..., anyio.CancelScope],
        event: Callable[[], anyio.Event],
        tasks: TaskRunner | None = None,
    ) -> None:
        self.cancel_scope = cancel_scope
        self.event = event
        self.run_tasks: TaskRunner = run_tasks if tasks is None else tasks


def primitives() -> Primitives:
    """The running backend's `CancelScope` and `Event` classes (on asyncio,
    `AsyncioEvent` for anyio's) and task runner."""
    cancel_scope = type(anyio.CancelScope())
    event: Callable[[], anyio.Event] = type(anyio.Event())
    if event.__module__ == "anyio._backends._asyncio":
        runner = partial(run_asyncio_tasks, cancel_scope)
        return Primitives(cancel_scope, AsyncioEvent, runner)
    return Primitives(cancel_scope, event, run_tasks)


async def run_tasks(count: int, task: Callable[[], Awaitable[None]], name: str) -> None:
    """Run `count` tasks of `task` at once and return once all have ended.

    The first that raises (an `Exception`) cancels the others, and its error
    is raised, as it is, once they have all ended (anyio's task group would
    raise it in an `ExceptionGroup`). A cancel of the caller cancels them all.
    """
    errors: list[Exception] = []

    async def one() -> None:
        try:
            await task()
        except Exception as exc:  # noqa: BLE001 - raised below, once all ended
            errors.append(exc)
            group.cancel_scope.cancel()

    async with anyio.create_task_group() as group:
        for _ in range(count):
            group.start_soon(one, name=name)
    if errors:
        raise errors[0]


async def run_asyncio_tasks(
    cancel_scope: Callable[..., anyio.CancelScope],
    count: int,
    task: Callable[[], Awaitable[None]],
    name: str,
) -> None:
    """`run_tasks` in asyncio's own tasks, cancelled the way anyio's are.

    anyio's task group gives each task a cancel scope, an event and a
    coroutine around it: ~53,000 instructions a task more than this (10 calls
    of a tool that waits once, in 8 tasks: 1.68x a sequential batch against
    ~1.45x, `bench/bench_scaling.py --only tools`). Each task here runs in one
    cancel scope of its own, with the caller's effective deadline, and is
    cancelled through it, never with `Task.cancel`: a shielded scope inside
    a task (a tool's cleanup, the journal recording an output) holds, and a
    cancel reaches a task when it next waits, as in anyio's group.
    """
    loop = asyncio.get_running_loop()
    deadline = anyio.current_effective_deadline()
    scopes: list[anyio.CancelScope] = []
    errors: list[Exception] = []
    running = count
    stopping = False
    waiter: asyncio.Future[None] | None = None

    def stop() -> None:
        nonlocal stopping
        stopping = True
        for scope in scopes:
            scope.cancel()

    async def one() -> None:
        nonlocal running
        try:
            with cancel_scope(deadline=deadline) as scope:
                scopes.append(scope)
                if stopping:  # stopped before this task took its first step
                    scope.cancel()
                await task()
        except Exception as exc:  # noqa: BLE001 - raised by the caller, once all ended
            errors.append(exc)
            stop()
        finally:
            running -= 1
            if not running and waiter is not None and not waiter.done():
                waiter.set_result(None)

    # Held here: the event loop holds its tasks only weakly.
    tasks = [loop.create_task(one(), name=name) for _ in range(count)]
    try:
        while running:
            waiter = loop.create_future()
            await waiter
    except asyncio.CancelledError:
        # The caller's scope was cancelled: cancel the tasks and wait for
        # them, shielded (as anyio's group does: anyio would deliver the
        # cancel again at every turn of the event loop until they end).
        stop()
        with cancel_scope(shield=True):
            while running:
                waiter = loop.create_future()
                await waiter
        raise
    del tasks
    if errors:
        raise errors[0]


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
