"""Durable loops (`Runtime(store=...)`): what a store holds, pauses that outlive
their runtime, recovery after a runtime dies mid-loop, leases.

A runtime "dies" here the way a deployment stops one: the task running it is
cancelled while a loop is inside a call. The loop is then neither ended nor
recorded as ended in the store (only a `Runtime.cancel` ends a durable loop),
so a second runtime on the same store takes it up. The subprocess crash
matrix (SIGKILL at every commit) is in tests/test_durable_crash.py.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentfsm import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    LoopResult,
    LoopState,
    LoopStatus,
    ModelContext,
    Outcome,
    PendingTransition,
    Proceed,
    Rewrite,
    Runtime,
    ToolBatch,
    Trigger,
    UserMessage,
    current_call,
    tool,
)
from agentfsm._keys import idempotency_key
from agentfsm.events import LoopRecovered
from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import InferenceOutput
from agentfsm.providers.function import FunctionProvider
from agentfsm.record import LoopRecord
from agentfsm.store import (
    CallRecord,
    Commit,
    EventArchive,
    Lease,
    LeaseLostError,
    LoopLockedError,
    LoopStore,
    MemoryStore,
    SharedContexts,
    SQLiteStore,
    StoreError,
    StoreSchemaError,
)
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from agentfsm.tools import Tool
from tests.helpers import items_of, wait_until
from tests.store_helpers import commit_of, spied

RAN: list[str] = []
"""What the tools below did (each appends once per run of its body)."""

GATE: dict[str, anyio.Event] = {}
"""`block` waits on GATE["block"] when it is set."""


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    RAN.append(f"add {a} {b}")
    return a + b


@tool(needs_approval=True)
async def pay(amount: int) -> str:
    """Pay an amount."""
    RAN.append(f"pay {amount}")
    return f"paid {amount}"


@tool
async def charge(amount: int) -> str:
    """Charge a card (not idempotent: `on_crash` is the default, pause)."""
    RAN.append(f"charge {amount}")
    gate = GATE.get("block")
    if gate is not None:
        await gate.wait()
    return f"charged {amount}"


KEYS: list[str] = []
"""The idempotency key each run of `lookup` saw."""


@tool(on_crash="retry")
async def lookup(key: str) -> str:
    """Look a key up (idempotent: runs again after a crash)."""
    RAN.append(f"lookup {key}")
    KEYS.append(current_call().idempotency_key)
    gate = GATE.get("block")
    if gate is not None:
        await gate.wait()
    return f"value of {key}"


TOOLS = [add, pay, charge, lookup]


@pytest.fixture(autouse=True)
def _clean() -> None:
    RAN.clear()
    KEYS.clear()
    GATE.clear()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store_factory(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[], LoopStore]:
    """A new store object on the same data each call (one MemoryStore is the data;
    a PostgreSQL schema of its own per test, on the session's server)."""
    if request.param == "memory":
        memory = MemoryStore()
        return lambda: memory
    if request.param == "postgres":
        from agentfsm.store.postgres import PostgresStore

        server = request.getfixturevalue("postgres_server")
        schema = f"t_{uuid.uuid4().hex}"
        return lambda: PostgresStore(server.conninfo(), schema=schema)
    return lambda: SQLiteStore(tmp_path / "loops.db")


@pytest.fixture(params=["sqlite", "postgres"])
def event_stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[], LoopStore]:
    """A new store object that keeps events, on the same data each call."""
    if request.param == "postgres":
        from agentfsm.store.postgres import PostgresStore

        server = request.getfixturevalue("postgres_server")
        schema = f"t_{uuid.uuid4().hex}"
        return lambda: PostgresStore(server.conninfo(), schema=schema, events=True)
    return lambda: SQLiteStore(tmp_path / "loops.db", events=True)


def counter_ids() -> Callable[[], str]:
    """Loop ids `loop-1`, `loop-2`, ...: an id source that starts again with
    each runtime (as a counter does at a restart)."""
    ids = iter(range(1, 100))
    return lambda: f"loop-{next(ids)}"


def request_with(*tools: Any) -> InferenceInput:
    return InferenceInput(model="scripted:m", context=ModelContext(), tools=list(tools))


class Hold:
    """A handler that holds the loop at `call_tools` until GATE["hold"] is set
    (with `holds=False`, it decides at once: the same handler, by name, in the
    runtime that takes the loop up). It counts what it was asked."""

    def __init__(self, *, holds: bool = True) -> None:
        self.holds = holds
        self.asked: list[Trigger] = []

    async def __call__(self, pending: PendingTransition) -> None:
        self.asked.append(pending.trigger)
        if self.holds and pending.trigger is Trigger.call_tools:
            await GATE["hold"].wait()


async def die_when(
    store: LoopStore,
    script: list[Any],
    start: Callable[[Runtime], str],
    until: Callable[[Runtime, str], bool],
) -> str:
    """Run a loop on `store` and kill its runtime once `until` holds (the task
    running the runtime is cancelled, as a deployment stopping would)."""
    loop_id = ""
    with anyio.CancelScope() as scope:
        async with Runtime(
            providers={"scripted": ScriptedProvider(script)}, store=store
        ) as runtime:
            loop_id = start(runtime)
            await wait_until(lambda: until(runtime, loop_id))
            scope.cancel()
            await anyio.sleep_forever()
    return loop_id


async def a_run_s_records(store_factory: Callable[[], LoopStore]) -> list[LoopRecord]:
    """The records a short loop committed (`add`, then an answer), in order."""
    committed: dict[int, LoopRecord] = {}
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(
        providers={"scripted": provider}, store=spied(store_factory(), committed)
    ) as runtime:
        await runtime.wait(runtime.run_loop("agent", "1+2?", request_with(add)))
    return [committed[seq] for seq in sorted(committed)]


async def paused_for_approval(store: LoopStore) -> str:
    """A loop that pays 5, paused for approval by a runtime that then exits."""
    async with Runtime(
        providers={"scripted": ScriptedProvider([calls(call("pay", amount=5))])},
        store=store,
    ) as first:
        loop_id = first.run_loop("agent", "pay 5", request_with(pay))
        await wait_until(lambda: first.get(loop_id).status is LoopStatus.paused)
    return loop_id


