"""The Messages API mapping: context items to messages, messages to outputs.

Imported only by `agentfsm.providers.anthropic`, after it checked the SDK is
there; the module docstring there has the table of what maps where.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any, Final, assert_never

from anthropic import transform_schema
from anthropic.types import (
    Message,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
)
from pydantic import BaseModel
from pydantic_core import to_json

from agentfsm.messages import (
    ContextItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ImageBlock,
    ModelMessageItem,
    OutputItem,
    ReasoningItem,
    TokenUsage,
    UserMessage,
)
from agentfsm.providers import InferenceOutput
from agentfsm.providers._common import (
    ImageMapping,
    count,
    structured_schema,
    tool_input,
)

__all__ = (
    "REDACTED_PREFIX",
    "messages_of",
    "output_of",
    "output_schema",
    "tool_choice",
    "usage_of",
)

REDACTED_PREFIX: Final = "anthropic-redacted-thinking:"
"""Prefix of an `encrypted_content` holding a `redacted_thinking` block's data
(no signature starts with it), so the block goes back as it came."""

_FINISH_REASONS: Final[Mapping[str, str]] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
}

# --------------------------------------------------------------------- requests


def messages_of(
    items: Sequence[ContextItem], images: ImageMapping
) -> list[dict[str, Any]]:
    """The context as Messages API messages (consecutive items of a role merged).

    Raises:
        ImageNotSupported: a user message holds an image the model cannot take.
    """
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, UserMessage) and not isinstance(item.content, str):
            role, blocks = "user", _user_blocks(item, images)
        else:
            role, block = _block(item, images)
            blocks = [] if block is None else [block]
        if not blocks:
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(blocks)
        else:
            messages.append({"role": role, "content": blocks})
    for message in messages:
        if message["role"] == "user":  # tool results go before any text
            message["content"].sort(key=lambda b: b["type"] != "tool_result")
    return messages


def _user_blocks(message: UserMessage, images: ImageMapping) -> list[dict[str, Any]]:
    """A message of text and image blocks, each as a block (blank text left out)."""
    content = message.content
    assert not isinstance(content, str)  # a text message is one block (`_block`)
    images.check_user(message)
    blocks: list[dict[str, Any]] = []
    for block in content:
        if isinstance(block, ImageBlock):
            blocks.append(_image(block))
        elif (text := _text(block.text)) is not None:
            blocks.append(text)
    return blocks


def _image(block: ImageBlock) -> dict[str, Any]:
    if block.data is None:
        return {"type": "image", "source": {"type": "url", "url": block.url}}
    source = {
        "type": "base64",
        "media_type": block.media_type,
        "data": base64.b64encode(block.data).decode("ascii"),
    }
    return {"type": "image", "source": source}


def _block(
    item: ContextItem, images: ImageMapping
) -> tuple[str, dict[str, Any] | None]:
    if isinstance(item, UserMessage):
        return "user", _text(item.text)
    if isinstance(item, ModelMessageItem):
        return "assistant", _text(item.content or item.refusal or "")
    if isinstance(item, ReasoningItem):
        secret = item.encrypted_content
        if secret is None:
            return "assistant", None
        if secret.startswith(REDACTED_PREFIX):
            return "assistant", {
                "type": "redacted_thinking",
                "data": secret.removeprefix(REDACTED_PREFIX),
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
        text, sent = images.tool_output(item)
        content: str | list[dict[str, Any]] = text
        if sent:
            # The API refuses an empty text block, here as anywhere.
            content = [] if (part := _text(text)) is None else [part]
            content.extend(_image(block) for block in sent)
        result: dict[str, Any] = {
            "type": "tool_result",
            "tool_use_id": item.call_id,
            "content": content,
        }
        if item.is_error:
            result["is_error"] = True
        return "user", result
    assert_never(item)


def _text(text: str) -> dict[str, Any] | None:
    return {"type": "text", "text": text} if text.strip() else None


def tool_choice(
    choice: str | None, *, parallel: bool | None = None
) -> dict[str, Any] | None:
    """`tool_choice`: `required` is `any`, a tool's name is `tool`; with
    `parallel=False`, `disable_parallel_tool_use` (on `auto` if none is forced)."""
    if choice is None and parallel is False:
        choice = "auto"
    if choice is None:
        return None
    if choice == "required":
        sent: dict[str, Any] = {"type": "any"}
    elif choice in ("auto", "none"):
        sent = {"type": choice}
    else:
        sent = {"type": "tool", "name": choice}
    if parallel is False and choice != "none":  # `none` takes no such flag
        sent["disable_parallel_tool_use"] = True
    return sent


def output_schema(output: type[BaseModel] | dict[str, Any]) -> dict[str, Any]:
    """The output format's schema: a model's made fit by the SDK, a dict as given."""
    if isinstance(output, dict):
        return structured_schema(output)
    return transform_schema(output)


# ---------------------------------------------------------------------- outputs


# ---------------------------------------------------------------------- outputs


def output_of(message: Message) -> InferenceOutput:
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
                ReasoningItem(
                    content="", encrypted_content=REDACTED_PREFIX + block.data
                )
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
        token_usage=usage_of(message.usage),
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


def usage_of(usage: Usage | None) -> TokenUsage | None:
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
