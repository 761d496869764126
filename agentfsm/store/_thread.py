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
import contextlib
import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import Generic, TypeVar, cast

import anyio
import anyio.lowlevel

__all__ = ("StoreThread",)

_T = TypeVar("_T")


class _Call(Generic[_T]):
    """One call, run in the thread; its caller waits for `done`, which the
    thread has the caller's event loop set once the call has ended."""

    __slots__ = ("done", "error", "fn", "notify", "result")

    def __init__(self, fn: Callable[[], _T]) -> None:
        self.fn = fn
        self.result: _T | None = None
        self.error: BaseException | None = None
        self.done: asyncio.Future[None] | anyio.Event
        self.notify: Callable[[], object]
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no asyncio loop runs here
            task = None
        if task is None:  # trio (or trio as asyncio's guest): through anyio
            token = anyio.lowlevel.current_token()
            event = anyio.Event()
            self.done = event
            self.notify = partial(
                token.backend_class.run_sync_soon, event.set, (), token.native_token
            )
        else:
            # asyncio: a future of the loop's, set by a callback of the loop's.
            # anyio's token, Event and `run_sync_soon` (what trio's path uses)
            # cost ~8 µs a call more: 1,176 against 1,143 µs a benchmark run
            # (4 calls). Both paths are tested (tests/internals/test_store_thread.py
            # runs on asyncio and trio).
            loop = task.get_loop()
            future = loop.create_future()
            self.done = future
            self.notify = partial(loop.call_soon_threadsafe, _resolve, future)

    def __call__(self) -> None:  # in the thread
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            self.error = exc
        # Its event loop may have ended (nobody waits): asyncio raises
        # RuntimeError, anyio RunFinishedError.
        with contextlib.suppress(RuntimeError):
            self.notify()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # (a native asyncio cancellation may have come first)
        future.set_result(None)


class StoreThread:
    """A thread that runs the calls given to `run`, one at a time, in order,
    from `start` to `stop`."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        # A daemon: a store never closed must not keep the process from
        # exiting (a write cut short is rolled back by SQLite, never torn).
        thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
        thread.start()
        self._thread = thread

    def stop(self) -> threading.Thread | None:
        """End the thread once the calls given it so far have run (it returns
        the thread, to join if you must see it gone)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._calls.put(None)
        return thread

    async def run(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` in the thread; return what it returns, or raise what it
        raises. A cancelled caller does not abandon it: the cancellation is
        delivered after it ends (one already delivered before it starts)."""
        if self._thread is None:
            raise RuntimeError(f"{self._name} is not running")
        await anyio.lowlevel.checkpoint_if_cancelled()
        call = _Call(fn)
        self._calls.put(call)
        done = call.done
        with anyio.CancelScope(shield=True):
            await (done.wait() if isinstance(done, anyio.Event) else done)
        if call.error is not None:
            raise call.error
        return cast("_T", call.result)

    def _serve(self) -> None:
        calls = self._calls
        while (call := calls.get()) is not None:
            call()
