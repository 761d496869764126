"""The agents tests/test_temporal_defense.py runs as workflows: loops fed bad
input, watched by subscribers that misbehave, ending in every outcome, and
swapping models.

The models are `FunctionProvider`s that answer from the context they are sent
(what it holds), never from a counter, as in tests/temporal_agents.py.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import anyio

from agentfsm import (
    Abort,
    Decision,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    LoopState,
    PendingTransition,
    Rewrite,
    Trigger,
    UserMessage,
    tool,
)
from agentfsm.events import AgentEvent
from agentfsm.exceptions import ProviderError
from agentfsm.providers.function import FunctionProvider
from agentfsm.temporal import TemporalAgent
from agentfsm.testing import call, calls, text


@tool(needs_approval=True)
async def transfer(amount: int) -> str:
    """Move money (needs approval)."""
    return f"moved {amount}"


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


release: dict[str, anyio.Event] = {}
"""`hold` returns once the test sets its key's event (the worker runs its
activities on the test's event loop)."""


def released(key: str) -> anyio.Event:
    return release.setdefault(key, anyio.Event())


@tool(timeout=60)
async def hold(key: str) -> str:
    """Wait until the test releases `key` (at most 30 s)."""
    with anyio.fail_after(30):
        await released(key).wait()
    return f"released {key}"


def _outputs(request: InferenceInput) -> list[FunctionCallOutputItem]:
    return [i for i in request.context.items if isinstance(i, FunctionCallOutputItem)]


def _users(request: InferenceInput) -> list[str]:
    return [i.text for i in request.context.items if isinstance(i, UserMessage)]


def approval_model(request: InferenceInput) -> InferenceOutput:
    """Asks for `transfer` once, then answers with every user message it saw."""
    if not _outputs(request):
        return calls(call("transfer", call_id="t1", amount=100))
    return text(" | ".join(_users(request)))


def seed_model(request: InferenceInput) -> InferenceOutput:
    if not _outputs(request):
        return calls(call("add", call_id="c1", a=2, b=3))
    return text(_outputs(request)[-1].output)


def hold_model(request: InferenceInput) -> InferenceOutput:
    if not _outputs(request):
        return calls(call("hold", call_id="h1", key=_users(request)[0]))
    return text(_outputs(request)[-1].output)


def broken_model(request: InferenceInput) -> InferenceOutput:
    raise ProviderError("the model is down", retryable=False)


def small_model(request: InferenceInput) -> InferenceOutput:
    """The agent's own model: the seed flow, answering as `small`."""
    if not _outputs(request):
        return calls(call("add", call_id="c1", a=2, b=3))
    return text(f"small({request.model}): {_outputs(request)[-1].output}")


def big_model(request: InferenceInput) -> InferenceOutput:
    """The model the swap sends the second request to, another provider's."""
    return text(f"big({request.model}): {_outputs(request)[-1].output}")


def _script(request: InferenceInput) -> InferenceOutput:
    name = request.model.partition(":")[2]
    return {
        "approval": approval_model,
        "seed": seed_model,
        "hold": hold_model,
        "broken": broken_model,
        "small": small_model,
    }[name](request)


PROVIDERS = {
    "dfn": FunctionProvider(_script),
    "bigco": FunctionProvider(big_model),
}


def swap_after_first(pending: PendingTransition) -> Decision | None:
    """The first request on the agent's model; the rest on another provider's."""
    if pending.trigger not in (Trigger.infer, Trigger.infer_streaming):
        return None
    request = pending.payload
    assert isinstance(request, InferenceInput)
    if pending.model_requests == 0:
        return None
    return Rewrite(payload=request.model_copy(update={"model": "bigco:large"}))


def refuse_tools(pending: PendingTransition) -> Decision | None:
    """Aborts the loop before any tool runs."""
    if pending.source is LoopState.inference and pending.trigger is Trigger.call_tools:
        return Abort("no tools today")
    return None


# ------------------------------------------------------------------ subscribers

seen: defaultdict[str, list[AgentEvent]] = defaultdict(list)
"""Each loop's events, as the `record` subscriber got them."""
failures: list[str] = []
"""The event types `flaky` raised on."""
files: dict[str, Path] = {}
"""Where `write_down` appends each event's type, by loop id (set by the test)."""


def record(event: AgentEvent) -> None:
    seen[event.loop_id].append(event)


def flaky(event: AgentEvent) -> None:
    """Raises on the loop's first transition, and only then."""
    if event.type == "loop.transition" and not failures:
        failures.append(event.type)
        raise RuntimeError("flaky subscriber: first transition")
    seen[event.loop_id].append(event)


def write_down(event: AgentEvent) -> None:
    """A side effect the sandbox forbids in workflow code (`open`)."""
    path = files.get(event.loop_id)
    if path is not None:
        # The builtin `open`, which the sandbox restricts in workflow code.
        with open(path, "a") as f:
            f.write(event.type + "\n")


APPROVAL = TemporalAgent(
    name="defense.approval",
    model="dfn:approval",
    tools=[transfer],
    subscribers=[record],
)
SEED = TemporalAgent(name="defense.seed", model="dfn:seed", tools=[add])
HOLD = TemporalAgent(name="defense.hold", model="dfn:hold", tools=[hold])
BROKEN = TemporalAgent(name="defense.broken", model="dfn:broken")
ABORTED = TemporalAgent(
    name="defense.aborted", model="dfn:seed", tools=[add], handlers=[refuse_tools]
)
FLAKY = TemporalAgent(
    name="defense.flaky", model="dfn:seed", tools=[add], subscribers=[flaky]
)
WRITER = TemporalAgent(
    name="defense.writer", model="dfn:seed", tools=[add], subscribers=[write_down]
)
SWAPPED = TemporalAgent(
    name="defense.swapped",
    model="dfn:small",
    tools=[add],
    handlers=[swap_after_first],
)
AGENTS = (APPROVAL, SEED, HOLD, BROKEN, ABORTED, FLAKY, WRITER, SWAPPED)
