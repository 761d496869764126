"""Instructions per run of `make bench`'s workload, counted by callgrind: a speed gate
that does not move with the machine.

CPU time on a shared 2-core VM drifts by +-30% between runs (bench/README.md);
the number of instructions a run executes does not. This counts them with
`valgrind --tool=callgrind` for three subjects, each in subprocesses of its own:

- agentfsm, nobody subscribed to the bus (`bench_loop.agentfsm_runs(n,
  subscriber=False)`);
- agentfsm with one subscriber draining every event (`bench_loop.agentfsm_runs(n)`);
- the bare asyncio loop, the floor (`bench_loop.bare_runs(n)`, over
  `harness.bare_loop`);
- agentfsm traced by `agentfsm.otel.OpenTelemetry()` with no tracer provider
  set (OpenTelemetry's default proxy: what tracing costs when nobody configured
  it), and with an SDK `TracerProvider` exporting to an `InMemorySpanExporter`
  (what the spans cost), nobody subscribed (`otel_runs`, below).

The workload is bench_loop.py's own, imported from it with its structlog
configuration: `Runtime.run_loop` + `Runtime.wait` with a `ScriptedProvider`
and an async `@agentfsm.tool` `add`, 4 model calls and 3 tool calls a run.

How a run is counted. Each subject runs LOW times in one process and HIGH times
in another, and instructions per run = (count(HIGH) - count(LOW)) / (HIGH -
LOW): what both processes do besides the runs (the runtime's setup and
teardown, the first runs' warm-up) cancels out. In each process callgrind
counts only what runs inside `sys.call_tracing(asyncio.run, (runs,))`
(`--collect-atstart=no --toggle-collect=_PyEval_CallTracing`: collection is on
while that C function is on the stack), after one uncounted run that does the
lazy imports and first uses. Counting the whole program instead would add the
interpreter's start-up and the imports (~1 billion instructions, more than the
runs themselves), which do not repeat exactly: every `os.stat` of an import builds
the file's access and change times, and pydantic-core seeds its Rust hash
maps from the OS, so the same start-up differed by ~1,000 instructions from
one process to the next. Toggling on a Python function is not possible (all of
them are the one `_PyEval_EvalFrameDefault`); `sys.call_tracing` is a C entry
point nothing else calls, exported by every CPython build (no debug symbols
needed), and without a tracer it changes nothing in how the code inside runs.

What makes the count repeatable:

- PYTHONHASHSEED=0: str hashes (dict and set probing) are the same every time;
- `random.seed(0)` and a clock for `time.time_ns` that advances 1 ms per call
  from a fixed start (`itertools.count(...).__next__`, a C callable like the
  real one): loop ids (UUIDv7) are made from both, and their hashes decide
  where they land in the runtime's dicts;
- the driver's clock for its time-based yield (`driver._yield_if_due`: a
  checkpoint when 10 ms passed since the last) advances 0.1 ms per look: a
  yield every ~100 looks, as at the workload's real speed, where under
  callgrind (~50x slower) real time made one every run or two, more often
  the busier the machine (~8,000 instructions each: two counts of one tree
  differed by ~15,000 a run with and without other work beside them);
- the runs return None: asyncio.run's end reprs its main task, result
  included, and the CPU seconds the bench_loop functions return would be a
  float of a different length every time;
- PYTHONDONTWRITEBYTECODE=1 under callgrind, after one plain run of each
  subject that checks the workload and writes any missing .pyc;
- a fixed environment for the subprocesses (of the caller's, only PYTHONPATH
  and VALGRIND_LIB are passed on) and run counts of one width in argv: under
  valgrind every address is the same from one process to the next as long as
  the same things were allocated before, and CPython hashes some things by
  address (its type attribute cache, the contextvars of the worker tasks), so
  a different environment (`make` adds MAKEFLAGS and others) would move every
  later object and change the count.

Addresses are also why the counts are exact for one tree only: a change that
moves the heap without touching the runs (a file added to a directory on
sys.path, another PYTHONPATH) moves them too, by as much as ~0.5% where a
directory on sys.path gained files: read smaller differences as noise. What
still moves from one process to the next is apparently pydantic-core's Rust
hash maps (seeded from the OS): up to ~250 instructions a count, which leaves
the agentfsm figures +-1 instruction per run from one run of this script to
the next (the bare loop's do not move). Callgrind counts user-space
instructions only (no kernel), so the load of the machine does not change them.

It imports agentfsm from whatever is first on sys.path and prints which one it
measured, so `PYTHONPATH=/other/checkout .venv/bin/python bench/bench_instructions.py`
measures another checkout with this workload. Callgrind runs Python ~50x
slower; the six processes take ~25 s on 2 cores (`--jobs` of them at once).
The last line is machine-readable: `instructions_ratio=<x>
instructions_ratio_subscribed=<y>` (agentfsm with nobody subscribed / bare, with
one subscriber / bare).

Run with `make bench-instructions`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final

HERE: Final = Path(__file__).resolve().parent
SCRIPT: Final = str(Path(__file__).resolve())

LOW: Final = 100
HIGH: Final = 600
"""Runs in the two processes of each subject (as bench/README.md's counts were
taken); per run = difference / (HIGH - LOW)."""

SUBJECTS: Final = {
    "agentfsm": "agentfsm, nobody subscribed",
    "subscribed": "agentfsm, one subscriber",
    "otel": "otel, no tracer provider",
    "otel-sdk": "otel, SDK in-memory export",
    "bare": "bare asyncio loop",
}
OTEL: Final = ("otel", "otel-sdk")
"""The subjects traced by `agentfsm.otel`, printed beside the untraced one."""

FAKE_CLOCK_START_NS: Final = 1_750_000_000_000_000_000
"""The fixed clock's first `time.time_ns()` (June 2025); then +1 ms per call."""

