"""Taking a live loop's record (`agentfsm.record.LoopRecord`): `Runtime.snapshot`,
and a durable store's write at every commit.

The record is made of the loop's own valid data, so it is built without
validation (`_models.trusted`), and what does not change between commits is
made once: a request's settings and tool names, the options, the handlers'
names. Validated, a record cost ~38 µs a commit (64 constructor calls a
benchmark run); `tests/internals/test_record_at_every_commit.py` checks that
each one round-trips through JSON and validates.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
from pydantic import BaseModel

from agentfsm import _models
from agentfsm.inference import InferenceInput, RequestMetadata
from agentfsm.interception import Decision, Rewrite, TransitionPayload
from agentfsm.record import (
    RECORD_VERSION,
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
    options_record,
)
from agentfsm.tools import Tool, ToolDefinition

from .states.model_message import jsonable

if TYPE_CHECKING:
    from .loop import Loop
    from .steps import Step

__all__ = ("record_of", "schema_digest")

M = TypeVar("M", bound=BaseModel)


def _made(cls: type[M], **values: Any) -> M:
    """`cls` holding `values`, every field of it, without validating them."""
    return _models.trusted(cls, values, _FIELDS[cls])


_FIELDS: Final[dict[type[BaseModel], set[str]]] = {
    cls: set(cls.model_fields)
    for cls in (
        LoopRecord,
        RequestRecord,
        MessagesRecord,
        StepRecord,
        PauseRecord,
        DecisionRecord,
        ResumeRecord,
        TurnRecord,
        OptionsRecord,
    )
}


def record_of(loop: Loop) -> LoopRecord:
    """The record of a live loop."""
    own = loop.input.context
    paused = loop.paused
    resumed = loop.resumed
    repair = loop.metadata
    described = loop.described
    if (
        described is None
        or described[0] is not loop.options
        or described[1] is not loop.handlers
    ):
        described = loop.described = (
            loop.options,
            loop.handlers,
            options_record(loop.options),
            tuple(callable_name(h) for h in loop.handlers),
        )
    options, handler_names = described[2], described[3]
    return _made(
        LoopRecord,
        version=RECORD_VERSION,
        loop_id=loop.loop_id,
        agent_id=loop.agent_id,
        started_at=loop.started_at,
        input=request_record(loop.input, own, None),
        handlers=handler_names,
        options=options,
        state=loop.state,
        status=loop.status,
        seq=loop.seq,
        path=tuple(loop.path),
        context_items=len(own.items),
        pending=step_record(loop.pending, own, repair),
        step=step_record(loop.step, own, repair),
        pause=None
        if paused is None
        else _made(
            PauseRecord,
            source=paused.pending.source,
            trigger=paused.pending.trigger,
            dest=paused.pending.dest,
            seq=paused.pending.seq,
            payload=payload_record(paused.pending.payload, own, repair),
            handler=paused.handler,
            reason=paused.reason,
            original_dest=paused.original_dest,
        ),
        resume=None
        if resumed is None
        else _made(
            ResumeRecord,
            decision=decision_record(resumed.decision, own, repair),
            handler=resumed.handler,
            original_dest=resumed.original_dest,
        ),
        model_requests=loop.model_requests,
        tool_calls=loop.tool_calls,
        structured_failures=loop.structured_failures,
        usage=loop.usage,
        steering=tuple(loop.steering or ()),
        follow_ups=tuple(loop.follow_ups or ()),
        turn=_made(
            TurnRecord,
            request=request_record(loop.request, own, repair, copy=False),
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


_REQUEST_DATA: Final = {"model", "context", "tools", "structured_output"}

_Static = tuple[
    "weakref.ref[InferenceInput]",
    dict[str, Any],
    tuple[str, ...],
    tuple[str, ...],
    Any,
    list[Any],
]
_STATIC: dict[int, _Static] = {}
"""What a request's record takes from the request alone (its settings as JSON,
its tools' names and digests, its structured output), by the request's id,
while the request lives (a weak reference: the cache never keeps a request,
and its context, alive; the entry goes with it). A loop's requests are few
and made once; bounded, for runtimes that make many.

