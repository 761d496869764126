"""The benchmark workload as a Temporal workflow: agentfsm, and pydantic-ai's
Temporal integration on the same dev server with the same tuning.

The workload is bench/bench_loop.py's (bench/peers/harness.py): one user
message, the model asks for `add(a, b)` three times (one call per turn), then
answers "10": 4 model requests and 3 tool calls per loop, a zero-latency
scripted model. On Temporal each model request and each tool call is an
activity, so what is measured is the orchestration: workflow tasks, activity
round trips through the server, history.

- agentfsm: `agentfsm.temporal` (a `TemporalAgent`, `worker`, `LoopClient`),
  sandboxed (the default) and unsandboxed;
- pydantic-ai: `pydantic_ai.durable_exec.temporal` (pydantic-ai-slim
  PYDANTIC_AI_VERSION, a `FunctionModel` and one tool), in a venv of its own
  (bench/.venvs/pydantic_ai_temporal, made on first use from the pins below),
  started against the same server.

Printed for each: the median ms per loop (ROUNDS sequential loops after
WARMUP), the history events per loop and the payload bytes per loop (every
`Payload` in the history: inputs, results, headers, memo). The last line is
machine-readable: `temporal_ms_per_loop=<x> pydantic_ai_temporal_vs_agentfsm=<y>
history_events=<n>` (x: agentfsm sandboxed; y: pydantic-ai's ms / agentfsm's,
`nan` when the peer could not run; n: agentfsm's events per loop).

Run with `make bench-temporal` (or `.venv/bin/python bench/bench_temporal.py`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from temporalio.api.common.v1 import Payload
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from agentfsm import FunctionCallOutputItem, InferenceInput, InferenceOutput, tool
from agentfsm.providers.function import FunctionProvider
from agentfsm.temporal import LoopClient, TemporalAgent, worker
from agentfsm.testing import call, calls, text

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from harness import ANSWER, MODEL_CALLS, PROMPT, TOOL_CALLS, script_step

ROUNDS: Final = int(os.environ.get("BENCH_TEMPORAL_ROUNDS", "30"))
WARMUP: Final = 5
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


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def model(request: InferenceInput) -> InferenceOutput:
    done = sum(isinstance(i, FunctionCallOutputItem) for i in request.context.items)
    step = script_step(done)
    if step is None:
        return text(ANSWER)
    name, args = step
    return calls(call(name, call_id=f"c{done}", **args))


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


async def agentfsm_side(client: Client, *, sandboxed: bool) -> Figures:
    queue = f"bench-agentfsm-{uuid.uuid4().hex[:6]}"
    async with worker(
        client,
        task_queue=queue,
        agents=[AGENT],
        providers={"fn": FunctionProvider(model)},
        sandboxed=sandboxed,
    ):
        loops = LoopClient(client, task_queue=queue)
        times = []
        ids = []
        for n in range(WARMUP + ROUNDS):
            started = time.perf_counter()
            loop_id = await loops.start("bench", PROMPT)
            result = await loops.wait(loop_id)
            elapsed = time.perf_counter() - started
            assert result.answer is not None
            assert result.answer.content == ANSWER, result
            assert (result.model_requests, result.tool_calls) == (
                MODEL_CALLS,
                TOOL_CALLS,
            )
            if n >= WARMUP:
                times.append(elapsed)
                ids.append(loops.handle(loop_id).id)
    events, size = await history_figures(client, ids)
    return Figures(statistics.median(times) * 1000, events, size)


# ------------------------------------------------------------------- the peer

PEER_SCRIPT: Final = r'''
"""The workload on pydantic-ai's Temporal integration (run by bench_temporal.py)."""
import asyncio, json, os, statistics, sys, time, uuid
from datetime import timedelta

from harness import ANSWER, PROMPT, TOOL_CALLS, script_step

from temporalio import workflow
from temporalio.client import Client
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from pydantic_ai import Agent
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin, TemporalDurability
    from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel


