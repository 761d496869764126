"""The Anthropic provider: Claude through the Messages API.

Install with `pip install 'agentfsm[anthropic]'`; `anthropic:<model>`
(`anthropic:claude-sonnet-4-6`) is built in and reads `ANTHROPIC_API_KEY` (or
`ANTHROPIC_AUTH_TOKEN`) and `ANTHROPIC_BASE_URL`.

| agentfsm                       | Messages API                                            |
|--------------------------------|---------------------------------------------------------|
| `ModelContext.instructions`    | `system`                                                |
| `UserMessage`                  | `text` (and `image`) blocks of a `user` message         |
| `ModelMessageItem`             | a `text` block of an `assistant` message                |
| `ReasoningItem`                | a `thinking` block (its `signature` is `encrypted_content`), or a `redacted_thinking` block |
| `FunctionCallItem`             | a `tool_use` block of an `assistant` message            |
| `FunctionCallOutputItem`       | a `tool_result` block of a `user` message (its content `text` and `image` blocks, with images) |

Consecutive items of one role form one message, so a turn's thinking, text and
tool calls are one assistant message, and the outputs of its calls one user
message of `tool_result` blocks (before any text the user adds). Empty text is
left out, since the API rejects empty text blocks. A `ReasoningItem` without
`encrypted_content` is not sent: the API accepts thinking only with its signature.

Images ([Images][images-in-messages-and-tool-results]): an `image` block of
the bytes (`base64` source) or of the URL (`url` source), in a user message
or in a tool result, up to 5 MiB of base64 each (3,932,160 bytes: `IMAGE_SUPPORT`); the models in
`TEXT_ONLY_MODELS` take none (`NO_IMAGES`), and `images=` overrides the answer
for every model. A request holding a user message's image its model cannot
take raises `ImageNotSupported` before anything is sent; a tool's image it
cannot take (a larger one, say) is sent as a line of text, its reference, and
named by the output's `images_described`.

Request settings:

- `max_output_tokens` is `max_tokens`, which the API requires: `None` sends
  `default_max_tokens` (4096), plus the thinking budget when thinking is on.
- `reasoning_effort` turns thinking on. With `thinking="budget"` (the default)
  it is a token budget: `minimal` 1024, `low` 2048, `medium` 8192, `high` 16384,
  `xhigh` and `max` 32768 (`THINKING_BUDGETS`), or a number of tokens given as
  text (`"3000"`). With `thinking="adaptive"` (for models that decide how much to
  think) it is `thinking: {"type": "adaptive"}` and `output_config.effort`.
  `none` turns thinking off.
- `tool_choice`: `auto` → `auto`, `required` → `any`, `none` → `none`, a tool's
  name → that tool.
- `stop_sequences` is `stop_sequences`.
- `parallel_tool_calls=False` is `tool_choice.disable_parallel_tool_use` (on an
  `auto` choice when the request forces none).
- `temperature`, `top_p` and `seed` are not sent: the Messages API takes no
  sampling settings (the model samples as it was tuned to). They are hints, so
  an agent tuned for another provider still runs here.
- `structured_output`, by `structured_output_mode`
  ([Structured output][structured-output-on-any-server]): `native` is `output_config.format` with
  a JSON schema (a pydantic model's through the SDK's `transform_schema`, a
  dict as given); `tool` a final answer tool (`final_result`), forced unless
  thinking is on (the API refuses a forced tool then), whose input becomes the
  answer's message; `prompted` the schema in `system`. `auto` is native, then
  tool, then prompted: a mode the API refuses (a 400 naming it, as older
  models do for `output_config.format`) is skipped from then on, for that model.
- `extra_body` is merged into the request body (its keys win).

`stop_reason` maps onto `finish_reason`: `end_turn`/`stop_sequence` → `stop`,
`tool_use` → `tool_calls`, `max_tokens`/`model_context_window_exceeded` →
`length`, `refusal` → `content_filter` (the message then has its `refusal` set);
others pass through. Errors: 429, 529 (overloaded), 408/409, other 5xx,
connection failures and `overloaded_error`/`rate_limit_error`/`api_error`
events in a stream raise `ProviderError(retryable=True)`, timeouts
`ProviderTimeout`, other HTTP errors `ProviderError(retryable=False)` with the
API's message.
"""

from __future__ import annotations

try:
    import anthropic
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "agentfsm.providers.anthropic needs the Anthropic SDK: "
        "pip install 'agentfsm[anthropic]'"
    ) from exc

from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final, Literal, TypeAlias

