"""What an MCP server's `tools/call` result becomes: a `ToolResult`.

`is_error` makes an error output. Otherwise the text blocks are the output
(a model reads text best, and a server's text is what it meant a reader to
see), unless the tool declares an output schema: then its structured content
(as JSON) is, being the result the tool promised. Structured content is the
output of a result that has no text block either.

An image block becomes an `ImageBlock` of `ToolResult.images`, checked as
every image is (its bytes the type it claims, one of `IMAGE_MEDIA_TYPES`, at
most `MAX_IMAGE_BYTES`). An image refused is a line of the output saying why,
never a failed call: a server's bad image is the server's text, not the
loop's error. Any other block that is not text (audio, a binary resource, a
resource link) is described in a line, since the rest of a tool's output is
text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, assert_never

import mcp_types
from mcp_types import (
    AudioContent,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)
from pydantic import ValidationError

from agentfsm._text import clip, json_text
from agentfsm.messages import MAX_IMAGE_BYTES, ImageBlock
from agentfsm.tools import ToolResult

__all__ = ("tool_result",)

_QUOTED: Final = 80
"""How much of a server's media type the line of a refused image quotes."""


def tool_result(
    result: mcp_types.CallToolResult, output_schema: Mapping[str, Any] | None
) -> ToolResult:
    """The result as the loop takes it (see the module's docstring)."""
    text, images, refused = _content(result.content)
    if result.is_error:
        if not text and result.structured_content is not None:
            text = json_text(result.structured_content)
        return ToolResult(
            output=text or "the tool failed", is_error=True, images=images
        )
    structured = result.structured_content
    if structured is not None and (output_schema is not None or not result.content):
        # The text blocks are left out, not what is said of a refused image.
        text = "\n".join((json_text(_unwrapped(structured, output_schema)), *refused))
    return ToolResult(output=json_text(text), images=images)


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


def _content(
    blocks: Sequence[mcp_types.ContentBlock],
) -> tuple[str, tuple[ImageBlock, ...], list[str]]:
    """The content blocks as text (one block a line), the images taken out of
    it, and the lines of the images refused (which the text holds too, in
    their place)."""
    lines: list[str] = []
    images: list[ImageBlock] = []
    refused: list[str] = []
    for block in blocks:
        if not isinstance(block, ImageContent):
            lines.append(_text(block))
            continue
        image = _image(block)
        if isinstance(image, ImageBlock):
            images.append(image)
        else:
            lines.append(image)
            refused.append(image)
    return "\n".join(lines), tuple(images), refused


def _image(block: ImageContent) -> ImageBlock | str:
    """The block as an image, or the line that says why it is refused."""
    size = len(block.data) * 3 // 4  # base64
    if size > MAX_IMAGE_BYTES + 2:  # refused before it is decoded
        why = f"more than MAX_IMAGE_BYTES={MAX_IMAGE_BYTES:,}"
    else:
        try:
            # Validation decodes the base64 and checks the bytes' signature
            # against the type claimed (a MIME type is case-insensitive).
            return ImageBlock(
                data=block.data,  # type: ignore[arg-type]
                media_type=block.mime_type.strip().lower(),
            )
        except ValidationError as exc:
            why = "; ".join(
                str(e["msg"]).removeprefix("Value error, ")
                for e in exc.errors(include_url=False)
            )
    # A hostile server's type may be long: the line quotes it cut.
    said = f"{clip(block.mime_type, _QUOTED)}, about {size:,} bytes"
    return f"[image refused: {said}: {clip(why, 4 * _QUOTED)}]"


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