def reply(messages, info):
    n = sum(isinstance(p, ToolReturnPart) for m in messages if isinstance(m, ModelRequest) for p in m.parts)
    step = script_step(n)
    if step is None:
        return ModelResponse(parts=[TextPart(ANSWER)])
    name, args = step
    return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=f"c{n}")])


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


async def main(address, rounds, warmup):
    client = await Client.connect(address, plugins=[PydanticAIPlugin()])
    queue = f"bench-pydantic-ai-{uuid.uuid4().hex[:6]}"
    async with Worker(client, task_queue=queue, workflows=[BenchWorkflow]):
        times, ids = [], []
        for n in range(warmup + rounds):
            wid = f"bench-pai-{uuid.uuid4().hex}"
            started = time.perf_counter()
            output = await client.execute_workflow(BenchWorkflow.run, PROMPT, id=wid, task_queue=queue)
            elapsed = time.perf_counter() - started
            assert output == ANSWER, output
            if n >= warmup:
                times.append(elapsed)
                ids.append(wid)
    print(json.dumps({"ms": statistics.median(times) * 1000, "ids": ids}), flush=True)


def entry():
    # A module, not a script: the sandbox imports the workflow's module again.
    try:
        asyncio.run(main(sys.argv[1], int(sys.argv[2]), 5))
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


async def peer_side(client: Client, address: str) -> Figures | None:
    python = peer_python()
    if python is None:
        return None
    (PEER_VENV / "peer_pydantic_ai_temporal.py").write_text(PEER_SCRIPT)
    entry = "import peer_pydantic_ai_temporal as peer; peer.entry()"
    done = await asyncio.to_thread(
        subprocess.run,
        [str(python), "-c", entry, address, str(ROUNDS)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{PEER_VENV}{os.pathsep}{ROOT / 'peers'}"},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        print(f"pydantic-ai run failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    data = json.loads(lines[-1])
    events, size = await history_figures(client, data["ids"])
    return Figures(data["ms"], events, size)


def row(name: str, figures: Figures | None) -> str:
    if figures is None:
        return f"{name:<34} (did not run)"
    return (
        f"{name:<34} {figures.ms_per_loop:8.1f} ms/loop  "
        f"{figures.events_per_loop:6.1f} events/loop  "
        f"{figures.payload_bytes_per_loop:9.0f} payload B/loop"
    )


async def main() -> None:
    env = await WorkflowEnvironment.start_local(
        ip="127.0.0.1",
        dev_server_existing_path=shutil.which(
            "temporal", path=str(Path(sys.executable).parent)
        )
        or shutil.which("temporal"),
        dev_server_extra_args=TUNING,
    )
    async with env:
        address = env.client.service_client.config.target_host
        sandboxed = await agentfsm_side(env.client, sandboxed=True)
        unsandboxed = await agentfsm_side(env.client, sandboxed=False)
        peer = await peer_side(env.client, address)
    print(
        f"workload: {MODEL_CALLS} model requests, {TOOL_CALLS} tool calls; "
        f"median of {ROUNDS} loops after {WARMUP}; one dev server, tuned"
    )
    print(row("agentfsm (sandboxed)", sandboxed))
    print(row("agentfsm (unsandboxed)", unsandboxed))
    print(row(f"pydantic-ai {PYDANTIC_AI_VERSION} (sandboxed)", peer))
    ratio = (
        peer.ms_per_loop / sandboxed.ms_per_loop if peer is not None else float("nan")
    )
    print(
        f"temporal_ms_per_loop={sandboxed.ms_per_loop:.1f} "
        f"pydantic_ai_temporal_vs_agentfsm={ratio:.2f} "
        f"history_events={sandboxed.events_per_loop:.0f}"
    )


if __name__ == "__main__":
    try:
        asyncio.run(main())
    finally:
        sys.stdout.flush()
        os._exit(0)  # temporalio issue #300: its threads can keep the process up
