"""The runtime's writer of commits (`agentfsm._durable.flusher`): a commit into
`inference` is not waited for, whoever waits writes the queue in one trip, the
commits land in order, and a failed one stops its loop in this process before
any tool runs (it is detached: the store keeps it as of its last good commit,
and nothing the loop is told disagrees with it)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from agentfsm import (
    Decision,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    LoopResult,
    LoopState,
    LoopStatus,
    ModelContext,
    Outcome,
    Pause,
    PendingTransition,
    Proceed,
    Runtime,
    Trigger,
    current_call,
    tool,
)
from agentfsm.exceptions import ConfigurationError, LoopDetachedError
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import (
    Commit,
    Lease,
    LoopIdTakenError,
    LoopStore,
    MemoryStore,
    SQLiteStore,
)
from agentfsm.store._sql import fold_ledger
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from agentfsm.tools import Tool
from tests.helpers import pause_tools, wait_until

pytestmark = pytest.mark.anyio

STORE: dict[str, MemoryStore] = {}
SEEN: list[tuple[str, str | None]] = []
"""What `add` found in the ledger when it ran: (its key, the entry's status)."""


@tool
async def add(a: int, b: int) -> int:
    """Add two integers; note what the ledger holds for this call as it runs."""
    key = current_call().idempotency_key
    entries = await STORE["store"].calls(current_call().loop_id, 1)
    SEEN.append((key, next((e.status for e in entries if e.key == key), None)))
    return a + b


@pytest.fixture(autouse=True)
def _clean() -> None:
    SEEN.clear()
    STORE.clear()


def state_of(commit: Commit) -> LoopState | None:
    """The state a commit's record is in (None: a commit without one)."""
    return None if commit.record is None else commit.record.state


class GatedStore(MemoryStore):
    """A store whose writes wait for `gate` (when set), and that notes the
    states of the commits of each trip (`trips`)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: anyio.Event | None = None
        self.trips: list[list[LoopState | None]] = []
        self.commits: list[Commit] = []
        self.landed: list[LoopState | None] = []

    async def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        self.trips.append([state_of(c) for c in commits])
        self.commits.extend(commits)
        if self.gate is not None:
            await self.gate.wait()
        errors = await super().commit_many(commits)
        self.landed.extend(
            state_of(c) for c, e in zip(commits, errors, strict=True) if e is None
        )
        return errors


class FailingStore(MemoryStore):
    """A store that cannot take the commits into `fail_in` (those made after
    `after_requests` model requests only, if given), and says so after `delay`."""

    def __init__(
        self, fail_in: LoopState, *, after_requests: int | None = None, delay: float = 0
    ) -> None:
        super().__init__()
        self.fail_in = fail_in
        self.after_requests = after_requests
        self.delay = delay

    async def _write(self, commit: Commit) -> None:
        record = commit.record
        if (
            record is not None
            and record.state is self.fail_in
            and self.after_requests in (None, record.model_requests)
        ):
            if self.delay:
                await anyio.sleep(self.delay)
            raise OSError(f"disk full at seq {record.seq}")
        await super()._write(commit)


async def run_to_end(
    store: LoopStore,
    model: Callable[[InferenceInput], Awaitable[InferenceOutput]],
    prompt: str,
    *,
    follow_ups: int = 0,
    **options: Any,
) -> LoopResult:
    """One loop of `model` (with `add`) on `store`, to its end (5 s at most);
    `follow_ups` messages ("and then?") queued as it starts."""
    async with Runtime(
        providers={"scripted": FunctionProvider(model)}, store=store
    ) as runtime:
        loop_id = runtime.run_loop("agent", prompt, request(), **options)
        for _ in range(follow_ups):
            runtime.follow_up(loop_id, "and then?")
        with anyio.fail_after(5):
            return await runtime.wait(loop_id)


async def detached(
    store: LoopStore,
    model: Callable[[InferenceInput], Awaitable[InferenceOutput]],
    prompt: str,
    **options: Any,
) -> LoopDetachedError:
    """What `wait` raises for a loop of `model` on `store` that stops in its
    runtime (`run_to_end`'s, which must raise)."""
    with pytest.raises(LoopDetachedError) as raised:
        await run_to_end(store, model, prompt, **options)
    return raised.value


def request() -> InferenceInput:
    return request_of(add)


def request_of(*tools: Tool) -> InferenceInput:
    return InferenceInput(model="scripted:m", context=ModelContext(), tools=list(tools))


@tool(on_crash="retry")
async def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


async def test_the_request_goes_out_before_its_commit_lands() -> None:
    """The model is asked while the commit into `inference` is still queued;
    the tool runs only once the commit into `function_call`, with its intent,
    has landed; the two went to the store in one trip."""
    store = STORE["store"] = GatedStore()
    store.gate = anyio.Event()
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(providers={"scripted": provider}, store=store) as runtime:
        loop_id = runtime.run_loop("agent", "add 1 and 2", request())
        await wait_until(lambda: len(provider.requests) == 1)
        assert await store.load(loop_id) is None  # nothing has landed yet
        assert SEEN == []  # and the tool waits for its intent
        store.gate.set()
        with anyio.fail_after(5):
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.answered
    assert [status for _, status in SEEN] == ["started"]
    assert store.trips[0] == [LoopState.inference, LoopState.function_call]
    stored = await store.load(loop_id)
    assert stored is not None
    assert stored.record.status is LoopStatus.done


async def test_a_commit_nobody_waits_for_is_written_by_the_runtime() -> None:
    """A request that takes its time: the commit into `inference` lands while
    it is in flight, though the loop never waits for it."""
    store = STORE["store"] = GatedStore()
    answer = anyio.Event()

    async def slow(request: InferenceInput) -> InferenceOutput:
        await answer.wait()
        return text("done")

    async with Runtime(
        providers={"scripted": FunctionProvider(slow)}, store=store
    ) as runtime:
        loop_id = runtime.run_loop("agent", "hi", request())

        await wait_until(lambda: LoopState.inference in store.landed)
        answer.set()
        with anyio.fail_after(5):
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.answered


async def test_a_failed_commit_stops_the_loop_before_any_tool_runs() -> None:
    """The commit into `inference` fails (the loop did not wait for it): the
    loop stops at its next write, before the tool it asked for runs; it is
    detached (`wait` raises, naming the store's error, and no `loop.idle` is
    published), and writes nothing after the failure."""
    store = STORE["store"] = FailingStore(LoopState.inference)
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(providers={"scripted": provider}, store=store) as runtime:
        recorder = EventRecorder(runtime.bus)
        loop_id = runtime.run_loop("agent", "add 1 and 2", request())
        with anyio.fail_after(5), pytest.raises(LoopDetachedError) as raised:
            await runtime.wait(loop_id)
        with pytest.raises(LoopDetachedError):
            runtime.get(loop_id)
    assert "disk full at seq 3" in str(raised.value)  # the commit into `inference`
    assert raised.value.loop_id == loop_id
    assert SEEN == []  # the tool never ran
    assert len(provider.requests) == 1
    types = [e.type for e in recorder.of_loop(loop_id)]
    assert types[-1] == "loop.detached"
    assert "loop.idle" not in types
    assert await store.load(loop_id) is None  # nothing landed after it


async def test_commits_land_in_order_and_none_after_a_failed_one_of_its_loop(
    tmp_path: Path,
) -> None:
    """`commit_many` (SQLite: one trip): a loop whose commit fails writes none
    of its later ones; another loop's commits in the same trip land."""
    store = STORE["store"] = GatedStore()
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("a"), text("b")])},
        store=store,
    ) as runtime:
        first = runtime.run_loop("agent", "one", request())
        second = runtime.run_loop("agent", "two", request())
        with anyio.fail_after(5):
            await runtime.wait(first)
            await runtime.wait(second)
    # Every commit the two loops made, replayed into a SQLite store in one trip,
    # after another runtime made a loop of the first one's id.
    commits = [
        commit
        for loop_id in (first, second)
        for commit in store.commits
        if commit.loop_id == loop_id
    ]
    sqlite = SQLiteStore(tmp_path / "loops.db")
    async with sqlite:
        await sqlite.commit(dataclasses.replace(commits[0], lease=Lease("else", 1)))
        errors = await sqlite.commit_many(commits)
        ours = [e for c, e in zip(commits, errors, strict=True) if c.loop_id == first]
        theirs = [
            e for c, e in zip(commits, errors, strict=True) if c.loop_id == second
        ]
        assert all(isinstance(e, LoopIdTakenError) for e in ours)
        assert len({id(e) for e in ours}) == 1  # the first one's, for the rest
        assert theirs == [None] * len(theirs)
        kept = await sqlite.load(first)
        assert kept is not None
        assert commits[0].record is not None
        assert kept.record.seq == commits[0].record.seq
        done = await sqlite.load(second)
        assert done is not None
        assert done.record.status is LoopStatus.done


