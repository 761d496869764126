"""The first place a replayed loop's events differ from the recorded ones.

Events are compared as JSON data (an image by its digest, media type and
size: the digest is its bytes') without what differs from run to run by
design: the envelope's `event_id`, `loop_id` and `ts`, a call's `duration`, and
`loop.started`'s `options`, `handlers` and `forked_from` (a replay is made to
run with other ones). A handler's `proceed` is left out on both sides (it
changes nothing: replaying with a handler added that lets everything through
reports no divergence), and so is the index of the deciding handler. What is
left is compared in order; the first pair that differs is the divergence.

The calls of a batch are the exception. Those of a parallel batch start,
report progress and end in an order the scheduler chooses, so their events
(`function_call.started`, `.progress`, `.completed`) interleave differently
from run to run. A batch's events are compared call by call (by call id),
each call's in order, the calls in the recording's order: a call whose events
differ, a call the replay did not make or one it made besides, is the
divergence; the order the calls interleaved in is not. A call whose recorded
output a recovery took from its ledger (`Recording.reused`: it ran before the
crash) has only its `function_call.completed` to compare, and the replay,
which runs it, counts it in `loop.idle`'s `tool_calls` where the recording may
not have.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import zip_longest
from typing import Any, Final, NamedTuple

from pydantic import JsonValue

from agentfsm.events import (
    AgentEvent,
    FunctionCallCompleted,
    FunctionCallProgress,
    FunctionCallStarted,
    LoopPaused,
    LoopTransition,
    TransitionIntercepted,
)
from agentfsm.messages import REFERENCE
from agentfsm.results import PathStep
from agentfsm.states import LoopState, Trigger

__all__ = ("Mismatch", "edge_of", "first_mismatch")

_ENVELOPE: Final = {"event_id", "loop_id", "seq", "ts"}
_LEFT_OUT: Final[dict[str, set[str]]] = {
    "loop.started": {"options", "handlers", "forked_from"},
    "function_call.completed": {"duration"},
    "transition.intercepted": {"handler"},
}
_MAX_DIFFERENCES: Final = 20
_CALL_EVENTS: Final = frozenset(
    {"function_call.started", "function_call.progress", "function_call.completed"}
)


class Mismatch(NamedTuple):
    """Where the two event lists first differ (an index is None past the end)."""

    expected: int | None
    actual: int | None
    differences: list[tuple[str, JsonValue, JsonValue]]


def comparable(event: AgentEvent) -> dict[str, Any]:
    """An event as the JSON data that is compared: its images by reference
    (their digests stand for their bytes, and a difference names them, not
    their base64)."""
    left_out = _ENVELOPE | _LEFT_OUT.get(event.type, set())
    data: dict[str, Any] = event.model_dump(
        mode="json", exclude=left_out, context=REFERENCE
    )
    return data


def _kept(events: Sequence[AgentEvent]) -> list[int]:
    return [
        i
        for i, e in enumerate(events)
        if not (e.type == "transition.intercepted" and e.decision == "proceed")
    ]


def first_mismatch(
    expected: Sequence[AgentEvent],
    actual: Sequence[AgentEvent],
    reused: Collection[int] = (),
) -> Mismatch | None:
    """The first pair of compared events that differ, or None.

    `reused`: indexes in `expected` of the completions of calls whose output a
    recovery reused (see the module).
    """
    left, right = _kept(expected), _kept(actual)
    a = b = 0
    ran = 0  # calls the replay ran whose recorded output a recovery reused
    while a < len(left) or b < len(right):
        i = left[a] if a < len(left) else None
        j = right[b] if b < len(right) else None
        if i is None or j is None:
            return Mismatch(i, j, [])
        if expected[i].type in _CALL_EVENTS and actual[j].type in _CALL_EVENTS:
            a_end, b_end = _batch_end(expected, left, a), _batch_end(actual, right, b)
            found = _batch_mismatch(
                expected,
                left[a:a_end],
                actual,
                right[b:b_end],
                reused,
                (_at(left, a_end), _at(right, b_end)),
            )
            if isinstance(found, Mismatch):
                return found
            ran += found
            a, b = a_end, b_end
            continue
        x, y = comparable(expected[i]), comparable(actual[j])
        if x != y and ran and x["type"] == "loop.idle":
            # The recovering process did not count the calls it took from its
            # ledger (a store that does counts them: either is the same run).
            x = {**x, "tool_calls": x["tool_calls"] + ran}
        if x != y:
            return _mismatch(i, j, x, y)
        a, b = a + 1, b + 1
    return None


def _mismatch(i: int | None, j: int | None, a: Any, b: Any) -> Mismatch:
    differences: list[tuple[str, JsonValue, JsonValue]] = []
    _diff("", a, b, differences)
    return Mismatch(i, j, differences)


def _at(indexes: list[int], n: int) -> int | None:
    return indexes[n] if n < len(indexes) else None


def _batch_end(events: Sequence[AgentEvent], indexes: list[int], n: int) -> int:
    """Past the run of call events starting at `indexes[n]` (one batch's)."""
    while n < len(indexes) and events[indexes[n]].type in _CALL_EVENTS:
        n += 1
    return n


def _call_id(event: AgentEvent) -> str:
    if isinstance(event, FunctionCallProgress):
        return event.call_id
    assert isinstance(event, FunctionCallStarted | FunctionCallCompleted)
    return event.call.call_id


def _by_call(events: Sequence[AgentEvent], indexes: list[int]) -> dict[str, list[int]]:
    """A batch's event indexes by call id, each call's in order (the calls in
    the order they first published)."""
    calls: dict[str, list[int]] = {}
    for index in indexes:
        calls.setdefault(_call_id(events[index]), []).append(index)
    return calls


def _batch_mismatch(
    expected: Sequence[AgentEvent],
    left: list[int],
    actual: Sequence[AgentEvent],
    right: list[int],
    reused: Collection[int],
    after: tuple[int | None, int | None],
) -> Mismatch | int:
    """The first call of a batch whose events differ, or how many calls the
    replay ran whose recorded output a recovery reused. `after` is where each
    side goes on past the batch (None: its end), what a call made on one side
    only is paired with."""
    replayed = _by_call(actual, right)
    ran = 0
    for call_id, mine in _by_call(expected, left).items():
        theirs = replayed.pop(call_id, None)
        if theirs is None:
            return Mismatch(mine[0], after[1], [])
        if len(mine) == 1 and mine[0] in reused:
            # Only its output is recorded: it ran in the process that crashed.
            done = [k for k in theirs if actual[k].type == "function_call.completed"]
            ran += len(done) < len(theirs)
            theirs = done
        for i, j in zip_longest(mine, theirs):
            if i is None or j is None:
                return Mismatch(
                    after[0] if i is None else i, after[1] if j is None else j, []
                )
            x, y = comparable(expected[i]), comparable(actual[j])
            if x != y:
                return _mismatch(i, j, x, y)
    for theirs in replayed.values():
        return Mismatch(after[0], theirs[0], [])
    return ran


def _diff(
    path: str, a: Any, b: Any, out: list[tuple[str, JsonValue, JsonValue]]
) -> None:
    """Append `(path, a's value, b's value)` for each leaf where they differ."""
    if len(out) >= _MAX_DIFFERENCES or a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        # Key by key even when the types differ: a decision where the recording
        # had a transition shows as its decision and payload.
        for key in [*a, *(k for k in b if k not in a)]:
            _diff(f"{path}.{key}" if path else key, a.get(key), b.get(key), out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _diff(f"{path}[{index}]", x, y, out)
    else:
        out.append((path or "event", a, b))


def edge_of(events: Sequence[AgentEvent], index: int) -> PathStep | None:
    """The transition the event at `index` belongs to: its own edge for a
    transition; the pending one for a decision, a pause, a resume, a failure
    or the start; else the transition before it (whose work it records)."""
    event = events[index]
    if isinstance(event, LoopTransition):
        return PathStep(event.source, event.trigger, event.dest, event.rewritten_from)
    if isinstance(event, TransitionIntercepted | LoopPaused):
        return PathStep(event.source, event.trigger, event.dest)
    if event.type in ("loop.started", "loop.resumed", "loop.failed"):
        for later in range(index + 1, len(events)):
            if isinstance(events[later], LoopTransition | LoopPaused):
                return edge_of(events, later)
        if event.type == "loop.started":
            return PathStep(LoopState.idle, Trigger.start, LoopState.context_update)
        return None
    for earlier in range(index - 1, -1, -1):
        if isinstance(events[earlier], LoopTransition):
            return edge_of(events, earlier)
    return None
