"""What a replay takes from a loop's recorded events: its start, the model's
outputs by request number, the tools' outputs, the decisions it was resumed
with, and how it failed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from agentfsm.events import (
    AgentEvent,
    FunctionCallCompleted,
    FunctionCallStarted,
    InferenceCompleted,
    InferenceStream,
    LoopFailed,
    LoopIdle,
    LoopPaused,
    LoopStarted,
    LoopTransition,
    RequestSummary,
    TransitionIntercepted,
)
from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import InferenceOutput, StreamingDelta
from agentfsm.interception import Abort, Decision, Pause, Proceed, Rewrite, ToolBatch
from agentfsm.states import LoopState, Trigger

__all__ = ("Invocation", "Recording", "loop_events")


@dataclass(slots=True)
class Invocation:
    """One tool call that ran (it has a `function_call.started`), as recorded."""

    call_id: str
    arguments: str
    output: str = ""
    is_error: bool = False
    terminate: bool = False
    """Not an event field: inferred when the batch ended the loop (`stop`,
    reason `terminated`: every call of the batch asked to)."""
    used: bool = False


@dataclass(slots=True)
class Request:
    """One model request as recorded: its chunks (streaming) and its output."""

    deltas: list[StreamingDelta] = field(default_factory=list)
    output: InferenceOutput | None = None


@dataclass(slots=True)
class Recording:
    """One loop's events, read for a replay."""

    events: tuple[AgentEvent, ...]
    started: LoopStarted
    requests: list[Request]
    invocations: dict[str, list[Invocation]]
    """By tool name, in the order the calls started."""
    resumes: list[Decision]
    """The decision each pause was resumed with, in order."""
    approvals: set[tuple[str, str]]
    """`(tool, arguments)` of the calls a paused batch awaited approval for."""
    failed: LoopFailed | None
    idle: LoopIdle | None

    @property
    def loop_id(self) -> str:
        return self.started.loop_id

    @classmethod
    def of(cls, events: Sequence[AgentEvent]) -> Recording:
        """Read one loop's events (seq 1, 2, 3, ... from `loop.started`).

        Raises:
            ConfigurationError: the events do not start with `loop.started`,
                have holes, or were written before `loop.started` carried the
                request.
        """
        if not events or not isinstance(events[0], LoopStarted):
            raise ConfigurationError(
                "a recording starts with the loop's loop.started event (seq 1)"
            )
        started = events[0]
        for expected, event in enumerate(events, 1):
            if event.seq != expected:
                raise ConfigurationError(
                    f"the recording of loop {started.loop_id} is incomplete: "
                    f"seq {expected} is missing (found {event.seq})"
                )
        if started.request is None:
            raise ConfigurationError(
                f"loop {started.loop_id}'s loop.started carries no request: it was "
                "recorded by a version of agentfsm that did not log one"
            )
        recording = cls(tuple(events), started, [], {}, [], set(), None, None)
        recording._read()
        return recording

    def _read(self) -> None:
        by_call: dict[str, list[Invocation]] = {}
        batch: list[Invocation] = []
        after_resume = False
        for event in self.events:
            if isinstance(event, LoopTransition):
                if event.trigger in (Trigger.infer, Trigger.infer_streaming):
                    self.requests.append(Request())
                elif event.trigger is Trigger.call_tools:
                    batch = []
            elif isinstance(event, InferenceStream) and self.requests:
                self.requests[-1].deltas.append(event.delta)
            elif isinstance(event, InferenceCompleted):
                if not self.requests or self.requests[-1].output is not None:
                    self.requests.append(Request())  # a retry for structured output
                self.requests[-1].output = event.output
            elif isinstance(event, FunctionCallStarted):
                call = event.call
                invocation = Invocation(call.call_id, call.arguments)
                self.invocations.setdefault(call.name, []).append(invocation)
                by_call.setdefault(call.call_id, []).append(invocation)
                batch.append(invocation)
            elif isinstance(event, FunctionCallCompleted):
                pending = [i for i in by_call.get(event.call.call_id, ()) if not i.used]
                if pending:  # a call that ran (denied ones never started)
                    pending[0].output = event.output.output
                    pending[0].is_error = event.output.is_error
                    pending[0].used = True
            elif isinstance(event, LoopPaused):
                payload = event.payload
                if isinstance(payload, ToolBatch):
                    self.approvals.update(
                        (c.name, c.arguments)
                        for c in payload.calls
                        if c.call_id in payload.awaiting_approval
                    )
            elif event.type == "loop.resumed":
                after_resume = True
                continue
            elif isinstance(event, TransitionIntercepted) and after_resume:
                self.resumes.append(_decision(event))
            elif isinstance(event, LoopFailed):
                self.failed = event
            elif isinstance(event, LoopIdle):
                self.idle = event
                if event.reason == "terminated" and batch:
                    for invocation in batch:
                        invocation.terminate = True
            after_resume = False
        # `used` paired each output with its call while reading; a replay
        # uses it again to serve each recorded output once.
        for invocations in self.invocations.values():
            for invocation in invocations:
                invocation.used = False


def _decision(event: TransitionIntercepted) -> Decision:
    """The decision a `resume` gave, from the event it published."""
    if event.decision == "abort":
        return Abort(event.reason or "")
    if event.decision == "pause":
        return Pause(event.reason or "")
    if event.decision == "rewrite":
        payload = event.payload
        dest: LoopState | None = event.new_dest
        if isinstance(payload, RequestSummary):
            # Only the request's summary is recorded: the loop makes the
            # request the new edge needs (a rewrite without a payload).
            return Rewrite(dest=dest)
        return Rewrite(dest=dest, payload=payload)
    return Proceed()


def loop_events(events: Sequence[AgentEvent], loop_id: str | None) -> list[AgentEvent]:
    """The events of one loop among `events` (the only loop when `loop_id` is None).

    Raises:
        ConfigurationError: no such loop, or several and `loop_id` is None.
    """
    ids = list(dict.fromkeys(e.loop_id for e in events))
    if loop_id is None:
        if len(ids) != 1:
            found = ", ".join(ids) if ids else "none"
            raise ConfigurationError(
                f"the events hold {len(ids)} loops ({found}): pass loop_id= to "
                "choose one"
            )
        loop_id = ids[0]
    elif loop_id not in ids:
        raise ConfigurationError(
            f"no events of loop {loop_id} (loops: {', '.join(ids) or 'none'})"
        )
    return sorted((e for e in events if e.loop_id == loop_id), key=lambda e: e.seq)