async def test_a_failed_commit_nobody_waited_for_stops_the_next_turn() -> None:
    """A loop of answers and follow-ups waits for no write until its end: a
    failed commit into `inference` fails it at its next commit, before it
    sends another request."""
    store = STORE["store"] = FailingStore(LoopState.inference)
    sent: list[InferenceInput] = []

    async def model(request: InferenceInput) -> InferenceOutput:
        sent.append(request)
        await anyio.sleep(0.001)  # a request in flight: the event loop runs on
        return text(f"answer {len(sent)}")

    error = await detached(store, model, "hi", follow_ups=2)
    assert "disk full at seq 3" in str(error)
    assert len(sent) == 1


class SlowFailingStore(SQLiteStore):
    """A SQLite store whose first commit into `inference` takes a while, then
    fails (a disk that stalls, then errs)."""

    failed = False

    def _commit_one(self, commit: Commit) -> None:
        if state_of(commit) is LoopState.inference and not self.failed:
            self.failed = True
            time.sleep(0.05)
            raise OSError("disk error")
        super()._commit_one(commit)


async def test_no_commit_after_a_failed_one_even_in_a_later_trip(
    tmp_path: Path,
) -> None:
    """The loop's next commit is queued while the failing one is written: it
    is not written by the trip after (it would leave a gap: the context's
    first items went with the failed one), and the tool never runs."""
    store = SlowFailingStore(tmp_path / "loops.db")
    STORE["store"] = MemoryStore()  # `add` must not run: it would look here

    async def model(request: InferenceInput) -> InferenceOutput:
        await anyio.sleep(0.001)
        return calls(call("add", a=1, b=2))

    error = await detached(store, model, "add 1 and 2")
    assert "disk error" in str(error)
    assert SEEN == []
    async with SQLiteStore(tmp_path / "loops.db") as again:
        assert await again.load(error.loop_id) is None
        assert await again.calls(error.loop_id, 1) == []


