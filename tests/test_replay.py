"""agentfsm.replay: re-driving a recorded loop from its events, and forking one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from agentfsm import (
    Abort,
    ConfigurationError,
    InferenceInput,
    LoopState,
    LoopStatus,
    ModelContext,
    Outcome,
    PendingTransition,
    Proceed,
    Rewrite,
    Runtime,
    Tool,
    ToolBatch,
    ToolCall,
    ToolResult,
    Trigger,
    report_progress,
    tool,
)
from agentfsm._bus.started import request_data
from agentfsm.diagrams import LoopPath, render_paths_mermaid
from agentfsm.eventlog import read_events
from agentfsm.events import (
    AgentEvent,
    FunctionCallCompleted,
    FunctionCallProgress,
    FunctionCallStarted,
    LoopStarted,
)
from agentfsm.exceptions import ProviderError
from agentfsm.options import LoopOptionsDict
from agentfsm.replay import EventLogSource, ReplaySource, fork, replay
from agentfsm.results import PathStep
from agentfsm.store import MemoryStore, SQLiteStore
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from agentfsm.timeline import (
    build_timeline,
    format_table,
    format_timeline,
    short_ids,
    summarize,
)
from agentfsm.tools import ToolNext, ToolWrapper
from tests.helpers import items_of, wait_until

ran: list[tuple[int, int]] = []
"""Every call of `add` that ran: a replay adds nothing to it."""

called: list[str] = []
"""Every call of `fetch`, `lookup` and `charge` that ran (likewise)."""


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    ran.append((a, b))
    return a + b


SCRIPT = [
    calls(call("add", call_id="c1", a=1, b=2)),
    calls(call("add", call_id="c2", a=3, b=4), call("add", call_id="c3", a=5, b=6)),
    text("21"),
]


def new_request(*tools: Tool, streaming: bool = False) -> InferenceInput:
    return InferenceInput(
        model="scripted:m",
        context=ModelContext(instructions="Add."),
        tools=tools or (add,),
        streaming=streaming,
    )


async def record(
    path: Path,
    script: Sequence[object] = SCRIPT,
    *,
    handlers: Sequence[object] = (),
    streaming: bool = False,
    tools: Sequence[Tool] = (),
) -> str:
    """Run one loop with an event log at `path`; return its id."""
    provider = ScriptedProvider(script)  # type: ignore[arg-type]
    async with Runtime(providers={"scripted": provider}, event_log=path) as runtime:
        loop_id = runtime.run_loop(
            "agent",
            "add them",
            new_request(*tools, streaming=streaming),
            list(handlers),  # type: ignore[arg-type]
        )
        await runtime.wait(loop_id)
    return loop_id


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "events.jsonl"


def deny_second_batch(pending: PendingTransition) -> Rewrite | None:
    """Deny the first call of the second tool batch."""
    batch = pending.payload
    if isinstance(batch, ToolBatch) and pending.model_requests == 2:
        return Rewrite(payload=batch.deny(batch.calls[0].call_id, "not today"))
    return None


class TestLoopStarted:
    async def test_it_carries_the_request_options_and_handlers(self, log: Path) -> None:
        """loop.started holds the context as found, the tools' specs, the settings,
        the options and the handlers by name, and reads back from the log."""
        context = ModelContext(instructions="Add.")
        context.append(text("earlier").items[0])
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("x")])}, event_log=log
        ) as runtime:
            inference_input = InferenceInput(
                model="scripted:m",
                context=context,
                tools=[add],
                temperature=0.5,
                stop_sequences=("END",),
            )
            runtime.run_loop(
                "agent", "hi", inference_input, deny_second_batch, max_turns=7
            )
        started = next(read_events(log))
        assert isinstance(started, LoopStarted)
        assert started.request is not None
        assert started.options is not None
        assert [i.model_dump() for i in started.request.items] == [
            {"type": "model_message", "content": "earlier", "refusal": None}
        ]
        assert started.request.instructions == "Add."
        assert started.request.settings == {
            "temperature": 0.5,
            "stop_sequences": ["END"],
        }
        assert [t.name for t in started.request.tools] == ["add"]
        assert started.request.tools[0].parameters == add.definition.parameters
        assert started.options.max_turns == 7
        assert started.handlers == ("tests.test_replay:deny_second_batch",)
        assert started.forked_from is None

    async def test_it_is_not_built_while_nobody_listens(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With no subscriber, the request's data is never made."""
        from agentfsm._bus import started as wire

        def refuse(*args: object) -> None:
            raise AssertionError("built with nobody listening")

        monkeypatch.setattr(wire, "started_fields", refuse)
        async with Runtime(providers={"scripted": ScriptedProvider([text("x")])}) as rt:
            result = await rt.wait(rt.run_loop("agent", "hi", new_request()))
        assert result.outcome is Outcome.answered


