"""What one model request is made of: its input, its output, the stream's deltas,
and the request as model wrappers see it.

Providers (`agentfsm.providers`) turn an `InferenceInput` into an
`InferenceOutput`, whole or as a stream of deltas ending with `OutputCompleted`.
These classes are re-exported from `agentfsm.providers` and `agentfsm`.
"""

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal, NamedTuple, TypeAlias, TypedDict

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetPydanticSchema,
    InstanceOf,
    JsonValue,
    PlainSerializer,
)
from pydantic_core import CoreSchema, core_schema

from agentfsm._images import MAX_IMAGE_BYTES
from agentfsm._models import read_fields_fast
from agentfsm.messages import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ImageBlock,
    ModelContext,
    ModelMessageItem,
    OutputItem,
    TokenUsage,
    UserMessage,
)
from agentfsm.tools import Tool

__all__ = (
    "NO_IMAGES",
    "TOOL_CHOICE_MODES",
    "ImageSupport",
    "InferenceInput",
    "InferenceOutput",
    "ItemSource",
    "ModelNext",
    "ModelRequest",
    "ModelSettings",
    "ModelWrapper",
    "OutputCompleted",
    "ReasoningDelta",
    "RequestMetadata",
    "StreamEvent",
    "StreamingDelta",
    "StructuredOutputMode",
    "TextDelta",
    "ToolCallDelta",
    "UsageUpdate",
)


def _tool_definition(tool: Tool) -> dict[str, Any]:
    return tool.definition.model_dump()


_ToolField: TypeAlias = Annotated[
    InstanceOf[Tool], PlainSerializer(_tool_definition, return_type=dict[str, Any])
]


def _tool_sequence(value: Any) -> tuple[Any, ...]:
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return tuple(value)
    raise ValueError(f"expected a sequence of tools, got {type(value).__name__}")


def _stop_sequences(value: Any) -> Any:
    """A single stop sequence as a one-item tuple; each sequence non-empty."""
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, Sequence) and any(s == "" for s in value):
        raise ValueError("a stop sequence cannot be empty")
    return value


def _unique_names(tools: tuple[Tool, ...]) -> tuple[Tool, ...]:
    """The tools, refused when two share a name: a call could run only one of
    them, and providers would be sent two functions of that name."""
    if len(tools) > 1 and len({tool.name for tool in tools}) < len(tools):
        names = [tool.name for tool in tools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"two tools are named {', '.join(map(repr, duplicates))}")
    return tools


def _json_schema(value: Any) -> Any:
    """A dict `structured_output`, refused when it is not a valid JSON schema
    (draft 2020-12, the draft answers are validated with) or has a `$ref` that
    does not resolve within it (nothing is ever fetched: see
    `agentfsm._jsonschema`). Unchecked, the model was called first, and the
    loop failed only on its answer, with jsonschema's error about the schema
    (`UnknownType`, `PointerToNowhere`)."""
    if isinstance(value, dict):
        # Imported here, like where answers are validated: jsonschema costs
        # ~50 ms, and only requests with a JSON-schema output need it.
        from agentfsm._jsonschema import SchemaProblem, check

        try:
            check(value, draft="2020-12")
        except SchemaProblem as exc:
            raise ValueError(f"not a valid JSON schema: {exc}") from None
    elif isinstance(value, type) and not issubclass(value, BaseModel):
        # `InstanceOf[type[BaseModel]]` takes any class: `int` reached the
        # loop, which failed on the answer with an AttributeError.
        raise ValueError(  # noqa: TRY004 - pydantic reports a ValueError (not a TypeError) as a ValidationError
            f"a pydantic model class or a JSON schema dict, got the class {value.__name__}"
        )
    return value