async def test_a_pause_after_a_failed_commit_detaches_the_loop() -> None:
    """A pause the store cannot take (an earlier write failed) would be lost
    with the process: the loop is detached, not shown paused."""
    store = STORE["store"] = FailingStore(LoopState.inference)

    async def hold(pending: PendingTransition) -> Decision | None:
        await anyio.sleep(0.001)  # the failed write is found meanwhile
        return (
            Pause(reason="a person decides")
            if pending.trigger is Trigger.call_tools
            else None
        )

    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(providers={"scripted": provider}, store=store) as runtime:
        loop_id = runtime.run_loop("agent", "add 1 and 2", request(), hold)
        with anyio.fail_after(5), pytest.raises(LoopDetachedError):
            await runtime.wait(loop_id)
    assert SEEN == []


@pytest.mark.parametrize("awaits", [False, True], ids=["never awaits", "awaits"])
async def test_the_outputs_a_commit_carries_land_while_the_model_is_asked(
    tmp_path: Path, awaits: bool
) -> None:
    """The commit into `inference` after a tool call carries its output: the
    request does not wait for it (a provider that never awaits finds the call
    started), and it lands while the request is in flight (one that awaits
    sees it land, and answers only then), before the loop goes on."""
    path = tmp_path / "loops.db"
    seen: list[list[tuple[str, str]]] = []

    def ledger() -> list[tuple[str, str]]:
        with sqlite3.connect(path) as db:
            rows = db.execute(
                "SELECT ledger FROM log WHERE ledger NOT NULL ORDER BY id"
            )
            entries = fold_ledger("(one loop)", [json.loads(text) for (text,) in rows])
        return [(c.tool, c.status) for c in entries.calls.values()]

    async def model(request: InferenceInput) -> InferenceOutput:
        if not any(
            isinstance(i, FunctionCallOutputItem) for i in request.context.items
        ):
            return calls(call("lookup", key="k"))
        if awaits:  # until the output is in the store (a trip, however long)
            for _ in range(1000):  # (5 s at most: the file is polled)
                if ledger() == [("lookup", "done")]:
                    break
                await anyio.sleep(0.005)
        seen.append(ledger())
        return text("done")

    async with Runtime(
        providers={"scripted": FunctionProvider(model)}, store=SQLiteStore(path)
    ) as runtime:
        loop_id = runtime.run_loop("agent", "look k up", request_of(lookup))
        with anyio.fail_after(5):
            result = await runtime.wait(loop_id)
        assert ledger() == [("lookup", "done")]
    assert result.outcome is Outcome.answered
    assert seen == [[("lookup", "done" if awaits else "started")]]


