"""A runtime that stalls past its lease (SIGSTOP: a frozen VM, a stop signal, a
blocked event loop) while another takes its loop up and finishes it, then
wakes (SIGCONT): it starts no further tool call or model request, writes
nothing (its end included), and is told the loop is no longer its.

tests/durable_stall_child.py is the process: a loop of two sequential calls
and an answer, on a SQLite or a PostgreSQL store with a one-second lease. Each point at which
it may stall is a parameter; the stalled process stops itself there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anyio
import pytest

from agentfsm.store import LoopStore, SQLiteStore

pytestmark = pytest.mark.e2e

CHILD = Path(__file__).with_name("durable_stall_child.py")
ROOT = CHILD.parent.parent

POINTS = [
    "mid_tool:1",
    "after_tool:1",
    "mid_tool:2",
    "after_tool:2",
    "mid_request:2",
    "before_end",
]


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    return process.stdout.readline().strip()


def stopped(pid: int) -> bool:
    """Whether the process is stopped (its state in /proc is `T`)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def until(condition: object, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def effects(side: Path, pid: int) -> list[str]:
    """The side effects process `pid` made, in order."""
    if not side.exists():
        return []
    return [
        line.split(" ", 1)[1]
        for line in side.read_text().splitlines()
        if line.split(" ", 1)[0] == str(pid)
    ]


async def stored(db: str, loop_id: str) -> tuple[str, str, list[str], list[str]]:
    """The loop as the store holds it: outcome, status, item types, calls."""
    store: LoopStore
    if db.startswith("postgresql:"):
        from agentfsm.store.postgres import PostgresStore

        _, schema, conninfo = db.split(":", 2)
        store = PostgresStore(conninfo, schema=schema)
    else:
        store = SQLiteStore(db)
    async with store:
        loop = await store.load(loop_id)
        calls = await store.calls(loop_id)
    assert loop is not None
    record = loop.record
    assert record.outcome is not None
    return (
        record.outcome.value,
        record.status.value,
        [i.type for i in loop.items],
        [c.status for c in calls],
    )


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
@pytest.mark.parametrize("point", POINTS)
def test_a_stalled_owner_that_wakes_does_nothing_more(
    tmp_path: Path, point: str, kind: str, request: pytest.FixtureRequest
) -> None:
    db, side = str(tmp_path / "loops.db"), tmp_path / "side-effects"
    if kind == "postgres":
        server = request.getfixturevalue("postgres_server")
        db = f"postgresql:t_{uuid.uuid4().hex}:{server.conninfo()}"
    stalled = start("run", db, str(side), point)
    try:
        loop_id = line(stalled)
        assert line(stalled) == "stopping", stalled.stderr
        until(lambda: stopped(stalled.pid), "the owner to stop")
        before = effects(side, stalled.pid)
        # Another process takes the loop up once the lease expired, and
        # finishes it.
        taker = start("recover", db, str(side), loop_id)
        out, err = taker.communicate(timeout=60)
        assert taker.returncode == 0, err[-3000:]
        assert json.loads(out.splitlines()[-1]) == {"outcome": "answered"}
        stalled.send_signal(signal.SIGCONT)
        out, err = stalled.communicate(timeout=60)
    finally:
        if stalled.poll() is None:
            stalled.kill()
            stalled.wait()
    lines = out.splitlines()
    assert lines[0] == "woken"
    told = json.loads(lines[-1])
    # Told the loop is no longer its, never an outcome of its own.
    assert told["cause"] == "LeaseLostError", told
    assert "stale" in told["detached"]
    # Nothing more after it stalled: no call, no request.
    assert effects(side, stalled.pid) == before, point
    # The store holds the other process's end, whole.
    outcome, status, items, calls = anyio.run(stored, db, loop_id)
    assert (outcome, status) == ("answered", "done")
    assert items == [
        "user_message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
        "model_message",
    ]
    assert calls == ["done", "done"]
    # Each step's side effect happened once, whoever made it.
    steps = [e for e in side.read_text().splitlines() if " step " in e]
    assert sorted(e.split(" ", 1)[1] for e in steps) == ["step 1", "step 2"]