async def died_charging(store: LoopStore) -> str:
    """A loop whose runtime was killed while `charge` (call c1, not
    idempotent) ran: in flight in the store."""
    GATE["block"] = anyio.Event()
    loop_id = await die_when(
        store,
        [calls(call("charge", call_id="c1", amount=5))],
        lambda rt: rt.run_loop("agent", "charge 5", request_with(charge)),
        running("charge"),
    )
    del GATE["block"]
    return loop_id


async def resumed_elsewhere(
    store: LoopStore,
    loop_id: str,
    provider: ScriptedProvider | None = None,
    tools: list[Tool] = TOOLS,
) -> LoopResult:
    """A new runtime on `store` recovers the loop (paused), resumes it with
    Proceed, and returns how it ended (the model answers "done")."""
    async with Runtime(
        providers={"scripted": provider or ScriptedProvider([text("done")])},
        store=store,
        tools=tools,
    ) as runtime:
        assert (await runtime.recover()).paused == [loop_id]
        runtime.resume(loop_id, Proceed())
        return await finished(runtime, loop_id)


async def finished(runtime: Runtime, loop_id: str) -> LoopResult:
    """`wait`, bounded: a loop left paused by mistake fails the test instead of
    hanging it (pytest-timeout cannot interrupt a trio run that waits)."""
    with anyio.fail_after(20):
        return await runtime.wait(loop_id)


def running(name: str) -> Callable[[Runtime, str], bool]:
    """Until a tool call `name ...` has started."""
    return lambda runtime, loop_id: any(r.startswith(name) for r in RAN)


