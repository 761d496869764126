"""A loop's record (`agentfsm.record.LoopRecord`) in both directions: taken
from a live loop (`record_of`: `Runtime.snapshot`, and a durable store's write
at every commit), and a loop rebuilt from a stored one (`restore`, with the
callables it names rebound by name through `Bindings`).

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
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
from pydantic import BaseModel

from agentfsm import _models
from agentfsm.exceptions import ConfigurationError, StoreError
from agentfsm.inference import InferenceInput, RequestMetadata
from agentfsm.interception import (
    APPROVAL_GATE,
    Abort,
    Decision,
    Pause,
    PendingTransition,
    Proceed,
    Rewrite,
    TransitionPayload,
)
from agentfsm.messages import ContextItem, FunctionCallOutputItem, ModelContext
from agentfsm.options import LoopOptions
from agentfsm.record import (
    RECORD_VERSION,
    DecisionEntry,
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

from .intercept import Paused, Resumed
from .repair import REPAIRED
from .states.model_message import jsonable

if TYPE_CHECKING:
    from .loop import Loop
    from .steps import Step

__all__ = (
    "Bindings",
    "RecoveryError",
    "decision_entry",
    "record_of",
    "restore",
    "schema_digest",
)

M = TypeVar("M", bound=BaseModel)


def _made(cls: type[M], **values: Any) -> M:
    """`cls` holding `values`, every field of it, without validating them."""
    return _models.trusted(cls, values, _FIELDS[cls])


_FIELDS: Final[dict[type[BaseModel], set[str]]] = {
    cls: set(cls.model_fields)
    for cls in (
        DecisionEntry,
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


def record_of(loop: Loop, *, path: bool = True) -> LoopRecord:
    """The record of a live loop (`path=False`: with its path left empty, for
    a store's commit, which carries the path's new steps instead)."""
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
    # The input's record, for the turn's request and a step's payload too when
    # they are the input (most records: one request record made, not three).
    given = (loop.input, request_record(loop.input, own, None))
    return _made(
        LoopRecord,
        version=RECORD_VERSION,
        loop_id=loop.loop_id,
        agent_id=loop.agent_id,
        started_at=loop.started_at,
        input=given[1],
        handlers=handler_names,
        options=options,
        state=loop.state,
        status=loop.status,
        seq=loop.seq,
        path=tuple(loop.path) if path else (),
        context_items=len(own.items),
        pending=step_record(loop.pending, own, repair, given),
        step=step_record(loop.step, own, repair, given),
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
            request=given[1]
            if loop.request is loop.input
            else request_record(loop.request, own, repair, copy=False),
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
    payload: TransitionPayload,
    own: Any,
    repair: RequestMetadata | None,
    given: tuple[InferenceInput, RequestRecord] | None = None,
) -> PayloadRecord:
    """A transition's payload as data (`given`: the loop's input and its
    record, which it is most often)."""
    if given is not None and payload is given[0]:
        return given[1]
    if isinstance(payload, InferenceInput):
        return request_record(payload, own, repair)
    if isinstance(payload, tuple):
        return _made(MessagesRecord, kind="messages", messages=payload)
    return payload


def step_record(
    step: Step | None,
    own: Any,
    repair: RequestMetadata | None,
    given: tuple[InferenceInput, RequestRecord] | None = None,
) -> StepRecord | None:
    if step is None:
        return None
    trigger, payload, reason = step
    return _made(
        StepRecord,
        trigger=trigger,
        payload=payload_record(payload, own, repair, given),
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


def decision_entry(
    loop: Loop,
    pending: PendingTransition,
    handler: str | None,
    decision: Decision | None,
    by: str | None = None,
) -> DecisionEntry:
    """A decision about `pending` as the store keeps it (`None`: proceed)."""
    return _made(
        DecisionEntry,
        seq=pending.seq,
        source=pending.source,
        trigger=pending.trigger,
        dest=pending.dest,
        handler=handler,
        decision=_PROCEED
        if decision is None
        else decision_record(decision, loop.input.context, loop.metadata),
        by=by,
        at=loop.clock(),
    )


_PROCEED: Final = DecisionRecord(kind="proceed")


# ------------------------------------------------------------------ restore


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


def stored_decision(
    record: LoopRecord, context: ModelContext, bindings: Bindings, data: DecisionRecord
) -> Decision:
    """A decision as the store keeps it (`DecisionRecord`), back as the loop of
    `record` takes it: a request's from the store's inbox, say."""
    return _Rebuild(record, context, bindings).decision(data)


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
    record: LoopRecord,
    items: Sequence[ContextItem],
    bindings: Bindings,
    make: Callable[[InferenceInput, tuple[Any, ...], LoopOptions], Loop],
) -> Loop:
    """The loop of a stored record and context, as it was at its last commit
    (no task, no event published): the inverse of `record_of`; `make` builds a
    `Loop` of the runtime's.

    Raises:
        RecoveryError: a tool or callable is missing or changed.
    """
    context = ModelContext(instructions=record.input.instructions)
    context.items.extend(items)  # validated when they were stored
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
