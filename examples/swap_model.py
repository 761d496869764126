"""Swapping the model for the next request with an interception handler.

Two `FunctionProvider`s are registered under two prefixes: `big:` and `cheap:`.
The loop starts on `big:large`. On `infer` (or `infer_streaming`) the payload is
the `InferenceInput` of the next request; after the first request the handler
returns `Rewrite(payload=...)` with the model changed to `cheap:mini`, so the
follow-up requests (which only read tool results) go to the cheap model. A
rewrite changes one request: the loop's own input still names `big:large`, so
the handler rewrites every request after the first.

Run it with `python examples/swap_model.py` (no network).
"""

from __future__ import annotations

import logging

import anyio
import structlog

from agentfsm import (
    Decision,
    FunctionCallOutputItem,
    FunctionProvider,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    PendingTransition,
    Rewrite,
    Runtime,
    Trigger,
    tool,
)
from agentfsm.testing import call, calls, text

# The library logs transitions at debug and never configures structlog itself.
structlog.configure(
    wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
)

served: list[str] = []
"""`provider -> model` for each request, in order."""


@tool
def search(query: str) -> str:
    """Search the docs."""
    return f"3 pages mention {query!r}"


def big(request: InferenceInput) -> InferenceOutput:
    """The expensive model: plans the first search."""
    served.append(f"big   served request {len(served) + 1} ({request.model})")
    return calls(call("search", query="pause"))


def cheap(request: InferenceInput) -> InferenceOutput:
    """The cheap model: one more search, then a summary of what was found."""
    served.append(f"cheap served request {len(served) + 1} ({request.model})")
    found = [
        i.output for i in request.context.items if isinstance(i, FunctionCallOutputItem)
    ]
    if len(found) < 2:
        return calls(call("search", query="resume"))
    return text("Summary: " + "; ".join(found) + ".")


def cheap_after_first(pending: PendingTransition) -> Decision | None:
    """After the first model request, send every request to `cheap:mini`."""
    if pending.trigger not in (Trigger.infer, Trigger.infer_streaming):
        return None
    request = pending.payload
    assert isinstance(request, InferenceInput)
    if pending.model_requests == 0:
        return None  # the first request plans: keep the big model
    return Rewrite(payload=request.model_copy(update={"model": "cheap:mini"}))


async def main() -> None:
    providers = {"big": FunctionProvider(big), "cheap": FunctionProvider(cheap)}
    async with Runtime(providers=providers) as runtime:
        request = InferenceInput(
            model="big:large", context=ModelContext(), tools=(search,)
        )
        loop_id = runtime.run_loop(
            "docs-agent", "How do I pause a loop?", request, cheap_after_first
        )
        result = await runtime.wait(loop_id)

    for line in served:
        print(line)
    print(f"outcome: {result.outcome} after {result.model_requests} model requests")
    print("answer:", result.answer.content if result.answer else None)


if __name__ == "__main__":
    anyio.run(main)
