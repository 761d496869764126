"""The agents tests/test_temporal_continue.py runs long enough to continue as
new: a loop of many one-call turns, and one paused for approval.

Each model answers from the context it is sent, never from a counter, so a
run that took the loop up from the run before answers as the first run would
have, and a context that arrived incomplete shows as a wrong answer.
"""

from __future__ import annotations

import re

from agentfsm import (
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    UserMessage,
    tool,
)
from agentfsm.events import AgentEvent
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


_STEPS = re.compile(r"take (\d+) steps")


def counter_model(request: InferenceInput) -> InferenceOutput:
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
        return calls(call("step", call_id=f"s{total}", n=total))
    return text(f"took {total} steps")


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


def model_for(request: InferenceInput) -> InferenceOutput:
    return {"counter": counter_model, "payer": payer_model}[
        request.model.partition(":")[2]
    ](request)


PROVIDERS = {"fn": FunctionProvider(model_for)}

SEEN: list[AgentEvent] = []
"""The events the counter's subscriber received (in the worker's process)."""

COUNTER = TemporalAgent(
    name="counter",
    model="fn:counter",
    tools=[step],
    options={"max_turns": 100},
    subscribers=[SEEN.append],
)
STREAMED = TemporalAgent(
    name="streamed_counter",
    model="fn:counter",
    tools=[step],
    settings={"streaming": True},
)
PAYER = TemporalAgent(name="payer", model="fn:payer", tools=[pay])
AGENTS = (COUNTER, STREAMED, PAYER)
