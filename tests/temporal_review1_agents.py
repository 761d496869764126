"""The agents tests/test_temporal_review1.py attacks the workflow with:
continue-as-new of paused and running loops, closures sharing a name, a
failed loop whose result is near the payload limit.

Each model answers from the context it is sent, never from a counter, so a
run that took a loop up from the run before answers as the first would.
"""

from __future__ import annotations

import asyncio  # noqa: TID251 - the tool waits in the worker's asyncio loop
import re
from collections.abc import Callable

from pydantic import BaseModel

from agentfsm import (
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    ModelMessageItem,
    PendingTransition,
    TokenUsage,
    UserMessage,
    after_turns,
    tool,
    tool_called,
)
from agentfsm.events import AgentEvent
from agentfsm.interception import Abort, Decision
from agentfsm.providers.function import FunctionProvider
from agentfsm.temporal import TemporalAgent
from agentfsm.testing import call, calls, text


@tool
async def step(n: int) -> str:
    """Take step `n`."""
    return f"step {n} taken"


@tool(needs_approval=True)
async def pay(amount: int) -> str:
    """Pay `amount` (needs approval)."""
    return f"paid {amount}"


BULK = 200_000
"""Characters of each `bulk` output: under every inline limit (a payload, a
`StoreContexts`' 256 KiB `by_reference`), but ten of them make a context of
2 MB."""


@tool
async def bulk(n: int) -> str:
    """Fetch page `n` (a large one)."""
    return f"page {n} " + "b" * BULK


GATE: dict[str, asyncio.Event] = {}
"""`gated_step(n)` waits for `GATE["open"]` (set by the test) at `n == GATED`
(the worker runs in the test's process and event loop)."""
GATED = 11


@tool
async def gated_step(n: int) -> str:
    """Take step `n` (the `GATED`th waits for the test)."""
    if n == GATED:
        await GATE["open"].wait()
    return f"step {n} taken"


_STEPS = re.compile(r"take (\d+) steps")
USAGE = TokenUsage(input_tokens=3, output_tokens=2)
"""What each of the counter's responses reports."""


def counter_model(request: InferenceInput, tool_name: str = "step") -> InferenceOutput:
    """Takes as many steps as the last "take <n> steps" message asks, one
    call a turn, then answers with the steps of the whole loop."""
    items = request.context.items
    last_ask = max(
        i
        for i, item in enumerate(items)
        if isinstance(item, UserMessage) and _STEPS.search(item.text)
    )
    asked = items[last_ask]
    assert isinstance(asked, UserMessage)
    wanted = int(_STEPS.search(asked.text).group(1))  # type: ignore[union-attr]
    taken = [i for i in items[last_ask:] if isinstance(i, FunctionCallOutputItem)]
    total = sum(isinstance(i, FunctionCallOutputItem) for i in items)
    if len(taken) < wanted:
        return calls(call(tool_name, call_id=f"s{total}", n=total), usage=USAGE)
    notes = [
        i.text
        for i in items
        if isinstance(i, UserMessage) and i.text.startswith("note ")
    ]
    return text(f"took {total} steps; notes: {','.join(notes)}", usage=USAGE)


def payer_model(request: InferenceInput) -> InferenceOutput:
    """Asks to pay, then answers with the payment and the steering messages
    the context holds."""
    items = request.context.items
    paid = [i for i in items if isinstance(i, FunctionCallOutputItem)]
    if not paid:
        return calls(call("pay", call_id="p1", amount=7))
    notes = [
        i.text
        for i in items
        if isinstance(i, UserMessage) and i.text.startswith("note ")
    ]
    return text(f"{paid[-1].output}; {len(notes)} notes: {','.join(notes)}")


class Steps(BaseModel):
    """The structured answer of `r1_structured`."""

    steps: int


def structured_model(request: InferenceInput) -> InferenceOutput:
    """The counter, answering `Steps` as JSON; its first answer is prose, which
    the loop refuses (a structured-output retry), its second JSON."""
    out = counter_model(request)
    if out.items[0].type == "function_call":
        return out
    total = sum(isinstance(i, FunctionCallOutputItem) for i in request.context.items)
    retried = any(
        isinstance(i, ModelMessageItem) and i.content.startswith("I took")
        for i in request.context.items
    )
    if not retried:
        return text(f"I took {total} steps")
    return text(f'{{"steps": {total}}}')


def gated_model(request: InferenceInput) -> InferenceOutput:
    """The counter, calling `gated_step`."""
    return counter_model(request, "gated_step")