class TestReplay:
    async def test_a_recorded_run_replays_without_divergence(self, log: Path) -> None:
        """The recording replays to the same events, with no tool run and no model called."""
        loop_id = await record(log)
        ran.clear()
        report = await replay(log)
        assert not report.diverged, report.describe()
        assert ran == []
        assert report.loop_id == loop_id
        assert report.replay_loop_id != loop_id
        assert report.result.outcome is Outcome.answered
        assert report.result.answer is not None
        assert report.result.answer.content == "21"
        assert [e.type for e in report.events] == [e.type for e in read_events(log)]
        assert len(report.requests) == 3
        # (A request's context is the loop's own: it holds the answer by now.)
        assert items_of(report.requests[-1].context)[-3:-1] == ["out:c2=7", "out:c3=11"]

    async def test_a_changed_handler_reports_the_first_divergent_transition(
        self, log: Path
    ) -> None:
        """A handler denying a call the recording ran: the divergence is that
        batch's transition, with the decision and the payload it changed."""
        await record(log)
        ran.clear()
        report = await replay(log, handlers=[deny_second_batch])
        divergence = report.divergence
        assert divergence is not None
        edge = PathStep(
            LoopState.inference, Trigger.call_tools, LoopState.function_call
        )
        assert (divergence.expected, divergence.actual) == (edge, edge)
        recorded = [e for e in read_events(log) if e.type == "loop.transition"]
        # The second call_tools transition is where the recording and the replay part.
        assert (
            divergence.seq
            == [e for e in recorded if e.trigger is Trigger.call_tools][1].seq
        )
        assert divergence.expected_event is not None
        assert divergence.expected_event.type == "loop.transition"
        assert divergence.actual_event is not None
        assert divergence.actual_event.type == "transition.intercepted"
        changes = {d.path: d.actual for d in divergence.differences}
        assert changes["decision"] == "rewrite"
        assert changes["payload"]["denied"] == {"c2": "not today"}  # type: ignore[index,call-overload]
        assert "diverged at seq" in report.describe()
        assert ran == []

    async def test_a_handler_that_only_proceeds_changes_nothing(
        self, log: Path
    ) -> None:
        """Proceed decisions are not behaviour: replaying with one added matches."""
        await record(log)
        seen: list[Trigger] = []

        def watch(pending: PendingTransition) -> None:
            seen.append(pending.trigger)

        report = await replay(log, handlers=[watch])
        assert not report.diverged, report.describe()
        assert seen[:2] == [Trigger.start, Trigger.infer]

    async def test_a_recorded_handler_replays_by_name(self, log: Path) -> None:
        """A mapping rebinds the recorded handler names; the replay then matches."""
        await record(log, handlers=[deny_second_batch])
        report = await replay(log, handlers={"deny_second_batch": deny_second_batch})
        assert not report.diverged, report.describe()
        outputs = [
            e.output.output
            for e in report.events
            if e.type == "function_call.completed"
        ]
        assert "the call was denied: not today" in outputs

    async def test_a_streamed_run_replays_its_chunks(self, log: Path) -> None:
        """A streaming recording is served chunk by chunk, as recorded."""
        await record(log, streaming=True)
        report = await replay(log)
        assert not report.diverged, report.describe()
        assert any(e.type == "inference.stream" for e in report.events)

    async def test_a_setting_is_recorded_when_no_tools_were_given(
        self, log: Path
    ) -> None:
        """A request made of a model, a context and one setting (no tools) keeps
        the setting in `loop.started`: a streamed run without tools replays
        streamed, and so matches."""
        request = InferenceInput(
            model="scripted:m", context=ModelContext(), streaming=True
        )
        assert request_data(request).settings == {"streaming": True}
        provider = ScriptedProvider([text("hello")])
        async with Runtime(providers={"scripted": provider}, event_log=log) as runtime:
            await runtime.wait(runtime.run_loop("agent", "hi", request))
        report = await replay(log)
        assert not report.diverged, report.describe()
        assert any(e.type == "inference.stream" for e in report.events)

    async def test_a_paused_and_resumed_run_is_resumed_as_recorded(
        self, log: Path
    ) -> None:
        """An approval pause is resumed with the recorded decision (here, a denial)."""

        @tool(needs_approval=lambda args: args["a"] > 2)
        async def gated(a: int, b: int) -> int:
            """Add, with approval for big numbers."""
            return a + b

        script = [
            calls(
                call("gated", call_id="g1", a=1, b=1),
                call("gated", call_id="g2", a=9, b=1),
            ),
            text("done"),
        ]
        provider = ScriptedProvider(script)
        async with Runtime(providers={"scripted": provider}, event_log=log) as runtime:
            loop_id = runtime.run_loop("agent", "go", new_request(gated))
            recorder = EventRecorder(runtime.bus, "loop.paused", loop_id=loop_id)
            await wait_until(lambda: recorder.events)
            paused = recorder.events[0]
            assert isinstance(paused.payload, ToolBatch)  # type: ignore[union-attr]
            runtime.resume(
                loop_id,
                Rewrite(payload=paused.payload.deny("g2", "too big")),  # type: ignore[union-attr]
            )
            recorder.close()
            await runtime.wait(loop_id)
        report = await replay(log)
        assert not report.diverged, report.describe()
        types = [e.type for e in report.events]
        assert "loop.paused" in types
        assert "loop.resumed" in types
        assert report.result.outcome is Outcome.answered

    async def test_a_run_left_paused_ends_the_same_way(self, log: Path) -> None:
        """A recording that ended paused (cancelled as its runtime closed): the
        replay pauses there too, and ends cancelled with the same reason."""

        @tool(needs_approval=True)
        async def gated(a: int, b: int) -> int:
            """Add, with approval."""
            return a + b

        script = [calls(call("gated", a=1, b=1)), text("never")]
        provider = ScriptedProvider(script)
        async with Runtime(providers={"scripted": provider}, event_log=log) as runtime:
            loop_id = runtime.run_loop("agent", "go", new_request(gated))
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
        report = await replay(log)
        assert not report.diverged, report.describe()
        assert report.result.outcome is Outcome.cancelled
        assert report.result.reason == "the runtime closed while the loop was paused"

    async def test_a_failed_model_request_fails_again(self, log: Path) -> None:
        """A request that failed in the recording fails the same way in the replay."""
        await record(log, [calls(call("add", a=1, b=1)), ProviderError("quota")])
        report = await replay(log)
        assert not report.diverged, report.describe()
        assert report.result.outcome is Outcome.failed
        assert report.result.error is not None
        assert report.result.error.message == "quota"

    async def test_a_terminating_tool_stops_the_replay_too(self, log: Path) -> None:
        """A batch whose every call terminated the loop ends the replay the same way."""

        @tool
        async def bye() -> ToolResult:
            """Say goodbye and stop."""
            return ToolResult(output="bye", terminate=True)

        await record(log, [calls(call("bye")), text("never")], tools=[bye])
        report = await replay(log)
        assert not report.diverged, report.describe()
        assert (report.result.outcome, report.result.reason) == (
            Outcome.stopped,
            "terminated",
        )

    async def test_a_changed_tool_schema_diverges_at_the_start(self, log: Path) -> None:
        """A tool given with another schema than recorded: loop.started differs."""
        await record(log)

        @tool(name="add")
        async def add_floats(a: float, b: float) -> float:
            """Add two numbers."""
            return a + b

        report = await replay(log, tools=[add_floats])
        assert report.divergence is not None
        assert report.divergence.seq == 1
        paths = [d.path for d in report.divergence.differences]
        assert any(p.startswith("request.tools[0].parameters") for p in paths), paths

    async def test_a_list_of_events_is_a_source(self) -> None:
        """Events collected from the bus replay as a log does."""
        async with Runtime(providers={"scripted": ScriptedProvider(SCRIPT)}) as rt:
            recorder = EventRecorder(rt.bus)
            await rt.wait(rt.run_loop("agent", "add them", new_request()))
            recorder.close()
        report = await replay(recorder.events)
        assert not report.diverged, report.describe()
        assert isinstance(EventLogSource("x.jsonl"), ReplaySource)


