from __future__ import annotations

import anyio
import pytest

from agentfsm import (
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
    Trigger,
    tool,
)
from agentfsm.events import FunctionCallCompleted, LoopIdle
from agentfsm.interception import Decision
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


async def test_runtime_cancelled_from_outside() -> None:
    """Cancelling the scope around a runtime cancels its loops cleanly."""

    async def never(req: InferenceInput) -> InferenceOutput:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    runtime = Runtime(providers={"fn": FunctionProvider(never)})
    with anyio.CancelScope() as scope:
        async with runtime:
            loop_id = runtime.run_loop("agent", "hi", request(model="fn:x"))
            await wait_for_state(runtime, loop_id, LoopState.inference)
            scope.cancel()
            await anyio.sleep_forever()
    assert runtime.get(loop_id).outcome is Outcome.cancelled


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
