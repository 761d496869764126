"""Context items and the model context they live in.

Items are frozen pydantic models with a literal `type` discriminator; a
`ModelContext` holds the instructions and the items, in order. The context is
the one mutable thing: loops append to it, and appending is safe when several
loops share one context (each append is a single list operation between
checkpoints).
"""

import base64
import re
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self, TypeAlias

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    SerializationInfo,
    Tag,
    TypeAdapter,
    field_serializer,
    model_validator,
)
from pydantic_core import from_json

from . import _images, _models
from ._images import IMAGE_MEDIA_TYPES, MAX_IMAGE_BYTES
from ._text import EncodableStr, encodable

__all__ = (
    "IMAGE_MEDIA_TYPES",
    "MAX_IMAGE_BYTES",
    "REFERENCE",
    "ContentBlock",
    "ContextItem",
    "ContextItemAdapter",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "ImageBlock",
    "ModelContext",
    "ModelMessageItem",
    "OutputItem",
    "ReasoningItem",
    "TextBlock",
    "TokenUsage",
    "UserMessage",
)

_FROZEN = ConfigDict(frozen=True, extra="forbid", defer_build=True)
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


REFERENCE: dict[str, Any] = {"images": "reference"}
"""The serialization context that writes images by reference (digest, media
type, size) without their bytes: `item.model_dump(mode="json", context=REFERENCE)`,
what a view or a span shows. A dump without it holds the bytes (base64 in
JSON), so that it reads back whole."""


def _base64_or_bytes(value: Any) -> Any:
    """An image's bytes from JSON data (base64 text), or as given."""
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except ValueError as exc:
            raise ValueError(f"data is not valid base64: {exc}") from None
    return value


class TextBlock(BaseModel):
    """Text in a user message's content."""

    model_config = _FROZEN

    type: Literal["text"] = "text"
    text: EncodableStr


