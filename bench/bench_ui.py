"""How live the live view is: `agentfsm ui` watching loops another process runs.

A runtime in this process runs loops on a SQLite store that keeps events
(each loop: 6 tool calls of an async tool that sleeps 50 ms, then an answer,
on a zero-latency scripted model), keeping N loops in flight, while
`agentfsm ui` serves the store from a process of its own. Clients in this
process hold the streams a browser would: the loops list, and the pages of
`--watched` loops of those in flight. For each timeline row a loop page
receives, the latency is the time it arrived minus the time of its event (the
runtime's clock, taken as the event is published, just before its commit:
the figure includes the commit). The loops list's latency is the time from a
loop's end (its record's `ended_at`) to the list showing it done.

Printed, at 10 and at 1,000 loops in flight: the median and p99 of both
latencies, the events committed, and the server's CPU time per 1,000 events
committed (user + system, read from /proc). The last line is
`ui_p50_ms=<x> ui_p99_ms=<y> ui_cpu_ms_per_1000_events=<z>` for 1,000 loops.

`--quick`: a smoke run (10 and 100 loops, shorter). Run with `make bench-ui`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import httpx2

from agentfsm import InferenceInput, InferenceOutput, ModelContext, Runtime, tool
from agentfsm.messages import FunctionCallOutputItem
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import SQLiteStore
from agentfsm.testing import call, calls, text

TOKEN = "bench-ui-token-0123456789"
CALLS = 6

TOOL_SECONDS = 0.05


@tool
async def work(step: int) -> int:
    """One step of work."""
    await anyio.sleep(TOOL_SECONDS)
    return step


def model(request: InferenceInput) -> InferenceOutput:
    """Each loop's model: a call of `work` until it has CALLS outputs, then
    the answer (by what its context holds, so one provider serves every
    loop)."""
    done = sum(isinstance(i, FunctionCallOutputItem) for i in request.context.items)
    if done < CALLS:
        return calls(call("work", call_id=f"c{done}", step=done))
    return text("done")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


@contextlib.contextmanager
def server(db: Path, poll: float) -> Any:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentfsm",
            "ui",
            str(db),
            "--port",
            "0",
            "--token",
            TOKEN,
            "--poll",
            str(poll),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/", process.stdout.readline())
        if match is None:
            raise RuntimeError(process.communicate(timeout=30))
        yield process, f"http://127.0.0.1:{match.group(1)}"
    finally:
        process.terminate()
        process.communicate(timeout=30)


async def events_of(
    http: httpx2.AsyncClient, url: str
) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """`(arrival time, data)` of each server-sent event of `url`."""
    headers = {"authorization": f"Bearer {TOKEN}"}
    async with http.stream("GET", url, headers=headers) as answer:
        data = ""
        async for line in answer.aiter_lines():
            if line.startswith("data:"):
                data += line[5:].strip()
            elif not line and data:
                yield time.time(), json.loads(data)
                data = ""


def ts(text_: str) -> float:
    return datetime.fromisoformat(text_).timestamp()


async def run(in_flight: int, total: int, watched: int, poll: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "ui.db"
        async with SQLiteStore(db, events=True):
            pass
        row_latency: list[float] = []
        list_latency: list[float] = []
        done_at: dict[str, float] = {}
        with server(db, poll) as (process, base):
            store = SQLiteStore(db, events=True)
            async with (
                Runtime(
                    providers={"f": FunctionProvider(model)}, store=store
                ) as runtime,
                httpx2.AsyncClient(timeout=None) as http,
                anyio.create_task_group() as tg,
            ):
                cpu_before = cpu_seconds(process.pid)

                async def watch_page(loop_id: str) -> None:
                    url = f"{base}/api/stream/loops/{loop_id}"
                    async for arrived, page in events_of(http, url):
                        if "rows" not in page:
                            continue  # not in the store yet
                        for row in page["rows"]:
                            event = row["event"]
                            if event is not None:
                                row_latency.append(arrived - ts(event["ts"]))
                        if page["summary"]["status"] == "done":
                            return

                listed_all = anyio.Event()

                async def watch_list() -> None:
                    seen: set[str] = set()
                    async for arrived, data in events_of(
                        http, f"{base}/api/stream/loops"
                    ):
                        for loop in data["loops"]:
                            loop_id = loop["loop_id"]
                            if loop["status"] == "done" and loop_id not in seen:
                                seen.add(loop_id)
                                list_latency.append(arrived - ts(loop["ended_at"]))
                        if len(seen) == total:
                            listed_all.set()
                            return

                tg.start_soon(watch_list)
                slots = anyio.Semaphore(in_flight)

                async def one(n: int) -> None:
                    async with slots:
                        request = InferenceInput(
                            model="f:m",
                            context=ModelContext(),
                            tools=(work,),
                        )
                        loop_id = runtime.run_loop("bench", "go", request)
                        if n < watched:
                            tg.start_soon(watch_page, loop_id)
                        result = await runtime.wait(loop_id)
                        assert result.ended_at is not None
                        done_at[loop_id] = result.ended_at.timestamp()

                async with anyio.create_task_group() as loops:
                    for n in range(total):
                        loops.start_soon(one, n)
                with anyio.fail_after(300):
                    await listed_all.wait()
                cpu = cpu_seconds(process.pid) - cpu_before
                events = 0
                for loop_id in done_at:
                    events += len(await store.events(loop_id))
                tg.cancel_scope.cancel()
        return {
            "in_flight": in_flight,
            "loops": total,
            "rows": len(row_latency),
            "row_p50_ms": 1000 * statistics.median(row_latency),
            "row_p99_ms": 1000 * quantile(row_latency, 0.99),
            "list_p50_ms": 1000 * statistics.median(list_latency),
            "list_p99_ms": 1000 * quantile(list_latency, 0.99),
            "events": events,
            "cpu_ms_per_1000_events": 1000 * cpu * 1000 / max(events, 1),
        }


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--poll", type=float, default=0.2)
    parser.add_argument("--watched", type=int, default=10)
    args = parser.parse_args()
    sizes = [(10, 40), (100, 200)] if args.quick else [(10, 100), (1000, 2000)]
    results = [
        anyio.run(run, in_flight, total, args.watched, args.poll)
        for in_flight, total in sizes
    ]
    print(
        f"{'in flight':>9} {'loops':>6} {'rows':>6} {'row p50':>9} {'row p99':>9} "
        f"{'list p50':>9} {'list p99':>9} {'events':>8} {'server CPU/1k events':>21}"
    )
    for r in results:
        print(
            f"{r['in_flight']:>9} {r['loops']:>6} {r['rows']:>6} "
            f"{r['row_p50_ms']:>7.0f}ms {r['row_p99_ms']:>7.0f}ms "
            f"{r['list_p50_ms']:>7.0f}ms {r['list_p99_ms']:>7.0f}ms "
            f"{r['events']:>8} {r['cpu_ms_per_1000_events']:>18.0f}ms"
        )
    last = results[-1]
    print(
        f"ui_p50_ms={last['row_p50_ms']:.0f} ui_p99_ms={last['row_p99_ms']:.0f} "
        f"ui_cpu_ms_per_1000_events={last['cpu_ms_per_1000_events']:.0f}"
    )


if __name__ == "__main__":
    main()
