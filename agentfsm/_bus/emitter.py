"""The one way events are made: a loop is an `Emitter` (it inherits this class).

An emitter numbers its loop's events (`seq`, without holes), and builds an
event only when someone listens: with nobody subscribed, an event costs a `seq`
increment and one attribute check. Loops name events by type; the event
classes (`agentfsm.events`) are imported by the first subscription, not by
`import agentfsm`, so a loop nobody watches never loads them (~0.7 ms of the
import since the model classes defer building their schemas; ~10 ms before).

A subscriber with backpressure is never dropped from. An event goes into its
buffer at once while the buffer has room; once it is full, the emitter holds
that event and every later one of the loop (in order), releasing them as room
appears, and the loop awaits `flush` (which waits in line for room: the
bus gives each slot that frees to the first loop waiting) at its next
checkpoint: after each state, each streamed chunk, and before a tool runs
(whenever `outbox` is not None). A loop publishing to a full subscriber waits
there. A cancel never waits: a loop ending by a cancel delivers what it holds
past the subscriber's capacity (`deliver_held`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from agentfsm._models import (  # events are made as `_models.trusted` makes models
    new_bare,
    set_fields_set,
)
from agentfsm.inference import InferenceInput

if TYPE_CHECKING:
    from agentfsm.events import AgentEvent, EventPayload
    from agentfsm.inference import InferenceOutput, StreamingDelta
    from agentfsm.interception import InterceptionHandler, TransitionPayload
    from agentfsm.messages import (
        FunctionCallItem,
        FunctionCallOutputItem,
        ModelMessageItem,
        TokenUsage,
        UserMessage,
    )
    from agentfsm.options import LoopOptions
    from agentfsm.states import LoopState, Outcome, Trigger

    from .bus import EventBus, Subscription

__all__ = ("Emitter", "EventType")

EventType: TypeAlias = Literal[
    "loop.started",
    "transition.intercepted",
    "loop.paused",
    "loop.resumed",
    "loop.recovered",
    "loop.transition",
    "inference.stream",
    "inference.completed",
    "function_call.started",
    "function_call.progress",
    "function_call.completed",
    "model.answer",
    "loop.failed",
    "loop.detached",
    "input.dropped",
    "loop.idle",
]
"""The events a loop publishes, by type (`agentfsm.events` has their classes;
a test checks that the two lists are the same)."""

_SPECS: dict[str, tuple[Any, dict[str, Any], set[str]]] = {}
"""`events.EVENT_SPECS` (type -> event class, template, fields set) once
`_event_specs` has found it."""


def _event_specs() -> dict[str, tuple[Any, dict[str, Any], set[str]]]:
    """`events.EVENT_SPECS`, imported on the first event built (someone subscribed)."""
    from agentfsm.events import EVENT_SPECS as specs

    _SPECS.update(specs)
    return _SPECS


_started_fields: Callable[..., dict[str, Any]] | None = None
"""`started.started_fields`, once `_import_started_fields` has imported it (an
import statement per `loop.started` cost ~1,500 instructions)."""


def _import_started_fields() -> Callable[..., dict[str, Any]]:
    """`started.started_fields`, imported on the first `loop.started` built."""
    global _started_fields
    from agentfsm._bus.started import started_fields

    _started_fields = started_fields
    return started_fields


class Emitter:
    """Builds, numbers and routes the events of one loop.

    A loop's class inherits it (rather than holding an emitter, which would be
    one more object per loop, and a cycle that only the cycle collector frees)
    and provides the envelope: `loop_id`, `agent_id` and `state`, and the
    runtime's `clock` (the events' `ts`).
    """

    # `__weakref__`: what outlives a loop may hold it weakly (the scripted
    # provider forgets a loop's cursor with it).
    __slots__ = ("__weakref__", "bus", "flushing", "held_idle", "outbox", "seq")

    loop_id: str
    agent_id: str
    state: LoopState
    clock: Callable[[], datetime]

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.seq = 0
        """The number of the last event (counted while nobody listens, too)."""
        self.flushing = False
        """Whether a task of the loop is in `flush` (events are then only held)."""
        self.outbox: list[AgentEvent] | None = None
        """Events held for a full backpressure subscriber, in order (None while
        none are: a plain attribute, checked after every state, where a
        property would be a call)."""
        self.held_idle: tuple[int, dict[str, Any], AgentEvent | None] | None = None
        """A durable loop's `loop.idle` (its seq, its fields, the event once
        built), held until its end is stored (`release_idle`)."""

    # The events a loop publishes on every run have a method each, taking the
    # event's fields by position: a call with keyword arguments builds a dict
    # even when nobody listens (~1,650 instructions against ~500 for these; 23
    # events per run). The rare ones go through `emit`.

    def emit_started(
        self,
        message: UserMessage | None,
        request: InferenceInput,
        options: LoopOptions,
        handlers: Sequence[InterceptionHandler],
    ) -> None:
        """`loop.started`, with what a replay needs to start the loop again: the
        request as data (its context and tools included), the options and the
        handlers by name. Built only when a subscriber (an event log's, say)
        takes `loop.started` of this loop: the request's items are copied then,
        a tuple of references (a subscriber of other types only, OTel's, pays
        nothing for it)."""
        seq = self.seq = self.seq + 1
        if self.bus.listening and self.bus.wants("loop.started", self.loop_id):
            started_fields = _started_fields or _import_started_fields()
            fields = started_fields(message, request, options, handlers)
            self._publish("loop.started", seq, fields)

    def emit_transition(
        self,
        source: LoopState,
        trigger: Trigger,
        dest: LoopState,
        rewritten_from: LoopState | None,
    ) -> None:
        """`loop.transition`."""
        seq = self.seq = self.seq + 1
        if self.bus.listening:
            fields = {
                "source": source,
                "trigger": trigger,
                "dest": dest,
                "rewritten_from": rewritten_from,
            }
            self._publish("loop.transition", seq, fields)

    def emit_stream(self, index: int, delta: StreamingDelta) -> None:
        """`inference.stream`."""
        seq = self.seq = self.seq + 1
        if self.bus.listening:
            self._publish("inference.stream", seq, {"index": index, "delta": delta})

    def emit_completed(self, model: str, output: InferenceOutput) -> None:
        """`inference.completed`."""
        seq = self.seq = self.seq + 1
        if self.bus.listening:
            fields = {"model": model, "output": output}
            self._publish("inference.completed", seq, fields)

    def emit_call_started(self, call: FunctionCallItem) -> None:
        """`function_call.started`."""
        seq = self.seq = self.seq + 1
        if self.bus.listening:
            self._publish("function_call.started", seq, {"call": call})

    def emit_call_completed(
        self, call: FunctionCallItem, output: FunctionCallOutputItem, duration: float
    ) -> None:
        """`function_call.completed`."""
        seq = self.seq = self.seq + 1
        if self.bus.listening:
            fields = {"call": call, "output": output, "duration": duration}
            self._publish("function_call.completed", seq, fields)

    def emit_answer(self, message: ModelMessageItem, parsed: Any) -> None:
        """`model.answer` (`parsed` as JSON data)."""
        seq = self.seq = self.seq + 1
        if self.bus.listening:
            self._publish("model.answer", seq, {"message": message, "parsed": parsed})

    def emit_idle(
        self,
        outcome: Outcome,
        reason: str | None,
        answer: ModelMessageItem | None,
        usage: TokenUsage,
        model_requests: int,
        tool_calls: int,
        held: bool = False,
    ) -> None:
        """`loop.idle`; `held`: numbered now, published by `release_idle` (a
        durable loop's, once its end is stored)."""
        seq = self.seq = self.seq + 1
        if self.bus.listening or held:
            fields = {
                "outcome": outcome,
                "reason": reason,
                "answer": answer,
                "usage": usage,
                "model_requests": model_requests,
                "tool_calls": tool_calls,
            }
            if held:
                self.held_idle = (seq, fields, None)
            else:
                self._publish("loop.idle", seq, fields)

    def release_idle(self) -> None:
        """Publish the held `loop.idle` (see `emit_idle`)."""
        held, self.held_idle = self.held_idle, None
        if held is not None and self.bus.listening:
            self._publish("loop.idle", *held)

    def idle_event(self) -> AgentEvent | None:
        """The held `loop.idle` as an event (a store that keeps events writes it
        with the loop's end, before it is published: the same event)."""
        held = self.held_idle
        if held is None:
            return None
        seq, fields, event = held
        if event is None:
            event = self._build("loop.idle", seq, fields)
            self.held_idle = (seq, fields, event)
        return event

    def emit(self, event_type: EventType, /, **fields: Any) -> None:
        """Publish an event of `event_type` with `fields` (already valid values)."""
        seq = self.seq = self.seq + 1
        if self.bus.listening:
            self._publish(event_type, seq, fields)

    def _publish(
        self,
        event_type: EventType,
        seq: int,
        fields: dict[str, Any],
        built: AgentEvent | None = None,
    ) -> None:
        """Build event number `seq` (unless it was: `built`) and route it
        (someone subscribed)."""
        bus = self.bus
        # `bus.targets()`, its common cases inlined: this runs for every event,
        # of every loop while any loop has a subscription of its own (a loop
        # started with `stream=True`), so other loops skip the call.
        targets: Sequence[Subscription] | None = bus._routes.get(event_type)
        by_loop = bus._by_loop
        if targets is None or (by_loop and self.loop_id in by_loop):
            targets = bus.targets(event_type, self.loop_id)
        if not targets:
            return  # nobody listens: the event is not even built
        event = built or self._build(event_type, seq, fields)
        outbox = self.outbox
        if outbox is not None or bus.backpressure:
            # Held events go first, even if their subscriber has left since.
            if outbox is not None and (self.flushing or not self._release()):
                outbox.append(event)  # earlier events still wait: keep the order
            elif bus.has_room(targets):
                bus._deliver(event, targets)
            else:
                self.outbox = [event]
            return
        # `bus._deliver(event, targets)`, inlined: a call per event is ~700
        # instructions of the ~20,000 an observed event costs, and a run
        # publishes 23 (tests/test_bus.py checks what each subscriber gets).
        bus.published += 1
        for sub in targets:
            buffer = sub._buffer
            if sub._closed:
                continue
            if len(buffer) < sub.capacity:
                buffer.append(event)
                sub.delivered += 1
                bus.delivered += 1
                waiter = sub._waiter
                if waiter is not None:
                    sub._waiter = None
                    waiter.set()
            else:
                sub.dropped += 1
                bus.dropped += 1

    def _build(
        self, event_type: EventType, seq: int, fields: dict[str, Any]
    ) -> AgentEvent:
        """Event number `seq` of `event_type`."""
        cls, template, fields_set = (_SPECS or _event_specs())[event_type]
        # What `_models.trusted` does, for an event (see `events._Event`): the
        # loop made every value itself, in the right type, so nothing is validated.
        event = new_bare(cls)
        values = event.__dict__  # a new, empty dict
        values.update(template)
        loop_id = self.loop_id
        values["event_id"] = f"{loop_id}:{seq}"
        values["loop_id"] = loop_id
        values["agent_id"] = self.agent_id
        values["seq"] = seq
        values["ts"] = self.clock()  # the runtime's (`Runtime(clock=)`)
        values["state"] = self.state
        values.update(fields)
        set_fields_set(event, fields_set)
        event_: AgentEvent = event
        return event_

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
        """Publish the held events, in order, waiting for room as needed.

        An event leaves `outbox` once it is delivered, so a cancel while
        waiting for room loses none (the cancelled loop flushes again,
        shielded). While one task of the loop flushes, another (a parallel
        tool call) only holds its events behind."""
        if self.flushing:
            return
        self.flushing = True
        try:
            while self.outbox:
                outbox = self.outbox
                await self.bus.publish(outbox[0])
                del outbox[0]  # only `flush` takes from the front while flushing
            self.outbox = None
        finally:
            self.flushing = False

    def deliver_held(self) -> None:
        """Deliver the held events now, in order, without waiting for room: a
        full backpressure subscriber takes them past its buffer's capacity.

        What a loop that ended by a cancel does instead of `flush`: a cancel
        never waits on a subscriber (one that never reads would hold the
        loop's worker, and the runtime's exit, for ever), and no event is
        lost. The events were held in `outbox` already, so the memory is the
        same; they only move to the subscribers' buffers, where whoever reads
        finds them (after the bus closed, too)."""
        outbox = self.outbox
        if outbox is None:
            return
        self.outbox = None
        bus = self.bus
        for event in outbox:
            bus._deliver(event, bus.targets(event.type, event.loop_id), True)

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
