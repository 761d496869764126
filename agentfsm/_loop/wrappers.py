"""Wrapper chains: `(value, next)` callables composed around an innermost call
(the model wrappers around the provider call, the tool wrappers around a tool)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

__all__ = ("chain_wrappers",)

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
