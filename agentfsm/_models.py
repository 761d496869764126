"""Models and JSON text from data the library made itself, without validating it
again; and fields read at a slot's speed on Python 3.11 (`read_fields_fast`).

The loop builds a dozen models per step (events, results, tool outputs) from
values it already holds in the right types; validating them again was the
largest cost of a step. `trusted()` does what `BaseModel.model_construct` does
for a model whose every field is given, minus its per-field work (~1.9 µs
against ~2.9 for `model_validate` of an event). `tests/internals/test_trusted_models.py`
checks that each model built this way equals the validated one,
`model_fields_set` included.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

__all__ = ("defaults", "json_of", "read_fields_fast", "trusted")

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


def _attribute_reader_setter() -> Callable[[type], None] | None:
    """What `read_fields_fast` does to a class on CPython 3.11, or None (nothing
    to do elsewhere, or this interpreter's type objects are not as expected).

    CPython 3.11 specializes an attribute read (`LOAD_ATTR`) only on a type
    whose `tp_getattro` slot is the generic one, and a class with a
    `__getattr__` anywhere in its MRO (every pydantic model: BaseModel's
    serves private attributes and extra fields) gets a hook there instead, so
    each field read takes the slow path (~440 instructions, against ~80 once
    specialized). 3.12 specializes such reads itself (CPython gh-93911).
    """
    if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11):
        return None
    import ctypes

    # `tp_getattro` is the 19th pointer-sized field of a type object (after the
    # object header, name, sizes, dealloc, vectorcall offset, getattr, setattr,
    # async, repr, number, sequence, mapping, hash, call, str).
    offset = 18 * ctypes.sizeof(ctypes.c_void_p)
    generic = ctypes.cast(ctypes.pythonapi.PyObject_GenericGetAttr, ctypes.c_void_p)

    def slot(cls: type) -> Any:
        return ctypes.c_void_p.from_address(id(cls) + offset)

    class Plain:
        pass

    class Hooked:
        def __getattr__(self, name: str) -> Any:
            raise AttributeError(name)

    hook = slot(Hooked).value
    # The offset is right only if it tells these apart: never write otherwise.
    if slot(Plain).value != generic.value or hook in (None, generic.value):
        return None
    if slot(BaseModel).value != hook:
        return None

    def set_generic(cls: type) -> None:
        getattro = slot(cls)
        if getattro.value == hook:
            getattro.value = generic.value

    return set_generic


_set_generic_getattr: Final = _attribute_reader_setter()


def read_fields_fast(namespace: Mapping[str, Any]) -> None:
    """Let CPython 3.11 specialize reads of the fields of the models a module
    defines (`read_fields_fast(globals())` at its end); nothing elsewhere.

    A model qualifies when BaseModel's `__getattr__` has nothing to serve it:
    no private attributes, no extra fields allowed by its config, no
    `__getattr__` or `__getattribute__` of its own. Its type then gets the
    generic attribute lookup, which finds the same fields, methods and
    descriptors; a missing attribute raises the same `AttributeError`. One
    difference shows on 3.11: extra fields allowed at validation time only
    (`model_validate(data, extra="allow")`) are in `model_extra` but not
    readable as attributes. A subclass made later gets the hook back
    (as does the class if a `__getattr__` is ever set on it); it is just
    slower. Saves ~48,000 instructions a benchmark run (6.6%, `make
    bench-instructions`; bench/PERFORMANCE.md).
    """
    if _set_generic_getattr is None:
        return
    name = namespace["__name__"]
    for value in list(namespace.values()):
        if (
            isinstance(value, type)
            and issubclass(value, BaseModel)
            and value.__module__ == name
            and not value.__private_attributes__
            and value.model_config.get("extra") != "allow"
            and value.__getattr__ is BaseModel.__getattr__  # type: ignore[attr-defined]
            and value.__getattribute__ is object.__getattribute__
        ):
            _set_generic_getattr(value)
