"""Replay a recorded loop, and fork one: record once, re-drive in CI.

`replay` re-drives a loop from its recorded events (a JSONL event log, or the
events themselves) with the recorded model outputs and the recorded tool
outputs: no network, no tool side effects. It compares what the replayed loop
publishes with what was recorded and reports the first divergence: where
(`seq`), the recorded edge, the replayed one, and how the payloads differ.

```python
async def test_the_recorded_run_still_holds() -> None:
    report = await replay("tests/recordings/refund.jsonl", handlers=[policy])
    assert not report.diverged, report.describe()
```

`fork` continues a recorded loop live from one of its model requests, in the
runtime of the current context: with another model, or a request changed by
`edit`; its `loop.started` records `forked_from`.

What a replay needs is in the events (`loop.started` carries the request, its
context and tools, the options and the handlers by name); the callables are
not data, so they are given again:

- `handlers`: a list replaces the recorded handlers (what a test of a changed
  handler passes); a mapping rebinds the recorded names (`module:qualname`, or
  the bare qualname). Recorded handlers left unbound are an error.
- `tools`: a tool given replaces the recorded spec of its name (a changed
  schema then shows as a divergence of `loop.started`); its function never
  runs. Without it, the recorded spec is used.
- `options`: overrides of the recorded options; callables the recording names
  (`stop_when`, wrappers, `finish_turn`) must be given here.

What it compares, and what it leaves out, is in `agentfsm.replay._compare`:
the envelope (`event_id`, `loop_id`, `seq`, `ts`), durations, handlers'
`proceed` decisions and the deciding handler's index differ by design, and so
does the order the calls of a parallel batch interleave in (a batch is
compared call by call). A loop a durable runtime recovered replays as one run
without a crash (`agentfsm.replay.recording`: what the recovery published is
read as such, not compared).

Limits: steering and follow-up messages queued from outside the loop are not
in the events, and nor is a `Runtime.cancel` mid-run; a recording that has
them diverges there. A resume that rewrote a request is replayed as a rewrite
without a payload (only the request's summary is recorded).

Images replay with their recorded bytes: a loop's message and its context
hold them, and a recorded tool returns the images it returned (a store reads
them from its blobs, an event log from its images' directory); events are
compared with each image as its digest.

A source is anything with `async def loop_events(loop_id) -> Sequence[AgentEvent]`
(`ReplaySource`): `EventLogSource` reads a log, and a durable store can serve
its events the same way (`store.events(loop_id, after_seq=0)`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, InstanceOf, JsonValue

from agentfsm._bus.started import FORKED_FROM, rebound, request_of
from agentfsm._models import read_fields_fast
from agentfsm.eventlog import read_events
from agentfsm.events import AgentEvent, ForkOrigin, LoopPaused, LoopTransition
from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import InferenceInput
from agentfsm.interception import (
    APPROVAL_GATE,
    Abort,
    Decision,
    InterceptionHandler,
    PendingTransition,
)
from agentfsm.messages import ModelContext
from agentfsm.options import LoopOptionsDict
from agentfsm.providers import OneProviderRegistry
from agentfsm.results import LoopResult, PathStep
from agentfsm.states import Trigger
from agentfsm.tools import Tool

from ._compare import edge_of, first_mismatch
from ._doubles import ReplayProvider, recorded_tools
from .recording import Recording, loop_events

if TYPE_CHECKING:
    from agentfsm._runtime import Runtime

__all__ = (
    "Difference",
    "Divergence",
    "EventLogSource",
    "ReplayReport",
    "ReplaySource",
    "fork",
    "replay",
)

_CALLABLE_OPTIONS = ("stop_when", "tool_wrappers", "model_wrappers", "finish_turn")


class Difference(BaseModel):
    """One value that differs between a recorded event and the replayed one."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    path: str
    """Where in the event, dotted (`call.arguments`, `output.items[0].content`)."""
    expected: JsonValue
    """The recorded value (JSON data)."""
    actual: JsonValue
    """The replayed value."""


