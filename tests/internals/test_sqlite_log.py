"""What SQLiteStore's log rows hold beyond a record's JSON: the ledger, a fold
of its loop's `ledger` column (`agentfsm.store.sqlite._fold_ledger`), and the
path, each step once (`Paths`). tests/test_durable.py checks the calls and
records read back through every store."""

from __future__ import annotations

import json

import pytest

from agentfsm import Runtime
from agentfsm.messages import FunctionCallOutputItem
from agentfsm.record import LoopRecord
from agentfsm.results import PathStep
from agentfsm.states import LoopState, Trigger
from agentfsm.store import CallRecord, StoreError
from agentfsm.store._rows import PATH_STEPS, Paths, prefix_length, steps_text
from agentfsm.store.sqlite import _done_entry, _fold_ledger, _intent_entry
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


def rows(*entries: str) -> list[str]:
    """One row per entry."""
    return [f"[{entry}]" for entry in entries]


def test_an_intent_then_its_output() -> None:
    ledger = _fold_ledger("L", rows(_intent_entry(CALL), _done_entry("k1", OUT, True)))
    assert ledger == {
        "k1": CALL.model_copy(
            update={"status": "done", "output": OUT, "terminate": True}
        )
    }


def test_a_commit_naming_a_known_call_changes_nothing() -> None:
    """A commit's intent for a key the ledger holds (a recovered loop's commit
    into `function_call`) keeps the entry: a done call stays done."""
    done = rows(_intent_entry(CALL), _done_entry("k1", OUT, False))
    again = CALL.model_copy(update={"call_id": "other", "attempt": 5})
    assert _fold_ledger("L", [*done, *rows(_intent_entry(again))]) == _fold_ledger(
        "L", done
    )


def test_begun_is_a_new_attempt_even_of_a_known_call() -> None:
    """As a ledger table's UPDATE of the status and the attempt: the rest of
    the entry is as the intent wrote it."""
    second = CALL.model_copy(update={"attempt": 2, "call_id": "other"})
    text = [
        *rows(_intent_entry(CALL)),
        '[["uncertain","k1"]]',
        *rows(_intent_entry(second, "begun")),
    ]
    assert _fold_ledger("L", text) == {"k1": CALL.model_copy(update={"attempt": 2})}
    assert _fold_ledger("L", rows(_intent_entry(second, "begun"))) == {"k1": second}


def test_an_output_or_uncertainty_of_an_unknown_call_is_nothing() -> None:
    assert (
        _fold_ledger(
            "L", ['[["uncertain","k9"]]', f"[{_done_entry('k9', OUT, False)}]"]
        )
        == {}
    )


def test_entries_of_one_row_apply_in_order() -> None:
    row = "[" + ",".join([_intent_entry(CALL), '["uncertain","k1"]']) + "]"
    (entry,) = _fold_ledger("L", [row]).values()
    assert entry.status == "uncertain"
    assert json.loads(row)[0][5] == 'c"1'


def test_an_unknown_entry_is_an_error_naming_it() -> None:
    with pytest.raises(StoreError, match=r"unknown ledger entry 'moved' of loop L"):
        _fold_ledger("L", rows(_intent_entry(CALL), '["moved","k1"]'))


START = PathStep(LoopState.idle, Trigger.start, LoopState.context_update)
INFER = PathStep(LoopState.context_update, Trigger.infer, LoopState.inference)
CALL_TOOLS = PathStep(LoopState.inference, Trigger.call_tools, LoopState.function_call)


def test_a_row_holds_the_steps_since_the_last_row_that_landed() -> None:
    paths = Paths()
    assert paths.start("L", (START,)) == 0  # a loop this store has not written
    paths.wrote("L", (START,))
    assert paths.start("L", (START, INFER)) == 1
    assert paths.start("L", (START, INFER)) == 1  # (the row did not land)
    paths.wrote("L", (START, INFER))
    assert paths.start("L", (START, INFER, CALL_TOOLS)) == 2
    assert paths.start("other", (START,)) == 0
    paths.pop("L")
    assert paths.start("L", (START, INFER, CALL_TOOLS)) == 0


def test_a_path_that_is_not_the_one_written_longer_is_written_whole() -> None:
    paths = Paths()
    paths.wrote("L", (START, INFER))
    assert paths.start("L", (START,)) == 0  # shorter: a step was taken back
    # As long, or longer, but not through the step written last.
    assert paths.start("L", (START, CALL_TOOLS)) == 0
    assert paths.start("L", (START, CALL_TOOLS, INFER)) == 0
    # Through the same last step, but not the same path before it.
    assert paths.start("L", (CALL_TOOLS, INFER, START)) == 0
    paths.wrote("L", ())
    assert paths.start("L", (START,)) == 0


async def records_of_a_run() -> list[LoopRecord]:
    """The record at each commit of a loop calling `add` once, then answering."""
    records: list[LoopRecord] = []
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(providers={"scripted": provider}) as runtime:
        runtime._on_commit = lambda loop: records.append(loop.snapshot())
        await runtime.wait(runtime.run_loop("agent", "1+2?", request(add)))
    return records


async def test_rows_of_a_run_and_rows_starting_one() -> None:
    """Each record a row of its own (the PostgreSQL store): the steps since
    the row before; a run's first rows hold the whole path."""
    first, second, third = (await records_of_a_run())[:3]
    paths = Paths()
    paths.wrote("L", first.path)
    rows = paths.rows("L", [second, third], run=True)
    assert [(start, len(json.loads(steps))) for _, start, steps in rows] == [
        (1, 1),
        (2, 1),
    ]
    assert json.loads(rows[0][0])["path"] == 2  # the record: its path's length
    (whole,) = paths.rows("L", [second], run=False)
    assert (whole[1], len(json.loads(whole[2]))) == (0, 2)
    assert paths.start("L", second.path) == 1  # (rows() records nothing)


def test_a_record_carried_with_a_later_one_is_its_path_s_start_or_whole() -> None:
    path = (START, INFER, CALL_TOOLS)
    assert prefix_length(path[:2], path) == 2
    assert prefix_length((), path) == 0
    assert prefix_length((START, CALL_TOOLS), path) is None
    assert prefix_length((INFER, INFER), (START, INFER, CALL_TOOLS)) is None
    assert prefix_length((*path, START), path) is None


def test_ledger_entries_are_the_json_of_their_parts() -> None:
    """`_intent_entry` joins its text by hand: it is `json.dumps`'s."""
    odd = CALL.model_copy(
        update={"key": "k\u00e9\n", "tool": 'to"ol', "request": 12, "attempt": 3}
    )
    for call_ in (CALL, odd):
        for kind in ("intent", "begun"):
            assert _intent_entry(call_, kind) == json.dumps(
                [kind, call_.key, call_.request, call_.position, call_.tool,
                 call_.call_id, call_.attempt],
                ensure_ascii=False,
            )  # fmt: skip
    assert json.loads(_done_entry("k\u00e9", OUT, False))[1] == "k\u00e9"


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