class ImageBlock(BaseModel):
    """An image in a user message's content or in a tool's result: its bytes
    with their media type, or a URL (`http`, `https`; a `data:` URL is decoded
    into bytes).

    Validating a block checks it before it can reach a context: the bytes must
    be the image type they claim (PNG, JPEG, GIF or WebP: `IMAGE_MEDIA_TYPES`;
    without `media_type` the bytes say which), at most `MAX_IMAGE_BYTES`. Its
    `digest` (SHA-256) and `size` are the bytes', computed here (or checked,
    when the block is read back with them). Stores, event logs and views keep
    an image once, by its digest.

    Example:
        ```python
        message = UserMessage(content=["What is in this picture?", ImageBlock.from_path("cat.png")])
        ```
    """

    model_config = _FROZEN

    type: Literal["image"] = "image"
    data: Annotated[bytes | None, BeforeValidator(_base64_or_bytes)] = None
    """The image's bytes (base64 in JSON); None for an image by URL, or for a
    reference to bytes kept elsewhere (`as_reference`)."""
    media_type: str | None = None
    """`image/png`, `image/jpeg`, `image/gif` or `image/webp` (None: an image by
    URL whose type was not given)."""
    url: str | None = None
    """The image's `http(s)` URL, for an image the provider fetches itself."""
    digest: str | None = None
    """`sha256:<hex>` of the bytes (None for an image by URL)."""
    size: int | None = None
    """Length of the bytes (None for an image by URL)."""

    @classmethod
    def from_bytes(cls, data: bytes, media_type: str | None = None) -> Self:
        """A block of these bytes (their type read from them unless given)."""
        return cls(data=data, media_type=media_type)

    @classmethod
    def from_path(cls, path: str | Path, media_type: str | None = None) -> Self:
        """A block of the file's bytes (refused over `MAX_IMAGE_BYTES` before
        it is read whole)."""
        path = Path(path)
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise ValueError(
                f"image {str(path)!r} has {size:,} bytes, more than "
                f"MAX_IMAGE_BYTES={MAX_IMAGE_BYTES:,}"
            )
        return cls(data=path.read_bytes(), media_type=media_type)

    @classmethod
    def from_url(cls, url: str, media_type: str | None = None) -> Self:
        """A block of an `http(s)` URL, or of a `data:` URL's bytes."""
        return cls(url=url, media_type=media_type)

    @model_validator(mode="before")
    @classmethod
    def _data_url(cls, value: Any) -> Any:
        """A `data:` URL becomes the bytes it holds (stored by digest, like any)."""
        if isinstance(value, dict):
            url = value.get("url")
            if isinstance(url, str) and url[:5].lower() == "data:":
                if value.get("data") is not None:
                    raise ValueError("an image block holds data or a url, not both")
                media_type, data = _images.decoded_data_url(url)
                claimed = value.get("media_type")
                if claimed is not None and claimed != media_type:
                    raise ValueError(
                        f"the data: URL says {media_type}, media_type says {claimed}"
                    )
                value = {**value, "url": None, "data": data, "media_type": media_type}
        return value

    @model_validator(mode="after")
    def _checked(self) -> Self:
        if _VALIDATED.get(id(self)) is self:
            return self  # a block given whole to a model holding it: checked once
        fields = self.__dict__
        data: bytes | None = fields["data"]
        media_type = fields["media_type"]
        if media_type is not None and media_type not in IMAGE_MEDIA_TYPES:
            raise ValueError(
                f"media type {media_type!r} is not supported "
                f"(supported: {', '.join(IMAGE_MEDIA_TYPES)})"
            )
        url = fields["url"]
        if data is None and url is None:
            return self._checked_reference()
        if data is None:
            if encodable(url) is not url:
                raise ValueError(
                    "the URL holds a lone surrogate (no UTF-8 can write it)"
                )
            scheme = url.partition(":")[0].lower() if ":" in url else ""
            if scheme not in ("http", "https"):
                raise ValueError(
                    f"the URL scheme {scheme or '(none)'!r} is not allowed for an "
                    "image (http, https or data)"
                )
            if fields["digest"] is not None or fields["size"] is not None:
                raise ValueError("an image by URL has no digest or size")
            return self._valid()
        if url is not None:
            raise ValueError("an image block holds data or a url, not both")
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(
                f"the image has {len(data):,} bytes, more than "
                f"MAX_IMAGE_BYTES={MAX_IMAGE_BYTES:,}"
            )
        found = _images.sniffed(data)
        if found is None:
            raise ValueError(f"the data is {_images.kind_of(data)}")
        if media_type is not None and found != media_type:
            raise ValueError(
                f"the data is {_images.kind_of(data)}, not {media_type} as claimed"
            )
        digest = _images.digest_of(data)
        given = fields["digest"]
        if given is not None and given != digest:
            raise ValueError(f"the bytes do not match the digest {given!r}")
        if fields["size"] is not None and fields["size"] != len(data):
            raise ValueError(f"the bytes are {len(data):,}, not size={fields['size']}")
        # Frozen: the derived fields are written as validation's own last step.
        fields.update(media_type=found, digest=digest, size=len(data))
        return self._valid()

    def _checked_reference(self) -> Self:
        """A block without bytes or URL: a reference to bytes kept elsewhere
        (a store, a Temporal context store), complete enough to find them."""
        fields = self.__dict__
        digest, size = fields["digest"], fields["size"]
        if digest is None:
            raise ValueError("an image block needs data (bytes) or a url")
        if type(digest) is not str or _DIGEST.fullmatch(digest) is None:
            raise ValueError(f"digest {digest!r} is not 'sha256:' and 64 hex digits")
        if fields["media_type"] is None or size is None:
            raise ValueError("an image by reference needs its media_type and size")
        if not 0 < size <= MAX_IMAGE_BYTES:
            raise ValueError(f"size={size} is not between 1 and {MAX_IMAGE_BYTES:,}")
        return self._valid()

    def _valid(self) -> Self:
        _VALIDATED[id(self)] = self
        return self

    def checked(self) -> Self:
        """The block as validation would make it: itself when validation made
        it, else validated again (one built with `model_construct`, or by a
        `model_copy` that changed its bytes, may claim anything). Its bytes
        are hashed once, however many boundaries ask.

        Raises:
            ValidationError: the block is not valid, saying why.
        """
        if _VALIDATED.get(id(self)) is self:
            return self
        valid = type(self).model_validate(self.__dict__)
        return self if valid == self else valid

    @property
    def is_reference(self) -> bool:
        """Whether the block only refers to its bytes (`as_reference`): a
        provider cannot send it until they are read back (`with_data`)."""
        return self.data is None and self.url is None

    def as_reference(self) -> Self:
        """The block without its bytes: digest, media type and size (what a
        store or a payload carries in its place)."""
        if self.data is None:
            return self
        return self.model_copy(update={"data": None})

    def with_data(self, data: bytes) -> Self:
        """The block of a reference, its bytes read back (checked against its
        digest and size).

        Raises:
            ValueError: the bytes are not the ones it refers to.
        """
        return type(self)(
            data=data, media_type=self.media_type, digest=self.digest, size=self.size
        )

    @field_serializer("data")
    def _data_out(self, data: bytes | None, info: SerializationInfo) -> Any:
        if data is None:
            return None
        context = info.context
        if context is not None and context.get("images") == "reference":
            return None
        if info.mode_is_json():
            return base64.b64encode(data).decode("ascii")
        return data

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            if name == "data" and value is not None:
                yield name, _Shown(f"<{len(value):,} bytes>")
            elif value is not None or name in ("media_type",):
                yield name, value

    @property
    def reference(self) -> str:
        """The block as text shows it: `[image: image/png, 4,035 bytes, sha256:1a2b...]`."""
        return _images.reference(self.media_type, self.size, self.digest, self.url)


