"""Messages as the GenAI semantic conventions record them (opt-in content).

`gen_ai.input.messages`, `gen_ai.output.messages`, `gen_ai.system_instructions`
and `gen_ai.tool.definitions` are JSON strings: a message is
`{"role": ..., "parts": [...]}`, a part `{"type": "text", "content": ...}`,
`{"type": "tool_call", "id", "name", "arguments"}`,
`{"type": "tool_call_response", "id", "response"}` or
`{"type": "reasoning", "content": ...}`. Consecutive items of one role make one
message (a model's output is one assistant message, whatever it holds).

An image is never in a span: a part holds its reference, as a file part
named by its digest, `{"type": "file", "modality": "image", "mime_type",
"file_id": "sha256:...", "size"}` (an image by URL is a `uri` part). A user
message's blocks are parts in their order; a tool output's images follow its
`tool_call_response`.

Every text from a model, a tool, a user or an MCP server that a span holds
outside these opt-in attributes (an error output, an exception's message, a
failed loop's reason) goes through `untrusted`, which withholds it unless
content is captured.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from pydantic_core import from_json

from agentfsm._text import encodable, json_text
from agentfsm.inference import InferenceOutput
from agentfsm.messages import (
    ContextItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ImageBlock,
    ModelMessageItem,
    ReasoningItem,
    UserMessage,
)
from agentfsm.tools import Tool

__all__ = (
    "WITHHELD",
    "answer_messages",
    "finish_reason",
    "image_part",
    "images",
    "input_messages",
    "output_messages",
    "system_instructions",
    "tool_definitions",
    "untrusted",
)

WITHHELD: Final = "content not captured"
"""What a span holds in place of untrusted text while content capture is off."""


def untrusted(text: str, capture: bool) -> str:
    """Text from a model, a tool, a user or an MCP server (or an error message
    that may quote one), as a span may hold it: the text when content is
    captured (the span writers make it encodable); else `WITHHELD`."""
    return text if capture else WITHHELD


def _arguments(text: str) -> Any:
    """A call's arguments as JSON data; the text itself when it is not JSON
    (or JSON that holds a lone surrogate)."""
    text = encodable(text)
    try:
        return from_json(text)
    except ValueError:
        return text


def image_part(image: ImageBlock) -> dict[str, Any]:
    """An image as a part: its reference (digest, media type, size), never
    its bytes; an image by URL, its URL."""
    if image.url is not None:
        part: dict[str, Any] = {"type": "uri", "modality": "image", "uri": image.url}
        if image.media_type is not None:
            part["mime_type"] = image.media_type
        return part
    return {
        "type": "file",
        "modality": "image",
        "mime_type": image.media_type,
        "file_id": image.digest,
        "size": image.size,
    }


def images(blocks: Iterable[ImageBlock]) -> str:
    """`agentfsm.tool.call.images`: a tool result's images, as parts."""
    return json_text([image_part(block) for block in blocks])


def _parts(item: ContextItem) -> tuple[str, list[dict[str, Any]]]:
    """The role an item belongs to, and the item as parts."""
    if isinstance(item, UserMessage):
        content = item.content
        if isinstance(content, str):
            return "user", [{"type": "text", "content": content}]
        return "user", [
            image_part(block)
            if isinstance(block, ImageBlock)
            else {"type": "text", "content": block.text}
            for block in content
        ]
    if isinstance(item, ModelMessageItem):
        if item.refusal is not None:
            return "assistant", [{"type": "refusal", "content": item.refusal}]
        return "assistant", [{"type": "text", "content": item.content}]
    if isinstance(item, ReasoningItem):
        return "assistant", [{"type": "reasoning", "content": item.content}]
    if isinstance(item, FunctionCallItem):
        part = {
            "type": "tool_call",
            "id": item.call_id,
            "name": item.name,
            "arguments": _arguments(item.arguments),
        }
        return "assistant", [part]
    assert isinstance(item, FunctionCallOutputItem)
    response = {
        "type": "tool_call_response",
        "id": item.call_id,
        "response": item.output,
    }
    return "tool", [response, *map(image_part, item.images)]


def _messages(items: Iterable[ContextItem]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for item in items:
        role, parts = _parts(item)
        if messages and messages[-1]["role"] == role:
            messages[-1]["parts"].extend(parts)
        else:
            messages.append({"role": role, "parts": parts})
    return messages


def input_messages(items: Iterable[ContextItem]) -> str:
    """`gen_ai.input.messages`: the conversation a request sends."""
    return json_text(_messages(items))


def finish_reason(output: InferenceOutput) -> str:
    """The output's finish reason, or the one its items imply."""
    if output.finish_reason is not None:
        return output.finish_reason
    return "tool_call" if output.function_calls else "stop"


def output_messages(output: InferenceOutput) -> str:
    """`gen_ai.output.messages`: what the model returned, as one message."""
    messages = _messages(output.items) or [{"role": "assistant", "parts": []}]
    for message in messages:
        message["finish_reason"] = finish_reason(output)
    return json_text(messages)


def answer_messages(message: ModelMessageItem) -> str:
    """`gen_ai.output.messages` of a loop: the answer it ended with."""
    [answer] = _messages([message])
    answer["finish_reason"] = "stop"
    return json_text([answer])


def system_instructions(instructions: str) -> str:
    """`gen_ai.system_instructions`."""
    return json_text([{"type": "text", "content": instructions}])


def tool_definitions(tools: Sequence[Tool]) -> str:
    """`gen_ai.tool.definitions`: the tools a request offers."""
    return json_text(
        [
            {
                "type": "function",
                "name": tool.definition.name,
                "description": tool.definition.description,
                "parameters": tool.definition.parameters,
            }
            for tool in tools
        ]
    )
