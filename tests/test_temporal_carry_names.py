"""A record a Temporal run carried (continue-as-new) names the workflow's own
callables by their module path: one carried before `agentfsm._temporal` became
the private modules of `agentfsm.temporal` still binds, and the tool wrapper
such a run listed (its tool activities, the workflow's extension's tool layer
now) binds to one that passes the call through."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("temporalio")

from agentfsm.options import LoopOptions
from agentfsm.record import callable_name
from agentfsm.temporal import _calls as calls
from agentfsm.temporal._carry import Carry
from agentfsm.testing import call
from agentfsm.tools import ToolCall, ToolResult

pytestmark = pytest.mark.anyio


def by_name(handlers: list[Any]) -> dict[str, Any]:
    carry = object.__new__(Carry)
    carry.agent = SimpleNamespace(settings={})  # type: ignore[assignment]
    return carry._by_name(handlers, LoopOptions())


async def test_names_from_before_the_move_bind() -> None:
    activities = object.__new__(calls.ToolActivities)
    handler = activities.pause_after_lost
    found = by_name([handler])
    assert callable_name(handler) == (
        "agentfsm.temporal._calls:ToolActivities.pause_after_lost"
    )
    assert found["agentfsm._temporal.calls:ToolActivities.pause_after_lost"] == handler
    passed = found["agentfsm._temporal.calls:ToolActivities"]
    assert found[callable_name(passed)] is passed  # and again, carried once more

    async def next_(made: ToolCall) -> ToolResult:
        return ToolResult(output="ran")

    made = ToolCall(
        call=call("add", a=1), tool=None, arguments="{}", loop_id="l", agent_id="a"
    )
    assert (await passed(made, next_)).output == "ran"
