"""How agentfsm's cost grows: context, tool calls per turn, loops, paused loops, bus.

Each section prints a small table of cost against size (`make bench` runs this
after bench_loop.py; `--only context,tools,...` runs some sections). The
workload is bench_loop.py's (one message, `add` three times, then "10") unless a
section says otherwise; CPU is `time.process_time()`, memory is tracemalloc.

- context: µs per run with 10 → 10,000 items already in the context before the
  loop starts, agentfsm and Apache Burr side by side (Burr in its venv,
  `bench/.venvs/burr`, through `bench/peers/peer_burr.py --context`). The items
  are user message / function call / function output / model message quads.
- turns: one loop of 10 → 1,000 turns (a tool call each, then the answer), so
  the context grows inside the loop; µs per turn.
- tools: one turn asking for 1 → 100 calls, then the answer; sequential
  and `tool_execution="parallel"` (default cap of 8 at once), with `add`
  (which never waits) and with a tool that yields to the event loop once.
- loops: 1 → 10,000 loops in flight at once in one process (the model yields
  once per call, so they interleave); µs and traced KB per loop.
- retained: the same runs after 0 → 10,000 finished loops are kept by the
  runtime for `wait` (its `keep_finished` store, full at 10,000 by default);
  CPU µs per run and the part spent in the garbage collector.
- paused: 1,000 → 100,000 loops paused at once by a handler returning
  `Pause(...)` at the start transition; traced KB per paused loop, how many
  loops hold a task while they wait (none should) and how many tasks are alive
  (the benchmark's own and the idle workers), then µs per loop to resume them
  all to their answer.
- bus: events per second from `bus.publish_nowait` through each subscriber's
  buffer to its `async for`, with 1, 10 and 100 subscribers.

See bench/README.md for the figures and what they mean.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final, Self

import anyio
import anyio.lowlevel
from bench_loop import (
    ANSWER,
    EVENTS_PER_RUN,
    PROMPT,
    CheckpointProvider,
    add,
    check,
    drain,
    scripted_provider,
)

import agentfsm
from agentfsm import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    LoopState,
    LoopStatus,
    ModelContext,
    ModelMessageItem,
    Pause,
    PendingTransition,
    Trigger,
    UserMessage,
)
from agentfsm.events import LoopTransition
from agentfsm.testing import ScriptedProvider, call, calls, text

BENCH: Final = Path(__file__).resolve().parent
BURR_PYTHON: Final = BENCH / ".venvs" / "burr" / "bin" / "python"

CONTEXT_SIZES: Final = (10, 100, 1_000, 10_000)
TURNS: Final = (10, 100, 1_000)
TOOLS_PER_TURN: Final = (1, 10, 100)
LOOPS: Final = (1, 10, 100, 1_000, 10_000)
PAUSED: Final = (1_000, 10_000, 100_000)
RETAINED: Final = (0, 4_000, 10_000)
SUBSCRIBERS: Final = (1, 10, 100)
ROUND_SECONDS: Final = 0.3
ROUNDS: Final = 3


def table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  " + "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for r in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


async def per_run_us(run: Callable[[], Awaitable[None]]) -> float:
    """Median CPU µs per run over ROUNDS rounds of ~ROUND_SECONDS each."""
    for _ in range(20):  # warm-up
        await run()
    gc.collect()
    start = time.process_time()
    await run()
    probe = time.process_time() - start
    runs = max(3, min(2_000, round(ROUND_SECONDS / max(probe, 1e-6))))
    samples = []
    for _ in range(ROUNDS):
        gc.collect()
        start = time.process_time()
        for _ in range(runs):
            await run()
        samples.append((time.process_time() - start) / runs * 1e6)
    return statistics.median(samples)


# ---------------------------------------------------------------------- context


def context_items(n: int) -> list[Any]:
    """`n` items: user message, function call, its output, model message, repeated."""
    items: list[Any] = []
    for i in range(n):
        k, q = divmod(i, 4)
        if q == 0:
            items.append(UserMessage(content=f"question {k}"))
        elif q == 1:
            items.append(
                FunctionCallItem(
                    call_id=f"old_{k}", name="add", arguments='{"a":1,"b":2}'
                )
            )
        elif q == 2:
            items.append(FunctionCallOutputItem(call_id=f"old_{k}", output="3"))
        else:
            items.append(ModelMessageItem(content=f"answer {k}"))
    return items


async def agentfsm_context(sizes: tuple[int, ...]) -> dict[int, float]:
    out = {}
    async with agentfsm.Runtime(providers={"scripted": scripted_provider()}) as runtime:
        for size in sizes:
            base = context_items(size)

            async def run(base: list[Any] = base) -> None:
                # A copy of the items list per run (the loop appends to it); the
                # items themselves are shared. Copying is part of the figure
                # (~1 µs per 1,000 items).
                request = InferenceInput(
                    model="scripted:bench",
                    context=ModelContext.model_construct(items=list(base)),
                    tools=[add],
                )
                result = await runtime.wait(runtime.run_loop("agent", PROMPT, request))
                check(result)

            out[size] = await per_run_us(run)
    return out


def burr_context(sizes: tuple[int, ...]) -> dict[int, float] | str:
    if not BURR_PYTHON.exists():
        return f"{BURR_PYTHON} missing (make bench-peers or make bench creates it)"
    cmd = [
        str(BURR_PYTHON),
        str(BENCH / "peers" / "peer_burr.py"),
        "--context",
        ",".join(map(str, sizes)),
        str(ROUND_SECONDS),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.splitlines()[-1]).items()}


async def section_context() -> None:
    print("\nper-run cost as the context grows (items in the context before the loop)")
    fsm = await agentfsm_context(CONTEXT_SIZES)
    burr = burr_context(CONTEXT_SIZES)
    rows = []
    for size in CONTEXT_SIZES:
        row = [
            f"{size:,}",
            f"{fsm[size]:,.0f}",
            f"{fsm[size] / fsm[CONTEXT_SIZES[0]]:.2f}",
        ]
        if isinstance(burr, dict):
            b = burr[size]
            row += [
                f"{b:,.0f}",
                f"{b / burr[CONTEXT_SIZES[0]]:.1f}",
                f"{b / fsm[size]:.1f}",
            ]
        rows.append(row)
    headers = ["items", "agentfsm µs/run", "x at 10"]
    if isinstance(burr, dict):
        headers += ["Burr µs/run", "x at 10", "Burr / agentfsm"]
    table(headers, rows)
    if not isinstance(burr, dict):
        print(f"  Burr: skipped, {burr}")
    lo, hi = CONTEXT_SIZES[-2], CONTEXT_SIZES[-1]
    slope = (fsm[hi] - fsm[lo]) / (hi - lo) * 1e3
    print(
        f"  agentfsm: +{slope:.1f} µs per 1,000 more items (between {lo:,} and {hi:,})"
    )


async def section_turns() -> None:
    print("\nturns per loop: the context grows inside the loop (2 items per turn)")
    rows = []
    for turns in TURNS:
        provider = ScriptedProvider(
            [*(calls(call("add", a=i, b=1)) for i in range(turns)), text(ANSWER)],
            record=False,
        )
        async with agentfsm.Runtime(providers={"scripted": provider}) as runtime:

            async def run(turns: int = turns) -> None:
                request = InferenceInput(
                    model="scripted:bench", context=ModelContext(), tools=[add]
                )
                loop_id = runtime.run_loop(
                    "agent", PROMPT, request, max_turns=turns + 1
                )
                result = await runtime.wait(loop_id)
                assert result.tool_calls == turns, result.tool_calls
                assert len(request.context.items) == 2 * turns + 2

            us = await per_run_us(run)
        rows.append([f"{turns:,}", f"{us:,.0f}", f"{us / turns:,.1f}"])
    table(["turns", "µs/run", "µs/turn"], rows)


# ---------------------------------------------------------------------- tools


@agentfsm.tool
async def add_after_wait(a: int, b: int) -> int:
    """Add two integers, after yielding to the event loop once."""
    await asyncio.sleep(0)
    return a + b


async def section_tools() -> None:
    print(
        "\ntool calls per turn: one turn asking for k calls, then the answer; `add`"
        " (never waits) and `add_after_wait` (yields once); x = parallel / sequential"
    )
    rows = []
    for tool in (add, add_after_wait):
        for k in TOOLS_PER_TURN:
            seq, par = await tools_per_turn(tool, k)
            rows.append(
                [
                    tool.name,
                    f"{k}",
                    f"{seq:,.0f}",
                    f"{seq / k:,.1f}",
                    f"{par:,.0f}",
                    f"{par / k:,.1f}",
                    f"{par / seq:.2f}",
                ]
            )
    table(
        [
            "tool",
            "calls/turn",
            "sequential µs/run",
            "µs/call",
            "parallel µs/run",
            "µs/call",
            "x",
        ],
        rows,
    )


async def tools_per_turn(tool: agentfsm.Tool, k: int) -> tuple[float, float]:
    """CPU µs a run, sequential and parallel, of one turn of `k` calls of `tool`."""
    provider = ScriptedProvider(
        [calls(*(call(tool.name, a=i, b=1) for i in range(k))), text(ANSWER)],
        record=False,
    )
    figures = []
    async with agentfsm.Runtime(providers={"scripted": provider}) as runtime:
        for mode in ("sequential", "parallel"):

            async def run(mode: Any = mode) -> None:
                context = ModelContext()
                request = InferenceInput(
                    model="scripted:bench", context=context, tools=[tool]
                )
                loop_id = runtime.run_loop(
                    "agent", PROMPT, request, tool_execution=mode
                )
                result = await runtime.wait(loop_id)
                assert result.answer is not None
                assert result.answer.content == ANSWER
                assert result.tool_calls == k, result.tool_calls
                outputs = [i for i in context.items if i.type == "function_call_output"]
                assert [o.output for o in outputs] == [str(i + 1) for i in range(k)]

            figures.append(await per_run_us(run))
    seq, par = figures
    return seq, par


# ---------------------------------------------------------------------- loops


async def loops_in_flight(n: int, traced: bool) -> float:
    """CPU µs per loop (or traced KB per loop) with `n` loops started at once."""
    provider = CheckpointProvider(scripted_provider())
    seen = [0]
    runtime = agentfsm.Runtime(providers={"scripted": provider}, keep_finished=n)
    async with anyio.create_task_group() as tg, runtime:
        tg.start_soon(
            drain, runtime.bus.subscribe("*", buffer=n * EVENTS_PER_RUN), seen
        )
        await anyio.lowlevel.checkpoint()
        gc.collect()
        if traced:
            tracemalloc.start()
            baseline, _ = tracemalloc.get_traced_memory()
        start = time.process_time()
        ids = []
        for _ in range(n):
            request = InferenceInput(
                model="scripted:bench", context=ModelContext(), tools=[add]
            )
            ids.append(runtime.run_loop("agent", PROMPT, request))
        for loop_id in ids:
            check(await runtime.wait(loop_id))
        elapsed = time.process_time() - start
        if traced:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        stats = runtime.bus.statistics()
    assert seen[0] == stats.published == n * EVENTS_PER_RUN, (seen[0], stats)
    if traced:
        return (peak - baseline) / n / 1024
    return elapsed / n * 1e6


async def section_loops() -> None:
    print("\nloops in flight at once in one process (each yields once per model call)")
    await loops_in_flight(1_000, False)  # warm-up
    rows = []
    for n in LOOPS:
        rounds = 5 if n <= 1_000 else 1
        cpu = statistics.median(
            [await loops_in_flight(n, False) for _ in range(rounds)]
        )
        kb = await loops_in_flight(n, True)
        rows.append([f"{n:,}", f"{cpu:,.0f}", f"{kb:.1f}", "yes"])
    table(["loops", "µs/loop", "KB/loop", "all answered"], rows)


# ---------------------------------------------------------------------- retained


class GcClock:
    """CPU seconds spent in the garbage collector while installed."""

    def __init__(self) -> None:
        self.spent = 0.0
        self.full = 0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.spent += time.process_time() - self._start
            self.full += info["generation"] == 2

    def __enter__(self) -> Self:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


async def with_retained(prefill: int, n: int, burst: bool) -> tuple[float, float, int]:
    """(µs/run, GC µs/run, full collections) for n runs after `prefill` finished loops."""
    providers = {
        "scripted": scripted_provider(),
        "checkpoint": CheckpointProvider(scripted_provider()),
    }
    runtime = agentfsm.Runtime(providers=providers)
    async with anyio.create_task_group() as tg, runtime:
        tg.start_soon(drain, runtime.bus.subscribe("*"), [0])
        await anyio.lowlevel.checkpoint()

        def start(model: str) -> str:
            request = InferenceInput(model=model, context=ModelContext(), tools=[add])
            return runtime.run_loop("agent", PROMPT, request)

        for chunk in range(0, prefill, 1_000):
            ids = [
                start("checkpoint:bench") for _ in range(min(1_000, prefill - chunk))
            ]
            for loop_id in ids:
                check(await runtime.wait(loop_id))
        gc.collect()
        with GcClock() as clock:
            begin = time.process_time()
            if burst:
                ids = [start("checkpoint:bench") for _ in range(n)]
                for loop_id in ids:
                    check(await runtime.wait(loop_id))
            else:
                for _ in range(n):
                    check(await runtime.wait(start("scripted:bench")))
            elapsed = time.process_time() - begin
    return elapsed / n * 1e6, clock.spent / n * 1e6, clock.full


async def section_retained() -> None:
    print(
        "\nfinished loops the runtime keeps for wait() (keep_finished=10,000 by"
        " default)\n  before 2,000 more runs, sequential and all in flight at once"
    )
    rows = []
    for prefill in RETAINED:
        row = [f"{prefill:,}"]
        for burst in (False, True):
            samples = [await with_retained(prefill, 2_000, burst) for _ in range(3)]
            us, gc_us, full = sorted(samples)[1]
            row += [f"{us:,.0f}", f"{gc_us:,.0f}", f"{full}"]
        rows.append(row)
    table(
        [
            "kept",
            "seq µs/run",
            "of which GC",
            "full GCs",
            "2,000 in flight µs/run",
            "of which GC",
            "full GCs",
        ],
        rows,
    )


# ---------------------------------------------------------------------- paused


class PauseAtStart:
    """Pauses every loop at its start transition; `all_paused` is set after `n`."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.all_paused = anyio.Event()

    def __call__(self, pending: PendingTransition) -> Pause | None:
        if pending.trigger is not Trigger.start:
            return None
        self.left -= 1
        if not self.left:
            self.all_paused.set()
        return Pause("held for the benchmark")


