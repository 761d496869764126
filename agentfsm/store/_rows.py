"""A loop's records as the SQL stores keep them: what all of a loop's records
share (`CONSTANT`) once, in the loop's row, and each path step once, in the
row of the commit that took it (`Paths`); a record's text holds the rest, and
its path's length (`record_text`); `record_of` makes it whole again.

What it saves, measured with bench/bench_durable.py: the JSON of the
benchmark's 10 records a run took 106 µs and 24.6 KB whole, 70 µs and 13.4 KB
so; and a loop of 300 tool calls wrote 16.5 KB a commit (its paths, in every
record), 1.9 KB so. Tests: tests/internals/test_sqlite_log.py,
tests/test_durable.py (every record read back equals the one committed, on
every store).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Final

from pydantic import TypeAdapter

from agentfsm.record import LoopRecord
from agentfsm.results import PathStep

__all__ = (
    "CONSTANT",
    "PATH_STEPS",
    "Paths",
    "prefix_length",
    "record_of",
    "record_text",
)

CONSTANT: Final[set[str]] = {
    "version",
    "loop_id",
    "agent_id",
    "started_at",
    "handlers",
    "options",
    "input",
}
"""What a loop's records share (the loop's row holds it, `loops.loop`): set
when the loop is made. Its `input` differs only in `context_items`, which is
the record's own (the input's context is the loop's)."""
_IN_ROW: Final[set[str]] = CONSTANT | {"path"}
PATH_STEPS: Final = TypeAdapter(tuple[PathStep, ...])


def record_text(record: LoopRecord, path_length: int | None) -> str:
    """A record as the log keeps it: without what the loop's row holds, and
    with its path as its length (its first `path_length` steps of the path the
    loop's rows' `path` columns make, see `Paths`), or in full (None).

    What it saves, measured on the benchmark's records (bench/bench_durable.py,
    10 a run): their JSON took 106 µs a run and 24.6 KB whole, 70 µs and 13.4
    KB so. And a path in full makes a loop's bytes grow with the square of its
    transitions."""
    if path_length is None:
        return record.model_dump_json(exclude=CONSTANT)
    text = record.model_dump_json(exclude=_IN_ROW)
    return f'{{"path":{path_length},{text[1:]}'


def constant_text(record: LoopRecord) -> str:
    """What the loop's row holds of its records (`CONSTANT`), as JSON."""
    return record.model_dump_json(include=CONSTANT)


def path_of(rows: Iterable[tuple[int, str]]) -> list[Any]:
    """The path (as JSON data) that a loop's rows' `(path_from, steps)` make,
    in the order they were written."""
    path: list[Any] = []
    for start, steps in rows:
        del path[start:]
        path.extend(json.loads(steps))
    return path


def record_of(
    data: dict[str, Any], constant: dict[str, Any], path: list[Any]
) -> LoopRecord:
    """A stored record, from its text's data, its loop's row and the path its
    loop's rows make up to its own (`path_of`)."""
    length = data["path"]
    if isinstance(length, int):
        data["path"] = path[:length]
    data.update(constant)
    data["input"] = {**constant["input"], "context_items": data["context_items"]}
    return LoopRecord.model_validate(data)


class Paths:
    """The path each loop's log rows hold, as this store wrote them (used in
    the worker thread only; forgotten when a lease changes hands): a row
    holds the steps its record's path took since the loop's previous row
    (`path_from` on), so a loop's rows hold each step once."""

    __slots__ = ("_written",)

    def __init__(self) -> None:
        self._written: dict[str, _Written] = {}

    def start(self, loop_id: str, path: tuple[PathStep, ...]) -> int:
        """Where a row of the loop whose record has `path` starts its steps (0:
        it holds the whole path)."""
        return _start(self._written.get(loop_id), path)

    def rows(
        self, loop_id: str, records: Sequence[LoopRecord]
    ) -> list[tuple[str, int, str]]:
        """A row for each of `records` (written in this order, each a row of
        its own): its text, where its steps start (`path_from`), and the steps
        as JSON."""
        rows = []
        known = self._written.get(loop_id)
        for record in records:
            path = record.path
            start = _start(known, path)
            text = record_text(record, len(path))
            rows.append((text, start, PATH_STEPS.dump_json(path[start:]).decode()))
            known = _written(path)
        return rows

    def wrote(self, loop_id: str, path: tuple[PathStep, ...]) -> None:
        """A row holding `path` landed."""
        self._written[loop_id] = _written(path)

    def pop(self, loop_id: str) -> None:
        self._written.pop(loop_id, None)

    def clear(self) -> None:
        self._written.clear()


_Written = tuple[int, PathStep | None]
"""A path's length and its last step (the very object)."""


def _written(path: tuple[PathStep, ...]) -> _Written:
    return (len(path), path[-1] if path else None)


def _start(known: _Written | None, path: tuple[PathStep, ...]) -> int:
    if known is None:
        return 0
    length, last = known
    # The same path, longer: its step at `length - 1` is the very one written
    # (a path that lost steps, a recovery's, is written whole).
    if length <= len(path) and (length == 0 or path[length - 1] is last):
        return length
    return 0


def prefix_length(path: tuple[PathStep, ...], of: tuple[PathStep, ...]) -> int | None:
    """`len(path)` if it is the start of `of` (its steps the very ones), else None."""
    n = len(path)
    if n > len(of):
        return None
    if n and of[n - 1] is not path[-1]:
        return None
    return n