class Divergence(BaseModel):
    """The first place a replay differs from its recording."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    seq: int
    """The recorded event's seq (one past the recording's last when it ended first)."""
    actual_seq: int
    """The replayed event's seq (they differ when handlers' decisions shift them)."""
    expected: PathStep | None
    """The recorded transition the event belongs to (None: the recording had ended)."""
    actual: PathStep | None
    """The replayed transition (None: the replay had ended)."""
    expected_event: AgentEvent | None
    actual_event: AgentEvent | None
    differences: tuple[Difference, ...] = ()
    """Field by field, where both events exist (20 at most)."""

    def describe(self) -> str:
        """The divergence in a few lines."""
        lines = [
            (
                f"diverged at seq {self.seq}: expected {_event_text(self.expected_event)}"
                f" in {_edge_text(self.expected)}, got {_event_text(self.actual_event)}"
                f" in {_edge_text(self.actual)}"
            )
        ]
        lines.extend(
            f"  {d.path}: {d.expected!r} -> {d.actual!r}" for d in self.differences
        )
        return "\n".join(lines)


class ReplayReport(BaseModel):
    """What `replay` found."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    loop_id: str
    """The recorded loop."""
    replay_loop_id: str
    """The replayed loop (a new id)."""
    divergence: Divergence | None
    """The first divergence, or None when the replay matched the recording."""
    result: LoopResult
    """How the replayed loop ended."""
    events: tuple[AgentEvent, ...]
    """The replayed loop's events."""
    requests: tuple[InstanceOf[InferenceInput], ...] = ()
    """The model requests the replayed loop made (answered from the recording)."""

    @property
    def diverged(self) -> bool:
        """Whether the replay differs from the recording."""
        return self.divergence is not None

    def describe(self) -> str:
        """One line when it matched; the divergence otherwise."""
        if self.divergence is None:
            return (
                f"replay of {self.loop_id}: no divergence "
                f"({len(self.events)} events, {self.result.outcome})"
            )
        return f"replay of {self.loop_id}: {self.divergence.describe()}"


@runtime_checkable
class ReplaySource(Protocol):
    """Where a replay reads a loop's recorded events from."""

    async def loop_events(self, loop_id: str | None) -> Sequence[AgentEvent]:
        """The events of loop `loop_id` (the only one when None), in seq order
        or in the order they were published (a recovered loop's events may
        repeat a seq: the later ones count).

        Raises:
            ConfigurationError: no such loop, or several and `loop_id` is None.
        """
        ...


class EventLogSource:
    """A JSONL event log (`Runtime(event_log=...)`) as a replay source."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path

    async def loop_events(self, loop_id: str | None) -> Sequence[AgentEvent]:
        """The loop's events in the log (read in a worker thread)."""
        events = await anyio.to_thread.run_sync(lambda: list(read_events(self.path)))
        return loop_events(events, loop_id)


class _EventList:
    def __init__(self, events: Sequence[AgentEvent]) -> None:
        self.events = events

    async def loop_events(self, loop_id: str | None) -> Sequence[AgentEvent]:
        return loop_events(self.events, loop_id)


def _source(source: object) -> ReplaySource:
    if isinstance(source, str | os.PathLike):
        return EventLogSource(source)
    if isinstance(source, ReplaySource):
        return source
    if isinstance(source, Sequence) and all(isinstance(e, BaseModel) for e in source):
        return _EventList(source)
    raise ConfigurationError(
        "source must be an event log's path, a list of events or a ReplaySource, "
        f"got {type(source).__name__}"
    )


async def replay(
    source: ReplaySource | str | os.PathLike[str] | Sequence[AgentEvent],
    *,
    loop_id: str | None = None,
    tools: Sequence[Tool] = (),
    handlers: Sequence[InterceptionHandler]
    | Mapping[str, InterceptionHandler]
    | None = None,
    options: LoopOptionsDict | None = None,
    structured_output: type[BaseModel] | dict[str, Any] | None = None,
) -> ReplayReport:
    """Re-drive a recorded loop with the recorded model and tool outputs, and
    report the first place it differs from the recording.

    It runs in a runtime of its own (no network: every model is answered from
    the recording; no tool function runs). A pause is resumed with the
    decision the recording was resumed with; a recording that ended paused
    ends the replay the same way (cancelled as its runtime closes).

    Args:
        source: an event log's path, a list of events, or a `ReplaySource`.
        loop_id: which loop of the source (needed when it holds several).
        tools: tools to offer in place of the recorded specs of their names.
        handlers: a list to run instead of the recorded handlers, or a mapping
            from the recorded names to the handlers to bind.
        options: loop options overriding the recorded ones (and the callables
            the recording names).
        structured_output: the class the recording names, if it used one.

    Raises:
        ConfigurationError: the source holds no such loop, the recording cannot
            be replayed (no `loop.started` request), or a callable it names was
            not given (the error names it).
    """
    recording = Recording.of(await _source(source).loop_events(loop_id))
    given = _given(recording, tools)
    request, chosen, loop_options = _setup(
        recording,
        recorded_tools(recording, given),
        handlers,
        options,
        structured_output,
    )
    provider = ReplayProvider(recording)
    events, result, replay_id = await _run(
        recording, request, chosen, loop_options, provider
    )
    return ReplayReport(
        loop_id=recording.loop_id,
        replay_loop_id=replay_id,
        divergence=_divergence(recording, events),
        result=result,
        events=tuple(events),
        requests=tuple(provider.requests),
    )


