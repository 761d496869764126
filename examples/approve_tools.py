"""Approving and denying tool calls with an interception handler.

Part 1: a policy handler. On `call_tools` the payload is a `ToolBatch`; the
handler denies every `delete_file` call with `batch.deny(call_id, reason)` and
returns `Rewrite(payload=batch)`. The denied call never runs: the model gets an
error output with the reason, and the approved call runs as usual.

Part 2: a human in the loop. The handler returns `Pause("needs approval")`; the
loop parks with the transition pending (no task stays busy) and publishes
`loop.paused`. The code looks at the pending calls through `runtime.get(loop_id)`
and continues the loop with `runtime.resume(loop_id, Rewrite(payload=...))` to
deny some of them, or with `runtime.resume(loop_id)` to approve them all.

Run it with `python examples/approve_tools.py` (no network).
"""

from __future__ import annotations

import logging

import anyio
import structlog

from agentfsm import (
    Decision,
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    LoopResult,
    LoopStatus,
    ModelContext,
    Pause,
    PendingTransition,
    Rewrite,
    Runtime,
    ToolBatch,
    tool,
)
from agentfsm.testing import ScriptedProvider, call, calls, text

# The library logs transitions at debug and never configures structlog itself.
structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
)

DANGEROUS = frozenset({"delete_file"})

ran: list[str] = []
"""What the tools actually did."""


@tool
def read_file(path: str) -> str:
    """Read a file."""
    ran.append(f"read_file({path})")
    return f"contents of {path}: 3 lines of notes"


@tool
def delete_file(path: str) -> str:
    """Delete a file."""
    ran.append(f"delete_file({path})")
    return f"deleted {path}"


# Every loop runs this script: one turn asking for both tools, then an answer.
provider = ScriptedProvider(
    [
        calls(
            call("read_file", path="notes.txt"),
            call("delete_file", path="notes.txt"),
            text="I will read the notes, then clean up.",
        ),
        text("Done: I read notes.txt (and tried to delete it)."),
    ]
)


def new_request() -> InferenceInput:
    return InferenceInput(
        model="scripted:assistant",
        context=ModelContext(),
        tools=(read_file, delete_file),
    )


def deny_dangerous(batch: ToolBatch) -> ToolBatch:
    for item in batch.calls:
        if item.name in DANGEROUS:
            batch = batch.deny(item.call_id, f"{item.name} is not allowed here")
    return batch


def policy(pending: PendingTransition) -> Decision | None:
    """Deny dangerous calls; let every other transition proceed."""
    if isinstance(pending.payload, ToolBatch):
        return Rewrite(payload=deny_dangerous(pending.payload))
    return None


def ask_a_human(pending: PendingTransition) -> Decision | None:
    """Pause before running any tool call."""
    if isinstance(pending.payload, ToolBatch):
        return Pause(reason="needs approval")
    return None


def show(title: str, request: InferenceInput, result: LoopResult) -> None:
    print(f"\n== {title}")
    print(f"outcome: {result.outcome}, tool calls run: {result.tool_calls}")
    print("ran:", ", ".join(ran) or "nothing")
    calls_by_id: dict[str, FunctionCallItem] = {}
    for item in request.context.items:
        if isinstance(item, FunctionCallItem):
            calls_by_id[item.call_id] = item
        elif isinstance(item, FunctionCallOutputItem):
            name = calls_by_id[item.call_id].name
            flag = "error" if item.is_error else "ok"
            print(f"  context: {name} -> {flag}: {item.output}")
    ran.clear()


async def wait_until_paused(runtime: Runtime, loop_id: str) -> ToolBatch:
    """Wait for the loop to pause and return the calls awaiting approval."""
    with runtime.bus.subscribe("loop.paused", loop_id=loop_id) as paused:
        if runtime.get(loop_id).status is not LoopStatus.paused:
            await paused.receive()
    view = runtime.get(loop_id)
    assert view.status is LoopStatus.paused
    pending = view.pending
    assert pending is not None
    print(
        f"\nloop paused in {view.state}, before {pending.trigger} -> {pending.dest}: "
        f"{view.pause_reason}"
    )
    batch = pending.payload
    assert isinstance(batch, ToolBatch)
    for item in batch.calls:
        print(f"  awaiting approval: {item.name}({item.arguments})")
    return batch


async def main() -> None:
    async with Runtime(providers={"scripted": provider}) as runtime:
        # Part 1: a policy handler denies the dangerous call.
        request = new_request()
        loop_id = runtime.run_loop("files-agent", "Tidy up my notes.", request, policy)
        show("policy handler", request, await runtime.wait(loop_id))

        # Part 2a: a human denies the dangerous call and approves the rest.
        request = new_request()
        loop_id = runtime.run_loop("files-agent", "Tidy up.", request, ask_a_human)
        batch = await wait_until_paused(runtime, loop_id)
        print("human: deny delete_file, run the rest")
        runtime.resume(loop_id, Rewrite(payload=deny_dangerous(batch)))
        show("human denied one call", request, await runtime.wait(loop_id))

        # Part 2b: a human approves every call as it is.
        request = new_request()
        loop_id = runtime.run_loop("files-agent", "Tidy up.", request, ask_a_human)
        await wait_until_paused(runtime, loop_id)
        print("human: approve all")
        runtime.resume(loop_id)
        show("human approved all calls", request, await runtime.wait(loop_id))


if __name__ == "__main__":
    anyio.run(main)
