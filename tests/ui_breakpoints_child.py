"""The process whose loop tests/test_ui_breakpoints_browser.py sets breakpoints
on from `agentfsm ui`: a runtime holding one durable loop, watching its
store (requests and stored breakpoints).

    python -m tests.ui_breakpoints_child DB FOLDER

The model asks for `gate("first")`, then for `note("second")`, then answers.
`gate` waits until the file FOLDER/go exists (the test writes it once the
breakpoint is set). The process prints JSON lines: `{"loop_id"}` once `gate`
runs, `{"synced": [ids]}` each time the stored breakpoints its runtime has set
change, and `{"outcome", "answer"}` when the loop has ended.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio

from agentfsm import InferenceInput, ModelContext, Runtime, tool
from agentfsm.store import SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text

_folder = Path(".")
_running = anyio.Event()


@tool
async def gate(name: str) -> str:
    """Wait until the test says go."""
    _running.set()
    # A file another process writes: polled, no event can say it.
    while not (_folder / "go").exists():  # noqa: ASYNC110
        await anyio.sleep(0.05)
    return f"{name} passed"


@tool
def note(name: str) -> str:
    """Return at once."""
    return f"{name} noted"


def say(data: object) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


async def report_synced(runtime: Runtime) -> None:
    """Say which stored breakpoints the runtime has set, at each change."""
    last: list[int] | None = None
    while True:
        now = sorted(s.stored for s in runtime.breakpoints.list() if s.stored)
        if now != last:
            last = now
            say({"synced": now})
        await anyio.sleep(0.05)


async def main(db: str) -> None:
    provider = ScriptedProvider(
        [
            calls(call("gate", call_id="g1", name="first")),
            calls(call("note", call_id="n1", name="second")),
            text("all done"),
        ]
    )
    request = InferenceInput(
        model="scripted:m", context=ModelContext(), tools=[gate, note]
    )
    async with (
        Runtime(
            providers={"scripted": provider},
            store=SQLiteStore(db, events=True),
            requests=0.1,
        ) as runtime,
        anyio.create_task_group() as tg,
    ):
        loop_id = runtime.run_loop("clerk", "go", request)
        with anyio.fail_after(60):
            await _running.wait()
        say({"loop_id": loop_id})
        tg.start_soon(report_synced, runtime)
        with anyio.fail_after(240):
            result = await runtime.wait(loop_id)
        tg.cancel_scope.cancel()
    answer = None if result.answer is None else result.answer.content
    say({"outcome": result.outcome.value, "answer": answer})


if __name__ == "__main__":
    _folder = Path(sys.argv[2])
    anyio.run(main, sys.argv[1])
