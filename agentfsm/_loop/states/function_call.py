"""`function_call`: run the batch's tools and write calls and outputs to the context.

The payload is the `ToolBatch` (a handler may have denied calls or changed
arguments). Calls run sequentially, or in parallel when the loop and every tool
allow it (`tool_call.run_batch`). Whatever happens, cancellation included,
every call gets an output, and the turn's items enter the context together
(calls first, then their outputs, in the model's order), so loops sharing the
context never see a call without its output. Then `finish_turn` runs.

Next: `stop` when every call asked to terminate (reason `terminated`) or a
limit or stop condition says so (its reason); `steer` when steering is queued;
else the next model request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentfsm._loop.steps import _T, Step
from agentfsm._loop.tool_call import INTERRUPTED, CallResult, run_batch
from agentfsm._loop.turn import (
    drain,
    finish_turn,
    infer_step,
    stop_check,
    tool_index,
    write,
)
from agentfsm.interception import ToolBatch, TransitionPayload
from agentfsm.messages import ContextItem, FunctionCallItem, FunctionCallOutputItem

if TYPE_CHECKING:
    from agentfsm._loop.loop import Loop

__all__ = ("function_call",)


async def function_call(loop: Loop, payload: TransitionPayload) -> Step:
    batch = payload if isinstance(payload, ToolBatch) else ToolBatch(calls=())
    output, loop.output = loop.output, None
    items: list[ContextItem] = (
        []
        if output is None
        else [i for i in output.items if not isinstance(i, FunctionCallItem)]
    )
    loop.last_tools.clear()
    results: list[CallResult | None] = [None] * len(batch.calls)
    # A response cut by the token limit may hold truncated arguments.
    truncated = output is not None and output.finish_reason == "length"
    try:
        await run_batch(loop, batch, tool_index(loop), results, truncated=truncated)
    finally:
        outputs = [
            settled(loop, call, r) for call, r in zip(batch.calls, results, strict=True)
        ]
        items.extend(batch.calls)
        items.extend(outputs)
        write(loop, items)
    if loop.options.finish_turn is not None:
        await finish_turn(loop, output, outputs)
    stop = "terminated" if all_terminate(results) else stop_check(loop)
    if stop is not None:
        return (_T.stop, None, stop)
    if loop.steering:
        steering = drain(loop.steering, loop.options.steering_mode)
        return (_T.steer, steering, None)
    return infer_step(loop)


def settled(
    loop: Loop, call: FunctionCallItem, result: CallResult | None
) -> FunctionCallOutputItem:
    """A call's output; an error output for a call that never ended."""
    if result is not None:
        return result[0]
    out = FunctionCallOutputItem.error(call.call_id, INTERRUPTED)
    loop.emit_call_completed(call, out, 0.0)
    return out


def all_terminate(results: list[CallResult | None]) -> bool:
    """Whether the batch ran calls and every one asked to end the loop."""
    for result in results:
        if result is None or not result[1]:
            return False
    return bool(results)
