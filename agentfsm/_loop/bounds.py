"""What a loop takes from a model and from a tool: each value checked, its text
made encodable, its size bounded by the loop's limits.

A provider is user code (or a server's answer parsed by it) and may hand over
values pydantic never validated (`model_construct`): a loop publishes only what
it can publish faithfully, so a value of the wrong type fails the request with
a `ProviderError` naming the provider and the field. Text with lone surrogates
is escaped (`agentfsm._text.encodable`) before anything sees it, so the model,
the events, the event log and the store all hold the same text. The limits are
`LoopOptions` fields (`max_output_calls`, `max_output_chars`,
`max_stream_seconds`, `max_tool_output_chars`); exceeding one fails the
request with `OutputLimitExceeded`, naming it, except a tool output, which the
model gets as an error output instead.

The common case costs a type test and an O(1) `str.isascii` per field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, TypeAlias

from agentfsm import _text
from agentfsm.exceptions import OutputLimitExceeded, ProviderError
from agentfsm.inference import (
    InferenceOutput,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
)
from agentfsm.messages import (
    FunctionCallItem,
    ModelMessageItem,
    ReasoningItem,
    TokenUsage,
    UserMessage,
)

if TYPE_CHECKING:
    from agentfsm.options import LoopOptions

__all__ = ("checked_delta", "checked_output", "checked_tool_output", "checked_user")

_TEXT: Final[dict[type[Any], tuple[str, ...]]] = {
    FunctionCallItem: ("call_id", "name", "arguments"),
    ModelMessageItem: ("content",),
    ReasoningItem: ("content",),
    TextDelta: ("text",),
    ReasoningDelta: ("text",),
    ToolCallDelta: ("arguments",),
}
"""Each checked model's fields that must hold a str."""
_OPTIONAL_TEXT: Final[dict[type[Any], tuple[str, ...]]] = {
    FunctionCallItem: (),
    ModelMessageItem: ("refusal",),
    ReasoningItem: ("encrypted_content",),
    TextDelta: (),
    ReasoningDelta: (),
    ToolCallDelta: ("call_id", "name"),
}
"""Each checked model's fields that hold a str or None."""
_USAGE: Final = tuple(TokenUsage.model_fields)

Delta: TypeAlias = TextDelta | ReasoningDelta | ToolCallDelta


def checked_output(
    output: InferenceOutput, model: str, options: LoopOptions
) -> InferenceOutput:
    """`output` as the loop may take it: every item of a known type with fields
    of their types, its text encodable, within the loop's limits.

    Raises:
        ProviderError: a value of the wrong type (naming the provider and field).
        OutputLimitExceeded: more calls or characters than the loop allows.
    """
    items = output.items
    if not isinstance(items, tuple | list):
        raise _bad(model, "items", items, "a tuple of items")
    cleaned: list[Any] | None = None
    calls = chars = 0
    for index, item in enumerate(items):
        kind = type(item)
        if kind not in _TEXT or kind in (TextDelta, ReasoningDelta, ToolCallDelta):
            raise _bad(model, f"items[{index}]", item, "an output item")
        fixed, size = _checked(item, kind, model, f"items[{index}]")
        chars += size
        if kind is FunctionCallItem:
            calls += 1
        if fixed is not item or cleaned is not None:
            cleaned = cleaned if cleaned is not None else list(items[:index])
            cleaned.append(fixed)
    if calls > options.max_output_calls:
        raise OutputLimitExceeded(
            f"the output of {model!r} has {calls} function calls, more than "
            f"max_output_calls={options.max_output_calls}",
            limit="max_output_calls",
        )
    if chars > options.max_output_chars:
        raise _too_long(model, chars, options.max_output_chars)
    _check_rest(output, model)
    if cleaned is None and type(items) is tuple:
        return output
    return output.model_copy(
        update={"items": tuple(cleaned if cleaned is not None else items)}
    )


