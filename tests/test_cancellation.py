from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import anyio
import pytest

from agentfsm import (
    ConfigurationError,
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    LoopState,
    LoopStatus,
    Outcome,
    Pause,
    PendingTransition,
    Runtime,
    Subscription,
    ToolCallContext,
    Trigger,
    current_call,
    report_progress,
    tool,
)
from agentfsm.events import FunctionCallCompleted, LoopIdle
from agentfsm.exceptions import NoToolCallError, ToolCancelled
from agentfsm.interception import Decision
from agentfsm.providers import Provider
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    assert_path,
    call,
    calls,
    text,
)
from tests.helpers import request


async def wait_for_state(runtime: Runtime, loop_id: str, state: LoopState) -> None:
    with anyio.fail_after(5):
        while runtime.get(loop_id).state is not state:
            await anyio.wait_all_tasks_blocked()


async def test_cancel_during_inference() -> None:
    """Cancelling a loop waiting on the model ends it cancelled, in idle, with no task left."""
    closed = anyio.Event()

    async def never(req: InferenceInput) -> InferenceOutput:
        try:
            await anyio.sleep_forever()
        finally:
            closed.set()
        raise AssertionError("unreachable")

    async with Runtime(providers={"fn": FunctionProvider(never)}) as runtime:
        recorder = EventRecorder(runtime.bus)
        loop_id = runtime.run_loop("agent", "hi", request(model="fn:x"))
        await wait_for_state(runtime, loop_id, LoopState.inference)
        runtime.cancel(loop_id, "user pressed stop")
        result = await runtime.wait(loop_id)
        assert closed.is_set()
        await anyio.wait_all_tasks_blocked()
        assert runtime._running == 0
    assert (result.outcome, result.reason) == (Outcome.cancelled, "user pressed stop")
    assert_path(result, "idle context_update inference idle")
    assert result.path[-1].trigger is Trigger.cancel
    assert recorder.types(loop_id)[-2:] == ["loop.transition", "loop.idle"]


async def test_cancel_during_a_tool_call_gives_every_call_an_output() -> None:
    """Cancelling mid-batch: the running call and the ones after it get error outputs."""
    started = anyio.Event()

    @tool
    async def slow(n: int) -> int:
        """Sleeps until cancelled."""
        started.set()
        await anyio.sleep_forever()
        return n

    provider = ScriptedProvider(
        [
            calls(call("slow", call_id="a", n=1), call("slow", call_id="b", n=2)),
            text("never"),
        ]
    )
    async with Runtime(providers={"scripted": provider}) as runtime:
        recorder = EventRecorder(runtime.bus, ["function_call.completed", "loop.idle"])
        inference_input = request(slow)
        loop_id = runtime.run_loop("agent", "go", inference_input)
        with anyio.fail_after(5):
            await started.wait()
        runtime.cancel(loop_id)
        result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.cancelled
    assert_path(result, "idle context_update inference function_call idle")
    items = inference_input.context.items
    call_ids = [i.call_id for i in items if isinstance(i, FunctionCallItem)]
    outputs = [i for i in items if isinstance(i, FunctionCallOutputItem)]
    assert call_ids == ["a", "b"]
    assert [o.call_id for o in outputs] == ["a", "b"]
    assert all(o.is_error and "interrupted" in o.output for o in outputs)
    completed = [e for e in recorder.events if isinstance(e, FunctionCallCompleted)]
    assert [e.output.call_id for e in completed] == ["a", "b"]
    assert isinstance(recorder.events[-1], LoopIdle)


async def test_cancel_a_paused_loop() -> None:
    """A paused loop (no task) can be cancelled; it ends cancelled in idle."""

    def hold(pending: PendingTransition) -> Decision | None:
        return Pause("approval") if pending.trigger is Trigger.call_tools else None

    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("no")])
    async with Runtime(providers={"scripted": provider}) as runtime:
        inference_input = request()
        loop_id = runtime.run_loop("agent", "go", inference_input, hold)
        with anyio.fail_after(5):
            while runtime.get(loop_id).status is not LoopStatus.paused:
                await anyio.wait_all_tasks_blocked()
        runtime.cancel(loop_id)
        result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.cancelled
    assert_path(result, "idle context_update inference idle")
    assert not any(
        isinstance(i, FunctionCallItem) for i in inference_input.context.items
    )


