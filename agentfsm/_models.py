"""Models and JSON text from data the library made itself, without validating it again.

The loop builds a dozen models per step (events, results, tool outputs) from
values it already holds in the right types; validating them again was the
largest cost of a step. `trusted()` does what `BaseModel.model_construct` does
for a model whose every field is given, minus its per-field work (~1.9 µs
against ~2.9 for `model_validate` of an event). `tests/internals/test_trusted_models.py`
checks that each model built this way equals the validated one,
`model_fields_set` included.
"""

from __future__ import annotations

from typing import Any, Final, TypeVar

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

__all__ = ("defaults", "json_of", "trusted")

M = TypeVar("M", bound=BaseModel)

# What `cls.__new__` is for a model, without the metaclass lookup.
new_bare = object.__new__

# The setters of a model's four slots, taken from their descriptors once:
# `object.__setattr__(model, name, value)` looks each name up in the class
# first (a model built this way: ~590 against ~450 ns by timeit).
_SLOTS: Final = BaseModel.__dict__
set_dict: Final = _SLOTS["__dict__"].__set__
set_fields_set: Final = _SLOTS["__pydantic_fields_set__"].__set__
_set_extra: Final = _SLOTS["__pydantic_extra__"].__set__
_set_private: Final = _SLOTS["__pydantic_private__"].__set__


def defaults(cls: type[BaseModel]) -> dict[str, Any]:
    """The static defaults of a model's fields (fields with a default factory excluded)."""
    return {
        name: field.default
        for name, field in cls.model_fields.items()
        if field.default is not PydanticUndefined
    }


def trusted(cls: type[M], values: dict[str, Any], fields_set: set[str]) -> M:
    """An instance of `cls` holding `values` (every field, already valid) as they are."""
    model = new_bare(cls)
    set_dict(model, values)
    set_fields_set(model, fields_set)
    _set_extra(model, None)
    _set_private(model, None)
    return model


def json_of(model: BaseModel, **options: Any) -> str:
    """`model.model_dump_json(**options)`, from the model's serializer itself
    (the same defaults; none of the models serialized has an alias): ~0.4 µs
    less a call, the method's own keyword handling, and a durable store makes
    ~26 calls a benchmark run (bench/bench_durable.py)."""
    return model.__pydantic_serializer__.to_json(model, **options).decode()
