"""The process tests/test_breakpoints.py kills: a durable loop on a SQLite store
that pauses at a breakpoint before its one tool call.

    python breakpoints_child.py run DB SIDE_EFFECTS at_pause|after_resume
    python breakpoints_child.py recover DB SIDE_EFFECTS LOOP_ID [hold]

`run` starts the loop and prints its id; it SIGKILLs itself right after the
store took the breakpoint's pause (`at_pause`), or, having resumed the pause
with `Proceed`, right after the store took that decision, before the
transition it decided about (`after_resume`). `recover` takes the loop up in a
new process with the same breakpoint, resumes it if it is paused (`hold`:
kills itself instead, still paused) and prints as JSON what happened: the
recovery's report, how many pauses this process saw, the outcome, and the
store's decision records.

The tool appends a line to SIDE_EFFECTS each time it runs.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import anyio

from agentfsm import (
    Break,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    Runtime,
    tool,
)
from agentfsm.messages import FunctionCallOutputItem
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import Commit, SQLiteStore
from agentfsm.testing import EventRecorder, call, calls, text

DB, SIDE_EFFECTS = sys.argv[2], Path(sys.argv[3])


def say(line: str) -> None:
    """A line for the test, at once (the process may be killed right after)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@tool
def charge(amount: int) -> str:
    """Charge a card (not idempotent; sync: its file writes block)."""
    with SIDE_EFFECTS.open("a") as file:
        file.write(f"charged {amount}\n")
        file.flush()
        os.fsync(file.fileno())
    return f"charged {amount}"


def model(request: InferenceInput) -> InferenceOutput:
    """Call `charge` once, then answer (whichever process asks)."""
    if any(isinstance(i, FunctionCallOutputItem) for i in request.context.items):
        return text("Charged.")
    return calls(call("charge", call_id="c1", amount=5))


class KillingStore(SQLiteStore):
    """Dies right after the commit `kill_at` names has landed."""

    kill_at = ""

    def _commit_one(self, commit: Commit) -> None:
        super()._commit_one(commit)
        record = commit.record
        if record is None:
            return
        if (self.kill_at == "at_pause" and record.pause is not None) or (
            self.kill_at == "after_resume" and record.resume is not None
        ):
            os.kill(os.getpid(), signal.SIGKILL)


def runtime(store: SQLiteStore) -> Runtime:
    return Runtime(
        providers={"script": FunctionProvider(model)},
        store=store,
        tools=[charge],
        breakpoints=[Break("function_call")],
    )


async def run(mode: str) -> None:
    store = KillingStore(DB)
    store.kill_at = mode
    async with runtime(store) as rt:
        with rt.bus.subscribe("loop.paused") as paused:
            loop_id = rt.run_loop(
                "agent",
                "charge 5",
                InferenceInput(
                    model="script:m", context=ModelContext(), tools=[charge]
                ),
            )
            say(loop_id)
            await paused.receive()
        if mode == "after_resume":
            rt.resume(loop_id, by="first process")
        await rt.wait(loop_id)  # killed before it ends


async def recover(loop_id: str, hold: bool) -> None:
    async with runtime(SQLiteStore(DB)) as rt:
        pauses = EventRecorder(rt.bus, "loop.paused")
        report = await rt.recover()
        if loop_id in report.paused:
            if hold:
                os.kill(os.getpid(), signal.SIGKILL)
            rt.resume(loop_id, by="after the crash")
        result = await rt.wait(loop_id)
        store = SQLiteStore(DB)
        async with store:
            decisions = await store.decisions(loop_id)
        say(
            json.dumps(
                {
                    "running": report.running,
                    "paused": report.paused,
                    "pauses": len(pauses.events),
                    "outcome": result.outcome,
                    "decisions": [
                        [d.handler, d.decision.kind, d.decision.reason, d.by]
                        for d in decisions
                    ],
                }
            )
        )


if __name__ == "__main__":
    backend = os.environ.get("AGENTFSM_BACKEND", "asyncio")
    if sys.argv[1] == "run":
        anyio.run(run, sys.argv[4], backend=backend)
    else:
        hold = len(sys.argv) > 5 and sys.argv[5] == "hold"
        anyio.run(recover, sys.argv[4], hold, backend=backend)
