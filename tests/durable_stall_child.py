"""The processes tests/test_durable_stall.py stops and wakes: a durable loop on a
SQLite store with a short lease, whose owner stalls (SIGSTOP, sent to itself)
at a given point, past its lease, while another process takes the loop up.

    python durable_stall_child.py run DB SIDE STOP_AT
    python durable_stall_child.py recover DB SIDE LOOP_ID

DB is a SQLite file, or `postgresql:SCHEMA:CONNINFO` (a PostgreSQL store).

`run` starts the loop, prints its id, stops itself at STOP_AT and, once woken
(SIGCONT), goes on as it can; it prints how `wait` ended as JSON. `recover`
takes the loop up (waiting for its lease to expire), resumes it if it paused
over a call in flight (answered from the side effects, or run again), waits
for it, and prints its outcome.

The points (STOP_AT):
- `mid_tool:N`: in the N-th tool call, after its side effect;
- `after_tool:N`: as the N-th call returns (a tool wrapper);
- `mid_request:N`: as the N-th model request reaches the model;
- `before_end`: as a handler decides about the loop's `finish`.

Every side effect (a tool call, a model request) is a line of SIDE with the
pid of the process that made it, written before the process goes on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio

from agentfsm import (
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    PendingTransition,
    Proceed,
    Rewrite,
    Runtime,
    ToolBatch,
    Trigger,
    tool,
)
from agentfsm.exceptions import LoopDetachedError
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import LoopStore, SQLiteStore
from agentfsm.testing import call, calls, text
from agentfsm.tools import ToolCall, ToolResult

LEASE_TTL = 1.0
DB, SIDE = sys.argv[2], Path(sys.argv[3])
STOP_AT = sys.argv[4] if sys.argv[1] == "run" else ""
COUNTS: dict[str, int] = {}


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def effect(line: str) -> None:
    with SIDE.open("a") as file:
        file.write(f"{os.getpid()} {line}\n")
        file.flush()
        os.fsync(file.fileno())


def reached(kind: str) -> None:
    """Stop here (until SIGCONT) if this is the point STOP_AT names."""
    COUNTS[kind] = COUNTS.get(kind, 0) + 1
    if STOP_AT in (kind, f"{kind}:{COUNTS[kind]}"):
        say("stopping")
        os.kill(os.getpid(), signal.SIGSTOP)
        say("woken")


@tool
async def step(n: int) -> str:
    """A step with a side effect that must not be repeated unasked."""
    effect(f"step {n}")
    reached("mid_tool")
    return f"step {n} done"


async def stall_after(tool_call: ToolCall, call_next: Any) -> ToolResult:
    """A tool wrapper: the point just after a call returned."""
    result: ToolResult = await call_next(tool_call)
    reached("after_tool")
    return result


def stall_before_end(pending: PendingTransition) -> None:
    if pending.trigger is Trigger.finish:
        reached("before_end")


def model(request: InferenceInput) -> InferenceOutput:
    done = sum(isinstance(i, FunctionCallOutputItem) for i in request.context.items)
    effect(f"request after {done}")
    reached("mid_request")
    if done == 0:
        return calls(
            call("step", call_id="c1", n=1),
            call("step", call_id="c2", n=2),
        )
    return text("done")


def store() -> LoopStore:
    if DB.startswith("postgresql:"):
        from agentfsm.store.postgres import PostgresStore

        _, schema, conninfo = DB.split(":", 2)
        return PostgresStore(conninfo, schema=schema, lease_ttl=LEASE_TTL)
    return SQLiteStore(DB, lease_ttl=LEASE_TTL)


def runtime() -> Runtime:
    return Runtime(
        providers={"script": FunctionProvider(model)},
        store=store(),
        tools=[step],
        handlers=[stall_after, stall_before_end],
    )


async def run() -> None:
    async with runtime() as rt:
        # A loop with a handler writes each call's output at once; without
        # one, the batch's last output goes with the next commit, which the
        # next request does not wait for: only the lease's check stops it.
        loop_id = rt.run_loop(
            "agent",
            "take the two steps",
            InferenceInput(model="script:m", context=ModelContext(), tools=[step]),
            stall_before_end if STOP_AT == "before_end" else None,
            tool_wrappers=[stall_after],
        )
        say(loop_id)
        try:
            result = await rt.wait(loop_id)
        except LoopDetachedError as exc:
            say(json.dumps({"detached": str(exc), "cause": type(exc.cause).__name__}))
        else:
            say(json.dumps({"outcome": result.outcome.value}))


def decide(batch: ToolBatch) -> Rewrite | Proceed:
    """Answer a call whose side effect happened (whoever made it); run the
    others again."""
    lines = SIDE.read_text().splitlines() if SIDE.exists() else []
    for c in batch.calls:
        n = json.loads(c.arguments)["n"]
        if any(line.endswith(f" step {n}") for line in lines):
            batch = batch.answer(c.call_id, f"step {n} done")
    return Rewrite(payload=batch) if batch.outputs else Proceed()


async def recover(loop_id: str) -> None:
    async with runtime() as rt:
        with anyio.fail_after(30):
            while True:
                report = await rt.recover()
                if loop_id in report.recovered:
                    break
                await anyio.sleep(0.05)  # its lease has not expired yet
        if loop_id in report.paused:
            view = rt.get(loop_id)
            assert view.pending is not None
            assert isinstance(view.pending.payload, ToolBatch)
            rt.resume(loop_id, decide(view.pending.payload))
        result = await rt.wait(loop_id)
    say(json.dumps({"outcome": result.outcome.value}))


if __name__ == "__main__":
    if sys.argv[1] == "run":
        anyio.run(run)
    else:
        anyio.run(recover, sys.argv[4])