_VALIDATED: weakref.WeakValueDictionary[int, ImageBlock] = weakref.WeakValueDictionary()
"""The blocks validation made, by identity (a frozen block stays valid)."""


class _Shown(str):
    """A string that repr() shows as it is."""

    def __repr__(self) -> str:
        return str(self)


def _blocks(value: Any) -> Any:
    """A content list as blocks: a str in it is a text block."""
    if isinstance(value, list | tuple):
        return tuple(TextBlock(text=v) if isinstance(v, str) else v for v in value)
    return value


def _content_kind(value: Any) -> str:
    return "text" if isinstance(value, str) else "blocks"


ContentBlock: TypeAlias = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]
"""What a user message's content holds, when it is not plain text."""


class UserMessage(BaseModel):
    """A message from the user (or from whoever drives the loop): text, or a
    list of blocks of text and images (`ImageBlock`; image-only is fine).

    A model that cannot take images is refused the message before it enters
    the context (`ImageNotSupported`), naming the block.
    """

    model_config = _FROZEN

    type: Literal["user_message"] = "user_message"
    content: Annotated[
        Annotated[EncodableStr, Tag("text")]
        | Annotated[
            tuple[ContentBlock, ...],
            BeforeValidator(_blocks),
            Field(min_length=1),
            Tag("blocks"),
        ],
        Discriminator(_content_kind),
    ]
    """The text of the message, or its blocks (a str in a list is a text block)."""

    if TYPE_CHECKING:
        # What callers may pass (a list, with plain strings for text blocks);
        # validation makes it the tuple of blocks the field holds.
        def __init__(
            self,
            *,
            content: str | Sequence[TextBlock | ImageBlock | str],
            type: Literal["user_message"] = "user_message",
        ) -> None: ...

    @property
    def text(self) -> str:
        """The message's text: its content, or its text blocks a line each."""
        content = self.content
        if type(content) is str:
            return content
        return "\n".join(b.text for b in content if type(b) is TextBlock)

    def shown(self) -> str:
        """The message as a text view shows it: its blocks in order, an image
        as its reference (`[image: image/png, 4,035 bytes, sha256:...]`)."""
        content = self.content
        if type(content) is str:
            return content
        return " ".join(
            b.text if type(b) is TextBlock else b.reference  # type: ignore[union-attr]
            for b in content
        )

    @property
    def images(self) -> tuple[ImageBlock, ...]:
        """The message's images, in order."""
        content = self.content
        if type(content) is str:
            return ()
        return tuple(b for b in content if type(b) is ImageBlock)


class ModelMessageItem(BaseModel):
    """A message the model wrote: its answer, or text beside tool calls."""

    model_config = _FROZEN

    type: Literal["model_message"] = "model_message"
    content: EncodableStr
    """The text of the message."""
    refusal: EncodableStr | None = None
    """The model's refusal, when it declined to answer."""


class ReasoningItem(BaseModel):
    """The model's reasoning (or a summary of it), as the provider returned it."""

    model_config = _FROZEN

    type: Literal["reasoning"] = "reasoning"
    content: EncodableStr
    """Reasoning text, or a summary when the provider only returns one."""
    encrypted_content: str | None = None
    """Opaque reasoning state some providers want sent back unchanged."""


class FunctionCallItem(BaseModel):
    """The model asked to call a tool."""

    model_config = _FROZEN

    type: Literal["function_call"] = "function_call"
    call_id: EncodableStr
    """Identifies the call; its output carries the same id."""
    name: EncodableStr
    """The tool's name."""
    arguments: EncodableStr
    """The arguments as the model wrote them: a JSON object, as text."""

    def parsed_arguments(self) -> Any:
        """The arguments decoded from JSON (raises `ValueError` when they are not JSON)."""
        return from_json(self.arguments)


def _empty(images: tuple[ImageBlock, ...]) -> bool:
    """An output without images is written as one was before outputs had them."""
    return not images


class FunctionCallOutputItem(BaseModel):
    """The output of a tool call, written to the context after the call."""

    model_config = _FROZEN

    type: Literal["function_call_output"] = "function_call_output"
    call_id: EncodableStr
    """The `call_id` of the `FunctionCallItem` this answers."""
    output: EncodableStr
    """What the tool returned, as text (JSON for non-string results), or the error."""
    is_error: bool = False
    """Whether the call failed (unknown tool, bad arguments, raised, timed out, denied)."""
    images: tuple[ImageBlock, ...] = Field(default=(), exclude_if=_empty)
    """Images the tool returned beside its text (`ToolResult.images`). A
    provider that takes none in a tool result is sent a line of text for each
    (`InferenceOutput.images_described` says which)."""

    @classmethod
    def error(cls, call_id: str, message: str) -> "FunctionCallOutputItem":
        """An error output for a call."""
        return cls(call_id=call_id, output=message, is_error=True)


