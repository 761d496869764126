"""Running one batch of tool calls: sequential or parallel, wrapped, with progress.

Outputs enter the context in the model's order, whatever order the calls finish
in; `function_call.completed` is published as each call finishes (completion
order). A failing call becomes an error output inside its own task, so it never
cancels its siblings. Each call runs with its `tools.ToolCallContext` as the
context's current call (`current_call()`, `report_progress`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Final, TypeAlias

import anyio

from agentfsm import _models
from agentfsm._errors import error_text
from agentfsm.exceptions import ToolError, UnknownTool
from agentfsm.interception import ToolBatch
from agentfsm.messages import FunctionCallItem, FunctionCallOutputItem
from agentfsm.tools import (
    Tool,
    ToolCall,
    ToolCallContext,
    ToolResult,
    ToolWrapper,
    _current_call,
)

from .wrappers import chain_wrappers

if TYPE_CHECKING:
    from agentfsm._durable.writer import Durable

    from .loop import Loop

__all__ = ("INTERRUPTED", "CallResult", "chain_tool_wrappers", "run_batch")

TRUNCATED: Final = (
    "the call was not run: the response hit the output token limit, "
    "so its arguments may be truncated"
)
INTERRUPTED: Final = "the tool call was interrupted: the loop was cancelled"
"""The output of a call the loop stopped waiting for (or never started): a sync
tool's thread may still have run on (see `tools.ToolCallContext`)."""
_OUTPUT_FIELDS: Final = {"type", "call_id", "output", "is_error"}

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


async def run_batch(
    loop: Loop,
    batch: ToolBatch,
    tools: Mapping[str, Tool],
    results: list[CallResult | None],
    *,
    truncated: bool,
) -> None:
    """Run a batch, filling `results` (one slot per call) as calls end.

    A slot still `None` afterwards is a call that never ended: the caller sees
    which calls finished even when the batch was interrupted.
    """
    options = loop.options
    durable = loop.durable
    if durable is not None:
        durable.unfinished = len(batch.calls)
    if not parallel(loop, batch, tools):
        for position, call in enumerate(batch.calls):
            results[position] = await _run_call(
                loop, batch, position, call, tools, truncated
            )
            if durable is not None:
                durable.unfinished -= 1
        return

    limiter = anyio.CapacityLimiter(options.max_tool_concurrency)

    async def run_one(position: int, call: FunctionCallItem) -> None:
        async with limiter:
            results[position] = await _run_call(
                loop, batch, position, call, tools, truncated
            )
        if durable is not None:
            durable.unfinished -= 1

    async with anyio.create_task_group() as tg:
        for position, call in enumerate(batch.calls):
            tg.start_soon(run_one, position, call, name=f"agentfsm-tool-{call.name}")


def parallel(loop: Loop, batch: ToolBatch, tools: Mapping[str, Tool]) -> bool:
    """Whether the batch's calls run concurrently: the loop runs tools in
    parallel, and no tool of the batch must run alone."""
    if loop.options.tool_execution != "parallel" or len(batch.calls) < 2:
        return False
    return all(
        (t := tools.get(c.name)) is None or t.execution_mode == "parallel"
        for c in batch.calls
    )


async def _run_call(
    loop: Loop,
    batch: ToolBatch,
    position: int,
    call: FunctionCallItem,
    tools: Mapping[str, Tool],
    truncated: bool,
) -> CallResult:
    started = time.perf_counter()
    denial = batch.denied.get(call.call_id)
    tool = tools.get(call.name)
    chain = loop.tool_chain
    durable = loop.durable
    key: str | None = None
    output: str
    is_error = terminate = False
    if denial is not None:
        output, is_error = f"the call was denied: {denial}", True
    elif (answer := batch.outputs.get(call.call_id)) is not None:
        output = answer  # answered by a handler: not run
    elif truncated:
        output, is_error = TRUNCATED, True
    elif tool is None and chain is None:
        output, is_error = _unknown(call, tools), True
    else:
        if durable is not None:
            ran = await _ledger(loop, durable, position, call)
            if not isinstance(ran, str):
                # It ran before a crash: its recorded output; never run twice.
                loop.emit_call_completed(call, ran[0], time.perf_counter() - started)
                return ran
            key = ran
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
            position,
            call.arguments,
            key,
        )
        running._publisher = loop
        running._thread = threading.get_ident()
        token = _current_call.set(running)
        returned = False
        try:
            if chain is None:
                assert tool is not None
                value = await tool._invoke(call.arguments, loop.cancel_scope)
            else:
                tool_call = ToolCall(
                    call=call,
                    tool=tool,
                    arguments=call.arguments,
                    loop_id=loop.loop_id,
                    agent_id=loop.agent_id,
                )
                value = await chain(tool_call)
            returned = True
            if isinstance(value, ToolResult):
                output, is_error = value.output, value.is_error
                terminate = value.terminate
            else:  # what `ToolResult.of` holds, without making one
                output = _models.json_text(value)
        except UnknownTool:
            output, is_error = _unknown(call, tools), True
        except ToolError as exc:
            output, is_error = error_text(exc), True
        except Exception as exc:  # noqa: BLE001 - a raising tool (or wrapper) becomes an error output
            output = (
                f"tool {call.name!r} raised {type(exc).__name__}: {error_text(exc)}"
            )
            is_error = True
        finally:
            # The call has ended. Without its result (cancelled, timed out, a
            # wrapper gave up), the function may still run (a sync tool's
            # thread cannot be killed): tell it so. And the call lets go of
            # the loop: copies of this context outlive the call (the cancelled
            # deadline timer asyncio keeps until it would have fired, a thread
            # running on), and must not keep the loop alive.
            running._publisher = None
            if not returned:
                running._interrupt()
            _current_call.reset(token)
    values = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": output,
        "is_error": is_error,
    }
    out = _models.trusted(FunctionCallOutputItem, values, _OUTPUT_FIELDS)
    if key is not None:
        assert durable is not None
        with anyio.CancelScope(shield=True):  # the output is known: record it
            await durable.end_call(loop, key, out, terminate)
    if is_error:
        loop.log.info(
            "tool_call_error", call_id=call.call_id, tool=call.name, error=output
        )
    loop.emit_call_completed(call, out, time.perf_counter() - started)
    return out, terminate


async def _ledger(
    loop: Loop, durable: Durable, position: int, call: FunctionCallItem
) -> CallResult | str:
    """Record the intent to run a call; its recorded result if it ran already,
    else its idempotency key (the call then runs)."""
    entry = await durable.begin_call(loop, position, call)
    if entry.status == "done" and entry.output is not None:
        return entry.output, entry.terminate
    return entry.key


def _unknown(call: FunctionCallItem, tools: Mapping[str, Tool]) -> str:
    offered = ", ".join(sorted(tools)) or "none"
    return f"unknown tool {call.name!r} (available tools: {offered})"
