"""Durable loops at the edges of their runs: a paused loop whose lease another
runtime takes, a loop whose lease cannot be given up, a steering message for
a loop just taken up, a handler's decision before a model request, a commit
the store cannot encode, a runtime closed between a model's output and the
commit that carries it, and a loop that ends while another runtime recovers
it. tests/test_durable.py holds the common paths."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    LoopStatus,
    ModelContext,
    Outcome,
    PendingTransition,
    Proceed,
    Rewrite,
    Runtime,
    Trigger,
    tool,
)
from agentfsm.events import LoopDetached, LoopIdle
from agentfsm.exceptions import LeaseLostError, LoopDetachedError
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import Commit, LoopStore, MemoryStore, SQLiteStore, StoreError
from agentfsm.store._sql import LogRow
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from tests.helpers import wait_until

RAN: list[str] = []


@tool(needs_approval=True)
async def pay(amount: int) -> str:
    """Pay an amount."""
    RAN.append(f"pay {amount}")
    return "paid"


@tool
async def add(a: int, b: int) -> int:
    """Add two numbers."""
    RAN.append(f"add {a} {b}")
    return a + b


@pytest.fixture(autouse=True)
def _clean() -> None:
    RAN.clear()


def request(*tools: Any) -> InferenceInput:
    return InferenceInput(model="s:m", context=ModelContext(), tools=list(tools))


def runtime(store: LoopStore, *script: Any, **options: Any) -> Runtime:
    return Runtime(
        providers={"s": ScriptedProvider(list(script))},
        store=store,
        tools=[pay, add],
        **options,
    )


async def paused(rt: Runtime) -> str:
    """A loop that asks to pay 5, paused for approval in `rt`."""
    loop_id = rt.run_loop("agent", "pay 5", request(pay))
    await wait_until(lambda: rt.get(loop_id).status is LoopStatus.paused)
    return loop_id


async def stored_as_paused(stores: Callable[[], LoopStore], loop_id: str) -> None:
    """Wait until the store holds the loop paused: the commit that pauses it
    may land after the runtime shows it paused (a loaded machine delays it)."""
    with anyio.fail_after(10):
        while True:
            async with stores() as store:
                stored = await store.load(loop_id)
            if stored is not None and stored.record.status is LoopStatus.paused:
                return
            await anyio.sleep(0.01)


@pytest.fixture(params=["memory", "sqlite"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], LoopStore]:
    """A new store object on the same data each call."""
    if request.param == "memory":
        memory = MemoryStore(lease_ttl=0.6)
        return lambda: memory
    return lambda: SQLiteStore(tmp_path / "loops.db", lease_ttl=0.6)


async def test_a_paused_loop_whose_lease_is_taken_stops_here_at_once(
    stores: Callable[[], LoopStore],
) -> None:
    """A paused loop holds no task to notice that another runtime took it:
    the renewal that finds its lease gone stops it here (`wait` raises
    `LoopDetachedError`, `loop.detached` is published), and it writes
    nothing more."""
    async with runtime(stores(), calls(call("pay", amount=5))) as first:
        recorder = EventRecorder(first.bus)
        loop_id = await paused(first)
        owner = first._keeper.owner  # type: ignore[union-attr]
        await stored_as_paused(stores, loop_id)
        async with stores() as store:
            taken = await store.acquire(loop_id, "another", replacing=owner)
        with anyio.fail_after(10):
            with pytest.raises(LoopDetachedError) as caught:
                await first.wait(loop_id)
        assert isinstance(caught.value.cause, LeaseLostError)
        assert [e for e in recorder.of_loop(loop_id) if isinstance(e, LoopDetached)]
        with pytest.raises(LoopDetachedError):
            first.resume(loop_id, Proceed())
    async with stores() as store:
        stored = await store.load(loop_id)
        assert stored is not None
        assert stored.record.status is LoopStatus.paused
        assert (await store.renew("another", [loop_id])) == {loop_id: taken.epoch}
    assert RAN == []


class _ReleaseFailsOnce(MemoryStore):
    """A store whose commit into `function_call` fails, and whose first release
    of a loop fails too (the fault is still there)."""

    def __init__(self) -> None:
        super().__init__(lease_ttl=0.6)
        self.releases = 0

    async def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        errors: list[Exception | None] = []
        for commit in commits:
            if (
                commit.record is not None
                and commit.record.state.value == "function_call"
            ):
                errors.append(StoreError("memory: the disk is full"))
            else:
                errors.extend(await super().commit_many([commit]))
        return errors

    async def release(
        self,
        owner: str,
        loop_ids: Sequence[str] | None = None,
        *,
        epochs: Mapping[str, int] | None = None,
    ) -> None:
        self.releases += 1
        if self.releases == 1:
            raise StoreError("memory: the disk is full")
        await super().release(owner, loop_ids, epochs=epochs)


async def test_a_loop_whose_lease_could_not_be_given_up_is_not_renewed() -> None:
    """A loop stops here (its commit failed) and giving up its lease fails
    too: the lease is not renewed with the runtime's others, it is given up
    at a later renewal, and another runtime takes the loop up while this one
    still runs."""
    store = _ReleaseFailsOnce()
    async with runtime(store, calls(call("add", a=1, b=2))) as first:
        loop_id = first.run_loop("agent", "1+2", request(add))
        with anyio.fail_after(10), pytest.raises(LoopDetachedError):
            await first.wait(loop_id)
        await wait_until(lambda: store.releases >= 2)
        async with runtime(MemoryStoreView(store), text("3")) as second:
            report = await second.recover()
            assert report.running == [loop_id], report
            assert (await second.wait(loop_id)).outcome is Outcome.answered


class MemoryStoreView(MemoryStore):
    """Another runtime's view of a memory store's data (its own presence)."""

    def __init__(self, data: MemoryStore) -> None:
        super().__init__(lease_ttl=data.lease_ttl)
        self._loops = data._loops
        self._contexts = data._contexts


async def test_steering_a_loop_just_taken_up_keeps_its_path(
    stores: Callable[[], LoopStore],
) -> None:
    """A message queued for a paused loop taken up from its store is stored
    with its record, and the path the store holds stays whole."""
    async with runtime(stores(), calls(call("pay", amount=5))) as first:
        loop_id = await paused(first)
        path = first.get(loop_id).path
    async with runtime(stores()) as second:
        assert (await second.recover()).paused == [loop_id]
        second.steer(loop_id, "and hurry")
    async with stores() as store:
        stored = await store.load(loop_id)
        assert stored is not None
        assert stored.record.path == path
        assert [m.content for m in stored.record.steering] == ["and hurry"]
    async with runtime(stores(), text("done")) as third:
        assert (await third.recover()).paused == [loop_id]
        third.resume(loop_id, Proceed())
        result = await third.wait(loop_id)
    assert result.outcome is Outcome.answered
    assert result.path[: len(path)] == path
    assert RAN == ["pay 5"]


async def test_a_handlers_decision_lands_before_the_request_it_shaped(
    tmp_path: Path,
) -> None:
    """A handler rewrites the request on an edge into `inference`: the model
    is asked only once the decision is in the store."""
    store = SQLiteStore(tmp_path / "loops.db")
    seen: list[int] = []

    async def cheaper(pending: PendingTransition) -> Rewrite | None:
        if pending.trigger is Trigger.infer:
            assert isinstance(pending.payload, InferenceInput)
            return Rewrite(payload=pending.payload.model_copy(update={"model": "s:x"}))
        return None

    class Checking(ScriptedProvider):
        async def complete(self, request: InferenceInput) -> Any:
            seen.append(len(await store.decisions(loop_id)))
            return await super().complete(request)

    async with Runtime(providers={"s": Checking([text("hi")])}, store=store) as rt:
        loop_id = rt.run_loop("agent", "hi", request(), cheaper)
        assert (await rt.wait(loop_id)).outcome is Outcome.answered
    assert seen == [1]


class _CannotEncode(SQLiteStore):
    """A store that cannot encode a commit of the loop's (as a value of a
    kind its JSON has no form for)."""

    def log_row(self, commit: Commit) -> LogRow:
        if commit.record is not None and commit.record.state.value == "function_call":
            raise ValueError("a value of a kind JSON has no form for")
        return super().log_row(commit)


async def test_a_commit_the_store_cannot_encode_is_named(tmp_path: Path) -> None:
    path = tmp_path / "loops.db"
    async with runtime(_CannotEncode(path), calls(call("add", a=1, b=2))) as rt:
        loop_id = rt.run_loop("agent", "1+2", request(add))
        with anyio.fail_after(10), pytest.raises(LoopDetachedError) as caught:
            await rt.wait(loop_id)
    cause = caught.value.cause
    assert isinstance(cause, StoreError)
    assert f"{path}: a commit of loop {loop_id} cannot be written" in str(cause)
    assert "ValueError: a value of a kind JSON has no form for" in str(cause)
    assert RAN == []  # its intent never landed: the tool never ran


async def test_a_runtime_closed_before_a_models_output_was_written_keeps_it(
    tmp_path: Path,
) -> None:
    """The runtime closes while the loop waits on a subscriber with its model
    output not written yet (it goes with the next commit): the output is
    written as the runtime exits, and the loop taken up does not ask the model
    again."""
    path = tmp_path / "loops.db"
    first_model = ScriptedProvider([calls(call("add", a=1, b=2))])
    with anyio.CancelScope() as scope:
        async with Runtime(
            providers={"s": first_model}, store=SQLiteStore(path), tools=[add]
        ) as first:
            # A subscriber that reads up to the loop's edge into
            # `context_update`, then no more: with room for one event, the
            # loop waits as it publishes what `inference` produced, its
            # output held for the next commit.
            slow = first.bus.subscribe("*", buffer=1, backpressure=True)
            loop_id = first.run_loop("agent", "1+2", request(add))
            async for event in slow:
                if event.type == "loop.transition" and event.dest == "context_update":
                    break
            await wait_until(lambda: len(first_model.requests) == 1)
            await wait_until(lambda: first.get(loop_id).state.value == "inference")
            scope.cancel()
    second_model = ScriptedProvider([text("3")])
    async with Runtime(
        providers={"s": second_model}, store=SQLiteStore(path), tools=[add]
    ) as second:
        assert (await second.recover()).running == [loop_id]
        result = await second.wait(loop_id)
    assert result.outcome is Outcome.answered
    assert RAN == ["add 1 2"]  # the recorded output's call, not a new request's
    assert len(second_model.requests) == 1


async def test_a_loop_that_ends_as_it_is_recovered_is_left_alone(
    tmp_path: Path,
) -> None:
    """`unfinished` listed a loop its owner then ended: recovery takes
    nothing, reports nothing failed, and leaves its end as it was."""
    path = tmp_path / "loops.db"
    async with runtime(SQLiteStore(path), text("hi")) as first:
        loop_id = first.run_loop("agent", "hi", request())
        await first.wait(loop_id)

    class Stale(SQLiteStore):
        async def unfinished(self) -> list[str]:
            return [loop_id]  # as listed just before the loop ended

    async with runtime(Stale(path)) as second:
        report = await second.recover()
    assert (report.recovered, report.failed, report.locked) == ([], {}, {})
    async with SQLiteStore(path) as store:
        stored = await store.load(loop_id)
        assert stored is not None
        assert stored.record.outcome is Outcome.answered


async def test_a_loop_failed_at_recovery_publishes_its_end(tmp_path: Path) -> None:
    """A loop taken up by a runtime without its tool ends failed in the store,
    and its `loop.idle` is stored and published like any loop's end."""
    path = tmp_path / "loops.db"
    async with runtime(
        SQLiteStore(path, events=True), calls(call("pay", amount=5))
    ) as a:
        loop_id = await paused(a)
    async with Runtime(
        providers={"s": ScriptedProvider([])}, store=SQLiteStore(path, events=True)
    ) as b:
        recorder = EventRecorder(b.bus)
        report = await b.recover()
        assert list(report.failed) == [loop_id]
        (idle,) = [e for e in recorder.of_loop(loop_id) if isinstance(e, LoopIdle)]
    assert idle.outcome is Outcome.failed
    async with SQLiteStore(path, events=True) as store:
        events = await store.events(loop_id)
        assert events[-1] == idle
        assert [e.seq for e in events] == list(range(1, len(events) + 1))