async def test_cancel_before_the_loop_task_ran_and_after_it_finished() -> None:
    """Cancel right after run_loop ends the loop cancelled; cancelling a finished loop does nothing."""
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("a"), text("b")])}
    ) as runtime:
        early = runtime.run_loop("agent", "hi", request())
        runtime.cancel(early)
        assert (await runtime.wait(early)).outcome is Outcome.cancelled
        done = runtime.run_loop("agent", "hi", request())
        assert (await runtime.wait(done)).outcome is Outcome.answered
        runtime.cancel(done)
        assert (await runtime.wait(done)).outcome is Outcome.answered


async def test_leaving_the_runtime_with_an_error_cancels_every_loop() -> None:
    """An exception leaving the runtime cancels its loops; each still ends idle, cancelled."""

    async def never(req: InferenceInput) -> InferenceOutput:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    runtime = Runtime(providers={"fn": FunctionProvider(never)})
    with pytest.raises(RuntimeError, match="caller failed"):  # noqa: PT012 - the block is the subject
        async with runtime:
            recorder = EventRecorder(runtime.bus, "loop.idle")
            ids = [
                runtime.run_loop("agent", str(i), request(model="fn:x"))
                for i in range(5)
            ]
            await wait_for_state(runtime, ids[-1], LoopState.inference)
            raise RuntimeError("caller failed")
    for loop_id in ids:
        view = runtime.get(loop_id)
        assert (view.status, view.outcome, view.state) == (
            LoopStatus.done,
            Outcome.cancelled,
            LoopState.idle,
        )
    idles = [e for e in recorder.events if isinstance(e, LoopIdle)]
    assert sorted(e.loop_id for e in idles) == sorted(ids)


async def test_leaving_with_an_error_ends_paused_loops_too() -> None:
    """A loop paused when an error leaves the runtime ends cancelled, with loop.idle."""

    def hold(pending: PendingTransition) -> Decision | None:
        return Pause("hold") if pending.trigger is Trigger.infer else None

    runtime = Runtime(providers={"scripted": ScriptedProvider([text("x")])})
    with pytest.raises(RuntimeError, match="caller failed"):  # noqa: PT012 - the block is the subject
        async with runtime:
            recorder = EventRecorder(runtime.bus, "loop.idle")
            loop_id = runtime.run_loop("agent", "hi", request(), hold)
            with anyio.fail_after(5):
                while runtime.get(loop_id).status is not LoopStatus.paused:
                    await anyio.wait_all_tasks_blocked()
            raise RuntimeError("caller failed")
    view = runtime.get(loop_id)
    assert (view.status, view.state, view.outcome) == (
        LoopStatus.done,
        LoopState.idle,
        Outcome.cancelled,
    )
    idles = [e for e in recorder.events if isinstance(e, LoopIdle)]
    assert [e.loop_id for e in idles] == [loop_id]


def worker_tasks() -> list[anyio.TaskInfo]:
    return [t for t in anyio.get_running_tasks() if t.name == "agentfsm-worker"]


