"""The agents tests/test_temporal_client.py runs: one per way a loop ends.

The models answer from the context they are sent, so a seeded loop shows its
seed in its answer.
"""

from __future__ import annotations

from agentfsm import (
    Abort,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    PendingTransition,
    ProviderError,
    Trigger,
    UserMessage,
    tool,
)
from agentfsm.providers.function import FunctionProvider
from agentfsm.temporal import TemporalAgent
from agentfsm.testing import call, calls, text


@tool(needs_approval=True)
async def transfer(amount: int) -> str:
    """Move money (needs approval)."""
    return f"moved {amount}"


def echo_model(request: InferenceInput) -> InferenceOutput:
    """Every user message of the context, in order, joined by `|`."""
    said = [i.content for i in request.context.items if isinstance(i, UserMessage)]
    return text("|".join(str(s) for s in said))


def approval_model(request: InferenceInput) -> InferenceOutput:
    items = request.context.items
    if not any(isinstance(i, FunctionCallOutputItem) for i in items):
        return calls(call("transfer", call_id="t1", amount=100))
    return text("done")


def broken_model(request: InferenceInput) -> InferenceOutput:
    raise ProviderError("the model is down", retryable=False)


def model_for(request: InferenceInput) -> InferenceOutput:
    """One provider for every agent: the model's name picks the script."""
    name = request.model.partition(":")[2]
    return {"echo": echo_model, "approval": approval_model, "broken": broken_model}[
        name
    ](request)


PROVIDERS = {"cl": FunctionProvider(model_for)}


def refuse_requests(pending: PendingTransition) -> Abort | None:
    """Aborts the loop before its first model request (deterministic: it
    runs in workflow code)."""
    if pending.trigger is Trigger.infer:
        return Abort(reason="requests are refused here")
    return None


ECHO = TemporalAgent(name="cl-echo", model="cl:echo")
INSTRUCTED = TemporalAgent(
    name="cl-instructed", model="cl:echo", instructions="Be brief."
)
APPROVAL = TemporalAgent(name="cl-approval", model="cl:approval", tools=[transfer])
BROKEN = TemporalAgent(name="cl-broken", model="cl:broken")
ABORTING = TemporalAgent(
    name="cl-aborting", model="cl:echo", handlers=[refuse_requests]
)
AGENTS = (ECHO, INSTRUCTED, APPROVAL, BROKEN, ABORTING)
