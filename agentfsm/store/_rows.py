"""A loop's records as the SQL stores keep them.

A loop's rows come in *runs*: the rows one lease wrote (one epoch: nobody else
writes the loop meanwhile, see `_base.Lease`), from its first commit with a
record to its last. A row holds only what changed within its run:

- what every record of the run shares (`SHARED`: the loop's ids, start, input
  request, options and handlers, which are fixed for as long as one process
  runs the loop) is in the run's first row only (`shared_text`); a later run
  writes it again (a recovery may rebind a handler under another name);
- each path step is in the row of the commit that took it: a commit carries
  the steps since the last one of its run (`Commit.steps`, from `path_from`
  on; the whole path in the run's first), and a record its path's length
  (`record_text`): neither a commit nor its record copies the whole path, so
  a commit costs the same however long the loop has run;
- the rest of a record is its own: the input's instructions included (the
  loop's context holds them, and a handler or `Agent.request` may change them).

`record_of` makes a record whole again from its text, the latest shared text at
or before its row, and the path its loop's rows make up to its row (`path_of`).

What it saves, measured with bench/bench_durable.py: the JSON of the
benchmark's 10 records a run took 106 µs and 24.6 KB whole, ~54 µs and ~7.5
KB so; a loop of 300 tool calls wrote 16.5 KB a commit (its path, in every
record), 1.3 KB so. Tests: tests/internals/test_sqlite_log.py,
tests/test_durable.py (every record read back equals the one committed, on
every store, across runs).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from typing import Any, Final

from pydantic import TypeAdapter

from agentfsm._models import json_of
from agentfsm.record import LoopRecord, RequestRecord
from agentfsm.results import PathStep

from ._outline import Outline

__all__ = (
    "PATH_STEPS",
    "SHARED",
    "path_of",
    "record_of",
    "record_text",
    "shared_text",
    "steps_text",
)

SHARED: Final[set[str]] = {
    "version",
    "loop_id",
    "agent_id",
    "started_at",
    "handlers",
    "options",
    "input",
}
"""What a run's records share: fixed while one process runs the loop. Of the
input request, all but its `instructions` (the context's) and `context_items`
(the record's own: the input's context is the loop's)."""
_OWN_INPUT: Final = {"instructions", "context_items"}
_SHARED_EXCLUDED: Final[dict[str, Any]] = {
    **dict.fromkeys(SHARED - {"input"}, True),
    "input": set(RequestRecord.model_fields) - _OWN_INPUT,
}


def _excluded(path: bool, turn: bool, step: bool) -> dict[str, Any]:
    excluded = dict(_SHARED_EXCLUDED)
    if path:
        excluded["path"] = True
    if turn:
        excluded["turn"] = {"request"}
    if step:
        excluded["step"] = {"payload"}
    return excluded


_EXCLUDED: Final = {
    key: _excluded(*key) for key in itertools.product((False, True), repeat=3)
}
"""What a record's text leaves out, by (its path as a length, its turn's request
the input, its step's payload the input): a record holds the input request
two or three times (its `input`, `turn.request`, an inference step's
`payload`), most often as one object (`snapshot.request_record` makes a
request's record once per context size). Left out, the benchmark's 10
records a run are ~6 KB less."""
PATH_STEPS: Final = TypeAdapter(tuple[PathStep, ...])
_STEP: Final = TypeAdapter(PathStep)
_STEP_TEXT: dict[PathStep, str] = {}
"""Each step's JSON, made once: loops take the same few edges (the states,
triggers and rewritten destinations make at most 3,024 steps), and serialized
anew a step cost ~0.8 µs a commit more (its enums' values are Python
properties)."""


def steps_text(steps: Sequence[PathStep]) -> str:
    """`PATH_STEPS.dump_json(steps)` as text (tests/internals/test_sqlite_log.py
    checks they are the same)."""
    texts = _STEP_TEXT
    parts = []
    for step in steps:
        text = texts.get(step)
        if text is None:
            text = texts[step] = _STEP.dump_json(step).decode()
        parts.append(text)
    return f"[{','.join(parts)}]"


def record_text(
    record: LoopRecord, path_length: int | None, outline: Outline | None = None
) -> str:
    """A record as a row keeps it: without what its run shares, nor the input
    request again where it is the turn's request or the step's payload (the
    very object), and with its path as its length (its first `path_length`
    steps of the path the loop's rows make), or in full (None); its large
    strings out of line with an `outline` (see `_outline`)."""
    given = record.input
    step = record.step
    excluded = _EXCLUDED[
        path_length is not None,
        record.turn.request is given,
        step is not None and step.payload is given,
    ]
    if outline is not None:
        data = record.model_dump(mode="json", exclude=excluded)
        if path_length is not None:
            data = {"path": path_length, **data}
        return outline.dumps(data)
    text = json_of(record, exclude=excluded)
    if path_length is None:
        return text
    return f'{{"path":{path_length},{text[1:]}'


def shared_text(record: LoopRecord, outline: Outline | None = None) -> str:
    """What the records of a run share (`SHARED`), as JSON."""
    if outline is not None:
        return outline.text(record, include=SHARED)
    return json_of(record, include=SHARED)


def path_of(rows: Iterable[tuple[int, str]]) -> list[Any]:
    """The path (as JSON data) that a loop's rows' `(path_from, steps)` make,
    in the order they were written."""
    path: list[Any] = []
    for start, steps in rows:
        del path[start:]
        path.extend(json.loads(steps))
    return path


def record_of(
    data: dict[str, Any], shared: dict[str, Any], path: list[Any]
) -> LoopRecord:
    """A stored record, from its text's data, its run's shared text's and the
    path its loop's rows make up to its own (`path_of`)."""
    length = data["path"]
    if isinstance(length, int):
        data["path"] = path[:length]
    own_input = data.pop("input")
    data.update(shared)
    given = data["input"] = {**shared["input"], **own_input}
    turn = data["turn"]
    if "request" not in turn:
        turn["request"] = given
    step = data["step"]
    if step is not None and "payload" not in step:
        step["payload"] = given
    return LoopRecord.model_validate(data)
