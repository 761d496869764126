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

Call ids. The loop pairs calls with their outputs, approvals, denials and
answers by `call_id`, so every function call in a loop's context has an id of
its own: an output whose call repeats an id (of the same output or of a call
already in the context) or has an empty one gets that call renamed
(`unique_call_ids`), before anything publishes or stores the output. A loop
whose ids are unique pays, per output with calls, a set of their ids (a lookup
for one call) and a look at the items appended to its context since the
previous such output (the ids seen are kept with the loop, not searched for).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from pydantic import ValidationError

from agentfsm import _text
from agentfsm.exceptions import ConfigurationError, OutputLimitExceeded, ProviderError
from agentfsm.inference import (
    InferenceOutput,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
)
from agentfsm.messages import (
    FunctionCallItem,
    ImageBlock,
    ModelMessageItem,
    ReasoningItem,
    TextBlock,
    TokenUsage,
    UserMessage,
)

if TYPE_CHECKING:
    from agentfsm.options import LoopOptions

    from .loop import Loop

__all__ = (
    "RENAMED_MARK",
    "checked_delta",
    "checked_output",
    "checked_tool_output",
    "checked_usage",
    "checked_user",
    "unique_call_ids",
)

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


RENAMED_MARK: Final = "-"
"""What joins a renamed call's id to its number: `call_1` repeated becomes
`call_1-2`, an empty id `call-1` (a character every provider accepts in an
id, Anthropic's `^[a-zA-Z0-9_-]+$` included)."""


