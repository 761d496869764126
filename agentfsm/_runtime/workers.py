"""The tasks loops run in: a pool of reused workers.

Starting an anyio task costs more than a loop's whole first step (anyio builds a
task handle, a cancel scope and an event for each), so a loop is handed to an
idle worker task when there is one and a new worker is started only when none
is idle. A worker runs one loop at a time, in a copy of the context of whoever
started (or resumed) the loop, as if it were the loop's own task: context
variables set by the caller are seen by the loop, and what the loop sets stays
with the loop.

A worker is not reused after its loop was cancelled (cancelling a loop cancels
its worker's task), nor while the runtime is closing, nor when enough workers
are already idle.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from contextvars import Context, copy_context
from typing import TYPE_CHECKING, Any, Final

import anyio

from agentfsm._loop.driver import run
from agentfsm.results import LoopStatus

from .backend import in_context, in_trio_context, trio_task

if TYPE_CHECKING:
    from agentfsm._loop import Loop

    from .backend import Primitives

__all__ = ("MAX_IDLE", "Worker", "WorkerPool")

MAX_IDLE: Final = 64
"""Idle workers kept for the next loops; more exit once their loop has ended."""


class Worker:
    """One worker task: the loop it runs next, its task and what wakes it."""

    __slots__ = ("cancelled", "context", "handle", "loop", "rerun", "wake")

    def __init__(self) -> None:
        self.handle: anyio.TaskHandle[None] | None = None
        """The worker's task, once started (its scope is the one `cancel` cancels:
        a scope of the worker's own would be three more objects per loop in flight)."""
        self.cancelled = False
        self.loop: Loop | None = None
        self.context: Context | None = None
        self.wake: anyio.Event | None = None
        self.rerun: Context | None = None
        """Set when the loop this worker runs was resumed before its run ended
        (it paused, and was still publishing): the context to run it on in."""

    def cancel(self) -> None:
        """Cancel the worker's task, and with it the loop it runs (the worker then ends)."""
        self.cancelled = True
        if self.handle is not None:
            self.handle.cancel()


class WorkerPool:
    """Hands loops to idle workers, starting workers when none is idle."""

    __slots__ = ("_idle", "_on_loop_end", "_primitives", "_start", "closing", "running")

    def __init__(
        self,
        start: Callable[
            [Callable[[Worker], Coroutine[Any, Any, None]], Worker],
            anyio.TaskHandle[None],
        ],
        primitives: Primitives,
        on_loop_end: Callable[[Loop], None],
    ) -> None:
        self._start = start
        self._primitives = primitives
        self._on_loop_end = on_loop_end
        self._idle: list[Worker] = []
        self.running = 0
        """Loops running (handed to a worker and not yet returned)."""
        self.closing = False

    def run(self, loop: Loop) -> None:
        """Run `loop` in a worker, in a copy of the current context."""
        self.running += 1
        context = copy_context()
        if self._idle:
            worker = self._idle.pop()
            worker.loop, worker.context = loop, context
            assert worker.wake is not None
            worker.wake.set()
        else:
            self._launch(loop, context)

    def resume(self, loop: Loop) -> None:
        """Run a resumed loop, in a copy of the current context: in its own
        worker when it still has one (its run, paused, is still publishing the
        pause to a subscriber with backpressure), never in a second one."""
        worker = loop.worker
        if worker is None:
            self.run(loop)
        else:
            worker.rerun = copy_context()

    def _launch(self, loop: Loop, context: Context) -> None:
        """Start a worker for `loop`, giving it the loop before it starts."""
        worker = Worker()
        worker.loop, worker.context = loop, context
        worker.handle = self._start(self._work, worker)
        # Defensive: the anyio of this writing returns from `start_soon` before
        # the task runs (on trio, and on asyncio even with an eager task
        # factory), but a task started eagerly could cancel its loop before its
        # worker had the handle.
        if worker.cancelled:
            worker.handle.cancel()

    def close(self) -> None:
        """No more reuse: wake the idle workers so that they end."""
        self.closing = True
        idle, self._idle = self._idle, []
        for worker in idle:
            assert worker.wake is not None
            worker.wake.set()

    async def _work(self, worker: Worker) -> None:
        task = trio_task()
        try:
            while True:
                loop, context = worker.loop, worker.context
                if loop is None or context is None:
                    return  # woken by `close`
                worker.loop = worker.context = worker.wake = None
                loop.run_by(worker)
                try:
                    while True:
                        if task is None:
                            await in_context(context, run(loop))
                        else:
                            await in_trio_context(task, context, run(loop))
                        if worker.rerun is None:
                            break
                        context, worker.rerun = worker.rerun, None  # resumed meanwhile
                        if loop.status is LoopStatus.done or loop.detached:
                            break  # and ended, or stopped here, since
                except BaseException as exc:  # noqa: BLE001 - re-raised
                    # A cancellation (`run` raises nothing else). The task handle
                    # keeps the exception, which would keep the frames of the
                    # loop's run, and the loop, until the cycle collector frees
                    # the handle: they are left out of its traceback.
                    raise exc.with_traceback(None)  # noqa: B904 - the same exception
                finally:
                    loop.run_by(None)
                    self.running -= 1
                    self._on_loop_end(loop)
                    # Neither an idle worker nor the traceback of a cancelled
                    # one (its task handle keeps it) keeps the loop alive.
                    loop = context = None
                if worker.cancelled or self.closing or len(self._idle) >= MAX_IDLE:
                    return
                wake = worker.wake = self._primitives.event()
                self._idle.append(worker)
                try:
                    await wake.wait()
                except BaseException:
                    self._ended_idle(worker)
                    raise
        finally:
            # anyio's task handle keeps the exception a task ends with, whose
            # traceback keeps the handle's own frame: a cycle that only the
            # cycle collector frees. It holds this frame too, so the worker lets
            # go of the handle, and the loop is out of the frame (above).
            worker.handle = None

    def _ended_idle(self, worker: Worker) -> None:
        """`worker` ended while idle (the runtime left with an error, an outer
        scope was cancelled): it must not be handed a loop, and a loop handed to
        it meanwhile goes to a new worker (where it ends as cancelled if the
        cancellation reaches it too)."""
        if worker in self._idle:
            self._idle.remove(worker)
        elif worker.loop is not None and worker.context is not None:
            self._launch(worker.loop, worker.context)
