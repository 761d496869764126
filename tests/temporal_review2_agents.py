"""The agents of tests/test_temporal_review2.py: an adversarial review of the
activity side of agentfsm.temporal (payload sizes, values by reference, the
history rebuild, deploys, heartbeats, routing).

One provider serves every agent; the model's name picks its script, and the
test sets what the script does in `PLAN` before it starts the loop (the worker
runs in the test's process). Each script answers from the context it is sent,
so the loop's answer says what the model received.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any, Final

import anyio
from temporalio import activity

from agentfsm import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    UserMessage,
    report_progress,
    tool,
)
from agentfsm.exceptions import ProviderError
from agentfsm.providers.function import FunctionProvider
from agentfsm.temporal import TemporalAgent, ToolActivityOptions
from agentfsm.testing import call, calls, text

PLAN: dict[str, Any] = {}
"""What the scripts do, set by the test: `size` and `fill` of a tool output,
`answer` of a model answer, `arguments` of a call, `progress` of a report."""
SEEN: list[dict[str, Any]] = []
"""What the scripts and tools saw, for the test to read."""
GATES: dict[str, threading.Event] = {}
WAIT: Final = 30.0
"""How long a script waits for a gate: far past any test's need."""

NOWHERE: Final = "agentfsm-review2-nobody-polls-this"
"""A task queue no worker polls."""
STEPS: Final = 8
"""Tool calls of the `steps` script: enough turns to continue as new."""


def reset() -> None:
    PLAN.clear()
    SEEN.clear()
    GATES.clear()


def gate(name: str) -> threading.Event:
    GATES[name] = threading.Event()
    return GATES[name]


@tool
async def blob(size: int, fill: str) -> str:
    """Return `fill` repeated `size` times."""
    return fill * size


@tool
async def take(data: str) -> str:
    """Take `data`; return its length."""
    return str(len(data))


@tool
async def step(n: int) -> str:
    """One numbered step."""
    return f"step {n} done"


@tool(on_crash="pause")
async def progress() -> str:
    """Report the planned progress once, then finish."""
    taken = report_progress(PLAN["progress"])
    SEEN.append({"tool": "progress", "attempt": activity.info().attempt})
    return f"reported: {taken}"


@tool(timeout=5)
async def far() -> str:
    """A tool routed to a queue no worker polls."""
    return "ran"


def _outputs(request: InferenceInput) -> list[FunctionCallOutputItem]:
    return [i for i in request.context.items if isinstance(i, FunctionCallOutputItem)]


def _report(request: InferenceInput) -> str:
    """What each tool output was: `whole`, an error, or something else."""
    asked = {
        i.call_id: json.loads(i.arguments)
        for i in request.context.items
        if isinstance(i, FunctionCallItem)
    }
    seen = []
    for out in _outputs(request):
        wanted = asked[out.call_id]
        if out.is_error:
            seen.append(f"{out.call_id}: error: {out.output[:300]}")
        elif out.output == wanted["fill"] * wanted["size"]:
            seen.append(f"{out.call_id}: whole")
        else:
            seen.append(f"{out.call_id}: not the output: {out.output[:120]}")
    return "\n".join(seen)


def _blob(request: InferenceInput) -> InferenceOutput:
    if not _outputs(request):
        parts = PLAN.get("parts") or [(PLAN["size"], PLAN["fill"])]
        return calls(
            *(
                call("blob", call_id=f"b{n}", size=size, fill=fill)
                for n, (size, fill) in enumerate(parts)
            )
        )
    return text(_report(request))


def _answer(request: InferenceInput) -> InferenceOutput:
    return text(PLAN["answer"])


def _arguments(request: InferenceInput) -> InferenceOutput:
    if not _outputs(request):
        return calls(call("take", call_id="a1", data=PLAN["arguments"]))
    return text(f"took {_outputs(request)[0].output}")


def _steps(request: InferenceInput) -> InferenceOutput:
    done = _outputs(request)
    if len(done) < STEPS:
        return calls(call("step", call_id=f"s{len(done)}", n=len(done)))
    return text("; ".join(o.output for o in done))


