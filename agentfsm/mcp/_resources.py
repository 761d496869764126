"""An MCP server's resources as the model may read them: which URIs it may
read (`Readable`), and what a read's contents become (`contents_text`).

The model reads only what the server listed (`resources/list`) or a tool's
result named (a resource link, an embedded resource): a URI the model made
up is refused before it reaches the server, which may serve more than it
lists (a template, a file system).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, final

import mcp_types
from mcp_types import (
    BlobResourceContents,
    EmbeddedResource,
    ResourceLink,
    TextResourceContents,
)

__all__ = ("READABLE", "URI_CHARS", "Readable", "contents_text", "named_in")

READABLE: Final = 10_000
"""The most URIs remembered as readable (the oldest is forgotten first): a
server that lists or links without end cannot grow the set without bound."""

URI_CHARS: Final = 4096
"""The longest URI remembered (a longer one is not readable through the
toolset's tool; `MCPToolset.read_resource` still reads it)."""


@final
class Readable:
    """The URIs the model may read, the most recently seen last."""

    __slots__ = ("_uris", "forgot")

    def __init__(self) -> None:
        self._uris: dict[str, None] = {}  # a dict keeps insertion order
        self.forgot = False
        """Whether a URI was ever forgotten (more than `READABLE` were seen)."""

    def __contains__(self, uri: object) -> bool:
        return uri in self._uris

    def __len__(self) -> int:
        return len(self._uris)

    def add(self, uris_in: Iterable[str]) -> None:
        """Remember `uris_in` (seen just now, the last most recently), in time
        linear in their number; the oldest beyond `READABLE` are forgotten."""
        uris = self._uris
        for uri in uris_in:
            if len(uri) > URI_CHARS:
                continue
            uris.pop(uri, None)
            uris[uri] = None
        excess = len(uris) - READABLE
        if excess > 0:
            # Rebuilt rather than deleted from the front one by one: a dict
            # skips its deleted slots on each iteration, which is quadratic.
            self.forgot = True
            self._uris = dict.fromkeys(list(uris)[excess:])


def named_in(blocks: Sequence[mcp_types.ContentBlock]) -> list[str]:
    """The URIs of the resource links and embedded resources in a result."""
    uris = []
    for block in blocks:
        if isinstance(block, ResourceLink):
            uris.append(block.uri)
        elif isinstance(block, EmbeddedResource):
            uris.append(block.resource.uri)
    return uris


def contents_text(
    contents: Sequence[TextResourceContents | BlobResourceContents],
) -> str:
    """A read's contents as text, one item a line: a text item's text, a
    binary one described (a tool's output is text)."""
    return "\n".join(_text(item) for item in contents)


def _text(item: TextResourceContents | BlobResourceContents) -> str:
    if isinstance(item, TextResourceContents):
        return item.text
    size = len(item.blob) * 3 // 4  # base64
    return f"[resource {item.uri} ({item.mime_type or 'binary'}), about {size} bytes]"