async def test_a_loop_that_waits_for_no_write_holds_no_landed_ones() -> None:
    """A loop of answers and follow-ups waits for no write until its end: the
    commits that landed are not kept (nor scanned at every commit)."""
    store = STORE["store"] = GatedStore()
    held: list[int] = []

    async def model(request: InferenceInput) -> InferenceOutput:
        await anyio.sleep(0.001)
        held.append(len(runtime._loops[loop_id].journal.tickets))  # type: ignore[union-attr]
        return text("again")

    async with Runtime(
        providers={"scripted": FunctionProvider(model)}, store=store
    ) as runtime:
        loop_id = runtime.run_loop(
            "agent", "hi", request(), follow_up_mode="one-at-a-time"
        )
        for _ in range(20):
            runtime.follow_up(loop_id, "and then?")
        with anyio.fail_after(5):
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.answered
    assert len(held) == 21
    assert max(held) <= 2


async def test_a_loop_whose_write_failed_does_not_end_as_it_chose() -> None:
    """The commit into `inference` fails, and the model answers after an
    await (the commit is written meanwhile): the loop's writes land before it
    ends, so it is detached, not answered with nothing of it stored."""
    store = STORE["store"] = FailingStore(LoopState.inference)

    async def model(request: InferenceInput) -> InferenceOutput:
        await anyio.sleep(0.01)
        return text("hi")

    error = await detached(store, model, "hello")
    assert "disk full" in str(error)


