"""What every peer script shares: the workload, the bare floor and the measurements.

Each peer script (`peer_<name>.py`) runs in its own virtual environment, so this
module imports nothing but the standard library. A peer script builds a
`Subject` (one run of the workload through its framework) and calls `main`,
which measures, in this one process:

- CPU µs per run: `time.process_time()` around sequential runs, in ROUNDS rounds
  that alternate with rounds of the bare floor, median reported (so each peer
  has a floor measured in its own process: machine speed drifts between runs);
- the same with CONCURRENT runs in flight at once (the scripted model yields
  once per call, so the runs advance in lockstep), CONCURRENT_ROUNDS rounds
  or more (as many as fit in CONCURRENT_SECONDS, up to MAX_CONCURRENT_ROUNDS),
  each right after a sequential round of its own: "in flight / sequential" is
  the median of these pairs' ratios, which a drift in machine speed between
  the two phases does not bias;
- traced memory per run in flight: tracemalloc peak above the baseline / CONCURRENT;
- import time of the framework: `import ...` timed in fresh subprocesses, each
  kept on one CPU.

The results go to `--json PATH` (read by `run.py`) and a summary to stdout.

The workload (identical in every peer and in `bench/bench_loop.py`): one user
message; the model asks for `add(a, b)` three times, one call per model turn,
then answers "10"; the tool returns a + b. 4 model calls + 3 tool calls per run,
with a zero-latency scripted model. Which step the model is at is read from the
conversation (the number of tool results in it), so concurrent runs never share
a cursor.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field
from typing import Any, Final, TypeAlias

PROMPT: Final = "what is 1+2+3+4?"
ANSWER: Final = "10"
SCRIPT: Final[tuple[tuple[str, dict[str, int]], ...]] = (
    ("add", {"a": 1, "b": 2}),
    ("add", {"a": 3, "b": 3}),
    ("add", {"a": 6, "b": 4}),
)
"""The tool calls the model asks for, one per turn; then it answers ANSWER."""
TOOL_CALLS: Final = len(SCRIPT)
MODEL_CALLS: Final = TOOL_CALLS + 1

CONCURRENT: Final = 2_000
"""Runs in flight at once for the concurrent CPU and the memory figures."""
ROUNDS: Final = 7
CONCURRENT_ROUNDS: Final = 5
"""Pairs of a sequential round and a round in flight, at least."""
MAX_CONCURRENT_ROUNDS: Final = 15
CONCURRENT_SECONDS: Final = 12.0
"""More pairs are taken while the subject's pairs so far took less than this."""
ROUND_SECONDS: Final = 0.4
"""Target CPU seconds of one sequential round (its run count is calibrated)."""
IMPORT_SAMPLES: Final = 5


def script_step(tool_results: int) -> tuple[str, dict[str, int]] | None:
    """The model's reply after `tool_results` tool results: a call, or None to answer."""
    return SCRIPT[tool_results] if tool_results < len(SCRIPT) else None


