"""What the SQL stores' log rows hold beyond a record's JSON: the ledger, a fold
of its loop's `ledger` column (`agentfsm.store._sql.fold_ledger`), and the
path, each step once, as the commits carry it. tests/test_durable.py checks
the calls and records read back through every store."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from agentfsm.messages import FunctionCallOutputItem
from agentfsm.results import PathStep
from agentfsm.states import LoopState, Trigger
from agentfsm.store import CallRecord, SQLiteStore, StoreError
from agentfsm.store._rows import PATH_STEPS, steps_text
from agentfsm.store._sql import fold_ledger, ledger_entry
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import add, request

CALL = CallRecord(
    key="k1",
    loop_id="L",
    request=1,
    position=0,
    tool="lookup",
    call_id='c"1',  # JSON-escaped in the entry
    status="started",
)
OUT = FunctionCallOutputItem(call_id='c"1', output="v")
DONE = CALL.model_copy(update={"status": "done", "output": OUT, "terminate": True})


def rows(*entries: CallRecord) -> list[object]:
    """One row per entry, as the store reads it back (JSON data)."""
    return [json.loads(f"[{ledger_entry(entry)}]") for entry in entries]


def test_a_key_holds_its_last_entry() -> None:
    ledger = fold_ledger("L", rows(CALL, DONE))
    assert ledger.calls == {"k1": DONE}
    again = CALL.model_copy(update={"attempt": 2})
    assert fold_ledger("L", rows(CALL, again)).calls == {"k1": again}


def test_entries_of_one_row_apply_in_order() -> None:
    uncertain = CALL.model_copy(update={"status": "uncertain"})
    row = "[" + ",".join([ledger_entry(CALL), ledger_entry(uncertain)]) + "]"
    (entry,) = fold_ledger("L", [json.loads(row)]).calls.values()
    assert entry == uncertain
    assert json.loads(row)[0][5] == 'c"1'


def test_calls_of_one_request_by_position() -> None:
    later = CALL.model_copy(update={"key": "k2", "request": 2})
    first = CALL.model_copy(update={"key": "k0", "position": 1})
    ledger = fold_ledger("L", rows(later, first, CALL))
    assert ledger.of(1) == [CALL, first]
    assert ledger.of(2) == [later]
    assert ledger.of(None) == [CALL, first, later]


def test_ledger_entries_are_the_json_of_their_parts() -> None:
    """`ledger_entry` joins its text by hand: it is the JSON of its parts."""
    odd = DONE.model_copy(
        update={
            "key": "k\u00e9\n",
            "tool": 'to"ol',
            "request": 12,
            "attempt": 3,
            "by": "al\u00efce",
        }
    )
    for entry in (CALL, DONE, odd):
        assert json.loads(ledger_entry(entry)) == [
            entry.status,
            entry.key,
            entry.request,
            entry.position,
            entry.tool,
            entry.call_id,
            entry.attempt,
            None if entry.output is None else entry.output.model_dump(mode="json"),
            entry.terminate,
            entry.by,
        ]
        assert r"\u00e9" not in ledger_entry(entry)  # non-ASCII as it is


def test_path_steps_text_is_their_json() -> None:
    """`steps_text` makes each step's JSON once: the same as the adapter's."""
    steps = (
        PathStep(LoopState.idle, Trigger.start, LoopState.context_update),
        PathStep(LoopState.inference, Trigger.call_tools, LoopState.function_call),
        PathStep(
            LoopState.inference,
            Trigger.call_tools,
            LoopState.idle,
            rewritten_from=LoopState.function_call,
        ),
    )
    for some in ((), steps[:1], steps, steps + steps):
        assert steps_text(some) == PATH_STEPS.dump_json(some).decode()


async def test_a_commit_carries_the_steps_since_the_last_one(tmp_path: Path) -> None:
    """Each row holds its record's path as a length, and the steps taken since
    the row before (the first row: the whole path): a commit's cost does not
    grow with the path."""
    from agentfsm import Runtime

    path = tmp_path / "loops.db"
    provider = ScriptedProvider(
        [calls(call("add", a=1, b=2)), calls(call("add", a=3, b=4)), text("3")]
    )
    async with Runtime(providers={"scripted": provider}, store=SQLiteStore(path)) as rt:
        result = await rt.wait(rt.run_loop("agent", "1+2?", request(add)))
    with sqlite3.connect(path) as db:
        rows_ = db.execute(
            "SELECT path_from, path, record FROM log WHERE record NOT NULL ORDER BY id"
        ).fetchall()
    lengths = [json.loads(record)["path"] for _, _, record in rows_]
    starts = [start for start, _, _ in rows_]
    assert starts[0] == 0
    assert starts[1:] == lengths[:-1]  # each from where the one before ended
    steps: list[object] = []
    for start, text_, _ in rows_:
        del steps[start:]
        steps.extend(json.loads(text_))
    assert len(steps) == lengths[-1] == len(result.path)
    assert max(len(json.loads(t)) for _, t, _ in rows_[1:]) <= 3


async def test_a_damaged_ledger_row_is_named(tmp_path: Path) -> None:
    path = tmp_path / "loops.db"
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    from agentfsm import Runtime

    async with Runtime(providers={"scripted": provider}, store=SQLiteStore(path)) as rt:
        loop_id = rt.run_loop("agent", "1+2?", request(add))
        await rt.wait(loop_id)
    with sqlite3.connect(path) as db:
        db.execute("UPDATE log SET ledger = '[[\"started\"' WHERE ledger NOT NULL")
    async with SQLiteStore(path) as store:
        with pytest.raises(StoreError, match=rf"{loop_id} cannot be read"):
            await store.calls(loop_id, 1)


async def test_a_model_output_is_serialized_once_a_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit's record (`turn.output`) and its `changes` (`inference`) hold
    the same model output: its JSON is made once, and both read back whole."""
    from agentfsm import Runtime
    from agentfsm._models import json_of
    from agentfsm.inference import InferenceOutput

    serialized: list[int] = []

    def counting(model: object, **options: object) -> str:
        if isinstance(model, InferenceOutput):
            serialized.append(id(model))
        return json_of(model, **options)  # type: ignore[arg-type]

    monkeypatch.setattr("agentfsm.store._rows.json_of", counting)
    monkeypatch.setattr("agentfsm.store._sql.json_of", counting)
    path = tmp_path / "loops.db"
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    store = SQLiteStore(path)
    async with Runtime(providers={"scripted": provider}, store=store) as rt:
        loop_id = rt.run_loop("agent", "1+2?", request(add))
        result = await rt.wait(loop_id)
        outputs = [await store.inference(loop_id, n) for n in (1, 2)]
    assert result.model_requests == 2
    assert len(serialized) == len(set(serialized)) == 2  # each output once
    with sqlite3.connect(path) as db:
        found = db.execute(
            "SELECT record, earlier, changes FROM log WHERE request NOT NULL"
            " ORDER BY id"
        ).fetchall()
    assert len(found) == 2
    for (record, earlier, changes), output in zip(found, outputs, strict=True):
        assert output is not None
        stored = json.loads(changes)["inference"][1]
        assert stored == output.model_dump(mode="json")
        # (the answer's: in the record of its transition into model_message)
        records = [json.loads(record), *json.loads(earlier or "[]")]
        assert stored in [r["turn"].get("output") for r in records]