DRIVER_CLOCK_STEP: Final = 1e-4
"""Seconds the driver's clock (`driver.monotonic`) advances per look."""

TOGGLE: Final = "_PyEval_CallTracing"
"""The C function (behind `sys.call_tracing`) inside which callgrind counts."""


# ---------------------------------------------------------------------- subprocess


async def otel_runs(runs: int, *, sdk: bool) -> None:
    """`bench_loop.agentfsm_runs(runs, subscriber=False)` in a runtime traced by
    `OpenTelemetry`: to the global provider (none is set: the proxy), or to an
    SDK provider exporting each span to memory as it ends (cleared each run)."""
    import bench_loop
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )

    import agentfsm
    from agentfsm.otel import OpenTelemetry

    exporter = InMemorySpanExporter()
    provider = None
    if sdk:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    runtime = agentfsm.Runtime(
        providers={"scripted": bench_loop.scripted_provider()},
        extensions=[OpenTelemetry(tracer_provider=provider)],
    )
    async with runtime:
        for _ in range(runs):
            loop_id = runtime.run_loop(
                "agent", bench_loop.PROMPT, bench_loop.inference_input()
            )
            bench_loop.check(await runtime.wait(loop_id))
            if sdk:
                # 1 invoke_agent, 4 chat and 3 execute_tool spans a run.
                assert len(exporter.get_finished_spans()) == 8
                exporter.clear()


def child(subject: str, runs: int) -> None:
    """`runs` runs of `subject` inside `sys.call_tracing` (what callgrind counts),
    after one uncounted run; prints the path of the agentfsm it ran."""
    time.time_ns = itertools.count(FAKE_CLOCK_START_NS, 1_000_000).__next__
    random.seed(0)
    sys.path.insert(0, str(HERE))
    import bench_loop

    import agentfsm
    from agentfsm._loop import driver

    driver.monotonic = itertools.count(0.0, DRIVER_CLOCK_STEP).__next__

    async def work(runs: int) -> None:
        # Returns None (see the module's docstring).
        if subject == "bare":
            await bench_loop.bare_runs(runs)
        elif subject in OTEL:
            await otel_runs(runs, sdk=subject == "otel-sdk")
        else:
            await bench_loop.agentfsm_runs(runs, subscriber=subject == "subscribed")

    asyncio.run(work(1))
    gc.collect()
    sys.call_tracing(asyncio.run, (work(runs),))
    print(Path(agentfsm.__file__).resolve().parent)


# ---------------------------------------------------------------------- parent


@dataclass(frozen=True)
class Count:
    instructions: int
    agentfsm_path: str


def child_command(subject: str, runs: int) -> list[str]:
    # One width for every run count: argv is allocated before the runs.
    return [sys.executable, SCRIPT, "--child", subject, f"{runs:07d}"]


