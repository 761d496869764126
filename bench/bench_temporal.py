"""The benchmark workload as a Temporal workflow: agentfsm, and pydantic-ai's
Temporal integration, each on a dev server of its own with the same tuning.

The workload is bench/bench_loop.py's (bench/peers/harness.py) at two sizes:
one user message, the model asks for `add(a, b)` CALLS times (one call per
turn), then answers: CALLS + 1 model requests and CALLS tool calls per loop, a
zero-latency scripted model, at CALLS = 4 and 40. On Temporal each model
request and each tool call is an activity, so what is measured is the
orchestration: workflow tasks, activity round trips through the server,
history.

- agentfsm: `agentfsm.temporal` (a `TemporalAgent`, `worker`, `LoopClient`,
  the default `MemoryContextStore`), sandboxed (the default; unsandboxed too
  at 4 calls and one worker; with two workers, also both on one
  `StoreContexts` in a SQLite file);
- pydantic-ai: `pydantic_ai.durable_exec.temporal` (pydantic-ai-slim
  PYDANTIC_AI_VERSION, a `FunctionModel` and one tool), in a venv of its own
  (bench/.venvs/pydantic_ai_temporal, made on first use from the pins below).

Each size runs with one worker and with two workers on the task queue (the
second on a client and runtime of its own, as another process's; with two,
eager activity execution is off on both sides, so that the server dispatches
each activity to either worker). Each row runs on a fresh dev server, so that
no side runs on a server the other has filled.

Printed for each: the median ms per loop (sequential loops after a warm-up),
the history events per loop and the payload bytes per loop (every `Payload`
in the history: inputs, results, headers, memo). The last line is
machine-readable, for 4 calls and one worker: `temporal_ms_per_loop=<x>
pydantic_ai_temporal_vs_agentfsm=<y> history_events=<n> payload_bytes=<b>`
(x: agentfsm sandboxed; y: pydantic-ai's ms / agentfsm's, `nan` when the peer
could not run; n, b: agentfsm's events and payload bytes per loop).

Run with `make bench-temporal` (or `.venv/bin/python bench/bench_temporal.py`;
BENCH_TEMPORAL_ROUNDS sets the loops measured at 4 calls, a tenth of them at
40, at least 3).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.testing import WorkflowEnvironment

from agentfsm import FunctionCallOutputItem, InferenceInput, InferenceOutput, tool
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import SQLiteStore
from agentfsm.temporal import LoopClient, StoreContexts, TemporalAgent, worker
from agentfsm.testing import call, calls, text

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from harness import PROMPT

ROUNDS: Final = int(os.environ.get("BENCH_TEMPORAL_ROUNDS", "30"))
SIZES: Final = (4, 40)
"""Tool calls per loop."""
WORKERS: Final = (1, 2)
ROOT: Final = Path(__file__).resolve().parent
PEER_VENV: Final = ROOT / ".venvs" / "pydantic_ai_temporal"
PYDANTIC_AI_VERSION: Final = "2.68.0"
PEER_REQUIREMENTS: Final = (
    f"pydantic-ai-slim[temporal]=={PYDANTIC_AI_VERSION}",
    "temporalio==1.35.0",
)
TUNING: Final = [
    arg
    for name in ("transfer", "timer", "visibility")
    for arg in ("--dynamic-config-value", f"history.{name}ProcessorMaxPollRPS=1000")
]
"""The dev server's history processors poll at 1000/s (research note §2.2)."""


