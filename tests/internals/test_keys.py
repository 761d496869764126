"""A tool call's idempotency key stays what it was: stores keep ledger entries
by it across processes and versions, and tools hand it to APIs that
deduplicate by it. These are the keys agentfsm derived when the stores first
kept them; a change to `_keys` that changes one breaks every loop in flight."""

from __future__ import annotations

import enum
import hashlib
import json

import pytest

from agentfsm._keys import canonical_arguments, idempotency_key


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (
            ("01a2323a-07b9-7000-887f-063430624d48", 1, 0, "add", '{"b": 2, "a": 1}'),
            "e287d67f3b888351dda26754a7dd73b65871700654f401fafe70564ab551768c",
        ),
        (
            ("L", 2, 3, "look_up", '{"q": "clé \\"x\\"", "n": [1, 2.5, null, true]}'),
            "18e2d774400cfa2b314fe5f24f3d91e237c37c3ce0b70b384a7e5b2d63eb2325",
        ),
        (
            ("L", 1, 0, "add", "not json"),
            "e8d82abe9afbdd7a6de13c53af65dd6004b155a1cc0ba2653193875b20b5391f",
        ),
    ],
)
def test_a_key_is_the_one_derived_before(
    args: tuple[str, int, int, str, str], key: str
) -> None:
    assert idempotency_key(*args) == key


def test_the_key_is_the_digest_of_the_call_as_canonical_json() -> None:
    text = '["L",2,3,"look_up","{\\"n\\":[1,2.5,null,true],\\"q\\":\\"clé \\\\\\"x\\\\\\"\\"}"]'
    arguments = '{"q": "clé \\"x\\"", "n": [1, 2.5, null, true]}'
    assert canonical_arguments(arguments) == '{"n":[1,2.5,null,true],"q":"clé \\"x\\""}'
    assert idempotency_key("L", 2, 3, "look_up", arguments) == (
        hashlib.sha256(text.encode()).hexdigest()
    )


class Level(enum.IntEnum):
    ONE = 1


@pytest.mark.parametrize(
    "args",
    [
        ("L", True, False, "add", "{}"),
        ("L", Level.ONE, 2**70, "add", "{}"),
        ("l\u2028\x00é\U0001f600", 1, 0, 'we"ird\\name', '{"é": "\\u0000\\n"}'),
        ("L", 1, 0, "add", '{"b": 1e400, "a": -0.0}'),
    ],
)
def test_a_key_is_the_digest_of_json_dumps_of_the_call(
    args: tuple[str, int, int, str, str],
) -> None:
    """The text hashed is `json.dumps` of the call as the first keys made it,
    for any value a caller may pass."""
    loop_id, request, position, name, arguments = args
    text = json.dumps(
        [loop_id, request, position, name, canonical_arguments(arguments)],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    assert idempotency_key(*args) == hashlib.sha256(text.encode()).hexdigest()
