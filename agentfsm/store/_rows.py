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
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from pydantic import BaseModel, TypeAdapter
from pydantic_core import to_json

from agentfsm._models import json_of
from agentfsm.record import LoopRecord, RequestRecord, StepRecord, TurnRecord
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
    record: LoopRecord,
    path_length: int | None,
    outline: Outline | None = None,
    texts: ModelTexts | None = None,
) -> str:
    """A record as a row keeps it: without what its run shares, nor the input
    request again where it is the turn's request or the step's payload (the
    very object), and with its path as its length (its first `path_length`
    steps of the path the loop's rows make), or in full (None); its large
    strings out of line with an `outline` (see `_outline`).

    Written field by field, leaving out those at their defaults (reading
    fills them in), not by the record's serializer: with `exclude`, pydantic
    spent ~2.4 µs a record building its filter and ~2.5 µs on the union of a
    step's payload, and the benchmark's records were ~640 bytes of which ~370
    said null, false or []: 5.4 against 3.2 µs a record, and a run wrote
    8,888 bytes, not 12,033, in ~100 µs less (A/B, 9 interleaved rounds of
    bench/bench_durable.py).
    `texts` (the store's) keeps the JSON of the models a loop's records share.
    tests/internals/test_record_text.py checks records of every shape, and a
    record with every field away from its default, read back whole.
    """
    given = record.input
    step = record.step
    if outline is not None:
        excluded = _EXCLUDED[
            path_length is not None,
            record.turn.request is given,
            step is not None and step.payload is given,
        ]
        data = record.model_dump(mode="json", exclude=excluded)
        if path_length is not None:
            data = {"path": path_length, **data}
        return outline.dumps(data)
    text = (texts or ModelTexts()).text
    path = steps_text(record.path) if path_length is None else path_length
    head = (
        f'{{"path":{path},"input":{{"context_items":{given.context_items}'
        f"{_field('instructions', given.instructions)}}},"
        f'"state":"{record.state._value_}","status":"{record.status._value_}",'
        f'"seq":{record.seq},"context_items":{record.context_items},'
        f'"model_requests":{record.model_requests},"tool_calls":{record.tool_calls},'
        f'"structured_failures":{record.structured_failures},'
        f'"usage":{text(record.usage)},"turn":{_turn_text(record.turn, given, text)}'
    )
    parts = [head]
    if record.pending is not None:
        parts.append(f',"pending":{_step_text(record.pending, None, text)}')
    if step is not None:
        parts.append(f',"step":{_step_text(step, given, text)}')
    if record.pause is not None:
        parts.append(f',"pause":{text(record.pause)}')
    if record.resume is not None:
        parts.append(f',"resume":{text(record.resume)}')
    if record.steering:
        parts.append(f',"steering":{_json(record.steering)}')
    if record.follow_ups:
        parts.append(f',"follow_ups":{_json(record.follow_ups)}')
    if record.cancel_requested:
        parts.append(',"cancel_requested":true')
    if record.deadline_at is not None:
        parts.append(f',"deadline_at":{_json(record.deadline_at)}')
    if (
        record.ended_at is not None  # (a loop's end sets it: most of the others)
        or record.cancel_reason is not None
        or record.deadline_utc is not None
        or record.outcome is not None
        or record.reason is not None
        or record.answer is not None
        or record.parsed is not None
        or record.error is not None
    ):
        # (All None in a loop's stride: tested at once, not a call each.)
        parts.append(
            f"{_field('cancel_reason', record.cancel_reason)}"
            f"{_field('deadline_utc', record.deadline_utc)}"
            f"{_field('outcome', record.outcome)}{_field('reason', record.reason)}"
            f"{_field('answer', record.answer)}{_field('parsed', record.parsed)}"
            f"{_field('error', record.error)}{_field('ended_at', record.ended_at)}"
        )
    parts.append("}")
    return "".join(parts)


def _json(value: Any) -> str:
    return to_json(value).decode()


def _field(name: str, value: Any) -> str:
    """A field's member of an object's JSON (after another), or nothing at its
    default (None)."""
    return "" if value is None else f',"{name}":{to_json(value).decode()}'


def _turn_text(
    turn: TurnRecord, given: RequestRecord, text: Callable[[Any], str]
) -> str:
    """A turn's JSON, without its request when that is `given` (the record's
    input request)."""
    parts = [f'{{"history":{turn.history}']
    if turn.request is not given:
        parts.append(f',"request":{text(turn.request)}')
    if turn.output is not None:
        parts.append(f',"output":{text(turn.output)}')
    if turn.message is not None:
        parts.append(f',"message":{text(turn.message)}')
    if turn.answer_at is not None:
        parts.append(f',"answer_at":{turn.answer_at}')
    if turn.last_tools:
        parts.append(f',"last_tools":{_json(turn.last_tools)}')
    parts.append("}")
    return "".join(parts)


def _step_text(
    step: StepRecord, given: RequestRecord | None, text: Callable[[Any], str]
) -> str:
    """A step's JSON, without its payload when that is `given` (the record's
    input request)."""
    payload = step.payload
    head = f'{{"trigger":"{step.trigger._value_}"{_field("reason", step.reason)}'
    if payload is given:
        return f"{head}}}"
    body = "null" if payload is None else text(payload)
    return f'{head},"payload":{body}}}'


class ModelTexts:
    """The JSON of the models a loop's records share (its requests' records,
    the turn's output, the usage), kept by the model's identity while it
    lives: a commit's records name the same few objects again. One store's,
    used by its thread alone; small texts only, a bounded number of them."""

    __slots__ = ("_known",)

    KEPT: Final = 512
    LONGEST: Final = 4096

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref[BaseModel], str]] = {}

    def text(self, model: BaseModel) -> str:
        known = self._known.get(id(model))
        if known is not None and known[0]() is model:
            return known[1]
        text = json_of(model)
        if len(text) <= self.LONGEST:
            if len(self._known) >= self.KEPT:
                del self._known[next(iter(self._known))]  # the oldest
            self._known[id(model)] = (weakref.ref(model), text)
        return text


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
    step = data.get("step")
    if step is not None and "payload" not in step:
        step["payload"] = given
    return LoopRecord.model_validate(data)
