"""agentfsm.replay: re-driving a recorded loop from its events, and forking one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from agentfsm import (
    ConfigurationError,
    InferenceInput,
    LoopState,
    LoopStatus,
    ModelContext,
    Outcome,
    PendingTransition,
    Rewrite,
    Runtime,
    Tool,
    ToolBatch,
    ToolResult,
    Trigger,
    tool,
)
from agentfsm.diagrams import LoopPath, render_paths_mermaid
from agentfsm.eventlog import read_events
from agentfsm.events import AgentEvent, LoopStarted
from agentfsm.exceptions import ProviderError
from agentfsm.replay import EventLogSource, ReplaySource, fork, replay
from agentfsm.results import PathStep
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from agentfsm.timeline import (
    build_timeline,
    format_table,
    format_timeline,
    short_ids,
    summarize,
)
from tests.helpers import items_of, wait_until

ran: list[tuple[int, int]] = []
"""Every call of `add` that ran: a replay adds nothing to it."""


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
        from agentfsm._replay import wire

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
    from agentfsm._replay.doubles import RecordedTool
    from agentfsm._replay.wire import tool_spec
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
        from agentfsm._temporal.activities import _spec_tool
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
