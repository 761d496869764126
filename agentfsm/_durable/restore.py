"""A loop rebuilt from its stored record: the inverse of `_loop.snapshot`.

The record names callables (tools, handlers, wrappers, stop conditions,
`finish_turn`, structured-output classes); `Bindings` rebinds each by name to
what the runtime was given, and refuses a tool whose schema changed. Every
other field is data and is restored as it was committed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio

from agentfsm._loop.intercept import APPROVAL_GATE, Paused, Resumed
from agentfsm._loop.loop import Loop
from agentfsm._loop.repair import REPAIRED
from agentfsm._loop.snapshot import schema_digest
from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import InferenceInput
from agentfsm.interception import (
    Abort,
    Decision,
    Pause,
    PendingTransition,
    Proceed,
    Rewrite,
    TransitionPayload,
)
from agentfsm.messages import FunctionCallOutputItem, ModelContext
from agentfsm.options import LoopOptions
from agentfsm.record import (
    DecisionRecord,
    LoopRecord,
    MessagesRecord,
    PayloadRecord,
    RequestRecord,
    StepRecord,
    callable_name,
)
from agentfsm.store._base import StoredLoop, StoreError
from agentfsm.tools import Tool

if TYPE_CHECKING:
    from agentfsm._loop.steps import Step

__all__ = ("Bindings", "RecoveryError", "restore")


class RecoveryError(StoreError):
    """A stored loop cannot be rebuilt here: it names a tool or a callable this
    runtime was not given, or a tool whose schema changed since."""


class Bindings:
    """The tools and callables a runtime may bind stored loops to, by name."""

    def __init__(
        self,
        tools: Iterable[Tool | Callable[..., Any]] = (),
        handlers: Mapping[str, Any] | Iterable[Any] = (),
    ) -> None:
        self.tools: dict[str, Tool] = {}
        self.callables: dict[str, Any] = {}
        for given in tools:
            tool = given if isinstance(given, Tool) else Tool.from_function(given)
            self.tools[tool.name] = tool
        if isinstance(handlers, Mapping):
            for name, value in handlers.items():
                if not callable(value):
                    raise ConfigurationError(f"handlers[{name!r}] is not callable")
                self.callables[name] = value
        else:
            for value in handlers:
                if not callable(value):
                    raise ConfigurationError(f"handler {value!r} is not callable")
                self.callables[callable_name(value)] = value

    def learn(self, loop: Loop) -> None:
        """Remember what a loop started here names, so this runtime can rebuild
        it (a loop paused here and taken up again by this runtime's store)."""
        for tool in loop.input.tools:
            self.tools.setdefault(tool.name, tool)
        options = loop.options
        for value in (
            *loop.handlers,
            *options.stop_when,
            *options.tool_wrappers,
            *options.model_wrappers,
        ):
            self.callables.setdefault(callable_name(value), value)
        if options.finish_turn is not None:
            self.callables.setdefault(
                callable_name(options.finish_turn), options.finish_turn
            )
        schema = loop.input.structured_output
        if schema is not None and not isinstance(schema, dict):
            self.callables.setdefault(callable_name(schema), schema)

    def tool(self, loop_id: str, name: str, digest: str | None) -> Tool:
        tool = self.tools.get(name)
        if tool is None:
            raise RecoveryError(
                f"loop {loop_id} uses the tool {name!r}, which this runtime was "
                "not given (Runtime(tools=[...]))"
            )
        if digest is not None and schema_digest(tool) != digest:
            raise RecoveryError(
                f"loop {loop_id} was started with another schema of the tool "
                f"{name!r}: it is not resumed with a tool whose arguments changed"
            )
        return tool

    def callable(self, loop_id: str, name: str) -> Any:
        value = self.callables.get(name)
        if value is None:
            raise RecoveryError(
                f"loop {loop_id} names {name!r}, which this runtime was not given "
                "(Runtime(handlers=[...]) binds handlers, wrappers, stop "
                "conditions, finish_turn and structured-output classes by name)"
            )
        return value


class _Rebuild:
    """The conversion of one record's data back into live objects."""

    def __init__(self, record: LoopRecord, context: ModelContext, bindings: Bindings):
        self.record = record
        self.context = context
        self.bindings = bindings

    def request(self, data: RequestRecord) -> InferenceInput:
        loop_id = self.record.loop_id
        digests: list[str | None] = list(data.tool_schemas) or [None] * len(data.tools)
        tools = [
            self.bindings.tool(loop_id, name, digest)
            for name, digest in zip(data.tools, digests, strict=True)
        ]
        if data.own_context or (data.repairs is None and data.items is None):
            context = self.context  # (the turn's request: see RequestRecord.items)
        elif data.repairs is not None:
            items = list(self.context.items[: data.context_items - len(data.repairs)])
            for position, _, call_id in data.repairs:
                items.insert(position, FunctionCallOutputItem.error(call_id, REPAIRED))
            context = ModelContext(instructions=data.instructions, items=items)
        else:
            context = ModelContext(
                instructions=data.instructions, items=list(data.items or ())
            )
        schema = data.structured_output
        return InferenceInput.model_validate(
            {
                **data.settings,
                "model": data.model,
                "context": context,
                "tools": tools,
                "structured_output": self.bindings.callable(loop_id, schema)
                if isinstance(schema, str)
                else schema,
            }
        )

    def payload(self, data: PayloadRecord) -> TransitionPayload:
        if isinstance(data, RequestRecord):
            return self.request(data)
        if isinstance(data, MessagesRecord):
            return tuple(data.messages)
        return data

    def step(self, data: StepRecord | None) -> Step | None:
        if data is None:
            return None
        return (data.trigger, self.payload(data.payload), data.reason)

    def decision(self, data: DecisionRecord) -> Decision:
        if data.kind == "rewrite":
            return Rewrite(dest=data.dest, payload=self.payload(data.payload))
        if data.kind == "pause":
            return Pause(reason=data.reason or "paused")
        if data.kind == "abort":
            return Abort(reason=data.reason or "aborted")
        return Proceed()

    def options(self) -> LoopOptions:
        data = self.record.options
        loop_id = self.record.loop_id
        values: dict[str, Any] = data.model_dump()
        for name in ("stop_when", "tool_wrappers", "model_wrappers"):
            values[name] = tuple(
                self.bindings.callable(loop_id, n) for n in values[name]
            )
        if data.finish_turn is not None:
            values["finish_turn"] = self.bindings.callable(loop_id, data.finish_turn)
        return LoopOptions(**values)


def restore(
    stored: StoredLoop,
    bindings: Bindings,
    make: Callable[[InferenceInput, tuple[Any, ...], LoopOptions], Loop],
) -> Loop:
    """The loop of a stored record, as it was at its last commit (no task, no
    event published); `make` builds a `Loop` of the runtime's.

    Raises:
        RecoveryError: a tool or callable is missing or changed.
    """
    record = stored.record
    context = ModelContext(instructions=record.input.instructions)
    context.items.extend(stored.items)  # validated when they were stored
    rebuild = _Rebuild(record, context, bindings)
    inference_input = rebuild.request(record.input)
    handlers = tuple(
        bindings.callable(record.loop_id, name)
        for name in record.handlers
        if name != APPROVAL_GATE  # the loop puts the gate back itself
    )
    loop = make(inference_input, handlers, rebuild.options())
    loop.loop_id = record.loop_id
    loop.agent_id = record.agent_id
    loop.started_at = record.started_at
    loop.state = record.state
    loop.status = record.status
    loop.seq = record.seq
    loop.path = list(record.path)
    loop.pending = rebuild.step(record.pending)
    loop.step = rebuild.step(record.step)
    if record.pause is not None:
        pause = record.pause
        payload = rebuild.payload(pause.payload)
        pending = PendingTransition(
            loop_id=record.loop_id,
            agent_id=record.agent_id,
            seq=pause.seq,
            source=pause.source,
            trigger=pause.trigger,
            dest=pause.dest,
            payload=payload,
            model_requests=record.model_requests,
            tool_calls=record.tool_calls,
            usage=record.usage,
        )
        loop.paused = Paused(pending, pause.handler, pause.reason, pause.original_dest)
    if record.resume is not None:
        resume = record.resume
        loop.resumed = Resumed(
            rebuild.decision(resume.decision), resume.handler, resume.original_dest
        )
    loop.model_requests = record.model_requests
    loop.tool_calls = record.tool_calls
    loop.structured_failures = record.structured_failures
    loop.usage = record.usage
    loop.steering = deque(record.steering) if record.steering else None
    loop.follow_ups = deque(record.follow_ups) if record.follow_ups else None
    turn = record.turn
    loop.request = rebuild.request(turn.request)
    loop.output = turn.output
    loop.message = turn.message
    loop.answer_at = turn.answer_at
    loop.history = turn.history
    loop.last_tools = list(turn.last_tools)
    loop.cancel_requested = record.cancel_requested
    loop.cancel_reason = record.cancel_reason
    if record.deadline_utc is not None:
        left = (record.deadline_utc - datetime.now(UTC)).total_seconds()
        loop.deadline_at = anyio.current_time() + left
    loop.outcome = record.outcome
    loop.reason = record.reason
    loop.answer = record.answer
    loop.parsed = record.parsed
    loop.error = record.error
    loop.ended_at = record.ended_at
    return loop