class TestACancelNeverWaitsOnASubscriber:
    """A backpressure subscriber that never reads (a stalled disk under the
    event log, say) holds neither a cancelled loop nor the runtime's exit; the
    events it has not taken yet wait in its buffer, in order, none lost."""

    async def test_a_cancelled_loops_worker_does_not_wait_for_room(self) -> None:
        provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        with anyio.fail_after(10):
            async with Runtime(providers={"scripted": provider}) as runtime:
                reader = EventRecorder(runtime.bus)
                stalled = runtime.bus.subscribe(buffer=1, backpressure=True)
                try:
                    loop_id = runtime.run_loop("agent", "go", request())
                    await anyio.wait_all_tasks_blocked()  # waits for room
                    assert runtime.get(loop_id).state is not LoopState.idle
                    runtime.cancel(loop_id, "stop")
                    result = await runtime.wait(loop_id)
                    await anyio.wait_all_tasks_blocked()
                    assert worker_tasks() == []  # its worker ended, not waiting
                finally:
                    # (Only reached with the subscriber still stalled when an
                    # assertion failed: closing it lets the runtime exit.)
                    if worker_tasks():
                        stalled.close()
        assert (result.outcome, result.reason) == (Outcome.cancelled, "stop")
        held = []
        while stalled.statistics().buffered:
            held.append(stalled.receive_nowait())
        assert [e.seq for e in held] == list(range(1, len(held) + 1))
        assert isinstance(held[-1], LoopIdle)
        assert held[-1].outcome is Outcome.cancelled
        assert [e.seq for e in reader.of_loop(loop_id)] == [e.seq for e in held]

    @pytest.mark.parametrize(
        "where",
        [
            pytest.param("running", id="running"),
            pytest.param("pausing", id="paused-its-pause-held"),
            pytest.param("paused", id="paused-its-pause-read"),
        ],
    )
    async def test_the_runtime_left_with_an_error_exits(self, where: str) -> None:
        """Leaving the runtime with an error cancels a loop held by the stalled
        subscriber, or paused (its pause still held, or read just before the
        subscriber stalled): the runtime exits, and the subscriber still has
        every event, ending with `loop.idle`."""

        def hold(pending: PendingTransition) -> Decision | None:
            pause = where != "running" and pending.trigger is Trigger.infer
            return Pause("hold") if pause else None

        provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        runtime = Runtime(providers={"scripted": provider})
        stalled = runtime.bus.subscribe(buffer=1, backpressure=True)
        received = []
        async with unstalled_if_stuck(stalled) as stuck:
            with pytest.raises(RuntimeError, match="caller failed"):  # noqa: PT012 - the block is the subject
                async with runtime:
                    loop_id = runtime.run_loop("agent", "go", request(), hold)
                    if where == "paused":  # read up to the pause, then stall
                        with anyio.fail_after(5):
                            async for event in stalled:
                                received.append(event)
                                if event.type == "loop.paused":
                                    break
                    await anyio.wait_all_tasks_blocked()
                    assert runtime.get(loop_id).path  # it ran, and holds events
                    raise RuntimeError("caller failed")
        assert not stuck, "the runtime's exit waited on the subscriber"
        assert runtime.get(loop_id).outcome is Outcome.cancelled
        while stalled.statistics().buffered:
            received.append(stalled.receive_nowait())
        assert [e.seq for e in received] == list(range(1, len(received) + 1))
        assert isinstance(received[-1], LoopIdle)


@asynccontextmanager
async def unstalled_if_stuck(subscription: Subscription) -> AsyncIterator[list[bool]]:
    """Close `subscription` if the block has not ended in 5 s (the runtime's exit
    waits on it): a hang inside a cancel shield, which `fail_after` cannot
    interrupt, then fails the test instead of stopping the run. The list
    yielded says whether it had to."""
    stuck: list[bool] = []

    async def watch() -> None:
        await anyio.sleep(5)
        stuck.append(True)
        subscription.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        yield stuck
        tg.cancel_scope.cancel()


