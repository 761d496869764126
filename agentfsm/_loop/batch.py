"""The plan of a batch of tool calls: which calls run, which do not and why, and
how (in sequence, or in parallel under a cap).

One plan per batch, made once (`plan_of`) and read by everyone who needs it:
the tool-call runner, the journal (which intents the commit into
`function_call` carries) and recovery (which calls were in flight). A skip
reason added here is therefore one that every reader knows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NamedTuple

from agentfsm._keys import idempotency_key
from agentfsm.interception import ToolBatch
from agentfsm.messages import FunctionCallItem
from agentfsm.tools import Tool

from .tool_run import BASE_INVOKE
from .turn import tool_index

if TYPE_CHECKING:
    from .loop import Loop

__all__ = ("TRUNCATED", "BatchPlan", "PlannedCall", "may_wait", "plan_of")

TRUNCATED: Final = (
    "the call was not run: the response hit the output token limit, "
    "so its arguments may be truncated"
)


class PlannedCall(NamedTuple):
    """One call of a batch, and whether it runs."""

    position: int
    call: FunctionCallItem
    tool: Tool | None
    output: str | None = None
    """The output of a call that does not run (a denial, a handler's answer, a
    truncated or unknown call); None for a call that runs."""
    is_error: bool = False
    """Whether `output` is an error (all but a handler's answer are)."""

    @property
    def runs(self) -> bool:
        return self.output is None

    def key(self, loop: Loop) -> str:
        """The call's idempotency key (see `agentfsm._keys`)."""
        call = self.call
        return idempotency_key(
            loop.loop_id, loop.model_requests, self.position, call.name, call.arguments
        )


class BatchPlan(NamedTuple):
    """How a batch runs."""

    batch: ToolBatch
    calls: tuple[PlannedCall, ...]
    parallel: bool
    """The calls run concurrently (the loop runs tools in parallel, the batch
    has two calls or more, and none of its tools must run alone); in tasks
    only if one of them at least `may_wait`."""
    concurrency: int
    """At most this many run at once (`max_tool_concurrency`)."""

    def starting(self) -> tuple[PlannedCall, ...]:
        """The calls that start as the batch starts, in a known order: every
        call that runs of a parallel batch when none waits for a free slot (else
        none: they start in no set order), the first of a sequential one. Any
        other call starts later, once those before it (or a slot) let it."""
        runs = tuple(c for c in self.calls if c.runs)
        if not self.parallel:
            return runs[:1]
        return runs if len(runs) <= self.concurrency else ()


_new = tuple.__new__
"""The plans' tuples made without their Python-level `__new__` (a plan a batch,
a planned call each: ~16,000 instructions a benchmark run less than frozen
dataclasses, `make bench-instructions`; tests/internals/test_batch_plan.py)."""


def plan_of(loop: Loop, batch: ToolBatch) -> BatchPlan:
    """The plan of `batch`, the payload of the loop's current `function_call`
    step (made once: the same object for every reader)."""
    known = loop.plan
    if known is not None and known.batch is batch:
        return known
    tools = tool_index(loop)
    output = loop.output
    # A response cut by the token limit may hold truncated arguments.
    truncated = output is not None and output.finish_reason == "length"
    chain = loop.tool_chain
    decided = batch.denied or batch.outputs or truncated
    get = tools.get
    calls = []
    for position, call in enumerate(batch.calls):
        tool = get(call.name)
        if decided or (tool is None and chain is None):
            calls.append(_planned(batch, position, call, tool, tools, truncated))
        else:  # (most calls: one that runs)
            calls.append(_new(PlannedCall, (position, call, tool, None, False)))
    options = loop.options
    parallel = (
        options.tool_execution == "parallel"
        and len(calls) > 1
        and all(c.tool is None or c.tool.execution_mode == "parallel" for c in calls)
    )
    plan = loop.plan = _new(
        BatchPlan, (batch, tuple(calls), parallel, options.max_tool_concurrency)
    )
    return plan


def may_wait(loop: Loop, plan: BatchPlan) -> bool:
    """Whether a call of a parallel batch may suspend while it runs, letting
    others run meanwhile: through the loop's tool wrappers or journal, a tool
    whose function may (an async one with a yield point in its code, a sync
    one run in a thread), or one that runs its calls itself (a subclass's
    `invoke`).

    A batch none of whose calls may wait runs them one by one without tasks
    (`tool_call.run_parallel`): a task and a slot of the concurrency cap per call
    cost ~5x the call, and its tasks would run them one after the other anyway.
    """
    if loop.tool_chain is not None or loop.journal is not None:
        return True
    for planned in plan.calls:
        tool = planned.tool
        if tool is None or planned.output is not None:
            continue  # it does not run
        if type(tool).invoke is not BASE_INVOKE:
            return True
        if tool.suspends if tool.is_async else tool.run_in_thread:
            return True
    return False


def _planned(
    batch: ToolBatch,
    position: int,
    call: FunctionCallItem,
    tool: Tool | None,
    tools: dict[str, Tool],
    truncated: bool,
) -> PlannedCall:
    """A call's plan when a handler decided about some of the batch, the
    response was truncated, or its tool is unknown."""
    denial = batch.denied.get(call.call_id)
    if denial is not None:
        return PlannedCall(position, call, tool, f"the call was denied: {denial}", True)
    answer = batch.outputs.get(call.call_id)
    if answer is not None:
        return PlannedCall(position, call, tool, answer)  # not run
    if truncated:
        return PlannedCall(position, call, tool, TRUNCATED, True)
    if tool is None:
        return PlannedCall(position, call, tool, unknown(call, tools), True)
    return PlannedCall(position, call, tool)


def unknown(call: FunctionCallItem, tools: dict[str, Tool]) -> str:
    offered = ", ".join(sorted(tools)) or "none"
    return f"unknown tool {call.name!r} (available tools: {offered})"
