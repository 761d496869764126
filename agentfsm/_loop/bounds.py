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

_FIELDS: Final[dict[type[Any], tuple[str, tuple[tuple[str, bool], ...]]]] = {
    FunctionCallItem: (
        "function_call",
        (("call_id", False), ("name", False), ("arguments", False)),
    ),
    ModelMessageItem: ("model_message", (("content", False), ("refusal", True))),
    ReasoningItem: ("reasoning", (("content", False), ("encrypted_content", True))),
    TextDelta: ("text", (("text", False),)),
    ReasoningDelta: ("reasoning", (("text", False),)),
    ToolCallDelta: (
        "tool_call",
        (("arguments", False), ("call_id", True), ("name", True)),
    ),
}
"""Each checked model's discriminator (its `type` or `kind`), and its text
fields: `(name, whether it may be None)`."""
_ITEMS: Final = (FunctionCallItem, ModelMessageItem, ReasoningItem)
_USAGE: Final = tuple(TokenUsage.model_fields)
_MAX_DEPTH: Final = 200
"""How deep a raw response may nest (a provider's JSON is a few levels)."""

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
    values = output.__dict__
    # One pass that only reads, each kind spelled out, fields subscripted (a
    # loop over field names and `dict.get` cost ~4,000 instructions an output
    # more): the common output is well typed and ASCII. Anything else takes
    # `_cleaned_items`, which names the problem.
    calls = chars = 0
    clean = True
    try:
        items = values["items"]
        for item in items:
            kind = type(item)
            fields = item.__dict__
            if kind is ModelMessageItem:
                text = fields["content"]
                refusal = fields["refusal"]
                if (
                    type(text) is not str
                    or not text.isascii()
                    or fields["type"] != "model_message"
                    or (
                        refusal is not None
                        and (type(refusal) is not str or not refusal.isascii())
                    )
                ):
                    clean = False
                    break
                chars += len(text) if refusal is None else len(text) + len(refusal)
            elif kind is FunctionCallItem:
                call_id = fields["call_id"]
                name = fields["name"]
                arguments = fields["arguments"]
                if (
                    type(call_id) is not str
                    or type(name) is not str
                    or type(arguments) is not str
                    or not (
                        call_id.isascii() and name.isascii() and arguments.isascii()
                    )
                    or fields["type"] != "function_call"
                ):
                    clean = False
                    break
                chars += len(call_id) + len(name) + len(arguments)
                calls += 1
            else:  # reasoning (rarer), or not an output item
                clean = False
                break
        reason = values["finish_reason"]
        plain = (
            values["token_usage"] is None
            and values["raw_response"] is None
            and (reason is None or (type(reason) is str and reason.isascii()))
        )
    except (KeyError, TypeError, AttributeError):  # a field missing, not an item
        clean = plain = False
        items = values.get("items")
    if not clean:
        if not isinstance(items, tuple | list):
            raise _bad(model, "items", items, "a tuple of items")
        items, calls, chars = _cleaned_items(items, model)
    if calls > options.max_output_calls:
        raise OutputLimitExceeded(
            f"the output of {model!r} has {calls} function calls, more than "
            f"max_output_calls={options.max_output_calls}",
            limit="max_output_calls",
        )
    if chars > options.max_output_chars:
        raise _too_long(model, chars, options.max_output_chars)
    update = None if plain else _checked_rest(values, model)
    if not clean or type(items) is not tuple:
        update = update or {}
        update["items"] = tuple(items)
    return output if update is None else output.model_copy(update=update)


def _cleaned_items(items: Any, model: str) -> tuple[list[Any], int, int]:
    """`items` checked one by one (raising on the first of a wrong type) with
    their text made encodable, and their function calls and characters."""
    cleaned: list[Any] = []
    calls = chars = 0
    for index, item in enumerate(items):
        kind = type(item)
        if kind not in _ITEMS:
            raise _bad(model, f"items[{index}]", item, "an output item")
        fixed, size = _checked(item, kind, model, f"items[{index}]")
        chars += size
        calls += kind is FunctionCallItem
        cleaned.append(fixed)
    return cleaned, calls, chars


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
    if kind not in _FIELDS or kind in _ITEMS:
        raise ProviderError(
            f"the stream from {model!r} sent a {kind.__name__}, "
            "not a TextDelta, ReasoningDelta, ToolCallDelta or OutputCompleted"
        )
    if kind is ToolCallDelta:
        index = delta.__dict__.get("index")
        if type(index) is not int or index < 0:
            raise _bad(model, "ToolCallDelta.index", index, "an int >= 0")
    fixed, size = _checked(delta, kind, model, kind.__name__)
    chars += size
    if chars > options.max_output_chars:
        raise _too_long(model, chars, options.max_output_chars)
    return fixed, chars