def _model_name_schema(source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
    """A `str`, whose error says what to do with a provider object given instead
    (the README's Runtime snippet invites one): a request names its model (its
    record and a durable store keep the name), and the runtime's registry maps
    the name's prefix to the provider. Validation stays in pydantic-core: a
    Python validator here was ~1% of a run of `make bench-instructions`."""
    return core_schema.custom_error_schema(
        core_schema.str_schema(),
        custom_error_type="model_name",
        custom_error_message=(
            "model must be a 'provider:model' name (a str); to use a provider "
            "object, register it under a prefix, Runtime(providers={'mine': "
            "provider}), and pass model='mine:<model>' (an Agent takes a "
            "provider itself: Agent(provider))"
        ),
    )


StructuredOutputMode: TypeAlias = Literal["auto", "native", "tool", "prompted"]
"""How a request asks for its `structured_output` ([Structured output][structured-output-on-any-server]):

- `native`: the API's JSON-schema format (`response_format`, `text.format`,
  `output_config.format`; a grammar on the local model);
- `tool`: a final answer tool whose parameters are the schema, which the model
  must call; its arguments are the answer;
- `prompted`: the schema in the instructions, and a JSON response format where
  the API has one;
- `auto`: the provider's best, falling back to the next when a server refuses one.
"""

_RESERVED_BODY_KEYS: Final = frozenset({"model", "stream"})


def _extra_body(value: Any) -> Any:
    """`extra_body` checked: a JSON object with str keys, none of them a key
    the request sets through its own fields (`model`, `stream`)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(  # noqa: TRY004 - pydantic reports a ValueError as a ValidationError
            f"extra_body must be a JSON object (a dict), got {type(value).__name__}"
        )
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise ValueError(f"extra_body's keys must be str, got {bad[0]!r}")
    reserved = sorted(_RESERVED_BODY_KEYS.intersection(value))
    if reserved:
        raise ValueError(
            f"extra_body cannot set {', '.join(reserved)}: use the request's "
            "`model` and `streaming` fields"
        )
    return value


def _finite_body(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """Refuse a NaN or infinite number anywhere in `extra_body`: JSON has none,
    so the request could not be sent."""
    if value is None:
        return None
    # A stack, not recursion: the value is as deep as pydantic let it be.
    stack: list[tuple[str, Any]] = [(f"extra_body[{k!r}]", v) for k, v in value.items()]
    while stack:
        where, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(
                f"{where} is {item}, which JSON cannot carry: use a finite number"
            )
        if isinstance(item, dict):
            stack.extend((f"{where}[{k!r}]", v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(item))
    return value


_ExtraBody: TypeAlias = Annotated[
    dict[str, JsonValue] | None,
    BeforeValidator(_extra_body),
    AfterValidator(_finite_body),
]


def _tools_schema(_: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
    """What `Sequence[_ToolField]` validates (any sequence but a str, kept as a
    tuple), with the items checked by pydantic-core: the `Sequence` schema wraps
    their validation in a Python function, ~3 µs of every
    `InferenceInput(tools=[...])`. The names are checked last, once the items
    are known to be tools (~0.05 µs with one tool, ~0.25 µs with two)."""
    return core_schema.chain_schema(
        [
            core_schema.no_info_plain_validator_function(_tool_sequence),
            # An after-validator keeps the tuple's serializer (a plain one would not).
            core_schema.no_info_after_validator_function(
                _unique_names, handler(tuple[_ToolField, ...])
            ),
        ]
    )


TOOL_CHOICE_MODES: Final = frozenset({"auto", "required", "none"})
"""`InferenceInput.tool_choice` values that are modes; anything else names a tool."""


class InferenceInput(BaseModel):
    """Everything one model request needs: the model, its settings, tools and context.

    Example:
        ```python
        InferenceInput(model="openai:gpt-4.1-mini", context=ModelContext(), tools=[add])
        ```
    """

    model_config = ConfigDict(
        frozen=True, extra="forbid", arbitrary_types_allowed=True, defer_build=True
    )

    model: Annotated[str, GetPydanticSchema(_model_name_schema)]
    """`provider:model`, resolved by the runtime's provider registry (a provider
    object is registered there under a prefix: `Runtime(providers={...})`)."""
    context: ModelContext
    """The instructions and the conversation; the loop appends to it. Loops
    started on one `InferenceInput` share this context (they see each other's
    items): for one context per conversation, start them from an `Agent`."""
    max_output_tokens: int | None = Field(default=None, gt=0)
    """Upper bound on generated tokens."""
    reasoning_effort: str | None = None
    """Provider-specific reasoning effort (`low`, `medium`, `high`, ...)."""
    tools: Annotated[Sequence[_ToolField], GetPydanticSchema(_tools_schema)] = ()
    """Tools the model may call (kept as a tuple), each under a name of its own."""
    tool_choice: str | None = None
    """`auto`, `required`, `none`, or the name of one tool to force."""
    reset_tool_choice: Literal["auto", "none"] | None = None
    """What a forcing `tool_choice` (`required` or a tool's name) becomes once
    a tool has answered since the last user message: `"auto"` forces the tool
    once and then lets the model choose (the OpenAI Agents SDK's
    `reset_tool_choice`), `"none"` forces it once and then has the model answer
    (what small models need: given the choice, they call the tool again and
    again). `None`, the default, forces it on every request. Providers send
    `effective_tool_choice`."""
    temperature: float | None = Field(default=None, ge=0, le=2)
    """Sampling temperature (`None`: the provider's default; the local model's
    is 0.2). A hint: a provider without it (Anthropic) leaves it out."""
    top_p: float | None = Field(default=None, gt=0, le=1)
    """Nucleus sampling: sample from the smallest set of tokens whose
    probability adds up to `top_p`. A hint, like `temperature`."""
    seed: int | None = None
    """Seed for sampling, for repeatable outputs (best effort). A hint: the
    OpenAI Responses API and Anthropic have none and leave it out."""
    stop_sequences: Annotated[tuple[str, ...], BeforeValidator(_stop_sequences)] = ()
    """Text at which generation stops (not included in the output); a single
    string is one sequence. A provider without them (the OpenAI Responses API)
    refuses the request with a `ConfigurationError`, since they change the answer."""
    parallel_tool_calls: bool | None = None
    """Whether the model may ask for several tool calls in one output (`None`:
    the provider's default, which is yes). `False` on a provider that cannot
    limit a turn to one call (the local model) is a `ConfigurationError`."""
    streaming: bool = False
    """Take the `inference_streaming` path and publish each chunk."""
    structured_output: Annotated[
        InstanceOf[type[BaseModel]] | dict[str, Any] | None,
        AfterValidator(_json_schema),
    ] = None
    """A pydantic model or JSON schema the answer must follow (a schema is
    checked against JSON Schema draft 2020-12 here, before any model call; each
    `$ref` in it must resolve within it: nothing is ever fetched)."""
    structured_output_mode: StructuredOutputMode = "auto"
    """How the request asks for `structured_output` (see `StructuredOutputMode`);
    the mode used is published as `InferenceOutput.structured_output_mode`.
    Ignored without a `structured_output`."""
    extra_body: _ExtraBody = None
    """A JSON object merged into the request's body, for a server's own
    parameters (`top_k`, `min_p`, `chat_template_kwargs`, ...); its keys win
    over the ones agentfsm sets. The local model takes only the sampling
    parameters llama.cpp has (`agentfsm.providers.local`) and refuses others."""

    @property
    def effective_tool_choice(self) -> str | None:
        """The tool choice this request goes out with: `tool_choice`, or
        `reset_tool_choice` once a forced tool has answered (see there)."""
        choice = self.tool_choice
        if self.reset_tool_choice is None or choice in (None, "auto", "none"):
            return choice
        for item in reversed(self.context.items):
            if isinstance(item, FunctionCallOutputItem):
                return self.reset_tool_choice
            if isinstance(item, UserMessage):
                break
        return choice

    def tool_named(self, name: str) -> Tool | None:
        """The tool offered under `name`, if any."""
        for candidate in self.tools:
            if candidate.name == name:
                return candidate
        return None


class ModelSettings(TypedDict, total=False):
    """The settings of `InferenceInput` an `Agent` takes as `model_settings`.

    Each key is the `InferenceInput` field of the same name (see there for what
    each provider does with it).

    Example:
        ```python
        Agent("openai:gpt-4.1-mini", model_settings={"temperature": 0.2, "seed": 7})
        ```
    """

    temperature: float
    top_p: float
    seed: int
    stop_sequences: Sequence[str] | str
    parallel_tool_calls: bool
    max_output_tokens: int
    reasoning_effort: str
    tool_choice: str
    reset_tool_choice: Literal["auto", "none"] | None
    structured_output_mode: StructuredOutputMode
    extra_body: dict[str, JsonValue]


class InferenceOutput(BaseModel):
    """What one model request returned."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", populate_by_name=True, defer_build=True
    )

    items: tuple[OutputItem, ...] = ()
    """Reasoning, messages and function calls, in the order the model produced them."""
    token_usage: TokenUsage | None = None
    """Tokens the provider counted, when it reports them."""
    raw_response: JsonValue = Field(
        default=None, validation_alias=AliasChoices("raw_response", "rowResponse")
    )
    """The provider's response as JSON data (seed 001 spells it `rowResponse`)."""
    finish_reason: str | None = None
    """Why generation stopped (`stop`, `tool_calls`, `length`, ...), when known."""
    structured_output_mode: Literal["native", "tool", "prompted"] | None = None
    """The mode the request's structured output was asked in (what `auto`
    chose), as the built-in providers report it; `None` without a structured
    output, or from a provider that does not say."""
    images_described: tuple[str, ...] = ()
    """The tool-result images this request sent as a line of text each (their
    digests, or URLs), the model taking none there (`ImageSupport`)."""

    @property
    def function_calls(self) -> tuple[FunctionCallItem, ...]:
        """The function calls in the output, in order."""
        return tuple([i for i in self.items if isinstance(i, FunctionCallItem)])

    @property
    def message(self) -> ModelMessageItem | None:
        """The last message in the output, if any."""
        for item in reversed(self.items):
            if isinstance(item, ModelMessageItem):
                return item
        return None


class TextDelta(BaseModel):
    """A chunk of the model's message text."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    kind: Literal["text"] = "text"
    text: str


class ReasoningDelta(BaseModel):
    """A chunk of the model's reasoning."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    kind: Literal["reasoning"] = "reasoning"
    text: str


class ToolCallDelta(BaseModel):
    """A chunk of a function call: its id and name when first seen, then argument text."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    kind: Literal["tool_call"] = "tool_call"
    index: int
    """Which call of the output this chunk belongs to."""
    call_id: str | None = None
    name: str | None = None
    arguments: str = ""
    """Argument text to append."""


class OutputCompleted(BaseModel):
    """The end of a stream: the completed output."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    kind: Literal["completed"] = "completed"
    output: InferenceOutput


class UsageUpdate(BaseModel):
    """The request's token usage so far, as the server reported it mid-stream
    (Anthropic's `message_start`, a Chat Completions usage chunk).

    Optional: a stream need not send one, and the loop publishes none. Each
    replaces the one before (counts so far, not increments). When a stream
    ends without its output (cancelled, failed, timed out), the loop adds the
    last one to its usage, so the tokens already spent are not lost; a
    completed stream's usage is its output's `token_usage`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    kind: Literal["usage"] = "usage"
    usage: TokenUsage


StreamingDelta: TypeAlias = Annotated[
    TextDelta | ReasoningDelta | ToolCallDelta, Field(discriminator="kind")
]
"""A chunk published as `inference.stream`."""

StreamEvent: TypeAlias = (
    TextDelta | ReasoningDelta | ToolCallDelta | UsageUpdate | OutputCompleted
)
"""What a provider's stream yields; the last one is `OutputCompleted`."""


@dataclass(frozen=True, slots=True)
class ImageSupport:
    """Where a model takes images: what a provider's optional
    `image_support(model)` returns. A provider without that method is sent
    every image it is given.

    The loop refuses a user message holding an image its model cannot take
    before the message enters the context (`ImageNotSupported`); a tool
    result's image the model cannot take is sent as a line of text instead.
    """

    user_messages: bool = True
    """Images in user messages."""
    tool_results: bool = True
    """Images in tool results."""
    urls: bool = True
    """Images by URL (the server fetches them), beside images as bytes."""
    max_bytes: int = MAX_IMAGE_BYTES
    """The largest image it takes, in bytes."""

    def lacking(self, block: ImageBlock, *, tool_result: bool = False) -> str | None:
        """What a model of this support lacks to take `block` in a user message
        (or in a tool result), as `ImageNotSupported.capability` names it;
        `None` when it takes it."""
        if not (self.tool_results if tool_result else self.user_messages):
            return (
                "images in tool results" if tool_result else "images in user messages"
            )
        if block.url is not None and not self.urls:
            return "images by URL"
        if block.size is not None and block.size > self.max_bytes:
            return f"images over {self.max_bytes:,} bytes"
        return None

    def refusal(self, message: UserMessage) -> tuple[str, str] | None:
        """`(capability, block)` of the first image of a user message a model of
        this support cannot take (as `ImageNotSupported` names them), or None."""
        content = message.content
        if type(content) is str:
            return None
        for index, block in enumerate(content):
            if type(block) is ImageBlock:
                lacking = self.lacking(block)
                if lacking is not None:
                    return lacking, f"content[{index}] {block.reference}"
        return None


NO_IMAGES: Final = ImageSupport(user_messages=False, tool_results=False, urls=False)
"""A model that takes no image anywhere (a text-only model)."""


class ItemSource(NamedTuple):
    """Where one item of a request's context came from."""

    kind: Literal["history", "repair"]
    """`history`: an item of the loop's context; `repair`: a synthetic output
    for a function call that had none."""
    item_index: int
    """For history, the item's index in the context; for a repair, the index of
    the function call it answers."""
    call_id: str | None = None
    """For a repair, the call it answers."""


class RequestMetadata:
    """What the loop knows about a request: never sent to the provider.

    `sources[i]` tells where `request.context.items[i]` came from; it is built
    only when asked for, since most requests never need it.
    """

    __slots__ = ("_sources", "history_count", "repairs")

    def __init__(
        self, history_count: int, repairs: Sequence[tuple[int, int, str]] = ()
    ) -> None:
        self.history_count = history_count
        """How many items the loop's context held when the request was made."""
        self.repairs = tuple(repairs)
        """`(position in the request, index of the call, call_id)` per synthetic output."""
        self._sources: tuple[ItemSource, ...] | None = None

    @property
    def sources(self) -> tuple[ItemSource, ...]:
        """One `ItemSource` per item of the request's context, in order."""
        if self._sources is None:
            sources: list[ItemSource] = []
            history = 0
            repairs = iter(self.repairs)
            repair = next(repairs, None)
            while history < self.history_count or repair is not None:
                if repair is not None and repair[0] == len(sources):
                    sources.append(ItemSource("repair", repair[1], repair[2]))
                    repair = next(repairs, None)
                else:
                    sources.append(ItemSource("history", history))
                    history += 1
            self._sources = tuple(sources)
        return self._sources

    def __repr__(self) -> str:
        return f"RequestMetadata(history_count={self.history_count}, repairs={self.repairs})"


class ModelRequest(BaseModel):
    """One model request as model wrappers see it."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", arbitrary_types_allowed=True, defer_build=True
    )

    input: InferenceInput
    """What the provider will be sent."""
    metadata: InstanceOf[RequestMetadata]
    """Where each item came from; never sent to the provider."""
    streaming: bool
    """Whether the request streams (chunks are published as they come)."""
    loop_id: str
    agent_id: str


ModelNext: TypeAlias = Callable[[ModelRequest], Awaitable[InferenceOutput]]
"""Runs the rest of the chain (the inner wrappers, then the provider)."""

ModelWrapper: TypeAlias = Callable[
    [ModelRequest, ModelNext], Awaitable[InferenceOutput]
]
"""`async def wrapper(request, next) -> InferenceOutput` around each model request.

Wrappers run in registration order, the first outermost. A wrapper may change
the request (`await next(request.model_copy(update={"input": ...}))`), answer
without calling the provider (a cache), or call `next` again (retry).
"""

read_fields_fast(globals())
