"""Images stored once, by digest (issue 31): a durable store keeps an image's
bytes once in its `blobs` table however many places refer to it (the context,
the ledger, records, decisions, events: `agentfsm/store/_outline.py`), an event
log keeps them once in a file beside it (`agentfsm/eventlog.py`), and reading
any of them back, replaying or forking gives the same bytes.

The loop of these tests: a user message with an image, then a tool that
returns the same image three times, with a handler that sends one request on a
copy of the context (so a record and a decision hold the image too).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from agentfsm import (
    FunctionCallOutputItem,
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
from agentfsm.eventlog import images_dir, read_events
from agentfsm.events import (
    AgentEvent,
    FunctionCallCompleted,
    LoopStarted,
    LoopTransition,
)
from agentfsm.exceptions import EventLogError, StoreError
from agentfsm.messages import ContextItem, ImageBlock, UserMessage
from agentfsm.providers.function import FunctionProvider
from agentfsm.record import RequestRecord
from agentfsm.replay import fork, replay
from agentfsm.store import LoopStore, MemoryStore, SQLiteStore
from agentfsm.store._outline import Outline, inline, is_large
from agentfsm.testing import call, calls, text
from tests.helpers import wait_until

IMAGE = b"\x89PNG\r\n\x1a\n" + os.urandom(200_000)
BASE64 = base64.b64encode(IMAGE)
CHUNKS = [BASE64[at : at + 32] for at in range(1000, len(BASE64) - 32, 13_000)]
"""Distinctive pieces of the image's base64, spread over it (a piece that
straddles two of a file's pages is not found whole: counted over many)."""
TURNS = 3


@tool
async def look(n: int) -> ImageBlock:
    """Look at the picture again."""
    return ImageBlock.from_bytes(IMAGE)


class Script:
    """The model: `TURNS` calls of `look`, then an answer; it keeps the items
    of each request it was sent."""

    def __init__(self) -> None:
        self.seen: list[list[ContextItem]] = []

    def __call__(self, request: InferenceInput) -> InferenceOutput:
        self.seen.append(list(request.context.items))
        done = sum(isinstance(i, FunctionCallOutputItem) for i in request.context.items)
        if done < TURNS:
            return calls(call("look", call_id=f"c{done + 1}", n=done + 1))
        return text("the same picture")


def copy_context(pending: PendingTransition) -> Rewrite | None:
    """The second request goes out on a copy of the context (its record and
    the decision hold the items, the images with them)."""
    request = pending.payload
    if (
        pending.trigger is Trigger.infer
        and isinstance(request, InferenceInput)
        and len(request.context.items) == 3
    ):
        copy = ModelContext(instructions="look closely", items=request.context.items)
        return Rewrite(payload=request.model_copy(update={"context": copy}))
    return None


def message() -> UserMessage:
    return UserMessage(content=["what changed?", ImageBlock.from_bytes(IMAGE)])


def new_request() -> InferenceInput:
    return InferenceInput(model="f:m", context=ModelContext(), tools=[look])


async def run(
    store: LoopStore | None = None,
    *,
    handlers: list[Any] | None = None,
    event_log: Path | None = None,
    script: Script | None = None,
) -> str:
    """Run the loop to its answer; its id."""
    async with Runtime(
        providers={"f": FunctionProvider(script or Script())},
        store=store,
        event_log=event_log,
    ) as rt:
        loop_id = rt.run_loop(
            "agent",
            message(),
            new_request(),
            [copy_context] if handlers is None else handlers,
        )
        result = await rt.wait(loop_id)
    assert result.outcome is Outcome.answered
    return loop_id


def images_in(value: Any) -> list[ImageBlock]:
    """Every image block in a model (or sequence of them)."""
    if type(value) is ImageBlock:
        return [value]
    if isinstance(value, BaseModel):
        return [i for v in value.__dict__.values() for i in images_in(v)]
    if isinstance(value, tuple | list):
        return [i for v in value for i in images_in(v)]
    return []