def _given(recording: Recording, tools: Sequence[Tool]) -> dict[str, Tool]:
    """The tools given, by name (each one the recorded request offered)."""
    started = recording.started
    assert started.request is not None
    if isinstance(tools, Tool) or not all(isinstance(t, Tool) for t in tools):
        raise ConfigurationError("tools must be a list of Tool objects")
    given = {t.name: t for t in tools}
    offered = {spec.name for spec in started.request.tools}
    extra = sorted(set(given) - offered)
    if extra:
        raise ConfigurationError(
            f"tools the recorded request did not offer: {', '.join(extra)} "
            f"(it offered: {', '.join(sorted(offered)) or 'none'})"
        )
    return given


def _setup(
    recording: Recording,
    tools: Mapping[str, Tool],
    handlers: Sequence[InterceptionHandler] | Mapping[str, InterceptionHandler] | None,
    options: LoopOptionsDict | None,
    structured_output: type[BaseModel] | dict[str, Any] | None,
    *,
    model: str | None = None,
) -> tuple[InferenceInput, list[InterceptionHandler], dict[str, Any]]:
    """The request, handlers and options to run the recorded loop with."""
    started = recording.started
    assert started.request is not None
    request = request_of(started.request, tools, structured_output, model=model)
    recorded = [h for h in started.handlers if h != APPROVAL_GATE]
    chosen: list[InterceptionHandler]
    if handlers is None:
        if recorded:
            raise ConfigurationError(
                f"the recording used handlers that were not given: {', '.join(recorded)} "
                "(pass handlers= a mapping from these names, or a list to use instead)"
            )
        chosen = []
    elif isinstance(handlers, Mapping):
        chosen = rebound(recorded, handlers, "handlers")
    else:
        chosen = list(handlers)
    return request, chosen, _options(recording, options or {})


def _options(recording: Recording, given: LoopOptionsDict) -> dict[str, Any]:
    """The recorded options, overridden by `given`; the recorded callables
    must be among `given`."""
    record = recording.started.options
    values: dict[str, Any] = {}
    if record is not None:
        values = record.model_dump()
        missing = [
            name for name in _CALLABLE_OPTIONS if values.get(name) and name not in given
        ]
        if missing:
            names = ", ".join(f"{n} ({values[n]})" for n in missing)
            raise ConfigurationError(
                f"the recording used callables that were not given: {names} "
                "(pass them in options=)"
            )
        for name in _CALLABLE_OPTIONS:
            values.pop(name, None)
    values.update(given)
    return values


async def _run(
    recording: Recording,
    request: InferenceInput,
    handlers: list[InterceptionHandler],
    options: dict[str, Any],
    provider: ReplayProvider,
) -> tuple[list[AgentEvent], LoopResult, str]:
    """Run the loop in a runtime of its own, resuming each pause as recorded."""
    from agentfsm._runtime import Runtime

    started = recording.started
    events: list[AgentEvent] = []
    resumes = iter(recording.resumes)
    if recording.recovered:
        handlers = [*handlers, _as_recovered(recording)]
    runtime = Runtime(providers=OneProviderRegistry(provider), keep_finished=1)
    async with runtime:
        # Subscribed until after the runtime's exit: a loop left paused ends
        # only then (cancelled, as the recording's did), publishing its end.
        subscription = runtime.bus.subscribe(buffer=10**9)
        try:
            loop_id = runtime.run_loop(
                started.agent_id, started.message, request, handlers, **options
            )
            async for event in subscription:
                if event.loop_id != loop_id:
                    continue
                events.append(event)
                if isinstance(event, LoopPaused):
                    decision = next(resumes, None)
                    if decision is None:
                        break  # recorded as left paused: the runtime's exit ends it
                    runtime.resume(loop_id, decision)
                elif event.type == "loop.idle":
                    break
        except BaseException:
            subscription.close()
            raise
    with subscription:
        while subscription.statistics().buffered:
            event = subscription.receive_nowait()
            if event.loop_id == loop_id:
                events.append(event)
    return events, await runtime.wait(loop_id), loop_id