# ------------------------------------------------------------ parallel batches


@tool
async def fetch(page: str, steps: int) -> str:
    """Fetch a page in `steps` steps, reporting each."""
    called.append(f"fetch {page}")
    for step in range(steps):
        report_progress({"page": page, "step": step})
        await anyio.lowlevel.checkpoint()
    return f"{page}: {steps} steps"


FETCHES = [
    calls(
        call("fetch", call_id="long", page="a", steps=3),
        call("fetch", call_id="mid", page="b", steps=1),
        call("fetch", call_id="short", page="c", steps=0),
    ),
    text("fetched"),
]


def ending_in(*order: str) -> ToolWrapper:
    """A tool wrapper that makes a batch's calls end in `order` (by call id):
    each waits for the one before it, whatever the scheduler does."""
    ended = {call_id: anyio.Event() for call_id in order}

    async def wrapper(tool_call: ToolCall, call_next: ToolNext) -> ToolResult:
        call_id = tool_call.call.call_id
        try:
            result = await call_next(tool_call)
            position = order.index(call_id)
            if position:
                with anyio.fail_after(5):  # a test that went wrong fails, never hangs
                    await ended[order[position - 1]].wait()
            return result
        finally:
            ended[call_id].set()

    return wrapper


def running_in(*order: str) -> ToolWrapper:
    """A tool wrapper that makes a batch's calls run their tools in `order`
    (by call id): each starts once the one before it ended."""
    ended = {call_id: anyio.Event() for call_id in order}

    async def wrapper(tool_call: ToolCall, call_next: ToolNext) -> ToolResult:
        call_id = tool_call.call.call_id
        try:
            position = order.index(call_id)
            if position:
                with anyio.fail_after(5):  # a test that went wrong fails, never hangs
                    await ended[order[position - 1]].wait()
            return await call_next(tool_call)
        finally:
            ended[call_id].set()

    return wrapper