def checked_tool_output(
    name: str, output: Any, is_error: Any, options: LoopOptions
) -> tuple[str, bool]:
    """A tool's output as the context may hold it: encodable, and an error
    output instead when it has more than `max_tool_output_chars` characters
    (the call ran; only its output is not kept)."""
    if type(output) is not str:  # a ToolResult built without validation
        return (
            f"tool {name!r} returned a {type(output).__name__} as output, not text",
            True,
        )
    if len(output) > options.max_tool_output_chars:
        message = (
            f"the output of tool {name!r} has {len(output):,} characters, more than "
            f"the loop's max_tool_output_chars={options.max_tool_output_chars:,}; "
            "it was not kept"
        )
        return message, True
    if type(is_error) is not bool:
        return f"tool {name!r} returned a {type(is_error).__name__} as is_error", True
    return _text.encodable(output), is_error


def checked_user(message: UserMessage) -> UserMessage:
    """A user's message as the context may hold it: its text encodable."""
    content = message.content
    safe = _text.encodable(content)
    return message if safe is content else message.model_copy(update={"content": safe})


def _checked(value: Any, kind: type[Any], model: str, where: str) -> tuple[Any, int]:
    """`value` with its text fields checked and made encodable, and the
    characters they hold."""
    fields = value.__dict__
    discriminator, texts = _FIELDS[kind]
    tag = "type" if kind in _ITEMS else "kind"
    if fields.get(tag) != discriminator:
        raise _bad(model, f"{where}.{tag}", fields.get(tag), repr(discriminator))
    size = 0
    update: dict[str, str] | None = None
    for name, nullable in texts:
        text = fields.get(name)
        if text is None and nullable:
            continue
        if type(text) is not str:
            expected = "a str or None" if nullable else "a str"
            raise _bad(model, f"{where}.{name}", text, expected)
        size += len(text)
        safe = _text.encodable(text)
        if safe is not text:
            update = update or {}
            update[name] = safe
    if update is None:
        return value, size
    return value.model_copy(update=update), size


def _checked_rest(values: dict[str, Any], model: str) -> dict[str, Any] | None:
    """Check an output's usage, finish reason and raw response; the fields to
    replace with encodable copies, if any."""
    update: dict[str, Any] | None = None
    usage = values.get("token_usage")
    if usage is not None:
        if type(usage) is not TokenUsage:
            raise _bad(model, "token_usage", usage, "a TokenUsage or None")
        counts = usage.__dict__
        for name in _USAGE:
            if not _count(counts.get(name)):
                raise _bad(
                    model, f"token_usage.{name}", counts.get(name), "an int >= 0"
                )
    reason = values.get("finish_reason")
    if reason is not None:
        if type(reason) is not str:
            raise _bad(model, "finish_reason", reason, "a str or None")
        safe = _text.encodable(reason)
        if safe is not reason:
            update = {"finish_reason": safe}
    raw = values.get("raw_response")
    if raw is not None:
        dirty = _json_scan(raw, _MAX_DEPTH)
        if dirty is None:
            raise _bad(
                model, "raw_response", raw, f"JSON data (at most {_MAX_DEPTH} deep)"
            )
        if dirty:
            update = update or {}
            update["raw_response"] = _text.encodable_data(raw)
    return update


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _json_scan(value: Any, depth: int) -> bool | None:
    """None when `value` is not JSON data (or nests deeper than `depth`), else
    whether one of its strings needs `encodable`."""
    kind = type(value)
    if kind is str:
        return not value.isascii() and _text.encodable(value) is not value
    if value is None or kind in (int, float, bool):
        return False
    if depth == 0 or kind not in (list, dict):
        return None
    dirty = False
    pairs = value.items() if kind is dict else enumerate(value)
    for key, v in pairs:
        if kind is dict:
            if type(key) is not str:
                return None
            dirty = dirty or _json_scan(key, 0) is True
        found = _json_scan(v, depth - 1)
        if found is None:
            return None
        dirty = dirty or found
    return dirty


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