async def read_back(store: LoopStore, loop_id: str) -> list[ImageBlock]:
    """Every image the store gives back for the loop (the context, the ledger,
    every record, the decisions, the events), checked to hold the bytes."""
    stored = await store.load(loop_id)
    assert stored is not None
    found = {"items": images_in(stored.items)}
    assert len(found["items"]) == 1 + TURNS
    found["ledger"] = images_in([c.output for c in await store.calls(loop_id)])
    assert len(found["ledger"]) == TURNS
    first = images_in([c.output for c in await store.calls(loop_id, 1)])
    assert len(first) == 1
    records = [await store.record_at(loop_id, n) for n in range(1, stored.record.seq)]
    found["records"] = images_in(records)
    assert any(
        isinstance(r.step.payload, RequestRecord) and r.step.payload.items
        for r in records
        if r is not None and r.step is not None
    )
    found["decisions"] = images_in([d.decision for d in await store.decisions(loop_id)])
    assert found["records"]
    assert found["decisions"]
    events: list[AgentEvent] = await store.events(loop_id)  # type: ignore[attr-defined]
    started = events[0]
    assert isinstance(started, LoopStarted)
    assert started.message is not None
    assert started.message.images[0].data == IMAGE
    completed = [e for e in events if isinstance(e, FunctionCallCompleted)]
    assert [len(e.output.images) for e in completed] == [1] * TURNS
    found["events"] = images_in(events)
    every = [image for images in found.values() for image in images]
    assert all(image.data == IMAGE for image in every), {
        where: [i.digest for i in images if i.data != IMAGE]
        for where, images in found.items()
    }
    return every