class TestSyncToolsSeeTheCancel:
    """A sync tool's thread cannot be killed: the call is reported interrupted at
    once, the thread runs on, and `current_call()` lets it see the cancel."""

    async def test_a_tool_polling_cancelled_stops_before_its_late_side_effect(
        self,
    ) -> None:
        effects: list[str] = []
        seen: list[ToolCallContext] = []
        started, stopped = threading.Event(), threading.Event()

        @tool
        def write_slowly() -> str:
            """Write, unless interrupted first."""
            running = current_call()
            seen.append(running)
            started.set()
            for _ in range(5000):  # 5 s at most
                if running.cancelled:
                    stopped.set()
                    return "stopped early"
                time.sleep(0.001)
            effects.append("late write")
            return "written"

        provider = ScriptedProvider(
            [calls(call("write_slowly", call_id="w")), text("x")]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request(write_slowly)
            loop_id = runtime.run_loop("agent-7", "go", inference_input)
            assert await anyio.to_thread.run_sync(started.wait, 5)
            assert not seen[0].cancelled
            runtime.cancel(loop_id, "stop")
            result = await runtime.wait(loop_id)
            assert await anyio.to_thread.run_sync(stopped.wait, 5)
        assert result.outcome is Outcome.cancelled
        assert effects == []
        (running,) = seen
        assert (
            running.loop_id,
            running.agent_id,
            running.call_id,
            running.tool_name,
        ) == (
            loop_id,
            "agent-7",
            "w",
            "write_slowly",
        )
        assert running.cancelled
        (output,) = [
            i
            for i in inference_input.context.items
            if isinstance(i, FunctionCallOutputItem)
        ]
        assert output.is_error
        assert output.output == "the tool call was interrupted: the loop was cancelled"

    async def test_a_tool_ignoring_the_cancel_runs_on_and_its_result_is_dropped(
        self,
    ) -> None:
        """The call is reported interrupted while the thread still runs; its side
        effect lands late, and what it returns and reports then is dropped."""
        effects: list[str] = []
        taken: list[bool] = []
        started, release, finished = (
            threading.Event(),
            threading.Event(),
            threading.Event(),
        )

        @tool
        def stubborn() -> str:
            """Wait to be released, whatever happens."""
            started.set()
            release.wait(5)
            effects.append("late write")
            taken.append(report_progress("done"))
            finished.set()
            return "late result"

        provider = ScriptedProvider([calls(call("stubborn")), text("x")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(runtime.bus)
            inference_input = request(stubborn)
            loop_id = runtime.run_loop("agent", "go", inference_input)
            assert await anyio.to_thread.run_sync(started.wait, 5)
            runtime.cancel(loop_id)
            result = await runtime.wait(loop_id)
            assert effects == []  # reported interrupted while the thread runs on
            release.set()
            assert await anyio.to_thread.run_sync(finished.wait, 5)
            await anyio.wait_all_tasks_blocked()
        assert result.outcome is Outcome.cancelled
        assert effects == ["late write"]
        assert taken == [False]
        outputs = [
            i
            for i in inference_input.context.items
            if isinstance(i, FunctionCallOutputItem)
        ]
        assert [(o.is_error, "interrupted" in o.output) for o in outputs] == [
            (True, True)
        ]
        assert recorder.types(loop_id)[-1] == "loop.idle"  # nothing after the end

    async def test_wait_cancelled_and_raise_if_cancelled(self) -> None:
        """A tool sleeping with `wait_cancelled` wakes at the cancel, and
        `raise_if_cancelled` unwinds it with `ToolCancelled`."""
        raised: list[BaseException] = []
        started, done = threading.Event(), threading.Event()

        @tool
        def sleeper() -> str:
            """Sleep until interrupted."""
            running = current_call()
            try:
                running.raise_if_cancelled()  # not yet: nothing raised
                started.set()
                assert running.wait_cancelled(5)
                running.raise_if_cancelled()
            except ToolCancelled as exc:
                raised.append(exc)
                raise
            finally:
                done.set()
            return "never"

        provider = ScriptedProvider([calls(call("sleeper", call_id="s")), text("x")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            loop_id = runtime.run_loop("agent", "go", request(sleeper))
            assert await anyio.to_thread.run_sync(started.wait, 5)
            runtime.cancel(loop_id)
            assert (await runtime.wait(loop_id)).outcome is Outcome.cancelled
            assert await anyio.to_thread.run_sync(done.wait, 5)
        (exc,) = raised
        assert isinstance(exc, ToolCancelled)
        assert exc.tool == "sleeper"
        assert "tool call s ('sleeper') was interrupted" in str(exc)

    async def test_a_tool_past_its_timeout_sees_the_interruption(self) -> None:
        """A timed-out call is interrupted too: the loop goes on without it."""
        woke = threading.Event()

        # The timeout leaves the worker thread a second to pick the call up: a
        # call cancelled before its thread starts never runs (anyio drops it),
        # so with a timeout of a few milliseconds a loaded machine could leave
        # nothing to interrupt.
        @tool(timeout=1)
        def slow() -> str:
            """Sleep until interrupted."""
            if current_call().wait_cancelled(30):
                woke.set()
            return "too late"

        provider = ScriptedProvider([calls(call("slow")), text("went on")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request(slow)
            result = await runtime.wait(
                runtime.run_loop("agent", "go", inference_input)
            )
            assert await anyio.to_thread.run_sync(woke.wait, 30)
        assert result.outcome is Outcome.answered
        (output,) = [
            i
            for i in inference_input.context.items
            if isinstance(i, FunctionCallOutputItem)
        ]
        assert output.is_error
        assert "timed out" in output.output

    async def test_current_call_outside_a_call_and_from_the_event_loop(self) -> None:
        """Outside a tool call `current_call()` says so; an async tool sees its
        call, and may not block the event loop in `wait_cancelled`."""
        with pytest.raises(NoToolCallError, match="only available inside a tool call"):
            current_call()
        errors: list[str] = []

        @tool
        async def probe() -> str:
            """Look at the current call."""
            running = current_call()
            try:
                running.wait_cancelled(0)
            except ConfigurationError as exc:
                errors.append(str(exc))
            return f"{running.tool_name} {running.cancelled}"

        provider = ScriptedProvider([calls(call("probe")), text("x")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request(probe)
            await runtime.wait(runtime.run_loop("agent", "go", inference_input))
        (output,) = [
            i
            for i in inference_input.context.items
            if isinstance(i, FunctionCallOutputItem)
        ]
        assert output.output == "probe False"
        (error,) = errors
        assert error.startswith("wait_cancelled() blocks its thread")


class TestACancelledErrorOfItsOwn:
    """On asyncio, code that awaits a task it cancelled itself raises that
    task's `CancelledError`, which cancels nothing of the loop's: a tool's is
    its error output, a provider's or a handler's fails its loop. Neither ends
    the loop as cancelled nor reaches the runtime, its other loops or the
    caller (`_errors.cancelled_from_outside`)."""

    pytestmark = pytest.mark.parametrize("anyio_backend", ["asyncio"])

    @staticmethod
    async def raise_a_cancel_of_its_own() -> None:
        import asyncio  # noqa: TID251 - the asyncio slip this class is about

        task = asyncio.create_task(asyncio.sleep(10))
        await asyncio.sleep(0)
        task.cancel()
        await task

    @pytest.mark.parametrize("mode", ["sequential", "parallel"])
    async def test_a_tools_is_its_error_output(
        self, mode: Literal["sequential", "parallel"]
    ) -> None:
        @tool
        async def slips() -> str:
            """Awaits a task it cancelled."""
            await TestACancelledErrorOfItsOwn.raise_a_cancel_of_its_own()
            return "never"

        @tool
        async def waits() -> str:
            """Waits a little."""
            await anyio.sleep(0.01)
            return "waited"

        provider = ScriptedProvider([calls(call("slips"), call("waits")), text("A")])
        other = ScriptedProvider([calls(call("waits")), text("B")])
        with anyio.fail_after(10):
            async with Runtime(providers={"scripted": provider, "o": other}) as rt:
                b = rt.run_loop("b", "go", request(waits, model="o:x"))
                inference_input = request(slips, waits)
                a = rt.run_loop("a", "go", inference_input, tool_execution=mode)
                result = await rt.wait(a)
                await anyio.lowlevel.checkpoint()  # the caller goes on
                other_result = await rt.wait(b)
        assert (result.outcome, other_result.outcome) == (
            Outcome.answered,
            Outcome.answered,
        )
        outputs = [
            i
            for i in inference_input.context.items
            if type(i) is FunctionCallOutputItem
        ]
        assert [o.is_error for o in outputs] == [True, False]
        assert "raised CancelledError of its own" in outputs[0].output
        assert outputs[1].output == "waited"

    async def test_a_providers_fails_its_loop(self) -> None:
        async def slips(_request: InferenceInput) -> InferenceOutput:
            await TestACancelledErrorOfItsOwn.raise_a_cancel_of_its_own()
            raise AssertionError("not reached")

        providers: dict[str, Provider] = {
            "slips": FunctionProvider(slips),
            "scripted": ScriptedProvider([text("fine")]),
        }
        with anyio.fail_after(10):
            async with Runtime(providers=providers) as rt:
                failed = await rt.wait(rt.run_loop("a", "go", request(model="slips:x")))
                fine = await rt.wait(rt.run_loop("b", "go", request()))
        assert failed.outcome is Outcome.failed
        assert failed.error is not None
        assert failed.error.type == "CancelledError"
        assert fine.outcome is Outcome.answered

    async def test_a_handlers_fails_its_loop(self) -> None:
        async def slips(_pending: PendingTransition) -> Decision:
            await TestACancelledErrorOfItsOwn.raise_a_cancel_of_its_own()
            raise AssertionError("not reached")

        provider = ScriptedProvider([text("hi"), text("fine")])
        with anyio.fail_after(10):
            async with Runtime(providers={"scripted": provider}) as rt:
                failed = await rt.wait(rt.run_loop("a", "go", request(), slips))
                fine = await rt.wait(rt.run_loop("b", "go", request()))
        assert failed.outcome is Outcome.failed
        assert fine.outcome is Outcome.answered

    async def test_a_cancel_of_the_loop_is_still_one(self) -> None:
        """A tool that catches the loop's cancel and raises it again, or lets
        it through, ends the loop cancelled, as before."""
        entered = anyio.Event()

        @tool
        async def waits() -> str:
            """Waits until cancelled."""
            entered.set()
            await anyio.sleep(10)
            return "never"

        provider = ScriptedProvider([calls(call("waits")), text("done")])
        with anyio.fail_after(10):
            async with Runtime(providers={"scripted": provider}) as rt:
                loop_id = rt.run_loop("a", "go", request(waits))
                await entered.wait()
                rt.cancel(loop_id)
                result = await rt.wait(loop_id)
        assert result.outcome is Outcome.cancelled
