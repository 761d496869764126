"""An MCP server's images (issue 31): an `ImageContent` block becomes an
`ImageBlock` of the tool's result, reaching the context and the next model
request byte for byte; an image the block refuses (not the type it claims,
not base64, a type no provider takes) is a line of text saying why, never a
failed call.

The server is tests/mcp_image_server.py, run as a subprocess over stdio.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest
from mcp_types import CallToolResult, ImageContent, TextContent

from agentfsm import (
    FunctionCallOutputItem,
    FunctionProvider,
    ImageBlock,
    ImageSupport,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    Runtime,
)
from agentfsm.mcp import mcp_tools
from agentfsm.mcp._results import tool_result
from agentfsm.messages import MAX_IMAGE_BYTES, ContextItem
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.mcp_image_server import BLUE, JPEG, RED, SVG

SERVER = Path(__file__).with_name("mcp_image_server.py")


class Sees(FunctionProvider):
    """A model that takes images everywhere, tool results too."""

    __slots__ = ()

    def image_support(self, model: str) -> ImageSupport:
        return ImageSupport(user_messages=True, tool_results=True)


async def run_tool(name: str) -> tuple[list[list[ContextItem]], ModelContext]:
    """One loop over the server's tools that calls `name`, then answers: what
    each request held, as it was sent, and the loop's context."""
    script = ScriptedProvider([calls(call(name, call_id="c1")), text("seen")])
    seen: list[list[ContextItem]] = []

    async def model(request: InferenceInput) -> InferenceOutput:
        seen.append(list(request.context.items))
        return await script.complete(request)

    async with Runtime(providers={"s": Sees(model)}) as runtime:
        tools = await mcp_tools(str(SERVER))
        request = InferenceInput(model="s:m", context=ModelContext(), tools=tools)
        result = await runtime.wait(runtime.run_loop("a", "look", request))
    assert result.outcome == "answered", result.error
    return seen, request.context


def output_of(items: list[ContextItem]) -> FunctionCallOutputItem:
    [output] = [i for i in items if isinstance(i, FunctionCallOutputItem)]
    return output


async def test_an_image_of_a_server_reaches_the_next_request_byte_equal() -> None:
    seen, context = await run_tool("snapshot")
    output = output_of(list(context.items))
    assert output.output == "a red square"  # the text block
    assert not output.is_error
    [image] = output.images
    assert image.data == RED
    assert image.media_type == "image/png"
    assert image.digest == "sha256:" + hashlib.sha256(RED).hexdigest()
    assert image.size == len(RED)
    # The first request had no output; the second carries this one, image and all.
    assert [i for i in seen[0] if isinstance(i, FunctionCallOutputItem)] == []
    sent = output_of(seen[1])
    assert sent == output
    assert sent.images[0].data == RED


async def test_a_hostile_servers_images_are_lines_saying_why() -> None:
    """JPEG bytes said to be a PNG, text that is no base64, an SVG: each
    refused in a line (the call is no error); the good image, its type in
    capitals, is taken; audio is described."""
    seen, context = await run_tool("liar")
    output = output_of(list(context.items))
    assert not output.is_error
    lines = output.output.splitlines()
    assert lines[0] == "look"
    assert lines[1] == (
        f"[image refused: image/png, about {len(base64.b64encode(JPEG)) * 3 // 4} "
        "bytes: the data is a JPEG image, not image/png as claimed]"
    )
    assert lines[2].startswith("[image refused: image/png, about 8 bytes: ")
    assert "not valid base64" in lines[2]
    assert lines[3].startswith("[image refused: image/svg+xml, ")
    assert "'image/svg+xml' is not supported" in lines[3]
    assert lines[4] == "[audio: audio/wav, about 6 bytes]"
    assert len(lines) == 5
    assert [i.data for i in output.images] == [BLUE]
    assert output.images[0].media_type == "image/png"
    assert output_of(seen[1]) == output
    # No refused byte reached the context, as an image or as text.
    assert "<svg" not in output.output
    assert all(i.data not in (JPEG, SVG) for i in output.images)


def test_structured_content_keeps_what_is_said_of_a_refused_image() -> None:
    """With an output schema the output is the structured content (as JSON);
    a refused image's line follows it, and the good image is a block."""
    result = CallToolResult(
        content=[
            TextContent(type="text", text="the chart"),
            ImageContent(
                type="image",
                data=base64.b64encode(JPEG).decode(),
                mime_type="image/gif",
            ),
            ImageContent(
                type="image",
                data=base64.b64encode(BLUE).decode(),
                mime_type="image/png",
            ),
        ],
        structured_content={"points": 3},
    )
    converted = tool_result(result, {"type": "object"})
    first, second = converted.output.splitlines()
    assert first == '{"points":3}'
    assert second.startswith("[image refused: image/gif, ")
    assert second.endswith("the data is a JPEG image, not image/gif as claimed]")
    assert [i.data for i in converted.images] == [BLUE]


def test_an_error_result_keeps_its_images() -> None:
    image = ImageContent(
        type="image", data=base64.b64encode(RED).decode(), mime_type="image/png"
    )
    result = CallToolResult(
        content=[TextContent(type="text", text="the page crashed"), image],
        is_error=True,
    )
    converted = tool_result(result, None)
    assert converted.is_error
    assert converted.output == "the page crashed"
    assert converted.images == (ImageBlock.from_bytes(RED),)


@pytest.mark.parametrize("mime", ["image/png", "x" * 10_000])
def test_an_image_over_the_limit_is_refused_before_it_is_decoded(mime: str) -> None:
    """A server's huge image is a line; a hostile type is quoted cut."""
    size = MAX_IMAGE_BYTES + 3
    data = "A" * (4 * -(-size // 3))  # base64 of `size` zero bytes, as a server sends
    result = CallToolResult(
        content=[ImageContent(type="image", data=data, mime_type=mime)]
    )
    converted = tool_result(result, None)
    assert converted.images == ()
    assert converted.output.startswith("[image refused: ")
    assert f"more than MAX_IMAGE_BYTES={MAX_IMAGE_BYTES:,}]" in converted.output
    assert len(converted.output) < 300
