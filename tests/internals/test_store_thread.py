"""The SQLite store's own thread (`agentfsm.store._thread.StoreThread`): calls run
there, in order, and come back to the caller's event loop (on asyncio through a
future of the loop's, on trio through anyio: both are tested here)."""

from __future__ import annotations

import gc
import os
import sqlite3
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import partial
from pathlib import Path
from typing import Self

import anyio
import anyio.to_thread
import pytest

from agentfsm.store import SQLiteStore, StoreError, StoreSchemaError
from agentfsm.store._thread import _WAKERS, StoreThread, _Call
from tests.helpers import wait_until

REQUEST: ContextVar[str] = ContextVar("request", default="unset")


@contextmanager
def running() -> Iterator[StoreThread]:
    """A thread for the test, stopped after it."""
    thread = StoreThread("store-test")
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()


class Gate:
    """Holds the thread in a call (`hold`) until `release`: released as the
    test leaves it, whatever happened (a failing test does not wait 5 s)."""

    def __init__(self) -> None:
        self._held = threading.Event()
        self._released = threading.Event()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def hold(self) -> None:  # in the thread
        self._held.set()
        self._released.wait(5)

    def release(self) -> None:
        self._released.set()

    async def held(self) -> None:
        """Return once the thread holds it."""
        assert await anyio.to_thread.run_sync(self._held.wait, 5)


async def test_calls_run_in_the_thread_in_order_and_return_or_raise() -> None:
    with running() as thread:
        caller = threading.get_ident()
        ran: list[tuple[int, int]] = []
        given: list[int] = []

        def step(n: int) -> int:
            ran.append((n, threading.get_ident()))
            return n * 10

        def fail() -> None:
            raise ValueError("no such row")

        results: list[int] = []

        async def one(n: int) -> None:
            given.append(n)  # (trio starts tasks in no set order)
            results.append(await thread.run(lambda: step(n)))

        async with anyio.create_task_group() as tg:
            for n in range(20):
                tg.start_soon(one, n)
        assert sorted(results) == [n * 10 for n in range(20)]
        assert [n for n, _ in ran] == given  # in the order they were given
        (worker,) = {ident for _, ident in ran}
        assert worker != caller  # never the event loop's thread
        with pytest.raises(ValueError, match="no such row"):
            await thread.run(fail)
        assert await thread.run(lambda: 7) == 7  # it goes on after one raised


async def test_a_cancelled_caller_does_not_abandon_its_call() -> None:
    done: list[str] = []
    seen_after: list[tuple[str, list[str]]] = []
    scope = anyio.CancelScope()

    with running() as thread, Gate() as gate:

        def slow_write() -> str:
            gate.hold()
            done.append("written")
            return "ok"

        async def cancel_once_held() -> None:
            await gate.held()
            scope.cancel()
            await anyio.sleep(0.05)  # the caller is still waiting
            gate.release()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_once_held)
            with scope:
                returned = await thread.run(slow_write)
                seen_after.append((returned, list(done)))
                await anyio.sleep(5)  # the cancellation, delivered now
        assert scope.cancelled_caught
        assert seen_after == [("ok", ["written"])]  # it returned once it had ended
        with anyio.CancelScope() as scope:
            scope.cancel()
            await thread.run(lambda: done.append("never"))  # cancelled before
        assert done == ["written"]


async def test_stop_ends_the_thread_after_the_calls_given_it() -> None:
    thread = StoreThread("store-test")
    thread.start()
    ran: list[int] = []
    await thread.run(lambda: ran.append(1))
    stopped = thread.stop()
    assert stopped is not None
    assert not thread.running
    stopped.join(5)
    assert not stopped.is_alive()
    with pytest.raises(RuntimeError, match="store-test is not running"):
        await thread.run(lambda: ran.append(2))
    assert ran == [1]
    thread.start()  # and may start again
    try:
        assert await thread.run(lambda: 3) == 3
    finally:
        thread.stop()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_call_whose_event_loop_ended_does_not_raise_in_the_thread(
    backend: str,
) -> None:
    finished = threading.Event()
    with running() as thread, Gate() as gate:

        async def leave_it_running() -> None:
            # A call the event loop never waits for: its loop has ended by the
            # time it ends, and its notice has nowhere to go.
            calls = thread._calls
            assert calls is not None
            calls.put(_Call(gate.hold))
            calls.put(finished.set)

        anyio.run(leave_it_running, backend=backend)
        gate.release()
        assert finished.wait(5)  # the thread went on to the next call
        assert thread.running