def rounds(size: int) -> tuple[int, int]:
    """`(warm-up, measured)` loops at `size` calls: a loop of 40 calls is ten
    times the work of one of 4."""
    if size <= SIZES[0]:
        return 5, ROUNDS
    return 2, max(3, ROUNDS // 10)


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def scripted(size: int) -> FunctionProvider:
    """The model: `add(n, 1)` for n in 0..size-1, one a turn, then the answer
    (the sum of the outputs, read from the context, as the peer's model)."""

    def model(request: InferenceInput) -> InferenceOutput:
        outputs = [
            int(i.output)
            for i in request.context.items
            if isinstance(i, FunctionCallOutputItem)
        ]
        done = len(outputs)
        if done < size:
            return calls(call("add", call_id=f"c{done}", a=done, b=1))
        return text(str(sum(outputs)))

    return FunctionProvider(model)


def answer(size: int) -> str:
    return str(sum(n + 1 for n in range(size)))


AGENT: Final = TemporalAgent(name="bench", model="fn:bench", tools=[add])


@dataclass
class Figures:
    ms_per_loop: float
    events_per_loop: float
    payload_bytes_per_loop: float


def payload_bytes(message: Any) -> int:
    """The bytes of every `Payload` inside a protobuf message."""
    if isinstance(message, Payload):
        return int(message.ByteSize())
    total = 0
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            if entry.message_type is not None:
                total += sum(payload_bytes(v) for v in value.values())
        elif field.is_repeated:
            total += sum(payload_bytes(v) for v in value)
        else:
            total += payload_bytes(value)
    return total


async def history_figures(client: Client, ids: list[str]) -> tuple[float, float]:
    events = size = 0
    for workflow_id in ids:
        history = await client.get_workflow_handle(workflow_id).fetch_history()
        events += len(history.events)
        size += sum(payload_bytes(e) for e in history.events)
    return events / len(ids), size / len(ids)


@asynccontextmanager
async def fresh_server() -> AsyncIterator[WorkflowEnvironment]:
    """A dev server of its own (in memory, on 127.0.0.1), tuned as the tests."""
    env = await WorkflowEnvironment.start_local(
        ip="127.0.0.1",
        dev_server_existing_path=shutil.which(
            "temporal", path=str(Path(sys.executable).parent)
        )
        or shutil.which("temporal"),
        dev_server_extra_args=TUNING,
    )
    async with env:
        yield env


async def agentfsm_side(
    env: WorkflowEnvironment,
    *,
    size: int,
    workers: int,
    sandboxed: bool = True,
    shared: bool = False,
) -> Figures:
    """The workload on agentfsm; `shared`: the workers keep contexts in one
    `StoreContexts` (a SQLite file) instead of a memory store each."""
    client = env.client
    queue = f"bench-agentfsm-{uuid.uuid4().hex[:6]}"
    warmup, measured = rounds(size)
    options: dict[str, Any] = {}
    if workers > 1:
        options["disable_eager_activity_execution"] = True
    async with AsyncExitStack() as stack:
        if shared:
            folder = stack.enter_context(tempfile.TemporaryDirectory())
            options["context_store"] = StoreContexts(
                SQLiteStore(Path(folder) / "contexts.db")
            )
        for n in range(workers):
            on = client
            if n:  # another process's client: one runtime takes one worker a queue
                on = await Client.connect(
                    client.service_client.config.target_host,
                    namespace=client.namespace,
                    runtime=Runtime(telemetry=TelemetryConfig()),
                )
            await stack.enter_async_context(
                worker(
                    on,
                    task_queue=queue,
                    agents=[AGENT],
                    providers={"fn": scripted(size)},
                    sandboxed=sandboxed,
                    **options,
                )
            )
        loops = LoopClient(client, task_queue=queue)
        times = []
        ids = []
        for n in range(warmup + measured):
            started = time.perf_counter()
            loop_id = await loops.start("bench", PROMPT)
            result = await loops.wait(loop_id)
            elapsed = time.perf_counter() - started
            assert result.answer is not None, result
            assert result.answer.content == answer(size), result
            assert (result.model_requests, result.tool_calls) == (size + 1, size)
            if n >= warmup:
                times.append(elapsed)
                ids.append(loops.handle(loop_id).id)
    events, payload = await history_figures(client, ids)
    return Figures(statistics.median(times) * 1000, events, payload)


# ------------------------------------------------------------------- the peer

PEER_SCRIPT: Final = r'''
"""The workload on pydantic-ai's Temporal integration (run by bench_temporal.py)."""
import asyncio, json, os, statistics, sys, time, uuid

from harness import PROMPT

from temporalio import workflow
from temporalio.client import Client
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from pydantic_ai import Agent
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin, TemporalDurability
    from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

SIZE = int(os.environ["BENCH_TEMPORAL_CALLS"])


def reply(messages, info):
    outputs = [p.content for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)]
    done = len(outputs)
    if done < SIZE:
        return ModelResponse(parts=[ToolCallPart("add", {"a": done, "b": 1}, tool_call_id=f"c{done}")])
    return ModelResponse(parts=[TextPart(str(sum(int(o) for o in outputs)))])


agent = Agent(FunctionModel(reply), name="bench", capabilities=[TemporalDurability()])


@agent.tool_plain
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@workflow.defn
class BenchWorkflow:
    __pydantic_ai_agents__ = [agent]

    @workflow.run
    async def run(self, prompt: str) -> str:
        result = await agent.run(prompt)
        return result.output


async def main(address, rounds, warmup, workers):
    client = await Client.connect(address, plugins=[PydanticAIPlugin()])
    queue = f"bench-pydantic-ai-{uuid.uuid4().hex[:6]}"
    options = {"disable_eager_activity_execution": True} if workers > 1 else {}
    running = [Worker(client, task_queue=queue, workflows=[BenchWorkflow], **options)]
    for _ in range(1, workers):
        other = await Client.connect(
            address,
            plugins=[PydanticAIPlugin()],
            runtime=Runtime(telemetry=TelemetryConfig()),
        )
        running.append(Worker(other, task_queue=queue, workflows=[BenchWorkflow], **options))
    for w in running:
        await w.__aenter__()
    expected = str(sum(n + 1 for n in range(SIZE)))
    times, ids = [], []
    for n in range(warmup + rounds):
        wid = f"bench-pai-{uuid.uuid4().hex}"
        started = time.perf_counter()
        output = await client.execute_workflow(BenchWorkflow.run, PROMPT, id=wid, task_queue=queue)
        elapsed = time.perf_counter() - started
        assert output == expected, output
        if n >= warmup:
            times.append(elapsed)
            ids.append(wid)
    print(json.dumps({"ms": statistics.median(times) * 1000, "ids": ids}), flush=True)
    # Not the workers' shutdown: with a second runtime it can hang after the
    # figures are out, and nothing is left to measure.
    os._exit(0)


def entry():
    # A module, not a script: the sandbox imports the workflow's module again.
    try:
        asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
'''


def peer_python() -> Path | None:
    """The peer venv's python, made from the pins on first use (None if that fails)."""
    python = PEER_VENV / "bin" / "python"
    stamp = PEER_VENV / ".installed"
    pins = "\n".join(PEER_REQUIREMENTS)
    if stamp.exists() and stamp.read_text() == pins:
        return python
    shutil.rmtree(PEER_VENV, ignore_errors=True)
    print(f"making {PEER_VENV} ({', '.join(PEER_REQUIREMENTS)})", file=sys.stderr)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "--quiet", *PEER_REQUIREMENTS],
            check=True,
        )
    except subprocess.CalledProcessError as exc:
        print(f"pydantic-ai venv failed: {exc}", file=sys.stderr)
        return None
    stamp.write_text(pins)
    return python


