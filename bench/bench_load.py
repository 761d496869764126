"""Load: many loops at once, many in a row, many pauses (issue 12's load tests).

- concurrent: 10,000 loops of the benchmark workload in flight at once in one
  runtime; each ends `answered`.
- in a row: 100,000 loops one after another in one runtime (`keep_finished=0`,
  so the runtime keeps no results); the traced memory after 10,000 and after
  100,000 loops, and the growth per loop between them (bounded: ~0 B a loop).
- pauses: 1,000 loops paused by a handler, resumed, each ends `answered`.

Each prints its figures and the wall time; it asserts what must hold (every
loop answered), never a time. Run with `make bench-load` (~1-2 minutes).
"""

from __future__ import annotations

import gc
import time
import tracemalloc

import anyio
import anyio.lowlevel
from bench_loop import check, inference_input, scripted_provider

from agentfsm import LoopStatus, Pause, PendingTransition, Runtime, Trigger

CONCURRENT = 10_000
IN_A_ROW = 100_000
MEASURE_AT = 10_000
PAUSES = 1_000


async def concurrent() -> None:
    started = time.perf_counter()
    async with Runtime(providers={"scripted": scripted_provider()}) as runtime:
        ids = [
            runtime.run_loop("agent", "what is 1+2+3+4?", inference_input())
            for _ in range(CONCURRENT)
        ]
        for loop_id in ids:
            check(await runtime.wait(loop_id))
    took = time.perf_counter() - started
    print(
        f"concurrent: {CONCURRENT:,} loops in flight at once, all answered, {took:.1f} s"
    )


async def in_a_row() -> None:
    started = time.perf_counter()
    marks: dict[int, int] = {}
    tracemalloc.start()
    async with Runtime(
        providers={"scripted": scripted_provider()}, keep_finished=0
    ) as runtime:
        for n in range(1, IN_A_ROW + 1):
            check(
                await runtime.wait(runtime.run_loop("agent", "go", inference_input()))
            )
            if n in (MEASURE_AT, IN_A_ROW):
                gc.collect()
                marks[n] = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    took = time.perf_counter() - started
    growth = (marks[IN_A_ROW] - marks[MEASURE_AT]) / (IN_A_ROW - MEASURE_AT)
    print(
        f"in a row: {IN_A_ROW:,} loops, traced memory {marks[MEASURE_AT] / 1e6:.2f} MB "
        f"after {MEASURE_AT:,}, {marks[IN_A_ROW] / 1e6:.2f} MB after {IN_A_ROW:,}: "
        f"{growth:+.2f} B a loop, {took:.1f} s"
    )


async def pauses() -> None:
    def pause_tools(pending: PendingTransition) -> Pause | None:
        if pending.trigger is Trigger.call_tools and pending.tool_calls == 0:
            return Pause(reason="check")
        return None

    started = time.perf_counter()
    async with Runtime(providers={"scripted": scripted_provider()}) as runtime:
        ids = [
            runtime.run_loop("agent", "go", inference_input(), pause_tools)
            for _ in range(PAUSES)
        ]
        await anyio.wait_all_tasks_blocked()  # every loop has paused (or ended)
        assert all(runtime.get(i).status is LoopStatus.paused for i in ids)
        for loop_id in ids:
            runtime.resume(loop_id)
        for loop_id in ids:
            check(await runtime.wait(loop_id))
    took = time.perf_counter() - started
    print(f"pauses: {PAUSES:,} loops paused, resumed, all answered, {took:.1f} s")


async def main() -> None:
    await concurrent()
    await pauses()
    await in_a_row()


if __name__ == "__main__":
    anyio.run(main)