def changing(call_id: str, output: str) -> ToolWrapper:
    """A tool wrapper that gives `output` for call `call_id` (a changed tool)."""

    async def wrapper(tool_call: ToolCall, call_next: ToolNext) -> ToolResult:
        result = await call_next(tool_call)
        if tool_call.call.call_id == call_id:
            return result.model_copy(update={"output": output})
        return result

    return wrapper


def in_reverse(*more: ToolWrapper) -> LoopOptionsDict:
    """Options making the fetches end long, mid, short (then `more` wrappers)."""
    return {"tool_wrappers": [ending_in("long", "mid", "short"), *more]}


async def record_fetches(path: Path) -> None:
    """The three fetches, run in parallel, ending short, mid, long."""
    provider = ScriptedProvider(FETCHES)
    async with Runtime(providers={"scripted": provider}, event_log=path) as runtime:
        loop_id = runtime.run_loop(
            "agent",
            "fetch them",
            new_request(fetch),
            tool_execution="parallel",
            tool_wrappers=[ending_in("short", "mid", "long")],
        )
        await runtime.wait(loop_id)


def call_of(event: AgentEvent) -> str | None:
    """The id of the call a call's event belongs to (None for other events)."""
    if isinstance(event, FunctionCallStarted | FunctionCallCompleted):
        return event.call.call_id
    if isinstance(event, FunctionCallProgress):
        return event.call_id
    return None


def call_events(events: Sequence[AgentEvent]) -> list[tuple[str, str]]:
    """The calls' events in the order published: `(type, call id)`."""
    return [(e.type, c) for e in events if (c := call_of(e)) is not None]


def by_call(seen: list[tuple[str, str]]) -> dict[str, list[str]]:
    calls_seen: dict[str, list[str]] = {}
    for kind, call_id in seen:
        calls_seen.setdefault(call_id, []).append(kind)
    return calls_seen


def with_call(
    events: Sequence[AgentEvent], call_id: str, /, **update: str
) -> list[AgentEvent]:
    """The events with call `call_id`'s start and end changed (`update` of
    its `FunctionCallItem`): a recording of another run."""
    changed = []
    for event in events:
        if (
            isinstance(event, FunctionCallStarted | FunctionCallCompleted)
            and event.call.call_id == call_id
        ):
            event = event.model_copy(
                update={"call": event.call.model_copy(update=update)}
            )
        changed.append(event)
    return changed


def renumbered(events: Sequence[AgentEvent]) -> list[AgentEvent]:
    """The events with seq 1, 2, 3, ... (after some were taken out)."""
    return [e.model_copy(update={"seq": n}) for n, e in enumerate(events, 1)]