async def paused(n: int) -> tuple[float, int, int, float, float]:
    """(traced KB per paused loop, loops holding a task and tasks alive while
    paused, µs/loop to pause, to resume)."""
    runtime = agentfsm.Runtime(
        providers={"scripted": scripted_provider()}, keep_finished=n
    )
    async with runtime:
        await anyio.lowlevel.checkpoint()
        gc.collect()
        tracemalloc.start()
        baseline, _ = tracemalloc.get_traced_memory()
        handler = PauseAtStart(n)
        start = time.process_time()
        ids = []
        for _ in range(n):
            request = InferenceInput(
                model="scripted:bench", context=ModelContext(), tools=[add]
            )
            ids.append(runtime.run_loop("agent", PROMPT, request, handler))
        await handler.all_paused.wait()
        await anyio.lowlevel.checkpoint()  # let the last loop park
        assert runtime.loops(status=LoopStatus.paused) == ids
        pause_us = (time.process_time() - start) / n * 1e6
        gc.collect()
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        running = runtime._running  # loops holding a (worker) task
        tasks = len(asyncio.all_tasks())  # this one, and workers kept idle for reuse
        start = time.process_time()
        for loop_id in ids:
            runtime.resume(loop_id)
        for loop_id in ids:
            check(await runtime.wait(loop_id))
        resume_us = (time.process_time() - start) / n * 1e6
    return (current - baseline) / n / 1024, running, tasks, pause_us, resume_us


