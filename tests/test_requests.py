"""The decision inbox (issue 29): a request to resume or cancel a loop, stored
by a process that does not hold the loop (`agentfsm ui`, a script), applied
once by the runtime that does (`Runtime(requests=...)`), in the transaction of
the commit the action produced.

Every store: memory, SQLite, PostgreSQL (tests/postgres_server.py). The
"UI" is a second store object on the same data (`store_factory()` again; the
memory store's one object), or a second process (tests/requests_child.py).
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
import structlog

from agentfsm import (
    FunctionCallOutputItem,
    InferenceInput,
    LoopStatus,
    ModelContext,
    Outcome,
    Proceed,
    Rewrite,
    Runtime,
    ToolBatch,
    UserMessage,
    tool,
)
from agentfsm.exceptions import (
    ConfigurationError,
    LoopDetachedError,
    LoopStateError,
    StoreError,
    UnknownLoopError,
)
from agentfsm.inference import InferenceOutput
from agentfsm.providers.function import FunctionProvider
from agentfsm.record import DecisionEntry, DecisionRecord, LoopRecord
from agentfsm.store import (
    CallRecord,
    Commit,
    Lease,
    LeaseLostError,
    LoopRequest,
    LoopStore,
    MemoryStore,
    Requests,
    SQLiteStore,
    StoredLoop,
    StoreStatistics,
)
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import wait_until
from tests.requests_child import send, store_of
from tests.store_helpers import commit_of

ROOT = Path(__file__).resolve().parents[1]

RAN: list[str] = []
GATE: dict[str, anyio.Event] = {}


@tool(needs_approval=True)
async def pay(to: str) -> str:
    """Pay someone (needs a person's approval)."""
    RAN.append(f"pay {to}")
    return f"paid {to}"


@tool
async def wait_for_gate(tag: str) -> str:
    """Run until GATE["open"] is set."""
    RAN.append(f"wait {tag}")
    await GATE["open"].wait()
    return "opened"


@pytest.fixture(autouse=True)
def _clean() -> None:
    RAN.clear()
    GATE.clear()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store_factory(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[], LoopStore]:
    """A new store object on the same data at each call (the memory store's
    one object is the data)."""
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
def shared(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """A store two processes share: its kind and where it is (see
    tests/requests_child.py)."""
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
        return "postgres", f"{server.conninfo()} t_{uuid.uuid4().hex}"
    return "sqlite", str(tmp_path / "loops.db")


def request_with(*tools: Any) -> InferenceInput:
    return InferenceInput(model="scripted:m", context=ModelContext(), tools=list(tools))


def own_store(runtime: Runtime) -> LoopStore:
    """The runtime's store (open while the runtime runs)."""
    store = runtime.store
    assert store is not None
    return store


def inbox(store: LoopStore) -> Requests:
    assert isinstance(store, Requests)
    return store


async def request_is(store: LoopStore, request_id: int, status: str) -> LoopRequest:
    """The request, once the store holds it with `status` (30 s at most)."""
    with anyio.fail_after(30):
        while True:
            (found,) = [r for r in await inbox(store).requests() if r.id == request_id]
            if found.status == status:
                return found
            await anyio.sleep(0.005)


async def paused(runtime: Runtime, loop_id: str) -> int:
    """The seq of the loop's pause, once it is paused and its store holds the
    pause (what another process can see and answer)."""
    await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
    pending = runtime.get(loop_id).pending
    assert pending is not None
    seq, _ = await stored_pause(own_store(runtime), loop_id)
    assert seq == pending.seq
    return seq


async def stored_pause(store: LoopStore, loop_id: str) -> tuple[int, ToolBatch]:
    """The pause a process reading the store sees, once its commit has landed:
    its seq and its batch (30 s at most)."""
    with anyio.fail_after(30):
        while True:
            stored = await store.load(loop_id)
            pause = None if stored is None else stored.record.pause
            if pause is not None:
                assert isinstance(pause.payload, ToolBatch)
                return pause.seq, pause.payload
            await anyio.sleep(0.005)


async def finished(runtime: Runtime, loop_id: str) -> Any:
    with anyio.fail_after(30):
        return await runtime.wait(loop_id)


def two_payments() -> ScriptedProvider:
    return ScriptedProvider(
        [
            calls(
                call("pay", call_id="c1", to="ada"), call("pay", call_id="c2", to="bob")
            ),
            text("done"),
        ]
    )


class TestResume:
    async def test_a_request_from_another_store_approves_one_call_and_denies_another(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """The UI reads the pause from its own store object and submits a
        resume that approves c1 and denies c2; the runtime holding the loop
        applies it: `pay` runs once, for ada; bob's output carries the reason;
        the decision names alice; the request is applied."""
        async with Runtime(
            providers={"scripted": two_payments()},
            store=store_factory(),
            requests=3600.0,  # only the poke (or a store's notice) wakes it
        ) as runtime:
            loop_id = runtime.run_loop("agent", "pay ada and bob", request_with(pay))
            await paused(runtime, loop_id)
            async with store_factory() as ui:
                seq, batch = await stored_pause(ui, loop_id)
                decision = Rewrite(payload=batch.approve("c1").deny("c2", "not bob"))
                submitted = await inbox(ui).submit_request(
                    loop_id,
                    "resume",
                    decision=decision,
                    seq=seq,
                    by="alice",
                    reason="ada only",
                )
                assert submitted.status == "pending"
                runtime.poke_requests()
                result = await finished(runtime, loop_id)
                stored = await ui.load(loop_id)
                decisions = await ui.decisions(loop_id)
                (request,) = await inbox(ui).requests(loop_id)
        assert result.outcome is Outcome.answered
        assert RAN == ["pay ada"]
        assert stored is not None
        outputs = {
            i.call_id: i for i in stored.items if isinstance(i, FunctionCallOutputItem)
        }
        assert outputs["c1"].output == "paid ada"
        assert outputs["c2"].is_error
        assert "not bob" in outputs["c2"].output
        resumes = [d for d in decisions if d.handler is None]
        assert [(d.by, d.seq, d.decision.kind) for d in resumes] == [
            ("alice", seq, "rewrite")
        ]
        assert request.id == submitted.id
        assert (request.status, request.by, request.reason) == (
            "applied",
            "alice",
            "ada only",
        )
        assert request.resolved_at is not None
        assert request.resolved_at >= request.created_at

    async def test_a_request_withdrawn_after_the_runtime_read_it_is_not_applied(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """Alice's approval is refused (withdrawn) right after the runtime read
        it: the commit that would apply it is refused, nothing runs, no
        decision is stored, and the store keeps the loop paused for the next
        runtime; a second refusal says it came too late."""
        store = store_factory()
        read = store.pending_requests  # type: ignore[attr-defined]

        async def read_then_withdrawn(after_id: int = 0) -> list[LoopRequest]:
            found: list[LoopRequest] = await read(after_id)
            for request in found:
                assert await inbox(store).refuse_request(request.id, "withdrawn")
            return found

        store.pending_requests = read_then_withdrawn  # type: ignore[attr-defined]
        async with Runtime(
            providers={"scripted": two_payments()}, store=store, requests=3600.0
        ) as runtime:
            loop_id = runtime.run_loop("agent", "pay ada and bob", request_with(pay))
            seq = await paused(runtime, loop_id)
            async with store_factory() as ui:
                submitted = await inbox(ui).submit_request(
                    loop_id, "resume", decision=Proceed(), seq=seq, by="alice"
                )
                runtime.poke_requests()
                with anyio.fail_after(30), pytest.raises(LoopDetachedError) as caught:
                    await runtime.wait(loop_id)
                assert "withdrawn" in str(caught.value.cause)
                assert not await inbox(ui).refuse_request(submitted.id, "again")
                (request,) = await inbox(ui).requests(loop_id)
                decisions = await ui.decisions(loop_id)
                stored = await ui.load(loop_id)
        assert RAN == []
        assert (request.status, request.note) == ("refused", "withdrawn")
        assert [d for d in decisions if d.handler is None] == []
        assert stored is not None
        assert stored.record.status is LoopStatus.paused

    async def test_a_request_that_proceeds_approves_every_call(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """No decision is Proceed: the calls awaiting approval all run."""
        async with Runtime(
            providers={"scripted": two_payments()},
            store=store_factory(),
            requests=3600.0,
        ) as runtime:
            loop_id = runtime.run_loop("agent", "pay", request_with(pay))
            seq = await paused(runtime, loop_id)
            await inbox(own_store(runtime)).submit_request(
                loop_id, "resume", seq=seq, by="bob"
            )
            runtime.poke_requests()
            result = await finished(runtime, loop_id)
        assert result.outcome is Outcome.answered
        assert sorted(RAN) == ["pay ada", "pay bob"]

    async def test_a_request_for_an_earlier_pause_is_refused_with_a_note(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """The loop moved on and paused again: a request naming its first
        pause is refused, saying where it is now, and the loop stays paused."""
        provider = ScriptedProvider(
            [
                calls(call("pay", call_id="c1", to="ada")),
                calls(call("pay", call_id="c2", to="bob")),
                text("done"),
            ]
        )
        async with Runtime(
            providers={"scripted": provider}, store=store_factory(), requests=3600.0
        ) as runtime:
            loop_id = runtime.run_loop("agent", "pay", request_with(pay))
            first = await paused(runtime, loop_id)
            runtime.resume(loop_id, Proceed(), by="carol")
            await wait_until(lambda: RAN == ["pay ada"])
            second = await paused(runtime, loop_id)
            assert second != first
            async with store_factory() as ui:
                stale = await inbox(ui).submit_request(
                    loop_id, "resume", seq=first, by="alice"
                )
                runtime.poke_requests()
                refused = await request_is(ui, stale.id, "refused")
            assert runtime.get(loop_id).status is LoopStatus.paused
        assert refused.note is not None
        assert f"paused at seq {second}, not at seq {first}" in refused.note
        assert refused.resolved_at is not None
        assert RAN == ["pay ada"]

    async def test_a_second_process_holding_the_loop_applies_a_request(
        self, shared: tuple[str, str], tmp_path: Path, anyio_backend: str
    ) -> None:
        """Another process holds the paused loop; this one submits the request
        through its own store: the other applies it and the loop ends there."""
        kind, where = shared
        effects = tmp_path / "effects.log"
        child = await start_child(anyio_backend, kind, where, effects)
        try:
            with anyio.fail_after(60):
                started = json.loads(await read_line(child))
                async with store_of(kind, where) as ui:
                    loop_id, seq = started["loop_id"], started["seq"]
                    stored_seq, batch = await stored_pause(ui, loop_id)
                    assert stored_seq == seq
                    await inbox(ui).submit_request(
                        loop_id,
                        "resume",
                        decision=Rewrite(payload=batch.deny("c2", "not bob")),
                        seq=seq,
                        by="alice",
                    )
                    ended = json.loads(await read_line(child))
                    assert await child.wait() == 0
                    (request,) = await inbox(ui).requests(loop_id)
                    decisions = await ui.decisions(loop_id)
        finally:
            if child.returncode is None:
                child.kill()
            await child.aclose()
        assert ended == {"outcome": "answered", "answer": "done"}
        assert [line.split()[:2] for line in effects.read_text().splitlines()] == [
            ["sent", "ada"]
        ]
        assert request.status == "applied"
        assert [d.by for d in decisions if d.handler is None] == ["alice"]


class TestPending:
    async def test_a_request_no_runtime_holds_stays_pending_until_its_loop_is_recovered(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """A runtime leaves a request for a loop it does not hold alone (the
        poll that applied its own loop's later request saw it); a runtime that
        recovers the loop applies it."""
        async with Runtime(
            providers={"scripted": ScriptedProvider([calls(call("pay", to="ada"))])},
            store=store_factory(),
        ) as first:
            orphan = first.run_loop("agent", "pay ada", request_with(pay))
            await paused(first, orphan)
        async with store_factory() as ui:
            orphan_seq, _ = await stored_pause(ui, orphan)
            waiting = await inbox(ui).submit_request(
                orphan, "resume", seq=orphan_seq, by="alice"
            )
            async with Runtime(
                providers={"scripted": two_payments()},
                store=store_factory(),
                requests=3600.0,
            ) as other:
                own = other.run_loop("agent", "pay", request_with(pay))
                own_seq = await paused(other, own)
                await inbox(ui).submit_request(own, "resume", seq=own_seq, by="bob")
                other.poke_requests()
                await finished(other, own)
            # Read after the request submitted after it was applied: the same
            # poll saw it, and left it.
            assert (await request_is(ui, waiting.id, "pending")).resolved_at is None
            assert RAN == ["pay ada", "pay bob"]
            RAN.clear()
            async with Runtime(
                providers={"scripted": ScriptedProvider([text("paid")])},
                store=store_factory(),
                tools=[pay],
                requests=3600.0,
            ) as taker:
                assert (await taker.recover()).paused == [orphan]
                result = await finished(taker, orphan)  # recover() pokes
            applied = await request_is(ui, waiting.id, "applied")
        assert result.outcome is Outcome.answered
        assert RAN == ["pay ada"]
        assert applied.by == "alice"

    async def test_a_request_for_a_finished_or_unknown_loop_is_refused_at_submit(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hi")])},
            store=store_factory(),
        ) as runtime:
            loop_id = runtime.run_loop("agent", "hi", request_with())
            await finished(runtime, loop_id)
        async with store_factory() as ui:
            with pytest.raises(LoopStateError, match=f"loop {loop_id} has ended"):
                await inbox(ui).submit_request(loop_id, "cancel", by="alice")
            with pytest.raises(UnknownLoopError, match="holds no loop 'nope'"):
                await inbox(ui).submit_request("nope", "resume", seq=3, by="alice")
            assert await inbox(ui).requests() == []

    async def test_a_request_for_a_loop_this_runtime_ended_is_refused(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """Submitted as the loop ended (the store still held it running): the
        runtime that ended it refuses it, as nobody else will apply it."""
        store = store_factory()
        if type(store).__name__ == "PostgresStore":
            pytest.skip("PostgreSQL's notice wakes the watcher while the loop runs")
        GATE["open"] = anyio.Event()
        provider = ScriptedProvider(
            [calls(call("wait_for_gate", tag="x")), text("done")]
        )
        async with Runtime(
            providers={"scripted": provider}, store=store, requests=3600.0
        ) as runtime:
            loop_id = runtime.run_loop("agent", "go", request_with(wait_for_gate))
            await wait_until(lambda: RAN == ["wait x"])
            async with store_factory() as ui:
                late = await inbox(ui).submit_request(
                    loop_id, "resume", seq=1, by="alice"
                )
                GATE["open"].set()
                await finished(runtime, loop_id)
                runtime.poke_requests()
                refused = await request_is(ui, late.id, "refused")
        assert refused.note == f"loop {loop_id} has ended"


class TestCancel:
    async def test_a_cancel_request_ends_a_running_loop_cancelled(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        GATE["open"] = anyio.Event()  # never set: only the cancel ends the call
        provider = ScriptedProvider([calls(call("wait_for_gate", tag="x"))])
        async with Runtime(
            providers={"scripted": provider}, store=store_factory(), requests=3600.0
        ) as runtime:
            loop_id = runtime.run_loop("agent", "go", request_with(wait_for_gate))
            await wait_until(lambda: RAN == ["wait x"])
            async with store_factory() as ui:
                asked = await inbox(ui).submit_request(
                    loop_id, "cancel", by="alice", reason="taking too long"
                )
                runtime.poke_requests()
                result = await finished(runtime, loop_id)
                applied = await request_is(ui, asked.id, "applied")
                stored = await ui.load(loop_id)
        assert result.outcome is Outcome.cancelled
        assert result.reason == "taking too long"
        assert stored is not None
        assert stored.record.outcome is Outcome.cancelled
        assert (applied.kind, applied.by, applied.seq) == ("cancel", "alice", None)

    async def test_a_cancel_request_ends_a_paused_loop(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        async with Runtime(
            providers={"scripted": two_payments()},
            store=store_factory(),
            requests=3600.0,
        ) as runtime:
            loop_id = runtime.run_loop("agent", "pay", request_with(pay))
            await paused(runtime, loop_id)
            asked = await inbox(own_store(runtime)).submit_request(
                loop_id, "cancel", by="alice", reason="no"
            )
            runtime.poke_requests()
            result = await finished(runtime, loop_id)
            applied = await request_is(own_store(runtime), asked.id, "applied")
        assert (result.outcome, result.reason) == (Outcome.cancelled, "no")
        assert applied.status == "applied"
        assert RAN == []


class TestExactlyOnce:
    async def test_a_commit_refused_for_its_lease_marks_no_request(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        """Only a commit that lands marks a request applied, once: a stale
        lease's marks nothing; a later commit naming it again changes
        nothing; a refusal after it is no change either."""
        record = await a_paused_record(store_factory())
        loop_id = record.loop_id
        async with store_factory() as store:
            assert record.pause is not None
            asked = await inbox(store).submit_request(
                loop_id, "resume", seq=record.pause.seq, by="alice"
            )
            lease = await store.acquire(loop_id, "me")
            stale = Lease("me", lease.epoch - 1)
            with pytest.raises(LeaseLostError):
                await store.commit(commit_of(record, stale, requests=[asked.id]))
            assert (await request_is(store, asked.id, "pending")).resolved_at is None
            await store.commit(commit_of(record, lease, requests=[asked.id]))
            applied = await request_is(store, asked.id, "applied")
            await store.commit(commit_of(record, lease, requests=[asked.id]))
            await inbox(store).refuse_request(asked.id, "too late")
            again = await request_is(store, asked.id, "applied")
            assert again == applied
            assert await inbox(store).pending_requests() == []

    async def test_a_crash_after_the_decision_is_stored_never_applies_it_twice(
        self, shared: tuple[str, str], tmp_path: Path, anyio_backend: str
    ) -> None:
        """The process holding the loop dies right after the commit that
        stores the decision (and marks the request applied) landed, before the
        decision acted. A runtime that recovers the loop goes on with the
        stored decision: the approved call runs once, the request stays
        applied, and no second decision is made."""
        kind, where = shared
        effects = tmp_path / "effects.log"
        child = await start_child(anyio_backend, kind, where, effects, "kill")
        try:
            with anyio.fail_after(60):
                started = json.loads(await read_line(child))
                loop_id, seq = started["loop_id"], started["seq"]
                async with store_of(kind, where) as ui:
                    _, batch = await stored_pause(ui, loop_id)
                    asked = await inbox(ui).submit_request(
                        loop_id,
                        "resume",
                        decision=Rewrite(payload=batch.deny("c2", "not bob")),
                        seq=seq,
                        by="alice",
                    )
                    assert await child.wait() == -9  # SIGKILL, at the commit
                    applied = await request_is(ui, asked.id, "applied")
        finally:
            if child.returncode is None:
                child.kill()
            await child.aclose()
        assert not effects.exists()  # the decision had not acted
        os.environ["SIDE_EFFECTS"] = str(effects)
        try:
            async with Runtime(
                providers={"scripted": ScriptedProvider([text("done")])},
                store=store_of(kind, where),
                tools=[send],
                requests=3600.0,
            ) as taker:
                report = await taker.recover()
                assert report.running == [loop_id]
                result = await finished(taker, loop_id)
                taker.poke_requests()  # a poll after the end: nothing to apply
                store = taker.store
                assert store is not None
                requests = await inbox(store).requests(loop_id)
                decisions = await store.decisions(loop_id)
        finally:
            del os.environ["SIDE_EFFECTS"]
        assert result.outcome is Outcome.answered
        assert [line.split()[:2] for line in effects.read_text().splitlines()] == [
            ["sent", "ada"]
        ]
        assert requests == [applied]
        assert [d.by for d in decisions if d.handler is None] == ["alice"]


class TestStore:
    async def test_requests_are_listed_by_loop_and_status_oldest_first(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        record = await a_paused_record(store_factory())
        other = await a_paused_record(store_factory())
        async with store_factory() as store:
            box = inbox(store)
            assert record.pause is not None
            one = await box.submit_request(
                record.loop_id, "resume", seq=record.pause.seq, by="a"
            )
            two = await box.submit_request(other.loop_id, "cancel", by="b", reason="r")
            three = await box.submit_request(record.loop_id, "cancel", by="c")
            await box.refuse_request(three.id, "changed my mind")
            assert one.id < two.id < three.id
            assert [r.id for r in await box.requests()] == [one.id, two.id, three.id]
            assert [r.id for r in await box.requests(record.loop_id)] == [
                one.id,
                three.id,
            ]
            assert [r.id for r in await box.requests(status="refused")] == [three.id]
            assert [r.id for r in await box.pending_requests()] == [one.id, two.id]
            assert [r.id for r in await box.pending_requests(one.id)] == [two.id]
            (refused,) = await box.requests(record.loop_id, status="refused")
        assert refused.note == "changed my mind"
        assert (two.kind, two.reason, two.decision, two.seq) == (
            "cancel",
            "r",
            None,
            None,
        )
        assert isinstance(one.created_at, datetime)

    async def test_a_decision_is_stored_as_data_and_read_back(
        self, store_factory: Callable[[], LoopStore]
    ) -> None:
        record = await a_paused_record(store_factory())
        assert record.pause is not None
        assert isinstance(record.pause.payload, ToolBatch)
        batch = record.pause.payload.deny("c1", "no\x00 way \ud800")
        async with store_factory() as store:
            box = inbox(store)
            given = await box.submit_request(
                record.loop_id,
                "resume",
                decision=Rewrite(payload=batch),
                seq=record.pause.seq,
                by="al\x00ice \udcff",
            )
            (read,) = await box.requests(record.loop_id)
        assert read == given
        assert read.by == "al\x00ice \\udcff"
        assert read.decision is not None
        assert read.decision.kind == "rewrite"
        assert isinstance(read.decision.payload, ToolBatch)
        assert read.decision.payload.denied == {"c1": "no\x00 way \\ud800"}

    @pytest.mark.parametrize(
        ("arguments", "error", "message"),
        [
            pytest.param(
                {"kind": "pause", "by": "a"}, ValueError, "kind must be", id="kind"
            ),
            pytest.param({"kind": "cancel", "by": ""}, ValueError, "by must", id="by"),
            pytest.param(
                {"kind": "cancel", "by": 5}, TypeError, "by must", id="by-type"
            ),
            pytest.param(
                {"kind": "resume", "by": "a"}, ValueError, "seq=", id="resume-no-seq"
            ),
            pytest.param(
                {"kind": "cancel", "by": "a", "seq": 3},
                ValueError,
                "takes no decision",
                id="cancel-seq",
            ),
            pytest.param(
                {"kind": "resume", "by": "a", "seq": 3, "decision": "yes"},
                TypeError,
                "decision must be",
                id="decision-type",
            ),
            pytest.param(
                {
                    "kind": "resume",
                    "by": "a",
                    "seq": 3,
                    "decision": DecisionRecord(kind="pause", reason="x"),
                },
                ValueError,
                "proceed, rewrite or abort",
                id="decision-pause",
            ),
            pytest.param(
                {"kind": "resume", "by": "a", "seq": 2**63},
                ValueError,
                "and below 2\\*\\*63",
                id="seq-too-large",
            ),
            pytest.param(
                {"kind": "cancel", "by": "a" * 257},
                ValueError,
                "by must be at most 256 characters",
                id="by-too-long",
            ),
            pytest.param(
                {"kind": "cancel", "by": "a", "reason": 404},
                TypeError,
                "reason must be",
                id="reason-type",
            ),
        ],
    )
    async def test_submit_refuses_what_does_not_fit_and_stores_nothing(
        self,
        store_factory: Callable[[], LoopStore],
        arguments: dict[str, Any],
        error: type[Exception],
        message: str,
    ) -> None:
        record = await a_paused_record(store_factory())
        async with store_factory() as store:
            with pytest.raises(error, match=message) as raised:
                await inbox(store).submit_request(record.loop_id, **arguments)
            assert isinstance(raised.value, ConfigurationError)
            assert await inbox(store).requests() == []

    async def test_a_read_only_store_lists_requests_and_takes_none(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "loops.db"
        record = await a_paused_record(SQLiteStore(path))
        async with SQLiteStore(path) as store:
            assert record.pause is not None
            asked = await store.submit_request(
                record.loop_id, "resume", seq=record.pause.seq, by="alice"
            )
        async with SQLiteStore(path, read_only=True) as reader:
            assert await reader.requests() == [asked]
            with pytest.raises(StoreError, match="read_only=True"):
                await reader.submit_request(record.loop_id, "cancel", by="alice")

    async def test_a_sqlite_store_made_before_requests_opens_and_gets_them(
        self, tmp_path: Path
    ) -> None:
        """A file of this layout without the `requests` table: read-only, it
        lists none; opened to write, it gets the table."""
        path = tmp_path / "loops.db"
        record = await a_paused_record(SQLiteStore(path))
        with sqlite3.connect(path) as db:
            db.execute("DROP TABLE requests")
        async with SQLiteStore(path, read_only=True) as reader:
            assert await reader.requests() == []
            assert await reader.load(record.loop_id) is not None
        async with SQLiteStore(path) as store:
            assert record.pause is not None
            asked = await store.submit_request(
                record.loop_id, "resume", seq=record.pause.seq, by="alice"
            )
            assert await store.pending_requests() == [asked]

    async def test_a_postgres_store_made_before_requests_opens_and_gets_them(
        self, postgres_server: Any
    ) -> None:
        from agentfsm.store.postgres import PostgresStore

        psycopg = pytest.importorskip("psycopg")
        conninfo, schema = postgres_server.conninfo(), f"t_{uuid.uuid4().hex}"
        record = await a_paused_record(PostgresStore(conninfo, schema=schema))

        def drop() -> None:
            with psycopg.connect(conninfo, autocommit=True) as conn:
                conn.execute(f'DROP TABLE "{schema}".requests')

        await anyio.to_thread.run_sync(drop)
        async with PostgresStore(conninfo, schema=schema, read_only=True) as reader:
            assert await reader.requests() == []
        async with PostgresStore(conninfo, schema=schema) as store:
            assert record.pause is not None
            asked = await store.submit_request(
                record.loop_id, "resume", seq=record.pause.seq, by="alice"
            )
            assert await store.pending_requests() == [asked]


class TestWatcher:
    async def test_a_request_that_cannot_be_read_is_refused_and_stops_no_other(
        self, tmp_path: Path
    ) -> None:
        """One loop's request row is damaged (bad JSON, as a faulty writer or
        disk leaves it): it is refused with a note naming the cause, and the
        other loop's request is applied as usual."""
        path = tmp_path / "loops.db"

        def pays(request: InferenceInput) -> InferenceOutput:
            items = request.context.items
            if any(isinstance(i, FunctionCallOutputItem) for i in items):
                return text("done")
            (asked,) = [i for i in items if isinstance(i, UserMessage)]
            return calls(call("pay", call_id="c1", to=str(asked.content)))

        async with Runtime(
            providers={"scripted": FunctionProvider(pays)},
            store=SQLiteStore(path),
            requests=3600.0,
        ) as runtime:
            first = runtime.run_loop("agent", "ada", request_with(pay))
            second = runtime.run_loop("agent", "bob", request_with(pay))
            seqs = [await paused(runtime, first), await paused(runtime, second)]
            async with SQLiteStore(path) as ui:
                damaged = await ui.submit_request(first, "resume", seq=seqs[0], by="a")
                with sqlite3.connect(path) as db:
                    db.execute(
                        "UPDATE requests SET asker = '{not json' WHERE id = ?",
                        (damaged.id,),
                    )
                await ui.submit_request(second, "resume", seq=seqs[1], by="bob")
            runtime.poke_requests()
            result = await finished(runtime, second)
            assert runtime.get(first).status is LoopStatus.paused
            with sqlite3.connect(path) as db:
                ((status, note),) = db.execute(
                    "SELECT status, note FROM requests WHERE id = ?", (damaged.id,)
                )
        assert result.outcome is Outcome.answered
        assert RAN == ["pay bob"]
        assert status == "refused"
        assert f"request {damaged.id} cannot be read" in note
        assert "JSONDecodeError" in note

    def test_requests_needs_a_store_that_keeps_them(self) -> None:
        with pytest.raises(ConfigurationError, match="give store= too"):
            Runtime(requests=True)
        with pytest.raises(ConfigurationError, match="NoInbox does not"):
            Runtime(store=NoInbox(), requests=True)
        with pytest.raises(ValueError, match="requests must be True, False or"):
            Runtime(store=MemoryStore(), requests=0)
        with pytest.raises(TypeError, match="requests must be True, False or"):
            Runtime(store=MemoryStore(), requests="yes")  # type: ignore[arg-type]

    async def test_a_failing_poll_is_logged_and_the_next_one_applies(self) -> None:
        store = FlakyStore()
        with structlog.testing.capture_logs() as logs:
            async with Runtime(
                providers={"scripted": two_payments()}, store=store, requests=3600.0
            ) as runtime:
                loop_id = runtime.run_loop("agent", "pay", request_with(pay))
                seq = await paused(runtime, loop_id)
                await store.submit_request(loop_id, "resume", seq=seq, by="alice")
                runtime.poke_requests()
                await wait_until(
                    lambda: any(e["event"] == "requests_poll_failed" for e in logs)
                )
                assert runtime.get(loop_id).status is LoopStatus.paused
                runtime.poke_requests()
                result = await finished(runtime, loop_id)
        assert result.outcome is Outcome.answered
        (failed,) = [e for e in logs if e["event"] == "requests_poll_failed"]
        assert "the store is down" in failed["error"]

    async def test_a_postgres_notice_wakes_the_watcher(
        self, postgres_server: Any
    ) -> None:
        """No poke, a poll an hour away: the store's NOTIFY, heard on the
        watcher's own connection, is what applies the request."""
        from agentfsm.store.postgres import PostgresStore

        conninfo, schema = postgres_server.conninfo(), f"t_{uuid.uuid4().hex}"
        async with Runtime(
            providers={"scripted": two_payments()},
            store=PostgresStore(conninfo, schema=schema),
            requests=3600.0,
        ) as runtime:
            loop_id = runtime.run_loop("agent", "pay", request_with(pay))
            seq = await paused(runtime, loop_id)
            async with PostgresStore(conninfo, schema=schema) as ui:
                await ui.submit_request(loop_id, "resume", seq=seq, by="alice")
                result = await finished(runtime, loop_id)
        assert result.outcome is Outcome.answered


# ------------------------------------------------------------------ helpers


async def a_paused_record(store: LoopStore) -> LoopRecord:
    """The record of a loop paused for approval (of c1, `pay` ada) by a
    runtime that has exited."""
    provider = ScriptedProvider([calls(call("pay", call_id="c1", to="ada"))])
    async with Runtime(providers={"scripted": provider}, store=store) as runtime:
        loop_id = runtime.run_loop("agent", "pay", request_with(pay))
        await paused(runtime, loop_id)
    async with store:
        stored = await store.load(loop_id)
    assert stored is not None
    return stored.record


class NoInbox(LoopStore):
    """A `LoopStore` that keeps no requests (not a `Requests`): a memory
    store's loops, through it."""

    def __init__(self) -> None:
        self.inner = MemoryStore()

    async def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        return await self.inner.commit_many(commits)

    async def load(self, loop_id: str) -> StoredLoop | None:
        return await self.inner.load(loop_id)

    async def record_at(self, loop_id: str, seq: int) -> LoopRecord | None:
        return await self.inner.record_at(loop_id, seq)

    async def unfinished(self) -> list[str]:
        return await self.inner.unfinished()

    async def inference(self, loop_id: str, request: int) -> InferenceOutput | None:
        return await self.inner.inference(loop_id, request)

    async def calls(self, loop_id: str, request: int | None = None) -> list[CallRecord]:
        return await self.inner.calls(loop_id, request)

    async def decisions(self, loop_id: str) -> list[DecisionEntry]:
        return await self.inner.decisions(loop_id)

    async def acquire(
        self, loop_id: str, owner: str, *, replacing: str | None = None
    ) -> Lease:
        return await self.inner.acquire(loop_id, owner, replacing=replacing)

    async def renew(
        self, owner: str, loop_ids: Sequence[str] | None = None
    ) -> dict[str, int]:
        return await self.inner.renew(owner, loop_ids)

    async def release(
        self,
        owner: str,
        loop_ids: Sequence[str] | None = None,
        *,
        epochs: Mapping[str, int] | None = None,
    ) -> None:
        await self.inner.release(owner, loop_ids, epochs=epochs)

    def statistics(self) -> StoreStatistics:
        return self.inner.statistics()


class FlakyStore(MemoryStore):
    """Its first read of pending requests fails."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    async def pending_requests(self, after_id: int = 0) -> list[LoopRequest]:
        if not self.failed:
            self.failed = True
            raise StoreError("the store is down")
        return await super().pending_requests(after_id)


async def start_child(
    backend: str, kind: str, where: str, effects: Path, *more: str
) -> anyio.abc.Process:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.requests_child"]
    return await anyio.open_process(
        [*command, backend, kind, where, str(effects), *more], env=env, cwd=ROOT
    )


async def read_line(process: anyio.abc.Process) -> str:
    """The next line the child prints."""
    assert process.stdout is not None
    line = b""
    while not line.endswith(b"\n"):
        chunk = await process.stdout.receive(1)
        line += chunk
    return line.decode().strip()