class TestParallelBatches:
    async def test_a_batch_replays_however_its_calls_interleaved(
        self, log: Path
    ) -> None:
        """Recorded ending short, mid, long, replayed ending long, mid, short:
        each call's events (progress included) are the same, their
        interleaving is not, and that is no divergence."""
        await record_fetches(log)
        called.clear()
        report = await replay(log, options=in_reverse())
        assert not report.diverged, report.describe()
        assert called == []
        recorded = call_events(list(read_events(log)))
        replayed = call_events(report.events)
        completions = [c for kind, c in recorded if kind.endswith("completed")]
        assert completions == ["short", "mid", "long"]
        completions = [c for kind, c in replayed if kind.endswith("completed")]
        assert completions == ["long", "mid", "short"]
        assert by_call(replayed) == by_call(recorded)
        assert by_call(recorded)["long"] == [
            "function_call.started",
            *["function_call.progress"] * 3,
            "function_call.completed",
        ]

    async def test_a_changed_output_diverges_at_its_call(self, log: Path) -> None:
        """A tool that now answers otherwise, in a batch replayed in another
        interleaving: the divergence is that call's completion, with the
        output it changed."""
        await record_fetches(log)
        report = await replay(log, options=in_reverse(changing("mid", "b: gone")))
        divergence = report.divergence
        assert divergence is not None, report.describe()
        expected, actual = divergence.expected_event, divergence.actual_event
        assert isinstance(expected, FunctionCallCompleted)
        assert isinstance(actual, FunctionCallCompleted)
        assert (expected.call.call_id, actual.call.call_id) == ("mid", "mid")
        assert [(d.path, d.expected, d.actual) for d in divergence.differences] == [
            ("output.output", "b: 1 steps", "b: gone")
        ]
        assert divergence.seq == expected.seq
        edge = PathStep(
            LoopState.inference, Trigger.call_tools, LoopState.function_call
        )
        assert (divergence.expected, divergence.actual) == (edge, edge)

    async def test_a_call_with_other_arguments_diverges_at_its_start(
        self, log: Path
    ) -> None:
        """The recorded call `mid` ran with other arguments than the model's
        batch gives it now: its start is the divergence."""
        await record_fetches(log)
        arguments = '{"page":"b","steps":2}'
        report = await replay(
            with_call(list(read_events(log)), "mid", arguments=arguments),
            options=in_reverse(),
        )
        divergence = report.divergence
        assert divergence is not None, report.describe()
        assert isinstance(divergence.expected_event, FunctionCallStarted)
        assert divergence.expected_event.call.call_id == "mid"
        assert [d.path for d in divergence.differences] == ["call.arguments"]

    async def test_a_call_made_on_one_side_only_diverges(self, log: Path) -> None:
        """A batch whose recording lacks a call the replay makes, or holds one
        the replay does not make: the divergence pairs that call's first event
        with where the other side goes on past the batch."""
        await record_fetches(log)
        events = list(read_events(log))

        without = renumbered([e for e in events if call_of(e) != "short"])
        report = await replay(without, options=in_reverse())
        divergence = report.divergence
        assert divergence is not None, report.describe()
        assert divergence.expected_event is not None
        assert divergence.expected_event.type == "loop.transition"
        assert isinstance(divergence.actual_event, FunctionCallStarted)
        assert divergence.actual_event.call.call_id == "short"

        report = await replay(
            with_call(events, "short", call_id="other"), options=in_reverse()
        )
        divergence = report.divergence
        assert divergence is not None, report.describe()
        assert isinstance(divergence.expected_event, FunctionCallStarted)
        assert divergence.expected_event.call.call_id == "other"
        assert divergence.actual_event is not None
        assert divergence.actual_event.type == "loop.transition"

    async def test_calls_alike_get_their_own_outputs(self, log: Path) -> None:
        """Two calls with the same arguments and different outputs, run in
        the other order in the replay: each gets its own recorded output."""
        tickets = iter(range(1, 10))

        @tool
        async def ticket(queue: str) -> str:
            """Take the next ticket of a queue."""
            return f"{queue}-{next(tickets)}"

        provider = ScriptedProvider(
            [
                calls(
                    call("ticket", call_id="t1", queue="q"),
                    call("ticket", call_id="t2", queue="q"),
                )
            ]
        )
        async with Runtime(providers={"scripted": provider}, event_log=log) as rt:
            loop_id = rt.run_loop(
                "agent",
                "two tickets",
                new_request(ticket),
                tool_execution="parallel",
                tool_wrappers=[running_in("t1", "t2")],
            )
            await rt.wait(loop_id)
        report = await replay(log, options={"tool_wrappers": [running_in("t2", "t1")]})
        assert not report.diverged, report.describe()
        outputs = {
            e.call.call_id: e.output.output
            for e in report.events
            if isinstance(e, FunctionCallCompleted)
        }
        assert outputs == {"t1": "q-1", "t2": "q-2"}

    async def test_the_progress_a_call_reported_is_replayed(self, log: Path) -> None:
        """Progress a tool reported is reported again, in order, by its stand-in."""
        await record(
            log,
            [calls(call("fetch", call_id="f", page="a", steps=2)), text("ok")],
            tools=[fetch],
        )
        report = await replay(log)
        assert not report.diverged, report.describe()
        progress = [
            e.progress for e in report.events if isinstance(e, FunctionCallProgress)
        ]
        assert progress == [{"page": "a", "step": 0}, {"page": "a", "step": 1}]


# ------------------------------------------------------------- recovered loops

GATE: dict[str, anyio.Event] = {}
"""`lookup` and `charge` wait on GATE["block"] while it is set."""


@tool(on_crash="retry")
async def lookup(key: str) -> str:
    """Look a key up (idempotent: runs again after a crash)."""
    called.append(f"lookup {key}")
    for step in range(3):
        report_progress(step)
    if (gate := GATE.get("block")) is not None:
        await gate.wait()
    return f"value of {key}"


@tool
async def charge(cents: int) -> str:
    """Charge, reporting each cent (not idempotent: on_crash is pause)."""
    called.append(f"charge {cents}")
    for cent in range(cents):
        report_progress(cent)
    if (gate := GATE.get("block")) is not None:
        await gate.wait()
    return f"charged {cents}"


async def hold_batches(pending: PendingTransition) -> None:
    """Hold each batch at its transition while GATE["hold"] is set."""
    if pending.trigger is Trigger.call_tools and (gate := GATE.get("hold")):
        await gate.wait()


def new_store(kind: str, tmp_path: Path) -> Callable[[], SQLiteStore | MemoryStore]:
    """A new store object on the same data each call."""
    if kind == "memory":
        memory = MemoryStore(events=True)
        return lambda: memory
    return lambda: SQLiteStore(tmp_path / "loops.db", events=True)


