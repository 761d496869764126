"""The process tests/test_requests.py starts: a runtime that holds a loop paused
for approval, watching its store's requests.

    python -m tests.requests_child BACKEND KIND WHERE SIDE_EFFECTS [kill]

KIND is `sqlite` (WHERE: the database file) or `postgres` (WHERE: `conninfo
schema`, one argument, split at the last space). The child starts a loop whose
model asks for `send` twice (c1 to ada, c2 to bob: both need approval),
prints `{"loop_id": ..., "seq": ...}` once the loop is paused, then waits for
a request (submitted by the test) to resume it, and prints how the loop ended:
`{"outcome": ..., "answer": ...}`. With `kill`, it SIGKILLs itself right after
the commit that applies a request has landed (before the decision acts).

Each `send` call appends a line to SIDE_EFFECTS: the lines count the calls
that ran, whichever process ran them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio

from agentfsm import InferenceInput, LoopStatus, ModelContext, Runtime, tool
from agentfsm.store import Commit, LoopStore, SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text

__all__ = ("SCRIPT", "send", "store_of")


@tool(needs_approval=True)
def send(to: str) -> str:
    """Send a message; appends `sent <to> <pid>` to $SIDE_EFFECTS."""
    with Path(os.environ["SIDE_EFFECTS"]).open("a") as file:
        file.write(f"sent {to} {os.getpid()}\n")
        file.flush()
        os.fsync(file.fileno())
    return f"sent to {to}"


SCRIPT = [
    calls(call("send", call_id="c1", to="ada"), call("send", call_id="c2", to="bob"))
]


def _killing(base: type[Any]) -> type[Any]:
    class Killing(base):  # type: ignore[misc]
        def _commit_one(self, commit: Commit) -> None:
            # In the store's thread, once the commit's transaction committed.
            super()._commit_one(commit)
            if commit.requests:
                os.kill(os.getpid(), signal.SIGKILL)

    return Killing


def store_of(kind: str, where: str, *, kill: bool = False) -> LoopStore:
    """The store the child (or the test) opens: `kind` at `where`."""
    if kind == "sqlite":
        cls: type[Any] = SQLiteStore
        args: tuple[str, ...] = (where,)
        kwargs: dict[str, str] = {}
    else:
        from agentfsm.store.postgres import PostgresStore

        conninfo, _, schema = where.rpartition(" ")
        cls, args, kwargs = PostgresStore, (conninfo,), {"schema": schema}
    if kill:
        cls = _killing(cls)
    store: LoopStore = cls(*args, **kwargs)
    return store


def say(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


async def main(kind: str, where: str, kill: bool) -> None:
    provider = ScriptedProvider([*SCRIPT, text("done")])
    async with Runtime(
        providers={"scripted": provider},
        store=store_of(kind, where, kill=kill),
        # Polls rarely: the test pokes nothing here, so what wakes this
        # process is its poll (SQLite) or the store's notice (PostgreSQL).
        requests=0.05 if kind == "sqlite" else 3600.0,
    ) as runtime:
        request = InferenceInput(
            model="scripted:m", context=ModelContext(), tools=[send]
        )
        with runtime.bus.subscribe("loop.paused") as paused, anyio.fail_after(60):
            loop_id = runtime.run_loop("agent", "write to ada and bob", request)
            await paused.receive()
        assert runtime.get(loop_id).status is LoopStatus.paused
        pending = runtime.get(loop_id).pending
        assert pending is not None
        say({"loop_id": loop_id, "seq": pending.seq})
        with anyio.fail_after(60):
            result = await runtime.wait(loop_id)
    answer = None if result.answer is None else result.answer.content
    say({"outcome": result.outcome.value, "answer": answer})


if __name__ == "__main__":
    backend, kind_arg, where_arg = sys.argv[1:4]
    os.environ["SIDE_EFFECTS"] = sys.argv[4]
    anyio.run(main, kind_arg, where_arg, sys.argv[5:] == ["kill"], backend=backend)
