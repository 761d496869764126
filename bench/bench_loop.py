"""Overhead of one agentfsm loop against a bare asyncio loop doing the same work.

The workload: one user message; the model asks for `add(a, b)` three times (one
call per model turn), then answers "10"; the tool returns a + b. That is 4 model
calls and 3 tool calls per run, with a zero-latency scripted model, so what is
measured is the runtime's own overhead.

- agentfsm: `Runtime.run_loop` + `Runtime.wait`, a `ScriptedProvider` and an
  async `@agentfsm.tool`, with nobody subscribed to the bus (as the bare loop
  publishes nothing); then again with one bus subscriber draining every event.
- bare: the same turns by hand on plain asyncio (a list of dict messages, an
  async scripted "model", `json.loads` of the arguments, `await add(...)`), each
  run in its own task that the caller awaits (agentfsm's loops are background
  tasks too).

Printed: CPU µs per run (median of REPEATS x RUNS sequential runs, after a
warm-up), the ratio agentfsm / bare, and the traced memory per loop with
CONCURRENT loops in flight at once. The last line is machine-readable:
`ratio_vs_floor=<x> kb_per_concurrent_loop=<y> ratio_with_subscriber=<z>
kb_with_subscriber=<w>` (x and y with nobody subscribed). See bench/README.md.

Run with `make bench` (or `.venv/bin/python bench/bench_loop.py`); add `--profile`
to run only the agentfsm loop for ~20 s, under a profiler.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.lowlevel
import structlog

import agentfsm
from agentfsm import InferenceInput, InferenceOutput, ModelContext
from agentfsm.testing import ScriptedProvider, call, calls, text

# The workload and the bare floor are the peer benchmark's (bench/peers/harness.py,
# plain Python, so that every peer's venv can run it): one copy for both.
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from harness import (
    ANSWER,
    MODEL_CALLS,
    PROMPT,
    TOOL_CALLS,
    bare_loop,
    bare_model,
    bare_model_checkpoint,
)

# agentfsm logs decisions and loop ends; an unconfigured structlog prints them.
# Configured as structlog's performance notes advise for production: a
# filtering wrapper class, and loggers assembled once instead of on every use.
structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    cache_logger_on_first_use=True,
)

RUNS: Final = 2_000
"""Sequential runs per timed repetition."""
REPEATS: Final = 7
"""Timed repetitions; the median is reported."""
WARMUP_RUNS: Final = 500
CONCURRENT: Final = 2_000
"""Loops in flight at once for the memory measurement."""

EVENTS_PER_RUN: Final = 23
"""loop.started, 10 loop.transition, 4 inference.completed, 3 function_call.started,
3 function_call.completed, model.answer, loop.idle."""


# ---------------------------------------------------------------------- agentfsm


@agentfsm.tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def scripted_provider() -> ScriptedProvider:
    # record=False: a recording provider keeps every request (and its context)
    # alive, which would be measured as the runtime's memory.
    return ScriptedProvider(
        [
            calls(call("add", a=1, b=2)),
            calls(call("add", a=3, b=3)),
            calls(call("add", a=6, b=4)),
            text(ANSWER),
        ],
        record=False,
    )


class CheckpointProvider:
    """A `ScriptedProvider` that yields to the event loop once per model call.

    Used for the loops in flight: without a checkpoint an agentfsm loop never
    yields (zero-latency model, async tool), so each loop would run to its end
    before the next one starts and nothing would be in flight together. It
    yields as the bare loop's model and every peer's scripted model do, with
    `asyncio.sleep(0)` (these benchmarks run on asyncio): this is the
    workload's model, not agentfsm, and `anyio.lowlevel.checkpoint()` costs
    ~1.7 µs more per call here, for its backend lookup.
    """

    def __init__(self, inner: ScriptedProvider) -> None:
        self.inner = inner

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        await asyncio.sleep(0)
        return await self.inner.complete(request)

    def stream(self, request: InferenceInput, /) -> Any:
        return self.inner.stream(request)


def inference_input() -> InferenceInput:
    # A fresh context per loop: the loop appends to it.
    return InferenceInput(model="scripted:bench", context=ModelContext(), tools=[add])


def check(result: agentfsm.LoopResult) -> None:
    assert result.outcome is agentfsm.Outcome.answered, result
    assert result.answer is not None
    assert result.answer.content == ANSWER, result.answer
    assert result.tool_calls == TOOL_CALLS, result.tool_calls
    assert result.model_requests == MODEL_CALLS, result.model_requests


async def drain(subscription: agentfsm.Subscription, counter: list[int]) -> None:
    async for _event in subscription:
        counter[0] += 1


async def agentfsm_runs(runs: int, *, subscriber: bool = True) -> float:
    """CPU seconds for `runs` sequential loops (runtime setup and teardown excluded).

    With `subscriber`, one task drains every event of every loop; without, no
    event is built (nobody listens), as when no one watches the loops.
    """
    provider = scripted_provider()
    seen = [0]
    runtime = agentfsm.Runtime(providers={"scripted": provider})
    async with anyio.create_task_group() as tg, runtime:
        if subscriber:
            tg.start_soon(drain, runtime.bus.subscribe("*"), seen)
        start = time.process_time()
        for _ in range(runs):
            loop_id = runtime.run_loop("agent", PROMPT, inference_input())
            check(await runtime.wait(loop_id))
        elapsed = time.process_time() - start
        stats = runtime.bus.statistics()
    if subscriber:
        assert seen[0] == stats.published == runs * EVENTS_PER_RUN, (seen[0], stats)
    assert stats.dropped == 0, stats
    return elapsed


async def agentfsm_concurrent(loops: int, *, subscriber: bool = True) -> int:
    """Traced peak bytes above the baseline with `loops` agentfsm loops in flight."""
    provider = CheckpointProvider(scripted_provider())
    seen = [0]
    runtime = agentfsm.Runtime(providers={"scripted": provider})
    async with anyio.create_task_group() as tg, runtime:
        if subscriber:
            tg.start_soon(drain, runtime.bus.subscribe("*"), seen)
            await anyio.lowlevel.checkpoint()  # let the drain task reach its first wait
        gc.collect()
        tracemalloc.start()
        tracemalloc.reset_peak()
        baseline, _ = tracemalloc.get_traced_memory()
        ids = [
            runtime.run_loop("agent", PROMPT, inference_input()) for _ in range(loops)
        ]
        for loop_id in ids:
            check(await runtime.wait(loop_id))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        stats = runtime.bus.statistics()
    if subscriber:
        assert seen[0] == stats.published == loops * EVENTS_PER_RUN, (seen[0], stats)
    assert stats.dropped == 0, stats
    return peak - baseline


# ---------------------------------------------------------------------- bare floor


async def bare_runs(runs: int) -> float:
    # Each run is a task awaited by the caller: the least that "start a loop in
    # the background, then wait for its result" (run_loop + wait) can cost.
    loop = asyncio.get_running_loop()
    start = time.process_time()
    for _ in range(runs):
        answer, tool_calls = await loop.create_task(bare_loop(PROMPT, bare_model))
        assert answer == ANSWER, answer
        assert tool_calls == TOOL_CALLS, tool_calls
    return time.process_time() - start


async def bare_concurrent(loops: int) -> int:
    results: list[tuple[str, int]] = []

    async def one() -> None:
        results.append(await bare_loop(PROMPT, bare_model_checkpoint))

    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    baseline, _ = tracemalloc.get_traced_memory()
    async with asyncio.TaskGroup() as tg:
        for _ in range(loops):
            tg.create_task(one())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert results == [(ANSWER, TOOL_CALLS)] * loops
    return peak - baseline


# ---------------------------------------------------------------------- main


async def timed() -> tuple[float, float, float]:
    """Median µs per run (bare, agentfsm with one subscriber, agentfsm without) over
    REPEATS x RUNS, after a warm-up.

    The repetitions alternate, so a change in the machine's speed during the
    benchmark (shared 2-core VMs drift by +-30%) hits all three.
    """
    await bare_runs(WARMUP_RUNS)
    await agentfsm_runs(WARMUP_RUNS)
    await agentfsm_runs(WARMUP_RUNS, subscriber=False)
    bare: list[float] = []
    fsm: list[float] = []
    quiet: list[float] = []
    for _ in range(REPEATS):
        gc.collect()
        bare.append(await bare_runs(RUNS) / RUNS * 1e6)
        gc.collect()
        fsm.append(await agentfsm_runs(RUNS) / RUNS * 1e6)
        gc.collect()
        quiet.append(await agentfsm_runs(RUNS, subscriber=False) / RUNS * 1e6)
    return statistics.median(bare), statistics.median(fsm), statistics.median(quiet)


async def profile_target(seconds: float = 20.0) -> None:
    """Only agentfsm runs, for a profiler: `py-spy record -- ... --profile`."""
    await agentfsm_runs(WARMUP_RUNS)
    total = runs = 0.0
    while total < seconds:
        total += await agentfsm_runs(RUNS)
        runs += RUNS
    print(f"agentfsm {total / runs * 1e6:.1f} µs/run over {runs:,.0f} runs")


async def main() -> None:
    print(f"python {sys.version.split()[0]}, asyncio, agentfsm {agentfsm.__version__}")
    print(f"workload: {MODEL_CALLS} model calls + {TOOL_CALLS} tool calls per run")
    print(f"cpu: median of {REPEATS} x {RUNS:,} sequential runs (process_time)")

    bare_us, observed_us, fsm_us = await timed()
    ratio = fsm_us / bare_us
    observed_ratio = observed_us / bare_us
    print(f"  bare asyncio  {bare_us:8.1f} µs/run")
    print(f"  agentfsm      {fsm_us:8.1f} µs/run   ({ratio:.1f}x the floor)")
    print(
        f"  agentfsm      {observed_us:8.1f} µs/run   ({observed_ratio:.1f}x the floor)"
        "   with one subscriber receiving every event"
    )

    print(f"memory: traced peak - baseline, {CONCURRENT:,} loops in flight at once")
    bare_kb = await bare_concurrent(CONCURRENT) / CONCURRENT / 1024
    fsm_kb = await agentfsm_concurrent(CONCURRENT, subscriber=False) / CONCURRENT / 1024
    observed_kb = await agentfsm_concurrent(CONCURRENT) / CONCURRENT / 1024
    print(f"  bare asyncio  {bare_kb:8.1f} KB/loop")
    print(f"  agentfsm      {fsm_kb:8.1f} KB/loop")
    print(f"  agentfsm      {observed_kb:8.1f} KB/loop   with one subscriber")

    print(
        f"ratio_vs_floor={ratio:.1f} kb_per_concurrent_loop={fsm_kb:.1f} "
        f"ratio_with_subscriber={observed_ratio:.1f} "
        f"kb_with_subscriber={observed_kb:.1f}"
    )


if __name__ == "__main__":
    asyncio.run(profile_target() if "--profile" in sys.argv[1:] else main())
