"""Fork and replay from `agentfsm ui` (issue 29), at the API's level: a fork
request in the decision inbox (`kind="fork"`), applied once by a watching
runtime that has the loop's tools; a fork's page beside its source's; a
replay's first divergence (the browser tests are in
tests/test_ui_fork_browser.py).

SQLite and PostgreSQL (tests/postgres_server.py) where the store matters;
asyncio and trio. The "UI" stores requests through a store object of its
own on the same data.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

from agentfsm import (
    InferenceInput,
    LoopStatus,
    ModelContext,
    Outcome,
    PendingTransition,
    Proceed,
    Rewrite,
    Runtime,
    ToolBatch,
    tool,
)
from agentfsm._arguments import ArgumentValueError
from agentfsm.events import LoopStarted
from agentfsm.exceptions import ConfigurationError, LoopStateError
from agentfsm.replay import _prepare_fork, fork
from agentfsm.replay.inbox import apply_fork, fork_id
from agentfsm.store import LoopRequest, MemoryStore, SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.ui import app

TOKEN = "fork-token-0123456789abc"
AUTH = {"authorization": f"Bearer {TOKEN}"}

RUNS: list[tuple[int, int]] = []

Stores = Callable[[], Any]
"""A new store object on the same data at each call (typed loosely: the
tests call the `Requests` and `EventArchive` halves of a `LoopStore`)."""


@tool
def add(a: int, b: int) -> str:
    """Add two numbers (each run is counted in RUNS)."""
    RUNS.append((a, b))
    return str(a + b)


@pytest.fixture(autouse=True)
def _clean() -> None:
    RUNS.clear()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Stores:
    """A new store object on the same data (keeping events) at each call (the
    memory store's one object is the data)."""
    if request.param == "memory":
        memory = MemoryStore(events=True)
        return lambda: memory
    return sql_stores_of(request, tmp_path)


@pytest.fixture(params=["sqlite", "postgres"])
def sql_stores(request: pytest.FixtureRequest, tmp_path: Path) -> Stores:
    """As `stores`, the stores the UI reads."""
    return sql_stores_of(request, tmp_path)


def sql_stores_of(request: pytest.FixtureRequest, tmp_path: Path) -> Stores:
    if request.param == "postgres":
        from agentfsm.store.postgres import PostgresStore

        server = request.getfixturevalue("postgres_server")
        schema = f"t_{uuid.uuid4().hex}"
        return lambda: PostgresStore(server.conninfo(), schema=schema, events=True)
    return lambda: SQLiteStore(tmp_path / "loops.db", events=True)


def recorded_script() -> ScriptedProvider:
    """Asks for add(1, 2), then answers."""
    return ScriptedProvider([calls(call("add", call_id="c1", a=1, b=2)), text("3")])


def forked_script() -> ScriptedProvider:
    """What the fork's model says: add(5, 5), then an answer."""
    return ScriptedProvider([calls(call("add", call_id="f1", a=5, b=5)), text("10")])


def request_of(model: str = "scripted:m") -> InferenceInput:
    return InferenceInput(model=model, context=ModelContext(), tools=[add])


async def recorded_loop(stores: Stores, *, handler: Any = None) -> str:
    """A loop run to its end in a runtime of its own: its id."""
    async with Runtime(
        providers={"scripted": recorded_script()}, store=stores()
    ) as runtime:
        loop_id = runtime.run_loop("adder", "add 1 and 2", request_of(), handler)
        result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.answered
    return loop_id


async def request_status(stores: Stores, request_id: int, status: str) -> LoopRequest:
    """The request once the store says it is `status` (the runtime writes in
    the background; a hang guard of 30 s)."""
    async with stores() as store:
        with anyio.fail_after(30):
            while True:
                found: LoopRequest
                (found,) = [r for r in await store.requests() if r.id == request_id]
                if found.status == status:
                    return found
                await anyio.sleep(0.02)  # a write in the store's thread


async def infer_seqs(stores: Stores, loop_id: str) -> list[int]:
    async with stores() as store:
        events = await store.events(loop_id)
    return [
        e.seq for e in events if e.type == "loop.transition" and e.trigger == "infer"
    ]


# ------------------------------------------------------------- the store


async def test_a_fork_request_is_stored_with_its_model_even_for_an_ended_loop(
    stores: Stores,
) -> None:
    """An ended loop takes a fork (not a resume or a cancel); the model is
    kept and read back; a fork's fields are checked, each named."""
    loop_id = await recorded_loop(stores)
    async with stores() as store:
        asked = await store.submit_request(
            loop_id, "fork", seq=3, model="scripted:other", by="alice"
        )
        assert (asked.kind, asked.seq, asked.model, asked.status) == (
            "fork",
            3,
            "scripted:other",
            "pending",
        )
        plain = await store.submit_request(loop_id, "fork", seq=0, by="bob")
        assert plain.model is None
        assert [
            (r.kind, r.model, r.decision) for r in await store.requests(loop_id)
        ] == [
            ("fork", "scripted:other", None),
            ("fork", None, None),
        ]
        with pytest.raises(LoopStateError):
            await store.submit_request(loop_id, "cancel", by="alice")
        for wrong, named in (
            ({"seq": None}, "seq"),
            ({"seq": -1}, "seq"),
            ({"seq": 3, "model": " "}, "model"),
            ({"seq": 3, "decision": Proceed()}, "decision"),
        ):
            with pytest.raises(ArgumentValueError, match=named):
                await store.submit_request(loop_id, "fork", by="alice", **wrong)
        with pytest.raises(
            ArgumentValueError, match="only a fork request takes a model"
        ):
            await store.submit_request(
                loop_id, "resume", seq=3, by="alice", model="scripted:other"
            )


# ------------------------------------------------------------ the runtime


async def test_a_watching_runtime_with_the_tools_runs_the_fork_once(
    stores: Stores,
) -> None:
    """The fork starts at the model request asked, with the model asked, its
    id derived from the request; its first commit marks the request applied;
    a second runtime that read the request pending before that and applies
    it too is refused by the store (its loop fails; no tool runs again)."""
    loop_id = await recorded_loop(stores)
    seqs = await infer_seqs(stores, loop_id)
    assert len(seqs) == 2
    assert RUNS == [(1, 2)]
    async with stores() as ui:
        asked = await ui.submit_request(
            loop_id, "fork", seq=seqs[0], model="scripted:other", by="alice"
        )
    new_id = fork_id(asked.id, loop_id)
    other = forked_script()
    async with Runtime(
        providers={"scripted": other}, store=stores(), tools=[add], requests=3600.0
    ) as runtime:
        runtime.poke_requests()
        await started(runtime, new_id)
        result = await runtime.wait(new_id)
    assert result.outcome is Outcome.answered
    assert result.answer is not None
    assert result.answer.content == "10"
    assert [r.model for r in other.requests] == ["scripted:other", "scripted:other"]
    assert RUNS == [(1, 2), (5, 5)]
    applied = await request_status(stores, asked.id, "applied")
    assert applied.resolved_at is not None
    async with stores() as store:
        events = await store.events(new_id)
        first = events[0]
        assert isinstance(first, LoopStarted)
        assert first.forked_from is not None
        assert (first.forked_from.loop_id, first.forked_from.seq) == (loop_id, seqs[0])
        stored = await store.load(new_id)
        assert stored is not None
        assert stored.record.status is LoopStatus.done
    # A second runtime applying the request as read pending before that: the
    # store holds the fork's loop, so it starts nothing.
    late = forked_script()
    async with Runtime(
        providers={"scripted": late}, store=stores(), tools=[add]
    ) as second:
        assert second._keeper is not None
        assert second.store is not None
        assert await apply_fork(second, second._keeper, second.store, asked) is None
        assert second.loops() == []
        # Had it raced the first to the store (both past that look), its loop
        # of the same id is refused at its first commit, before any tool runs.
        source: Any = second.store  # (a store that keeps events: a ReplaySource)
        prepared = await _prepare_fork(source, seqs[0], loop_id=loop_id, tools=[add])
        prepared.start(second, new_id)
        failed = await second.wait(new_id)
    assert failed.outcome is Outcome.failed
    assert failed.error is not None
    assert "LoopIdTakenError" in failed.error.type
    assert RUNS == [(1, 2), (5, 5)]
    async with stores() as store:
        kept = await store.load(new_id)
        assert kept is not None
        assert kept.record.outcome is Outcome.answered


async def started(runtime: Runtime, loop_id: str) -> None:
    """Once the runtime has the loop (its watcher replays the recording
    first; a hang guard of 30 s)."""
    with anyio.fail_after(30):
        while True:
            if loop_id in runtime.loops() or loop_id in runtime.loops(
                status=LoopStatus.done
            ):
                return
            await anyio.sleep(0.01)


async def test_two_watching_runtimes_never_both_run_a_fork(
    stores: Stores,
) -> None:
    """Both runtimes watch the store and are poked at once: the fork's tool
    runs once, one loop of the fork's id is stored, the request is applied."""
    loop_id = await recorded_loop(stores)
    seqs = await infer_seqs(stores, loop_id)
    async with stores() as ui:
        asked = await ui.submit_request(loop_id, "fork", seq=seqs[0], by="alice")
    new_id = fork_id(asked.id, loop_id)
    providers = [forked_script(), forked_script()]
    async with (
        Runtime(
            providers={"scripted": providers[0]},
            store=stores(),
            tools=[add],
            requests=0.05,
        ),
        Runtime(
            providers={"scripted": providers[1]},
            store=stores(),
            tools=[add],
            requests=0.05,
        ),
    ):
        await request_status(stores, asked.id, "applied")
        async with stores() as store:
            with anyio.fail_after(30):
                while True:
                    stored = await store.load(new_id)
                    if stored is not None and stored.record.status is LoopStatus.done:
                        break
                    await anyio.sleep(0.02)  # the fork runs in the background
    assert RUNS == [(1, 2), (5, 5)]
    # A runtime that lost the race asked no model either: a named loop's
    # first commit lands before its first model request.
    assert sum(len(p.requests) for p in providers) == 2
    async with stores() as store:
        forks = [s.loop_id for s in await store.loops() if s.loop_id != loop_id]
    assert forks == [new_id]


async def test_a_runtime_without_the_tools_leaves_the_fork_pending(
    stores: Stores,
) -> None:
    """A runtime lacking the recording's tool leaves the request pending (an
    other may have it); one with it applies it."""
    loop_id = await recorded_loop(stores)
    async with stores() as ui:
        asked = await ui.submit_request(loop_id, "fork", seq=0, by="alice")
    async with Runtime(
        providers={"scripted": forked_script()}, store=stores(), requests=3600.0
    ) as toolless:
        assert toolless._watcher is not None
        await toolless._watcher.poll()
        await toolless._watcher.poll()
        assert toolless.loops() == []
    still = await request_status(stores, asked.id, "pending")
    assert still.note is None
    async with Runtime(
        providers={"scripted": forked_script()},
        store=stores(),
        tools=[add],
        requests=3600.0,
    ) as runtime:
        assert runtime._watcher is not None
        await runtime._watcher.poll()
        result = await runtime.wait(fork_id(asked.id, loop_id))
    assert result.outcome is Outcome.answered
    await request_status(stores, asked.id, "applied")


async def test_a_fork_with_no_model_request_after_its_seq_is_refused(
    stores: Stores,
) -> None:
    """A fork that can never work is refused, its note saying why."""
    loop_id = await recorded_loop(stores)
    async with stores() as ui:
        asked = await ui.submit_request(loop_id, "fork", seq=10_000, by="alice")
    async with Runtime(
        providers={"scripted": forked_script()},
        store=stores(),
        tools=[add],
        requests=3600.0,
    ) as runtime:
        assert runtime._watcher is not None
        await runtime._watcher.poll()
        assert runtime.loops() == []
    refused = await request_status(stores, asked.id, "refused")
    assert refused.note is not None
    assert "no model request at or after seq 10000" in refused.note


async def test_fork_takes_the_new_loops_id(tmp_path: Path) -> None:
    """`fork(new_loop_id=)` names the loop; a runtime's own id is refused."""
    async with Runtime(providers={"scripted": recorded_script()}) as runtime:
        with runtime.bus.subscribe() as events:
            loop_id = runtime.run_loop("adder", "add", request_of())
            await runtime.wait(loop_id)
            recorded = []
            while events.statistics().buffered:
                recorded.append(events.receive_nowait())
    async with Runtime(providers={"scripted": forked_script()}) as runtime:
        made = await fork(recorded, 0, tools=[add], runtime=runtime, new_loop_id="f-1")
        assert made == "f-1"
        assert (await runtime.wait("f-1")).outcome is Outcome.answered
        with pytest.raises(ConfigurationError, match="runtime already has"):
            await fork(recorded, 0, tools=[add], runtime=runtime, new_loop_id="f-1")


# ------------------------------------------------------------------ the UI


@contextlib.asynccontextmanager
async def mounted(
    runtime: Runtime,
) -> AsyncIterator[tuple[httpx2.AsyncClient, dict[str, str]]]:
    ui = app(runtime, token=TOKEN, user="alice")
    async with ui.router.lifespan_context(ui):
        transport = httpx2.ASGITransport(app=ui)
        async with httpx2.AsyncClient(
            transport=transport, base_url="http://127.0.0.1"
        ) as http:
            yield http, {**AUTH, "x-agentfsm-form": ui.state.form_token}


@contextlib.asynccontextmanager
async def standalone(
    db: Path,
) -> AsyncIterator[tuple[httpx2.AsyncClient, dict[str, str]]]:
    ui = app(SQLiteStore(db, events=True), token=TOKEN, user="alice")
    async with ui.router.lifespan_context(ui):
        transport = httpx2.ASGITransport(app=ui)
        async with httpx2.AsyncClient(
            transport=transport, base_url="http://127.0.0.1"
        ) as http:
            yield http, {**AUTH, "x-agentfsm-form": ui.state.form_token}


async def test_a_fork_asked_from_the_page_is_drawn_beside_its_source(
    sql_stores: Stores,
) -> None:
    """The page offers the loop's model requests to fork at; a fork asked
    there (another model) is run by the runtime the app is mounted beside;
    the fork's page names its source and draws the source's path; the
    source's page lists the fork with its loop."""
    loop_id = await recorded_loop(sql_stores)
    other = forked_script()
    async with (
        Runtime(
            providers={"scripted": other},
            store=sql_stores(),
            tools=[add],
            requests=3600.0,
        ) as runtime,
        mounted(runtime) as (http, form),
    ):
        page = (await http.get(f"/api/loops/{loop_id}", headers=AUTH)).json()
        points = page["fork"]["points"]
        assert points == await infer_seqs(sql_stores, loop_id)
        assert page["fork"]["from"] is None
        assert page["fork"]["enabled"] is True
        bad = await http.post(
            f"/api/loops/{loop_id}/requests",
            json={"kind": "fork", "seq": points[-1] + 1},
            headers=form,
        )
        assert bad.status_code == 400
        assert bad.json()["field"] == "seq"
        assert "no model request at or after" in bad.json()["error"]
        asked = await http.post(
            f"/api/loops/{loop_id}/requests",
            json={"kind": "fork", "seq": points[1], "model": "scripted:other"},
            headers=form,
        )
        assert asked.status_code == 202, asked.text
        request_id = asked.json()["id"]
        new_id = fork_id(request_id, loop_id)
        await started(runtime, new_id)
        result = await runtime.wait(new_id)
        assert result.answer is not None
        assert result.answer.content == "10"
        assert [r.model for r in other.requests] == ["scripted:other"] * 2
        await request_status(sql_stores, request_id, "applied")
        forked = (await http.get(f"/api/loops/{new_id}", headers=AUTH)).json()
        origin = forked["fork"]["from"]
        assert (origin["loop_id"], origin["seq"]) == (loop_id, points[1])
        assert origin["graph"]["rows"] == forked["graph"]["rows"]
        assert any(e["kind"] == "taken" for e in origin["graph"]["edges"])
        source = (await http.get(f"/api/loops/{loop_id}", headers=AUTH)).json()
        assert [
            (f["request"], f["status"], f["loop_id"], f["model"])
            for f in source["fork"]["forks"]
        ] == [(request_id, "applied", new_id, "scripted:other")]
    assert RUNS == [(1, 2), (5, 5)]


def deny_first_call(pending: PendingTransition) -> Rewrite | None:
    """Deny the first batch's call (what the replay needs to bind again)."""
    batch = pending.payload
    if isinstance(batch, ToolBatch) and pending.model_requests == 1:
        return Rewrite(payload=batch.deny(batch.calls[0].call_id, "not today"))
    return None


async def test_a_clean_loop_replays_with_no_divergence(tmp_path: Path) -> None:
    """The standalone UI replays an ended loop from its recording: no
    divergence; a running loop is not replayed."""
    db = tmp_path / "loops.db"
    loop_id = await recorded_loop(lambda: SQLiteStore(db, events=True))
    async with standalone(db) as (http, form):
        answer = await http.post(f"/api/loops/{loop_id}/replay", headers=form)
        assert answer.status_code == 200, answer.text
        found = answer.json()
        assert found["diverged"] is False, found
        assert found["handlers"] == "none"
        assert "no divergence" in found["text"]
        assert found["divergence"] is None
        assert found["outcome"] == "answered"
        got = await http.get(f"/api/loops/{loop_id}/replay", headers=AUTH)
        assert got.status_code == 405
        unknown = await http.post("/api/loops/nope/replay", headers=form)
        assert unknown.status_code == 404
    assert RUNS == [(1, 2)]  # the replay ran no tool


async def test_an_altered_recording_shows_its_first_divergence(tmp_path: Path) -> None:
    """A recording whose answer was changed in the store replays to the
    model's real answer: the divergence names the seq and the field."""
    db = tmp_path / "loops.db"
    loop_id = await recorded_loop(lambda: SQLiteStore(db, events=True))
    seq = alter_answer(db, loop_id, "4")
    async with standalone(db) as (http, form):
        found = (await http.post(f"/api/loops/{loop_id}/replay", headers=form)).json()
    assert found["diverged"] is True, found
    assert found["divergence"]["seq"] == seq
    assert f"diverged at seq {seq}" in found["text"]
    (difference,) = found["divergence"]["differences"]
    assert (difference["expected"], difference["actual"]) == ("4", "3")


def alter_answer(db: Path, loop_id: str, answer: str) -> int:
    """Change the stored `model.answer` event's text: its seq."""
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        rows = conn.execute(
            "SELECT seq, event FROM events WHERE loop_id = ?", (loop_id,)
        ).fetchall()
        for seq, data in rows:
            event = json.loads(data)
            if event["type"] == "model.answer":
                event["message"]["content"] = answer
                conn.execute(
                    "UPDATE events SET event = ? WHERE loop_id = ? AND seq = ?",
                    (json.dumps(event), loop_id, seq),
                )
                return int(seq)
    raise AssertionError("no model.answer event")


async def test_mounted_replays_with_the_runtimes_handlers(tmp_path: Path) -> None:
    """A loop a handler rewrote replays clean beside the runtime that knows
    the handler, and diverges in the standalone UI (no handlers)."""
    db = tmp_path / "loops.db"
    async with Runtime(
        providers={"scripted": recorded_script()},
        store=SQLiteStore(db, events=True),
        handlers=[deny_first_call],
    ) as runtime:
        loop_id = runtime.run_loop("adder", "add", request_of(), deny_first_call)
        await runtime.wait(loop_id)
        async with mounted(runtime) as (http, form):
            with anyio.fail_after(30):
                while True:
                    assert runtime.store is not None
                    stored = await runtime.store.load(loop_id)
                    if stored is not None and stored.record.status is LoopStatus.done:
                        break
                    await anyio.sleep(0.01)  # its end is written in the background
            found = (
                await http.post(f"/api/loops/{loop_id}/replay", headers=form)
            ).json()
    assert found["handlers"] == "the runtime's"
    assert found["diverged"] is False, found
    async with standalone(db) as (http, form):
        alone = (await http.post(f"/api/loops/{loop_id}/replay", headers=form)).json()
    assert alone["handlers"] == "none"
    assert alone["diverged"] is True, alone
    assert RUNS == []  # denied when recorded; never run by a replay