async def section_paused() -> None:
    print("\npaused loops held at once (paused by a handler at the start transition)")
    rows = []
    for n in PAUSED:
        kb, running, tasks, pause_us, resume_us = await paused(n)
        rows.append(
            [
                f"{n:,}",
                f"{kb:.2f}",
                f"{running}",
                f"{tasks}",
                f"{pause_us:,.0f}",
                f"{resume_us:,.0f}",
            ]
        )
    table(
        [
            "paused",
            "KB/paused loop",
            "loops holding a task",
            "tasks alive**",
            "µs/loop to pause*",
            "µs/loop to resume",
        ],
        rows,
    )
    print("  * under tracemalloc, which slows allocation ~2x; resuming runs untraced")
    print("  ** the benchmark's own task and the worker tasks kept idle for reuse")


# ---------------------------------------------------------------------- bus


def make_events(n: int) -> list[LoopTransition]:
    return [
        LoopTransition(
            event_id=f"bench:{i}",
            loop_id="bench",
            agent_id="agent",
            seq=i + 1,
            state=LoopState.inference,
            source=LoopState.context_update,
            trigger=Trigger.infer,
            dest=LoopState.inference,
        )
        for i in range(n)
    ]


async def bus_rate(
    subscribers: int, events: list[LoopTransition], rounds: int
) -> float:
    """Events per second published and received by every subscriber (CPU time)."""
    counts = [0] * subscribers

    async def consume(sub: agentfsm.Subscription, i: int) -> None:
        async for _ in sub:
            counts[i] += 1

    async with agentfsm.Runtime() as runtime:
        bus = runtime.bus
        subs = [bus.subscribe("*", buffer=len(events)) for _ in range(subscribers)]
        async with anyio.create_task_group() as tg:
            for i, sub in enumerate(subs):
                tg.start_soon(consume, sub, i)
            await anyio.lowlevel.checkpoint()
            gc.collect()
            start = time.process_time()
            for _ in range(rounds):
                for event in events:
                    bus.publish_nowait(event)
                while any(sub.statistics().buffered for sub in subs):
                    await anyio.lowlevel.checkpoint()
            elapsed = time.process_time() - start
            for sub in subs:
                sub.close()
    published = rounds * len(events)
    assert counts == [published] * subscribers, (counts, published)
    assert bus.statistics().dropped == 0
    return published / elapsed


