"""`StoreThread`: one thread of its own that runs a store's blocking calls.

`SQLiteStore` and `PostgresStore` each keep one connection (`sqlite3`'s,
psycopg's sync one), used from one thread and never from the event loop's. A
store's calls go to a thread it starts as it opens and ends as it closes, in
the order they come (a FIFO queue), and the caller's event loop is told when
each ends, on asyncio and trio alike; a cancelled caller waits for its call to
end (the cancellation comes after).

Why not `anyio.to_thread.run_sync` with a one-thread `CapacityLimiter`, what
the store used before: a call through it takes two turns of the event loop
before its function is handed over (its checkpoint, then the limiter's), and a
`queue.Queue` of Python locks each way. On the benchmark workload
(bench/bench_durable.py: 4 trips to the thread a run) that was ~37 µs a trip:
1,274 against 1,114 µs a run, A/B in 9 interleaved rounds (the floor it is
measured against, the bare loop plus plain commits, still hops through
`anyio.to_thread` for each). Tests: tests/internals/test_store_thread.py.
"""

from __future__ import annotations

import asyncio  # noqa: TID251 - a faster way back on asyncio (see `_Call`); trio's goes through anyio
import atexit
import collections
import contextlib
import contextvars
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import anyio
import anyio.lowlevel

__all__ = ("StoreThread",)

_T = TypeVar("_T")


class _Call(Generic[_T]):
    """One call, run in the thread (in a copy of its caller's context, as
    `anyio.to_thread` runs one); its caller waits for `done`, which the thread
    has the caller's event loop set once the call has ended."""

    __slots__ = (
        "context",
        "done",
        "ended",
        "error",
        "fn",
        "loop",
        "result",
        "token",
        "waker",
    )

    def __init__(self, fn: Callable[[], _T]) -> None:
        self.fn = fn
        self.context = contextvars.copy_context()
        self.result: _T | None = None
        self.error: BaseException | None = None
        self.ended = False
        """The call has ended (set in the caller's event loop, on asyncio)."""
        self.done: asyncio.Future[None] | anyio.Event
        self.loop: asyncio.AbstractEventLoop | None = None
        self.token: anyio.lowlevel.EventLoopToken | None = None
        self.waker: _Waker | None = None
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no asyncio loop runs here
            task = None
        if task is None:  # trio (or trio as asyncio's guest): through anyio
            self.token = anyio.lowlevel.current_token()
            self.done = anyio.Event()
        else:
            # asyncio: a future of the loop's, set by a callback of the loop's.
            # anyio's token, Event and `run_sync_soon` (what trio's path uses)
            # cost ~8 µs a call more: 1,176 against 1,143 µs a benchmark run
            # (4 calls). Both paths are tested (tests/internals/test_store_thread.py
            # runs on asyncio and trio).
            loop = self.loop = task.get_loop()
            self.done = loop.create_future()
            try:
                self.waker = _WAKERS[loop]
            except KeyError:  # the loop's first call
                self.waker = _waker(loop)
            except TypeError:  # a loop that cannot be weakly referenced
                self.waker = None

    def __call__(self) -> None:  # in the thread
        try:
            self.result = self.context.run(self.fn)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            self.error = exc
        # Its event loop may have ended (nobody waits): asyncio raises
        # RuntimeError, anyio RunFinishedError (a RuntimeError). Nothing else
        # is expected, and the thread must live on for the calls after it.
        with contextlib.suppress(Exception):
            if self.waker is not None:
                self.waker.wake(self)
            elif self.loop is not None:
                self.loop.call_soon_threadsafe(_ended, self)
            elif self.token is not None and isinstance(self.done, anyio.Event):
                token = self.token
                token.backend_class.run_sync_soon(self.done.set, (), token.native_token)

    async def wait(self) -> None:
        """Return once the call has ended, whatever cancellation comes: a
        cancel scope's is delivered at the caller's next checkpoint, after
        the call's result (as `anyio.to_thread.run_sync` does); a native
        asyncio one (`task.cancel()`: `asyncio.timeout`, `asyncio.run`
        ending), which comes once, is raised once the call has ended."""
        done = self.done
        with anyio.CancelScope(shield=True):
            if isinstance(done, anyio.Event):
                await done.wait()
                return
            try:
                await done
            except asyncio.CancelledError:
                # A native cancellation cancelled the future: another, for
                # `_ended` to set once the call has ended.
                if not self.ended and self.loop is not None:
                    self.done = self.loop.create_future()
                    await self.done
                raise


def _ended(call: _Call[Any]) -> None:
    """(In the caller's event loop, on asyncio.) The call has ended."""
    call.ended = True
    done = call.done
    if isinstance(done, asyncio.Future) and not done.done():
        done.set_result(None)


