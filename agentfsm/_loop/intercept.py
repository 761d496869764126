"""Interception, as the loop runs it: handlers, decisions, rewrites, pauses.

`intercept` runs a loop's handlers on the step the last state proposed and
applies their decisions (see `agentfsm.interception` for the public side): a
rewrite must name an edge leaving the source and a payload that fits it, a
pause parks the loop (`loop.paused`, with the step kept as `loop.pending`), an
abort raises `LoopAborted`. Every decision is published and logged.

A rewrite that changes the edge drops the step's reason (`max_turns`, say): the
reason belongs to the edge the state chose, so a loop that a handler sends on
past its limit ends by the edges it takes afterwards.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from agentfsm._machine import ALLOWED
from agentfsm.exceptions import LoopAborted, TransitionRejected
from agentfsm.inference import InferenceInput
from agentfsm.interception import (
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
from agentfsm.messages import ModelMessageItem, UserMessage
from agentfsm.record import callable_name
from agentfsm.results import LoopStatus
from agentfsm.states import LoopState, Trigger

from .steps import _T, Step
from .turn import infer_step, request_metadata

if TYPE_CHECKING:
    from .loop import Loop

__all__ = ("Paused", "Resumed", "approval_gate", "intercept")


class Paused(NamedTuple):
    """Why and where a loop waits (its step is kept as `loop.pending`)."""

    pending: PendingTransition
    """The transition as the pausing handler saw it."""
    handler: int
    """The handler that paused: resuming continues with the handlers after it."""
    reason: str
    original_dest: LoopState
    """Where the step led before any handler rewrote it."""


class Resumed(NamedTuple):
    """The decision a paused loop was resumed with, until the driver applies it."""

    decision: Decision
    handler: int
    """The handler whose `Pause` the decision replaces."""
    original_dest: LoopState


_DECISIONS: Final = (Proceed, Rewrite, Pause, Abort)

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
    """The transition as a handler sees it."""
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
    loop: Loop, source: LoopState, step: Step, dest: LoopState
) -> tuple[Step, LoopState, LoopState | None] | None:
    """Run the handlers on `step`; return the step to take, its destination and
    the destination before a rewrite (None when unchanged), or None when the
    loop paused."""
    original = dest
    trigger, payload, reason = step
    start = 0
    resumed: Decision | None = None
    if loop.resumed is not None:
        resumed, start, original = loop.resumed
        loop.resumed = None
    handlers = loop.handlers
    stop = len(handlers) if resumed is None else max(len(handlers), start + 1)
    for index in range(start, stop):
        if resumed is not None:
            decision: Decision | None = resumed
            handler_index = -1
            resumed = None
        else:
            pending = pending_of(loop, source, trigger, dest, payload)
            decision = await call_handler(handlers[index], pending)
            handler_index = index
            if (
                loop.journal is not None
                and (decision is not None or trigger is _T.call_tools)
                and (decision is None or isinstance(decision, _DECISIONS))
            ):
                # Stored with the commit of the transition, before it acts: a
                # handler's decision, and who let a batch of calls through.
                from .snapshot import decision_entry

                name = callable_name(handlers[index])
                entry = decision_entry(loop, pending, name, decision)
                loop.journal.store_decision(entry)
        match decision:
            case None | Proceed():
                publish_decision(loop, source, trigger, dest, handler_index, "proceed")
            case Rewrite():
                new_trigger, new_dest, payload = rewrite(
                    loop, source, trigger, dest, payload, decision
                )
                # The event names the edge proposed to the handler, and its choice.
                publish_decision(
                    loop,
                    source,
                    trigger,
                    dest,
                    handler_index,
                    "rewrite",
                    new_dest=new_dest,
                    payload=loop.event_payload(payload),
                )
                if new_trigger is not trigger:
                    reason = None  # the edge's reason goes with it
                trigger, dest = new_trigger, new_dest
            case Pause(reason=why):
                publish_decision(
                    loop, source, trigger, dest, handler_index, "pause", reason=why
                )
                park(
                    loop,
                    (trigger, payload, reason),  # the step keeps its own reason
                    pending_of(loop, source, trigger, dest, payload),
                    index,
                    why,
                    original,
                )
                return None
            case Abort(reason=why):
                publish_decision(
                    loop, source, trigger, dest, handler_index, "abort", reason=why
                )
                raise LoopAborted(why)
            case _:
                raise TypeError(
                    f"interception handler returned {decision!r}; expected "
                    "Proceed, Rewrite, Pause, Abort or None"
                )
    return (trigger, payload, reason), dest, (None if original is dest else original)


def publish_decision(
    loop: Loop,
    source: LoopState,
    trigger: Trigger,
    dest: LoopState,
    handler: int,
    decision: str,
    **fields: Any,
) -> None:
    """Log and publish a handler's decision."""
    loop.log.info(
        "transition_intercepted",
        source=source,
        trigger=trigger,
        dest=dest,
        decision=decision,
        handler=handler,
        **{k: v for k, v in fields.items() if k == "reason" or k == "new_dest"},
    )
    loop.emit(
        "transition.intercepted",
        source=source,
        trigger=trigger,
        dest=dest,
        decision=decision,
        handler=handler,
        **fields,
    )


def park(
    loop: Loop,
    step: Step,
    pending: PendingTransition,
    index: int,
    reason: str,
    original: LoopState,
) -> None:
    """Pause the loop at `step` (the driver returns; `Loop.resume` continues it)."""
    loop.pending = step
    loop.paused = Paused(pending, index, reason, original)
    loop.status = LoopStatus.paused
    loop.emit(
        "loop.paused",
        source=pending.source,
        trigger=pending.trigger,
        dest=pending.dest,
        reason=reason,
        payload=loop.event_payload(pending.payload),
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
        if isinstance(payload, InferenceInput):
            return payload
        # The request the loop would make itself: repaired, its forced tool
        # choice released after the first request.
        return infer_step(loop)[1]
    if trigger in ANSWER_TRIGGERS:
        # Out of `inference`, the output's message; out of `model_message`, the
        # message that state wrote (an answer that failed validation, say).
        output = loop.output
        message = output.message if output is not None else loop.message
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