Its last item is the request's last record on its own context, with the
context's size and instructions then: a loop's record holds the same request
three times (its input, the turn's request, an inference step's payload), and
the next commit's often once more. Made once each, a record took ~1 µs less a
request (~20 µs a run of the benchmark's 10 records)."""
_STATIC_KEPT: Final = 4096


def request_record(
    request: InferenceInput,
    own: Any,
    repair: RequestMetadata | None,
    *,
    copy: bool = True,
) -> RequestRecord:
    """An `InferenceInput` as data (`own` is the loop's context; `repair`, the
    metadata of the loop's last request, says how a repaired copy was made).

    `copy=False` (the turn's last request, whose tools and settings are what
    the loop uses of it) never copies a context that is not the loop's own:
    restored, the request has the loop's own context.
    """
    static = _STATIC.get(id(request))
    if static is None or static[0]() is not request:
        static = _static(request)
    _, settings, tools, digests, schema, last = static
    context = request.context
    items = context.items
    own_context = context is own
    if (
        own_context
        and last
        and last[0] == len(items)
        and last[1] is context.instructions
    ):
        record: RequestRecord = last[2]
        return record
    repairs = None
    copied = None
    if not own_context:
        if (
            repair is not None
            and repair.repairs
            and len(items) == repair.history_count + len(repair.repairs)
        ):
            # The loop's own context with synthetic outputs: recorded as the
            # repairs, not a copy of the whole context at every commit.
            repairs = repair.repairs
        elif copy:
            copied = tuple(items)  # a copy a handler made
    record = _made(
        RequestRecord,
        kind="request",
        model=request.model,
        settings=settings,
        tools=tools,
        tool_schemas=digests,
        structured_output=schema,
        instructions=context.instructions,
        context_items=len(items),
        own_context=own_context,
        repairs=repairs,
        items=copied,
    )
    if own_context:
        last[:] = (len(items), context.instructions, record)
    return record


def _static(request: InferenceInput) -> _Static:
    schema = request.structured_output
    key = id(request)
    static: _Static = (
        weakref.ref(request, partial(_forget, key)),
        request.model_dump(mode="json", exclude=_REQUEST_DATA),
        tuple(t.name for t in request.tools),
        tuple(schema_digest(t) for t in request.tools),
        schema if schema is None or isinstance(schema, dict) else callable_name(schema),
        [],
    )
    if len(_STATIC) >= _STATIC_KEPT:
        del _STATIC[next(iter(_STATIC))]  # the oldest
    _STATIC[key] = static
    return static


def _forget(key: int, _: object = None) -> None:
    """A request was freed: its entry goes (unless its id was reused since)."""
    static = _STATIC.get(key)
    if static is not None and static[0]() is None:
        del _STATIC[key]


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
    if len(_DIGESTS) >= _STATIC_KEPT:
        del _DIGESTS[next(iter(_DIGESTS))]
    _DIGESTS[id(definition)] = (definition, digest)
    return digest


def _wall(deadline_at: float) -> datetime:
    """A deadline on anyio's clock as a wall-clock time."""
    return datetime.now(UTC) + timedelta(seconds=deadline_at - anyio.current_time())


def payload_record(
    payload: TransitionPayload, own: Any, repair: RequestMetadata | None
) -> PayloadRecord:
    """A transition's payload as data."""
    if isinstance(payload, InferenceInput):
        return request_record(payload, own, repair)
    if isinstance(payload, tuple):
        return _made(MessagesRecord, kind="messages", messages=payload)
    return payload


def step_record(
    step: Step | None, own: Any, repair: RequestMetadata | None
) -> StepRecord | None:
    if step is None:
        return None
    trigger, payload, reason = step
    return _made(
        StepRecord,
        trigger=trigger,
        payload=payload_record(payload, own, repair),
        reason=reason,
    )


def decision_record(
    decision: Decision, own: Any, repair: RequestMetadata | None
) -> DecisionRecord:
    if isinstance(decision, Rewrite):
        return DecisionRecord(
            kind="rewrite",
            dest=decision.dest,
            payload=payload_record(decision.payload, own, repair),
        )
    return DecisionRecord(kind=decision.kind, reason=getattr(decision, "reason", None))
