"""What the spans share: the provider's name, where it is served, errors, and
the one way anything is written to a span.

Every span of `agentfsm.otel` is started and written through the functions
here: each makes its texts encodable (a lone surrogate escaped, see
`agentfsm._text.encodable`) and none raises. A tracer, span processor or
exporter that fails is logged as `otel_failed` and the loop goes on, untraced
where the tracing failed: tracing never changes how a loop ends.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import anyio
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanKind, StatusCode, Tracer

from agentfsm._errors import error_text
from agentfsm._logging import get_logger
from agentfsm._text import encodable

from . import _content as content

__all__ = (
    "METADATA_CHARS",
    "NO_SPAN",
    "add_event",
    "end",
    "error_type",
    "failed",
    "guarded",
    "provider_name",
    "server_attributes",
    "set_attributes",
    "set_error",
    "start_span",
    "tracing_failed",
)

_T = TypeVar("_T")

METADATA_CHARS: Final = 128
"""The most characters a model-chosen id (a call id, a response id) or a
model's name keeps on a span: ids are short, longer text is not metadata."""

NO_SPAN: Final[Span] = INVALID_SPAN
"""What a span that could not be started is: it records nothing."""

BUILTIN_NAMES: Final = {
    "openai": "openai",
    "openai-chat": "openai",
    "anthropic": "anthropic",
    "local": "llama.cpp",
}
"""`gen_ai.provider.name` of the built-in prefixes. `openai` and `anthropic`
are the conventions' own values; llama.cpp has none, so the local provider's
is a custom one."""

_BUILTIN_MODULES: Final = {
    "agentfsm.providers.openai": "openai",
    "agentfsm.providers.anthropic": "anthropic",
    "agentfsm.providers.local": "llama.cpp",
}
"""The same, by the module of a built-in provider's class, for one registered
under a prefix of the user's (`{"oai": OpenAIChatProvider(...)}`)."""


def provider_name(prefix: str, provider: object, names: Mapping[str, str]) -> str:
    """`gen_ai.provider.name`: the user's name for the prefix, the built-in
    one, the built-in provider's, or else the prefix itself."""
    name = names.get(prefix) or BUILTIN_NAMES.get(prefix)
    if name is None:
        name = _BUILTIN_MODULES.get(type(provider).__module__, prefix)
    return name


def server_attributes(provider: object) -> dict[str, Any]:
    """`server.address` and `server.port` of a provider with an SDK client
    (the built-in OpenAI and Anthropic ones); none for the others."""
    url = getattr(getattr(provider, "client", None), "base_url", None)
    host = getattr(url, "host", None)
    if not isinstance(host, str) or not host:
        return {}
    port = getattr(url, "port", None)
    if not isinstance(port, int):
        port = 443 if getattr(url, "scheme", "https") == "https" else 80
    return {"server.address": host, "server.port": port}


def error_type(exc: BaseException) -> str:
    """`error.type`: the exception's class, fully qualified (builtins by name);
    a cancellation (a timeout's, or the loop's) is `cancelled`."""
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return "cancelled"
    cls = type(exc)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def failed(span: Span, exc: BaseException, capture: bool) -> None:
    """Mark `span` as ended by `exc` (a cancellation is not recorded as an
    exception: nothing went wrong where the span was).

    The exception's message and traceback quote whatever it was raised about
    (a tool's output, a model's answer), so they are recorded only when
    content is captured; its type always is.
    """
    try:
        kind = error_type(exc)
        set_attributes(span, {"error.type": kind})
        if kind == "cancelled":
            return
        attributes = {"exception.type": kind}
        if capture:
            attributes["exception.message"] = error_text(exc)
            attributes["exception.stacktrace"] = "".join(
                traceback.format_exception(exc)
            )
        add_event(span, "exception", attributes)
        set_error(span, attributes.get("exception.message", content.WITHHELD))
    except Exception as error:  # noqa: BLE001 - tracing never fails a loop
        tracing_failed("failed", error)


# ------------------------------------------------------- writing to a span


def tracing_failed(what: str, exc: Exception) -> None:
    """Log a failure of the tracing itself (the loop goes on)."""
    get_logger().warning(
        "otel_failed",
        during=what,
        error=f"{type(exc).__name__}: {error_text(exc)}",
    )


def guarded(
    what: str, function: Callable[..., _T], /, *args: Any, otherwise: _T, **kwargs: Any
) -> _T:
    """`function(*args, **kwargs)`, or `otherwise` when it raises (logged)."""
    try:
        return function(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - tracing never fails a loop
        tracing_failed(what, exc)
        return otherwise


def _encodable(value: Any) -> Any:
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, list | tuple):
        return tuple(encodable(v) if isinstance(v, str) else v for v in value)
    return value


def _attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """`attributes` with each text (a str, or a str in a sequence) encodable."""
    return {key: _encodable(value) for key, value in attributes.items()}


def start_span(
    tracer: Tracer,
    name: str,
    kind: SpanKind,
    attributes: Mapping[str, Any],
    links: Sequence[Link] = (),
) -> Span:
    """A started span; a non-recording one when the tracer fails."""
    try:
        return tracer.start_span(
            encodable(name), kind=kind, attributes=_attributes(attributes), links=links
        )
    except Exception as exc:  # noqa: BLE001 - tracing never fails a loop
        tracing_failed("start_span", exc)
        return NO_SPAN


def set_attributes(span: Span, attributes: Mapping[str, Any]) -> None:
    try:
        span.set_attributes(_attributes(attributes))
    except Exception as exc:  # noqa: BLE001 - tracing never fails a loop
        tracing_failed("set_attributes", exc)


def add_event(
    span: Span,
    name: str,
    attributes: Mapping[str, Any],
    timestamp: int | None = None,
) -> None:
    try:
        span.add_event(name, _attributes(attributes), timestamp=timestamp)
    except Exception as exc:  # noqa: BLE001 - tracing never fails a loop
        tracing_failed("add_event", exc)


def set_error(span: Span, description: str) -> None:
    """Mark `span` failed. `description` is metadata, or text that went
    through `content.untrusted`."""
    try:
        span.set_status(StatusCode.ERROR, encodable(description))
    except Exception as exc:  # noqa: BLE001 - tracing never fails a loop
        tracing_failed("set_status", exc)


def end(span: Span) -> None:
    try:
        span.end()
    except Exception as exc:  # noqa: BLE001 - tracing never fails a loop
        tracing_failed("end", exc)