class _PauseFailsOnce(MemoryStore):
    """A store whose first commit of a paused loop fails, whose releases fail
    while `refusing`, and which tells of its renewals (`renewed`)."""

    def __init__(self) -> None:
        super().__init__(lease_ttl=0.3)
        self.failed = self.releases = 0
        self.refusing = True
        self.renewed = anyio.Event()

    async def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        errors: list[Exception | None] = []
        for commit in commits:
            record = commit.record
            if record is not None and record.status is LoopStatus.paused:
                self.failed += 1
                if self.failed == 1:
                    errors.append(StoreError("memory: the disk is full"))
                    continue
            errors.extend(await super().commit_many([commit]))
        return errors

    async def release(
        self,
        owner: str,
        loop_ids: Sequence[str] | None = None,
        *,
        epochs: Mapping[str, int] | None = None,
    ) -> None:
        self.releases += 1
        if self.refusing:
            raise StoreError("memory: the disk is full")
        await super().release(owner, loop_ids, epochs=epochs)

    async def renew(
        self, owner: str, loop_ids: Sequence[str] | None = None
    ) -> dict[str, int]:
        renewed = await super().renew(owner, loop_ids)
        self.renewed.set()
        return renewed


async def test_a_lease_taken_again_is_not_freed_by_the_old_ones_retried_release() -> (
    None
):
    """A loop stops here (a write failed) and giving its lease up fails; the
    same runtime takes it up again (a new epoch): the renewals that retry the
    old lease's release leave the new one alone, so no other runtime takes
    the loop while this one holds it."""
    store = _PauseFailsOnce()

    def asks_to_pay(request: InferenceInput) -> InferenceOutput:
        return calls(call("pay", call_id="p", amount=5))

    def rt(data: MemoryStore) -> Runtime:
        providers = {"s": FunctionProvider(asks_to_pay)}
        return Runtime(providers=providers, store=data, tools=[pay])

    async with rt(store) as first:
        loop_id = first.run_loop("agent", "pay 5", request(pay))
        with anyio.fail_after(10), pytest.raises(LoopDetachedError):
            await first.wait(loop_id)
        old = store._loops[loop_id].epoch
        assert (await first.recover()).running == [loop_id]  # its own: at once
        await wait_until(lambda: first.get(loop_id).status is LoopStatus.paused)
        taken = store._loops[loop_id].epoch
        assert taken > old
        assert store.releases >= 1  # the old lease's, failed
        store.refusing = False  # a retry of it would now be carried out
        for _ in range(2):  # the retries (if any) come before each renewal
            store.renewed = anyio.Event()
            with anyio.fail_after(10):
                await store.renewed.wait()
        entry = store._loops[loop_id]
        assert (entry.owner, entry.epoch) == (first._keeper.owner, taken)  # type: ignore[union-attr]
        async with rt(MemoryStoreView(store)) as second:
            report = await second.recover()
            assert loop_id in report.locked, report
    assert RAN == []


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("UPDATE loops SET number = 99999 WHERE loop_id = ?", "holds no record of it"),
        ("UPDATE loops SET epoch = 'x' WHERE loop_id = ?", "ValueError: invalid"),
    ],
)
async def test_a_damaged_loop_row_is_reported_and_recovery_goes_on(
    tmp_path: Path, damage: str, said: str
) -> None:
    """A loop whose row in `loops` is damaged (its log out of reach, its
    epoch not a number) is reported in `Recovery.failed`, naming the store's
    file and the cause; the other loop is recovered."""
    path = tmp_path / "loops.db"
    async with runtime(SQLiteStore(path), calls(call("pay", amount=1))) as first:
        damaged = await paused(first)
    async with runtime(SQLiteStore(path), calls(call("pay", amount=2))) as first:
        healthy = await paused(first)
    with sqlite3.connect(path) as db:
        db.execute(damage, (damaged,))
    async with runtime(SQLiteStore(path)) as second:
        report = await second.recover()
    assert report.paused == [healthy]
    assert list(report.failed) == [damaged]
    assert str(path) in report.failed[damaged]
    assert said in report.failed[damaged]
