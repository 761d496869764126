"""Steering and follow-up queues: when queued messages enter the context."""

from __future__ import annotations

import anyio
import pytest

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    ModelMessageItem,
    Runtime,
    Trigger,
    UserMessage,
    tool,
)
from agentfsm.events import (
    ModelAnswer,
)
from agentfsm.exceptions import LoopStateError
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    assert_path,
    call,
    calls,
    text,
)
from tests.helpers import items_of, request


class TestQueues:
    async def test_steering_during_a_tool_batch(self) -> None:
        """Steering sent while a tool runs enters after the tool outputs, before the next request."""
        running, release = anyio.Event(), anyio.Event()

        @tool
        async def slow(n: int) -> int:
            """Waits for the test."""
            running.set()
            await release.wait()
            return n

        provider = ScriptedProvider(
            [
                calls(call("slow", call_id="a", n=1), call("slow", call_id="b", n=2)),
                text("done"),
            ]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(
                runtime.bus, ["loop.transition", "function_call.completed"]
            )
            inference_input = request(slow)
            loop_id = runtime.run_loop("agent", "go", inference_input)
            with anyio.fail_after(5):
                await running.wait()
            runtime.steer(loop_id, "also consider c")
            release.set()
            result = await runtime.wait(loop_id)
        assert items_of(inference_input.context) == [
            "user:go",
            "call:a",
            "call:b",
            "out:a=1",
            "out:b=2",
            "user:also consider c",
            "model:done",
        ]
        assert_path(
            result,
            "idle context_update inference function_call context_update inference "
            "model_message idle",
        )
        assert result.path[3].trigger is Trigger.steer
        assert recorder.types(loop_id) == [
            "loop.transition",
            "loop.transition",
            "loop.transition",
            "function_call.completed",
            "function_call.completed",
            "loop.transition",
            "loop.transition",
            "loop.transition",
            "loop.transition",
        ]

    async def test_steering_before_the_first_request(self) -> None:
        """Steering queued before the loop runs joins the first request."""
        provider = ScriptedProvider([text("ok")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request()
            loop_id = runtime.run_loop("agent", "first", inference_input)
            runtime.steer(loop_id, "second")
            await runtime.wait(loop_id)
        assert items_of(inference_input.context) == [
            "user:first",
            "user:second",
            "model:ok",
        ]
        assert items_of(provider.requests[0].context)[:2] == [
            "user:first",
            "user:second",
        ]

    async def test_follow_up_after_an_answer(self) -> None:
        """A follow-up is sent after the answer; model.answer is published for each."""
        gate = anyio.Event()

        async def model(req: InferenceInput) -> InferenceOutput:
            last = req.context.items[-1]
            assert isinstance(last, UserMessage)
            if last.content == "q1":
                await gate.wait()
            return text(f"a:{last.content}")

        async with Runtime(providers={"fn": FunctionProvider(model)}) as runtime:
            recorder = EventRecorder(runtime.bus, "model.answer")
            inference_input = request(model="fn:x")
            loop_id = runtime.run_loop("agent", "q1", inference_input)
            runtime.follow_up(loop_id, "q2")
            runtime.follow_up(loop_id, "q3")
            gate.set()
            result = await runtime.wait(loop_id)
            with pytest.raises(LoopStateError, match="has ended"):
                runtime.follow_up(loop_id, "too late")
        assert items_of(inference_input.context) == [
            "user:q1",
            "model:a:q1",
            "user:q2",
            "user:q3",
            "model:a:q3",
        ]
        assert result.answer == ModelMessageItem(content="a:q3")
        assert result.path[3].trigger is Trigger.follow_up
        answers = [
            e.message.content for e in recorder.events if isinstance(e, ModelAnswer)
        ]
        assert answers == ["a:q1", "a:q3"]

    async def test_one_at_a_time_follow_ups(self) -> None:
        """follow_up_mode='one-at-a-time' sends one queued message per turn."""

        def model(req: InferenceInput) -> InferenceOutput:
            last = req.context.items[-1]
            assert isinstance(last, UserMessage)
            return text(f"a:{last.content}")

        async with Runtime(providers={"fn": FunctionProvider(model)}) as runtime:
            inference_input = request(model="fn:x")
            loop_id = runtime.run_loop(
                "agent", "q1", inference_input, follow_up_mode="one-at-a-time"
            )
            runtime.follow_up(loop_id, "q2")
            runtime.follow_up(loop_id, "q3")
            result = await runtime.wait(loop_id)
        assert items_of(inference_input.context) == [
            "user:q1",
            "model:a:q1",
            "user:q2",
            "model:a:q2",
            "user:q3",
            "model:a:q3",
        ]
        assert result.model_requests == 3

    async def test_nothing_queued_ends_as_before(self) -> None:
        """Without queued messages the loop ends after its answer."""
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("x")])}
        ) as runtime:
            result = await runtime.wait(runtime.run_loop("agent", "q", request()))
        assert_path(result, "idle context_update inference model_message idle")
