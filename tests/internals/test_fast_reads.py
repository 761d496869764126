"""`_models.read_fields_fast`: on CPython 3.11 the library's models get the
generic attribute lookup (so the interpreter specializes their field reads),
and nothing a user can see changes."""

from __future__ import annotations

import ctypes
import dis
import importlib
import pkgutil
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, PrivateAttr

import agentfsm
from agentfsm import _models
from agentfsm.interception import ToolBatch
from agentfsm.messages import FunctionCallItem, TokenUsage

ON_311 = sys.implementation.name == "cpython" and sys.version_info[:2] == (3, 11)
GENERIC = ctypes.cast(ctypes.pythonapi.PyObject_GenericGetAttr, ctypes.c_void_p).value


def reads_generically(cls: type) -> bool:
    """Whether `cls`'s `tp_getattro` is the generic lookup (read through ctypes
    at the offset `_models` uses; checked against plain classes first)."""
    offset = 18 * ctypes.sizeof(ctypes.c_void_p)
    value: int | None = ctypes.c_void_p.from_address(id(cls) + offset).value
    return value == GENERIC


def library_modules() -> list[ModuleType]:
    modules = []
    for info in pkgutil.walk_packages(agentfsm.__path__, "agentfsm."):
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError:  # an optional extra not installed
            continue
    return modules


def models_defined_in(module: ModuleType) -> list[type[BaseModel]]:
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, BaseModel)
        and value.__module__ == module.__name__
    ]


def test_the_offset_tells_a_plain_class_from_a_hooked_one() -> None:
    class Plain:
        pass

    class Hooked:
        def __getattr__(self, name: str) -> Any:
            raise AttributeError(name)

    assert reads_generically(Plain)
    assert not reads_generically(Hooked)
    assert not reads_generically(BaseModel)
    # The library's own check of the offset agrees: on 3.11 it found it.
    assert (_models._set_generic_getattr is not None) is ON_311


@pytest.mark.skipif(not ON_311, reason="only CPython 3.11 needs it")
def test_every_model_the_library_defines_reads_fields_generically() -> None:
    models = [m for module in library_modules() for m in models_defined_in(module)]
    assert len(models) > 60  # (the walk found the library)
    slow = [
        f"{m.__module__}.{m.__qualname__}" for m in models if not reads_generically(m)
    ]
    assert slow == [], "a module defining models lacks read_fields_fast(globals())"


def specialized_reads(read: Callable[[Any], object], instance: object) -> list[str]:
    for _ in range(64):  # past the adaptive counters' warm-up
        read(instance)
    return [
        i.opname
        for i in dis.get_instructions(read, adaptive=True)
        if i.opname.startswith("LOAD_ATTR")
    ]


@pytest.mark.skipif(not ON_311, reason="3.12 specializes such reads itself")
@pytest.mark.parametrize(
    ("instance", "read"),
    [
        (FunctionCallItem(call_id="c1", name="add", arguments="{}"), lambda m: m.name),
        (ToolBatch(calls=()), lambda m: m.calls),
        (TokenUsage(input_tokens=1), lambda m: m.input_tokens),
    ],
    ids=["FunctionCallItem", "ToolBatch", "TokenUsage"],
)
def test_a_field_read_is_specialized(
    instance: BaseModel, read: Callable[[Any], object]
) -> None:
    opnames = specialized_reads(read, instance)
    assert opnames in (["LOAD_ATTR_WITH_HINT"], ["LOAD_ATTR_INSTANCE_VALUE"])


def test_a_missing_attribute_is_the_same_error() -> None:
    item = FunctionCallItem(call_id="c1", name="add", arguments="{}")
    with pytest.raises(
        AttributeError, match="'FunctionCallItem' object has no attribute 'nope'"
    ):
        _ = item.nope  # type: ignore[attr-defined]
    assert not hasattr(item, "nope")
    assert getattr(item, "nope", 3) == 3
    assert item.model_dump()["name"] == "add"  # methods found as before


class _Private(BaseModel):
    value: int = 0
    _secret: int = PrivateAttr(default=7)


class _Extra(BaseModel):
    model_config = ConfigDict(extra="allow")
    value: int = 0


class _OwnHook(BaseModel):
    value: int = 0

    def __getattr__(self, name: str) -> Any:
        if name == "computed":
            return self.value * 2
        return super().__getattr__(name)  # type: ignore[misc]


class _Audited(BaseModel):
    value: int = 0

    def __getattribute__(self, name: str) -> Any:
        if name == "value":
            return -1
        return super().__getattribute__(name)


class _Sub(FunctionCallItem):
    _note: str = PrivateAttr(default="kept")


def test_models_the_hook_serves_keep_it() -> None:
    """Private attributes, extra fields and a model's own `__getattr__` need
    BaseModel's hook, and a model's own `__getattribute__` its slot:
    `read_fields_fast` leaves those models as they are."""
    _models.read_fields_fast(globals())
    assert _Private()._secret == 7
    assert _Extra(value=1, more=2).more == 2  # type: ignore[call-arg,attr-defined]
    assert _OwnHook(value=2).computed == 4
    assert _Audited(value=3).value == -1
    # A subclass of a library model made later gets the hook back.
    assert _Sub(call_id="c", name="n", arguments="{}")._note == "kept"
    for cls in (_Private, _Extra, _OwnHook, _Audited, _Sub):
        assert not reads_generically(cls)


def test_extra_fields_allowed_at_validation_are_kept() -> None:
    """The one difference on 3.11: kept in `model_extra`, read as
    attributes only where the hook is (elsewhere, always)."""
    usage = TokenUsage.model_validate({"trace_id": "t-1"}, extra="allow")
    assert usage.model_extra == {"trace_id": "t-1"}
    assert getattr(usage, "trace_id", None) == (None if ON_311 else "t-1")
