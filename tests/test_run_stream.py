"""A loop's own stream: `Runtime.events(loop_id)` and `Agent.run_stream`.

The events of a loop started with `stream=True` are kept from its first, so
none is missed however late the reader starts; the stream ends with the loop.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, assert_type

import anyio
import pytest
from pydantic import BaseModel

from agentfsm import (
    Agent,
    FunctionProvider,
    InferenceInput,
    InferenceOutput,
    LoopFailedError,
    LoopStatus,
    Outcome,
    Proceed,
    Runtime,
)
from agentfsm.agent import StreamedRun
from agentfsm.events import AgentEvent, InferenceStream, LoopIdle
from agentfsm.exceptions import LoopStateError, UnknownLoopError
from agentfsm.inference import TextDelta
from agentfsm.results import LoopResult
from agentfsm.store import MemoryStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import add, pause_tools, request, wait_until


class Gate:
    """A model that calls `add` twice, one request each, then waits at its third
    request until `opened` is set, then answers: a loop paused mid-way, after
    a dozen events, with nothing timed."""

    def __init__(self, answer: str = "done") -> None:
        self.waiting = anyio.Event()
        """Set when the third request arrived (the loop waits there)."""
        self.opened = anyio.Event()
        self.answer = answer
        self.requests = 0

    async def __call__(self, request: InferenceInput) -> InferenceOutput:
        self.requests += 1
        if self.requests <= 2:
            return calls(call("add", a=self.requests, b=1, call_id=f"c{self.requests}"))
        self.waiting.set()
        await self.opened.wait()
        return text(self.answer)


def gated_runtime(gate: Gate, **kwargs: Any) -> Runtime:
    return Runtime(providers={"scripted": FunctionProvider(gate)}, **kwargs)


async def read(events: Any) -> list[AgentEvent]:
    with anyio.fail_after(10):
        return [event async for event in events]


def assert_whole(events: list[AgentEvent], loop_id: str) -> None:
    """One loop's events, every one from its first to its last, in order."""
    assert {e.loop_id for e in events} == {loop_id}
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert events[0].type == "loop.started"
    assert events[-1].type == "loop.idle"


