"""The public testing helpers behave as documented."""

from __future__ import annotations

import gc

import anyio
import pytest

from agentfsm import LoopStatus, Outcome, Runtime, tool_called
from agentfsm.exceptions import ProviderError
from agentfsm.store import MemoryStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import add, pause_tools, request, wait_until


async def test_a_script_one_step_short_fails_the_loop() -> None:
    """Past the end of its script a loop fails, with an error naming the step count."""
    provider = ScriptedProvider([calls(call("add", a=1, b=2))])
    with anyio.fail_after(10):
        async with Runtime(providers={"scripted": provider}) as runtime:
            result = await runtime.wait(runtime.run_loop("a", "go", request()))
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert result.error.type == "ProviderError"
    assert "the script has 1 steps" in result.error.message
    assert f"loop {result.loop_id} asked for step 2" in result.error.message
    assert len(provider.requests) == 2  # it did not start the script over
    assert result.tool_calls == 1


async def test_each_loop_plays_the_script_from_the_start() -> None:
    """A finished loop does not use up the script for the next loop."""
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    with anyio.fail_after(10):
        async with Runtime(providers={"scripted": provider}) as runtime:
            for _ in range(3):
                result = await runtime.wait(runtime.run_loop("a", "1+2?", request()))
                assert result.outcome is Outcome.answered
                assert result.answer is not None
                assert result.answer.content == "3"


async def test_outside_a_loop_the_script_ends_too() -> None:
    """Called directly, the provider plays its script once, then raises."""
    provider = ScriptedProvider([text("one"), text("two")])
    outputs = [await provider.complete(request()) for _ in range(2)]
    assert [o.message.content for o in outputs if o.message] == ["one", "two"]
    with pytest.raises(ProviderError, match="has 2 steps and outside a loop"):
        await provider.complete(request())


async def test_an_empty_script_raises_at_once() -> None:
    """A script with no steps raises on the first request."""
    with pytest.raises(ProviderError, match="has 0 steps"):
        await ScriptedProvider([]).complete(request())


async def test_loops_ending_mid_script_leave_no_cursor_behind() -> None:
    """1,000 loops that each end before their script does (by `max_turns`, a
    stop condition, or a cancel while paused) leave the provider no cursor."""
    provider = ScriptedProvider([calls(call("add", a=1, b=2))] * 3 + [text("3")])
    with anyio.fail_after(60):
        async with Runtime(providers={"scripted": provider}) as runtime:
            ended = [
                runtime.run_loop("a", "go", request(), max_turns=1) for _ in range(333)
            ] + [
                runtime.run_loop("a", "go", request(), stop_when=[tool_called("add")])
                for _ in range(333)
            ]
            paused = [
                runtime.run_loop("a", "go", request(), pause_tools) for _ in range(334)
            ]
            await wait_until(
                lambda: len(runtime.loops(status=LoopStatus.paused)) == 334
            )
            assert provider._cursors.keys() >= set(paused)  # while they live
            for loop_id in paused:
                runtime.cancel(loop_id)
            results = [await runtime.wait(loop_id) for loop_id in ended + paused]
            assert [r.outcome for r in results] == (
                [Outcome.stopped] * 666 + [Outcome.cancelled] * 334
            )
            assert {r.model_requests for r in results} == {1}  # all mid-script
            gc.collect()
            assert len(provider._cursors) == 0
            assert len(provider._unwatched) == 0


async def test_a_paused_loop_keeps_its_cursor() -> None:
    """A loop's cursor lives as long as the loop: paused, it goes on from the
    step it was at once resumed, and its cursor goes when it ends."""
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    with anyio.fail_after(10):
        async with Runtime(providers={"scripted": provider}) as runtime:
            loop_id = runtime.run_loop("a", "1+2?", request(), pause_tools)
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
            gc.collect()
            assert provider._cursors.keys() == {loop_id}
            assert provider._cursors[loop_id].index == 1
            runtime.resume(loop_id)
            result = await runtime.wait(loop_id)
            assert result.answer is not None
            assert result.answer.content == "3"
            gc.collect()
            assert provider._cursors == {}


async def test_a_loop_left_paused_by_its_runtime_goes_on_with_its_script() -> None:
    """A loop paused as its runtime exits has not ended: its cursor is kept, and
    the runtime that takes it up from the store, with the same provider, goes on
    with the script; the cursor goes once the loop ends there."""
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    store = MemoryStore()
    with anyio.fail_after(20):
        async with Runtime(
            providers={"scripted": provider}, store=store, tools=[add]
        ) as first:
            loop_id = first.run_loop("a", "1+2?", request(), pause_tools)
            await wait_until(lambda: first.get(loop_id).status is LoopStatus.paused)
        gc.collect()
        assert provider._cursors.keys() == {loop_id}
        assert provider._cursors[loop_id].index == 1
        async with Runtime(
            providers={"scripted": provider},
            store=store,
            tools=[add],
            handlers=[pause_tools],
        ) as second:
            assert (await second.recover()).paused == [loop_id]
            second.resume(loop_id)
            result = await second.wait(loop_id)
            assert result.answer is not None
            assert result.answer.content == "3"
            gc.collect()
            assert provider._cursors == {}
