""" "Force this tool once, then auto" in a loop: the loop's first request forces
the tool, every later one goes out with `reset_tool_choice`, steering included."""

from __future__ import annotations

from agentfsm import (
    InferenceInput,
    LoopState,
    ModelContext,
    PendingTransition,
    Rewrite,
    Runtime,
    Trigger,
    current_loop_id,
    current_runtime,
    tool,
)
from agentfsm.testing import ScriptedProvider, call, calls, text


@tool
async def add_and_steer(a: int, b: int) -> int:
    """Add, and steer the loop (a user message enters the context)."""
    loop_id = current_loop_id()
    assert loop_id is not None
    current_runtime().steer(loop_id, "also, be brief")
    return a + b


async def test_steering_does_not_force_the_tool_again() -> None:
    provider = ScriptedProvider([calls(call("add_and_steer", a=1, b=2)), text("3")])
    request = InferenceInput(
        model="scripted:x",
        context=ModelContext(),
        tools=[add_and_steer],
        tool_choice="add_and_steer",
        reset_tool_choice="auto",
    )
    async with Runtime(providers={"scripted": provider}) as runtime:
        result = await runtime.wait(runtime.run_loop("agent", "1+2?", request))
        # A second loop on the same input forces the tool again, once.
        provider2 = ScriptedProvider(
            [calls(call("add_and_steer", a=2, b=2)), text("4")]
        )
        runtime.providers.register("other", provider2)
        again = request.model_copy(update={"model": "other:x"})
        await runtime.wait(runtime.run_loop("agent", "2+2?", again))
    assert result.answer is not None
    assert [r.tool_choice for r in provider.requests] == [
        "add_and_steer",
        "auto",
    ]
    assert [r.tool_choice for r in provider2.requests] == [
        "add_and_steer",
        "auto",
    ]
    assert request.tool_choice == "add_and_steer"  # the input itself is unchanged


async def test_a_rewrite_onto_inference_sends_the_request_the_loop_would() -> None:
    """A handler taking `steer` on to `inference` without a payload: the request
    is the one the loop would make itself, with the forced tool released (it
    was the loop's raw input, which forced the tool again)."""
    provider = ScriptedProvider([calls(call("add_and_steer", a=1, b=2)), text("3")])
    request = InferenceInput(
        model="scripted:x",
        context=ModelContext(),
        tools=[add_and_steer],
        tool_choice="add_and_steer",
        reset_tool_choice="auto",
    )

    def straight_to_inference(pending: PendingTransition) -> Rewrite | None:
        if pending.trigger is Trigger.steer:
            return Rewrite(dest=LoopState.inference)
        return None

    async with Runtime(providers={"scripted": provider}) as runtime:
        loop_id = runtime.run_loop("agent", "1+2?", request, straight_to_inference)
        result = await runtime.wait(loop_id)
    assert result.answer is not None
    assert [r.tool_choice for r in provider.requests] == ["add_and_steer", "auto"]
