"""What an MCP server's `tools/call` result becomes: a `ToolResult`.

`is_error` makes an error output. Otherwise the text blocks are the output
(a model reads text best, and a server's text is what it meant a reader to
see), unless the tool declares an output schema: then its structured content
(as JSON) is, being the result the tool promised. Structured content is the
output of a result that has no text block either. A block that is not text
(an image, a resource) is described in a line, since a tool's output is text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, assert_never

import mcp_types
from mcp_types import (
    AudioContent,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)

from agentfsm._text import json_text
from agentfsm.tools import ToolResult

__all__ = ("tool_result",)


def tool_result(
    result: mcp_types.CallToolResult, output_schema: Mapping[str, Any] | None
) -> ToolResult:
    """The result as the loop takes it (see the module's docstring)."""
    if result.is_error:
        message = text_of(result.content)
        if not message and result.structured_content is not None:
            message = json_text(result.structured_content)
        return ToolResult(output=message or "the tool failed", is_error=True)
    structured = result.structured_content
    if structured is not None and (output_schema is not None or not result.content):
        return ToolResult.of(_unwrapped(structured, output_schema))
    return ToolResult.of(text_of(result.content))


def _unwrapped(
    structured: dict[str, Any], output_schema: Mapping[str, Any] | None
) -> Any:
    """The value a tool returned, out of the `{"result": value}` object the
    Python SDK wraps a value that is no object in (an int, a list): its output
    schema is then that object's, with `result` its one, required property.
    The model reads `5`, not `{"result": 5}`."""
    if (
        output_schema is not None
        and output_schema.get("required") == ["result"]
        and list(output_schema.get("properties") or ()) == ["result"]
        and list(structured) == ["result"]
    ):
        return structured["result"]
    return structured


def text_of(blocks: Sequence[mcp_types.ContentBlock]) -> str:
    """The content blocks as text, one block a line."""
    return "\n".join(_text(block) for block in blocks)


def _text(block: mcp_types.ContentBlock) -> str:
    match block:
        case TextContent(text=text):
            return text
        case ImageContent(mime_type=mime) | AudioContent(mime_type=mime):
            size = len(block.data) * 3 // 4  # base64
            return f"[{block.type}: {mime}, about {size} bytes]"
        case EmbeddedResource(resource=TextResourceContents(text=text)):
            return text
        case EmbeddedResource(resource=resource):
            return f"[resource {resource.uri} ({resource.mime_type or 'binary'})]"
        case ResourceLink(uri=uri, name=name):
            return f"[resource link {uri}: {name}]"
        case _:
            assert_never(block)
