"""A loop's records as the SQL stores keep them.

A store writes a loop's rows in *runs*: from the row it writes when it takes the
loop (a new loop, or one it acquired: recovered, resumed) to the one it writes
last. Within a run the store knows what its earlier rows hold, so a row holds
only what changed:

- what every record of the run shares (`SHARED`: the loop's ids, start, input
  request, options and handlers, which are fixed for as long as one process
  runs the loop) is in the run's first row only (`shared_text`); a later run
  writes it again (a recovery may rebind a handler under another name);
- each path step is in the row of the commit that took it: a row holds the
  steps since the row before (`Paths`: from `path_from` on), and a record its
  path's length (`record_text`);
- the rest of a record is its own: the input's instructions included (the
  loop's context holds them, and a handler or `Agent.request` may change them).

`record_of` makes a record whole again from its text, the latest shared text at
or before its row, and the path its loop's rows make up to its row (`path_of`).

A store may rely on what it wrote only while nobody else wrote the loop: a row
that does is written only if the loop's row still names the store's runtime as
its owner (no other runtime took the loop since); else the row holds it all.

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

__all__ = (
    "PATH_STEPS",
    "SHARED",
    "Paths",
    "path_of",
    "prefix_length",
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


def record_text(record: LoopRecord, path_length: int | None) -> str:
    """A record as a row keeps it: without what its run shares, nor the input
    request again where it is the turn's request or the step's payload (the
    very object), and with its path as its length (its first `path_length`
    steps of the path the loop's rows make, see `Paths`), or in full (None)."""
    given = record.input
    step = record.step
    excluded = _EXCLUDED[
        path_length is not None,
        record.turn.request is given,
        step is not None and step.payload is given,
    ]
    text = json_of(record, exclude=excluded)
    if path_length is None:
        return text
    return f'{{"path":{path_length},{text[1:]}'


def shared_text(record: LoopRecord) -> str:
    """What the records of a run share (`SHARED`), as JSON."""
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


_Written = tuple[PathStep, ...]
"""The path the loop's rows hold (a record's own tuple: kept, not copied)."""


class Paths:
    """The path each loop's rows hold, as this store wrote them in the loop's
    current run (used in the worker thread only; forgotten when the run ends:
    the store takes the loop again, gives it up, finishes it): a row holds the
    steps its record's path took since the row before (`path_from` on)."""

    __slots__ = ("_written",)

    def __init__(self) -> None:
        self._written: dict[str, _Written] = {}

    def __contains__(self, loop_id: str) -> bool:
        """Whether the store wrote a row of the loop in its current run."""
        return loop_id in self._written

    def start(self, loop_id: str, path: tuple[PathStep, ...]) -> int:
        """Where a row of the loop whose record has `path` starts its steps (0:
        it holds the whole path)."""
        return _start(self._written.get(loop_id), path)

    def rows(
        self, loop_id: str, records: Sequence[LoopRecord], *, run: bool
    ) -> list[tuple[str, int, str]]:
        """A row for each of `records` (written in this order, each a row of
        its own): its text, where its steps start (`path_from`), and the steps
        as JSON; `run=False`: as the first rows of a run (the whole path)."""
        rows = []
        known = self._written.get(loop_id) if run else None
        for record in records:
            path = record.path
            start = _start(known, path)
            text = record_text(record, len(path))
            rows.append((text, start, steps_text(path[start:])))
            known = _written(path)
        return rows

    def wrote(self, loop_id: str, path: tuple[PathStep, ...]) -> None:
        """A row holding `path` landed."""
        self._written[loop_id] = _written(path)

    def pop(self, loop_id: str) -> None:
        self._written.pop(loop_id, None)

    def clear(self) -> None:
        self._written.clear()


def _written(path: tuple[PathStep, ...]) -> _Written:
    return path


def _start(known: _Written | None, path: tuple[PathStep, ...]) -> int:
    # Within a run a loop's path only grows (the one step a recovery takes
    # back is taken when its run starts), so the written path is this one's
    # start; checked, not relied on: a path that does not start with it is
    # written whole. The steps are the same objects (a record's path is the
    # loop's list as a tuple), so the comparison is one of references: ~2 µs
    # a commit at 600 steps.
    if known is None:
        return 0
    length = len(known)
    if length <= len(path) and path[:length] == known:
        return length
    return 0


def prefix_length(path: tuple[PathStep, ...], of: tuple[PathStep, ...]) -> int | None:
    """`len(path)` if it is the start of `of`, else None (written in full)."""
    n = len(path)
    if n > len(of) or of[:n] != path:
        return None
    return n