def checked_output(
    output: InferenceOutput,
    model: str,
    options: LoopOptions,
    loop: Loop | None = None,
) -> InferenceOutput:
    """`output` as the loop may take it: every item of a known type with fields
    of their types, its text encodable, within the loop's limits, and, given
    the `loop`, its calls' ids unique in the loop's context (`unique_call_ids`).

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
    ids: list[str] = []  # the calls' ids, for `loop` (a list: appending is cheap)
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
                ids.append(call_id)
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
        ids = [i.call_id for i in items if type(i) is FunctionCallItem]
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
    if calls and loop is not None:
        renamed = _with_unique_ids(items, ids, loop, model)
        if renamed is not None:
            update = update or {}
            update["items"] = renamed
    return output if update is None else output.model_copy(update=update)


def unique_call_ids(output: InferenceOutput, loop: Loop, model: str) -> InferenceOutput:
    """`output` (checked) with each call whose id is empty, or repeats an
    earlier call's of the output or of the loop's context, renamed: the id and
    the first free number after `RENAMED_MARK` (`call_1` -> `call_1-2`, `""`
    -> `call-1`). The new ids depend on the output and the context alone, so a
    recovered or replayed loop renames as the first run did; each renaming is
    logged (`call_ids_renamed`, warning).
    """
    items = output.items
    ids = [i.call_id for i in items if type(i) is FunctionCallItem]
    renamed = _with_unique_ids(items, ids, loop, model)
    return output if renamed is None else output.model_copy(update={"items": renamed})


def _with_unique_ids(
    items: Sequence[Any], ids: list[str], loop: Loop, model: str
) -> tuple[Any, ...] | None:
    """`items` (whose calls' ids are `ids`) with those ids made unique in the
    loop, or None when they are already."""
    taken = _context_ids(loop)
    if _unique(ids, taken):
        return None
    return _renamed_calls(items, taken, set(ids), loop, model)


def _unique(ids: list[str], taken: set[str]) -> bool:
    """Whether `ids` are non-empty, distinct, and none of them in `taken`."""
    if len(ids) == 1:  # the common case, without a set
        return bool(ids[0]) and ids[0] not in taken
    fresh = set(ids)
    return len(fresh) == len(ids) and "" not in fresh and fresh.isdisjoint(taken)


def _renamed_calls(
    items: Sequence[Any], taken: set[str], fresh: set[str], loop: Loop, model: str
) -> tuple[Any, ...]:
    """`items` (checked, their calls' ids `fresh`) with those ids made unique
    in the loop (see `unique_call_ids`), logging the renaming."""
    # Renamed in order, the first of a repeated id keeping it: what the model
    # meant by each call is unchanged, only which id the loop pairs it by.
    used: set[str] = set()
    result: list[Any] = []
    changes: list[tuple[int, str, str]] = []
    for index, item in enumerate(items):
        if type(item) is FunctionCallItem:
            call_id = item.call_id
            if not call_id or call_id in taken or call_id in used:
                new = _free_id(call_id, taken, used, fresh)
                changes.append((index, call_id, new))
                item = item.model_copy(update={"call_id": new})
                call_id = new
            used.add(call_id)
        result.append(item)
    loop.log.warning(
        "call_ids_renamed",
        model=model,
        renamed=[f"items[{i}]: {old!r} -> {new!r}" for i, old, new in changes],
    )
    return tuple(result)


def _free_id(call_id: str, *sets: set[str]) -> str:
    """The first of `call_id-2`, `call_id-3`, ... (`call-1`, `call-2`, ... for
    an empty id) in none of `sets`."""
    base, number = (call_id, 2) if call_id else ("call", 1)
    while True:
        candidate = f"{base}{RENAMED_MARK}{number}"
        if not any(candidate in ids for ids in sets):
            return candidate
        number += 1


def _context_ids(loop: Loop) -> set[str]:
    """The ids of the calls in the loop's context (`CallIds`, made with its
    first output holding calls), brought up to date from the items appended
    since the previous look (a context shorter than before, or another list,
    is read anew). In one function, not a method of the record: a call less
    per model output."""
    index = loop.call_ids
    items = loop.input.context.items
    if index is None:
        index = loop.call_ids = CallIds()
    ids = index.ids
    start = index.read
    if index.items is not items or len(items) < start:
        ids = index.ids = set()
        index.items = items
        start = 0
    elif start == len(items):
        return ids
    for item in items[start:]:
        if type(item) is FunctionCallItem:
            ids.add(item.call_id)
    index.read = len(items)
    return ids


class CallIds:
    """The ids of the calls in a loop's context, kept with the loop
    (`_context_ids` keeps them up to date; a recovered loop's are read from
    its restored context)."""

    __slots__ = ("ids", "items", "read")

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.items: list[Any] | None = None
        """The item list `ids` was read from."""
        self.read = 0
        """How many of its items `ids` has read."""


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
            "not a TextDelta, ReasoningDelta, ToolCallDelta, UsageUpdate or "
            "OutputCompleted"
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
    """A user's message as the context may hold it: its text encodable, its
    blocks validated ones (a handler may have built it without validation).

    Raises:
        ConfigurationError: its content is neither text nor blocks.
    """
    content = message.content
    if type(content) is str:
        safe = _text.encodable(content)
        if safe is content:
            return message
        return message.model_copy(update={"content": safe})
    blocks = checked_blocks("message", content)
    if all(a is b for a, b in zip(blocks, content, strict=True)):
        return message
    return message.model_copy(update={"content": blocks})


def checked_blocks(where: str, content: object) -> tuple[TextBlock | ImageBlock, ...]:
    """A message's blocks as the context may hold them (see `checked_user`)."""
    if type(content) is not tuple or not content:
        raise ConfigurationError(
            f"{where}.content must be a str or a non-empty tuple of blocks, "
            f"got {type(content).__name__}"
        )
    blocks: list[TextBlock | ImageBlock] = []
    for index, block in enumerate(content):
        if type(block) is TextBlock:
            text = block.text
            if type(text) is not str:
                raise ConfigurationError(
                    f"{where}.content[{index}].text must be a str, got {type(text).__name__}"
                )
            safe = _text.encodable(text)
            blocks.append(block if safe is text else TextBlock(text=safe))
        elif type(block) is ImageBlock:
            # Checked again: one built without validation may claim anything.
            try:
                (valid,) = checked_images((block,))
            except ValueError as exc:
                problem = str(exc).removeprefix("images[0]: ")
                raise ConfigurationError(
                    f"{where}.content[{index}] is not a valid image: {problem}"
                ) from None
            blocks.append(valid)
        else:
            raise ConfigurationError(
                f"{where}.content[{index}] must be a TextBlock or an ImageBlock, "
                f"got {type(block).__name__}"
            )
    return tuple(blocks)


def checked_tool_images(
    name: str, output: str, is_error: bool, images: Any
) -> tuple[str, bool, tuple[ImageBlock, ...]]:
    """A tool's images as the context may hold them: each block validated
    again (a `ToolResult` built without validation, or a wrapper's
    `model_copy`, may hold bytes that are not what the block claims), else an
    error output naming what the tool returned."""
    if type(images) is not tuple or not all(type(i) is ImageBlock for i in images):
        got = type(images).__name__
        if isinstance(images, tuple | list):
            got = ", ".join(sorted({type(i).__name__ for i in images}))
        return f"tool {name!r} returned {got} as images, not ImageBlocks", True, ()
    try:
        checked = checked_images(images)
    except ValueError as exc:
        return f"tool {name!r} returned an image that is not valid: {exc}", True, ()
    return output, is_error, checked


def checked_images(images: tuple[ImageBlock, ...]) -> tuple[ImageBlock, ...]:
    """The blocks validated again, each the same object when it was valid.

    Raises:
        ValueError: naming the first block that is not valid, and why.
    """
    checked: list[ImageBlock] = []
    for index, block in enumerate(images):
        try:
            checked.append(block.checked())
        except ValidationError as exc:
            problem = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise ValueError(f"images[{index}]: {problem}") from None
    return tuple(checked)


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
        _check_counts(usage, model, "token_usage")
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


def checked_usage(usage: Any, model: str) -> TokenUsage:
    """A stream's `UsageUpdate.usage`, checked as an output's `token_usage` is.

    Raises:
        ProviderError: not a `TokenUsage`, or a count that is not an int >= 0.
    """
    if type(usage) is not TokenUsage:
        raise _bad(model, "UsageUpdate.usage", usage, "a TokenUsage")
    _check_counts(usage, model, "UsageUpdate.usage")
    return usage


def _check_counts(usage: TokenUsage, model: str, where: str) -> None:
    counts = usage.__dict__
    for name in _USAGE:
        if not _count(counts.get(name)):
            raise _bad(model, f"{where}.{name}", counts.get(name), "an int >= 0")
    if counts["unreported_requests"]:
        # Only the loop counts requests that reported nothing: one request's
        # usage claiming others would make the loop's total lie.
        raise _bad(
            model,
            f"{where}.unreported_requests",
            counts["unreported_requests"],
            "0 (a request that reported no usage has token_usage=None)",
        )


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
