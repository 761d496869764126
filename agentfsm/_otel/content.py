"""Messages as the GenAI semantic conventions record them (opt-in content).

`gen_ai.input.messages`, `gen_ai.output.messages`, `gen_ai.system_instructions`
and `gen_ai.tool.definitions` are JSON strings: a message is
`{"role": ..., "parts": [...]}`, a part `{"type": "text", "content": ...}`,
`{"type": "tool_call", "id", "name", "arguments"}`,
`{"type": "tool_call_response", "id", "response"}` or
`{"type": "reasoning", "content": ...}`. Consecutive items of one role make one
message (a model's output is one assistant message, whatever it holds).

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
    ModelMessageItem,
    ReasoningItem,
    UserMessage,
)
from agentfsm.tools import Tool

__all__ = (
    "WITHHELD",
    "answer_messages",
    "finish_reason",
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


def _part(item: ContextItem) -> tuple[str, dict[str, Any]]:
    """The role an item belongs to, and the item as a part."""
    if isinstance(item, UserMessage):
        return "user", {"type": "text", "content": item.content}
    if isinstance(item, ModelMessageItem):
        if item.refusal is not None:
            return "assistant", {"type": "refusal", "content": item.refusal}
        return "assistant", {"type": "text", "content": item.content}
    if isinstance(item, ReasoningItem):
        return "assistant", {"type": "reasoning", "content": item.content}
    if isinstance(item, FunctionCallItem):
        part = {
            "type": "tool_call",
            "id": item.call_id,
            "name": item.name,
            "arguments": _arguments(item.arguments),
        }
        return "assistant", part
    assert isinstance(item, FunctionCallOutputItem)
    return "tool", {
        "type": "tool_call_response",
        "id": item.call_id,
        "response": item.output,
    }


def _messages(items: Iterable[ContextItem]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for item in items:
        role, part = _part(item)
        if messages and messages[-1]["role"] == role:
            messages[-1]["parts"].append(part)
        else:
            messages.append({"role": role, "parts": [part]})
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
