"""The Anthropic provider: Claude through the Messages API.

Install with `pip install 'agentfsm[anthropic]'`; `anthropic:<model>`
(`anthropic:claude-sonnet-4-5`) is built in and reads `ANTHROPIC_API_KEY` (or
`ANTHROPIC_AUTH_TOKEN`) and `ANTHROPIC_BASE_URL`.

| agentfsm                       | Messages API                                            |
|--------------------------------|---------------------------------------------------------|
| `ModelContext.instructions`    | `system`                                                |
| `UserMessage`                  | a `text` block of a `user` message                      |
| `ModelMessageItem`             | a `text` block of an `assistant` message                |
| `ReasoningItem`                | a `thinking` block (its `signature` is `encrypted_content`), or a `redacted_thinking` block |
| `FunctionCallItem`             | a `tool_use` block of an `assistant` message            |
| `FunctionCallOutputItem`       | a `tool_result` block of a `user` message               |

Consecutive items of one role form one message, so a turn's thinking, text and
tool calls are one assistant message, and the outputs of its calls one user
message of `tool_result` blocks (before any text the user adds). Empty text is
left out, since the API rejects empty text blocks. A `ReasoningItem` without
`encrypted_content` is not sent: the API accepts thinking only with its signature.

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
- `structured_output`: `output_config.format` with a JSON schema (a pydantic
  model's through the SDK's `transform_schema`, a dict as given).

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

from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final, Literal, Self, TypeAlias, assert_never

import anyio
from anthropic import AsyncAnthropic, transform_schema
from anthropic.lib.streaming import AsyncMessageStream
from anthropic.types import (
    InputJSONDelta,
    Message,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
)
from anthropic.types import TextDelta as AnthropicTextDelta
from pydantic import BaseModel
from pydantic_core import to_json

from agentfsm.exceptions import ConfigurationError, ProviderError, ProviderTimeout
from agentfsm.messages import (
    ContextItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ModelMessageItem,
    OutputItem,
    ReasoningItem,
    TokenUsage,
    UserMessage,
)
from agentfsm.providers import (
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    ReasoningDelta,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    split_model,
)
from agentfsm.providers._common import (
    count,
    env,
    error_detail,
    status_error,
    structured_schema,
    tool_input,
)

__all__ = (
    "DEFAULT_MAX_TOKENS",
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

ThinkingMode: TypeAlias = Literal["budget", "adaptive"]
"""How `reasoning_effort` turns into thinking: a token budget, or adaptive thinking."""

_VENDOR: Final = "Anthropic"
_CLOSE_TIMEOUT: Final = 5.0
_OFF: Final = frozenset({"none", "off", "disabled"})
_REDACTED: Final = "anthropic-redacted-thinking:"
"""Prefix of `encrypted_content` holding a `redacted_thinking` block's data
(no signature starts with it), so it goes back as the block it came as."""
_RETRYABLE_TYPES: Final = frozenset(
    {"overloaded_error", "rate_limit_error", "api_error"}
)
_FINISH_REASONS: Final[Mapping[str, str]] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
}
_ADAPTIVE_EFFORTS: Final[Mapping[str, str]] = {"minimal": "low"}


class AnthropicProvider:
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

    Example:
        ```python
        async with AnthropicProvider(api_key="sk-ant-...") as claude:
            async with Runtime(providers={"anthropic": claude}) as runtime:
                ...
        ```
    """

    __slots__ = ("_client", "_default_max_tokens", "_owns_client", "_thinking")

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
    ) -> None:
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
        if client is not None:
            if api_key is not None or base_url is not None:
                raise ConfigurationError(
                    "pass either client= or api_key=/base_url=, not both"
                )
            self._client = client
            self._owns_client = False
            return
        if api_key is None and not (
            env("ANTHROPIC_API_KEY") or env("ANTHROPIC_AUTH_TOKEN")
        ):
            raise ConfigurationError(
                "no Anthropic API key: set ANTHROPIC_API_KEY or pass api_key= "
                "(or pass a configured client=)"
            )
        self._client = AsyncAnthropic(
            api_key=api_key,
            base_url=base_url or env("ANTHROPIC_BASE_URL"),
            timeout=timeout if timeout is not None else anthropic.DEFAULT_TIMEOUT,
            max_retries=max_retries,
        )
        self._owns_client = True

    @property
    def client(self) -> AsyncAnthropic:
        """The SDK client the provider sends its requests with."""
        return self._client

    async def aclose(self) -> None:
        """Close the SDK client, if the provider created it."""
        if self._owns_client:
            await self._client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def request_params(self, request: InferenceInput) -> dict[str, Any]:
        """The arguments `client.messages.create` gets for `request`.

        Raises:
            ConfigurationError: `reasoning_effort` is not one this provider knows,
                or its budget does not fit under `max_output_tokens`.
        """
        params: dict[str, Any] = {
            "model": split_model(request.model)[1],
            "messages": _messages_of(request.context.items),
        }
        max_tokens = request.max_output_tokens or self._default_max_tokens
        if request.context.instructions:
            params["system"] = request.context.instructions
        if request.tools:
            params["tools"] = [
                {
                    "name": t.definition.name,
                    "description": t.definition.description,
                    "input_schema": t.definition.parameters,
                }
                for t in request.tools
            ]
        if request.tool_choice is not None:
            params["tool_choice"] = _tool_choice(request.tool_choice)
        output_config: dict[str, Any] = {}
        effort = request.reasoning_effort
        if effort is not None:
            if effort in _OFF:
                params["thinking"] = {"type": "disabled"}
            elif self._thinking == "adaptive":
                params["thinking"] = {"type": "adaptive"}
                output_config["effort"] = _ADAPTIVE_EFFORTS.get(effort, effort)
            else:
                budget = _budget(effort)
                if request.max_output_tokens is None:
                    max_tokens = budget + self._default_max_tokens
                elif budget >= max_tokens:
                    raise ConfigurationError(
                        f"the thinking budget for reasoning_effort {effort!r} "
                        f"({budget} tokens) must be below max_output_tokens "
                        f"({max_tokens})"
                    )
                params["thinking"] = {"type": "enabled", "budget_tokens": budget}
        if request.structured_output is not None:
            output_config["format"] = {
                "type": "json_schema",
                "schema": _output_schema(request.structured_output),
            }
        if output_config:
            params["output_config"] = output_config
        params["max_tokens"] = max_tokens
        return params

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        """Send the request and map the whole message.

        Raises:
            ProviderError: the API failed (`retryable` when it is transient).
            ProviderTimeout: the request timed out.
        """
        params = self.request_params(request)
        with _mapped_errors():
            message = await self._client.messages.create(**params)
        return _output_of(message)

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """Send the request streaming: text, thinking and tool-input deltas, then the output.

        Raises:
            ProviderError: the API failed (`retryable` when it is transient).
            ProviderTimeout: the request timed out.
        """
        params = self.request_params(request)
        with _mapped_errors():
            async with self._client.messages.stream(**params) as events:
                deltas = _deltas(events)
                try:
                    yield deltas
                finally:
                    # Shielded: the response is closed even when the loop is
                    # being cancelled, rather than left to the garbage collector.
                    with anyio.move_on_after(_CLOSE_TIMEOUT, shield=True):
                        await deltas.aclose()
                        await events.close()