class TestEvents:
    async def test_a_reader_from_the_start_gets_every_event_then_the_end(
        self,
    ) -> None:
        """Read before the loop published anything: from `loop.started` to
        `loop.idle`, the same events a bus subscriber got, and then it ends."""
        gate = Gate()
        gate.opened.set()
        async with gated_runtime(gate) as runtime:
            with runtime.bus.subscribe() as everything:
                loop_id = runtime.run_loop("a", "go", request(), stream=True)
                events = await read(runtime.events(loop_id))
                result = await runtime.wait(loop_id)
                seen = everything.drain()
        assert_whole(events, loop_id)
        assert events == seen
        assert isinstance(events[-1], LoopIdle)
        assert events[-1].outcome is result.outcome is Outcome.answered

    async def test_a_reader_that_starts_mid_loop_misses_nothing(self) -> None:
        """The loop published a dozen events and waits on its model before
        anyone reads: the reader still gets them all, then the rest as they
        come, the same events a bus subscriber got."""
        gate = Gate()
        async with gated_runtime(gate) as runtime:
            with runtime.bus.subscribe() as everything:
                loop_id = runtime.run_loop("a", "go", request(), stream=True)
                with anyio.fail_after(10):
                    await gate.waiting.wait()
                assert everything.statistics().buffered >= 10
                got: list[AgentEvent] = []

                async def reader() -> None:
                    got.extend(await read(runtime.events(loop_id)))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(reader)
                    await anyio.wait_all_tasks_blocked()
                    assert got == []  # still reading: the loop has not ended
                    gate.opened.set()
                assert got == everything.drain()
        assert_whole(got, loop_id)
        types = [e.type for e in got]
        assert types.count("function_call.completed") == 2
        assert types.count("model.answer") == 1

    async def test_a_reader_after_the_end_gets_every_event(self) -> None:
        """Nobody read while the loop ran (it never waited for a reader): after
        its end its events are all there, and the iteration ends."""
        gate = Gate()
        gate.opened.set()
        async with gated_runtime(gate) as runtime:
            loop_id = runtime.run_loop("a", "go", request(), stream=True)
            result = await runtime.wait(loop_id)
            assert runtime.bus.statistics().subscribers == 0  # unsubscribed
            events = await read(runtime.events(loop_id))
        assert_whole(events, loop_id)
        assert [e.dest for e in events if e.type == "loop.transition"] == [
            step.dest for step in result.path
        ]

    async def test_the_events_are_kept_after_the_runtime_exited(self) -> None:
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hi")])}
        ) as rt:
            loop_id = rt.run_loop("a", "go", request(), stream=True)
            await rt.wait(loop_id)
        assert_whole(await read(rt.events(loop_id)), loop_id)

    async def test_parallel_loops_each_get_their_own(self) -> None:
        """Five loops at once, interleaved: each stream holds its loop's events
        only, every one of them."""
        script = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        async with Runtime(providers={"scripted": script}) as runtime:
            ids = [
                runtime.run_loop("a", f"go {n}", request(), stream=True)
                for n in range(5)
            ]
            streams = {loop_id: runtime.events(loop_id) for loop_id in ids}
            got: dict[str, list[AgentEvent]] = {}

            async def reader(loop_id: str) -> None:
                got[loop_id] = await read(streams[loop_id])

            async with anyio.create_task_group() as tg:
                for loop_id in ids:
                    tg.start_soon(reader, loop_id)
        for loop_id in ids:
            assert_whole(got[loop_id], loop_id)
        assert len({len(events) for events in got.values()}) == 1

    async def test_a_loop_not_streamed_keeps_nothing_and_says_so(self) -> None:
        script = ScriptedProvider([text("hi")])
        async with Runtime(providers={"scripted": script}) as runtime:
            loop_id = runtime.run_loop("a", "go", request())
            assert runtime.bus.statistics().subscribers == 0
            with pytest.raises(LoopStateError, match=r"stream=True"):
                runtime.events(loop_id)
            await runtime.wait(loop_id)
            with pytest.raises(UnknownLoopError):
                runtime.events("no-such-loop")

    async def test_the_events_are_handed_over_once(self) -> None:
        script = ScriptedProvider([text("hi")])
        async with Runtime(providers={"scripted": script}) as runtime:
            loop_id = runtime.run_loop("a", "go", request(), stream=True)
            events = runtime.events(loop_id)
            with pytest.raises(LoopStateError, match=r"once"):
                runtime.events(loop_id)
            assert_whole(await read(events), loop_id)

    async def test_the_events_go_with_the_forgotten_result(self) -> None:
        """An untaken stream is kept as long as the loop's result, no longer."""
        script = ScriptedProvider([text("hi")])
        async with Runtime(providers={"scripted": script}, keep_finished=1) as rt:
            first = rt.run_loop("a", "go", request(), stream=True)
            await rt.wait(first)
            second = rt.run_loop("a", "go", request(), stream=True)
            await rt.wait(second)
            with pytest.raises(UnknownLoopError):
                rt.events(first)
            assert_whole(await read(rt.events(second)), second)
        async with Runtime(providers={"scripted": script}, keep_finished=0) as rt:
            loop_id = rt.run_loop("a", "go", request(), stream=True)
            with rt.events(loop_id) as taken:  # taken while it runs: kept
                await rt.wait(loop_id)
                assert_whole(await read(taken), loop_id)

    async def test_closing_the_events_stops_new_ones_only(self) -> None:
        """Closed mid-loop, the subscription gets no more events; those in it
        can still be read, then the iteration ends (as any subscription's)."""
        gate = Gate()
        async with gated_runtime(gate) as runtime:
            loop_id = runtime.run_loop("a", "go", request(), stream=True)
            with anyio.fail_after(10):
                await gate.waiting.wait()
            with runtime.events(loop_id) as events:
                buffered = events.statistics().buffered
            gate.opened.set()
            await runtime.wait(loop_id)
            got = await read(events)
        assert len(got) == buffered >= 10
        assert [e.seq for e in got] == list(range(1, buffered + 1))
        assert "loop.idle" not in [e.type for e in got]

    async def test_a_failed_loop_ends_the_stream(self) -> None:
        script = ScriptedProvider([RuntimeError("the model broke")])
        async with Runtime(providers={"scripted": script}) as runtime:
            loop_id = runtime.run_loop("a", "go", request(), stream=True)
            events = await read(runtime.events(loop_id))
        assert_whole(events, loop_id)
        assert [e.type for e in events][-2:] == ["loop.transition", "loop.idle"]
        assert "loop.failed" in [e.type for e in events]
        assert isinstance(events[-1], LoopIdle)
        assert events[-1].outcome is Outcome.failed

    async def test_a_cancelled_loop_ends_the_stream(self) -> None:
        gate = Gate()
        async with gated_runtime(gate) as runtime:
            loop_id = runtime.run_loop("a", "go", request(), stream=True)
            with anyio.fail_after(10):
                await gate.waiting.wait()
            runtime.cancel(loop_id, "enough")
            events = await read(runtime.events(loop_id))
        assert_whole(events, loop_id)
        assert isinstance(events[-1], LoopIdle)
        assert (events[-1].outcome, events[-1].reason) == (Outcome.cancelled, "enough")

    async def test_a_paused_loop_streams_on_after_resume(self) -> None:
        """The stream shows the pause, waits through it, and goes on after
        `resume` to the end."""
        script = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        async with Runtime(providers={"scripted": script}) as runtime:
            loop_id = runtime.run_loop("a", "go", request(), pause_tools, stream=True)
            got: list[AgentEvent] = []
            with anyio.fail_after(10), runtime.events(loop_id) as events:
                async for event in events:
                    got.append(event)
                    if event.type == "loop.paused":
                        await anyio.wait_all_tasks_blocked()
                        assert runtime.get(loop_id).status is LoopStatus.paused
                        runtime.resume(loop_id, Proceed())
        assert_whole(got, loop_id)
        types = [e.type for e in got]
        assert types.index("loop.paused") < types.index("loop.resumed")
        assert types.index("loop.resumed") < types.index("function_call.completed")

    async def test_a_durable_loop_streams_to_its_stored_end(self) -> None:
        """A durable loop's `loop.idle` is published once its end is stored:
        the stream ends with it."""
        script = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        store = MemoryStore(events=True)
        async with Runtime(providers={"scripted": script}, store=store) as runtime:
            loop_id = runtime.run_loop("a", "go", request(), stream=True)
            events = await read(runtime.events(loop_id))
        assert_whole(events, loop_id)

    async def test_a_paused_loop_past_its_deadline_ends_the_stream(self) -> None:
        """Paused, the loop's deadline ends it (failed), and its stream."""
        script = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        async with Runtime(providers={"scripted": script}) as runtime:
            loop_id = runtime.run_loop(
                "a", "go", request(), pause_tools, stream=True, deadline=0.2
            )
            events = await read(runtime.events(loop_id))
        assert_whole(events, loop_id)
        assert isinstance(events[-1], LoopIdle)
        assert events[-1].outcome is Outcome.failed
        assert "deadline" in (events[-1].reason or "")

    async def test_a_durable_loop_left_paused_ends_its_stream_at_exit(self) -> None:
        """A durable loop stays paused in its store when the runtime exits: its
        stream ends there, with `loop.paused`, not its end."""
        script = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        async with Runtime(
            providers={"scripted": script}, store=MemoryStore()
        ) as runtime:
            loop_id = runtime.run_loop("a", "go", request(), pause_tools, stream=True)
            events = runtime.events(loop_id)
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
        got = await read(events)
        assert [e.seq for e in got] == list(range(1, len(got) + 1))
        assert got[-1].type == "loop.paused"

    async def test_a_full_backpressure_subscriber_does_not_cost_the_stream_events(
        self,
    ) -> None:
        """Another subscriber that never reads holds the loop's events back
        (backpressure); cancelled, the loop delivers them all, and the stream
        gets every one, its end included."""
        script = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        async with Runtime(providers={"scripted": script}) as runtime:
            with runtime.bus.subscribe(buffer=1, backpressure=True):
                loop_id = runtime.run_loop("a", "go", request(), stream=True)
                events = runtime.events(loop_id)
                first = await events.receive()
                await anyio.wait_all_tasks_blocked()  # the loop waits for room
                assert runtime.get(loop_id).status is LoopStatus.running
                runtime.cancel(loop_id, "stuck")
                rest = await read(events)
        assert_whole([first, *rest], loop_id)
        assert isinstance(rest[-1], LoopIdle)
        assert rest[-1].outcome is Outcome.cancelled

    async def test_stream_must_be_a_bool(self) -> None:
        async with Runtime(providers={"scripted": ScriptedProvider([])}) as runtime:
            with pytest.raises(TypeError, match=r"stream must be a bool, got int 1"):
                runtime.run_loop("a", "go", request(), stream=1)  # type: ignore[arg-type]
            assert runtime.loops() == []


