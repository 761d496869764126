"""Interception, as the loop runs it: handlers, decisions, rewrites, pauses.

`intercept` runs a loop's handlers on a pending transition and applies their
decisions (see `agentfsm.interception` for the public side): a rewrite must
name an edge leaving the source and a payload that fits it, a pause parks the
loop, an abort raises `LoopAborted`. Every decision is published and logged.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Final

from ._machine import ALLOWED
from ._states import _T, request_metadata
from .exceptions import LoopAborted, TransitionRejected
from .inference import InferenceInput
from .interception import (
    Abort,
    Decision,
    InterceptionHandler,
    Pause,
    PendingTransition,
    Proceed,
    Rewrite,
    ToolBatch,
    TransitionPayload,
)
from .messages import ModelMessageItem, UserMessage
from .results import LoopStatus
from .states import LoopState, Trigger

if TYPE_CHECKING:
    from ._loop import Loop
    from .events import EventPayload

__all__ = ("approval_gate", "event_payload", "intercept")

MESSAGE_TRIGGERS: Final = frozenset({_T.start, _T.steer, _T.follow_up})
REQUEST_TRIGGERS: Final = frozenset({_T.infer, _T.infer_streaming})
ANSWER_TRIGGERS: Final = frozenset({_T.answer, _T.finish})


def pending_of(
    loop: Loop,
    source: LoopState,
    trigger: Trigger,
    dest: LoopState,
    payload: TransitionPayload,
) -> PendingTransition:
    return PendingTransition(
        loop_id=loop.loop_id,
        agent_id=loop.agent_id,
        seq=loop.seq + 1,
        source=source,
        trigger=trigger,
        dest=dest,
        payload=payload,
        model_requests=loop.model_requests,
        tool_calls=loop.tool_calls,
        usage=loop.usage,
        metadata=request_metadata(loop) if trigger in REQUEST_TRIGGERS else None,
    )


def approval_gate(pending: PendingTransition) -> Decision | None:
    """Pause a batch holding calls that need approval (runs as the first handler).

    The batch lists them in `awaiting_approval`; resuming approves every one
    the resuming decision did not deny.
    """
    batch = pending.payload
    if pending.trigger is not _T.call_tools or not isinstance(batch, ToolBatch):
        return None
    waiting = [c for c in batch.calls if c.call_id in batch.awaiting_approval]
    if not waiting:
        return None
    names = ", ".join(sorted({c.name for c in waiting}))
    return Pause(f"approval required: {names}")


async def intercept(
    loop: Loop,
    source: LoopState,
    trigger: Trigger,
    dest: LoopState,
    payload: TransitionPayload,
) -> tuple[Trigger, LoopState, TransitionPayload, LoopState] | None:
    """Run the handlers; return the edge to take, or None when the loop paused."""
    original = dest
    start = 0
    resumed: Decision | None = None
    if loop._resume is not None:
        resumed, start, original = loop._resume
        loop._resume = None
    stop = (
        len(loop._handlers) if resumed is None else max(len(loop._handlers), start + 1)
    )
    for index in range(start, stop):
        if resumed is not None:
            decision: Decision | None = resumed
            handler_index = -1
            resumed = None
        else:
            pending = pending_of(loop, source, trigger, dest, payload)
            decision = await call_handler(loop._handlers[index], pending)
            handler_index = index
        match decision:
            case None | Proceed():
                decided(loop, source, trigger, dest, handler_index, "proceed")
            case Rewrite():
                new_trigger, new_dest, payload = rewrite(
                    loop, source, trigger, dest, payload, decision
                )
                # The event names the edge proposed to the handler, and its choice.
                decided(
                    loop,
                    source,
                    trigger,
                    dest,
                    handler_index,
                    "rewrite",
                    new_dest=new_dest,
                    payload=event_payload(loop, payload),
                )
                trigger, dest = new_trigger, new_dest
            case Pause(reason=reason):
                decided(
                    loop, source, trigger, dest, handler_index, "pause", reason=reason
                )
                park(
                    loop,
                    pending_of(loop, source, trigger, dest, payload),
                    index,
                    reason,
                    original,
                )
                return None
            case Abort(reason=reason):
                decided(
                    loop, source, trigger, dest, handler_index, "abort", reason=reason
                )
                raise LoopAborted(reason)
            case _:
                raise TypeError(
                    f"interception handler returned {decision!r}; expected "
                    "Proceed, Rewrite, Pause, Abort or None"
                )
    return trigger, dest, payload, original


def decided(
    loop: Loop,
    source: LoopState,
    trigger: Trigger,
    dest: LoopState,
    handler: int,
    decision: str,
    **fields: Any,
) -> None:
    loop._log.info(
        "transition_intercepted",
        source=source,
        trigger=trigger,
        dest=dest,
        decision=decision,
        handler=handler,
        **{k: v for k, v in fields.items() if k == "reason" or k == "new_dest"},
    )
    loop._emit(
        "transition.intercepted",
        source=source,
        trigger=trigger,
        dest=dest,
        decision=decision,
        handler=handler,
        **fields,
    )


def park(
    loop: Loop, pending: PendingTransition, index: int, reason: str, original: LoopState
) -> None:
    loop._paused = (pending, index, reason, original)
    loop.status = LoopStatus.paused
    loop._emit(
        "loop.paused",
        source=pending.source,
        trigger=pending.trigger,
        dest=pending.dest,
        reason=reason,
        payload=event_payload(loop, pending.payload),
    )


def rewrite(
    loop: Loop,
    source: LoopState,
    trigger: Trigger,
    dest: LoopState,
    payload: TransitionPayload,
    rewrite: Rewrite,
) -> tuple[Trigger, LoopState, TransitionPayload]:
    new_dest = rewrite.dest if rewrite.dest is not None else dest
    new_trigger = trigger if new_dest is dest else ALLOWED[source].get(new_dest)
    if new_trigger is None:
        legal = ", ".join(f"{d} (via {t})" for d, t in ALLOWED[source].items())
        raise TransitionRejected(
            f"illegal rewrite of {source} --{trigger}--> {dest}: there is no edge from "
            f"{source} to {new_dest} (legal destinations: {legal})",
            loop_id=loop.loop_id,
            source=source,
            trigger=trigger,
            dest=new_dest,
        )
    new_payload = rewrite.payload
    if new_payload is None and new_trigger is trigger:
        new_payload = payload
    elif new_payload is None:
        new_payload = derived_payload(loop, new_trigger, payload)
    problem = payload_problem(new_trigger, new_payload)
    if problem is not None:
        raise TransitionRejected(
            f"illegal rewrite of {source} --{trigger}--> {dest}: {problem}",
            loop_id=loop.loop_id,
            source=source,
            trigger=trigger,
            dest=new_dest,
        )
    return new_trigger, new_dest, new_payload


def derived_payload(
    loop: Loop, trigger: Trigger, payload: TransitionPayload
) -> TransitionPayload:
    """The payload a changed edge acts on when the rewrite did not give one."""
    if trigger in REQUEST_TRIGGERS:
        return payload if isinstance(payload, InferenceInput) else loop.input
    if trigger in ANSWER_TRIGGERS:
        message = loop._output.message if loop._output is not None else None
        return message or ModelMessageItem(content="")
    return None  # steer / follow_up with nothing queued, stop; call_tools is rejected


async def call_handler(
    handler: InterceptionHandler, pending: PendingTransition
) -> Decision | None:
    result = handler(pending)
    if inspect.isawaitable(result):
        result = await result
    return result


def payload_problem(trigger: Trigger, payload: TransitionPayload) -> str | None:
    """Why `payload` cannot go with `trigger`, or None when it can."""
    if trigger in MESSAGE_TRIGGERS:
        ok = (
            payload is None
            or isinstance(payload, UserMessage)
            or (
                isinstance(payload, tuple)
                and all(isinstance(m, UserMessage) for m in payload)
            )
        )
        expected = "a UserMessage, a tuple of them, or None"
    elif trigger in REQUEST_TRIGGERS:
        ok, expected = isinstance(payload, InferenceInput), "an InferenceInput"
    elif trigger is _T.call_tools:
        ok, expected = isinstance(payload, ToolBatch), "a ToolBatch"
    elif trigger in ANSWER_TRIGGERS:
        ok, expected = isinstance(payload, ModelMessageItem), "a ModelMessageItem"
    else:
        return None
    if ok:
        return None
    return f"{trigger} needs {expected} as payload, got {type(payload).__name__}"


def event_payload(loop: Loop, payload: TransitionPayload) -> EventPayload | None:
    """A payload as events record it (None while nobody listens: no event is built)."""
    if not loop._bus.listening:
        return None
    if isinstance(payload, InferenceInput):
        from .events import RequestSummary  # imported by `subscribe` already

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
