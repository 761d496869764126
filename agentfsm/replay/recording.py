"""What a replay takes from a loop's recorded events: its start, the model's
outputs by request number, the tools' outputs (and the progress they
reported), the decisions it was resumed with, how it failed, and the events a
run without a crash publishes (what the replay is compared with).

A recovered loop (`Runtime.recover`) goes on from its last commit, and the
recording shows it: the recovering process publishes again from the seq after
that commit (`resolved` keeps its events, not the crashed process's), says
`loop.recovered`, runs the state the loop was in again from its start (a
batch: taking the outputs of the calls its ledger holds as done, a
`function_call.completed` without its `function_call.started`; a model
request: its recorded output), and may pause before a batch over the calls
that were in flight, to be resumed by a person. None of that is the loop's
behaviour, and a replay (one process, no crash) does none of it:
`Recording.expected` leaves it out (with what the crashed process published in
the state run again), `Recording.reused` names the outputs a batch took rather
than ran (the replay runs those calls, and they return them), and
`Recording.recovered` holds the resumes of pauses over calls in flight that
did not let the batch run, which the replay takes at the batch itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from pydantic import JsonValue

from agentfsm.events import (
    AgentEvent,
    FunctionCallCompleted,
    FunctionCallProgress,
    FunctionCallStarted,
    InferenceCompleted,
    InferenceStream,
    LoopFailed,
    LoopIdle,
    LoopPaused,
    LoopRecovered,
    LoopStarted,
    LoopTransition,
    RequestSummary,
    TransitionIntercepted,
)
from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import InferenceOutput, StreamingDelta
from agentfsm.interception import Abort, Decision, Pause, Proceed, Rewrite, ToolBatch
from agentfsm.messages import ImageBlock
from agentfsm.states import LoopState, Trigger

__all__ = ("Invocation", "Recording", "loop_events", "resolved")


@dataclass(slots=True)
class Invocation:
    """One tool call that ran (it has a `function_call.started`), as recorded."""

    call_id: str
    arguments: str
    output: str = ""
    is_error: bool = False
    images: tuple[ImageBlock, ...] = ()
    """The images it returned beside its text (the same blocks: their bytes)."""
    terminate: bool = False
    """Not an event field: inferred when the batch ended the loop (`stop`,
    reason `terminated`: every call of the batch asked to)."""
    progress: list[JsonValue] = field(default_factory=list)
    """What it reported while it ran (`function_call.progress`), in order."""
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
    """As its last run left them (`resolved`): seq 1, 2, 3, ..."""
    started: LoopStarted
    requests: list[Request] = field(default_factory=list)
    invocations: dict[str, list[Invocation]] = field(default_factory=dict)
    """By tool name, in the order the calls started."""
    resumes: list[Decision] = field(default_factory=list)
    """The decision each pause was resumed with, in order (not the pauses a
    recovery made: see `recovered`)."""
    approvals: set[tuple[str, str]] = field(default_factory=set)
    """`(tool, arguments)` of the calls a paused batch awaited approval for."""
    failed: LoopFailed | None = None
    idle: LoopIdle | None = None
    expected: tuple[AgentEvent, ...] = ()
    """`events` as a run without a crash publishes them: what a replay is
    compared with (see the module)."""
    reused: frozenset[int] = frozenset()
    """Indexes in `expected` of the `function_call.completed` of calls whose
    output a recovery took from its ledger (they ran before the crash)."""
    recovered: dict[tuple[int, Trigger], Decision] = field(default_factory=dict)
    """The decision that resumed a pause a recovery made over calls in flight,
    when it did not let the batch run (an abort, a pause), by the model outputs
    the loop had then and the pending trigger (the batch's): a replay, which
    does not pause there, takes it at that batch."""

    @property
    def loop_id(self) -> str:
        return self.started.loop_id

    @classmethod
    def of(cls, events: Sequence[AgentEvent]) -> Recording:
        """Read one loop's events (seq 1, 2, 3, ... from `loop.started`, once
        `resolved`).

        Raises:
            ConfigurationError: the events do not start with `loop.started`,
                have holes, or were written before `loop.started` carried the
                request.
        """
        events = resolved(events)
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
        run = _one_run(events)
        recording = cls(tuple(events), started, expected=tuple(run.expected))
        recording._read(run)
        return recording

    def _read(self, run: _Run) -> None:
        by_call: dict[str, list[Invocation]] = {}
        batch: list[Invocation] = []
        reused: set[int] = set()
        after_resume = False
        # Since a recovery, until the next model output: the batch it runs
        # again takes the outputs of the calls that ran from its ledger.
        recovering = False
        outputs = 0  # model outputs so far: the loop's `model_requests`
        for index, event in enumerate(self.expected):
            if index in run.recovered_at:
                recovering = True
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
                outputs += 1
                recovering = False
            elif isinstance(event, FunctionCallStarted):
                call = event.call
                invocation = Invocation(call.call_id, call.arguments)
                self.invocations.setdefault(call.name, []).append(invocation)
                by_call.setdefault(call.call_id, []).append(invocation)
                batch.append(invocation)
            elif isinstance(event, FunctionCallProgress):
                running = [i for i in by_call.get(event.call_id, ()) if not i.used]
                if running:
                    running[0].progress.append(event.progress)
            elif isinstance(event, FunctionCallCompleted):
                call = event.call
                pending = [i for i in by_call.get(call.call_id, ()) if not i.used]
                if pending:  # a call that ran (denied ones never started)
                    pending[0].output = event.output.output
                    pending[0].is_error = event.output.is_error
                    pending[0].images = event.output.images
                    pending[0].used = True
                elif recovering:
                    # Its output from the ledger (or from the decision that
                    # resumed a pause over it): the replay runs it, and serves
                    # this output. Denied or answered calls do not run, and
                    # never ask for it.
                    invocation = Invocation(
                        call.call_id,
                        call.arguments,
                        event.output.output,
                        event.output.is_error,
                        event.output.images,
                        used=True,
                    )
                    self.invocations.setdefault(call.name, []).append(invocation)
                    batch.append(invocation)
                    reused.add(index)
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
            elif isinstance(event, TransitionIntercepted):
                if index in run.decided_at:
                    self.recovered[outputs, event.trigger] = _decision(event)
                elif after_resume:
                    self.resumes.append(_decision(event))
            elif isinstance(event, LoopFailed):
                self.failed = event
            elif isinstance(event, LoopIdle):
                self.idle = event
                if event.reason == "terminated" and batch:
                    for invocation in batch:
                        invocation.terminate = True
            after_resume = False
        self.reused = frozenset(reused)
        # `used` paired each output with its call while reading; a replay
        # uses it again to serve each recorded output once.
        for invocations in self.invocations.values():
            for invocation in invocations:
                invocation.used = False


@dataclass(slots=True)
class _Run:
    """A loop's events as one run without a crash publishes them."""

    expected: list[AgentEvent] = field(default_factory=list)
    recovered_at: set[int] = field(default_factory=set)
    """Indexes in `expected` where a recovery went on."""
    decided_at: set[int] = field(default_factory=set)
    """Indexes of the decisions that resumed a recovery's pause over calls in
    flight and did not let the batch run (an abort, a pause)."""

    def cut(self, at: int) -> None:
        """Drop the events from `at` on (a recovery publishes them again)."""
        del self.expected[at:]
        self.recovered_at = {i for i in self.recovered_at if i < at}
        self.decided_at = {i for i in self.decided_at if i < at}