def _as_recovered(recording: Recording) -> InterceptionHandler:
    """The last handler of a replay whose recording was recovered: it decides
    each batch a recovery paused over its calls in flight as the resume did."""
    decisions = dict(recording.recovered)

    def as_resumed_after_recovery(pending: PendingTransition) -> Decision | None:
        """The recorded resume's decision (the replay does not pause there)."""
        return decisions.pop((pending.model_requests, pending.trigger), None)

    return as_resumed_after_recovery


def _divergence(
    recording: Recording, actual: Sequence[AgentEvent]
) -> Divergence | None:
    expected = recording.expected
    mismatch = first_mismatch(expected, actual, recording.reused)
    if mismatch is None:
        return None
    i, j, differences = mismatch
    return Divergence(
        seq=expected[i].seq if i is not None else _past(expected),
        actual_seq=actual[j].seq if j is not None else _past(actual),
        expected=edge_of(expected, i) if i is not None else None,
        actual=edge_of(actual, j) if j is not None else None,
        expected_event=expected[i] if i is not None else None,
        actual_event=actual[j] if j is not None else None,
        differences=tuple(
            Difference(path=path, expected=a, actual=b) for path, a, b in differences
        ),
    )


def _past(events: Sequence[AgentEvent]) -> int:
    """One past the last event's seq."""
    return events[-1].seq + 1 if events else 1


def _event_text(event: AgentEvent | None) -> str:
    return "nothing (ended)" if event is None else f"{event.type} #{event.seq}"


def _edge_text(edge: PathStep | None) -> str:
    if edge is None:
        return "no transition"
    return f"{edge.source} --{edge.trigger}--> {edge.dest}"


# ---------------------------------------------------------------------- fork


async def fork(
    source: ReplaySource | str | os.PathLike[str] | Sequence[AgentEvent],
    at_seq: int,
    *,
    loop_id: str | None = None,
    model: str | None = None,
    edit: Callable[[InferenceInput], InferenceInput] | None = None,
    tools: Sequence[Tool] = (),
    handlers: Sequence[InterceptionHandler]
    | Mapping[str, InterceptionHandler]
    | None = None,
    options: LoopOptionsDict | None = None,
    structured_output: type[BaseModel] | dict[str, Any] | None = None,
    runtime: Runtime | None = None,
    new_loop_id: str | None = None,
) -> str:
    """Start a new loop from a recorded loop's model request, and run it live.

    The recording is replayed (from its own outputs, as `replay` does) up to
    the first model request at or after `at_seq`; the new loop starts from the
    context that request was made with, sends it live (to `model` if given,
    after `edit`), and goes on with the real tools and providers of the
    runtime. Its `loop.started` records `forked_from` (the recorded loop and
    the seq of that request's transition). Returns the new loop's id at once,
    as `run_loop` does.

    Args:
        source: an event log's path, a list of events, or a `ReplaySource`.
        at_seq: a seq of the recorded loop; the fork continues from the first
            model request (`infer` transition) at or after it.
        loop_id: which loop of the source (needed when it holds several).
        model: the model the fork asks (default: the recorded one).
        edit: a function of the `InferenceInput` the fork starts with,
            returning the one to use (another setting, a trimmed context).
        tools: the live tools (every tool the recording offered is needed).
        handlers: as for `replay`; they run in the replay and in the fork.
        options: as for `replay`.
        structured_output: as for `replay`.
        runtime: where the fork runs (default: the current context's).
        new_loop_id: the new loop's id (default: one of the runtime's
            `ids`): a fork made once whatever retries it (the decision
            inbox's, `agentfsm ui`'s) names it, and a durable store refuses
            a second loop of that id (`LoopIdTakenError`, the loop fails).

    Raises:
        ConfigurationError: as `replay`, or no model request at or after
            `at_seq`, or the replay diverged before reaching it, or
            `new_loop_id` is not a new loop's id.
    """
    from agentfsm._runtime import current_runtime

    target = runtime or current_runtime()
    prepared = await _prepare_fork(
        source,
        at_seq,
        loop_id=loop_id,
        model=model,
        edit=edit,
        tools=tools,
        handlers=handlers,
        options=options,
        structured_output=structured_output,
    )
    return prepared.start(target, new_loop_id)