async def test_the_sqlite_store_runs_in_a_thread_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / "loops.db"
    store = SQLiteStore(path)
    with pytest.raises(StoreError, match="is not open"):
        await store.load("nobody")

    def threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == f"agentfsm-sqlite {path}"]

    async with store:
        (ours,) = threads()
        assert await store.load("nobody") is None
    ours.join(5)
    assert not ours.is_alive()
    assert threads() == []
    with pytest.raises(StoreError, match="is not open"):
        await store.load("nobody")
    async with store:  # opened again: a new thread
        assert await store.load("nobody") is None
        assert len(threads()) == 1


async def test_a_failed_open_leaves_no_thread(tmp_path: Path) -> None:
    path = tmp_path / "newer.db"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version=99")
    store = SQLiteStore(path)
    with pytest.raises(StoreSchemaError, match="not an agentfsm store"):
        await store.open()
    name = f"agentfsm-sqlite {path}"
    for thread in [t for t in threading.enumerate() if t.name == name]:
        thread.join(5)
    assert not [t for t in threading.enumerate() if t.name == name]


async def test_a_call_waiting_its_turn_runs_though_its_caller_is_cancelled() -> None:
    """A call given the thread is not lost (through a limiter, a write that
    waited for a busy thread was dropped): its cancelled caller waits for it."""
    ran: list[str] = []
    returned: list[str] = []
    scope = anyio.CancelScope()

    def second() -> str:
        ran.append("second")
        return "second"

    with running() as thread, Gate() as gate:

        def first() -> None:
            gate.hold()
            ran.append("first")

        async def second_caller() -> None:
            with scope:
                returned.append(await thread.run(second))
                await anyio.sleep(5)  # the cancellation, now

        async with anyio.create_task_group() as tg:
            tg.start_soon(thread.run, first)
            await gate.held()
            tg.start_soon(second_caller)
            calls = thread._calls
            assert calls is not None
            await wait_until(lambda: calls.qsize() == 1)  # the second, queued
            scope.cancel()
            await anyio.sleep(0.05)
            assert returned == []  # its caller still waits
            gate.release()
        assert scope.cancelled_caught
        assert ran == ["first", "second"]
        assert returned == ["second"]


async def test_a_call_runs_in_its_callers_context() -> None:
    with running() as thread:
        token = REQUEST.set("the caller's")
        try:
            assert await thread.run(REQUEST.get) == "the caller's"
        finally:
            REQUEST.reset(token)
        assert await thread.run(REQUEST.get) == "unset"


async def test_a_thread_started_again_serves_only_its_own_calls() -> None:
    ran_in: dict[str, int] = {}
    with running() as thread, Gate() as gate:

        def first() -> None:
            gate.hold()
            ran_in["first"] = threading.get_ident()

        old_calls = thread._calls
        assert old_calls is not None
        old_calls.put(first)
        old_calls.put(lambda: ran_in.update(queued=threading.get_ident()))
        await gate.held()
        old = thread.stop()
        thread.start()  # while the old thread still has a call queued
        new_ident = await thread.run(threading.get_ident)
        gate.release()
        assert old is not None
        old.join(5)
        assert ran_in["first"] == ran_in["queued"] != new_ident


