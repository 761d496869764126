"""Every model the library builds without validation (`_models.trusted`, and the
emitter's events) equals the model validation builds from the same values,
`model_fields_set` included: the speed trick changes nothing a user can see."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from agentfsm import (
    InferenceOutput,
    ModelRequest,
    PendingTransition,
    Rewrite,
    Runtime,
    TokenUsage,
    ToolCall,
    ToolResult,
    Trigger,
    _models,
    tool,
)
from agentfsm._loop.loop import _NO_USAGE
from agentfsm.options import after_turns
from agentfsm.providers import ModelNext
from agentfsm.store import CallRecord, MemoryStore
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from agentfsm.tools import ToolNext
from tests.helpers import add, request, wait_until

USAGE = TokenUsage(input_tokens=3, output_tokens=2)


@tool(needs_approval=True)
async def guarded(x: int) -> ToolResult:
    """Echo `x` (after approval)."""
    return ToolResult.of({"x": x})


async def model_wrapper(request: ModelRequest, next_: ModelNext) -> InferenceOutput:
    return await next_(request)


async def tool_wrapper(tool_call: ToolCall, next_: ToolNext) -> ToolResult:
    return await next_(tool_call)


def proceed_and_rewrite(pending: PendingTransition) -> Rewrite | None:
    if pending.trigger is Trigger.finish:
        return Rewrite(payload=pending.payload)
    return None


def validated(model: BaseModel) -> BaseModel:
    """What validation makes of the fields `model` says were set (the rest default)."""
    values = {name: getattr(model, name) for name in model.model_fields_set}
    return type(model).model_validate(values)


def assert_same(model: BaseModel) -> None:
    again = validated(model)
    assert model == again, type(model).__name__
    assert model.model_fields_set == again.model_fields_set, type(model).__name__
    assert model.model_dump() == again.model_dump()


def recorded_trusted(monkeypatch: pytest.MonkeyPatch) -> list[BaseModel]:
    """The models `_models.trusted` builds from now on (for this test)."""
    built: list[BaseModel] = []
    trusted = _models.trusted

    def recording(cls: type[Any], values: dict[str, Any], fields_set: set[str]) -> Any:
        model = trusted(cls, values, fields_set)
        built.append(model)
        return model

    monkeypatch.setattr(_models, "trusted", recording)
    return built


async def test_trusted_models_equal_validated_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = recorded_trusted(monkeypatch)
    script = [
        calls(call("add", a=1, b=2), usage=USAGE),
        calls(call("guarded", x=4), usage=USAGE),
        text("done", usage=USAGE),
    ]
    async with Runtime(providers={"scripted": ScriptedProvider(script)}) as runtime:
        recorder = EventRecorder(runtime.bus)
        loop_id = runtime.run_loop(
            "agent",
            "go",  # a str message: the runtime builds its UserMessage
            request(add, guarded),
            proceed_and_rewrite,
            model_wrappers=[model_wrapper],
            tool_wrappers=[tool_wrapper],
            stop_when=[after_turns(10)],  # a LoopView every turn
        )
        await wait_until(lambda: runtime.get(loop_id).status == "paused")
        runtime.resume(loop_id)
        result = await runtime.wait(loop_id)
        events = recorder.events
    kinds = {type(m).__name__ for m in built}
    assert kinds >= {
        "UserMessage",
        "ModelRequest",
        "ToolBatch",
        "FunctionCallOutputItem",
        "TokenUsage",
        "ToolResult",
        "LoopView",
        "LoopResult",
    }
    for model in built:
        assert_same(model)
    assert_same(_NO_USAGE)  # built at import
    assert result.usage == TokenUsage(input_tokens=9, output_tokens=6)
    assert_same(result)
    # The emitter fills events' dicts itself (see `_bus.emitter`).
    assert len({e.type for e in events}) >= 10
    for event in events:
        assert_same(event)


async def test_trusted_ledger_entries_equal_validated_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The intents a durable loop writes with its commits into `function_call`."""
    built = recorded_trusted(monkeypatch)
    script = [calls(call("add", a=1, b=2), call("add", a=3, b=4)), text("done")]
    async with Runtime(
        providers={"scripted": ScriptedProvider(script)}, store=MemoryStore()
    ) as runtime:
        result = await runtime.wait(runtime.run_loop("agent", "go", request(add)))
    assert result.outcome == "answered"
    intents = [m for m in built if isinstance(m, CallRecord)]
    assert [(c.position, c.status) for c in intents] == [(0, "started"), (1, "started")]
    for model in intents:
        assert_same(model)
