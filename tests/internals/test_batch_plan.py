"""The plan of a batch (`_loop/batch.py`): which calls run, which do not and
why, how they run, and which start as the batch starts. Its tuples are made
without their `__new__` (`_new`): each field must land where it is named."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Unpack

import anyio.lowlevel
import pytest

from agentfsm import InferenceInput, ModelContext, Tool, ToolBatch, ToolResult, tool
from agentfsm._loop.batch import TRUNCATED, PlannedCall, may_wait, plan_of
from agentfsm._loop.loop import Loop
from agentfsm.inference import InferenceOutput
from agentfsm.messages import FunctionCallItem
from agentfsm.options import LoopOptions, LoopOptionsDict


@tool
async def add(a: int, b: int) -> int:
    """Add."""
    return a + b


@tool(execution_mode="sequential")
async def alone(x: int) -> int:
    """A tool that must run alone."""
    return x


@tool
async def waits(a: int, b: int) -> int:
    """Add, after a wait."""
    await anyio.lowlevel.checkpoint()
    return a + b


@tool
def threaded(a: int, b: int) -> int:
    """Add, in a worker thread."""
    return a + b


@tool(run_in_thread=False)
def here(a: int, b: int) -> int:
    """Add, in the loop's thread."""
    return a + b


class _RunsItself(Tool):
    """A tool whose `invoke` runs its calls (as replay's recorded tools do)."""

    async def invoke(self, arguments: str | Mapping[str, Any]) -> ToolResult:
        return ToolResult(output="recorded")


async def _recorded(a: int, b: int) -> int:
    """Add (never runs)."""
    return a + b


itself = _RunsItself(_recorded, name="itself")


def loop_with(**options: Unpack[LoopOptionsDict]) -> Loop:
    request = InferenceInput(
        model="m:m",
        context=ModelContext(),
        tools=[add, alone, waits, threaded, here, itself],
    )
    loop = Loop.__new__(Loop)
    loop.request = request
    loop.tools_of = None
    loop.output = None
    loop.tool_chain = None
    loop.journal = None
    loop.plan = None
    loop.options = LoopOptions.of(options)
    loop.loop_id = "L"
    loop.model_requests = 1
    return loop


def calls(*names: str) -> tuple[FunctionCallItem, ...]:
    return tuple(
        FunctionCallItem(call_id=f"c{n}", name=name, arguments='{"a": 1, "b": 2}')
        for n, name in enumerate(names)
    )


def test_calls_that_run_and_their_fields() -> None:
    batch = ToolBatch(calls=calls("add", "add"))
    plan = plan_of(loop_with(), batch)
    assert plan.batch is batch
    assert plan.parallel is False
    assert plan.concurrency == LoopOptions().max_tool_concurrency
    first, second = plan.calls
    assert first == PlannedCall(0, batch.calls[0], add)
    assert (second.position, second.call, second.tool) == (1, batch.calls[1], add)
    assert (second.output, second.is_error, second.runs) == (None, False, True)
    assert plan.starting() == (first,)  # sequential: the first only
    assert plan_of(loop_with(), batch) is not plan  # another loop's
    loop = loop_with()
    assert plan_of(loop, batch) is plan_of(loop, batch)  # made once


def test_calls_that_do_not_run_say_why() -> None:
    batch = (
        ToolBatch(calls=calls("add", "add", "nope", "add"))
        .deny("c0", "no")
        .answer("c1", "42")
    )
    plan = plan_of(loop_with(), batch)
    outputs = [(c.output, c.is_error, c.runs) for c in plan.calls]
    assert outputs[0] == ("the call was denied: no", True, False)
    assert outputs[1] == ("42", False, False)
    assert outputs[2][0] is not None
    assert outputs[2][0].startswith("unknown tool 'nope' (available tools: add,")
    assert outputs[2][1:] == (True, False)
    assert outputs[3] == (None, False, True)
    assert plan.starting() == (plan.calls[3],)


def test_a_truncated_response_runs_nothing() -> None:
    loop = loop_with()
    loop.output = InferenceOutput(items=calls("add"), finish_reason="length")
    (planned,) = plan_of(loop, ToolBatch(calls=calls("add"))).calls
    assert (planned.output, planned.is_error) == (TRUNCATED, True)


@pytest.mark.parametrize(
    ("names", "cap", "parallel", "starting", "waits"),
    [
        (("waits", "waits", "waits"), 3, True, 3, True),
        (("waits", "waits", "waits"), 2, True, 0, True),  # one waits for a slot
        (("add", "waits", "add"), 3, True, 3, True),
        (("add", "threaded"), 3, True, 2, True),
        (("add", "itself"), 3, True, 2, True),  # its `invoke` may wait
        (("waits", "alone"), 3, False, 1, True),  # a tool that runs alone
        (("waits",), 3, False, 1, True),
        # No call can wait: one by one, without tasks.
        (("add", "add", "add"), 3, True, 3, False),
        (("add", "here"), 3, True, 2, False),
        (("add", "nope"), 3, True, 1, False),  # an unknown tool does not run
    ],
)
def test_parallel_batches(
    names: tuple[str, ...], cap: int, parallel: bool, starting: int, waits: bool
) -> None:
    loop = loop_with(tool_execution="parallel", max_tool_concurrency=cap)
    plan = plan_of(loop, ToolBatch(calls=calls(*names)))
    assert (plan.parallel, len(plan.starting())) == (parallel, starting)
    assert may_wait(loop, plan) is waits


def test_calls_that_cannot_wait_may_through_wrappers_or_a_journal() -> None:
    """A tool wrapper or a journal may suspend around any call: such a batch
    keeps its tasks."""
    loop = loop_with(tool_execution="parallel")
    loop.tool_chain = object()  # type: ignore[assignment]
    assert may_wait(loop, plan_of(loop, ToolBatch(calls=calls("add", "add"))))
    loop = loop_with(tool_execution="parallel")
    loop.journal = object()  # type: ignore[assignment]
    assert may_wait(loop, plan_of(loop, ToolBatch(calls=calls("add", "add"))))


def test_a_call_s_key_is_its_idempotency_key() -> None:
    from agentfsm._keys import idempotency_key

    batch = ToolBatch(calls=calls("add", "add"))
    planned = plan_of(loop_with(), batch).calls[1]
    assert planned.key(loop_with()) == idempotency_key(
        "L", 1, 1, "add", '{"a": 1, "b": 2}'
    )