def bulky_model(request: InferenceInput) -> InferenceOutput:
    """The counter, calling `bulk`."""
    return counter_model(request, "bulk")


def model_for(request: InferenceInput) -> InferenceOutput:
    kind = request.model.partition(":")[2]
    models: dict[str, Callable[[InferenceInput], InferenceOutput]] = {
        "counter": counter_model,
        "payer": payer_model,
        "structured": structured_model,
        "bulky": bulky_model,
        "gated": gated_model,
    }
    return models[kind](request)


PROVIDERS = {"fn": FunctionProvider(model_for)}

SEEN: list[AgentEvent] = []
"""The events the subscribed agents' subscriber received (worker process)."""


def _watcher(label: str) -> Callable[[PendingTransition], Decision | None]:
    """A handler that lets every transition through; two made by this factory
    share one `__qualname__` (`_watcher.<locals>.watch`)."""

    def watch(pending: PendingTransition) -> Decision | None:
        assert label  # each closure holds its own label
        return None

    return watch


def _aborter(after: int) -> Callable[[PendingTransition], Decision | None]:
    """A handler that aborts the loop once it made `after` tool calls; two
    made by this factory share one `__qualname__`, and differ."""

    def abort(pending: PendingTransition) -> Decision | None:
        if pending.tool_calls >= after:
            return Abort(reason=f"{after} tool calls")
        return None

    return abort


BIG_ERROR = 800_000
"""Characters of the message the failing handler raises with: the failed
loop's result carries it twice (about 1.6 MB, under the payload limit), the
workflow's failure three times (its message and the result)."""


def _explode(pending: PendingTransition) -> Decision | None:
    raise RuntimeError("x" * BIG_ERROR)


OWN_LIMIT = 6
"""Where the second closure of `r1_own_handlers` and of `r1_own_stops` ends the
loop (tool calls, model requests): in a run after the first."""

COUNTER = TemporalAgent(
    name="r1_counter",
    model="fn:counter",
    tools=[step],
    options={"max_turns": 100},
    subscribers=[SEEN.append],
)
GATED_COUNTER = TemporalAgent(
    name="r1_gated_counter",
    model="fn:gated",
    tools=[gated_step],
    options={"max_turns": 100},
    subscribers=[SEEN.append],
)
PAYER = TemporalAgent(
    name="r1_payer", model="fn:payer", tools=[pay], subscribers=[SEEN.append]
)
CLOSURES = TemporalAgent(
    name="r1_closures",
    model="fn:counter",
    tools=[step],
    handlers=[_watcher("a"), _watcher("b")],
    options={"max_turns": 100},
)
TWO_STOPS = TemporalAgent(
    name="r1_two_stops",
    model="fn:counter",
    tools=[step],
    options={
        "max_turns": 100,
        # agentfsm's own factory: two conditions, one `__qualname__`.
        "stop_when": [tool_called("submit"), tool_called("give_up")],
    },
)
OWN_HANDLERS = TemporalAgent(
    name="r1_own_handlers",
    model="fn:counter",
    tools=[step],
    handlers=[_aborter(100), _aborter(OWN_LIMIT)],
    options={"max_turns": 100},
)
OWN_STOPS = TemporalAgent(
    name="r1_own_stops",
    model="fn:counter",
    tools=[step],
    # agentfsm's own factory: two conditions, one `__qualname__`, that differ.
    options={"max_turns": 100, "stop_when": [after_turns(100), after_turns(OWN_LIMIT)]},
)
BIG_FAILURE = TemporalAgent(
    name="r1_big_failure", model="fn:counter", tools=[step], handlers=[_explode]
)
STRUCTURED = TemporalAgent(
    name="r1_structured",
    model="fn:structured",
    tools=[step],
    settings={"structured_output": Steps},
)
DEADLINE = 20.0
"""Seconds `r1_payer_deadline`'s loops may take, pauses included: enough for
a paused loop to continue as new first on a loaded machine."""
PAYER_DEADLINE = TemporalAgent(
    name="r1_payer_deadline",
    model="fn:payer",
    tools=[pay],
    options={"deadline": DEADLINE},
)
BULKY = TemporalAgent(
    name="r1_bulky", model="fn:bulky", tools=[bulk], options={"max_turns": 100}
)
AGENTS = (
    COUNTER,
    GATED_COUNTER,
    PAYER,
    CLOSURES,
    TWO_STOPS,
    OWN_HANDLERS,
    OWN_STOPS,
    BIG_FAILURE,
    STRUCTURED,
    PAYER_DEADLINE,
    BULKY,
)