async def test_a_sqlite_store_never_closed_is_collected_and_its_thread_ends(
    tmp_path: Path,
) -> None:
    path = tmp_path / "loops.db"
    store = SQLiteStore(path)
    await store.open()
    assert await store.load("nobody") is None
    (ours,) = [t for t in threading.enumerate() if t.name == f"agentfsm-sqlite {path}"]
    collected = threading.Event()
    weakref.finalize(store, collected.set)
    del store
    gc.collect()
    assert collected.is_set()
    ours.join(5)
    assert not ours.is_alive()


async def test_two_opens_at_once_one_cancelled_leave_the_store_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One `open` connects; another, cancelled meanwhile, fails: the thread
    the first is using runs on."""
    store = SQLiteStore(tmp_path / "loops.db")
    connect = store._connect
    with Gate() as gate:

        def slow_connect() -> sqlite3.Connection:
            gate.hold()
            return connect()

        monkeypatch.setattr(store, "_connect", slow_connect)
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.open)
            await gate.held()  # the first open's connect runs in the thread
            with anyio.CancelScope() as scope:
                scope.cancel()
                await store.open()
            assert scope.cancelled_caught
            gate.release()
    assert await store.load("nobody") is None
    await store.close()
    with pytest.raises(StoreError, match="is not open"):
        await store.load("nobody")


def test_the_calls_given_a_thread_still_run_as_the_interpreter_exits(
    tmp_path: Path,
) -> None:
    """A write whose caller went away (a task cancelled natively as
    `asyncio.run` ends, say) still lands: the thread is joined at exit."""
    written = tmp_path / "written"
    script = f"""
import threading, time
from agentfsm.store._thread import StoreThread
thread = StoreThread("store-exit")
thread.start()
started = threading.Event()
def slow_write():
    started.set()
    time.sleep(0.3)
    open({str(written)!r}, "w").write("landed")
thread._calls.put(slow_write)
started.wait(5)
"""  # the main thread ends here, the write in flight
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert written.read_text() == "landed"


def test_a_native_asyncio_cancellation_waits_for_the_call_then_comes() -> None:
    """`task.cancel()` (asyncio.timeout, asyncio.run's end) comes once: the
    caller waits for its call to end, then raises it (not swallowed)."""
    import asyncio  # noqa: TID251 - a native asyncio cancellation, on purpose

    ran: list[str] = []

    async def main() -> None:
        with running() as thread, Gate() as gate:

            def slow_write() -> None:
                gate.hold()
                ran.append("written")

            task = asyncio.ensure_future(thread.run(slow_write))
            await gate.held()
            task.cancel()
            await asyncio.sleep(0.05)
            assert not task.done()  # waiting for the call
            gate.release()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert ran == ["written"]

    anyio.run(main, backend="asyncio")


def test_on_asyncio_calls_end_through_the_loops_eventfd_closed_with_the_loop() -> None:
    """Linux: the thread wakes an asyncio loop through an eventfd the loop
    watches, one a loop, closed once the loop is garbage."""
    import asyncio  # noqa: TID251 - the asyncio loop's own waker, on purpose

    if not hasattr(os, "eventfd"):
        pytest.skip("no eventfd here: calls end through call_soon_threadsafe")
    fds: list[int] = []

    async def main() -> None:
        with running() as thread:
            for n in range(5):
                assert await thread.run(partial(int, n)) == n
            waker = _WAKERS[asyncio.get_running_loop()]
            assert waker is not None
            fds.append(waker.fd)
            os.fstat(waker.fd)  # open while the loop lives

    anyio.run(main, backend="asyncio")
    gc.collect()
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fds[0])


def test_a_loop_that_cannot_watch_an_fd_gets_its_calls_back_all_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio  # noqa: TID251 - an asyncio loop without add_reader, on purpose

    def refuse(*args: object) -> None:
        raise NotImplementedError

    async def main() -> None:
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "add_reader", refuse)
        with running() as thread:
            assert await thread.run(lambda: "back") == "back"
            assert _WAKERS[loop] is None  # through call_soon_threadsafe

    anyio.run(main, backend="asyncio")