class Counter:
    """Counts tool calls (each peer's `add` bumps it; `Subject.run` checks it)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


# ---------------------------------------------------------------------- bare floor
# bench/bench_loop.py imports this floor too: agentfsm and the peers meet one floor.

Message: TypeAlias = dict[str, Any]

BARE_SCRIPT: Final[tuple[Message, ...]] = (
    {"tool_calls": [{"id": "call_1", "name": "add", "arguments": '{"a":1,"b":2}'}]},
    {"tool_calls": [{"id": "call_2", "name": "add", "arguments": '{"a":3,"b":3}'}]},
    {"tool_calls": [{"id": "call_3", "name": "add", "arguments": '{"a":6,"b":4}'}]},
    {"content": ANSWER},
)

Model: TypeAlias = Callable[[list[Message], int], Awaitable[Message]]


async def bare_model(messages: list[Message], turn: int) -> Message:
    return BARE_SCRIPT[turn]


async def bare_model_checkpoint(messages: list[Message], turn: int) -> Message:
    await asyncio.sleep(0)
    return BARE_SCRIPT[turn]


async def bare_add(a: int, b: int) -> int:
    return a + b


BARE_TOOLS: Final[dict[str, Callable[..., Awaitable[Any]]]] = {"add": bare_add}


async def bare_loop(prompt: str, model: Model) -> tuple[str, int]:
    """The floor: the same turns by hand; returns (answer, tool calls)."""
    messages: list[Message] = [{"role": "user", "content": prompt}]
    tool_calls = 0
    turn = 0
    while True:
        reply = await model(messages, turn)
        turn += 1
        messages.append({"role": "assistant", **reply})
        requested = reply.get("tool_calls")
        if not requested:
            return reply["content"], tool_calls
        for tc in requested:
            output = await BARE_TOOLS[tc["name"]](**json.loads(tc["arguments"]))
            tool_calls += 1
            messages.append(
                {"role": "tool", "tool_call_id": tc["id"], "content": str(output)}
            )


async def bare_one(checkpoint: bool) -> None:
    # A task per run, awaited by the caller, as in bench_loop.py.
    model = bare_model_checkpoint if checkpoint else bare_model
    answer, tool_calls = await asyncio.get_running_loop().create_task(
        bare_loop(PROMPT, model)
    )
    assert (answer, tool_calls) == (ANSWER, TOOL_CALLS), (answer, tool_calls)


async def bare_many(n: int) -> None:
    results: list[tuple[str, int]] = []

    async def one() -> None:
        results.append(await bare_loop(PROMPT, bare_model_checkpoint))

    async with asyncio.TaskGroup() as tg:
        for _ in range(n):
            tg.create_task(one())
    assert results == [(ANSWER, TOOL_CALLS)] * n


# ---------------------------------------------------------------------- subjects


@dataclass
class Subject:
    """One framework running the workload.

    `one(checkpoint)` runs the workload once and asserts that "10" came back
    and the tool results are in the conversation; with `checkpoint` the
    scripted model yields to the event loop once per call. `many(n)` runs n at
    once (checkpointing) and checks each; by default a task per run in a
    TaskGroup. `counter` is bumped by the peer's tool: `run_one` and `run_many`
    check that the tool ran TOOL_CALLS times per run. `reset`, if given, runs
    before each timed round, untimed (agentfsm renews its runtime there).
    """

    name: str
    one: Callable[[bool], Awaitable[None]]
    many: Callable[[int], Awaitable[None]] | None = None
    counter: Counter | None = None
    reset: Callable[[], Awaitable[None]] | None = None
    """Called before each timed round, outside the timed region."""

    async def run_one(self, checkpoint: bool) -> None:
        before = self.counter.n if self.counter else 0
        await self.one(checkpoint)
        if self.counter:
            assert self.counter.n - before == TOOL_CALLS, self.counter.n - before

    async def run_many(self, n: int) -> None:
        before = self.counter.n if self.counter else 0
        if self.many is not None:
            await self.many(n)
        else:
            async with asyncio.TaskGroup() as tg:
                for _ in range(n):
                    tg.create_task(self.one(True))
        if self.counter:
            assert self.counter.n - before == TOOL_CALLS * n, self.counter.n - before


BARE: Final = Subject("bare", bare_one, bare_many)


@dataclass
class Figures:
    name: str
    version: str
    python: str
    imports: list[str]
    us_per_run: float = 0.0
    bare_us_per_run: float = 0.0
    concurrent_us_per_run: float = 0.0
    bare_concurrent_us_per_run: float = 0.0
    kb_per_run_in_flight: float = 0.0
    bare_kb_per_run_in_flight: float = 0.0
    import_ms: float = 0.0
    reference_imports: list[str] | None = None
    reference_import_ms: float | None = None
    concurrent_over_sequential: float = 0.0
    """Median over the rounds in flight of (µs/run in flight / µs/run of the
    sequential round just before it)."""
    bare_concurrent_over_sequential: float = 0.0
    seq_runs_per_round: int = 0
    in_flight: int = CONCURRENT
    samples: dict[str, list[float]] = field(default_factory=dict)


async def seq_round(subject: Subject, runs: int) -> float:
    """CPU µs per run over `runs` sequential runs."""
    if subject.reset is not None:
        await subject.reset()
    gc.collect()
    start = time.process_time()
    for _ in range(runs):
        await subject.run_one(False)
    return (time.process_time() - start) / runs * 1e6


async def many_round(subject: Subject, n: int) -> float:
    """CPU µs per run with `n` runs in flight at once."""
    if subject.reset is not None:
        await subject.reset()
    gc.collect()
    start = time.process_time()
    await subject.run_many(n)
    return (time.process_time() - start) / n * 1e6


async def traced_kb(subject: Subject, n: int) -> float:
    """Traced peak KB above the baseline, per run, with `n` runs in flight."""
    if subject.reset is not None:
        await subject.reset()
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    baseline, _ = tracemalloc.get_traced_memory()
    await subject.run_many(n)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return (peak - baseline) / n / 1024


def _pin_to_one_cpu() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def import_ms(imports: list[str], reference: list[str] | None = None) -> list[float]:
    """Median wall ms of importing `imports` in a fresh interpreter, then (if
    given) of importing `reference` alone, their samples taken alternately so
    that both see the machine at the same speed."""
    # As installed: pip compiles every module to .pyc when it installs a
    # package, and the first run below writes them for an editable install,
    # unless the environment forbids it (PYTHONDONTWRITEBYTECODE, set on some
    # CI machines), which would time agentfsm compiled from source on every
    # import and its installed peers from .pyc.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    # Each interpreter stays on one CPU (the same for every subject): on the
    # shared 2-core VM an interpreter moved between CPUs while importing took
    # ~1.5x as long, so that unpinned samples fell in two groups (agentfsm:
    # 108-115 ms or 157-176 ms) and the median landed in either.
    pin = _pin_to_one_cpu if hasattr(os, "sched_setaffinity") else None
    kinds = [imports] if reference is None else [imports, reference]
    samples: list[list[float]] = [[] for _ in kinds]
    for i in range(IMPORT_SAMPLES + 1):
        for modules, taken in zip(kinds, samples, strict=True):
            code = (
                "import time; t = time.perf_counter()\n"
                + "".join(f"import {m}\n" for m in modules)
                + "print(time.perf_counter() - t)"
            )
            out = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                check=True,
                env=env,
                preexec_fn=pin,
            )
            if i:  # the first one may still write .pyc files
                taken.append(float(out.stdout.strip()) * 1e3)
    return [statistics.median(taken) for taken in samples]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def measure(subject: Subject, figures: Figures, quick: bool) -> None:
    rounds = 3 if quick else ROUNDS
    concurrent_rounds = 1 if quick else CONCURRENT_ROUNDS
    n = 200 if quick else CONCURRENT
    # Warm up both (and check they work), then size a round to ~ROUND_SECONDS.
    for s in (BARE, subject):
        await seq_round(s, 20)
    probe = await seq_round(subject, 20)
    runs = max(20, min(2_000, round(ROUND_SECONDS / (probe / 1e6))))
    if quick:
        runs = max(10, runs // 10)
    figures.seq_runs_per_round = runs
    figures.in_flight = n
    bare: list[float] = []
    seq: list[float] = []
    for _ in range(rounds):
        bare.append(await seq_round(BARE, 2_000))
        seq.append(await seq_round(subject, runs))
    log(f"  {subject.name}: sequential {statistics.median(seq):.1f} µs/run")
    bare_many_: list[float] = []
    many: list[float] = []
    bare_pairs: list[float] = []
    pairs: list[float] = []
    # At least `concurrent_rounds` pairs, more while they fit in
    # CONCURRENT_SECONDS (up to MAX_CONCURRENT_ROUNDS): a round in flight moves
    # by +-25% from one to the next, so the fast subjects take more of them.
    started = time.monotonic()
    while len(pairs) < concurrent_rounds or (
        not quick
        and len(pairs) < MAX_CONCURRENT_ROUNDS
        and time.monotonic() - started < CONCURRENT_SECONDS
    ):
        before = await seq_round(BARE, 2_000)
        bare_many_.append(await many_round(BARE, n))
        bare_pairs.append(bare_many_[-1] / before)
        before = await seq_round(subject, runs)
        many.append(await many_round(subject, n))
        pairs.append(many[-1] / before)
    log(f"  {subject.name}: {n:,} in flight {statistics.median(many):.1f} µs/run")
    figures.bare_kb_per_run_in_flight = await traced_kb(BARE, n)
    figures.kb_per_run_in_flight = await traced_kb(subject, n)
    figures.us_per_run = statistics.median(seq)
    figures.bare_us_per_run = statistics.median(bare)
    figures.concurrent_us_per_run = statistics.median(many)
    figures.bare_concurrent_us_per_run = statistics.median(bare_many_)
    figures.concurrent_over_sequential = statistics.median(pairs)
    figures.bare_concurrent_over_sequential = statistics.median(bare_pairs)
    figures.samples = {
        "seq": seq,
        "bare_seq": bare,
        "concurrent": many,
        "bare_concurrent": bare_many_,
        "concurrent_over_sequential": pairs,
        "bare_concurrent_over_sequential": bare_pairs,
    }


def main(
    make_subject: Callable[[], AbstractAsyncContextManager[Subject]],
    *,
    name: str,
    version: str,
    imports: list[str],
    reference_imports: list[str] | None = None,
) -> None:
    """Measure the subject `make_subject()` opens (in a running event loop).

    `reference_imports`, if given, are timed beside `imports` (the subject's
    own dependencies, say), to show what the machine's speed made of them.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument(
        "--check", action="store_true", help="one run of each, no figures"
    )
    args = parser.parse_args()
    figures = Figures(name, version, platform.python_version(), imports)

    async def run() -> None:
        async with make_subject() as subject:
            if args.check:
                await subject.run_one(False)
                await subject.run_one(True)
                await subject.run_many(10)
            else:
                await measure(subject, figures, args.quick)

    asyncio.run(run())
    if args.check:
        print(f"{name}: ok")
        return
    timed = import_ms(imports, reference_imports)
    figures.import_ms = timed[0]
    if reference_imports is not None:
        figures.reference_imports = reference_imports
        figures.reference_import_ms = timed[1]
    print(
        f"{name} {version}: {figures.us_per_run:.1f} µs/run "
        f"({figures.us_per_run / figures.bare_us_per_run:.1f}x bare), "
        f"{figures.concurrent_us_per_run:.1f} µs/run with {figures.in_flight:,} in flight, "
        f"{figures.kb_per_run_in_flight:.1f} KB/run, import {figures.import_ms:.0f} ms"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(asdict(figures), f, indent=1)
