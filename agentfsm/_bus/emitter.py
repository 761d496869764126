"""The one way events are made: a loop is an `Emitter` (it inherits this class).

An emitter numbers its loop's events (`seq`, without holes), and builds an
event only when someone listens: with nobody subscribed, an event costs a `seq`
increment and one attribute check. Loops name events by type; the event
classes (`agentfsm.events`) are imported by the first subscription, not by
`import agentfsm` (their ~15 model classes are the largest part of the import,
~10 ms), so a loop nobody watches never loads them.

A subscriber with backpressure is never dropped from. An event goes into its
buffer at once while the buffer has room; once it is full, the emitter holds
that event and every later one of the loop (in order), releasing them as room
appears, and the loop awaits `flush` (which waits for room) at its next
checkpoint: after each state, each streamed chunk, and before a tool runs
(whenever `outbox` is not None). A loop publishing to a full subscriber waits
there.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from agentfsm._models import (  # events are made as `_models.trusted` makes models
    _new,
    _setattr,
)
from agentfsm.inference import InferenceInput

if TYPE_CHECKING:
    from agentfsm.events import AgentEvent, EventPayload
    from agentfsm.interception import TransitionPayload
    from agentfsm.states import LoopState

    from .bus import EventBus, Subscription

__all__ = ("Emitter", "EventType")

EventType: TypeAlias = Literal[
    "loop.started",
    "transition.intercepted",
    "loop.paused",
    "loop.resumed",
    "loop.transition",
    "inference.stream",
    "inference.completed",
    "function_call.started",
    "function_call.progress",
    "function_call.completed",
    "model.answer",
    "loop.failed",
    "loop.idle",
]
"""The events a loop publishes, by type (`agentfsm.events` has their classes;
a test checks that the two lists are the same)."""

_SPECS: dict[str, tuple[Any, dict[str, Any], set[str], tuple[str, ...]]] = {}
"""`events._SPECS` (type -> event class, template, fields set, own fields) once
`_event_specs` has found it."""


def _event_specs() -> dict[str, tuple[Any, dict[str, Any], set[str], tuple[str, ...]]]:
    """`events._SPECS`, imported on the first event built (someone subscribed)."""
    from agentfsm.events import _SPECS as specs

    _SPECS.update(specs)
    return _SPECS


class Emitter:
    """Builds, numbers and routes the events of one loop.

    A loop's class inherits it (rather than holding an emitter, which would be
    one more object per loop, and a cycle that only the cycle collector frees)
    and provides the envelope: `loop_id`, `agent_id` and `state`.
    """

    __slots__ = ("bus", "outbox", "seq")

    loop_id: str
    agent_id: str
    state: LoopState

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.seq = 0
        """The number of the last event (counted while nobody listens, too)."""
        self.outbox: list[AgentEvent] | None = None
        """Events held for a full backpressure subscriber, in order (None while
        none are: a plain attribute, checked after every state, where a
        property would be a call)."""

    def emit(self, event_type: EventType, /, *values: Any) -> None:
        """Publish an event of `event_type` whose own fields (after the envelope)
        are `values`, in the order its class declares them (`agentfsm.events`):
        `emit("inference.completed", model, output)`.

        By position, not by keyword: a keyword call builds a dict even when
        nobody listens (~1,650 instructions against ~1,100; 23 events per run),
        and zipping the values with the field names is cheaper than that dict
        when someone does. Values are the loop's own, already valid.
        """
        seq = self.seq = self.seq + 1
        bus = self.bus
        if not bus.listening:
            return
        # `bus.targets()`, its common case inlined: this runs for every event.
        targets: Sequence[Subscription] | None = bus._routes.get(event_type)
        if targets is None or bus._by_loop:
            targets = bus.targets(event_type, self.loop_id)
        if not targets:
            return  # nobody listens: the event is not even built
        cls, template, fields_set, names = (_SPECS or _event_specs())[event_type]
        # What `_models.trusted` does, for an event (see `events._Event`): the
        # loop made every value itself, in the right type, so nothing is validated.
        event = _new(cls)
        fields = event.__dict__  # a new, empty dict
        fields.update(template)
        loop_id = self.loop_id
        fields["event_id"] = f"{loop_id}:{seq}"
        fields["loop_id"] = loop_id
        fields["agent_id"] = self.agent_id
        fields["seq"] = seq
        fields["ts"] = datetime.now(UTC)
        fields["state"] = self.state
        fields.update(zip(names, values, strict=True))
        _setattr(event, "__pydantic_fields_set__", fields_set)
        if bus.backpressure:
            outbox = self.outbox
            if outbox is not None and not self._release():
                outbox.append(event)  # earlier events still wait: keep the order
            elif bus.has_room(targets):
                bus._deliver(event, targets)
            else:
                self.outbox = [event]
        else:
            bus._deliver(event, targets)

    def emit_named(self, event_type: EventType, /, **fields: Any) -> None:
        """`emit` with the fields by name, those left out at their defaults (for
        the events a run rarely publishes: decisions, pauses)."""
        if not self.bus.listening:
            self.seq += 1
            return
        _, template, _, names = (_SPECS or _event_specs())[event_type]
        self.emit(event_type, *[fields.get(n, template[n]) for n in names])

    def _release(self) -> bool:
        """Deliver the held events that have room now, oldest first; return
        whether none is left (a subscriber that drained its buffer gets the
        next events as they are published, not when the state ends)."""
        outbox = self.outbox
        assert outbox is not None
        bus = self.bus
        while outbox:
            event = outbox[0]
            targets = bus.targets(event.type, event.loop_id)
            if not bus.has_room(targets):
                return False
            bus._deliver(outbox.pop(0), targets)
        self.outbox = None
        return True

    async def flush(self) -> None:
        """Publish the held events, in order, waiting for room as needed."""
        outbox, self.outbox = self.outbox, None
        for event in outbox or ():
            await self.bus.publish(event)

    def event_payload(self, payload: TransitionPayload) -> EventPayload | None:
        """A transition's payload as events record it (a request as its summary),
        or None while nobody listens (no event will be built)."""
        if not self.bus.listening:
            return None
        if isinstance(payload, InferenceInput):
            from agentfsm.events import (
                RequestSummary,  # imported by `subscribe` already
            )

            return RequestSummary(
                model=payload.model,
                max_output_tokens=payload.max_output_tokens,
                reasoning_effort=payload.reasoning_effort,
                tool_choice=payload.tool_choice,
                tools=tuple(t.name for t in payload.tools),
                instructions=payload.context.instructions,
                context_items=len(payload.context.items),
            )
        return payload