def checked_delta(
    delta: Delta, model: str, options: LoopOptions, chars: int
) -> tuple[Delta, int]:
    """A stream's chunk as the loop may publish it, and the characters the
    stream has sent so far with it (`chars` before it).

    Raises:
        ProviderError: a chunk of the wrong type or with fields of wrong types.
        OutputLimitExceeded: the stream sent more than `max_output_chars`.
    """
    kind = type(delta)
    if kind not in (TextDelta, ReasoningDelta, ToolCallDelta):
        raise ProviderError(
            f"the stream from {model!r} sent a {kind.__name__}, "
            "not a TextDelta, ReasoningDelta, ToolCallDelta or OutputCompleted"
        )
    if kind is ToolCallDelta:
        index = delta.__dict__.get("index")
        if type(index) is not int:
            raise _bad(model, "ToolCallDelta.index", index, "an int")
    fixed, size = _checked(delta, kind, model, kind.__name__)
    chars += size
    if chars > options.max_output_chars:
        raise _too_long(model, chars, options.max_output_chars)
    return fixed, chars


def checked_tool_output(
    name: str, output: str, is_error: bool, options: LoopOptions
) -> tuple[str, bool]:
    """A tool's output as the context may hold it: encodable, and an error
    output instead when it has more than `max_tool_output_chars` characters
    (the call ran; only its output is not kept)."""
    if len(output) > options.max_tool_output_chars:
        message = (
            f"the output of tool {name!r} has {len(output):,} characters, more than "
            f"the loop's max_tool_output_chars={options.max_tool_output_chars:,}; "
            "it was not kept"
        )
        return message, True
    return _text.encodable(output), is_error


def checked_user(message: UserMessage) -> UserMessage:
    """A user's message as the context may hold it: its text encodable."""
    content = message.content
    if content.isascii():
        return message
    safe = _text.encodable(content)
    return message if safe is content else message.model_copy(update={"content": safe})


def _checked(value: Any, kind: type[Any], model: str, where: str) -> tuple[Any, int]:
    """`value` with its text fields checked and made encodable, and the
    characters they hold."""
    fields = value.__dict__
    size = 0
    update: dict[str, str] | None = None
    for name in _TEXT[kind]:
        text = fields.get(name)
        if type(text) is not str:
            raise _bad(model, f"{where}.{name}", text, "a str")
        size += len(text)
        if not text.isascii():
            safe = _text.encodable(text)
            if safe is not text:
                update = update or {}
                update[name] = safe
    for name in _OPTIONAL_TEXT[kind]:
        text = fields.get(name)
        if text is None:
            continue
        if type(text) is not str:
            raise _bad(model, f"{where}.{name}", text, "a str or None")
        size += len(text)
        if not text.isascii():
            safe = _text.encodable(text)
            if safe is not text:
                update = update or {}
                update[name] = safe
    if update is None:
        return value, size
    return value.model_copy(update=update), size


def _check_rest(output: InferenceOutput, model: str) -> None:
    usage = output.token_usage
    if usage is not None:
        if type(usage) is not TokenUsage:
            raise _bad(model, "token_usage", usage, "a TokenUsage or None")
        for name in _USAGE:
            count = usage.__dict__.get(name)
            if type(count) is not int or count < 0:
                raise _bad(model, f"token_usage.{name}", count, "an int >= 0")
    reason = output.finish_reason
    if reason is not None and type(reason) is not str:
        raise _bad(model, "finish_reason", reason, "a str or None")
    raw = output.raw_response
    if raw is not None and not _is_json(raw):
        raise _bad(model, "raw_response", raw, "JSON data")


def _is_json(value: Any) -> bool:
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) is list:
        return all(_is_json(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _is_json(v) for k, v in value.items())
    return False


def _bad(model: str, field: str, value: Any, expected: str) -> ProviderError:
    try:
        shown = _text.encodable(repr(value))
    except Exception:  # noqa: BLE001 - a broken repr is the provider's, not the loop's
        shown = "<unprintable>"
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ProviderError(
        f"the provider for {model!r} returned an output the loop cannot publish: "
        f"{field} is {type(value).__name__} {shown}, not {expected}"
    )


def _too_long(model: str, chars: int, limit: int) -> OutputLimitExceeded:
    return OutputLimitExceeded(
        f"the output of {model!r} has more than {limit:,} characters "
        f"(max_output_chars; {chars:,} so far)",
        limit="max_output_chars",
    )
