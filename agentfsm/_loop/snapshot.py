"""Taking a live loop's record (`agentfsm.record.LoopRecord`): `Runtime.snapshot`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import anyio

from agentfsm.inference import InferenceInput
from agentfsm.interception import Decision, Rewrite, TransitionPayload
from agentfsm.record import (
    DecisionRecord,
    LoopRecord,
    MessagesRecord,
    OptionsRecord,
    PauseRecord,
    PayloadRecord,
    RequestRecord,
    ResumeRecord,
    StepRecord,
    TurnRecord,
    callable_name,
)
from agentfsm.tools import Tool, ToolDefinition

from .states.model_message import jsonable

if TYPE_CHECKING:
    from .loop import Loop
    from .steps import Step

__all__ = ("record_of",)


def record_of(loop: Loop) -> LoopRecord:
    """The record of a live loop."""
    own = loop.input.context
    paused = loop.paused
    resumed = loop.resumed
    return LoopRecord(
        loop_id=loop.loop_id,
        agent_id=loop.agent_id,
        started_at=loop.started_at,
        input=request_record(loop.input, own),
        handlers=tuple(callable_name(h) for h in loop.handlers),
        options=options_record(loop),
        state=loop.state,
        status=loop.status,
        seq=loop.seq,
        path=tuple(loop.path),
        context_items=len(own.items),
        pending=step_record(loop.pending, own),
        step=step_record(loop.step, own),
        pause=None
        if paused is None
        else PauseRecord(
            source=paused.pending.source,
            trigger=paused.pending.trigger,
            dest=paused.pending.dest,
            seq=paused.pending.seq,
            payload=payload_record(paused.pending.payload, own),
            handler=paused.handler,
            reason=paused.reason,
            original_dest=paused.original_dest,
        ),
        resume=None
        if resumed is None
        else ResumeRecord(
            decision=decision_record(resumed.decision, own),
            handler=resumed.handler,
            original_dest=resumed.original_dest,
        ),
        model_requests=loop.model_requests,
        tool_calls=loop.tool_calls,
        structured_failures=loop.structured_failures,
        usage=loop.usage,
        steering=tuple(loop.steering or ()),
        follow_ups=tuple(loop.follow_ups or ()),
        turn=TurnRecord(
            request=request_record(loop.request, own),
            output=loop.output,
            message=loop.message,
            answer_at=loop.answer_at,
            history=loop.history,
            last_tools=tuple(loop.last_tools),
        ),
        cancel_requested=loop.cancel_requested,
        cancel_reason=loop.cancel_reason,
        deadline_at=loop.deadline_at,
        deadline_utc=None if loop.deadline_at is None else _wall(loop.deadline_at),
        outcome=loop.outcome,
        reason=loop.reason,
        answer=loop.answer,
        parsed=jsonable(loop.parsed),
        error=loop.error,
        ended_at=loop.ended_at,
    )


_REQUEST_DATA = {"model", "context", "tools", "structured_output"}


def request_record(request: InferenceInput, own: Any) -> RequestRecord:
    """An `InferenceInput` as data (`own` is the loop's context)."""
    schema = request.structured_output
    own_context = request.context is own
    return RequestRecord(
        model=request.model,
        settings=request.model_dump(mode="json", exclude=_REQUEST_DATA),
        tools=tuple(t.name for t in request.tools),
        tool_schemas=tuple(schema_digest(t) for t in request.tools),
        structured_output=schema
        if schema is None or isinstance(schema, dict)
        else callable_name(schema),
        instructions=request.context.instructions,
        context_items=len(request.context.items),
        own_context=own_context,
        items=None if own_context else tuple(request.context.items),
    )


_DIGESTS: dict[int, tuple[ToolDefinition, str]] = {}
"""Each tool definition's digest, by the definition's id (kept with it, so the
id stays its own): a record names the same few tools at every commit."""


def schema_digest(tool: Tool) -> str:
    """A digest of a tool's name and parameters schema (not its description:
    rewording a tool does not change the calls it takes)."""
    definition = tool.definition
    known = _DIGESTS.get(id(definition))
    if known is not None and known[0] is definition:
        return known[1]
    text = json.dumps([definition.name, definition.parameters], sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    _DIGESTS[id(definition)] = (definition, digest)
    return digest


def _wall(deadline_at: float) -> datetime:
    """A deadline on anyio's clock as a wall-clock time."""
    return datetime.now(UTC) + timedelta(seconds=deadline_at - anyio.current_time())


def payload_record(payload: TransitionPayload, own: Any) -> PayloadRecord:
    """A transition's payload as data."""
    if isinstance(payload, InferenceInput):
        return request_record(payload, own)
    if isinstance(payload, tuple):
        return MessagesRecord(messages=payload)
    return payload


def step_record(step: Step | None, own: Any) -> StepRecord | None:
    if step is None:
        return None
    trigger, payload, reason = step
    return StepRecord(
        trigger=trigger, payload=payload_record(payload, own), reason=reason
    )


def decision_record(decision: Decision, own: Any) -> DecisionRecord:
    if isinstance(decision, Rewrite):
        return DecisionRecord(
            kind="rewrite",
            dest=decision.dest,
            payload=payload_record(decision.payload, own),
        )
    return DecisionRecord(kind=decision.kind, reason=getattr(decision, "reason", None))


def options_record(loop: Loop) -> OptionsRecord:
    options = loop.options
    values: dict[str, Any] = {}
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if isinstance(value, tuple):
            value = tuple(callable_name(v) for v in value)
        elif callable(value):
            value = callable_name(value)
        values[field.name] = value
    return OptionsRecord(**values)
