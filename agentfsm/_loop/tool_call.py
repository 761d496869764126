"""Running one batch of tool calls, as its plan (`batch.plan_of`) says: in
sequence or in parallel, wrapped, with progress, through the loop's journal.

Outputs enter the context in the model's order, whatever order the calls finish
in; `function_call.completed` is published as each call finishes (completion
order). A failing call becomes an error output inside its own task, so it never
cancels its siblings; a journal that stops the loop (`Halted`: the lease is
lost, a write failed) cancels them all, and the batch raises it. Each call runs
with its `tools.ToolCallContext` as the context's current call
(`current_call()`, `report_progress`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextvars import copy_context
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import anyio
from anyio.lowlevel import checkpoint_if_cancelled

from agentfsm import _models, _text
from agentfsm._errors import cancelled_from_outside, error_text
from agentfsm._in_context import in_context
from agentfsm.exceptions import ToolError, UnknownTool
from agentfsm.messages import FunctionCallItem, FunctionCallOutputItem, ImageBlock
from agentfsm.tools import (
    ToolCall,
    ToolCallContext,
    ToolResult,
    ToolWrapper,
)

from .batch import BatchPlan, PlannedCall, may_wait, unknown
from .bounds import checked_tool_images, checked_tool_output
from .tool_run import BASE_INVOKE, run_function
from .wrappers import chain_wrappers

if TYPE_CHECKING:
    from .journal import Journal
    from .loop import Loop

__all__ = (
    "INTERRUPTED",
    "CallResult",
    "chain_tool_wrappers",
    "run_call",
    "run_parallel",
)

INTERRUPTED: Final = "the tool call was interrupted: the loop was cancelled"
"""The output of a call the loop stopped waiting for (or never started): a sync
tool's thread may still have run on (see `tools.ToolCallContext`)."""
_OUTPUT_FIELDS: Final = {"type", "call_id", "output", "is_error", "images"}

ToolChain = Callable[[ToolCall], Awaitable[ToolResult]]


CallResult: TypeAlias = tuple[FunctionCallOutputItem, bool]
"""How one call of a batch ended: `(output, terminate)`, terminate being whether
the tool asked to end the loop (`ToolResult(terminate=True)`). A plain tuple: a
`NamedTuple` made through `tuple.__new__` cost ~400 instructions a call more."""


def chain_tool_wrappers(wrappers: Sequence[ToolWrapper]) -> ToolChain | None:
    """Compose `(call, next)` wrappers around running the tool, first outermost."""
    return chain_wrappers(wrappers, _innermost) if wrappers else None


async def _innermost(tool_call: ToolCall) -> ToolResult:
    if tool_call.tool is None:
        raise UnknownTool(
            f"unknown tool {tool_call.call.name!r}", tool=tool_call.call.name
        )
    return await tool_call.tool.invoke(tool_call.arguments)


async def run_parallel(
    loop: Loop, plan: BatchPlan, results: list[CallResult | None]
) -> None:
    """Run a parallel batch (`plan.parallel`), filling `results` (one slot per
    call) as calls end; `function_call` runs a sequential one itself.

    A slot still `None` afterwards is a call that never ended: the caller sees
    which calls finished even when the batch was interrupted.

    Raises:
        Halted: the journal stopped the loop (the other calls were cancelled).
    """
    if not may_wait(loop, plan):
        # No call can suspend: their tasks would run them one after the other.
        # Each runs in a copy of the context, as in a task of its own.
        for planned in plan.calls:
            await checkpoint_if_cancelled()
            results[planned.position] = await in_context(
                copy_context(), run_call(loop, planned)
            )
        return

    # At most `concurrency` tasks, each taking the next call as it ends one:
    # calls start in the model's order as slots free up, and a batch pays for
    # one task per slot, not per call, and for no limiter (a task and a
    # limiter's slot per call cost ~2.4x a sequential call of a tool that
    # waits once, `bench/bench_scaling.py --only tools`). The first to raise
    # (`Halted`) cancels the others, and the backend's runner raises it.
    pending = iter(plan.calls)

    async def run_some() -> None:
        for planned in pending:  # shared: each call is taken once
            await checkpoint_if_cancelled()
            results[planned.position] = await in_context(
                copy_context(), run_call(loop, planned)
            )

    slots = min(plan.concurrency, len(plan.calls))
    await loop.run_tasks(slots, run_some, f"agentfsm-tools-{loop.loop_id}")


def run_call(loop: Loop, planned: PlannedCall) -> Coroutine[Any, Any, CallResult]:
    """One call of a batch, to await: its output as planned (a call that does
    not run), as the ledger recorded it (a call that ran before a crash: never
    run twice), or the tool's.

    A plain function choosing the coroutine: a call without a store is the
    tool's run itself (`_invoke`), a coroutine less per call (~1,000
    instructions, `make bench-instructions`)."""
    if planned.output is not None:
        return _planned_output(loop, planned)
    journal = loop.journal
    if journal is None:
        return _invoke(loop, planned, None, None)
    return _journaled(loop, planned, journal)