async def peer_side(
    env: WorkflowEnvironment, python: Path | None, *, size: int, workers: int
) -> Figures | None:
    if python is None:
        return None
    (PEER_VENV / "peer_pydantic_ai_temporal.py").write_text(PEER_SCRIPT)
    address = env.client.service_client.config.target_host
    warmup, measured = rounds(size)
    entry = "import peer_pydantic_ai_temporal as peer; peer.entry()"
    done = await asyncio.to_thread(
        subprocess.run,
        [str(python), "-c", entry, address, str(measured), str(warmup), str(workers)],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": f"{PEER_VENV}{os.pathsep}{ROOT / 'peers'}",
            "BENCH_TEMPORAL_CALLS": str(size),
        },
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        print(f"pydantic-ai run failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    data = json.loads(lines[-1])
    events, payload = await history_figures(env.client, data["ids"])
    return Figures(data["ms"], events, payload)


def row(size: int, workers: int, name: str, figures: Figures | None) -> str:
    head = f"{size:>5} {workers:>7}  {name:<34}"
    if figures is None:
        return f"{head} (did not run)"
    return (
        f"{head} {figures.ms_per_loop:8.1f} {figures.events_per_loop:8.1f} "
        f"{figures.payload_bytes_per_loop:12,.0f}"
    )


async def main() -> None:
    python = peer_python()
    peer_name = f"pydantic-ai {PYDANTIC_AI_VERSION} (sandboxed)"
    lines = []
    headline: tuple[Figures, Figures | None] | None = None
    for size in SIZES:
        for workers in WORKERS:
            async with fresh_server() as env:
                ours = await agentfsm_side(env, size=size, workers=workers)
            lines.append(row(size, workers, "agentfsm (sandboxed)", ours))
            print(lines[-1], file=sys.stderr, flush=True)
            if workers > 1:
                async with fresh_server() as env:
                    kept = await agentfsm_side(
                        env, size=size, workers=workers, shared=True
                    )
                lines.append(row(size, workers, "agentfsm (StoreContexts)", kept))
                print(lines[-1], file=sys.stderr, flush=True)
            if (size, workers) == (SIZES[0], 1):
                async with fresh_server() as env:
                    bare = await agentfsm_side(
                        env, size=size, workers=workers, sandboxed=False
                    )
                lines.append(row(size, workers, "agentfsm (unsandboxed)", bare))
                print(lines[-1], file=sys.stderr, flush=True)
            async with fresh_server() as env:
                peer = await peer_side(env, python, size=size, workers=workers)
            lines.append(row(size, workers, peer_name, peer))
            print(lines[-1], file=sys.stderr, flush=True)
            if (size, workers) == (SIZES[0], 1):
                headline = (ours, peer)
    small, large = rounds(SIZES[0]), rounds(SIZES[-1])
    print(
        "workload: N tool calls (one a turn) and N+1 model requests per loop, "
        f"a zero-latency scripted model; median of {small[1]} loops after "
        f"{small[0]} at N={SIZES[0]}, {large[1]} after {large[0]} at "
        f"N={SIZES[-1]}; each row on a fresh dev server, tuned; with 2 workers "
        "the server dispatches each activity (no eager execution)"
    )
    print(
        f"{'calls':>5} {'workers':>7}  {'':<34} {'ms/loop':>8} {'events':>8} "
        f"{'payload B':>12}"
    )
    for line in lines:
        print(line)
    assert headline is not None
    ours, peer = headline
    ratio = peer.ms_per_loop / ours.ms_per_loop if peer is not None else float("nan")
    print(
        f"temporal_ms_per_loop={ours.ms_per_loop:.1f} "
        f"pydantic_ai_temporal_vs_agentfsm={ratio:.2f} "
        f"history_events={ours.events_per_loop:.0f} "
        f"payload_bytes={ours.payload_bytes_per_loop:.0f}"
    )


if __name__ == "__main__":
    try:
        asyncio.run(main())
    finally:
        sys.stdout.flush()
        os._exit(0)  # temporalio issue #300: its threads can keep the process up