# --------------------------------------------------------------------- requests


def _messages_of(items: Sequence[ContextItem]) -> list[dict[str, Any]]:
    """The context as Messages API messages (consecutive items of a role merged)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        role, block = _block(item)
        if block is None:
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].append(block)
        else:
            messages.append({"role": role, "content": [block]})
    for message in messages:
        if message["role"] == "user":  # tool results go before any text
            message["content"].sort(key=lambda b: b["type"] != "tool_result")
    return messages


def _block(item: ContextItem) -> tuple[str, dict[str, Any] | None]:
    if isinstance(item, UserMessage):
        return "user", _text(item.content)
    if isinstance(item, ModelMessageItem):
        return "assistant", _text(item.content or item.refusal or "")
    if isinstance(item, ReasoningItem):
        secret = item.encrypted_content
        if secret is None:
            return "assistant", None
        if secret.startswith(_REDACTED):
            return "assistant", {
                "type": "redacted_thinking",
                "data": secret.removeprefix(_REDACTED),
            }
        return "assistant", {
            "type": "thinking",
            "thinking": item.content,
            "signature": secret,
        }
    if isinstance(item, FunctionCallItem):
        return "assistant", {
            "type": "tool_use",
            "id": item.call_id,
            "name": item.name,
            "input": tool_input(item),
        }
    if isinstance(item, FunctionCallOutputItem):
        result: dict[str, Any] = {
            "type": "tool_result",
            "tool_use_id": item.call_id,
            "content": item.output,
        }
        if item.is_error:
            result["is_error"] = True
        return "user", result
    assert_never(item)


def _text(text: str) -> dict[str, Any] | None:
    return {"type": "text", "text": text} if text.strip() else None


def _tool_choice(choice: str) -> dict[str, Any]:
    if choice == "required":
        return {"type": "any"}
    if choice in ("auto", "none"):
        return {"type": choice}
    return {"type": "tool", "name": choice}


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


def _output_schema(output: type[BaseModel] | dict[str, Any]) -> dict[str, Any]:
    if isinstance(output, dict):
        return structured_schema(output)
    return transform_schema(output)


# ---------------------------------------------------------------------- outputs


def _output_of(message: Message) -> InferenceOutput:
    """A complete `Message` as an `InferenceOutput`."""
    items: list[OutputItem] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            items.append(ModelMessageItem(content="".join(text)))
            text.clear()

    for block in message.content:
        if isinstance(block, TextBlock):
            text.append(block.text)
            continue
        flush()
        if isinstance(block, ThinkingBlock):
            items.append(
                ReasoningItem(
                    content=block.thinking, encrypted_content=block.signature or None
                )
            )
        elif isinstance(block, RedactedThinkingBlock):
            items.append(
                ReasoningItem(content="", encrypted_content=_REDACTED + block.data)
            )
        elif isinstance(block, ToolUseBlock):
            arguments = to_json(block.input).decode()
            items.append(
                FunctionCallItem(call_id=block.id, name=block.name, arguments=arguments)
            )
    flush()
    stop_reason = message.stop_reason
    if stop_reason == "refusal":
        _mark_refusal(items, message)
    return InferenceOutput(
        items=tuple(items),
        token_usage=_usage_of(message.usage),
        raw_response=message.model_dump(mode="json", warnings=False),
        finish_reason=None
        if stop_reason is None
        else _FINISH_REASONS.get(stop_reason, stop_reason),
    )


def _mark_refusal(items: list[OutputItem], message: Message) -> None:
    details = getattr(message, "stop_details", None)
    refusal = getattr(details, "explanation", None) or "the model declined to answer"
    for index in range(len(items) - 1, -1, -1):
        item = items[index]
        if isinstance(item, ModelMessageItem):
            items[index] = item.model_copy(update={"refusal": refusal})
            return
    items.append(ModelMessageItem(content="", refusal=refusal))


def _usage_of(usage: Usage | None) -> TokenUsage | None:
    """The message's token counts (input includes cache reads and writes)."""
    if usage is None:
        return None
    cached = count(usage, "cache_read_input_tokens")
    return TokenUsage(
        input_tokens=count(usage, "input_tokens")
        + count(usage, "cache_creation_input_tokens")
        + cached,
        output_tokens=count(usage, "output_tokens"),
        reasoning_tokens=count(
            getattr(usage, "output_tokens_details", None), "thinking_tokens"
        ),
        cached_input_tokens=cached,
    )


async def _deltas(
    events: AsyncMessageStream[Any],
) -> AsyncGenerator[StreamEvent, None]:
    calls: dict[int, int] = {}  # content block index -> call index, for tool_use
    with _mapped_errors():
        async for event in events:
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
        message = await events.get_final_message()
    yield OutputCompleted(output=_output_of(message))


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
            raise ProviderError(
                f"{_VENDOR} stream error: {f'{kind}: ' if kind else ''}{message}",
                retryable=kind in _RETRYABLE_TYPES,
            ) from exc
        raise status_error(_VENDOR, exc.status_code, kind, message) from exc
