"""What an image block must be, and how the loop shows one it cannot send.

One module for the rules every boundary applies to an image (`ImageBlock`
validates with them): the media types every built-in provider takes, the size
limit, the bytes' own signature against the type they claim, the URL schemes.
And the line that stands for an image wherever an image cannot go (a provider
that takes no image in a tool result, a text view, a log).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import Final
from urllib.parse import unquote_to_bytes

__all__ = (
    "IMAGE_MEDIA_TYPES",
    "MAX_IMAGE_BYTES",
    "data_url",
    "decoded_data_url",
    "digest_of",
    "reference",
    "sniffed",
)

IMAGE_MEDIA_TYPES: Final = ("image/png", "image/jpeg", "image/gif", "image/webp")
"""The media types an image block may have: those OpenAI's, Anthropic's and
Chat Completions servers all take."""

MAX_IMAGE_BYTES: Final = 20 * 1024 * 1024
"""The largest image a block may hold (20 MiB, OpenAI's limit per image); a
provider may take less (Anthropic: 5 MiB), which `ImageSupport.max_bytes` says."""

_NAMES: Final = {
    "image/png": "a PNG image",
    "image/jpeg": "a JPEG image",
    "image/gif": "a GIF image",
    "image/webp": "a WebP image",
}


def sniffed(data: bytes) -> str | None:
    """The media type `data`'s first bytes say it is, of `IMAGE_MEDIA_TYPES`."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def kind_of(data: bytes) -> str:
    """What `data` is, for an error message: `a JPEG image`, `bytes that are no
    image (starting 25 50 44 46)`."""
    found = sniffed(data)
    if found is not None:
        return _NAMES[found]
    if not data:
        return "no bytes at all"
    return (
        f"bytes that are no PNG, JPEG, GIF or WebP image (starting {data[:4].hex(' ')})"
    )


def digest_of(data: bytes) -> str:
    """The image's digest, as blocks carry it: `sha256:<hex>`."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def decoded_data_url(url: str) -> tuple[str, bytes]:
    """`(media type, bytes)` of a `data:` URL.

    Raises:
        ValueError: the URL is not `data:<type>[;base64],<data>`.
    """
    head, comma, payload = url[5:].partition(",")
    if not comma:
        raise ValueError("the data: URL has no ',' before its data")
    parts = head.split(";")
    media_type = parts[0].strip().lower() or "text/plain"
    if "base64" in (p.strip().lower() for p in parts[1:]):
        try:
            return media_type, base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"the data: URL's base64 is not valid: {exc}") from None
    return media_type, unquote_to_bytes(payload)


def data_url(media_type: str, data: bytes) -> str:
    """The bytes as a `data:` URL (what OpenAI's APIs take an image's bytes as)."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


def reference(
    media_type: str | None, size: int | None, digest: str | None, url: str | None
) -> str:
    """An image as text shows it: `[image: image/png, 4,035 bytes, sha256:1a2b3c4d5e6f]`."""
    if url is not None:
        shown = url if len(url) <= 80 else url[:77] + "..."
        return f"[image: {shown}]"
    short = digest[:19] if digest is not None else "?"
    return f"[image: {media_type}, {size or 0:,} bytes, {short}]"