def _steered(request: InferenceInput) -> InferenceOutput:
    """Call `blob` (which waits at the `steer` gate), then report the sizes of
    the user messages the model received."""
    if not _outputs(request):
        return calls(call("held", call_id="w1", size=1, fill="w"))
    sizes = [
        len(i.content)
        for i in request.context.items
        if isinstance(i, UserMessage) and isinstance(i.content, str)
    ]
    return text(f"user messages: {sizes}")


async def _slow(request: InferenceInput) -> InferenceOutput:
    """A model call that runs until its worker is being stopped, then until
    the test opens the `model` gate: it ends during the worker's shutdown."""
    SEEN.append({"model": "started", "attempt": activity.info().attempt})
    with anyio.fail_after(WAIT):
        while not activity.is_worker_shutdown():  # noqa: ASYNC110 - no event for it
            await anyio.sleep(0.05)
    SEEN.append({"model": "shutdown seen"})
    opened = await anyio.to_thread.run_sync(GATES["model"].wait, WAIT)
    SEEN.append({"model": "finished", "opened": opened})
    return text("answered during a deploy")


def _refuse(request: InferenceInput) -> InferenceOutput:
    """A provider error whose message is as long as planned (some providers
    echo the request in theirs)."""
    raise ProviderError(PLAN["error"], retryable=False)


def _progress(request: InferenceInput) -> InferenceOutput:
    if not _outputs(request):
        return calls(call("progress", call_id="p1"))
    out = _outputs(request)[0]
    return text(f"{'error' if out.is_error else 'ok'}: {out.output[:300]}")


def _far(request: InferenceInput) -> InferenceOutput:
    if not _outputs(request):
        return calls(call("far", call_id="f1"))
    out = _outputs(request)[0]
    return text(f"{'error' if out.is_error else 'ok'}: {out.output[:300]}")


_SCRIPTS = {
    "blob": _blob,
    "answer": _answer,
    "arguments": _arguments,
    "steps": _steps,
    "steered": _steered,
    "progress": _progress,
    "far": _far,
    "refuse": _refuse,
}


async def model_for(request: InferenceInput) -> InferenceOutput:
    name = request.model.partition(":")[2]
    if name == "slow":
        return await _slow(request)
    return _SCRIPTS[name](request)


PROVIDERS = {"fn": FunctionProvider(model_for)}


@tool
async def held(size: int, fill: str) -> str:
    """Wait for the `steer` gate, then return `fill` repeated `size` times."""
    SEEN.append({"tool": "held"})
    await anyio.to_thread.run_sync(GATES["steer"].wait, WAIT)
    return fill * size


BLOB = TemporalAgent(name="r2-blob", model="fn:blob", tools=[blob])
ANSWER = TemporalAgent(name="r2-answer", model="fn:answer")
ARGUMENTS = TemporalAgent(name="r2-arguments", model="fn:arguments", tools=[take])
STEPPER = TemporalAgent(name="r2-steps", model="fn:steps", tools=[step])
SLOW = TemporalAgent(name="r2-slow", model="fn:slow")
PROGRESS = TemporalAgent(
    name="r2-progress",
    model="fn:progress",
    tools=[progress],
    tool_options={
        "progress": ToolActivityOptions(heartbeat_timeout=timedelta(seconds=10))
    },
)
FAR = TemporalAgent(
    name="r2-far",
    model="fn:far",
    tools=[far],
    tool_options={"far": ToolActivityOptions(task_queue=NOWHERE)},
)
FAR_SOON = TemporalAgent(
    name="r2-far-soon",
    model="fn:far",
    tools=[far],
    tool_options={
        "far": ToolActivityOptions(
            task_queue=NOWHERE, schedule_to_start_timeout=timedelta(seconds=1)
        )
    },
)
STEERED = TemporalAgent(name="r2-steered", model="fn:steered", tools=[held])
REFUSE = TemporalAgent(name="r2-refuse", model="fn:refuse")
AGENTS = (
    BLOB,
    ANSWER,
    ARGUMENTS,
    STEPPER,
    SLOW,
    PROGRESS,
    FAR,
    FAR_SOON,
    STEERED,
    REFUSE,
)
