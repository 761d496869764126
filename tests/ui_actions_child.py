"""The process whose loop tests/test_ui_actions*.py act on from `agentfsm ui`:
a runtime holding one durable loop, watching its store's requests.

    python -m tests.ui_actions_child MODE KIND WHERE MARKERS

KIND is `sqlite` (WHERE: the database file) or `postgres` (WHERE: `conninfo
schema`, one argument, split at the last space). MODE:

- `approve`: the model asks for `send` three times (c1 to ada, c2 to bob,
  c3 to cy), each needing approval; the loop pauses for it.
- `run`: the model asks for `wait_here`, which waits until the loop is
  cancelled; the loop runs.
- `crash`: the model asks for `charge` (a tool that must not run twice),
  which never returns: the test kills the process with SIGKILL during it.
- `recover`: takes the killed process's loop up (`Runtime.recover`): it
  pauses over the uncertain `charge`; `charge` returns at once here.

The process prints one JSON line once the loop is where the test wants it
(`{"loop_id", "seq"}`: paused at seq, or running its tool: seq None), and
one when the loop has ended (`{"outcome", "reason", "answer"}`).

Each tool run writes a file of its own into MARKERS (`<tool>-<random>.json`,
its arguments and the process's id), before it returns or waits: the files
count the runs, whichever process ran them.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio

from agentfsm import InferenceInput, LoopStatus, ModelContext, Runtime, tool
from agentfsm.store import LoopStore, SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text

__all__ = ("markers", "store_of")


_ran: anyio.Event | None = None
"""Set once a tool of this process has recorded its run (`main` waits for
it in the modes whose tool waits)."""


def mark(tool_name: str, arguments: dict[str, Any]) -> None:
    """Record one run of a tool (durably: the process may be killed next)."""
    folder = Path(os.environ["UI_MARKERS"])
    path = folder / f"{tool_name}-{uuid.uuid4().hex}.json"
    data = {"tool": tool_name, "arguments": arguments, "pid": os.getpid()}
    with path.open("w") as file:
        file.write(json.dumps(data))
        file.flush()
        os.fsync(file.fileno())
    if _ran is not None:
        _ran.set()


def markers(folder: Path) -> list[dict[str, Any]]:
    """The runs recorded in `folder`, as the tools wrote them."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


@tool(needs_approval=True)
def send(to: str, text: str) -> str:
    """Send a message."""
    mark("send", {"to": to, "text": text})
    return f"sent {text!r} to {to}"


@tool
async def wait_here() -> str:
    """Wait until the loop is cancelled."""
    mark("wait_here", {})
    await anyio.sleep_forever()
    return "never"


@tool
async def charge(amount: int) -> str:
    """Charge a card: must not run twice (a crash during it leaves it
    uncertain). Never returns in the `crash` process."""
    mark("charge", {"amount": amount})
    if os.environ["UI_MODE"] == "crash":
        await anyio.sleep_forever()
    return f"charged {amount}"


TOOLS = (send, wait_here, charge)


def store_of(kind: str, where: str) -> LoopStore:
    """The store at `where` (see the module), keeping events."""
    if kind == "sqlite":
        return SQLiteStore(where, events=True)
    from agentfsm.store.postgres import PostgresStore

    conninfo, _, schema = where.rpartition(" ")
    return PostgresStore(conninfo, schema=schema, events=True)


SCRIPTS = {
    "approve": [
        calls(
            call("send", call_id="c1", to="ada", text="hi ada"),
            call("send", call_id="c2", to="bob", text="hi bob"),
            call("send", call_id="c3", to="cy", text="hi cy"),
        ),
        text("sent what was approved"),
    ],
    "run": [calls(call("wait_here", call_id="w1"))],
    "crash": [calls(call("charge", call_id="k1", amount=5))],
    "recover": [text("charged once")],
}


def say(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data) + "\n")
    sys.stdout.flush()


async def main(mode: str, kind: str, where: str) -> None:
    global _ran
    _ran = ran = anyio.Event()
    provider = ScriptedProvider(SCRIPTS[mode])
    async with Runtime(
        providers={"scripted": provider},
        store=store_of(kind, where),
        tools=TOOLS,  # (what a recovered loop's calls are bound to)
        requests=0.1,
    ) as runtime:
        if mode == "recover":
            loop_id = await _recovered(runtime)
        else:
            request = InferenceInput(
                model="scripted:m",
                context=ModelContext(),
                tools=TOOLS,
            )
            with runtime.bus.subscribe("loop.paused") as paused:
                loop_id = runtime.run_loop("actor", f"{mode}, please", request)
                with anyio.fail_after(60):
                    if mode == "approve":
                        await paused.receive()
                    else:
                        await ran.wait()  # its tool is running (and recorded)
        pending = runtime.get(loop_id).pending
        seq = None if pending is None else pending.seq
        say({"loop_id": loop_id, "seq": seq, "status": runtime.get(loop_id).status})
        with anyio.fail_after(120):
            result = await runtime.wait(loop_id)
    answer = None if result.answer is None else result.answer.content
    say({"outcome": result.outcome.value, "reason": result.reason, "answer": answer})


async def _recovered(runtime: Runtime) -> str:
    """The killed process's loop, taken up here and paused (its lease is
    taken at once when the store can tell its owner is dead; else waited)."""
    with anyio.fail_after(90):
        while True:
            report = await runtime.recover()
            if report.paused:
                (loop_id,) = report.paused
                assert runtime.get(loop_id).status is LoopStatus.paused
                return loop_id
            assert not report.failed, report.failed
            await anyio.sleep(0.2)  # a lease still held: the store's next look


if __name__ == "__main__":
    mode_arg, kind_arg, where_arg, markers_arg = sys.argv[1:5]
    os.environ["UI_MARKERS"] = markers_arg
    os.environ["UI_MODE"] = mode_arg
    anyio.run(main, mode_arg, kind_arg, where_arg)
