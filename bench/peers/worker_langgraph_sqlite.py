"""The workload on LangGraph with its SQLite checkpointer, for bench/bench_durable.py.

LangGraph's prebuilt ReAct agent (`create_react_agent`, as in peer_langgraph.py,
whose scripted chat model this reuses) with `AsyncSqliteSaver`
(langgraph-checkpoint-sqlite, over aiosqlite) as its checkpointer: every run is
a new thread, checkpointed at each super-step, with its pending writes.

It is not a peer of `make bench-peers` (hence not `peer_*.py`): it runs in
`bench/.venvs/langgraph_sqlite` (make bench-durable builds it from
requirements-langgraph_sqlite.txt) as a worker that bench_durable.py drives
over stdin and stdout, one JSON object a line each way, so that its rounds
alternate with the agentfsm rounds in the other process:

- `{"op": "round", "runs": n}`: n sequential runs on a fresh database; replies
  `{"wall_us": ..., "cpu_us": ...}` per run (opening the database and building
  the agent are outside the timed region, as agentfsm's runtime setup is);
- `{"op": "count", "runs": n}`: n runs on a fresh database, counting the
  commits made during them and the bytes of the rows they left (the
  serialized checkpoints, their metadata and the pending writes' values);
  replies `{"commits": ..., "bytes": ..., "checkpoints": ..., "writes": ...}`
  per run;
- `{"op": "quit"}`.

Both databases get `PRAGMA synchronous=NORMAL`, agentfsm's default: aiosqlite
leaves SQLite's own default, FULL, which in WAL mode syncs the log at every
commit (~4 ms a commit on this VM), and that would measure the disk rather
than the framework. `--check` does a few runs and prints the counts.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from harness import ANSWER, PROMPT, TOOL_CALLS, Counter
from langchain_core.messages import ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from peer_langgraph import ScriptedChatModel

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # create_react_agent is deprecated in langgraph 1.x
    from langgraph.prebuilt import create_react_agent

counter = Counter()


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    counter.n += 1
    return a + b


MODEL = ScriptedChatModel()


@asynccontextmanager
async def durable_agent(path: Path) -> AsyncIterator[tuple[Any, AsyncSqliteSaver]]:
    """The agent with a checkpointer on a new database at `path`."""
    async with AsyncSqliteSaver.from_conn_string(str(path)) as saver:
        await saver.conn.execute("PRAGMA synchronous=NORMAL")
        await saver.setup()  # WAL mode and the tables, before any timed run
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            agent = create_react_agent(MODEL, [add], checkpointer=saver)
        yield agent, saver


async def one(agent: Any) -> None:
    # A thread per run: each run is a new conversation, as each agentfsm loop is.
    config = {"configurable": {"thread_id": str(uuid.uuid4())}}
    before = counter.n
    state = await agent.ainvoke({"messages": [("user", PROMPT)]}, config)
    messages = state["messages"]
    assert messages[-1].content == ANSWER, messages[-1]
    outputs = [m.content for m in messages if isinstance(m, ToolMessage)]
    assert outputs == ["3", "6", "10"], outputs
    assert counter.n - before == TOOL_CALLS, counter.n - before


class Databases:
    """A fresh database file per round, in one temporary directory."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="bench-langgraph-sqlite-")
        self._n = 0

    def next(self) -> Path:
        self._n += 1
        return Path(self._dir.name) / f"round{self._n}.db"

    def close(self) -> None:
        self._dir.cleanup()


async def timed_round(dbs: Databases, runs: int) -> dict[str, float]:
    async with durable_agent(dbs.next()) as (agent, _saver):
        await one(agent)  # the first run of a database compiles its statements
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(runs):
            await one(agent)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall_us": wall / runs * 1e6, "cpu_us": cpu / runs * 1e6}


async def counted(dbs: Databases, runs: int) -> dict[str, float]:
    async with durable_agent(dbs.next()) as (agent, saver):
        commits = 0
        commit = saver.conn.commit

        async def counting_commit() -> None:
            nonlocal commits
            commits += 1
            await commit()

        saver.conn.commit = counting_commit  # type: ignore[method-assign]
        for _ in range(runs):
            await one(agent)
        # Every run is a thread of its own, and its rows stay: what is in the
        # tables is what the runs wrote (INSERT OR REPLACE rewrites a row only
        # within one task's writes, which a run makes once each).
        async with saver.conn.execute(
            "SELECT count(*), sum(length(checkpoint) + length(metadata)) FROM checkpoints"
        ) as cur:
            checkpoints, checkpoint_bytes = await cur.fetchone()  # type: ignore[misc]
        async with saver.conn.execute(
            "SELECT count(*), sum(length(value)) FROM writes"
        ) as cur:
            writes, write_bytes = await cur.fetchone()  # type: ignore[misc]
    return {
        "commits": commits / runs,
        "bytes": (checkpoint_bytes + write_bytes) / runs,
        "checkpoints": checkpoints / runs,
        "writes": writes / runs,
    }


async def serve() -> None:
    dbs = Databases()
    try:
        await timed_round(dbs, 20)  # warm-up: imports, first uses
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] == "quit":
                break
            if request["op"] == "round":
                reply = await timed_round(dbs, request["runs"])
            elif request["op"] == "count":
                reply = await counted(dbs, request["runs"])
            else:
                raise ValueError(f"unknown op {request['op']!r}")
            print(json.dumps(reply), flush=True)
    finally:
        dbs.close()


async def check() -> None:
    dbs = Databases()
    try:
        print(json.dumps(await timed_round(dbs, 3)))
        print(json.dumps(await counted(dbs, 3)))
    finally:
        dbs.close()


if __name__ == "__main__":
    asyncio.run(check() if "--check" in sys.argv[1:] else serve())
