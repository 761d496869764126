"""The processes tests/test_ui_fork_browser.py forks and replays loops of
from `agentfsm ui`.

    python -m tests.ui_fork_child MODE KIND WHERE MARKERS

KIND and WHERE as in tests/ui_actions_child.py (`sqlite` and the database
file, or `postgres` and `conninfo schema`). MODE:

- `record`: runs one loop to its end (the model asks for `add(1, 2)`, then
  answers "3"), prints `{"loop_id"}` and exits.
- `watch`: a runtime with the tools, watching the store's requests (every
  0.1 s); its model asks for `add(5, 5)`, then answers "10" (what a fork
  started here says). Prints `{"watching": pid}` once it watches, then runs
  until it is killed.

Each run of `add` writes a file of its own into MARKERS (its arguments and
the process's id): the files count the runs, whichever process ran them.
"""

from __future__ import annotations

import os
import sys

import anyio

from agentfsm import InferenceInput, ModelContext, Runtime, tool
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.ui_actions_child import mark, say, store_of


@tool
def add(a: int, b: int) -> str:
    """Add two numbers."""
    mark("add", {"a": a, "b": b})
    return str(a + b)


async def main(mode: str, kind: str, where: str) -> None:
    if mode == "record":
        provider = ScriptedProvider(
            [calls(call("add", call_id="c1", a=1, b=2)), text("3")]
        )
        async with Runtime(
            providers={"scripted": provider}, store=store_of(kind, where)
        ) as runtime:
            request = InferenceInput(
                model="scripted:m", context=ModelContext(), tools=[add]
            )
            loop_id = runtime.run_loop("adder", "add 1 and 2", request)
            with anyio.fail_after(60):
                await runtime.wait(loop_id)
        say({"loop_id": loop_id})
        return
    provider = ScriptedProvider(
        [calls(call("add", call_id="f1", a=5, b=5)), text("10")]
    )
    async with Runtime(
        providers={"scripted": provider},
        store=store_of(kind, where),
        tools=[add],
        requests=0.1,
    ):
        say({"watching": os.getpid()})
        await anyio.sleep_forever()


if __name__ == "__main__":
    mode_arg, kind_arg, where_arg, markers_arg = sys.argv[1:5]
    os.environ["UI_MARKERS"] = markers_arg
    os.environ["UI_MODE"] = mode_arg
    anyio.run(main, mode_arg, kind_arg, where_arg)
