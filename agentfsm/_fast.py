"""Small pieces of the hot path: pydantic models built from data the library
made itself without validating it again, the backend's anyio classes, JSON text.

The loop builds a dozen models per step (events, results, tool outputs) from
values it already holds in the right types; validating them again was the
largest cost of a step. `trusted()` does what `BaseModel.model_construct` does
for a model whose every field is given, minus its per-field work. Tests check
that each model built this way equals the validated one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_json

__all__ = ("Primitives", "defaults", "json_text", "primitives", "trusted")

M = TypeVar("M", bound=BaseModel)

_new = object.__new__  # what `cls.__new__` is for a model, without the metaclass lookup
_setattr = object.__setattr__


def defaults(cls: type[BaseModel]) -> dict[str, Any]:
    """The static defaults of a model's fields (fields with a default factory excluded)."""
    return {
        name: field.default
        for name, field in cls.model_fields.items()
        if field.default is not PydanticUndefined
    }


def trusted(cls: type[M], values: dict[str, Any], fields_set: set[str]) -> M:
    """An instance of `cls` holding `values` (every field, already valid) as they are."""
    model = _new(cls)
    _setattr(model, "__dict__", values)
    _setattr(model, "__pydantic_fields_set__", fields_set)
    _setattr(model, "__pydantic_extra__", None)
    _setattr(model, "__pydantic_private__", None)
    return model


class Primitives:
    """The anyio classes the hot path makes instances of."""

    __slots__ = ("cancel_scope", "event")

    def __init__(
        self,
        cancel_scope: Callable[..., anyio.CancelScope],
        event: Callable[[], anyio.Event],
    ) -> None:
        self.cancel_scope = cancel_scope
        self.event = event


def primitives() -> Primitives:
    """The running backend's `CancelScope` and `Event` classes.

    `anyio.CancelScope()` and `anyio.Event()` find the running backend (a
    sniffio lookup) and then call its class; a runtime finds it once, and its
    loops call the class directly.
    """
    return Primitives(type(anyio.CancelScope()), type(anyio.Event()))


def json_text(value: Any) -> str:
    """`value` as text: a str as it is, anything else as JSON (tool outputs and
    arguments)."""
    return value if isinstance(value, str) else to_json(value).decode()