class Person(BaseModel):
    name: str
    age: int


class TestRunStream:
    async def test_it_yields_the_text_as_it_comes_and_the_result(self) -> None:
        """`text_deltas()` gives the answer chunk by chunk; `result()` the
        result, whose output is the answer's text (and typed so)."""
        agent = Agent(ScriptedProvider([text("Paris is the capital.")]))
        async with agent.run_stream("Capital of France?") as run:
            chunks = [chunk async for chunk in run.text_deltas()]
            result = await run.result()
        assert len(chunks) > 1
        assert "".join(chunks) == "Paris is the capital."
        assert_type(result, LoopResult[str])
        assert_type(result.output, str | None)
        assert result.output == "Paris is the capital."
        assert result.loop_id == run.loop_id

    async def test_it_yields_every_event_of_the_loop(self) -> None:
        """Even for an agent made without `streaming=True`: the run streams."""
        agent = Agent(
            ScriptedProvider([calls(call("add", a=1, b=2)), text("3")]), tools=[add]
        )
        async with Runtime() as runtime, agent.run_stream("1+2?") as run:
            events = await read(run)
            assert run.runtime is runtime
        assert_whole(events, run.loop_id)
        deltas = [e.delta for e in events if isinstance(e, InferenceStream)]
        assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == "3"
        assert "function_call.completed" in [e.type for e in events]

    async def test_structured_output_is_the_typed_model(self) -> None:
        script = ScriptedProvider([text('{"name": "Ada", "age": 36}')])
        agent = Agent(script, output_type=Person)
        assert_type(agent, Agent[Person])
        async with agent.run_stream("Who?") as run:
            await read(run)
            result = await run.result()
        assert_type(result.output, Person | None)
        assert result.output == Person(name="Ada", age=36)

    async def test_a_failed_loop_raises_from_result(self) -> None:
        """`result()` raises `LoopFailedError`, out of the runtime the block
        opened as it is (no exception group, on trio either)."""
        agent = Agent(ScriptedProvider([RuntimeError("the model broke")]))

        async def stream() -> None:
            async with agent.run_stream("hi") as run:
                events = await read(run)
                assert events[-1].type == "loop.idle"
                await run.result()

        with pytest.raises(LoopFailedError, match="the model broke"):
            await stream()
        async with agent.run_stream("hi", raise_on_failure=False) as run:
            assert (await run.result()).outcome is Outcome.failed

    async def test_leaving_the_block_early_cancels_the_loop(self) -> None:
        gate = Gate()
        agent = Agent(FunctionProvider(gate), tools=[add])
        async with Runtime() as runtime:
            async with agent.run_stream("go", runtime=runtime) as run:
                async for event in run:
                    if event.type == "function_call.completed":
                        break
            result = await runtime.wait(run.loop_id)
        assert (result.outcome, result.reason) == (
            Outcome.cancelled,
            "the run_stream block was left before the loop ended",
        )

    async def test_a_paused_run_goes_on_after_resume(self) -> None:
        script = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        agent = Agent(script, tools=[add], handlers=[pause_tools])
        types = []
        async with agent.run_stream("1+2?") as run:
            async for event in run:
                types.append(event.type)
                if event.type == "loop.paused":
                    await wait_until(
                        lambda: run.runtime.get(run.loop_id).status is LoopStatus.paused
                    )
                    run.runtime.resume(run.loop_id)
            result = await run.result()
        assert result.output == "3"
        assert types.index("loop.paused") < types.index("loop.resumed")

    def test_bad_arguments_fail_at_the_call(self) -> None:
        agent = Agent(ScriptedProvider([]))
        with pytest.raises(TypeError, match=r"message must be"):
            agent.run_stream(3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"raise_on_failure must be a bool"):
            agent.run_stream("hi", raise_on_failure="yes")  # type: ignore[arg-type]