class _Waker:
    """How the store threads tell one asyncio event loop (on Linux) that calls
    have ended: an eventfd the loop watches (`add_reader`), and the calls.

    Through `call_soon_threadsafe` (asyncio's self-pipe, a socket pair: a
    send, then two reads and an exception in the loop), the loop resumed
    ~47 µs after a call ended, ~37 this way (alone, 4 x 3,000 round trips);
    a benchmark run makes 4 (bench/bench_durable.py). The eventfd lives as
    long as the loop (closed once the loop is garbage), and a call holds its
    loop until it has woken it: no thread writes to a closed fd."""

    __slots__ = ("ended", "fd")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.ended: collections.deque[_Call[Any]] = collections.deque()

    def wake(self, call: _Call[Any]) -> None:  # in a store's thread
        self.ended.append(call)
        os.eventfd_write(self.fd, 1)

    def drain(self) -> None:  # in the loop
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)
        ended = self.ended
        while ended:
            _ended(ended.popleft())


_WAKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Waker | None] = (
    weakref.WeakKeyDictionary()
)
"""Each asyncio event loop's waker (None: the loop cannot watch an fd, or the
system has no eventfd: `call_soon_threadsafe`)."""


def _waker(loop: asyncio.AbstractEventLoop) -> _Waker | None:
    """(In the loop.) The loop's waker, made on its first call."""
    waker = None
    if hasattr(os, "eventfd"):
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        waker = _Waker(fd)
        try:
            loop.add_reader(fd, waker.drain)
        except NotImplementedError:  # (a loop that cannot watch an fd)
            os.close(fd)
            waker = None
        else:
            weakref.finalize(loop, os.close, fd)
    _WAKERS[loop] = waker
    return waker


_RUNNING: weakref.WeakSet[StoreThread] = weakref.WeakSet()
"""The threads running: joined as the interpreter exits (`_join_all`)."""


class StoreThread:
    """A thread that runs the calls given to `run`, one at a time, in order,
    from `start` to `stop`.

    A daemon, joined as the interpreter exits: a store never closed does not
    keep the process from exiting, and the calls it was given still run (the
    writes of a runtime whose task was cancelled natively, by Ctrl-C under
    `asyncio.run`, say). Give `owner` to `start` to have the thread stop once
    the owner is garbage (a store dropped without being closed).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[Callable[[], None] | None] | None = None
        self._thread: threading.Thread | None = None
        self._opening = 0
        """`open` calls waiting for their `connect`."""

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, owner: object = None) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self._name} is running already")
        # A queue of its own: a thread stopped and started again never has
        # two serving one queue.
        calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        thread = threading.Thread(
            target=_serve, args=(calls,), name=self._name, daemon=True
        )
        thread.start()
        self._calls, self._thread = calls, thread
        _RUNNING.add(self)
        if owner is not None:
            weakref.finalize(owner, calls.put, None)

    def stop(self) -> threading.Thread | None:
        """End the thread once the calls given it so far have run (it returns
        the thread, to join if you must see it gone)."""
        thread, self._thread = self._thread, None
        calls, self._calls = self._calls, None
        _RUNNING.discard(self)
        if calls is not None:
            calls.put(None)
        return thread

    async def open(
        self, owner: object, connect: Callable[[], None], opened: Callable[[], bool]
    ) -> None:
        """A store opening: start the thread, unless it runs (it stops once
        `owner` is garbage, a store never closed), and run `connect` in it. If
        that fails, stop the thread again, unless another `open` waits for it
        or the store is `opened()` (another `open` connected it)."""
        if self._thread is None:
            self.start(owner)
        self._opening += 1
        try:
            await self.run(connect)
        except BaseException:
            if self._opening == 1 and not opened():
                self.stop()
            raise
        finally:
            self._opening -= 1

    async def run(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` in the thread; return what it returns, or raise what it
        raises. A call given the thread runs: a caller cancelled meanwhile
        waits for it to end (after the calls given before it), and the
        cancellation comes after (see `_Call.wait`); one cancelled already
        gives it nothing."""
        calls = self._calls
        if calls is None:
            raise RuntimeError(f"{self._name} is not running")
        await anyio.lowlevel.checkpoint_if_cancelled()
        call = _Call(fn)
        calls.put(call)
        await call.wait()
        error = call.error
        if error is not None:
            try:
                raise error
            finally:
                del call, error  # (no cycle through this frame)
        return cast("_T", call.result)


def _serve(calls: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    while True:
        call = calls.get()
        if call is None:
            return
        call()
        del call  # not kept while the thread waits for the next


@atexit.register
def _join_all() -> None:
    """As the interpreter exits: let each thread still running run the calls
    it was given, then end."""
    for store_thread in list(_RUNNING):
        thread = store_thread.stop()
        if thread is not None:
            thread.join()
