"""The agents tests/test_temporal_payload.py runs: tools and models whose
values are too large for one Temporal payload (2 MB by default).

Each model answers from the context it is sent, so a test reads from the
loop's answer what the model received: each tool output whole (`whole`), or
the error output that stood in for it.
"""

from __future__ import annotations

import json

from agentfsm import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    tool,
)
from agentfsm.providers.function import FunctionProvider
from agentfsm.temporal import TemporalAgent
from agentfsm.testing import call, calls, text

TWIN_SIZE = 1_200_000
"""Two outputs of this size fit one payload each, not one together."""
HUGE_SIZE = 2_600_000
"""One output of this size fits no payload."""
CHATTY_SIZE = 1_500_000
"""A model answer of this size fits one payload, not the loop's result (which
carries it twice)."""


@tool
async def blob(size: int, fill: str) -> str:
    """Return `fill` repeated `size` times."""
    return fill * size


def _report(request: InferenceInput) -> InferenceOutput:
    """Answer with what each tool output was: `whole`, or its error text."""
    asked = {
        i.call_id: json.loads(i.arguments)
        for i in request.context.items
        if isinstance(i, FunctionCallItem)
    }
    seen = []
    for out in request.context.items:
        if not isinstance(out, FunctionCallOutputItem):
            continue
        wanted = asked[out.call_id]
        if out.is_error:
            seen.append(f"{out.call_id}: error: {out.output}")
        elif out.output == wanted["fill"] * wanted["size"]:
            seen.append(f"{out.call_id}: whole")
        else:
            seen.append(f"{out.call_id}: {len(out.output)} chars, not the output")
    return text("\n".join(seen))


def twins_model(request: InferenceInput) -> InferenceOutput:
    """Two parallel calls whose outputs together exceed one payload."""
    if not any(isinstance(i, FunctionCallOutputItem) for i in request.context.items):
        return calls(
            call("blob", call_id="t1", size=TWIN_SIZE, fill="a"),
            call("blob", call_id="t2", size=TWIN_SIZE, fill="b"),
        )
    return _report(request)


def huge_model(request: InferenceInput) -> InferenceOutput:
    """One call whose output exceeds one payload."""
    if not any(isinstance(i, FunctionCallOutputItem) for i in request.context.items):
        return calls(call("blob", call_id="h1", size=HUGE_SIZE, fill="z"))
    return _report(request)


def chatty_model(request: InferenceInput) -> InferenceOutput:
    """An answer too large for the loop's result."""
    return text("x" * CHATTY_SIZE)


def model_for(request: InferenceInput) -> InferenceOutput:
    """One provider for every agent: the model's name picks the script."""
    name = request.model.partition(":")[2]
    return {"twins": twins_model, "huge": huge_model, "chatty": chatty_model}[name](
        request
    )


PROVIDERS = {"fn": FunctionProvider(model_for)}

TWINS = TemporalAgent(name="payload-twins", model="fn:twins", tools=[blob])
HUGE = TemporalAgent(name="payload-huge", model="fn:huge", tools=[blob])
CHATTY = TemporalAgent(name="payload-chatty", model="fn:chatty")
BOUNDED = TemporalAgent(
    name="payload-bounded",
    model="fn:huge",
    tools=[blob],
    options={"max_tool_output_chars": 1_000_000},
)
AGENTS = (TWINS, HUGE, CHATTY, BOUNDED)