def test_the_output_type_is_inferred() -> None:
    """Type checkers see `result.output` typed by the agent (mypy checks these
    lines: `assert_type` is a no-op at run time)."""
    plain = Agent("scripted:x")
    assert_type(plain, Agent[str])
    schema = Agent("scripted:x", output_type={"type": "object"})
    assert_type(schema, Agent[Any])
    typed = Agent("scripted:x", output_type=Person)
    assert_type(typed, Agent[Person])
    assert (plain.model, schema.model, typed.model) == ("scripted:x",) * 3


class TestKeepStreams:
    """An untaken stream of an ended loop is kept until `keep_streams` other
    such loops ended after it: the waste of never reading is bounded."""

    async def test_the_oldest_untaken_streams_are_dropped(self) -> None:
        script = ScriptedProvider([text("hi")])
        async with Runtime(providers={"scripted": script}, keep_streams=2) as rt:
            ids = []
            for _ in range(4):
                ids.append(rt.run_loop("a", "go", request(), stream=True))
                await rt.wait(ids[-1])
            for dropped in ids[:2]:
                with pytest.raises(LoopStateError, match=r"keep_streams=2"):
                    rt.events(dropped)
                assert rt.get(dropped).status is LoopStatus.done  # its result: kept
            for kept in ids[2:]:
                assert_whole(await read(rt.events(kept)), kept)

    async def test_taken_and_live_streams_do_not_count(self) -> None:
        """A stream taken while its loop ran is the reader's, and a paused
        loop's untaken stream is kept however many loops end meanwhile."""
        script = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        async with Runtime(providers={"scripted": script}, keep_streams=1) as rt:
            paused = rt.run_loop("a", "go", request(), pause_tools, stream=True)
            taken_id = rt.run_loop("a", "go", request(), stream=True)
            taken = rt.events(taken_id)
            await rt.wait(taken_id)
            # One after another: which untaken stream is the oldest must not
            # depend on the order concurrent loops end in (trio shuffles it).
            others = []
            for _ in range(3):
                others.append(rt.run_loop("a", "go", request(), stream=True))
                await rt.wait(others[-1])
            await wait_until(lambda: rt.get(paused).status is LoopStatus.paused)
            assert_whole(await read(taken), taken_id)
            with pytest.raises(LoopStateError, match=r"keep_streams=1"):
                rt.events(others[1])
            assert_whole(await read(rt.events(others[2])), others[2])
            events = rt.events(paused)
            rt.resume(paused, Proceed())
            assert_whole(await read(events), paused)

    async def test_with_none_kept_a_stream_is_dropped_at_its_end(self) -> None:
        script = ScriptedProvider([text("hi")])
        async with Runtime(providers={"scripted": script}, keep_streams=0) as rt:
            loop_id = rt.run_loop("a", "go", request(), stream=True)
            await rt.wait(loop_id)
            with pytest.raises(LoopStateError, match=r"not kept"):
                rt.events(loop_id)

    def test_keep_streams_must_be_an_int_of_at_least_0(self) -> None:
        with pytest.raises(ValueError, match=r"keep_streams must be an int >= 0"):
            Runtime(keep_streams=-1)
        with pytest.raises(TypeError, match=r"keep_streams must be an int >= 0"):
            Runtime(keep_streams="5")  # type: ignore[arg-type]


