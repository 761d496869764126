"""The SQLite store's own thread (`agentfsm.store._thread.StoreThread`): calls run
there, in order, and come back to the caller's event loop (on asyncio through a
future of the loop's, on trio through anyio: both are tested here)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from agentfsm.store import SQLiteStore, StoreError, StoreSchemaError
from agentfsm.store._thread import StoreThread, _Call


async def test_calls_run_in_the_thread_in_order_and_return_or_raise() -> None:
    thread = StoreThread("store-test")
    thread.start()
    try:
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
    finally:
        thread.stop()


async def test_a_cancelled_caller_does_not_abandon_its_call() -> None:
    thread = StoreThread("store-test")
    thread.start()
    started, release = threading.Event(), threading.Event()
    done: list[str] = []

    def slow_write() -> str:
        started.set()
        release.wait(5)
        done.append("written")
        return "ok"

    seen_after: list[tuple[str, list[str]]] = []
    scope = anyio.CancelScope()

    async def cancel_once_started() -> None:
        assert await anyio.to_thread.run_sync(started.wait, 5)
        scope.cancel()
        await anyio.sleep(0.05)  # the caller is still waiting
        release.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_once_started)
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
    finally:
        release.set()
        thread.stop()


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
    thread = StoreThread("store-test")
    thread.start()
    gate = threading.Event()
    finished = threading.Event()

    def blocked() -> None:
        gate.wait(5)

    async def leave_it_running() -> None:
        # A call the event loop never waits for: its loop has ended by the time
        # it ends, and its notice has nowhere to go.
        call = _Call(blocked)
        thread._calls.put(call)
        thread._calls.put(finished.set)

    try:
        anyio.run(leave_it_running, backend=backend)
        gate.set()
        assert finished.wait(5)  # the thread went on to the next call
        assert thread.running
    finally:
        thread.stop()


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
    with pytest.raises(StoreSchemaError, match="newer agentfsm"):
        await store.open()
    name = f"agentfsm-sqlite {path}"
    for thread in [t for t in threading.enumerate() if t.name == name]:
        thread.join(5)
    assert not [t for t in threading.enumerate() if t.name == name]
