"""The first place a replayed loop's events differ from the recorded ones.

Events are compared as JSON data without what differs from run to run by
design: the envelope's `event_id`, `loop_id` and `ts`, a call's `duration`, and
`loop.started`'s `options`, `handlers` and `forked_from` (a replay is made to
run with other ones). A handler's `proceed` is left out on both sides (it
changes nothing: replaying with a handler added that lets everything through
reports no divergence), and so is the index of the deciding handler. What is
left is compared in order; the first pair that differs is the divergence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, NamedTuple

from pydantic import JsonValue

from agentfsm.events import (
    AgentEvent,
    LoopPaused,
    LoopTransition,
    TransitionIntercepted,
)
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


class Mismatch(NamedTuple):
    """Where the two event lists first differ (an index is None past the end)."""

    expected: int | None
    actual: int | None
    differences: list[tuple[str, JsonValue, JsonValue]]


def comparable(event: AgentEvent) -> dict[str, Any]:
    """An event as the JSON data that is compared."""
    left_out = _ENVELOPE | _LEFT_OUT.get(event.type, set())
    data: dict[str, Any] = event.model_dump(mode="json", exclude=left_out)
    return data


def _kept(events: Sequence[AgentEvent]) -> list[int]:
    return [
        i
        for i, e in enumerate(events)
        if not (e.type == "transition.intercepted" and e.decision == "proceed")
    ]


def first_mismatch(
    expected: Sequence[AgentEvent], actual: Sequence[AgentEvent]
) -> Mismatch | None:
    """The first pair of compared events that differ, or None."""
    left, right = _kept(expected), _kept(actual)
    for n in range(max(len(left), len(right))):
        i = left[n] if n < len(left) else None
        j = right[n] if n < len(right) else None
        if i is None or j is None:
            return Mismatch(i, j, [])
        a, b = comparable(expected[i]), comparable(actual[j])
        if a != b:
            differences: list[tuple[str, JsonValue, JsonValue]] = []
            _diff("", a, b, differences)
            return Mismatch(i, j, differences)
    return None


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
