"""The process tests/test_store_faults.py kills, stops, or runs in another PID
namespace: a runtime whose one durable loop is held in a tool.

    python -m tests.durable_owner_child CONFIG

CONFIG is JSON: `kind` ("sqlite" or "postgres"), `path` (SQLite) or
`conninfo` and `schema` (PostgreSQL), `backend` ("asyncio" or "trio") and
`effects` (a file); with `reopen` (SQLite), a first runtime opens the store
and exits, and its `<path>-owners` file is removed, before the runtime that
runs the loop. The store's `lease_ttl` is 60 s: a lease the test finds is
never an expired one.

The loop asks for `hold` (call h1), then answers "held". `hold` appends a
line to the effects file (`<pid> <loop id> <call id>`: the lines count the
calls that ran, in any process), then, in this process, prints
`in-tool <loop id>` and waits for a line on stdin before it returns. Once the
loop has ended the process prints `ended <outcome>` and exits.

The test process imports `hold`, `model` and `request` to take the loop up
(there `hold` returns at once).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import anyio
import anyio.to_thread

from agentfsm import (
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    Runtime,
    current_call,
    tool,
)
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import LoopStore, SQLiteStore
from agentfsm.testing import call, calls, text

__all__ = ("STATE", "hold", "model", "open_store", "request")

STATE: dict[str, Any] = {"effects": None, "holds": False}
"""Where `hold` records its runs, and whether it holds (in the child only)."""


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@tool(on_crash="retry")
async def hold(tag: str) -> str:
    """Record a run; in the child, hold until a line comes on stdin."""
    running = current_call()
    with open(STATE["effects"], "a") as effects:  # noqa: ASYNC230 - a line, fsynced
        effects.write(f"{os.getpid()} {running.loop_id} {running.call_id}\n")
        effects.flush()
        os.fsync(effects.fileno())
    if STATE["holds"]:
        say(f"in-tool {running.loop_id}")
        await anyio.to_thread.run_sync(sys.stdin.readline)
    return f"held {tag}"


def model(request: InferenceInput) -> InferenceOutput:
    """`hold`, then the answer (whichever process asks)."""
    if any(isinstance(i, FunctionCallOutputItem) for i in request.context.items):
        return text("held")
    return calls(call("hold", call_id="h1", tag="x"))


def request() -> InferenceInput:
    return InferenceInput(model="owner:m", context=ModelContext(), tools=[hold])


def open_store(config: dict[str, Any]) -> LoopStore:
    if config["kind"] == "postgres":
        from agentfsm.store.postgres import PostgresStore

        return PostgresStore(config["conninfo"], schema=config["schema"], lease_ttl=60)
    return SQLiteStore(config["path"], lease_ttl=60)


async def main(config: dict[str, Any]) -> None:
    STATE.update(effects=config["effects"], holds=True)
    if config.get("reopen"):
        async with Runtime(store=open_store(config)):
            pass
        os.unlink(config["path"] + "-owners")
    async with Runtime(
        providers={"owner": FunctionProvider(model)},
        store=open_store(config),
        tools=[hold],
    ) as runtime:
        loop_id = runtime.run_loop("owner", "hold on", request())
        result = await runtime.wait(loop_id)
    say(f"ended {result.outcome.value}")


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    anyio.run(main, settings, backend=settings["backend"])
