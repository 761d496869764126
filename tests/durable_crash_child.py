"""The process tests/test_durable_crash.py kills: the benchmark workload (4 model
requests, 3 tool calls) as a durable loop on a SQLite store.

    python durable_crash_child.py run DB SIDE_EFFECTS [KILL_AT]
    python durable_crash_child.py recover DB SIDE_EFFECTS LOOP_ID

`run` starts the loop and prints its id; with KILL_AT (`commit:N`, a commit
with a record, `ledger:N`, one without, `mid_tool:N` or `ask:N`) the process
SIGKILLs itself right after the N-th write of that kind, in the middle of the
N-th tool call (after its side effect), or as the N-th request reaches the
model. `recover` takes the loop up in a new process and
prints how it ended as JSON: a loop paused over an uncertain call is resolved
the way an operator would, by looking at the side-effect file.

Each tool call appends one line to SIDE_EFFECTS: the lines count the calls
that ran.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import anyio

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    ModelContext,
    Proceed,
    Rewrite,
    Runtime,
    ToolBatch,
    tool,
)
from agentfsm.messages import FunctionCallOutputItem
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import Commit, SQLiteStore
from agentfsm.testing import EventRecorder, call, calls, text

DB, SIDE_EFFECTS = sys.argv[2], Path(sys.argv[3])
KILL_AT = sys.argv[4] if sys.argv[1] == "run" and len(sys.argv) > 4 else ""
KIND, _, AT = KILL_AT.partition(":")
COUNTS: dict[str, int] = {}


def reached(kind: str) -> None:
    """Die here if this is the write (or call) KILL_AT names."""
    COUNTS[kind] = COUNTS.get(kind, 0) + 1
    if kind == KIND and COUNTS[kind] == int(AT):
        os.kill(os.getpid(), signal.SIGKILL)


def say(line: str) -> None:
    """A line for the test, at once (the process may be killed right after)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def effect(line: str) -> None:
    with SIDE_EFFECTS.open("a") as file:
        file.write(line + "\n")
        file.flush()
        os.fsync(file.fileno())
    reached("mid_tool")


@tool(on_crash="retry")
async def step_a(n: int) -> str:
    """An idempotent step: run again after a crash."""
    effect(f"a {n}")
    return f"a done {n}"


@tool
async def step_b(n: int) -> str:
    """A step that must not run twice: a crash in it pauses the loop."""
    effect(f"b {n}")
    return f"b done {n}"


SCRIPT = [
    calls(call("step_a", call_id="c1", n=1)),
    calls(call("step_b", call_id="c2", n=2)),
    calls(call("step_a", call_id="c3", n=3)),
    text("done"),
]


def model(request: InferenceInput) -> InferenceOutput:
    """The script's step for this point of the conversation (whichever process
    sends the request): the number of tool outputs so far. It never awaits: the
    commit that carries the last call's output is still queued as it is asked."""
    reached("ask")
    done = sum(isinstance(i, FunctionCallOutputItem) for i in request.context.items)
    return SCRIPT[done]


class KillingStore(SQLiteStore):
    def _commit_one(self, commit: Commit) -> None:
        # Each commit's transaction, in the store's thread: the runtime writes
        # several in one trip (`_durable.flusher`); this dies between them.
        super()._commit_one(commit)
        reached("commit" if commit.record is not None else "ledger")


def runtime() -> Runtime:
    return Runtime(
        providers={"script": FunctionProvider(model)},
        store=KillingStore(DB),
        tools=[step_a, step_b],
    )


async def run() -> None:
    async with runtime() as rt:
        loop_id = rt.run_loop(
            "agent",
            "do the three steps",
            InferenceInput(
                model="script:m", context=ModelContext(), tools=[step_a, step_b]
            ),
        )
        say(loop_id)
        await rt.wait(loop_id)


def decide(batch: ToolBatch, uncertain: tuple[str, ...]) -> ToolBatch | None:
    """What an operator does with calls whose outcome is uncertain: a call whose
    side effect happened is answered with what it returned; one that did not
    happen is run (None: resume with Proceed)."""
    lines = SIDE_EFFECTS.read_text().splitlines() if SIDE_EFFECTS.exists() else []
    for c in batch.calls:
        if c.call_id in uncertain:
            n = json.loads(c.arguments)["n"]
            if f"b {n}" in lines:
                batch = batch.answer(c.call_id, f"b done {n}")
    return batch if batch.outputs else None


async def recover(loop_id: str) -> None:
    async with runtime() as rt:
        recorder = EventRecorder(rt.bus, "loop.recovered")
        report = await rt.recover()
        uncertain: tuple[str, ...] = ()
        for event in recorder.events:
            uncertain += getattr(event, "uncertain_calls", ())
        if loop_id in report.paused:
            view = rt.get(loop_id)
            assert view.pending is not None
            assert isinstance(view.pending.payload, ToolBatch)
            answered = decide(view.pending.payload, uncertain)
            rt.resume(
                loop_id, Proceed() if answered is None else Rewrite(payload=answered)
            )
        if loop_id in report.recovered:
            await rt.wait(loop_id)
    store = SQLiteStore(DB)
    async with store:
        stored = await store.load(loop_id)
    assert stored is not None
    say(
        json.dumps(
            {
                "report": {"running": report.running, "paused": report.paused},
                "uncertain": list(uncertain),
                "outcome": stored.record.outcome,
                "status": stored.record.status,
                "items": [i.model_dump(mode="json") for i in stored.items],
            }
        )
    )


if __name__ == "__main__":
    backend = os.environ.get("AGENTFSM_BACKEND", "asyncio")
    if sys.argv[1] == "run":
        anyio.run(run, backend=backend)
    else:
        anyio.run(recover, sys.argv[4], backend=backend)