async def test_a_commit_still_queued_as_the_loop_ends_goes_with_its_end(
    log_output: list[dict[str, object]],
) -> None:
    """The model answers a follow-up at once: the commit into `inference` has
    not been sent as the loop ends, and goes to the store with its end's, in
    one trip. When it fails, the end is not written either: the loop is
    detached (no outcome is told that the store does not hold), both
    failures are logged, and the store keeps the loop's last commit."""
    store = STORE["store"] = FailingStore(LoopState.inference, after_requests=1)
    trips = counted_trips(store)
    asked = 0

    async def model(request: InferenceInput) -> InferenceOutput:
        nonlocal asked
        asked += 1
        if asked == 1:
            await anyio.sleep(0.01)  # its commit is written meanwhile
        return text(f"answer {asked}")

    error = await detached(store, model, "hello", follow_ups=1)
    assert trips == [["inference"], ["inference", "idle"]]
    assert "disk full at seq" in str(error)
    failures = [e for e in log_output if e["event"] == "store_write_failed"]
    assert len(failures) == 2
    assert all("disk full at seq" in str(f["error"]) for f in failures)
    stored = await store.load(error.loop_id)
    assert stored is not None
    assert (stored.record.state, stored.record.model_requests) == (
        LoopState.inference,
        0,
    )


async def test_a_loop_ends_once_the_write_in_flight_lands() -> None:
    """The commit into the second request's `inference` is being written (the
    model awaited), a later one is queued, and the model answers at once as
    the loop ends: the end waits for the write in flight, which fails, and
    the loop fails (the queued one would have gone with the end)."""
    store = STORE["store"] = FailingStore(
        LoopState.inference, after_requests=1, delay=0.05
    )
    asked = 0

    async def model(request: InferenceInput) -> InferenceOutput:
        nonlocal asked
        asked += 1
        if asked < 3:
            await anyio.sleep(0.01)
        return text(f"answer {asked}")

    error = await detached(
        store, model, "hi", follow_ups=2, follow_up_mode="one-at-a-time"
    )
    assert asked == 3
    assert "disk full" in str(error)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_loop_that_yields_between_two_commits_writes_them_in_one_trip() -> None:
    """The model yields one event-loop turn before it answers (as the driver's
    fairness checkpoint does, every ~10 ms): the commit into `inference`,
    queued, still goes with the next one the loop waits for. (asyncio runs a
    turn's tasks in the order they became ready; trio, in a random one: there
    the commits share a trip some of the time.)"""
    store = STORE["store"] = MemoryStore()
    trips = counted_trips(store)

    async def model(request: InferenceInput) -> InferenceOutput:
        await anyio.lowlevel.checkpoint()
        if any(isinstance(i, FunctionCallOutputItem) for i in request.context.items):
            return text("3")
        return calls(call("add", a=1, b=2))

    result = await run_to_end(store, model, "add")
    assert result.outcome is Outcome.answered
    assert trips == [["inference", "function_call"], ["inference", "idle"]]


def counted_trips(store: MemoryStore) -> list[list[str]]:
    """The states of the commits of each of the store's trips, as they come."""
    trips: list[list[str]] = []
    commit_many = store.commit_many

    async def counted(commits: Sequence[Commit]) -> list[Exception | None]:
        trips.append([c.record.state.value if c.record else "ledger" for c in commits])
        return await commit_many(commits)

    store.commit_many = counted  # type: ignore[method-assign]
    return trips


class PauseStore(MemoryStore):
    """A store whose pause commits take a while (and fail, with `fail`), and
    whose commits of a record with steering fail."""

    def __init__(self, *, fail: bool) -> None:
        super().__init__()
        self.fail = fail
        self.steered = False

    async def _write(self, commit: Commit) -> None:
        record = commit.record
        if record is not None and record.steering and not self.steered:
            self.steered = True
            raise OSError("the steering's commit failed")
        if record is not None and record.status is LoopStatus.paused:
            await anyio.sleep(0.05)
            if self.fail:
                raise OSError("disk full")
        await super()._write(commit)