async def _planned_output(loop: Loop, planned: PlannedCall) -> CallResult:
    """A call that does not run: its output as planned (see `batch.plan_of`)."""
    assert planned.output is not None
    started = time.perf_counter()
    out = _output(loop, planned.call, planned.output, planned.is_error, ())
    return _ended(loop, planned, out, started), False


async def _journaled(loop: Loop, planned: PlannedCall, journal: Journal) -> CallResult:
    """A call of a durable loop: its intent stored first, then its output as
    the ledger holds it (done before a crash) or the tool's, recorded."""
    started = time.perf_counter()
    entry = await journal.begin_call(loop, planned)
    if entry.status == "done" and entry.output is not None:
        loop.emit_call_completed(
            planned.call, entry.output, time.perf_counter() - started
        )
        return entry.output, entry.terminate
    return await _invoke(loop, planned, entry.key, journal)


def _output(
    loop: Loop,
    call: FunctionCallItem,
    output: str,
    is_error: bool,
    images: tuple[ImageBlock, ...],
) -> FunctionCallOutputItem:
    """The output item of a call: its text as the context may hold it (see
    `bounds.checked_tool_output`), and its images."""
    output, is_error = checked_tool_output(call.name, output, is_error, loop.options)
    if images:
        output, is_error, images = checked_tool_images(
            call.name, output, is_error, images
        )
    values = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": output,
        "is_error": is_error,
        "images": images,
    }
    return _models.trusted(FunctionCallOutputItem, values, _OUTPUT_FIELDS)


def _ended(
    loop: Loop, planned: PlannedCall, out: FunctionCallOutputItem, started: float
) -> FunctionCallOutputItem:
    call = planned.call
    if out.is_error:
        loop.log.info(
            "tool_call_error", call_id=call.call_id, tool=call.name, error=out.output
        )
    loop.emit_call_completed(call, out, time.perf_counter() - started)
    return out


async def _invoke(
    loop: Loop, planned: PlannedCall, key: str | None, journal: Journal | None
) -> CallResult:
    """Run the tool (through the loop's tool wrappers) as the context's current
    call; its output recorded in the `journal` of a durable loop (under the
    ledger's `key`)."""
    started = time.perf_counter()
    call = planned.call
    tool = planned.tool
    chain = loop.tool_chain
    loop.emit_call_started(call)
    if loop.outbox is not None:
        await loop.flush()  # the call starts once its start was received
    loop.tool_calls += 1
    if tool is not None:
        loop.last_tools.append(tool.name)
    running = ToolCallContext(
        loop.loop_id,
        loop.agent_id,
        call.call_id,
        call.name,
        loop.model_requests,
        planned.position,
        call.arguments,
        key,
        None if journal is None else journal.fencing_token,
    )
    context = running.activate(loop)
    returned = False
    output, is_error, terminate = "", False, False
    images: tuple[ImageBlock, ...] = ()
    try:
        if chain is None:
            assert tool is not None
            if type(tool).invoke is BASE_INVOKE:  # (else a subclass runs itself)
                value = await run_function(tool, call.arguments, loop.cancel_scope)
            else:
                value = await tool.invoke(call.arguments)
        else:
            value = await chain(
                ToolCall(
                    call=call,
                    tool=tool,
                    arguments=call.arguments,
                    loop_id=loop.loop_id,
                    agent_id=loop.agent_id,
                )
            )
        returned = True
        if type(value) is str:  # the common case first: no call, no class test
            output = value
        else:
            output, is_error, terminate, images = _taken(call.name, value)
    except UnknownTool:
        output, is_error = unknown(call, loop.tools_by_name), True
    except ToolError as exc:
        output, is_error = error_text(exc), True
    except Exception as exc:  # noqa: BLE001 - a raising tool (or wrapper) becomes an error output
        output = f"tool {call.name!r} raised {type(exc).__name__}: {error_text(exc)}"
        is_error = True
    except anyio.get_cancelled_exc_class() as exc:
        if cancelled_from_outside():
            raise
        # The tool's own (it awaited a task it had cancelled, say): its error.
        output = (
            f"tool {call.name!r} raised {type(exc).__name__} of its own, not a "
            f"cancel of the loop: {error_text(exc) or 'no message'}"
        )
        is_error = True
    finally:
        # Without its result (cancelled, timed out, a wrapper gave up) the
        # function may still run: a sync tool's thread cannot be killed.
        running.deactivate(context, returned=returned)
    out = _output(loop, call, output, is_error, images)
    if journal is not None:
        assert key is not None
        with anyio.CancelScope(shield=True):  # the output is known: record it
            await journal.end_call(loop, key, out, terminate)
    return _ended(loop, planned, out, started), terminate


def _taken(name: str, value: Any) -> tuple[str, bool, bool, tuple[ImageBlock, ...]]:
    """What a call returned that is not text: `(output, is_error, terminate,
    images)` of a `ToolResult`, or any other value as JSON (what
    `ToolResult.of` holds, without making one)."""
    if not isinstance(value, ToolResult):
        return _text.json_text(value), False, False, ()
    asked: Any = value.terminate
    if type(asked) is not bool:  # built without validation
        kind = type(asked).__name__
        output = f"tool {name!r} returned a {kind} as terminate, not a bool"
        return output, True, False, value.images
    return value.output, value.is_error, asked, value.images