from anthropic import AsyncAnthropic
from anthropic.lib.streaming import AsyncMessageStream
from anthropic.types import (
    InputJSONDelta,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    ThinkingDelta,
    ToolUseBlock,
)
from anthropic.types import TextDelta as AnthropicTextDelta

from agentfsm.exceptions import ConfigurationError, ProviderError, ProviderTimeout
from agentfsm.providers import (
    NO_IMAGES,
    ImageSupport,
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    ReasoningDelta,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    UsageUpdate,
    split_model,
)
from agentfsm.providers import _anthropic_messages as mapping
from agentfsm.providers._common import (
    ImageMapping,
    OwnedClient,
    close_stream,
    env,
    error_detail,
    image_override,
    next_or_none,
    status_error,
    stream_error,
    text_only,
)
from agentfsm.providers._structured import NATIVE_FIRST, Mode, Modes, Plan

__all__ = (
    "DEFAULT_MAX_TOKENS",
    "IMAGE_SUPPORT",
    "TEXT_ONLY_MODELS",
    "THINKING_BUDGETS",
    "AnthropicProvider",
    "ThinkingMode",
)

DEFAULT_MAX_TOKENS: Final = 4096
"""`max_tokens` when the request sets no `max_output_tokens` (the API needs one)."""

THINKING_BUDGETS: Final[Mapping[str, int]] = {
    "minimal": 1024,
    "low": 2048,
    "medium": 8192,
    "high": 16384,
    "xhigh": 32768,
    "max": 32768,
}
"""Thinking budget in tokens per `reasoning_effort` (`thinking="budget"`)."""

