"""Large values in a durable loop (`agentfsm/store/_outline.py`): a string over
`LARGE` characters is written once, out of line, whatever number of places a
commit carries it in (the context, the model output, the record's answer and
message, events, the ledger), and read back whole everywhere.

(`make bench-durable`'s memory table measures what it saves: a loop whose
answer is 100 MB peaks at a fraction of it over its run, where it peaked at
35 times it when every place held its own copy.)
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from agentfsm import (
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    Outcome,
    Runtime,
    tool,
)
from agentfsm._text import encodable
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import EventArchive, LoopStore, MemoryStore, SQLiteStore
from agentfsm.store._outline import LARGE, Outline, inline
from agentfsm.testing import call, calls, text

BIG = "x" * (LARGE + 1) + "é" * 1000 + "\udcff" + "y" * 5000
"""Over the limit, with characters of two and three UTF-8 bytes and a lone
surrogate (which the loop escapes where the text enters it: `KEPT`)."""
KEPT = encodable(BIG)


@tool
async def fetch(name: str) -> str:
    """Fetch a document."""
    return BIG


def model(request: InferenceInput) -> InferenceOutput:
    if not any(isinstance(i, FunctionCallOutputItem) for i in request.context.items):
        return calls(call("fetch", call_id="c1", name="doc"))
    return text(BIG)


@pytest.fixture(params=["memory", "sqlite", "sqlite-events", "postgres-events"])
def make_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[[], LoopStore]:
    kind: str = request.param
    if kind == "memory":
        memory = MemoryStore(events=True)
        return lambda: memory
    if kind.startswith("postgres"):
        from agentfsm.store.postgres import PostgresStore

        server = request.getfixturevalue("postgres_server")
        schema = f"t_{uuid.uuid4().hex}"
        return lambda: PostgresStore(server.conninfo(), schema=schema, events=True)
    return lambda: SQLiteStore(tmp_path / "loops.db", events=kind.endswith("events"))


async def test_a_large_value_is_read_back_whole_everywhere(
    make_store: Callable[[], LoopStore],
) -> None:
    """A tool's large output and a large answer: the context, every record,
    the model outputs, the ledger and the events read back hold them whole."""
    store = make_store()
    async with Runtime(providers={"f": FunctionProvider(model)}, store=store) as rt:
        loop_id = rt.run_loop(
            "agent",
            "fetch it",
            InferenceInput(model="f:m", context=ModelContext(), tools=[fetch]),
        )
        result = await rt.wait(loop_id)
    assert result.outcome is Outcome.answered
    async with make_store() as store:
        stored = await store.load(loop_id)
        assert stored is not None
        records = [await store.record_at(loop_id, n) for n in range(1, 40)]
        outputs = [await store.inference(loop_id, n) for n in (1, 2)]
        (entry,) = await store.calls(loop_id, 1)
        events = (
            await store.events(loop_id)
            if isinstance(store, EventArchive) and store.keeps_events
            else []
        )
    assert stored.record.answer is not None
    assert stored.record.answer.content == KEPT
    assert [getattr(i, "output", getattr(i, "content", None)) for i in stored.items][
        2:
    ] == [KEPT, KEPT]
    assert entry.output is not None
    assert entry.output.output == KEPT
    assert outputs[1] is not None
    assert outputs[1].message is not None
    assert outputs[1].message.content == KEPT
    assert any(r is not None and r.turn.message is not None for r in records)
    for record in records:
        if record is not None and record.turn.message is not None:
            assert record.turn.message.content == KEPT
    if events:
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        idle = events[-1]
        assert idle.type == "loop.idle"
        assert idle.answer is not None
        assert idle.answer.content == KEPT


async def test_sqlite_writes_a_large_value_once(tmp_path: Path) -> None:
    """Once, however many places carry it: its row of `blobs`; the log and
    the events refer to it."""
    path = tmp_path / "loops.db"
    async with Runtime(
        providers={"f": FunctionProvider(model)}, store=SQLiteStore(path, events=True)
    ) as rt:
        loop_id = rt.run_loop(
            "agent",
            "fetch it",
            InferenceInput(model="f:m", context=ModelContext(), tools=[fetch]),
        )
        assert (await rt.wait(loop_id)).outcome is Outcome.answered
    with sqlite3.connect(path) as db:
        (blobs,) = db.execute("SELECT count(*) FROM blobs").fetchone()
        longest = max(
            len(text or "")
            for row in db.execute("SELECT * FROM log")
            for text in row
            if isinstance(text, str)
        )
        (events,) = db.execute("SELECT max(length(event)) FROM events").fetchone()
    assert blobs == 1  # the tool's output and the answer are the same text
    assert longest < LARGE
    assert events < LARGE


def test_an_outlined_row_takes_no_value_of_its_own_for_a_reference() -> None:
    """A value shaped like a reference (`{"$blob": ...}`, `{"$literal": ...}`)
    reads back as it was, beside real references."""
    import json

    odd = {
        "a": {"$blob": "not a digest"},
        "b": {"$literal": {"x": 1}},
        "c": [{"$blob": BIG}],
        "d": BIG,
    }
    outline = Outline({})
    texts: dict[str, str] = {}
    written = outline.dumps(odd)
    for digest, blob, _ in outline.blobs:
        texts[digest] = blob
    assert len(outline.blobs) == 1
    assert len(written) < LARGE
    assert inline(json.loads(written), texts.__getitem__) == odd