ContextItem: TypeAlias = Annotated[
    UserMessage
    | ModelMessageItem
    | ReasoningItem
    | FunctionCallItem
    | FunctionCallOutputItem,
    Field(discriminator="type"),
]
"""Anything a context can hold."""

OutputItem: TypeAlias = Annotated[
    FunctionCallItem | ReasoningItem | ModelMessageItem, Field(discriminator="type")
]
"""Anything a model's output can hold."""

ContextItemAdapter: TypeAdapter[ContextItem] = TypeAdapter(
    ContextItem, config=ConfigDict(defer_build=True)
)
"""(De)serializes one context item."""


class ModelContext(BaseModel):
    """The instructions and the conversation a loop sends to the model.

    Several loops may share one context; each appends its items as it goes.

    Example:
        ```python
        context = ModelContext(instructions="Be brief.")
        context.append(UserMessage(content="hi"))
        ```
    """

    model_config = ConfigDict(extra="forbid", defer_build=True)

    __slots__ = ("__weakref__", "_scan")  # weakref-able, as a model without slots is
    # The loops' scan for calls without outputs (`agentfsm._loop.repair.ContextScan`),
    # kept with the context so that a conversation run as one loop per message
    # does not rescan its whole history each time. A slot, not a pydantic
    # private attribute: those cost ~2 µs to set up in every `ModelContext()`
    # and ~3 µs to read (through the model's `__getattr__`).

    instructions: EncodableStr | None = None
    """The system prompt."""
    items: list[ContextItem] = Field(default_factory=list)
    """The conversation, oldest first."""

    def append(self, item: ContextItem) -> None:
        """Append one item."""
        self.items.append(item)

    def extend(self, items: Iterable[ContextItem]) -> None:
        """Append several items at once (they stay together even when loops share the context)."""
        self.items.extend(items)


class TokenUsage(BaseModel):
    """Tokens counted by the provider for one request, or summed over a loop.

    A request whose server reported no usage has `token_usage=None`, never a
    zero. A loop's total (`LoopResult.usage`, `LoopView.usage`, `loop.idle`)
    counts what the requests reported and, in `unreported_requests`, how many
    reported nothing; `status` says which of the three cases a total is:

    ```python
    result = await runtime.wait(loop_id)
    if result.usage.status == "unknown":
        print("the server reported no usage")
    ```
    """

    model_config = _FROZEN

    input_tokens: int = 0
    """Tokens in the request."""
    output_tokens: int = 0
    """Tokens the model generated, reasoning included."""
    reasoning_tokens: int = 0
    """Of the output tokens, those spent on reasoning."""
    cached_input_tokens: int = 0
    """Of the input tokens, those served from the provider's cache."""
    unreported_requests: int = 0
    """In a sum: of the requests summed, how many reported no usage (their
    tokens are not counted above). 0 in one request's usage."""

    @property
    def total_tokens(self) -> int:
        """Input plus output tokens."""
        return self.input_tokens + self.output_tokens

    @property
    def status(self) -> Literal["complete", "partial", "unknown"]:
        """Whether the counts cover every request summed: `complete` (each
        reported its usage, or there was none), `partial` (some reported none:
        the counts are a lower bound) or `unknown` (some reported none and no
        token is counted: what the requests used is not known)."""
        if not self.unreported_requests:
            return "complete"
        if self.input_tokens or self.output_tokens:
            return "partial"
        return "unknown"

    def __str__(self) -> str:
        """`12 in + 3 out = 15 total`, `... (1 request reported none)` for a
        partial sum, `unknown (not reported)` when nothing is counted."""
        unreported = self.unreported_requests
        if unreported and not (self.input_tokens or self.output_tokens):
            return "unknown (not reported)"
        text = (
            f"{self.input_tokens} in + {self.output_tokens} out = "
            f"{self.total_tokens} total"
        )
        if unreported:
            noun = "request" if unreported == 1 else "requests"
            text += f" ({unreported} {noun} reported none)"
        return text

    def __add__(self, other: "TokenUsage") -> "TokenUsage":
        values = {
            "input_tokens": self.input_tokens + other.input_tokens,
            "output_tokens": self.output_tokens + other.output_tokens,
            "reasoning_tokens": self.reasoning_tokens + other.reasoning_tokens,
            "cached_input_tokens": self.cached_input_tokens + other.cached_input_tokens,
            "unreported_requests": self.unreported_requests + other.unreported_requests,
        }
        return _models.trusted(TokenUsage, values, set(values))


_models.read_fields_fast(globals())
