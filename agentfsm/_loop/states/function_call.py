"""`function_call`: run the batch's tools and write calls and outputs to the context.

The payload is the `ToolBatch` (a handler may have denied calls, answered them
or changed arguments); its plan (`batch.plan_of`) says which calls run and
how: one after the other (`tool_call.run_call` each), or in parallel when the
loop and every tool allow it (`tool_call.run_parallel`). Whatever happens,
cancellation included, every call gets an output, and the turn's items enter
the context together (calls first, then their outputs, in the model's order),
so loops sharing the context never see a call without its output. Then
`finish_turn` runs.

Next: `stop` when every call asked to terminate (reason `terminated`) or a
limit or stop condition says so (its reason); `steer` when steering is queued;
else the next model request.

Recovered (`recover`): a loop taken up from its store in this state runs it
again; a call the ledger holds as done gives its recorded output, and a call
in flight when the process stopped (started, no output) of a tool that may
not run twice parks the loop before this state, naming it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anyio.lowlevel import checkpoint_if_cancelled

from agentfsm._loop.batch import plan_of
from agentfsm._loop.intercept import park, pending_of
from agentfsm._loop.steps import _T, Step
from agentfsm._loop.tool_call import INTERRUPTED, CallResult, run_call, run_parallel
from agentfsm._loop.turn import drain, finish_turn, infer_step, stop_check, write
from agentfsm.interception import ToolBatch, TransitionPayload
from agentfsm.messages import ContextItem, FunctionCallItem, FunctionCallOutputItem

if TYPE_CHECKING:
    from agentfsm._loop.loop import Loop
    from agentfsm._loop.steps import Found

__all__ = ("function_call", "recover")


async def function_call(loop: Loop, payload: TransitionPayload) -> Step:
    batch = payload if isinstance(payload, ToolBatch) else ToolBatch(calls=())
    plan = plan_of(loop, batch)
    output, loop.output = loop.output, None
    items: list[ContextItem] = (
        []
        if output is None
        else [i for i in output.items if not isinstance(i, FunctionCallItem)]
    )
    loop.last_tools.clear()
    results: list[CallResult | None] = [None] * len(batch.calls)
    try:
        if plan.parallel:
            await run_parallel(loop, plan, results)
        else:
            # One by one, here rather than in a helper: a coroutine less per
            # batch (~1,500 instructions, `make bench-instructions`).
            for planned in plan.calls:
                if planned.position:  # a cancel while the last call ended: no more
                    await checkpoint_if_cancelled()
                results[planned.position] = await run_call(loop, planned)
    finally:
        outputs = [
            settled(loop, call, r) for call, r in zip(batch.calls, results, strict=True)
        ]
        items.extend(batch.calls)
        items.extend(outputs)
        write(loop, items)
        loop.plan = None
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


def recover(loop: Loop, found: Found) -> list[str]:
    """A loop taken up in this state (its batch not done when its process
    stopped): park it before this state over the calls in flight whose tools
    may not run twice; return their keys (none: it runs the state again).

    `found.ledger` is the ledger's entries of the batch's request. A call runs
    again with the same key if its tool is `on_crash="retry"`; a call a
    decision settled (answered or denied: done in the ledger, or in the batch;
    to be run again: `retry` until it starts) is never in doubt again."""
    step = loop.step
    assert step is not None
    batch = step[1]
    if not isinstance(batch, ToolBatch):
        return []
    doubtful = []
    for planned in plan_of(loop, batch).calls:
        if not planned.runs:
            continue  # denied, answered, not run at all
        key = planned.key(loop)
        entry = found.ledger.get(key)
        if entry is None or entry.status in ("done", "retry"):
            continue  # not started (since a decision to run it again), or done
        if planned.tool is not None and planned.tool.on_crash == "retry":
            continue  # idempotent: it runs again, with the same key
        doubtful.append((key, planned.call))
    if not doubtful:
        return []
    # Back to just before `function_call`, paused: the handlers decided about
    # this batch already, so the decision resuming it is the last.
    entered = loop.path.pop()
    loop.state = entered.source
    loop.plan = None
    names = ", ".join(f"{c.call_id} ({c.name})" for _, c in doubtful)
    reason = (
        f"uncertain tool outcome: the process stopped with {names} started "
        "and no output recorded (each may or may not have run); "
        "resume with Proceed to run them again, or a Rewrite whose ToolBatch "
        "answers them (ToolBatch.answer) or denies them (ToolBatch.deny)"
    )
    if found.notes:
        notes = [found.notes[key] for key, _ in doubtful if key in found.notes]
        reason = "; ".join([reason, *notes])
    park(
        loop,
        (entered.trigger, batch, None),
        pending_of(loop, entered.source, entered.trigger, entered.dest, batch),
        len(loop.handlers),
        reason,
        entered.dest,
    )
    return [key for key, _ in doubtful]
