"""At every committed transition of a broad set of loops, the loop's record
round-trips through JSON and compares equal, and says where the loop is.

They are read where an extension's `committed` hook is called (`OnCommit`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from pydantic import BaseModel

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    LoopState,
    ModelContext,
    ModelRequest,
    Outcome,
    Pause,
    PendingTransition,
    ProviderError,
    Rewrite,
    Runtime,
    ToolBatch,
    Trigger,
    UserMessage,
    after_turns,
    tool,
)
from agentfsm._loop import snapshot
from agentfsm.extensions import Extension, LoopExtension, LoopInfo
from agentfsm.providers import ModelNext
from agentfsm.record import LoopRecord
from agentfsm.testing import ScriptedProvider, ScriptStep, call, calls, text
from tests.helpers import add, request, wait_until


class OnCommit(Extension):
    """Calls `hook` with the loop at each of its committed transitions."""

    def __init__(self, hook: Callable[[LoopInfo], None]) -> None:
        self.hook = hook

    def open(self, loop: LoopInfo, /) -> LoopExtension:
        hook = self.hook

        class Part(LoopExtension):
            def committed(self) -> None:
                hook(loop)

        return Part()


class Answer(BaseModel):
    value: int


@tool(needs_approval=True)
async def delete(path: str) -> str:
    """Delete a file (needs approval)."""
    return f"deleted {path}"


@tool
async def slow(x: int) -> int:
    """Sleep a little, then echo."""
    await anyio.lowlevel.checkpoint()
    return x


async def passthrough(request: ModelRequest, next_: ModelNext) -> InferenceOutput:
    return await next_(request)


def swap_model(pending: PendingTransition) -> Rewrite | None:
    """Send every request to another model of the same provider."""
    if pending.trigger is Trigger.infer and isinstance(pending.payload, InferenceInput):
        return Rewrite(
            payload=pending.payload.model_copy(update={"model": "scripted:b"})
        )
    return None


def pause_requests(pending: PendingTransition) -> Pause | None:
    return Pause("look at the request") if pending.trigger is Trigger.infer else None


async def finish_turn(_: object) -> None:
    return None


Driver = Callable[[Runtime, str], Awaitable[None]]


async def resume_with(runtime: Runtime, loop_id: str, decision: Any = None) -> None:
    """Resume the loop each time it pauses, until it ends."""
    while True:
        await wait_until(lambda: runtime.get(loop_id).status != "running")
        view = runtime.get(loop_id)
        if view.status == "done":
            return
        # A paused loop's record round-trips too (read through the public API).
        record = runtime.snapshot(loop_id)
        assert record.pause is not None
        assert record.pending is not None
        assert LoopRecord.model_validate_json(record.model_dump_json()) == record
        pending = view.pending
        assert pending is not None
        if decision == "deny" and isinstance(pending.payload, ToolBatch):
            batch = pending.payload.deny(pending.payload.calls[0].call_id, "no")
            runtime.resume(loop_id, Rewrite(payload=batch))
        else:
            runtime.resume(loop_id)


CASES: dict[str, tuple[list[ScriptStep], dict[str, Any]]] = {
    "tools": (
        [calls(call("add", a=1, b=2)), calls(call("add", a=3, b=4)), text("7")],
        {},
    ),
    "parallel": (
        [calls(call("slow", x=1), call("slow", x=2)), text("done")],
        {"tools": (slow,), "tool_execution": "parallel"},
    ),
    "streaming": ([calls(call("add", a=1, b=2)), text("3")], {"streaming": True}),
    "approval, denied": (
        [calls(call("delete", path="/a")), text("ok")],
        {"tools": (delete,), "drive": "deny"},
    ),
    "approval, approved": (
        [calls(call("delete", path="/a")), text("ok")],
        {"tools": (delete,), "drive": "approve"},
    ),
    "paused request": ([text("hi")], {"handler": pause_requests, "drive": "approve"}),
    "rewrites": ([calls(call("add", a=1, b=2)), text("3")], {"handler": swap_model}),
    "steering and follow-ups": (
        [calls(call("add", a=1, b=2)), text("first"), text("second")],
        {"steer": "go on", "follow_up": "and then?"},
    ),
    "structured output": (
        [text("nope"), text('{"value": 3}')],
        {"structured_output": Answer},
    ),
    "callables by name": (
        [calls(call("add", a=1, b=2)), text("3")],
        {
            "options": {
                "stop_when": [after_turns(5)],
                "model_wrappers": [passthrough],
                "finish_turn": finish_turn,
            }
        },
    ),
    "stopped": (
        [calls(call("add", a=1, b=2)), text("x")],
        {"options": {"max_turns": 1}},
    ),
    "failed": ([ProviderError("the model is down")], {}),
    "aborted": ([calls(call("add", a=1, b=2))], {"handler": "abort"}),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_the_record_round_trips_at_every_commit(case: str) -> None:
    script, how = CASES[case]
    records: list[tuple[LoopRecord, LoopState, int]] = []
    remade: list[LoopRecord] = []

    def on_commit(loop: LoopInfo) -> None:
        record = loop.snapshot()
        # What a request's record is made of, made anew (`snapshot._STATIC`,
        # whose last records the next commits reuse): the same record.
        snapshot._STATIC.clear()
        remade.append(loop.snapshot())  # (compared below: a hook's raise is logged)
        records.append((record, loop.state, len(loop.context.items)))

    handler = how.get("handler")
    if handler == "abort":
        from agentfsm import Abort

        def handler(pending: PendingTransition) -> Abort | None:
            return Abort("budget") if pending.trigger is Trigger.call_tools else None

    inference_input = InferenceInput(
        model="scripted:a",
        context=ModelContext(instructions="be brief"),
        tools=how.get("tools", (add,)),
        streaming=how.get("streaming", False),
        structured_output=how.get("structured_output"),
    )
    provider = ScriptedProvider(script)
    async with Runtime(
        providers={"scripted": provider}, extensions=[OnCommit(on_commit)]
    ) as runtime:
        loop_id = runtime.run_loop(
            "agent", "hello", inference_input, handler, **how.get("options", {})
        )
        if "steer" in how:
            runtime.steer(loop_id, how["steer"])
        if "follow_up" in how:
            runtime.follow_up(loop_id, how["follow_up"])
        if "drive" in how:
            await resume_with(runtime, loop_id, how["drive"])
        result = await runtime.wait(loop_id)

    assert len(records) == len(result.path)  # one record per committed transition
    assert remade == [record for record, _, _ in records]
    for index, (record, state, items) in enumerate(records):
        assert LoopRecord.model_validate_json(record.model_dump_json()) == record
        assert record.state is state is result.path[index].dest
        assert record.path == result.path[: index + 1]
        assert record.context_items == items
        assert record.step is not None
        assert record.step.trigger is result.path[index].trigger
    last = records[-1][0]
    assert last.state is LoopState.idle
    gate = (
        ("agentfsm._loop.intercept:approval_gate",)
        if delete in inference_input.tools
        else ()
    )
    mine = (f"{handler.__module__}:{handler.__qualname__}",) if handler else ()
    assert last.handlers == gate + mine
    if result.outcome is Outcome.failed:
        assert last.step is not None
        assert last.step.trigger is Trigger.fail


async def test_the_record_names_callables_and_references_the_context() -> None:
    """Tools, wrappers, stop conditions and handlers appear by name, the context
    by position: nothing callable, and no context item, is in the record."""
    seen: list[LoopRecord] = []

    def on_commit(loop: LoopInfo) -> None:
        if loop.state is LoopState.function_call:
            seen.append(loop.snapshot())

    inference_input = request()
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(
        providers={"scripted": provider}, extensions=[OnCommit(on_commit)]
    ) as runtime:
        await runtime.wait(
            runtime.run_loop(
                "agent",
                "hello",
                inference_input,
                swap_model,
                model_wrappers=[passthrough],
                stop_when=[after_turns(5)],
            )
        )
    (record,) = seen
    assert (record.input.model, record.input.tools) == ("scripted:test", ("add",))
    assert record.input.settings["streaming"] is False
    assert record.input.own_context
    assert record.handlers == (f"{__name__}:swap_model",)
    assert record.options.model_wrappers == (f"{__name__}:passthrough",)
    assert record.options.stop_when == (
        "agentfsm.options:after_turns.<locals>.condition",
    )
    assert record.turn.request.model == "scripted:b"  # the rewritten request
    assert record.turn.request.own_context
    # By position: the user's message (calls enter with their outputs, later).
    assert record.context_items == record.turn.request.context_items == 1
    assert record.step is not None
    assert isinstance(record.step.payload, ToolBatch)
    text_of_record = record.model_dump_json()
    assert "Add two integers" not in text_of_record  # a tool's definition is not in it
    assert UserMessage(content="hello").model_dump_json() not in text_of_record
