"""The agents and tools of tests/test_temporal_deploy.py: deploys, heartbeats
and routing.

Each test builds its agents with `agents_for(queue)`, named after its task
queue (workflows find their agent by name in the worker's process), and its
tools record where and how often they ran in `RUNS`. The tools wait on
`threading.Event`s the test sets (`GATES`), never on a clock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import anyio
from temporalio import activity
from temporalio.common import RetryPolicy

from agentfsm import (
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    report_progress,
    tool,
)
from agentfsm.providers.function import FunctionProvider
from agentfsm.temporal import TemporalAgent, ToolActivityOptions
from agentfsm.testing import call, calls, text

WAIT = 30.0
"""How long a tool waits for its gate: far past any test's need."""


@dataclass
class Runs:
    """What the tools saw, in the worker, for the test to read."""

    events: list[dict[str, Any]] = field(default_factory=list)

    def add(self, tool_name: str, **fields: Any) -> None:
        info = activity.info()
        self.events.append(
            {
                "tool": tool_name,
                "attempt": info.attempt,
                "task_queue": info.task_queue,
                "worker": activity.client().identity,
                "thread": threading.current_thread().name,
                **fields,
            }
        )

    def of(self, tool_name: str, event: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if e["tool"] == tool_name and (event is None or e.get("event") == event)
        ]


RUNS = Runs()
GATES: dict[str, threading.Event] = {}
"""Opened by the test: `gate(name)` makes one, closed."""


def gate(name: str) -> threading.Event:
    GATES[name] = threading.Event()
    return GATES[name]


def reset() -> None:
    RUNS.events.clear()
    GATES.clear()


@tool(timeout=20)
async def finish_during_deploy() -> str:
    """Runs until its worker is being stopped, then until the test opens its
    gate (on_crash="pause", the default: a lost call would pause the loop)."""
    RUNS.add("finish_during_deploy", event="start")
    await activity.wait_for_worker_shutdown()
    RUNS.add("finish_during_deploy", event="shutdown seen")
    opened = await anyio.to_thread.run_sync(GATES["deploy"].wait, WAIT)
    assert opened, "the test never opened the deploy gate"
    return "finished"


@tool
async def where() -> str:
    """Says where it ran."""
    RUNS.add("where")
    return f"ran on {activity.info().task_queue}"


@tool
async def here() -> str:
    """Says where it ran (not routed: the loop's own queue)."""
    RUNS.add("here")
    return f"ran on {activity.info().task_queue}"


@tool(on_crash="retry")
async def again() -> str:
    """Idempotent: may run again."""
    RUNS.add("again")
    return "again"


@tool(on_crash="retry")
async def block() -> str:
    """An async tool that blocks its event loop (a sync call in an async
    tool) until the test opens the gate of this attempt; idempotent, so a
    lost attempt is retried."""
    attempt = activity.info().attempt
    RUNS.add("block", event="start")
    opened = GATES[f"block-{attempt}"].wait(WAIT)  # blocks the event loop
    assert opened, f"the test never opened block-{attempt}"
    return f"blocked and done (attempt {attempt})"


@tool
def progress() -> str:
    """A sync tool (in a thread) that reports progress, then waits for the
    test to open its gate."""
    taken = report_progress({"step": 1, "of": 2})
    RUNS.add("progress", event="reported", taken=taken)
    opened = GATES["progress"].wait(WAIT)
    assert opened, "the test never opened the progress gate"
    return "progressed"


def _outputs(request: InferenceInput) -> list[FunctionCallOutputItem]:
    return [i for i in request.context.items if isinstance(i, FunctionCallOutputItem)]


def model(request: InferenceInput) -> InferenceOutput:
    """Calls the tools the model's name lists (in one batch), then answers
    with their outputs."""
    outputs = _outputs(request)
    if outputs:
        return text(" | ".join(str(o.output) for o in outputs))
    names = request.model.partition(":")[2].split("+")
    return calls(*(call(n, call_id=f"{n}-1") for n in names))


PROVIDERS = {"deploy": FunctionProvider(model)}


def agents_for(queue: str) -> dict[str, TemporalAgent]:
    """The agents of a test whose loops run on `queue`, by role; tools routed
    elsewhere go to `queue + "-gpu"` or `queue + "-blocky"`."""
    gpu = ToolActivityOptions(task_queue=f"{queue}-gpu")
    blocky = f"{queue}-blocky"
    return {
        "deploy": TemporalAgent(
            name=f"{queue}-deploy",
            model="deploy:finish_during_deploy",
            tools=[finish_during_deploy],
        ),
        "routed": TemporalAgent(
            name=f"{queue}-routed",
            model="deploy:where+here",
            tools=[where, here],
            tool_options={"where": gpu},
        ),
        "blocking": TemporalAgent(
            name=f"{queue}-blocking",
            model="deploy:block",
            tools=[block],
            tool_defaults=ToolActivityOptions(task_queue=blocky),
        ),
        "blocking-beats": TemporalAgent(
            name=f"{queue}-blocking-beats",
            model="deploy:block",
            tools=[block],
            tool_options={
                "block": ToolActivityOptions(
                    task_queue=blocky,
                    heartbeat_timeout=timedelta(seconds=1),
                    retry_policy=RetryPolicy(
                        maximum_attempts=2, initial_interval=timedelta(seconds=0.2)
                    ),
                )
            },
        ),
        "progress": TemporalAgent(
            name=f"{queue}-progress", model="deploy:progress", tools=[progress]
        ),
        "progress-beats": TemporalAgent(
            name=f"{queue}-progress-beats",
            model="deploy:progress",
            tools=[progress],
            tool_defaults=ToolActivityOptions(heartbeat_timeout=timedelta(seconds=1.5)),
        ),
    }
