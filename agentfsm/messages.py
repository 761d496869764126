"""Context items and the model context they live in.

Items are frozen pydantic models with a literal `type` discriminator; a
`ModelContext` holds the instructions and the items, in order. The context is
the one mutable thing: loops append to it, and appending is safe when several
loops share one context (each append is a single list operation between
checkpoints).
"""

from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from pydantic_core import from_json

from . import _models
from ._text import EncodableStr

__all__ = (
    "ContextItem",
    "ContextItemAdapter",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "ModelContext",
    "ModelMessageItem",
    "OutputItem",
    "ReasoningItem",
    "TokenUsage",
    "UserMessage",
)

_FROZEN = ConfigDict(frozen=True, extra="forbid", defer_build=True)


class UserMessage(BaseModel):
    """A message from the user (or from whoever drives the loop)."""

    model_config = _FROZEN

    type: Literal["user_message"] = "user_message"
    content: EncodableStr
    """The text of the message."""


class ModelMessageItem(BaseModel):
    """A message the model wrote: its answer, or text beside tool calls."""

    model_config = _FROZEN

    type: Literal["model_message"] = "model_message"
    content: EncodableStr
    """The text of the message."""
    refusal: EncodableStr | None = None
    """The model's refusal, when it declined to answer."""


class ReasoningItem(BaseModel):
    """The model's reasoning (or a summary of it), as the provider returned it."""

    model_config = _FROZEN

    type: Literal["reasoning"] = "reasoning"
    content: EncodableStr
    """Reasoning text, or a summary when the provider only returns one."""
    encrypted_content: str | None = None
    """Opaque reasoning state some providers want sent back unchanged."""


class FunctionCallItem(BaseModel):
    """The model asked to call a tool."""

    model_config = _FROZEN

    type: Literal["function_call"] = "function_call"
    call_id: EncodableStr
    """Identifies the call; its output carries the same id."""
    name: EncodableStr
    """The tool's name."""
    arguments: EncodableStr
    """The arguments as the model wrote them: a JSON object, as text."""

    def parsed_arguments(self) -> Any:
        """The arguments decoded from JSON (raises `ValueError` when they are not JSON)."""
        return from_json(self.arguments)


class FunctionCallOutputItem(BaseModel):
    """The output of a tool call, written to the context after the call."""

    model_config = _FROZEN

    type: Literal["function_call_output"] = "function_call_output"
    call_id: EncodableStr
    """The `call_id` of the `FunctionCallItem` this answers."""
    output: EncodableStr
    """What the tool returned, as text (JSON for non-string results), or the error."""
    is_error: bool = False
    """Whether the call failed (unknown tool, bad arguments, raised, timed out, denied)."""

    @classmethod
    def error(cls, call_id: str, message: str) -> "FunctionCallOutputItem":
        """An error output for a call."""
        return cls(call_id=call_id, output=message, is_error=True)


ContextItem: TypeAlias = Annotated[
    UserMessage
    | ModelMessageItem
    | ReasoningItem
    | FunctionCallItem
    | FunctionCallOutputItem,
    Field(discriminator="type"),
]
"""Anything a context can hold."""

OutputItem: TypeAlias = Annotated[
    FunctionCallItem | ReasoningItem | ModelMessageItem, Field(discriminator="type")
]
"""Anything a model's output can hold."""

ContextItemAdapter: TypeAdapter[ContextItem] = TypeAdapter(
    ContextItem, config=ConfigDict(defer_build=True)
)
"""(De)serializes one context item."""


class ModelContext(BaseModel):
    """The instructions and the conversation a loop sends to the model.

    Several loops may share one context; each appends its items as it goes.

    Example:
        ```python
        context = ModelContext(instructions="Be brief.")
        context.append(UserMessage(content="hi"))
        ```
    """

    model_config = ConfigDict(extra="forbid", defer_build=True)

    __slots__ = ("__weakref__", "_scan")  # weakref-able, as a model without slots is
    # The loops' scan for calls without outputs (`agentfsm._loop.repair.ContextScan`),
    # kept with the context so that a conversation run as one loop per message
    # does not rescan its whole history each time. A slot, not a pydantic
    # private attribute: those cost ~2 µs to set up in every `ModelContext()`
    # and ~3 µs to read (through the model's `__getattr__`).

    instructions: EncodableStr | None = None
    """The system prompt."""
    items: list[ContextItem] = Field(default_factory=list)
    """The conversation, oldest first."""

    def append(self, item: ContextItem) -> None:
        """Append one item."""
        self.items.append(item)

    def extend(self, items: Iterable[ContextItem]) -> None:
        """Append several items at once (they stay together even when loops share the context)."""
        self.items.extend(items)


class TokenUsage(BaseModel):
    """Tokens counted by the provider for one request, or summed over a loop.

    A request whose server reported no usage has `token_usage=None`, never a
    zero. A loop's total (`LoopResult.usage`, `LoopView.usage`, `loop.idle`)
    counts what the requests reported and, in `unreported_requests`, how many
    reported nothing; `status` says which of the three cases a total is:

    ```python
    result = await runtime.wait(loop_id)
    if result.usage.status == "unknown":
        print("the server reported no usage")
    ```
    """

    model_config = _FROZEN

    input_tokens: int = 0
    """Tokens in the request."""
    output_tokens: int = 0
    """Tokens the model generated, reasoning included."""
    reasoning_tokens: int = 0
    """Of the output tokens, those spent on reasoning."""
    cached_input_tokens: int = 0
    """Of the input tokens, those served from the provider's cache."""
    unreported_requests: int = 0
    """In a sum: of the requests summed, how many reported no usage (their
    tokens are not counted above). 0 in one request's usage."""

    @property
    def total_tokens(self) -> int:
        """Input plus output tokens."""
        return self.input_tokens + self.output_tokens

    @property
    def status(self) -> Literal["complete", "partial", "unknown"]:
        """Whether the counts cover every request summed: `complete` (each
        reported its usage, or there was none), `partial` (some reported none:
        the counts are a lower bound) or `unknown` (some reported none and no
        token is counted: what the requests used is not known)."""
        if not self.unreported_requests:
            return "complete"
        if self.input_tokens or self.output_tokens:
            return "partial"
        return "unknown"

    def __str__(self) -> str:
        """`12 in + 3 out = 15 total`, `... (1 request reported none)` for a
        partial sum, `unknown (not reported)` when nothing is counted."""
        unreported = self.unreported_requests
        if unreported and not (self.input_tokens or self.output_tokens):
            return "unknown (not reported)"
        text = (
            f"{self.input_tokens} in + {self.output_tokens} out = "
            f"{self.total_tokens} total"
        )
        if unreported:
            noun = "request" if unreported == 1 else "requests"
            text += f" ({unreported} {noun} reported none)"
        return text

    def __add__(self, other: "TokenUsage") -> "TokenUsage":
        values = {
            "input_tokens": self.input_tokens + other.input_tokens,
            "output_tokens": self.output_tokens + other.output_tokens,
            "reasoning_tokens": self.reasoning_tokens + other.reasoning_tokens,
            "cached_input_tokens": self.cached_input_tokens + other.cached_input_tokens,
            "unreported_requests": self.unreported_requests + other.unreported_requests,
        }
        return _models.trusted(TokenUsage, values, set(values))