class TestWhatIsStored:
    async def test_the_ledger_holds_each_key_s_last_entry(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """Ledger entries go with commits, with a record or without one; what
        the ledger holds for a key is its last entry; `calls` gives one
        request's (or all the loop's) by position, none of an unknown loop."""
        last = (await a_run_s_records(store_factory))[-1]
        record = last.model_copy(
            update={"loop_id": "ledgered", "status": LoopStatus.running}
        )
        lease = Lease("A", 1)
        out = FunctionCallOutputItem(call_id="x0", output="v")

        def entry(position: int, request: int = 1, **changes: Any) -> CallRecord:
            return CallRecord(
                # (Any text in a key, quotes and all.)
                key=f'{request}-{position} clé "{position}"',
                loop_id="ledgered",
                request=request,
                position=position,
                tool="lookup",
                call_id=f"x{position}",
                status="started",
            ).model_copy(update=changes)

        async with store_factory() as store:
            await store.commit(
                commit_of(record, lease, new=True, ledger=[entry(0), entry(1)])
            )
            done = entry(0, status="done", output=out, terminate=True, by="alice")
            await store.commit(Commit("ledgered", lease, ledger=[done, entry(2)]))
            await store.commit(
                Commit(
                    "ledgered",
                    lease,
                    ledger=[entry(2, status="uncertain"), entry(0, request=2)],
                )
            )
            await store.commit(Commit("ledgered", lease, ledger=[entry(2, attempt=2)]))
            first = await store.calls("ledgered", 1)
            second = await store.calls("ledgered", 2)
            every = await store.calls("ledgered")
            none = await store.calls("nobody", 1)
        assert first == [done, entry(1), entry(2, attempt=2)]
        assert second == [entry(0, request=2)]
        assert every == [*first, *second]
        assert none == []

    async def test_loops_written_at_once_keep_each_its_own_rows(
        self, store_factory: Callable[[], LoopStore], tmp_path: Path
    ) -> None:
        """Six loops whose commits interleave (the model awaits): each one's
        record, context, ledger and earlier records read back as its own (the
        SQLite store finds a loop's rows by their ids: each loop's are from its
        number on, in the order written)."""
        store = store_factory()

        async def model(request: InferenceInput) -> InferenceOutput:
            await anyio.sleep(0.001)
            items = request.context.items
            if not any(isinstance(i, FunctionCallOutputItem) for i in items):
                n = int(str(getattr(items[0], "content", "")).split()[1])
                return calls(call("add", call_id=f"c{n}", a=n, b=n))
            return text(f"sum {items[-1].output}")  # type: ignore[union-attr]

        async with Runtime(
            providers={"scripted": FunctionProvider(model)}, store=store
        ) as runtime:
            loop_ids = [
                runtime.run_loop("agent", f"double {n}", request_with(add))
                for n in range(6)
            ]
            with anyio.fail_after(10):
                results = [await runtime.wait(loop_id) for loop_id in loop_ids]
            assert [r.answer.content for r in results] == [  # type: ignore[union-attr]
                f"sum {2 * n}" for n in range(6)
            ]
            for n, loop_id in enumerate(loop_ids):
                stored = await store.load(loop_id)
                assert stored is not None
                assert stored.record.loop_id == loop_id
                assert stored.record.outcome is Outcome.answered
                assert items_of(ModelContext(items=stored.items)) == [
                    f"user:double {n}",
                    f"call:c{n}",
                    f"out:c{n}={2 * n}",
                    f"model:sum {2 * n}",
                ]
                (entry,) = await store.calls(loop_id, 1)
                assert (entry.call_id, entry.status) == (f"c{n}", "done")
                assert entry.output is not None
                assert entry.output.output == str(2 * n)
                first = await store.record_at(loop_id, 2)
                assert first is not None
                assert (first.loop_id, first.state) == (
                    loop_id,
                    LoopState.context_update,
                )
        if isinstance(store, SQLiteStore):
            import sqlite3

            with sqlite3.connect(store.path) as db:
                numbers = dict(
                    db.execute("SELECT loop_id, number FROM loops").fetchall()
                )
                rows = db.execute("SELECT id, loop_id FROM log").fetchall()
            assert sorted(numbers.values()) == list(range(1, 7))
            assert all(numbers[loop_id] == row_id >> 32 for row_id, loop_id in rows)

    async def test_the_record_the_context_and_the_ledger(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        store = store_factory()
        provider = ScriptedProvider(
            [calls(call("add", call_id="c1", a=1, b=2)), text("3")]
        )
        inference_input = request_with(add)
        async with Runtime(providers={"scripted": provider}, store=store) as runtime:
            loop_id = runtime.run_loop("agent", "1+2?", inference_input)
            result = await runtime.wait(loop_id)
            stored = await store.load(loop_id)
            calls_of_1 = await store.calls(loop_id, 1)
            first = await store.record_at(loop_id, 2)
        assert result.outcome is Outcome.answered
        assert stored is not None
        assert stored.record.status is LoopStatus.done
        assert stored.record.outcome is Outcome.answered
        assert stored.items == inference_input.context.items
        assert items_of(ModelContext(items=stored.items)) == [
            "user:1+2?",
            "call:c1",
            "out:c1=3",
            "model:3",
        ]
        assert first is not None
        assert first.state is LoopState.context_update
        (entry,) = calls_of_1
        assert (entry.status, entry.tool, entry.call_id, entry.attempt) == (
            "done",
            "add",
            "c1",
            1,
        )
        assert entry.output is not None
        assert entry.output.output == "3"
        assert entry.key == idempotency_key(loop_id, 1, 0, "add", '{"b": 2, "a": 1}')

    async def test_every_record_by_its_seq_and_every_model_output(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """`record_at` gives the record of each seq, the ones written with a
        later commit (into `context_update`, `model_message`) included, and
        `inference` each request's output."""
        store = store_factory()
        provider = ScriptedProvider(
            [calls(call("add", call_id="c1", a=1, b=2)), text("3")]
        )
        async with Runtime(providers={"scripted": provider}, store=store) as runtime:
            loop_id = runtime.run_loop("agent", "1+2?", request_with(add))
            result = await runtime.wait(loop_id)
            stored = await store.load(loop_id)
            assert stored is not None
            last = stored.record.seq
            records = [await store.record_at(loop_id, n) for n in range(1, last + 1)]
            outputs = [await store.inference(loop_id, n) for n in (1, 2, 3)]
        assert result.outcome is Outcome.answered
        kept = {r.seq: r for r in records if r is not None}
        # One record per committed transition, each the latest at or before a seq.
        assert [kept[seq].state for seq in sorted(kept)] == [
            LoopState.context_update,
            LoopState.inference,
            LoopState.function_call,
            LoopState.inference,
            LoopState.model_message,
            LoopState.idle,
        ]
        for n, record in enumerate(records, start=1):
            expected = max((seq for seq in kept if seq <= n), default=None)
            assert (record.seq if record else None) == expected, n
        assert outputs[0] is not None
        assert [c.name for c in outputs[0].function_calls] == ["add"]
        assert outputs[1] is not None
        assert outputs[1].message is not None
        assert outputs[2] is None

    @pytest.mark.parametrize("how", ["paused and resumed", "crashed in a call"])
    async def test_every_stored_record_is_the_committed_one(
        self, store_factory: Callable[[], LoopStore], how: str
    ) -> None:
        """What `load` and `record_at` give is each record as the runtimes
        committed it, whole (the SQLite store keeps what a loop's records share
        once, and each path step once): across a pause resumed by another
        runtime, and a crash whose recovery took a step back off the path to
        pause over the call in flight."""
        committed: dict[int, LoopRecord] = {}
        if how == "paused and resumed":
            loop_id = await paused_for_approval(spied(store_factory(), committed))
        else:
            loop_id = await died_charging(spied(store_factory(), committed))
        result = await resumed_elsewhere(spied(store_factory(), committed), loop_id)
        assert result.outcome is Outcome.answered
        async with store_factory() as store:
            stored = await store.load(loop_id)
            at = {seq: await store.record_at(loop_id, seq) for seq in committed}
        assert stored is not None
        assert stored.record == committed[max(committed)]
        assert at == committed
        if how == "crashed in a call":  # the step back, then the step again
            paths = [r.path for r in committed.values()]
            assert any(len(b) < len(a) for a, b in itertools.pairwise(paths))

    @pytest.mark.parametrize("how", ["a rewritten request", "a repaired context"])
    async def test_records_whose_request_is_not_the_input_read_back_whole(
        self, store_factory: Callable[[], LoopStore], how: str
    ) -> None:
        """A record leaves out the input request where the turn's request or
        the step's payload is it; where they are other requests (a handler's
        rewrite, a context repaired), they are kept and read back."""
        committed: dict[int, LoopRecord] = {}
        context = ModelContext()
        handler: Any = None
        if how == "a rewritten request":

            def handler(pending: PendingTransition) -> Rewrite | None:
                payload = pending.payload
                if pending.trigger is Trigger.infer and isinstance(
                    payload, InferenceInput
                ):
                    return Rewrite(
                        payload=payload.model_copy(update={"temperature": 0.5})
                    )
                return None

        else:  # a call with no output: each request is a repaired copy
            context.append(UserMessage(content="earlier"))
            context.append(FunctionCallItem(call_id="open", name="add", arguments="{}"))
        provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        async with Runtime(
            providers={"scripted": provider},
            store=spied(store_factory(), committed),
        ) as runtime:
            request = InferenceInput(model="scripted:m", context=context, tools=[add])
            loop_id = runtime.run_loop("agent", "1+2?", request, handler)
            assert (await runtime.wait(loop_id)).outcome is Outcome.answered
        async with store_factory() as store:
            at = {seq: await store.record_at(loop_id, seq) for seq in committed}
        assert at == committed
        assert any(r.turn.request != r.input for r in committed.values())

    async def test_a_new_loop_whose_id_the_store_holds_fails_with_no_tool_call(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """The model answers at once: the new loop's first commit is still
        queued as the loop ends, and its end waits for it (it would go with the
        end's commit otherwise, and its failure be only logged): the loop
        fails, naming the id."""

        results = []
        for _ in range(2):
            async with Runtime(
                providers={"scripted": ScriptedProvider([text("hi")])},
                store=store_factory(),
                ids=counter_ids(),
            ) as runtime:
                results.append(
                    await runtime.wait(runtime.run_loop("agent", "go", request_with()))
                )
        assert results[0].outcome is Outcome.answered
        assert results[1].loop_id == "loop-1"
        assert results[1].outcome is Outcome.failed
        assert "loop id 'loop-1' is a loop's the store holds" in str(results[1].reason)

    async def test_a_new_loop_whose_id_the_store_holds_fails(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """An id source that gives an id again across restarts (counter ids):
        the new loop fails, naming the id, before any tool runs, and the loop
        the store holds is left as it was (it did not lend the new one its
        ledger: a call of the same key would have been answered by the old
        loop's output, and not run)."""

        script = [calls(call("add", a=1, b=2), call("add", a=3, b=4)), text("done")]
        async with Runtime(
            providers={"scripted": ScriptedProvider(script)},
            store=store_factory(),
            ids=counter_ids(),
        ) as first:
            request = request_with(add)
            first_result = await first.wait(
                first.run_loop("agent", "go", request, tool_execution="sequential")
            )
        async with Runtime(
            providers={"scripted": ScriptedProvider(script)},
            store=store_factory(),
            ids=counter_ids(),
        ) as second:
            request = request_with(add)
            again = second.run_loop("agent", "go", request, tool_execution="sequential")
            result = await finished(second, again)
        assert first_result.outcome is Outcome.answered
        assert again == first_result.loop_id == "loop-1"
        assert result.outcome is Outcome.failed
        assert result.reason is not None
        assert "loop id 'loop-1' is a loop's the store holds already" in result.reason
        assert RAN == ["add 1 2", "add 3 4"]  # none in the second runtime
        async with store_factory() as store:
            stored = await store.load("loop-1")
        assert stored is not None
        assert (stored.record.outcome, stored.record.started_at) == (
            Outcome.answered,
            first_result.started_at,
        )

    async def test_a_run_s_records_keep_what_that_run_shared(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """A runtime that takes a loop up may name its handlers otherwise (a
        handler rebound to another callable): the records each lease wrote
        read back as written."""
        last = (await a_run_s_records(store_factory))[-1]
        running = LoopStatus.running
        first = last.model_copy(
            update={
                "loop_id": "shared",
                "seq": 100,
                "handlers": ("app:old",),
                "status": running,
            }
        )
        then = first.model_copy(update={"seq": 101, "handlers": ("app:new",)})
        async with store_factory() as store:
            await store.commit(commit_of(first, Lease("A", 1), new=True))
            await store.release("A")
        async with store_factory() as store:
            lease = await store.acquire("shared", "B")
            assert lease == Lease("B", 2)
            await store.commit(commit_of(then, lease))
            got = (await store.record_at("shared", 100), await store.load("shared"))
        assert got[0] == first
        assert got[1] is not None
        assert got[1].record == then

    async def test_a_stale_lease_writes_nothing_and_a_new_one_reads_back_whole(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """A runtime whose loop another took (its lease lapsed: the other
        recovered the loop, took a step back off its path, paused it and
        exited) can write nothing more with its old lease, even once the other
        gave the loop up; taking it again (a new epoch), its commits start a
        run of their own, and every record reads back as committed."""
        last = (await a_run_s_records(store_factory))[-1]
        path = last.path
        assert len(path) >= 4
        running = LoopStatus.running
        ours = last.model_copy(
            update={"loop_id": "taken", "seq": 100, "path": path[:3], "status": running}
        )
        theirs = ours.model_copy(
            update={"seq": 101, "path": path[:2], "status": LoopStatus.paused}
        )
        again = ours.model_copy(update={"seq": 102, "path": path[:4]})
        async with store_factory() as a, store_factory() as b:
            await a.commit(commit_of(ours, Lease("A", 1), new=True))
            taken = await b.acquire("taken", "B", replacing="A")
            await b.commit(commit_of(theirs, taken))
            await b.release("B")
            with pytest.raises(LeaseLostError, match="nobody holds it"):
                await a.commit(commit_of(again, Lease("A", 1)))
            lease = await a.acquire("taken", "A")
            assert lease.epoch == taken.epoch + 1
            await a.commit(commit_of(again, lease))
            stored = await a.load("taken")
            at = [await a.record_at("taken", seq) for seq in (100, 101, 102)]
        assert stored is not None
        assert stored.record == again
        assert at == [ours, theirs, again]

    async def test_a_seq_written_twice_reads_as_last_written(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """Two leases wrote seqs 102 to 104 (B took the loop from A, A took it
        back and went on from its own record): `record_at` gives each as the
        last one written, whether a row holds it or a later commit carried it."""
        last = (await a_run_s_records(store_factory))[-1]
        path = last.path

        def at(seq: int, who: str, steps: int) -> LoopRecord:
            return last.model_copy(
                update={
                    "loop_id": "twice",
                    "seq": seq,
                    "path": path[:steps],
                    "status": LoopStatus.running,
                    "handlers": (f"app:{who}",),
                }
            )

        async with store_factory() as a, store_factory() as b:
            await a.commit(commit_of(at(101, "A", 1), Lease("A", 1), new=True))
            taken = await b.acquire("twice", "B", replacing="A")
            b_earlier = [at(102, "B", 1), at(103, "B", 2)]
            await b.commit(commit_of(at(104, "B", 2), taken, earlier=b_earlier))
            await b.release("B")
            lease = await a.acquire("twice", "A")
            await a.commit(commit_of(at(102, "A", 2), lease))
            a_earlier = [at(103, "A", 2), at(104, "A", 3)]
            last_of_a = at(105, "A", 3)
            await a.commit(
                Commit(
                    "twice",
                    lease,
                    last_of_a.model_copy(update={"path": ()}),
                    3,
                    path[2:3],
                    2,
                    earlier=[
                        (r.model_copy(update={"path": ()}), len(r.path))
                        for r in a_earlier
                    ],
                )
            )
            read = {n: await a.record_at("twice", n) for n in (101, 102, 103, 104)}
            stored = await a.load("twice")
        assert read == {
            101: at(101, "A", 1),
            102: at(102, "A", 2),
            103: at(103, "A", 2),
            104: at(104, "A", 3),
        }
        assert stored is not None
        assert stored.record == last_of_a

    async def test_instructions_changed_mid_loop_outlive_the_process(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """A loop's context's instructions changed by a tool (as agents taking
        turns on one conversation do): the records hold each commit's, and the
        runtime that takes the loop up sends the changed ones."""
        committed: dict[int, LoopRecord] = {}
        context = ModelContext(instructions="be brief")

        @tool
        async def retitle(text: str) -> str:
            """Change the instructions."""
            context.instructions = text
            return "ok"

        request = InferenceInput(
            model="scripted:m", context=context, tools=[retitle, pay]
        )
        script = [
            calls(call("retitle", text="be thorough")),
            calls(call("pay", amount=5)),
        ]
        async with Runtime(
            providers={"scripted": ScriptedProvider(script)},
            store=spied(store_factory(), committed),
        ) as first:
            loop_id = first.run_loop("agent", "go", request)
            await wait_until(lambda: first.get(loop_id).status is LoopStatus.paused)
        provider = ScriptedProvider([text("paid")])
        result = await resumed_elsewhere(
            spied(store_factory(), committed), loop_id, provider, [retitle, *TOOLS]
        )
        assert result.outcome is Outcome.answered
        async with store_factory() as store:
            at = {seq: await store.record_at(loop_id, seq) for seq in committed}
        assert at == committed
        assert [r.input.instructions for r in committed.values()][-1] == "be thorough"
        (sent,) = provider.requests
        assert sent.context.instructions == "be thorough"

    async def test_a_loop_waited_for_has_its_end_in_the_store(
        self, tmp_path: Path
    ) -> None:
        """`wait` returns once the end is stored (it returned before the last
        write: a crash then left a finished loop looking unfinished)."""
        import sqlite3

        path = tmp_path / "loops.db"
        provider = ScriptedProvider([text("hi")])
        async with Runtime(
            providers={"scripted": provider}, store=SQLiteStore(path)
        ) as runtime:
            loop_id = runtime.run_loop("agent", "hi", request_with())
            await runtime.wait(loop_id)
            with sqlite3.connect(path) as db:  # no await in between
                (status,) = db.execute(
                    "SELECT status FROM loops WHERE loop_id = ?", (loop_id,)
                ).fetchone()
                (state,) = db.execute(
                    "SELECT json_extract(record, '$.state') FROM log"
                    " WHERE loop_id = ? ORDER BY id DESC LIMIT 1",
                    (loop_id,),
                ).fetchone()
        assert (status, state) == ("done", "idle")

    @pytest.mark.parametrize("open_call", [False, True])
    async def test_a_commit_writes_only_what_the_context_gained(
        self, tmp_path: Path, open_call: bool
    ) -> None:
        """A 2,000-item context costs its size once, not at every commit; one
        holding a call without an output too (each request is then a repaired
        copy of it, which the records held in full)."""
        store = SQLiteStore(tmp_path / "big.db")
        context = ModelContext()
        for n in range(2000):
            context.append(UserMessage(content=f"message {n:04d} " + "x" * 40))
        if open_call:
            context.append(FunctionCallItem(call_id="old", name="add", arguments="{}"))
        size = len(context.model_dump_json())
        provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        inference_input = InferenceInput(
            model="scripted:m", context=context, tools=[add]
        )
        async with Runtime(providers={"scripted": provider}, store=store) as runtime:
            result = await runtime.wait(
                runtime.run_loop("agent", "go", inference_input)
            )
        written = store.statistics()
        assert result.outcome is Outcome.answered
        # Four writes for the loop: into `inference` twice and `function_call`
        # once (with the call's intent), and the end (with the records of the
        # transitions into `context_update` and `model_message`, and the
        # call's output); and the runtime's lease given up at its exit.
        assert written.commits == 5
        assert size < written.bytes_written < 2 * size

    async def test_a_repaired_context_is_recorded_as_its_repairs(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """A context holding a call without an output is sent repaired; its
        records name the repair (they held a copy of the whole context at every
        commit), and the loop taken up again sends the same repaired request."""
        context = ModelContext()
        for n in range(500):
            context.append(UserMessage(content=f"message {n:04d} " + "x" * 40))
        context.append(FunctionCallItem(call_id="old", name="add", arguments="{}"))
        async with Runtime(
            providers={"scripted": ScriptedProvider([calls(call("pay", amount=5))])},
            store=store_factory(),
        ) as first:
            loop_id = first.run_loop(
                "agent",
                "pay 5",
                InferenceInput(model="scripted:m", context=context, tools=[pay, add]),
            )
            await wait_until(lambda: first.get(loop_id).status is LoopStatus.paused)
            record = first.snapshot(loop_id)
        assert record.turn.request.repairs is not None
        assert record.turn.request.items is None
        provider = ScriptedProvider([text("paid")])
        async with Runtime(
            providers={"scripted": provider}, store=store_factory(), tools=TOOLS
        ) as second:
            await second.recover()
            second.resume(loop_id, Proceed())
            result = await finished(second, loop_id)
        assert result.outcome is Outcome.answered
        (again,) = provider.requests
        sent = items_of(again.context)
        assert sent[500:503] == ["call:old", "out:old=ERR", "user:pay 5"]
        assert sent[-1].endswith("=paid 5")


class TestPauses:
    async def test_a_paused_loop_outlives_its_runtime(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        loop_id = await paused_for_approval(store_factory())
        # The runtime exited with the loop paused: it is not cancelled.
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("paid")])},
            store=store_factory(),
            tools=TOOLS,
        ) as second:
            report = await second.recover()
            assert report.paused == [loop_id]
            view = second.get(loop_id)
            assert view.status is LoopStatus.paused
            assert view.pending is not None
            assert view.pending.trigger is Trigger.call_tools
            second.resume(loop_id, Proceed())
            result = await finished(second, loop_id)
        assert result.outcome is Outcome.answered
        assert RAN == ["pay 5"]

    @pytest.mark.parametrize("follow_up", [False, True])
    async def test_a_message_queued_for_a_paused_loop_outlives_its_runtime(
        self, store_factory: Callable[[], LoopStore], follow_up: bool
    ) -> None:
        """Steering or a follow-up sent to a paused loop is stored with it: the
        runtime that resumes it, after the first one exited, delivers it."""
        async with Runtime(
            providers={"scripted": ScriptedProvider([calls(call("pay", amount=5))])},
            store=store_factory(),
        ) as first:
            loop_id = first.run_loop("agent", "pay 5", request_with(pay))
            await wait_until(lambda: first.get(loop_id).status is LoopStatus.paused)
            if follow_up:
                first.follow_up(loop_id, "and send a receipt")
            else:
                first.steer(loop_id, "in euros")
        provider = ScriptedProvider([text("paid"), text("receipt sent")])
        result = await resumed_elsewhere(store_factory(), loop_id, provider)
        assert result.outcome is Outcome.answered
        seen = [
            [i.content for i in r.context.items if isinstance(i, UserMessage)]
            for r in provider.requests
        ]
        message = "and send a receipt" if follow_up else "in euros"
        assert message in seen[-1]  # delivered, by the second runtime

    async def test_a_decision_given_is_never_asked_for_again(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """Resumed, the loop dies in the tool its decision let run; taken up
        again, it does not pause for that decision a second time."""
        GATE["block"] = anyio.Event()

        def start(runtime: Runtime) -> str:
            return runtime.run_loop("agent", "go", request_with(lookup, pay))

        async def first_life() -> str:
            loop_id = ""
            with anyio.CancelScope() as scope:
                async with Runtime(
                    providers={
                        "scripted": ScriptedProvider(
                            [calls(call("pay", amount=1), call("lookup", key="k"))]
                        )
                    },
                    store=store_factory(),
                ) as runtime:
                    loop_id = start(runtime)
                    await wait_until(
                        lambda: runtime.get(loop_id).status is LoopStatus.paused
                    )
                    runtime.resume(loop_id, Proceed())
                    await wait_until(lambda: "lookup k" in RAN)
                    scope.cancel()
                    await anyio.sleep_forever()
            return loop_id

        loop_id = await first_life()
        del GATE["block"]
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("done")])},
            store=store_factory(),
            tools=TOOLS,
        ) as second:
            report = await second.recover()
            assert report.running == [loop_id], report
            result = await finished(second, loop_id)
        assert result.outcome is Outcome.answered
        assert RAN == ["pay 1", "lookup k", "lookup k"]  # pay ran once


class TestRecovery:
    async def test_a_done_call_is_never_run_again_and_a_retry_tool_runs_again(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        GATE["block"] = anyio.Event()
        script = [
            calls(
                call("add", call_id="c1", a=1, b=2),
                call("lookup", call_id="c2", key="k"),
            )
        ]
        loop_id = await die_when(
            store_factory(),
            script,
            lambda rt: rt.run_loop(
                "agent", "go", request_with(add, lookup), tool_execution="sequential"
            ),
            running("lookup"),
        )
        del GATE["block"]
        store = store_factory()
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("done")])},
            store=store,
            tools=TOOLS,
        ) as second:
            recorder = EventRecorder(second.bus, "loop.recovered")
            report = await second.recover()
            result = await finished(second, loop_id)
            stored = await store.load(loop_id)
            ledger = await store.calls(loop_id, 1)
        assert report.running == [loop_id]
        assert result.outcome is Outcome.answered
        assert RAN == ["add 1 2", "lookup k", "lookup k"]
        # The call run again has the key it had: an API deduplicating by it
        # takes its effect once.
        key = idempotency_key(loop_id, 1, 1, "lookup", '{"key":"k"}')
        assert list(KEYS) == [key, key]
        assert [(c.call_id, c.status, c.attempt) for c in ledger] == [
            ("c1", "done", 1),
            ("c2", "done", 2),
        ]
        assert stored is not None
        assert items_of(ModelContext(items=stored.items)) == [
            "user:go",
            "call:c1",
            "call:c2",
            "out:c1=3",
            "out:c2=value of k",
            "model:done",
        ]
        (event,) = recorder.events
        assert isinstance(event, LoopRecovered)
        assert (event.status, event.state) == ("running", LoopState.function_call)

    async def test_a_call_done_before_a_sibling_starts_is_stored_at_once(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """A parallel batch one call at a time (which first is the backend's
        choice): the call that ran first has its output written when it ends
        (not kept for the next write: its sibling runs after it), and the one
        waiting for its slot has no intent written before it starts; so a crash
        in the second call makes neither uncertain."""
        GATE["block"] = anyio.Event()
        script = [
            calls(
                call("add", call_id="c1", a=1, b=2),
                call("lookup", call_id="c2", key="k"),
            )
        ]
        loop_id = await die_when(
            store_factory(),
            script,
            lambda rt: rt.run_loop(
                "agent",
                "go",
                request_with(add, lookup),
                tool_execution="parallel",
                max_tool_concurrency=1,
            ),
            running("lookup"),
        )
        del GATE["block"]
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("done")])},
            store=store_factory(),
            tools=TOOLS,
        ) as second:
            report = await second.recover()
            assert report.running == [loop_id], report  # not paused over `add`
            result = await finished(second, loop_id)
        assert result.outcome is Outcome.answered
        assert sorted(RAN) == ["add 1 2", "lookup k", "lookup k"]

    @pytest.mark.parametrize("decision", ["answer", "proceed"])
    async def test_a_call_in_flight_pauses_the_loop_naming_it(
        self, store_factory: Callable[[], LoopStore], decision: str
    ) -> None:
        loop_id = await died_charging(store_factory())
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("done")])},
            store=store_factory(),
            tools=TOOLS,
        ) as second:
            recorder = EventRecorder(second.bus, "loop.recovered")
            report = await second.recover()
            view = second.get(loop_id)
            assert report.paused == [loop_id]
            assert view.status is LoopStatus.paused
            assert view.pause_reason is not None
            assert "c1 (charge)" in view.pause_reason
            assert view.pending is not None
            batch = view.pending.payload
            assert isinstance(batch, ToolBatch)
            if decision == "answer":
                answered = batch.answer("c1", "charged 5 (checked by hand)")
                second.resume(loop_id, Rewrite(payload=answered))
            else:
                second.resume(loop_id, Proceed())
            result = await finished(second, loop_id)
        (event,) = recorder.events
        assert isinstance(event, LoopRecovered)
        assert (event.status, event.uncertain_calls) == ("paused", ("c1",))
        assert result.outcome is Outcome.answered
        if decision == "answer":
            assert RAN == ["charge 5"]
        else:
            assert RAN == ["charge 5", "charge 5"]

    @pytest.mark.parametrize("resumed_by", ["the recovering runtime", "a third"])
    async def test_a_call_done_beside_one_in_flight_is_not_run_again(
        self, store_factory: Callable[[], LoopStore], resumed_by: str
    ) -> None:
        """A parallel batch: `add` ended (its output stored), `charge` ran
        when the process died. Recovery pauses over `charge`; resumed with
        Proceed, `charge` runs again and `add` does not, whichever runtime
        resumes it (the batch goes into `function_call` anew: its intents
        must not make `add` look new)."""
        ended: list[str] = []
        store = store_factory()
        commit_many = store.commit_many

        async def spy(commits: Sequence[Commit]) -> list[Exception | None]:
            errors = await commit_many(commits)
            for commit, error in zip(commits, errors, strict=True):
                if error is None:
                    ended.extend(c.call_id for c in commit.ledger if c.status == "done")
            return errors

        store.commit_many = spy  # type: ignore[method-assign]
        GATE["block"] = anyio.Event()
        loop_id = await die_when(
            store,
            [
                calls(
                    call("add", call_id="c1", a=1, b=2),
                    call("charge", call_id="c2", amount=5),
                )
            ],
            lambda rt: rt.run_loop(
                "agent", "go", request_with(add, charge), tool_execution="parallel"
            ),
            lambda rt, loop_id: "c1" in ended and "charge 5" in RAN,
        )
        del GATE["block"]
        if resumed_by == "a third":  # one recovers it, pausing it, and exits
            async with Runtime(store=store_factory(), tools=TOOLS) as second:
                assert (await second.recover()).paused == [loop_id]
        result = await resumed_elsewhere(store_factory(), loop_id)
        assert result.outcome is Outcome.answered
        assert sorted(RAN) == ["add 1 2", "charge 5", "charge 5"]

    async def test_a_recorded_model_output_is_not_sent_again(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """The loop dies while a handler decides about the model's output: taken
        up again, it uses the recorded output (a second request would have
        been answered "3" at once, with no tool call)."""
        GATE["hold"] = anyio.Event()
        loop_id = await die_when(
            store_factory(),
            [calls(call("add", a=1, b=2))],
            lambda rt: rt.run_loop("agent", "go", request_with(add), Hold()),
            lambda rt, loop_id: rt.get(loop_id).model_requests == 1,
        )
        provider = ScriptedProvider([text("3")])
        again = Hold(holds=False)
        async with Runtime(
            providers={"scripted": provider},
            store=store_factory(),
            tools=TOOLS,
            handlers=[again],
        ) as second:
            await second.recover()
            result = await finished(second, loop_id)
        assert result.outcome is Outcome.answered
        assert RAN == ["add 1 2"]
        assert len(provider.requests) == 1
        assert again.asked[0] is Trigger.call_tools

    async def test_a_cancelled_loop_is_not_recovered(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        async with Runtime(
            providers={"scripted": ScriptedProvider([calls(call("pay", amount=5))])},
            store=store_factory(),
        ) as first:
            loop_id = first.run_loop("agent", "pay 5", request_with(pay))
            await wait_until(lambda: first.get(loop_id).status is LoopStatus.paused)
            first.cancel(loop_id)
            assert (await first.wait(loop_id)).outcome is Outcome.cancelled
        async with Runtime(store=store_factory(), tools=TOOLS) as second:
            report = await second.recover()
        assert report.recovered == []


class TestRefusals:
    async def test_a_missing_tool_fails_the_loop_naming_it(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        loop_id = await paused_for_approval(store_factory())
        store = store_factory()
        async with Runtime(store=store, tools=[add]) as second:
            report = await second.recover()
            stored = await store.load(loop_id)
        assert "'pay'" in report.failed[loop_id]
        assert stored is not None
        assert stored.record.outcome is Outcome.failed
        assert stored.record.error is not None
        assert "'pay'" in stored.record.error.message

    async def test_a_tool_whose_schema_changed_fails_the_loop(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        loop_id = await paused_for_approval(store_factory())

        @tool(name="pay", needs_approval=True)
        async def pay_in(amount: int, currency: str) -> str:
            """Pay an amount in a currency."""
            return f"paid {amount} {currency}"

        async with Runtime(store=store_factory(), tools=[pay_in]) as second:
            report = await second.recover()
        assert "another schema of the tool 'pay'" in report.failed[loop_id]

    async def test_a_store_written_by_newer_code_is_refused(
        self, tmp_path: Path
    ) -> None:
        import sqlite3

        path = tmp_path / "new.db"
        with sqlite3.connect(path) as db:
            db.execute("PRAGMA application_id=1634104113")  # agentfsm's
            db.execute("PRAGMA user_version=99")
        with pytest.raises(StoreSchemaError, match="newer agentfsm"):
            async with Runtime(store=SQLiteStore(path)):
                pass

    @pytest.mark.parametrize("layout", [1, 2, 3, 4])
    async def test_a_store_written_by_an_earlier_layout_is_refused(
        self, tmp_path: Path, layout: int
    ) -> None:
        import sqlite3

        path = tmp_path / "old.db"
        with sqlite3.connect(path) as db:
            db.execute("CREATE TABLE loops (loop_id TEXT PRIMARY KEY)")
            db.execute(f"PRAGMA user_version={layout}")
        with pytest.raises(
            StoreSchemaError, match=rf"earlier agentfsm.*layout {layout}"
        ):
            async with Runtime(store=SQLiteStore(path)):
                pass

    async def test_a_commit_for_a_loop_the_store_does_not_hold_fails(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        entry = CallRecord(
            key="k",
            loop_id="nobody",
            request=1,
            position=0,
            tool="add",
            call_id="c",
            status="started",
        )
        async with store_factory() as store:
            with pytest.raises(StoreError, match="holds no loop 'nobody'"):
                await store.commit(Commit("nobody", Lease("A", 1), ledger=[entry]))
            with pytest.raises(StoreError, match="holds no loop 'nobody'"):
                await store.acquire("nobody", "A")
            assert await store.calls("nobody", 1) == []

    def test_bad_arguments_are_refused_by_name(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigurationError, match="store must be a LoopStore"):
            Runtime(store="loops.db")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="give store= too"):
            Runtime(tools=[add])
        with pytest.raises(ConfigurationError, match="durability"):
            SQLiteStore(tmp_path / "x.db", durability="always")  # type: ignore[arg-type]


class TestLeases:
    async def test_two_runtimes_never_run_one_loop(self, tmp_path: Path) -> None:
        GATE["block"] = anyio.Event()
        path = tmp_path / "shared.db"
        async with Runtime(
            providers={
                "scripted": ScriptedProvider(
                    [calls(call("charge", amount=5)), text("done")]
                )
            },
            store=SQLiteStore(path),
        ) as first:
            loop_id = first.run_loop("agent", "charge", request_with(charge))
            await wait_until(lambda: "charge 5" in RAN)
            async with Runtime(store=SQLiteStore(path), tools=TOOLS) as second:
                report = await second.recover()
                assert second.loops() == []
            assert list(report.locked) == [loop_id]
            GATE["block"].set()
            result = await first.wait(loop_id)
        assert result.outcome is Outcome.answered
        assert RAN == ["charge 5"]

    async def test_a_lease_is_fenced_and_an_ended_loop_never_taken_again(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """A runtime holds its loops' leases while it runs; another takes one
        only once it is free (a new epoch each time), and the old lease writes
        nothing more; an ended loop is never taken, nor written, again."""
        store = store_factory()
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hi")])}, store=store
        ) as runtime:
            loop_id = runtime.run_loop("agent", "hi", request_with())
            await runtime.wait(loop_id)
            owner = runtime._keeper.owner  # type: ignore[union-attr]
        last = (await a_run_s_records(store_factory))[-1]
        open_ = last.model_copy(
            update={"loop_id": "open", "status": LoopStatus.running}
        )
        async with store_factory() as store:
            stored = await store.load(loop_id)
            assert stored is not None
            assert stored.record.outcome is Outcome.answered
            with pytest.raises(StoreError, match="has ended"):
                await store.acquire(loop_id, "someone-else")
            with pytest.raises(LeaseLostError, match="has ended"):
                await store.commit(commit_of(stored.record, Lease(owner, 1)))
            mine = Lease("me", 1)
            await store.commit(commit_of(open_, mine, new=True))
            with pytest.raises(
                LoopLockedError, match="owned by another runtime \\(me\\)"
            ):
                await store.acquire("open", "someone-else")
            assert await store.renew("me") == {"open": 1}
            await store.release("me")
            assert await store.renew("me") == {}
            theirs = await store.acquire("open", "someone-else")
            assert theirs == Lease("someone-else", 2)
            with pytest.raises(LeaseLostError, match="someone-else holds it"):
                await store.commit(Commit("open", mine))
            ended = open_.model_copy(update={"status": LoopStatus.done, "seq": 500})
            await store.commit(commit_of(ended, theirs))
            with pytest.raises(LeaseLostError, match="has ended"):
                await store.commit(Commit("open", theirs))
            assert await store.renew("someone-else") == {}


class TestEventStreams:
    async def test_a_watcher_that_reconnects_misses_nothing(
        self, event_stores: Callable[[], LoopStore]
    ) -> None:
        """A watcher reads a loop's events up to its pause and goes; the loop is
        resumed; reconnecting from the last seq it saw, it gets the rest, once
        each, up to `loop.idle`. A watcher coming after the end gets them all
        from the store."""
        store = event_stores()
        provider = ScriptedProvider([calls(call("pay", amount=5)), text("paid")])
        async with Runtime(providers={"scripted": provider}, store=store) as runtime:
            recorder = EventRecorder(runtime.bus)
            loop_id = runtime.run_loop("agent", "pay 5", request_with(pay))
            first: list[int] = []
            async with aclosing(runtime.watch(loop_id)) as events:
                async for event in events:
                    first.append(event.seq)
                    if event.type == "loop.paused":
                        break  # the watcher goes away
            runtime.resume(loop_id, Proceed())
            await runtime.wait(loop_id)
            rest = [e.seq async for e in runtime.watch(loop_id, after_seq=first[-1])]
            everything = [e async for e in runtime.watch(loop_id)]
        published = recorder.of_loop(loop_id)
        assert first + rest == [e.seq for e in published]
        assert first + rest == list(range(1, len(published) + 1))
        assert everything == published
        async with event_stores() as again:
            assert isinstance(again, EventArchive)
            assert await again.events(loop_id, after_seq=len(published) - 1) == [
                published[-1]
            ]

    async def test_watch_needs_a_store_that_keeps_events(self, tmp_path: Path) -> None:
        from agentfsm.exceptions import LoopStateError

        async with Runtime(store=SQLiteStore(tmp_path / "loops.db")) as runtime:
            with pytest.raises(LoopStateError, match="events=True"):
                runtime.watch("any")


async def test_a_durable_runtime_cancelled_from_outside_closes_everything(
    tmp_path: Path,
) -> None:
    """Its services (the leases) close, and so do its store, its bus and its
    event log (on trio, the services' close raised and the rest was skipped)."""
    from agentfsm import current_runtime
    from agentfsm.eventlog import read_events
    from agentfsm.exceptions import BusClosed, NoRuntimeError
    from agentfsm.store import StoreError

    GATE["block"] = anyio.Event()
    log = tmp_path / "events.jsonl"
    store = SQLiteStore(tmp_path / "loops.db")
    with anyio.CancelScope() as scope:
        async with Runtime(
            providers={"scripted": ScriptedProvider([calls(call("charge", amount=5))])},
            store=store,
            event_log=log,
        ) as runtime:
            recorder = EventRecorder(runtime.bus)
            runtime.run_loop("agent", "charge", request_with(charge))
            await wait_until(lambda: "charge 5" in RAN)
            scope.cancel()
            await anyio.sleep_forever()
    with pytest.raises(BusClosed):
        runtime.bus.subscribe("*")
    with pytest.raises(NoRuntimeError):
        current_runtime()
    assert list(read_events(log)) == recorder.events
    with pytest.raises(StoreError, match="not open"):
        await store.load("any")  # the store was closed


async def test_a_store_that_keeps_events_is_a_replay_source(
    event_stores: Callable[[], LoopStore],
) -> None:
    """Replayed from the store, a recorded run reports no divergence; with a
    handler that denies the call, the first divergent transition."""
    from agentfsm.replay import replay

    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(
        providers={"scripted": provider}, store=event_stores()
    ) as runtime:
        loop_id = runtime.run_loop("agent", "1+2?", request_with(add))
        await runtime.wait(loop_id)

    def deny(pending: PendingTransition) -> Rewrite | None:
        batch = pending.payload
        if isinstance(batch, ToolBatch):
            return Rewrite(payload=batch.deny(batch.calls[0].call_id, "no"))
        return None

    async with event_stores() as store:
        assert isinstance(store, EventArchive)
        same = await replay(store, loop_id=loop_id, tools=[add])
        changed = await replay(store, loop_id=loop_id, tools=[add], handlers=[deny])
    assert not same.diverged
    assert changed.diverged
    assert RAN == ["add 1 2"]  # the recording: the replays ran no tool


async def test_a_shared_context_is_kept_append_only(
    store_factory: Callable[[], LoopStore],
) -> None:
    """What `agentfsm.temporal.StoreContexts` keeps a workflow's context in."""
    store = store_factory()
    assert isinstance(store, SharedContexts)
    one, two, three = (UserMessage(content=t) for t in ("one", "two", "three"))
    async with store:
        assert await store.context("c") is None
        await store.append_context("c", 0, [one, two], ["d1", "d2"])
        await store.append_context("c", 2, [three], ["d3"])
        assert await store.context("c") == ([one, two, three], ["d1", "d2", "d3"])
        await store.append_context("c", 1, [three], ["x2"])  # from 1 on, rewritten
        assert await store.context("c") == ([one, three], ["d1", "x2"])
