"""The agents tests/test_temporal.py runs as workflows, shared with the worker
subprocess of the crash test (tests/temporal_worker.py), and the benchmark's.

The model is a `FunctionProvider` that answers from the context it is sent
(how many tool outputs it holds), not from a counter: a worker that starts
after a crash answers the same, and a context that arrived incomplete (the
context is passed by reference) would show as a wrong answer.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import anyio

from agentfsm import (
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    LoopState,
    PendingTransition,
    Rewrite,
    TokenUsage,
    UserMessage,
    current_call,
    tool,
)
from agentfsm.providers.function import FunctionProvider
from agentfsm.temporal import TemporalAgent, ToolActivityOptions, local_activity
from agentfsm.testing import call, calls, text


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool(needs_approval=True)
async def transfer(amount: int) -> str:
    """Move money (needs approval)."""
    return f"moved {amount}"


CRASH_LOG = "AGENTFSM_TEMPORAL_CRASH_LOG"
"""The environment variable naming the file `slow_step` logs each attempt to."""


@tool(on_crash="retry", timeout=30)
async def slow_step(n: int) -> str:
    """A slow idempotent step: logs its start and end (with the attempt's
    process and its idempotency key), sleeping in between."""
    key = current_call().idempotency_key
    _log(n, "start", key)
    await anyio.sleep(1.5)
    _log(n, "done", key)
    return f"step {n} done"


def _log(n: int, event: str, key: str) -> None:
    entry = {"n": n, "event": event, "pid": os.getpid(), "key": key}
    with Path(os.environ[CRASH_LOG]).open("a") as f:
        f.write(json.dumps(entry) + "\n")


@tool(timeout=0.3)
async def stall() -> str:
    """Hangs past its timeout (on_crash="pause", the default)."""
    await anyio.sleep(10)
    return "never"


def _outputs(request: InferenceInput) -> int:
    return sum(isinstance(i, FunctionCallOutputItem) for i in request.context.items)


def seed_model(request: InferenceInput) -> InferenceOutput:
    """The seed flow: add(2, 3), then answer "5"."""
    if _outputs(request) == 0:
        return calls(
            call("add", call_id="c1", a=2, b=3),
            usage=TokenUsage(input_tokens=10, output_tokens=5),
        )
    return text("5", usage=TokenUsage(input_tokens=20, output_tokens=1))


def approval_model(request: InferenceInput) -> InferenceOutput:
    if _outputs(request) == 0:
        return calls(call("transfer", call_id="t1", amount=100))
    last = [i for i in request.context.items if isinstance(i, FunctionCallOutputItem)]
    return text(f"done: {last[-1].output}")


def slow_model(request: InferenceInput) -> InferenceOutput:
    done = _outputs(request)
    if done < 3:
        return calls(call("slow_step", call_id=f"s{done}", n=done))
    return text("all steps done")


def stall_model(request: InferenceInput) -> InferenceOutput:
    outputs = [
        i for i in request.context.items if isinstance(i, FunctionCallOutputItem)
    ]
    if not outputs:
        return calls(call("stall", call_id="h1"))
    return text(f"saw: {outputs[-1].output}")


BENCH_CALLS = ((1, 2), (3, 3), (6, 4))


def bench_model(request: InferenceInput) -> InferenceOutput:
    """bench/peers/harness.py's workload: add three times, then answer "10"."""
    done = _outputs(request)
    if done < len(BENCH_CALLS):
        a, b = BENCH_CALLS[done]
        return calls(call("add", call_id=f"a{done}", a=a, b=b))
    return text("10")


def model_for(request: InferenceInput) -> InferenceOutput:
    """One provider for every agent: the model's name picks the script."""
    name = request.model.partition(":")[2]
    return {
        "seed": seed_model,
        "approval": approval_model,
        "slow": slow_model,
        "bench": bench_model,
        "stall": stall_model,
    }[name](request)


PROVIDERS = {"fn": FunctionProvider(model_for)}

checked: list[str] = []
"""The triggers the `audit` local-activity handler saw (in the worker)."""


@local_activity
def audit(pending: PendingTransition) -> Rewrite | None:
    """An I/O handler (it writes down what it saw): run as a local activity.
    It rewrites the first user message, to show its decision is applied."""
    checked.append(str(pending.trigger))
    if pending.source is LoopState.idle and isinstance(pending.payload, UserMessage):
        return Rewrite(payload=UserMessage(content=pending.payload.text + "!"))
    return None


SEED = TemporalAgent(name="seed", model="fn:seed", tools=[add])
AUDITED = TemporalAgent(name="audited", model="fn:seed", tools=[add], handlers=[audit])
APPROVAL = TemporalAgent(
    name="approval",
    model="fn:approval",
    tools=[transfer],
    options={"deadline": timedelta(days=3).total_seconds()},
)
SLOW = TemporalAgent(
    name="slow",
    model="fn:slow",
    tools=[slow_step],
    # Heartbeats, so that a killed worker's call runs again within 1 s.
    tool_defaults=ToolActivityOptions(heartbeat_timeout=timedelta(seconds=1)),
)
STREAMED = TemporalAgent(
    name="streamed", model="fn:seed", tools=[add], settings={"streaming": True}
)
STALLED = TemporalAgent(name="stalled", model="fn:stall", tools=[stall])
BENCH = TemporalAgent(name="bench", model="fn:bench", tools=[add])
AGENTS = (SEED, AUDITED, APPROVAL, SLOW, STREAMED, STALLED, BENCH)