@dataclass(frozen=True, slots=True)
class _PreparedFork:
    """A fork ready to start (`_prepare_fork`): what `run_loop` is given."""

    origin: ForkOrigin
    agent_id: str
    request: InferenceInput
    handlers: list[InterceptionHandler]
    options: dict[str, Any]

    def start(self, runtime: Runtime, new_loop_id: str | None = None) -> str:
        """Start the fork in `runtime` (no await: the caller may act on the
        new loop, say carry a request into its journal, before it runs).

        Raises:
            ConfigurationError: `new_loop_id` is not a new loop's id.
        """
        token = FORKED_FROM.set(self.origin)
        try:
            return runtime.run_loop(
                self.agent_id,
                None,
                self.request,
                self.handlers,
                loop_id=new_loop_id,
                **self.options,
            )
        finally:
            FORKED_FROM.reset(token)


async def _prepare_fork(
    source: ReplaySource | str | os.PathLike[str] | Sequence[AgentEvent],
    at_seq: int,
    *,
    loop_id: str | None = None,
    model: str | None = None,
    edit: Callable[[InferenceInput], InferenceInput] | None = None,
    tools: Sequence[Tool] = (),
    handlers: Sequence[InterceptionHandler]
    | Mapping[str, InterceptionHandler]
    | None = None,
    options: LoopOptionsDict | None = None,
    structured_output: type[BaseModel] | dict[str, Any] | None = None,
) -> _PreparedFork:
    """`fork`'s replay up to the fork point, and the fork's input: what is
    left is to start it (`_PreparedFork.start`). Arguments as `fork`'s.

    Raises:
        ConfigurationError: as `fork`.
    """
    recording = Recording.of(await _source(source).loop_events(loop_id))
    origin, number = _fork_point(recording, at_seq)
    given = _given(recording, tools)
    live, chosen, loop_options = _setup(
        recording, given, handlers, options, structured_output
    )
    captured: list[InferenceInput] = []
    seen = 0

    def stop_at_request(pending: PendingTransition) -> Abort | None:
        """Capture the fork point's request and end the replay there."""
        nonlocal seen
        if pending.trigger in (Trigger.infer, Trigger.infer_streaming):
            seen += 1
            if seen == number:
                assert isinstance(pending.payload, InferenceInput)
                captured.append(pending.payload)
                return Abort("fork point reached")
        return None

    replayed = live.model_copy(
        update={"tools": tuple(recorded_tools(recording, given).values())}
    )
    events, _, _ = await _run(
        recording,
        replayed,
        [*chosen, stop_at_request],
        loop_options,
        ReplayProvider(recording),
    )
    if not captured:
        divergence = _divergence(recording, events)
        why = divergence.describe() if divergence else "the replay ended first"
        raise ConfigurationError(
            f"the replay of {recording.loop_id} never reached the fork point "
            f"(seq {origin.seq}): {why}"
        )
    at = captured[0]
    start = at.model_copy(
        update={
            "model": model or at.model,
            # A context of its own: the fork appends to it, the recording's stays.
            "context": ModelContext(
                instructions=at.context.instructions, items=list(at.context.items)
            ),
            "tools": live.tools,
        }
    )
    if edit is not None:
        start = edit(start)
        if not isinstance(start, InferenceInput):
            raise ConfigurationError(
                f"edit must return an InferenceInput, got {type(start).__name__}"
            )
    return _PreparedFork(
        origin, recording.started.agent_id, start, chosen, loop_options
    )


def _fork_point(recording: Recording, at_seq: int) -> tuple[ForkOrigin, int]:
    """The first model request at or after `at_seq`: its origin, and its number."""
    number = 0
    for event in recording.expected:
        if isinstance(event, LoopTransition) and event.trigger in (
            Trigger.infer,
            Trigger.infer_streaming,
        ):
            number += 1
            if event.seq >= at_seq:
                return ForkOrigin(loop_id=recording.loop_id, seq=event.seq), number
    raise ConfigurationError(
        f"loop {recording.loop_id} made no model request at or after seq {at_seq}"
    )


read_fields_fast(globals())