def listed(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def on_disk(path: Path) -> bytes:
    """A SQLite file with its write-ahead log."""
    wal = path.with_name(path.name + "-wal")
    return path.read_bytes() + (wal.read_bytes() if wal.exists() else b"")


def assert_once(counts: list[int]) -> None:
    """Each piece of the image found once at most, and nearly all found."""
    assert max(counts) == 1, counts
    assert sum(counts) >= len(counts) - 3, counts


class TestSQLite:
    async def test_an_image_is_written_once_however_many_rows_refer_to_it(
        self, tmp_path: Path
    ) -> None:
        """The image of the message and of three tool outputs, the records and
        decisions that hold the context's copy, the events: its base64 is in
        the file once (a row of `blobs`), and sent once."""
        path = tmp_path / "loops.db"
        store = SQLiteStore(path, events=True)
        loop_id = await run(store)
        assert store.statistics().bytes_written < 2 * len(BASE64)
        assert_once([on_disk(path).count(chunk) for chunk in CHUNKS])
        with sqlite3.connect(path) as db:
            blobs = db.execute("SELECT digest, length(data) FROM blobs").fetchall()
            inline_rows = db.execute(
                "SELECT count(*) FROM log WHERE instr(coalesce(record, '') ||"
                " coalesce(earlier, '') || coalesce(changes, '') ||"
                " coalesce(ledger, '') || coalesce(decisions, '') ||"
                " coalesce(shared, ''), ?) > 0",
                (CHUNKS[0].decode(),),
            ).fetchone()[0]
            inline_events = db.execute(
                "SELECT count(*) FROM events WHERE instr(event, ?) > 0",
                (CHUNKS[0].decode(),),
            ).fetchone()[0]
            referring = db.execute(
                "SELECT count(*) FROM log WHERE instr(changes, ?) > 0",
                (f'"digest":"sha256:{hashlib.sha256(IMAGE).hexdigest()}"',),
            ).fetchone()[0]
        assert blobs == [(hashlib.sha256(BASE64).hexdigest(), len(BASE64))]
        assert (inline_rows, inline_events) == (0, 0)
        assert referring >= 2  # the message's row and the tool outputs' rows
        async with SQLiteStore(path, events=True) as again:
            assert len(await read_back(again, loop_id)) > 2 * TURNS

    async def test_a_damaged_blob_is_an_error_naming_the_loop(
        self, tmp_path: Path
    ) -> None:
        """A blob whose bytes changed (one base64 character) is not read as the
        image: loading the loop fails, naming the loop and the blob."""
        path = tmp_path / "loops.db"
        loop_id = await run(SQLiteStore(path, events=True))
        digest = hashlib.sha256(BASE64).hexdigest()
        damaged = BASE64[:5000] + (b"A" if BASE64[5000:5001] != b"A" else b"B")
        damaged += BASE64[5001:]
        with sqlite3.connect(path) as db:
            db.execute("UPDATE blobs SET data = ? WHERE digest = ?", (damaged, digest))
        async with SQLiteStore(path, events=True) as store:
            with pytest.raises(
                StoreError, match=f"loop {loop_id}.*{digest} is damaged"
            ):
                await store.load(loop_id)
            with pytest.raises(StoreError, match=f"loop {loop_id}"):
                await store.events(loop_id)
            with sqlite3.connect(path) as db:
                db.execute("DELETE FROM blobs")
            with pytest.raises(StoreError, match=f"loop {loop_id}.*no blob {digest}"):
                await store.calls(loop_id, 1)


@tool(needs_approval=True)
async def peek(n: int) -> str:
    """Peek, once a person approves."""
    return f"peeked {n}"


def peek_once(request: InferenceInput) -> InferenceOutput:
    if not any(isinstance(i, FunctionCallOutputItem) for i in request.context.items):
        return calls(call("peek", call_id="p1", n=1))
    return text("seen")


async def test_an_image_steered_into_a_paused_loop_is_stored_once(
    tmp_path: Path,
) -> None:
    """A steering message with an image, queued while the loop waits for an
    approval, is stored with its record by reference; the runtime that
    resumes the loop after the first exited sends it with its bytes."""
    path = tmp_path / "loops.db"
    async with Runtime(
        providers={"f": FunctionProvider(peek_once)}, store=SQLiteStore(path)
    ) as first:
        loop_id = first.run_loop(
            "agent",
            "peek",
            InferenceInput(model="f:m", context=ModelContext(), tools=[peek]),
        )
        await wait_until(lambda: first.get(loop_id).status is LoopStatus.paused)
        first.steer(loop_id, message())
    assert_once([on_disk(path).count(chunk) for chunk in CHUNKS])
    async with SQLiteStore(path) as store:
        stored = await store.load(loop_id)
    assert stored is not None
    assert [m.images[0].data for m in stored.record.steering] == [IMAGE]
    script = Script()
    async with Runtime(
        providers={"f": FunctionProvider(lambda r: (script(r), peek_once(r))[1])},
        store=SQLiteStore(path),
        tools=[peek],
    ) as second:
        assert (await second.recover()).paused == [loop_id]
        second.resume(loop_id, Proceed())
        assert (await second.wait(loop_id)).outcome is Outcome.answered
    assert [i.data for i in images_in(script.seen[-1])] == [IMAGE]
    assert_once([on_disk(path).count(chunk) for chunk in CHUNKS])


async def test_postgres_writes_an_image_once(postgres_server: Any) -> None:
    """On PostgreSQL as on SQLite: one row of `blobs`, no row or event holding
    the base64, sent once, read back whole; a damaged blob fails the read."""
    import psycopg

    from agentfsm.store.postgres import PostgresStore

    conninfo = postgres_server.conninfo()
    schema = f"t_{uuid.uuid4().hex}"
    store = PostgresStore(conninfo, schema=schema, events=True)
    loop_id = await run(store)
    assert store.statistics().bytes_written < 2 * len(BASE64)
    chunk = CHUNKS[0]
    with psycopg.connect(conninfo, autocommit=True) as db:
        blobs = db.execute(
            f"SELECT digest, length(data), position(%s in data) > 0 FROM {schema}.blobs",
            (chunk,),
        ).fetchall()
        (inline_rows,) = db.execute(
            f"SELECT count(*) FROM {schema}.log WHERE position(%s in concat(record,"
            " earlier, changes, ledger, decisions, shared)) > 0",
            (chunk.decode(),),
        ).fetchone() or (None,)
        (inline_events,) = db.execute(
            f"SELECT count(*) FROM {schema}.events WHERE position(%s in event) > 0",
            (chunk.decode(),),
        ).fetchone() or (None,)
    digest = hashlib.sha256(BASE64).hexdigest()
    assert blobs == [(digest, len(BASE64), True)]
    assert (inline_rows, inline_events) == (0, 0)
    async with PostgresStore(conninfo, schema=schema, events=True) as again:
        await read_back(again, loop_id)
        with psycopg.connect(conninfo, autocommit=True) as db:
            db.execute(
                f"UPDATE {schema}.blobs SET data = overlay(data placing '!' from 10)"
            )
        with pytest.raises(StoreError, match=f"loop {loop_id}.*{digest} is damaged"):
            await again.load(loop_id)


async def test_a_memory_store_shares_the_image_it_is_given() -> None:
    """A memory store keeps the models: every place holds the one bytes object
    the tool and the message were built of, none a copy."""
    store = MemoryStore(events=True)
    loop_id = await run(store)
    every = await read_back(store, loop_id)
    assert all(image.data is IMAGE for image in every)


async def test_the_event_log_keeps_an_image_once_beside_it(tmp_path: Path) -> None:
    """The log's lines refer to the image; its bytes are one file of
    `<log>.images/`, and reading the log gives them back."""
    log = tmp_path / "events.jsonl"
    loop_id = await run(event_log=log)
    text_of_log = log.read_bytes()
    assert [text_of_log.count(chunk) for chunk in CHUNKS] == [0] * len(CHUNKS)
    digest = hashlib.sha256(IMAGE).hexdigest()
    # The message in `loop.started`, each output in `function_call.completed`.
    assert text_of_log.count(f'"digest":"sha256:{digest}"'.encode()) == 1 + TURNS
    assert listed(images_dir(log)) == [f"{digest}.png"]
    file = Path(images_dir(log), f"{digest}.png")
    assert file.read_bytes() == IMAGE  # noqa: ASYNC240 - the test's own reads
    assert file.stat().st_mode & 0o777 == 0o600  # noqa: ASYNC240
    events = list(read_events(log))
    assert {e.loop_id for e in events} == {loop_id}
    images = images_in(events)
    assert [image.data == IMAGE for image in images] == [True] * (1 + TURNS)
    # A second run appends to the log and finds the file there.
    await run(event_log=log)
    assert listed(images_dir(log)) == [f"{digest}.png"]
    assert len({e.loop_id for e in read_events(log)}) == 2


async def test_an_event_logs_missing_or_damaged_image_is_named(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    await run(event_log=log)
    digest = hashlib.sha256(IMAGE).hexdigest()
    file = Path(images_dir(log)) / f"{digest}.png"
    file.write_bytes(IMAGE[:-1] + b"!")
    with pytest.raises(
        EventLogError, match=f"line 1: the image sha256:{digest} is damaged"
    ):
        list(read_events(log))
    file.unlink()
    with pytest.raises(
        EventLogError, match=f"sha256:{digest} is missing: no file {file}"
    ):
        list(read_events(log))


class TestReplay:
    @pytest.fixture(params=["sqlite", "log"])
    def source(
        self, request: pytest.FixtureRequest, tmp_path: Path
    ) -> Callable[[], Any]:
        """Where the recording is read from: a SQLite store that keeps events,
        or an event log."""
        self.kind = request.param
        self.path = tmp_path / (
            "loops.db" if request.param == "sqlite" else "events.jsonl"
        )
        if request.param == "sqlite":
            return lambda: SQLiteStore(self.path, events=True)
        return lambda: self.path

    async def record(self, source: Callable[[], Any], script: Script) -> str:
        if self.kind == "sqlite":
            return await run(source(), handlers=[], script=script)
        return await run(event_log=self.path, handlers=[], script=script)

    async def test_a_replay_sends_the_recorded_requests_with_their_images(
        self, source: Callable[[], Any]
    ) -> None:
        """Replayed from what was stored, the requests are the recorded ones:
        the same items, the images' bytes with them."""
        script = Script()
        loop_id = await self.record(source, script)
        given = source()
        if isinstance(given, SQLiteStore):
            async with given:
                report = await replay(given, loop_id=loop_id)
        else:
            report = await replay(given)
        assert not report.diverged, report.describe()
        assert len(report.requests) == len(script.seen) == TURNS + 1
        # (A request's context is the loop's own: it grew after the request.)
        final = report.requests[-1].context.items
        for seen in script.seen:
            assert final[: len(seen)] == seen
        assert [i.data == IMAGE for i in images_in(final)] == [True] * (1 + TURNS)

    async def test_a_fork_sees_the_same_images(self, source: Callable[[], Any]) -> None:
        """A fork from the second request starts on that request's context:
        the message's and the first tool's images (the recorded output's),
        with their bytes."""
        loop_id = await self.record(source, Script())
        second = Script()
        given = source()
        async with Runtime(providers={"f": FunctionProvider(second)}) as rt:
            if isinstance(given, SQLiteStore):
                async with given:
                    at = second_request(await given.events(loop_id))
                    forked = await fork(given, at, loop_id=loop_id, tools=[look])
            else:
                at = second_request(list(read_events(given)))
                forked = await fork(given, at, tools=[look])
            assert (await rt.wait(forked)).outcome is Outcome.answered
        first = second.seen[0]
        assert [type(i).__name__ for i in first] == [
            "UserMessage",
            "FunctionCallItem",
            "FunctionCallOutputItem",
        ]
        assert [i.data for i in images_in(first)] == [IMAGE, IMAGE]
        assert len(images_in(second.seen[-1])) == 1 + TURNS


def second_request(events: list[AgentEvent]) -> int:
    """The seq of a recording's second model request's transition."""
    return [
        e.seq
        for e in events
        if isinstance(e, LoopTransition) and e.trigger is Trigger.infer
    ][1]


def test_an_outlined_image_lookalike_reads_back_as_it_was() -> None:
    """Data shaped like an image block that is not one (a structured answer,
    say: its `data` no base64) goes out of line and reads back unchanged."""
    odd = {
        "type": "image",
        "data": "not base64 at all",
        "digest": "sha256:0",
        "extra": [{"type": "image", "data": None}],
    }
    outline = Outline({})
    written = json.loads(outline.dumps({"answer": odd}))
    assert written["answer"]["data"] == {
        "$blob": hashlib.sha256(b"not base64 at all").hexdigest()
    }
    blobs = {digest: blob for digest, blob, _ in outline.blobs}
    assert inline(written, blobs.__getitem__) == {"answer": odd}
    # Written already in the run: referred to, not listed again.
    again = Outline({}, frozenset(blobs))
    assert json.loads(again.dumps(odd)) == written["answer"]
    assert again.blobs == []


def test_a_commit_carrying_an_image_is_large() -> None:
    image = ImageBlock.from_bytes(IMAGE)
    assert is_large(message())
    assert is_large(FunctionCallOutputItem(call_id="c", output="", images=(image,)))
    assert not is_large(
        UserMessage(content=["hi", ImageBlock.from_url("https://x/y.png")])
    )
    assert not is_large(UserMessage(content="hi"))


CHILD = Path(__file__).with_name("images_crash_child.py")


def child(backend: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(CHILD.parent.parent),
        "AGENTFSM_BACKEND": backend,
    }
    return subprocess.run(
        [sys.executable, str(CHILD), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_loop_killed_mid_tool_recovers_with_the_same_images(
    backend: str, tmp_path: Path
) -> None:
    """SIGKILLed in its second tool call, the loop is recovered by another
    process: it ends answered, its stored context holds the image's very bytes
    (the message's and each output's), its replays (from the store, from the
    log both processes wrote) find no divergence, and the image is one file
    beside the log and one blob in the store."""
    db, log, side = (
        str(tmp_path / name) for name in ("loops.db", "events.jsonl", "side")
    )
    ran = child(backend, "run", db, log, side, "kill")
    assert ran.returncode == -signal.SIGKILL, ran.stderr[-2000:]
    loop_id = ran.stdout.split()[0]
    recovered = child(backend, "recover", db, log, side, loop_id)
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    result = json.loads(recovered.stdout.splitlines()[-1])
    assert (result["outcome"], result["status"]) == ("answered", "done")
    assert Path(side).read_text().splitlines() == [
        "look 1",
        "look 2",
        "look 2",
        "look 3",
    ]
    import random

    image = b"\x89PNG\r\n\x1a\n" + random.Random(31).randbytes(200_000)
    assert result["images"] == [hashlib.sha256(image).hexdigest()] * 4
    assert result["diverged"] == [False, False], result["replayed"]
    assert listed(images_dir(log)) == [f"{hashlib.sha256(image).hexdigest()}.png"]
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM blobs").fetchone() == (1,)