IMAGE_SUPPORT: Final = ImageSupport(max_bytes=5 * 1024 * 1024 * 3 // 4)
"""Where Claude takes images: in user messages and tool results, by bytes or
URL, up to 3,932,160 bytes each: the Messages API's 5 MiB limit applies to an
image's base64, a third longer than its bytes."""

TEXT_ONLY_MODELS: Final = ("claude-2*", "claude-instant*")
"""Models that take no image (a trailing `*`: every name that starts so), for
which `image_support` answers `NO_IMAGES`: Claude 2 and Claude Instant."""

ThinkingMode: TypeAlias = Literal["budget", "adaptive"]
"""How `reasoning_effort` turns into thinking: a token budget, or adaptive thinking."""

_VENDOR: Final = "Anthropic"
_ANTHROPIC_HOST: Final = "api.anthropic.com"
_OFF: Final = frozenset({"none", "off", "disabled"})
_RETRYABLE_TYPES: Final = frozenset(
    {"overloaded_error", "rate_limit_error", "api_error"}
)
_ADAPTIVE_EFFORTS: Final[Mapping[str, str]] = {"minimal": "low"}


class AnthropicProvider(OwnedClient[AsyncAnthropic]):
    """Serves `anthropic:<model>` through Anthropic's Messages API.

    Args:
        api_key: the API key (default: `ANTHROPIC_API_KEY`, or
            `ANTHROPIC_AUTH_TOKEN` for a bearer token).
        base_url: the API's URL (default: `ANTHROPIC_BASE_URL`, else Anthropic's).
        client: a ready `AsyncAnthropic` client, instead of `api_key`/`base_url`
            (the provider then leaves closing it to you).
        timeout: seconds a request may take (default: the SDK's).
        max_retries: the SDK's own retries; the loop already retries transient
            errors, so the default is none.
        default_max_tokens: `max_tokens` for requests without `max_output_tokens`.
        thinking: how `reasoning_effort` maps onto thinking (see the module).
        images: where every model takes images, instead of what
            `image_support` knows of Claude (`IMAGE_SUPPORT`; `NO_IMAGES` for
            `TEXT_ONLY_MODELS`), e.g. for a proxy with limits of its own.

    Example:
        ```python
        async with AnthropicProvider(api_key="sk-ant-...") as claude:
            async with Runtime(providers={"anthropic": claude}) as runtime:
                ...
        ```
    """

    __slots__ = ("_default_max_tokens", "_images", "_modes", "_thinking")

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        client: AsyncAnthropic | None = None,
        timeout: float | None = None,
        max_retries: int = 0,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        thinking: ThinkingMode = "budget",
        images: ImageSupport | None = None,
    ) -> None:
        self._images = image_override(images)
        if default_max_tokens <= 0:
            raise ConfigurationError(
                f"default_max_tokens must be positive, got {default_max_tokens}"
            )
        if thinking not in ("budget", "adaptive"):
            raise ConfigurationError(
                f"thinking must be 'budget' or 'adaptive', got {thinking!r}"
            )
        self._default_max_tokens = default_max_tokens
        self._thinking: ThinkingMode = thinking
        if not self._given(client, api_key, base_url):
            if api_key is None and not (
                env("ANTHROPIC_API_KEY") or env("ANTHROPIC_AUTH_TOKEN")
            ):
                raise ConfigurationError(
                    "no Anthropic API key: set ANTHROPIC_API_KEY or pass api_key= "
                    "(or pass a configured client=)"
                )
            self._made(
                AsyncAnthropic(
                    api_key=api_key,
                    base_url=base_url or env("ANTHROPIC_BASE_URL"),
                    timeout=(
                        timeout if timeout is not None else anthropic.DEFAULT_TIMEOUT
                    ),
                    max_retries=max_retries,
                )
            )
        self._modes = Modes(
            NATIVE_FIRST, vendor=self._client.base_url.host == _ANTHROPIC_HOST
        )

    def image_support(self, model: str) -> ImageSupport:
        """Where `model` (`provider:model`) takes images: the `images=` given to
        the provider, else `NO_IMAGES` for the models in `TEXT_ONLY_MODELS`,
        else `IMAGE_SUPPORT`."""
        if self._images is not None:
            return self._images
        if text_only(model, TEXT_ONLY_MODELS):
            return NO_IMAGES
        return IMAGE_SUPPORT

    def _image_mapping(self, request: InferenceInput) -> ImageMapping:
        return ImageMapping(request.model, self.image_support(request.model))

    def request_params(
        self, request: InferenceInput, *, mode: Mode | None = None
    ) -> dict[str, Any]:
        """The arguments `client.messages.create` gets for `request`, its
        structured output asked for in `mode` (default: the first mode the
        provider tries).

        Raises:
            ConfigurationError: `reasoning_effort` is not one this provider knows,
                or its budget does not fit under `max_output_tokens`.
            ImageNotSupported: a user message holds an image the model cannot take.
        """
        plan = self._modes.plan(request, mode)
        return self._params(request, plan, self._image_mapping(request))

    def _params(
        self, request: InferenceInput, plan: Plan | None, images: ImageMapping
    ) -> dict[str, Any]:
        params: dict[str, Any] = {
            "model": split_model(request.model)[1],
            "messages": mapping.messages_of(request.context.items, images),
        }
        max_tokens = request.max_output_tokens or self._default_max_tokens
        instructions = request.context.instructions
        if plan is not None and plan.instructions is not None:
            instructions = plan.instructions
        if instructions:
            params["system"] = instructions
        definitions = [t.definition.model_dump() for t in request.tools]
        final = None if plan is None else plan.final
        if final is not None:
            definitions.append(final.definition)
        if definitions:
            params["tools"] = [
                {
                    "name": d["name"],
                    "description": d["description"],
                    "input_schema": d["parameters"],
                }
                for d in definitions
            ]
        # `temperature`, `top_p` and `seed` are left out: the Messages API has
        # no sampling settings (see the module docstring).
        if request.stop_sequences:
            params["stop_sequences"] = list(request.stop_sequences)
        choice = request.effective_tool_choice
        if final is not None:
            choice = final.choice
            if request.reasoning_effort not in (None, *_OFF):
                # With thinking on, the API refuses a forced tool: the model
                # chooses, and a text answer is validated like any other.
                choice = "auto"
        sent = mapping.tool_choice(
            choice, parallel=request.parallel_tool_calls if request.tools else None
        )
        if sent is not None:
            params["tool_choice"] = sent
        output_config: dict[str, Any] = {}
        if request.reasoning_effort is not None:
            thinking, effort, max_tokens = self._thinking_of(
                request.reasoning_effort, request.max_output_tokens
            )
            params["thinking"] = thinking
            if effort is not None:
                output_config["effort"] = effort
        if (
            plan is not None
            and plan.mode == "native"
            and request.structured_output is not None
        ):
            output_config["format"] = {
                "type": "json_schema",
                "schema": mapping.output_schema(request.structured_output),
            }
        if output_config:
            params["output_config"] = output_config
        params["max_tokens"] = max_tokens
        if request.extra_body is not None:
            params["extra_body"] = request.extra_body
        return params

    def _thinking_of(
        self, effort: str, max_output_tokens: int | None
    ) -> tuple[dict[str, Any], str | None, int]:
        """`(thinking, output_config effort, max_tokens)` for a reasoning effort."""
        max_tokens = max_output_tokens or self._default_max_tokens
        if effort in _OFF:
            return {"type": "disabled"}, None, max_tokens
        if self._thinking == "adaptive":
            return (
                {"type": "adaptive"},
                _ADAPTIVE_EFFORTS.get(effort, effort),
                max_tokens,
            )
        budget = _budget(effort)
        if max_output_tokens is None:
            max_tokens = budget + self._default_max_tokens  # thinking counts toward it
        elif budget >= max_tokens:
            raise ConfigurationError(
                f"the thinking budget for reasoning_effort {effort!r} "
                f"({budget} tokens) must be below max_output_tokens ({max_tokens})"
            )
        return {"type": "enabled", "budget_tokens": budget}, None, max_tokens

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        """Send the request and map the whole message.

        Raises:
            ProviderError: the API failed (`retryable` when it is transient).
            ProviderTimeout: the request timed out.
        """
        return await self._modes.complete(request, self._complete)

    async def _complete(
        self, request: InferenceInput, plan: Plan | None
    ) -> InferenceOutput:
        images = self._image_mapping(request)
        params = self._params(request, plan, images)
        with _mapped_errors():
            message = await self._client.messages.create(**params)
        return images.output(mapping.output_of(message))

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """Send the request streaming: text, thinking and tool-input deltas, then the output.

        Raises:
            ProviderError: the API failed (`retryable` when it is transient).
            ProviderTimeout: the request timed out.
        """
        async with self._modes.stream(request, self._open) as deltas:
            yield deltas

    @asynccontextmanager
    async def _open(
        self, request: InferenceInput, plan: Plan | None
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        images = self._image_mapping(request)
        params = self._params(request, plan, images)
        with _mapped_errors():
            async with self._client.messages.stream(**params) as events:
                deltas = _deltas(events, images)
                try:
                    yield deltas
                finally:
                    await close_stream(deltas, events)


# --------------------------------------------------------------------- helpers


def _budget(effort: str) -> int:
    if effort.isdigit():
        return int(effort)
    try:
        return THINKING_BUDGETS[effort]
    except KeyError:
        known = ", ".join([*THINKING_BUDGETS, *sorted(_OFF)])
        raise ConfigurationError(
            f"unknown reasoning_effort {effort!r} for Anthropic: use one of {known}, "
            "or a number of thinking tokens"
        ) from None


async def _deltas(
    events: AsyncMessageStream[Any], images: ImageMapping
) -> AsyncGenerator[StreamEvent, None]:
    calls: dict[int, int] = {}  # content block index -> call index, for tool_use
    with _mapped_errors():
        while (event := await next_or_none(events)) is not None:
            if isinstance(event, RawContentBlockStartEvent):
                block = event.content_block
                if isinstance(block, ToolUseBlock):
                    index = calls[event.index] = len(calls)
                    yield ToolCallDelta(index=index, call_id=block.id, name=block.name)
            elif isinstance(event, RawContentBlockDeltaEvent):
                delta = event.delta
                if isinstance(delta, AnthropicTextDelta) and delta.text:
                    yield TextDelta(text=delta.text)
                elif isinstance(delta, ThinkingDelta) and delta.thinking:
                    yield ReasoningDelta(text=delta.thinking)
                elif isinstance(delta, InputJSONDelta) and delta.partial_json:
                    call = calls.get(event.index)
                    if call is not None:
                        yield ToolCallDelta(index=call, arguments=delta.partial_json)
            elif isinstance(event, RawMessageStartEvent | RawMessageDeltaEvent):
                # The input tokens come first, the output's count at the end:
                # what a stream cancelled between them has spent (the SDK's
                # snapshot holds the counts so far).
                usage = mapping.usage_of(events.current_message_snapshot.usage)
                if usage is not None:
                    yield UsageUpdate(usage=usage)
        message = await events.get_final_message()
    yield OutputCompleted(output=images.output(mapping.output_of(message)))


@contextmanager
def _mapped_errors() -> Iterator[None]:
    """Turn the SDK's exceptions into agentfsm's."""
    try:
        yield
    except anthropic.APITimeoutError as exc:
        raise ProviderTimeout(f"{_VENDOR}: the request timed out") from exc
    except anthropic.APIConnectionError as exc:
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        raise ProviderError(f"{_VENDOR}: {exc.message}{cause}", retryable=True) from exc
    except anthropic.APIStatusError as exc:
        kind, message = error_detail(exc.body, exc.message)
        if exc.status_code < 400:  # an error event inside a streamed 200 response
            raise stream_error(
                _VENDOR, kind, message, retryable=kind in _RETRYABLE_TYPES
            ) from exc
        raise status_error(_VENDOR, exc.status_code, kind, message) from exc
