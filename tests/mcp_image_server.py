"""An MCP server whose tools return images, for tests/test_images_mcp.py: in
process (`make_server()`) or over stdio (`python tests/mcp_image_server.py`).

`snapshot` returns a caption and a real PNG (`Image`, the SDK's helper);
`liar` is a hostile server's answer: images whose bytes are not the type they
claim, that are not base64, of a type no provider takes, beside audio and a
good image with its type in capitals.
"""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

from mcp.server.mcpserver import Image, MCPServer
from mcp_types import AudioContent, CallToolResult, ImageContent, TextContent


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A real PNG of one colour (a browser decodes it)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\x00" + bytes(rgb) * width
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


RED = png(24, 16, (220, 30, 30))
"""What `snapshot` returns."""
BLUE = png(8, 8, (30, 30, 220))
"""The good image of `liar`."""
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(64)
"""JPEG bytes, which `liar` says are a PNG."""
SVG = b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>'


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def make_server() -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer("images")

    @server.tool(structured_output=False)
    def snapshot() -> list[TextContent | Image]:
        """A picture of the screen, with a caption."""
        return [TextContent(type="text", text="a red square"), Image(data=RED)]

    @server.tool()
    def liar() -> CallToolResult:
        """Images that are not what they say."""
        return CallToolResult(
            content=[
                TextContent(type="text", text="look"),
                ImageContent(type="image", data=_b64(JPEG), mime_type="image/png"),
                ImageContent(type="image", data="not base64!", mime_type="image/png"),
                ImageContent(type="image", data=_b64(SVG), mime_type="image/svg+xml"),
                AudioContent(type="audio", data=_b64(b"RIFF"), mime_type="audio/wav"),
                ImageContent(type="image", data=_b64(BLUE), mime_type="IMAGE/PNG"),
            ]
        )

    return server


if __name__ == "__main__":
    make_server().run("stdio")