async def texts(run: StreamedRun[Any]) -> list[str]:
    with anyio.fail_after(10):
        return [chunk async for chunk in run.text_deltas()]


def _approval_agent(answer: str = "3") -> Agent[str]:
    script = ScriptedProvider([calls(call("add", a=1, b=2)), text(answer)])
    return Agent(script, tools=[add], handlers=[pause_tools])


class TestRunStreamPauses:
    async def test_text_deltas_raise_at_a_pause_and_go_on_after_resume(
        self,
    ) -> None:
        """Waiting for text at a pause would wait forever: `text_deltas()`
        raises, saying why, and iterated again after the resume it goes on."""
        async with _approval_agent("one two three").run_stream("1+2?") as run:
            with pytest.raises(LoopStateError) as paused:
                await texts(run)
            message = str(paused.value)
            assert run.loop_id in message
            assert "approval required" in message  # the pause's reason
            assert "run.runtime.resume(run.loop_id" in message
            assert run.runtime.get(run.loop_id).status is LoopStatus.paused
            run.runtime.resume(run.loop_id)
            after = await texts(run)
            with anyio.fail_after(10):
                result = await run.result()
        assert "".join(after) == "one two three"
        assert result.output == "one two three"

    async def test_result_waits_through_a_pause(self) -> None:
        """A pause is not an end: `result()` returns once the loop is resumed
        and ended, and the run's own events show the pause."""
        async with _approval_agent().run_stream("1+2?") as run:
            results: list[LoopResult[str]] = []

            async def wait_for_result() -> None:
                results.append(await run.result())

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_for_result)
                with anyio.fail_after(10):
                    async for event in run:
                        if event.type == "loop.paused":
                            break
                await anyio.wait_all_tasks_blocked()
                assert results == []  # still waiting
                assert run.runtime.get(run.loop_id).status is LoopStatus.paused
                run.runtime.resume(run.loop_id)
        assert [r.output for r in results] == ["3"]


