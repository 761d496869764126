"""The process tests/test_reconcile.py kills: a durable loop on a SQLite store
whose `charge` call is in flight when its process dies, and its recovery,
which asks `charge`'s reconcile function.

    python reconcile_crash_child.py run DB DIR EFFECT
    python reconcile_crash_child.py recover DB DIR LOOP_ID [KILL_AT]

`run` starts the loop, prints its id, and SIGKILLs itself in the middle of the
`charge` call: after its side effect (EFFECT `after`: a line in DIR/effects)
or before it (`before`). `recover` takes the loop up; the reconcile function
(each question a line in DIR/asked) answers from the side-effect file, as a
payments API looked up by key would: `ran` if the line is there, `not_run` if
not. With KILL_AT the process SIGKILLs itself while the function is being
asked (`asking`), or right after the store's transaction holding its answer
committed (`answered`); without, it prints how the loop ended as JSON.
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
    ModelContext,
    Reconciled,
    Runtime,
    current_call,
    tool,
)
from agentfsm.store import Commit, SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text

DB, DIR = sys.argv[2], Path(sys.argv[3])
EFFECTS, ASKED = DIR / "effects", DIR / "asked"
KILL_AT = sys.argv[5] if sys.argv[1] == "recover" and len(sys.argv) > 5 else ""
EFFECT = sys.argv[4] if sys.argv[1] == "run" else ""


def append(path: Path, line: str) -> None:
    with path.open("a") as file:
        file.write(line + "\n")
        file.flush()
        os.fsync(file.fileno())


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def find_charge(key: str, arguments: dict[str, Any]) -> Reconciled | None:
    """Look the charge up by its key (a sync function: run in a thread)."""
    append(ASKED, f"{key} {json.dumps(arguments)}")
    if KILL_AT == "asking":
        die()
    effects = EFFECTS.read_text().splitlines() if EFFECTS.exists() else []
    if f"charge {key}" in effects:
        return Reconciled.ran(f"charged {arguments['amount']} (found by key)")
    return Reconciled.not_run()


@tool(reconcile=find_charge)
async def charge(amount: int) -> str:
    """Charge a card (not idempotent)."""
    if EFFECT == "before":
        die()
    append(EFFECTS, f"charge {current_call().idempotency_key}")
    if EFFECT == "after":
        die()
    return f"charged {amount}"


class KillingStore(SQLiteStore):
    def _commit_one(self, commit: Commit) -> None:
        super()._commit_one(commit)
        by = [c.by or "" for c in commit.ledger]
        if KILL_AT == "answered" and any(b.startswith("reconcile:") for b in by):
            die()


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def run() -> None:
    model = ScriptedProvider([calls(call("charge", call_id="c1", amount=5))])
    async with Runtime(providers={"m": model}, store=KillingStore(DB)) as rt:
        request = InferenceInput(model="m:m", context=ModelContext(), tools=[charge])
        loop_id = rt.run_loop("agent", "charge 5", request)
        say(loop_id)
        await rt.wait(loop_id)


async def recover(loop_id: str) -> None:
    model = ScriptedProvider([text("done")])
    async with Runtime(
        providers={"m": model}, store=KillingStore(DB), tools=[charge]
    ) as rt:
        report = await rt.recover()
        with anyio.fail_after(30):
            result = await rt.wait(loop_id)
    async with SQLiteStore(DB) as store:
        stored = await store.load(loop_id)
    assert stored is not None
    say(
        json.dumps(
            {
                "running": report.running,
                "outcome": result.outcome,
                "outputs": [
                    i.output
                    for i in stored.items
                    if isinstance(i, FunctionCallOutputItem)
                ],
            }
        )
    )


if __name__ == "__main__":
    backend = os.environ.get("AGENTFSM_BACKEND", "asyncio")
    if sys.argv[1] == "run":
        anyio.run(run, backend=backend)
    else:
        anyio.run(recover, sys.argv[4], backend=backend)