def _one_run(events: Sequence[AgentEvent]) -> _Run:
    """`events` without what recovering a loop published (see the module).

    A recovery goes on in the state the loop's last commit entered, running it
    again from its start: what the crashed run published in it before that
    commit (a batch's first calls, a model output) is published again, and
    only the recovering run's counts. A pause over calls in flight goes back
    before the transition into the batch, which its resume takes again.
    """
    run = _Run()
    expected = run.expected
    entered: int | None = None  # the last transition, in `expected`
    parked = resumed = False
    for event in events:
        if isinstance(event, LoopRecovered):
            if event.status == "running" and _in_state(expected, entered):
                assert entered is not None
                run.cut(entered + 1)
            run.recovered_at.add(len(expected))
            continue
        if isinstance(event, LoopPaused) and _parks(event, expected, entered):
            assert entered is not None
            run.cut(entered)
            entered, parked = None, True
            continue
        if parked and event.type == "loop.resumed":
            resumed = True
            continue
        if resumed and isinstance(event, TransitionIntercepted):
            parked = resumed = False
            if event.decision in ("proceed", "rewrite"):
                # The batch runs: what the decision gave its calls in flight
                # (an answer, a denial) is their recorded output.
                continue
            run.decided_at.add(len(expected))
        if isinstance(event, LoopTransition):
            entered = len(expected)
        expected.append(event)
    return run


def _in_state(expected: list[AgentEvent], entered: int | None) -> bool:
    """Whether the loop was in the state its last transition entered (not
    paused after it: a recovery goes on from a pause, not from the state)."""
    return entered is not None and not any(
        e.type in ("loop.paused", "loop.resumed") for e in expected[entered + 1 :]
    )


_CALL_EVENTS: Final = frozenset(
    {"function_call.started", "function_call.progress", "function_call.completed"}
)


def _parks(paused: LoopPaused, expected: list[AgentEvent], entered: int | None) -> bool:
    """Whether `paused` is a recovery's pause over calls in flight: it pauses
    before the transition into the batch, taken already (only call events of
    the crashed run since); a handler's pause comes instead of its transition."""
    if entered is None:
        return False
    last = expected[entered]
    assert isinstance(last, LoopTransition)
    edge = (paused.source, paused.trigger, paused.dest)
    return (last.source, last.trigger, last.dest) == edge and all(
        e.type in _CALL_EVENTS for e in expected[entered + 1 :]
    )


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
    """The events of one loop among `events` (the only loop when `loop_id` is
    None), in the order given (`Recording.of` resolves them).

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
    return [e for e in events if e.loop_id == loop_id]


def resolved(events: Sequence[AgentEvent]) -> list[AgentEvent]:
    """One loop's events as its last run left them, in seq order.

    A recovered loop goes on from its last commit, and the recovering process
    publishes from the seq after it again: what the crashed process published
    past that commit (calls it ran, its `loop.detached`) is not the loop's any
    more. So, in the order the events were published (an event log both
    processes appended to, a `MemoryStore`), an event whose seq goes back
    drops the ones before it from its seq on; in seq order, a seq's last
    event counts. Nothing follows `loop.idle` (in seq order, the crashed run's
    events past the recovered run's end).
    """
    if not any(e.type == "loop.recovered" for e in events):
        return sorted(events, key=_seq)
    kept: list[AgentEvent] = []
    for event in events:
        while kept and kept[-1].seq >= event.seq:
            kept.pop()
        kept.append(event)
    for index, event in enumerate(kept):
        if event.type == "loop.idle":
            return kept[: index + 1]
    return kept


def _seq(event: AgentEvent) -> int:
    return event.seq
