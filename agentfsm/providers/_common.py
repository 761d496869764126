"""Helpers the vendor providers share: schemas, tool choice, errors, call ids, images.

Nothing here imports a vendor SDK; each provider module maps its SDK's types
and exceptions onto these.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Mapping,
    Sequence,
)
from typing import Any, Final, Generic, Protocol, Self, TypeVar

import anyio
from pydantic import BaseModel
from pydantic_core import from_json

from agentfsm import _images
from agentfsm.exceptions import (
    ConfigurationError,
    ImageMissing,
    ImageNotSupported,
    ProviderError,
)
from agentfsm.inference import ImageSupport, InferenceOutput
from agentfsm.messages import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ImageBlock,
    UserMessage,
)

__all__ = (
    "ImageMapping",
    "OwnedClient",
    "close_stream",
    "count",
    "env",
    "error_detail",
    "image_override",
    "image_url",
    "new_call_id",
    "next_or_none",
    "refuse_unsupported",
    "retryable_status",
    "schema_name",
    "status_error",
    "stream_error",
    "strict_compatible",
    "structured_schema",
    "text_only",
    "tool_input",
)

T = TypeVar("T")

CLOSE_TIMEOUT: Final = 5.0
"""Seconds a provider waits for a stream to close."""

_RETRYABLE_STATUS: Final = frozenset({408, 409, 425, 429})


class Closable(Protocol):
    def close(self) -> Awaitable[None]: ...


_NAME_CHARS: Final = re.compile(r"[^a-zA-Z0-9_-]+")


ClientT = TypeVar("ClientT", bound=Closable)


class OwnedClient(Generic[ClientT]):
    """A provider that sends its requests through an SDK client: one it was
    given (the caller's to close) or one it made (closed with the provider)."""

    __slots__ = ("_client", "_owns_client")

    _client: ClientT
    _owns_client: bool

    def _given(
        self, client: ClientT | None, api_key: str | None, base_url: str | None
    ) -> bool:
        """Use `client` if there is one; False when the provider must make its own.

        Raises:
            ConfigurationError: a client and settings for another one were both given.
        """
        if client is None:
            return False
        if api_key is not None or base_url is not None:
            raise ConfigurationError(
                "pass either client= or api_key=/base_url=, not both"
            )
        self._client, self._owns_client = client, False
        return True

    def _made(self, client: ClientT) -> None:
        self._client, self._owns_client = client, True

    @property
    def client(self) -> ClientT:
        """The SDK client the provider sends its requests with."""
        return self._client

    async def aclose(self) -> None:
        """Close the SDK client, if the provider created it."""
        if self._owns_client:
            await self._client.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def env(name: str) -> str | None:
    """The environment variable `name`, or `None` when it is unset or empty."""
    return os.environ.get(name) or None


def count(obj: object, name: str) -> int:
    """An integer attribute of an SDK object, 0 when it is missing or `None`.

    Compatible servers leave out fields that the SDK types call required, and
    the SDKs build their objects without validating them.
    """
    value = getattr(obj, name, None)
    return value if isinstance(value, int) else 0


def error_detail(body: object, fallback: str) -> tuple[str | None, str]:
    """`(type or code, message)` from an API error body, or `(None, fallback)`.

    Reads `{"message", "type", "code"}` and `{"error": {...}}` alike.
    """
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            message = error.get("message")
            kind = error.get("type") or error.get("code")
            return (
                str(kind) if kind else None,
                message if isinstance(message, str) and message else fallback,
            )
    return None, fallback


def refuse_unsupported(provider: str, unsupported: Mapping[str, str | None]) -> None:
    """Refuse a request that sets a model setting the provider cannot honour.

    `unsupported` maps each setting the request sets but the provider lacks onto
    what to use instead (or `None`). Used for the settings that change what the
    output is (`stop_sequences`, `parallel_tool_calls=False`): dropping them
    would hand the loop an answer its author ruled out. Sampling hints
    (`temperature`, `top_p`, `seed`) a provider lacks are left out instead.

    Raises:
        ConfigurationError: naming the first such setting.
    """
    for setting, instead in unsupported.items():
        hint = f"; {instead}" if instead else ""
        raise ConfigurationError(f"{provider} has no {setting} setting{hint}")


def new_call_id() -> str:
    """A call id for a function call the server sent without one."""
    return f"call_{uuid.uuid4().hex[:24]}"


def retryable_status(status: int) -> bool:
    """Whether an HTTP status is transient: timeouts, conflicts, rate limits, 5xx."""
    return status in _RETRYABLE_STATUS or status >= 500


def stream_error(
    vendor: str, kind: str | None, message: str, *, retryable: bool
) -> ProviderError:
    """A `ProviderError` for an error the server sent inside a streamed answer."""
    detail = f"{kind}: {message}" if kind else message
    return ProviderError(f"{vendor} stream error: {detail}", retryable=retryable)


async def next_or_none(stream: AsyncIterator[T]) -> T | None:
    """The stream's next item, or `None` at its end.

    `async for` over an SDK stream makes an async generator (its `__aiter__`)
    that nobody closes when the stream is left early; `__anext__` makes none.
    """
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def close_stream(deltas: AsyncGenerator[Any, None], stream: Closable) -> None:
    """Close a provider's deltas and the SDK stream under them.

    Shielded: it runs when the loop is cancelled too, and the HTTP response is
    then closed rather than left to the garbage collector.
    """
    with anyio.move_on_after(CLOSE_TIMEOUT, shield=True):
        await deltas.aclose()
        await stream.close()


def status_error(
    vendor: str, status: int, kind: str | None, message: str
) -> ProviderError:
    """A `ProviderError` for an HTTP error answer, retryable when it is transient."""
    detail = f"{kind}: {message}" if kind else message
    return ProviderError(
        f"{vendor} answered HTTP {status}: {detail}",
        retryable=retryable_status(status),
        status_code=status,
    )


def schema_name(output: type[BaseModel] | Mapping[str, Any]) -> str:
    """The name a structured-output schema is sent under (`[a-zA-Z0-9_-]{1,64}`)."""
    if isinstance(output, Mapping):
        title = output.get("title")
        raw = title if isinstance(title, str) else "output"
    else:
        raw = output.__name__
    return _NAME_CHARS.sub("_", raw).strip("_")[:64] or "output"


def structured_schema(output: type[BaseModel] | Mapping[str, Any]) -> dict[str, Any]:
    """The JSON schema of a structured output: a model's, or the mapping as given."""
    if isinstance(output, Mapping):
        return dict(output)
    return output.model_json_schema()


def strict_compatible(schema: Any) -> bool:
    """Whether a JSON schema already meets OpenAI's strict mode as it is.

    Strict mode wants every object closed (`additionalProperties: false`) with
    every property required, and no `$ref` beside other keywords. A schema that
    falls short is sent non-strict rather than changed, since changing it (making
    an optional parameter required, say) would change what the model may send.
    """
    if not isinstance(schema, dict):
        return isinstance(schema, bool)
    if "$ref" in schema and len(schema) > 1:
        return False
    properties = schema.get("properties")
    if schema.get("type") == "object" or properties is not None:
        if schema.get("additionalProperties") is not False:
            return False
        if not isinstance(properties, dict):
            properties = {}
        if set(schema.get("required", ())) != set(properties):
            return False
    for key in _SCHEMA_MAPS:
        if not all(strict_compatible(sub) for sub in schema.get(key, {}).values()):
            return False
    for key in _SCHEMA_LISTS:
        if not all(strict_compatible(sub) for sub in schema.get(key, ())):
            return False
    return all(
        strict_compatible(schema[key]) for key in _SCHEMA_VALUES if key in schema
    )


_SCHEMA_MAPS: Final = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS: Final = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES: Final = ("items", "not", "if", "then", "else", "contains")


def tool_input(call: FunctionCallItem) -> dict[str, Any]:
    """A call's arguments as a JSON object (`{}` when the text is not one).

    Arguments cut off by a token limit are not valid JSON; the loop answered
    such a call with an error output, and the call still has to be sent back.
    """
    try:
        value = from_json(call.arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# ----------------------------------------------------------------------- images


def image_url(block: ImageBlock) -> str:
    """The image as OpenAI's APIs take one: its URL, or its bytes as a `data:` URL."""
    if block.data is None:
        assert block.url is not None  # validation: an image has bytes or a URL
        return block.url
    assert block.media_type is not None  # validation sniffs it from the bytes
    return _images.data_url(block.media_type, block.data)


def text_only(model: str, names: Sequence[str]) -> bool:
    """Whether `model` (`provider:model`, or the bare name) is one of `names`:
    exact names, or prefixes ending with `*`."""
    prefix, sep, name = model.partition(":")
    name = name if sep else prefix
    return any(name.startswith(n[:-1]) if n.endswith("*") else name == n for n in names)


def image_override(images: ImageSupport | None) -> ImageSupport | None:
    """A provider's `images=` argument, checked.

    Raises:
        ConfigurationError: it is not an `ImageSupport`.
    """
    if images is not None and not isinstance(images, ImageSupport):
        raise ConfigurationError(
            f"images must be an ImageSupport (or None), got {type(images).__name__}"
        )
    return images


class ImageMapping:
    """How one request sends its images: what its model takes, and the
    tool-result images it sent as text instead.

    A provider makes one per request, its mapping asks it about each image,
    and the output takes the images described (`output`). A user message's
    image the model cannot take is an error here (`check_user`): the loop
    refuses such a message before it enters the context, so it can only come
    from a context filled directly, or a model changed since (by a handler).
    """

    __slots__ = ("_described", "model", "support")

    def __init__(self, model: str, support: ImageSupport) -> None:
        self.model = model
        """The request's model, as errors name it."""
        self.support = support
        self._described: list[str] = []

    def check_user(self, message: UserMessage) -> None:
        """Refuse a user message holding an image the model cannot take.

        Raises:
            ImageNotSupported: naming the model, what it lacks and the block.
        """
        if type(message.content) is not str:
            for index, block in enumerate(message.content):
                if type(block) is ImageBlock:
                    self._present(block, f"a user message's content[{index}]")
        refused = self.support.refusal(message)
        if refused is not None:
            lacking, where = refused
            raise ImageNotSupported(
                f"model {self.model!r} does not take {lacking}: a user "
                f"message of the context holds {where}, which cannot be sent "
                "to it (the message was put in the context directly, or the "
                "model changed after it entered)",
                model=self.model,
                capability=lacking,
                block=where,
            )

    def tool_output(
        self, item: FunctionCallOutputItem, *, takes_images: bool = True
    ) -> tuple[str, tuple[ImageBlock, ...]]:
        """`(text, images to send)` of a tool's output.

        An image the model cannot take in a tool result (any image, with
        `takes_images=False`: an API whose tool outputs hold text only) is a
        line of text after the output, its reference
        (`[image: image/png, 70 bytes, sha256:...]`), and is recorded as
        described.
        """
        images = item.images
        if not images:
            return item.output, ()
        sent: list[ImageBlock] = []
        lines: list[str] = []
        for block in images:
            self._present(block, f"the output of call {item.call_id!r}")
            if takes_images and self.support.lacking(block, tool_result=True) is None:
                sent.append(block)
                continue
            lines.append(block.reference)
            name = block.digest if block.digest is not None else block.url
            assert name is not None  # validation: an image has bytes or a URL
            self._described.append(name)
        text = item.output
        if lines:
            text = "\n".join([text, *lines] if text else lines)
        return text, tuple(sent)

    def _present(self, block: ImageBlock, where: str) -> None:
        if block.is_reference:
            raise ImageMissing(
                f"{where} is {block.reference} by reference: its bytes were not "
                f"read back, so the request to {self.model!r} cannot send it"
            )

    @property
    def described(self) -> tuple[str, ...]:
        """The digests (or URLs) of the tool-result images sent as text, in order."""
        return tuple(self._described)

    def output(self, output: InferenceOutput) -> InferenceOutput:
        """`output` with the images this request described (`images_described`)."""
        if not self._described:
            return output
        return output.model_copy(update={"images_described": self.described})