async def crashed_and_recovered(
    store: Callable[[], SQLiteStore | MemoryStore],
    log: Path,
    second: str,
    resume: Callable[[Runtime, str], None] | None = None,
) -> str:
    """A loop running `add` (call c1) and `second` (call c2) in parallel, whose
    runtime dies once `add` ended and `second` runs (its task cancelled, as a
    deployment stopping would), taken up by a second runtime on the same store
    and event log, resumed with `resume` if it recovered paused; its id."""
    arguments: dict[str, Any] = {"key": "k"} if second == "lookup" else {"cents": 12}
    script = [
        calls(
            call("add", call_id="c1", a=1, b=2), call(second, call_id="c2", **arguments)
        )
    ]
    tools = [add, lookup, charge]
    GATE["block"] = anyio.Event()
    called.clear()
    loop_id = ""
    try:
        with anyio.CancelScope() as scope:
            async with Runtime(
                providers={"scripted": ScriptedProvider(script)},
                store=store(),
                event_log=log,
            ) as first:
                ended = EventRecorder(first.bus, "function_call.completed")
                loop_id = first.run_loop(
                    "agent", "go", new_request(*tools), tool_execution="parallel"
                )
                # `add` published its end once its output was in the ledger.
                await wait_until(lambda: ended.events and called)
                scope.cancel()
                await anyio.sleep_forever()
    finally:
        del GATE["block"]
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("done")])},
        store=store(),
        event_log=log,
        tools=tools,
    ) as again:
        recovery = await again.recover()
        if resume is None:
            assert recovery.running == [loop_id]
        else:
            assert recovery.paused == [loop_id]
            resume(again, loop_id)
        with anyio.fail_after(10):
            await again.wait(loop_id)
    return loop_id


def proceed(runtime: Runtime, loop_id: str) -> None:
    runtime.resume(loop_id, Proceed())


def answer(runtime: Runtime, loop_id: str) -> None:
    pending = runtime.get(loop_id).pending
    assert pending is not None
    assert isinstance(pending.payload, ToolBatch)
    runtime.resume(loop_id, Rewrite(payload=pending.payload.answer("c2", "by hand")))


def give_up(runtime: Runtime, loop_id: str) -> None:
    runtime.resume(loop_id, Abort("not charged twice"))


RECOVERIES = {
    "a retried call": ("lookup", None, Outcome.answered),
    "a call in flight, run again": ("charge", proceed, Outcome.answered),
    "a call in flight, answered": ("charge", answer, Outcome.answered),
    "a call in flight, given up": ("charge", give_up, Outcome.aborted),
}


