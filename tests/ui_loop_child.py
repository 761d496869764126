"""The process whose loop tests/test_ui_browser.py watches in a browser: one
durable loop on a SQLite store that keeps its events.

    python ui_loop_child.py DB

The loop calls `wait_for_gate`, which returns the line the test writes to
the process's stdin (until then the loop stays in `function_call`), then
answers with text full of markup and control characters (the model's
text is untrusted: the page must show it as text). The process prints the
loop's id, then `done` when the loop has ended.
"""

from __future__ import annotations

import sys

import anyio

from agentfsm import InferenceInput, ModelContext, Runtime, tool
from agentfsm.store import SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text

HOSTILE = (
    '<img src=x onerror="alert(1)"><script>alert(2)</script>'
    '<a href="javascript:alert(3)">link</a>\x1b[31m red \u202e'
)


@tool
def wait_for_gate() -> str:
    """Wait until the test opens the gate (a sync tool: it runs in a thread)."""
    return sys.stdin.readline().strip()


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main() -> None:
    provider = ScriptedProvider(
        [calls(call("wait_for_gate", call_id="g1")), text(HOSTILE)]
    )
    store = SQLiteStore(sys.argv[1], events=True)
    async with Runtime(providers={"scripted": provider}, store=store) as runtime:
        request = InferenceInput(
            model="scripted:m", context=ModelContext(), tools=(wait_for_gate,)
        )
        loop_id = runtime.run_loop("watched", HOSTILE, request)
        say(loop_id)
        await runtime.wait(loop_id)
        say("done")


if __name__ == "__main__":
    anyio.run(main)
