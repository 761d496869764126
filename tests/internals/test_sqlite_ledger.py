"""SQLiteStore's ledger is the fold of its loop's `ledger` column
(`agentfsm.store.sqlite._fold_ledger`): the rules that make it say what a
ledger table did (tests/test_durable.py checks the store's calls through
every store)."""

from __future__ import annotations

import json

import pytest

from agentfsm.messages import FunctionCallOutputItem
from agentfsm.store import CallRecord, StoreError
from agentfsm.store.sqlite import _done_entry, _fold_ledger, _intent_entry

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
    second = CALL.model_copy(update={"attempt": 2})
    text = [
        *rows(_intent_entry(CALL)),
        '[["uncertain","k1"]]',
        *rows(_intent_entry(second, "begun")),
    ]
    assert _fold_ledger("L", text) == {"k1": second}


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