class TestRecoveredLoops:
    @pytest.mark.parametrize("store_kind", ["sqlite", "memory"])
    @pytest.mark.parametrize("recovery", list(RECOVERIES))
    async def test_a_recovered_loop_replays_from_its_store_and_its_log(
        self, tmp_path: Path, log: Path, store_kind: str, recovery: str
    ) -> None:
        """A loop whose runtime died in a batch and that another runtime took
        up (reusing `add`'s output from the ledger; running the call in flight
        again, or pausing over it until a person decided) replays as one run
        with no crash, ending as it did, from the store's events and from the
        event log both runtimes appended to."""
        store = new_store(store_kind, tmp_path)
        second, resume, outcome = RECOVERIES[recovery]
        loop_id = await crashed_and_recovered(store, log, second, resume)
        logged = list(read_events(log))
        assert "loop.recovered" in [e.type for e in logged]
        assert len({e.seq for e in logged}) < len(logged)  # seqs published twice
        ran.clear()
        called.clear()
        async with store() as opened:
            from_store = await replay(opened, loop_id=loop_id)
        from_log = await replay(log)
        # In seq order (a seq the recovery published again, after the crashed
        # run's), and past the recovered run's end, the crashed run's progress.
        by_seq = await replay(sorted(logged, key=lambda e: e.seq))
        for report in (from_store, from_log, by_seq):
            assert not report.diverged, report.describe()
            assert report.result.outcome is outcome
        assert (ran, called) == ([], [])

    async def test_a_loop_recovered_in_inference_replays(
        self, tmp_path: Path, log: Path
    ) -> None:
        """The runtime died while a handler decided about the model's output;
        the loop taken up publishes that output again (recorded, not asked
        for again) and asks the handler again: one run, in the replay."""
        store = new_store("sqlite", tmp_path)
        GATE["hold"] = anyio.Event()
        try:
            with anyio.CancelScope() as scope:
                async with Runtime(
                    providers={"scripted": ScriptedProvider(SCRIPT[:1])},
                    store=store(),
                    event_log=log,
                ) as first:
                    loop_id = first.run_loop(
                        "agent", "add", new_request(), hold_batches
                    )
                    await wait_until(lambda: first.get(loop_id).model_requests == 1)
                    scope.cancel()
                    await anyio.sleep_forever()
        finally:
            del GATE["hold"]
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("3")])},
            store=store(),
            event_log=log,
            tools=[add],
            handlers=[hold_batches],
        ) as again:
            assert (await again.recover()).running == [loop_id]
            result = await again.wait(loop_id)
        assert result.outcome is Outcome.answered
        logged = list(read_events(log))
        assert [e.type for e in logged].count("inference.completed") == 3
        async with store() as opened:
            from_store = await replay(opened, loop_id=loop_id, handlers=[hold_batches])
        from_log = await replay(log, handlers=[hold_batches])
        for report in (from_store, from_log):
            assert not report.diverged, report.describe()
            assert report.result.outcome is Outcome.answered
            assert len(report.requests) == 2

    @pytest.mark.parametrize("changed", ["c1", "c2"])
    async def test_a_changed_output_of_a_recovered_batch_diverges(
        self, tmp_path: Path, log: Path, changed: str
    ) -> None:
        """A recovered batch is still compared: a changed output of the call
        whose output was reused (c1), or of the one run again (c2), is the
        divergence."""
        await crashed_and_recovered(new_store("sqlite", tmp_path), log, "lookup")
        report = await replay(log, options={"tool_wrappers": [changing(changed, "x")]})
        divergence = report.divergence
        assert divergence is not None, report.describe()
        assert isinstance(divergence.expected_event, FunctionCallCompleted)
        assert divergence.expected_event.call.call_id == changed
        assert [d.path for d in divergence.differences] == ["output.output"]

    async def test_a_pause_taken_up_by_another_runtime_replays(
        self, tmp_path: Path, log: Path
    ) -> None:
        """Paused for approval, left by its runtime, recovered and resumed by
        another: the recording's loop.recovered is no divergence."""

        @tool(needs_approval=True)
        async def pay(cents: int) -> str:
            """Pay, with approval."""
            return f"paid {cents}"

        store = new_store("sqlite", tmp_path)
        script = ScriptedProvider([calls(call("pay", cents=5))])
        async with Runtime(
            providers={"scripted": script}, store=store(), event_log=log
        ) as first:
            loop_id = first.run_loop("agent", "pay", new_request(pay))
            await wait_until(lambda: first.get(loop_id).status is LoopStatus.paused)
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("done")])},
            store=store(),
            event_log=log,
            tools=[pay],
        ) as again:
            assert (await again.recover()).paused == [loop_id]
            again.resume(loop_id, Proceed())
            await again.wait(loop_id)
        report = await replay(log)
        assert not report.diverged, report.describe()
        assert [e.type for e in report.events].count("loop.paused") == 1


class TestReplayRefuses:
    async def test_a_log_of_several_loops_without_loop_id(self, log: Path) -> None:
        """Several loops in the source: loop_id= chooses, and its absence is an error."""
        first = await record(log)
        await record(log)
        with pytest.raises(ConfigurationError, match="2 loops"):
            await replay(log)
        report = await replay(log, loop_id=first)
        assert report.loop_id == first
        assert not report.diverged

    async def test_recorded_handlers_not_given(self, log: Path) -> None:
        """A recording made with handlers needs them (the error names them)."""
        await record(log, handlers=[deny_second_batch])
        with pytest.raises(ConfigurationError, match="deny_second_batch"):
            await replay(log)
        with pytest.raises(ConfigurationError, match="deny_second_batch"):
            await replay(log, handlers={"other": deny_second_batch})

    async def test_an_incomplete_recording(self, log: Path) -> None:
        """Events with a hole, or without loop.started, cannot be replayed."""
        await record(log)
        events: list[AgentEvent] = list(read_events(log))
        with pytest.raises(ConfigurationError, match="seq 3 is missing"):
            await replay(events[:2] + events[3:])
        with pytest.raises(ConfigurationError, match="starts with"):
            await replay(events[1:])

    async def test_tools_the_recording_did_not_offer(self, log: Path) -> None:
        """A tool given that the recorded request never offered is named."""
        await record(log)

        @tool
        async def other() -> str:
            """Another tool."""
            return "x"

        with pytest.raises(ConfigurationError, match="did not offer: other"):
            await replay(log, tools=[other])

    async def test_not_a_source(self) -> None:
        with pytest.raises(ConfigurationError, match="source must be"):
            await replay(42)  # type: ignore[arg-type]