async def test_a_failed_commit_of_a_queued_message_does_not_fail_the_pause(
    log_output: list[dict[str, object]],
) -> None:
    """The pause lands; the commit of a message queued meanwhile (the record
    alone) fails: the loop stays paused (logged), and its resume goes on."""
    store = STORE["store"] = PauseStore(fail=False)
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(providers={"scripted": provider}, store=store) as runtime:
        loop_id = runtime.run_loop("agent", "add", request(), pause_tools)
        await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
        runtime.steer(loop_id, "in euros")  # queued while the pause is saved
        await anyio.sleep(0.2)  # the pause lands, the steering's commit fails
        assert store.steered
        assert runtime.get(loop_id).status is LoopStatus.paused
        runtime.resume(loop_id, Proceed())
        with anyio.fail_after(5):
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.answered
    failures = [e for e in log_output if e["event"] == "store_write_failed"]
    assert len(failures) == 1
    assert "the steering's commit failed" in str(failures[0]["error"])


async def test_a_loop_resumed_as_its_pause_fails_to_be_stored_stops_once(
    log_output: list[dict[str, object]],
) -> None:
    """Resumed while its pause is being saved, and the save fails: the loop is
    detached (its pause would be lost), once, and is not run again."""
    store = STORE["store"] = PauseStore(fail=True)
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(providers={"scripted": provider}, store=store) as runtime:
        recorder = EventRecorder(runtime.bus, ["loop.idle", "loop.detached"])
        loop_id = runtime.run_loop("agent", "add", request(), pause_tools)
        with anyio.fail_after(5):
            while runtime.get(loop_id).status is not LoopStatus.paused:  # noqa: ASYNC110 - a status, not an event
                await anyio.sleep(0.001)
        runtime.resume(loop_id, Proceed())  # accepted: the save is still going
        with anyio.fail_after(5), pytest.raises(LoopDetachedError, match="disk full"):
            await runtime.wait(loop_id)
        await anyio.sleep(0.1)
    assert [e.type for e in recorder.events] == ["loop.detached"]
    assert len(provider.requests) == 1
    assert SEEN == []
    # Not run again: no second stop, no end.
    detaches = [e for e in log_output if e["event"] == "loop_detached"]
    assert len(detaches) == 1
    assert [e for e in log_output if e["event"] == "loop_idle"] == []


async def test_a_failed_record_only_commit_does_not_stop_the_next_in_its_trip(
    tmp_path: Path,
) -> None:
    """In one trip as across trips: a commit of the record alone (a message
    queued for a paused loop) that fails does not keep the loop's next commit
    from being written; one that builds on nothing is not a gap."""
    store = STORE["store"] = GatedStore()
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("a")])}, store=store
    ) as runtime:
        loop_id = runtime.run_loop("agent", "one", request())
        with anyio.fail_after(5):
            await runtime.wait(loop_id)
    first, *rest = store.commits
    record_only = Commit(
        first.loop_id, first.lease, first.record, first.path_length, first=first.first
    )
    assert not record_only.builds_on
    assert first.builds_on

    class Flaky(SQLiteStore):
        def _commit_one(self, commit: Commit) -> None:
            if not commit.builds_on:
                raise OSError("transient")
            super()._commit_one(commit)

    async with Flaky(tmp_path / "loops.db") as sqlite:
        errors = await sqlite.commit_many([record_only, first, *rest])
        assert isinstance(errors[0], OSError)
        assert errors[1:] == [None] * (len(errors) - 1)
        stored = await sqlite.load(loop_id)
        assert stored is not None
        assert stored.record.status is LoopStatus.done


@pytest.mark.parametrize("lease_ttl", [0, -1.0, True, "30", float("nan"), float("inf")])
def test_every_store_refuses_a_lease_ttl_that_is_not_positive(
    tmp_path: Path, lease_ttl: object
) -> None:
    for make in (
        lambda: MemoryStore(lease_ttl=lease_ttl),  # type: ignore[arg-type]
        lambda: SQLiteStore(tmp_path / "x.db", lease_ttl=lease_ttl),  # type: ignore[arg-type]
    ):
        with pytest.raises(ConfigurationError, match="lease_ttl must be a positive"):
            make()