class TestRunStreamBlock:
    async def test_breaking_out_of_text_deltas_leaves_nothing_unfinished(
        self,
    ) -> None:
        """The docstring's own pattern, breaking out: nothing is left to
        finalize (trio warns of an async generator collected unfinished)."""
        agent = Agent(ScriptedProvider([text("one two three four")]))
        gc.collect()  # earlier tests' garbage warns outside this test's block
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            async with Runtime() as runtime:
                async with agent.run_stream("go", runtime=runtime) as run:
                    chunks = run.text_deltas()
                    async for chunk in chunks:
                        assert chunk
                        break
                    else:
                        pytest.fail("no text chunk to break out at")
                    del chunks
                gc.collect()
                await anyio.wait_all_tasks_blocked()
        assert [str(w.message) for w in caught] == []

    async def test_after_the_block_the_unread_events_are_gone(self) -> None:
        """Leaving the block drops what was not read: reading after it raises,
        rather than hand out the events of a loop the block cancelled."""
        gate = Gate()
        agent = Agent(FunctionProvider(gate), tools=[add])
        async with Runtime() as runtime:
            async with agent.run_stream("go", runtime=runtime) as run:
                deltas = run.text_deltas()
                with anyio.fail_after(10):
                    await gate.waiting.wait()
                    first = await run.__anext__()
                assert first.type == "loop.started"
            await runtime.wait(run.loop_id)
            with pytest.raises(LoopStateError, match=r"block of loop .* was left"):
                await run.__anext__()
            with pytest.raises(LoopStateError, match=r"block of loop .* was left"):
                await deltas.__anext__()
            with pytest.raises(LoopStateError, match=r"block of loop .* was left"):
                run.text_deltas()