class TestFork:
    async def test_a_fork_with_another_model_runs_live_from_its_request(
        self, log: Path
    ) -> None:
        """Forking at the second request sends that request's context to another
        model, runs the tools for real, and records where it came from."""
        loop_id = await record(log)
        second = [
            e
            for e in read_events(log)
            if e.type == "loop.transition" and e.trigger is Trigger.infer
        ][1]
        other = ScriptedProvider(
            [calls(call("add", call_id="f1", a=10, b=20)), text("30")]
        )
        ran.clear()
        async with Runtime(providers={"other": other}) as runtime:
            recorder = EventRecorder(runtime.bus, "loop.started")
            forked = await fork(log, second.seq, model="other:m", tools=[add])
            result = await runtime.wait(forked)
            recorder.close()
        assert result.outcome is Outcome.answered
        assert result.answer is not None
        assert result.answer.content == "30"
        assert ran == [(10, 20)]  # live: the fork's own call ran, no recorded one
        assert other.requests[0].model == "other:m"
        # The fork's context: the recording's up to that request, then its own.
        assert items_of(other.requests[0].context)[:5] == [
            "user:add them",
            "call:c1",
            "out:c1=3",
            "call:f1",
            "out:f1=30",
        ]
        started = recorder.events[0]
        assert isinstance(started, LoopStarted)
        assert started.forked_from is not None
        assert (started.forked_from.loop_id, started.forked_from.seq) == (
            loop_id,
            second.seq,
        )

    async def test_edit_changes_the_request_it_starts_with(self, log: Path) -> None:
        """`edit` rewrites the request the fork starts from."""
        await record(log)
        other = ScriptedProvider([text("short")])
        async with Runtime(providers={"scripted": other}) as runtime:
            forked = await fork(
                log,
                1,
                tools=[add],
                edit=lambda r: r.model_copy(update={"max_output_tokens": 5}),
            )
            await runtime.wait(forked)
        assert other.requests[0].max_output_tokens == 5
        assert items_of(other.requests[0].context) == ["user:add them", "model:short"]

    async def test_no_request_after_the_seq(self, log: Path) -> None:
        """A seq after the last model request is refused, naming the loop."""
        await record(log)
        async with Runtime() as runtime:
            with pytest.raises(
                ConfigurationError, match="no model request at or after"
            ):
                await fork(log, 10_000, tools=[add], runtime=runtime)

    async def test_a_fork_needs_the_live_tools(self, log: Path) -> None:
        """A fork runs its tools for real: the recorded ones must be given."""
        await record(log)
        async with Runtime() as runtime:
            with pytest.raises(ConfigurationError, match="not given: add"):
                await fork(log, 1, runtime=runtime)

    async def test_inspect_shows_the_fork_and_both_paths_draw_side_by_side(
        self, log: Path
    ) -> None:
        """A fork logged beside its original: the table and the timelines say
        which forked from which, and one diagram holds both paths."""
        original = await record(log)
        other = ScriptedProvider([text("forked answer")])
        async with Runtime(providers={"scripted": other}, event_log=log) as runtime:
            forked = await fork(log, 1, tools=[add])
            await runtime.wait(forked)
        events = list(read_events(log))
        table = format_table(summarize(events))
        shorts = short_ids([original, forked])
        assert f"fork of {shorts[original]}@" in table
        assert build_timeline(events, original).forks == (forked,)
        text_of_fork = format_timeline(build_timeline(events, forked))
        assert f"forked    from {original} at seq " in text_of_fork
        diagram = render_paths_mermaid(
            [
                LoopPath.from_events(events, original),
                LoopPath.from_events(events, forked),
            ],
            titles=["original", "fork"],
        )
        assert 'state "original" as loop1 {' in diagram
        assert 'state "fork" as loop2 {' in diagram
        # The original called tools; the fork answered at once.
        assert "l1_inference --> l1_function_call: call_tools (#3, #5)" in diagram
        assert "l2_inference --> l2_model_message: answer (#3)" in diagram
        assert "l2_inference --> l2_function_call: call_tools\n" in diagram


def test_tools_without_a_signature_have_every_field_a_loop_reads() -> None:
    """A recorded tool (from its spec, or like a given one) and Temporal's
    stand-in are set up by `Tool._describe`: every field of `Tool` is there
    (`on_crash` was missing from two of them), as the spec or the tool says."""
    from agentfsm import tool
    from agentfsm._bus.started import tool_spec
    from agentfsm.replay._doubles import RecordedTool
    from agentfsm.tools import Tool

    @tool(on_crash="retry", execution_mode="sequential", timeout=7.0)
    async def lookup(key: str) -> str:
        """Look a key up."""
        return key

    spec = tool_spec(lookup)
    made: list[Tool] = [
        RecordedTool(spec, [], set()),
        RecordedTool(spec, [], set(), lookup),
    ]
    try:
        from agentfsm.temporal._activities import _spec_tool
    except ImportError:  # temporalio not installed
        pass
    else:
        made.append(_spec_tool(spec))
    fields = [f for f in Tool.__slots__ if f != "_args_model"]
    for stand_in in made:
        for field in fields:
            getattr(stand_in, field)  # raises AttributeError if missing
        assert stand_in.name == "lookup"
        assert stand_in.definition.parameters == lookup.definition.parameters
        assert (stand_in.timeout, stand_in.execution_mode) == (7.0, "sequential")
        assert stand_in.run_in_thread is False
    assert [t.on_crash for t in made[:2]] == ["pause", "retry"]
