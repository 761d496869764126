"""Wrapper chains: `(value, next)` callables composed around an innermost call
(the model wrappers around the provider call, the tool wrappers around a tool),
and the extensions' provider layers around a loop's provider registry."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from agentfsm.providers import ProviderRegistry

if TYPE_CHECKING:
    from agentfsm.extensions import LoopExtension
    from agentfsm.providers import Provider

    from .loop import Loop

__all__ = ("LayeredProviders", "chain_wrappers", "hook_failed")

In = TypeVar("In")
Out = TypeVar("Out")


def chain_wrappers(
    wrappers: Sequence[Callable[[In, Callable[[In], Awaitable[Out]]], Awaitable[Out]]],
    innermost: Callable[[In], Awaitable[Out]],
) -> Callable[[In], Awaitable[Out]]:
    """Compose `(value, next)` wrappers around `innermost`, the first outermost
    (the model wrappers around the provider call, the tool wrappers around a tool)."""
    chain = innermost
    for wrapper in reversed(wrappers):
        chain = _bind(wrapper, chain)
    return chain


def _bind(
    wrapper: Callable[[In, Callable[[In], Awaitable[Out]]], Awaitable[Out]],
    inner: Callable[[In], Awaitable[Out]],
) -> Callable[[In], Awaitable[Out]]:
    def call(value: In) -> Awaitable[Out]:
        return wrapper(value, inner)

    return call


class LayeredProviders(ProviderRegistry):
    """A loop's registry with its extensions' provider layers: each provider
    the runtime's registry resolves, wrapped by each layer (the first
    outermost). `resolve` is all a loop asks of its registry."""

    __slots__ = ("_layers", "inner")

    def __init__(
        self, inner: ProviderRegistry, layers: Sequence[Callable[[Provider], Provider]]
    ) -> None:
        super().__init__()
        self.inner = inner
        """The runtime's registry."""
        self._layers = tuple(reversed(layers))

    def resolve(self, model: str) -> Provider:
        provider = self.inner.resolve(model)
        for layer in self._layers:
            provider = layer(provider)
        return provider


def hook_failed(loop: Loop, part: LoopExtension, hook: str, exc: Exception) -> None:
    """Log an extension's hook that raised (it is passed over: an extension
    never stops a loop)."""
    loop.log.error(
        "extension_hook_failed",
        extension=type(part).__qualname__,
        hook=hook,
        error=f"{type(exc).__name__}: {exc}",
    )