async def section_bus() -> None:
    print("\nbus throughput: publish_nowait -> each subscriber's async for")
    events = make_events(1_000)
    rows = []
    for subs in SUBSCRIBERS:
        rounds = max(2, 400 // subs)
        await bus_rate(subs, events, 2)
        rate = statistics.median(
            [await bus_rate(subs, events, rounds) for _ in range(3)]
        )
        rows.append([f"{subs}", f"{rate:,.0f}", f"{rate * subs:,.0f}"])
    table(
        ["subscribers", "events/s published", "events/s delivered (all subscribers)"],
        rows,
    )


# ---------------------------------------------------------------------- main

SECTIONS: Final = {
    "context": section_context,
    "turns": section_turns,
    "tools": section_tools,
    "loops": section_loops,
    "retained": section_retained,
    "paused": section_paused,
    "bus": section_bus,
}


async def main(sections: list[str]) -> None:
    print(f"python {sys.version.split()[0]}, asyncio, agentfsm {agentfsm.__version__}")
    for name in sections:
        await SECTIONS[name]()


if __name__ == "__main__":
    # (bench_loop, imported above, configured structlog to drop debug records.)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated: " + ",".join(SECTIONS))
    args = parser.parse_args()
    asyncio.run(main(args.only.split(",") if args.only else list(SECTIONS)))
