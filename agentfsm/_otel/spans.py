"""What the spans share: the provider's name, where it is served, errors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import anyio
from opentelemetry.trace import Span, StatusCode

from agentfsm._errors import error_text

__all__ = ("error_type", "failed", "provider_name", "server_attributes")

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


def failed(span: Span, exc: BaseException) -> None:
    """Mark `span` as ended by `exc` (a cancellation is not recorded as an
    exception: nothing went wrong where the span was)."""
    kind = error_type(exc)
    span.set_attribute("error.type", kind)
    if kind != "cancelled":
        span.record_exception(exc)
        span.set_status(StatusCode.ERROR, error_text(exc))
