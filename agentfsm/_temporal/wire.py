"""What crosses Temporal's boundary: the workflow's start, the activities'
arguments and results, as JSON data (plain dicts for Temporal's default
converter, so no client needs a custom data converter).

The model request's context goes by reference (`InferArgs.base`,
`InferArgs.base_digest`): only the items the activity's context store has not
seen are sent, so each context item enters the workflow's history once, not
once per model request (temporalio/sdk-python#1890: the history, and the
payloads, would otherwise grow quadratically with the number of requests).
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from agentfsm.events import ToolSpec
from agentfsm.inference import InferenceOutput
from agentfsm.messages import ContextItem, UserMessage

__all__ = (
    "CONTEXT_MISSING",
    "ErrorData",
    "InferArgs",
    "InferResult",
    "StartLoop",
    "ToolArgs",
    "ToolOutcome",
    "chain_digest",
    "dump",
)

CONTEXT_MISSING: Final = "agentfsm.ContextMissing"
"""The `ApplicationError` type an inference activity raises when its context
store does not hold the prefix a request refers to (another worker's store, or
an evicted entry): the workflow then sends the whole context."""

_FROZEN = ConfigDict(frozen=True, extra="forbid")


def dump(model: BaseModel) -> dict[str, Any]:
    """A model as the JSON data Temporal's default converter carries."""
    return model.model_dump(mode="json")


def chain_digest(previous: str, item: ContextItem) -> str:
    """The digest of a context prefix ending with `item`: the previous prefix's
    digest chained with the item's JSON. The workflow and the activity's store
    compare these to agree on a prefix without sending it."""
    text = previous + item.model_dump_json()
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class StartLoop(BaseModel):
    """The workflow's input: which agent, the loop's id and first message."""

    model_config = _FROZEN

    agent: str
    loop_id: str
    message: UserMessage | None = None
    agent_id: str | None = None
    """Who the loop runs for (default: the agent's name)."""


class InferArgs(BaseModel):
    """One model request, as the inference activity receives it."""

    model_config = _FROZEN

    loop_id: str
    request: int
    """The loop's request number (1 for its first)."""
    model: str
    settings: dict[str, JsonValue] = Field(default_factory=dict)
    tools: tuple[ToolSpec, ...] = ()
    structured_output: dict[str, JsonValue] | None = None
    instructions: str | None = None
    streaming: bool = False
    base: int = 0
    """How many of the context's first items the activity's store holds already."""
    base_digest: str = ""
    """The chain digest of those `base` items ("" when `base` is 0)."""
    items: tuple[ContextItem, ...] = ()
    """The context's items from `base` on."""
    digests: tuple[str, ...] = ()
    """The chain digest after each of `items`."""


class ErrorData(BaseModel):
    """A provider error, carried back as data so that the loop's own retry
    rules (`max_retries`, `retryable`) decide, not Temporal's retry policy
    (which is for lost workers and timeouts)."""

    model_config = _FROZEN

    type: str
    message: str
    retryable: bool = False
    status_code: int | None = None


class InferResult(BaseModel):
    """The inference activity's result: the output, or the provider's error."""

    model_config = _FROZEN

    output: InferenceOutput | None = None
    error: ErrorData | None = None


class ToolArgs(BaseModel):
    """One tool call, as the tool activity receives it."""

    model_config = _FROZEN

    loop_id: str
    agent_id: str
    call_id: str
    name: str
    arguments: str
    request: int
    """The loop's request number whose output asked for the call."""
    position: int
    """The call's position in that output's batch."""
    idempotency_key: str
    """The same for the same call of the same loop, whatever the attempt (the
    loop's own, `agentfsm.current_call().idempotency_key`): a tool with side
    effects passes it on (a payment API's idempotency header, say)."""


class ToolOutcome(BaseModel):
    """What a tool activity returns (a raising tool is an error output, as in
    a loop outside Temporal: Temporal retries lost workers, not tool errors)."""

    model_config = _FROZEN

    output: str
    is_error: bool = False
    terminate: bool = False