def child_env(*, write_bytecode: bool = False) -> dict[str, str]:
    """The subprocesses' whole environment: the same however this was started."""
    env = {"PATH": os.defpath, "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0"}
    for name in ("PYTHONPATH", "VALGRIND_LIB"):
        if name in os.environ:
            env[name] = os.environ[name]
    if not write_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def plain_run(subject: str) -> str:
    """One run of `subject` without callgrind: checks the workload, writes .pyc."""
    out = subprocess.run(
        child_command(subject, 1),
        capture_output=True,
        text=True,
        env=child_env(write_bytecode=True),
        check=False,
    )
    if out.returncode:
        sys.exit(f"{subject}: the workload failed:\n{out.stderr}")
    return last_line(out.stdout)


def counted(valgrind: str, subject: str, runs: int, tmp: Path) -> Count:
    """Instructions callgrind counted inside `sys.call_tracing` for `runs` runs."""
    out_file = tmp / f"callgrind.{subject}.{runs}"
    log_file = tmp / f"valgrind.{subject}.{runs}.log"
    out = subprocess.run(
        [
            valgrind,
            "--tool=callgrind",
            "--collect-atstart=no",
            f"--toggle-collect={TOGGLE}",
            f"--callgrind-out-file={out_file}",
            f"--log-file={log_file}",
            "--dump-line=no",
            "--compress-strings=no",
            *child_command(subject, runs),
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        check=False,
    )
    if out.returncode:
        log = log_file.read_text() if log_file.exists() else ""
        sys.exit(f"{subject} x{runs} under callgrind failed:\n{out.stderr}\n{log}")
    match = re.search(r"^summary:\s*(\d+)", out_file.read_text(), re.MULTILINE)
    if match is None or int(match.group(1)) == 0:
        sys.exit(
            f"callgrind counted nothing inside {TOGGLE} ({out_file}): "
            f"this interpreter ({sys.executable}) does not export it?"
        )
    return Count(int(match.group(1)), last_line(out.stdout))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--low", type=int, default=LOW, help="runs, first process")
    parser.add_argument("--high", type=int, default=HIGH, help="runs, second process")
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(6, os.cpu_count() or 1),
        help="callgrind processes at once",
    )
    parser.add_argument(
        "--child", nargs=2, metavar=("SUBJECT", "RUNS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return
    if not 0 < args.low < args.high:
        parser.error("need 0 < --low < --high")

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        sys.exit(
            "bench_instructions.py counts instructions with valgrind, which is not "
            "installed: apt-get install -y valgrind"
        )
    version = subprocess.run(
        [valgrind, "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()

    import agentfsm

    path = str(Path(agentfsm.__file__).resolve().parent)
    print(
        f"python {sys.version.split()[0]}, {version}, agentfsm {agentfsm.__version__}"
    )
    print(f"agentfsm measured: {path}")
    for subject in SUBJECTS:
        seen = plain_run(subject)
        if seen != path:
            sys.exit(f"the subprocess imported agentfsm from {seen}, not {path}")
    print(
        f"instructions per run: callgrind, (count of {args.high} runs - count of "
        f"{args.low} runs) / {args.high - args.low}"
    )

    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp,
        ThreadPoolExecutor(max_workers=args.jobs) as pool,
    ):
        # The slow ones first, so that the bare loop's fill in at the end.
        futures = {
            (subject, runs): pool.submit(counted, valgrind, subject, runs, Path(tmp))
            for subject in ("otel-sdk", "subscribed", "otel", "agentfsm", "bare")
            for runs in (args.high, args.low)
        }
        counts = {key: future.result() for key, future in futures.items()}
    for (subject, runs), count in counts.items():
        if count.agentfsm_path != path:
            sys.exit(f"{subject} x{runs} measured agentfsm at {count.agentfsm_path}")

    per_run = {
        subject: (
            counts[subject, args.high].instructions
            - counts[subject, args.low].instructions
        )
        / (args.high - args.low)
        for subject in SUBJECTS
    }
    floor = per_run["bare"]
    for subject, label in SUBJECTS.items():
        line = f"  {label:<28} {per_run[subject]:>12,.0f} instructions/run"
        if subject in OTEL:
            extra = per_run[subject] - per_run["agentfsm"]
            line += f"   ({extra:+,.0f} against nobody subscribed)"
        elif subject != "bare":
            line += f"   ({per_run[subject] / floor:.2f}x the floor)"
        print(line)
    print(f"({time.monotonic() - started:.0f} s under callgrind, {args.jobs} at once)")
    print(
        f"instructions_ratio={per_run['agentfsm'] / floor:.2f} "
        f"instructions_ratio_subscribed={per_run['subscribed'] / floor:.2f}"
    )


if __name__ == "__main__":
    main()
