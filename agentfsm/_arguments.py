"""Checks of a public call's arguments: their types, and durations.

Every public call (`Runtime`'s and `Agent`'s methods, the stores' and the event
log's constructors, tool and MCP timeouts, loop options) checks what it is
given before it writes or publishes anything: a value of another type would
otherwise be written where it cannot be read back (a `cancel` reason of `404`
in a stored record, say), and a NaN timeout would fail every call it bounds.

The errors name the parameter and what was given. Each is a
`ConfigurationError` (the developer's mistake, as agentfsm's other checks
raise) and the builtin `TypeError` or `ValueError` alike.

A type check is one `isinstance` and a call: cheap enough for `run_loop` and
`wait`, which every loop goes through.
"""

from __future__ import annotations

import math
import os
import reprlib
from collections.abc import Callable
from numbers import Real
from types import NoneType, UnionType
from typing import Final, TypeAlias

from .exceptions import ConfigurationError

__all__ = (
    "private_opener",
    "ArgumentTypeError",
    "ArgumentValueError",
    "Kind",
    "check",
    "file_mode_of",
    "given",
    "one_of",
    "seconds",
    "seconds_or_none",
    "timeout_or_none",
)

Kind: TypeAlias = type | UnionType | tuple[type, ...]
"""What `isinstance` takes: a class, a union (`str | None`) or a tuple of classes."""


class ArgumentTypeError(ConfigurationError, TypeError):
    """A public call was given an argument of another type than it takes."""


class ArgumentValueError(ConfigurationError, ValueError):
    """A public call was given a value its parameter cannot take (a NaN, negative
    or infinite duration, say)."""


_REPR: Final = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60  # a message quotes what was given, not all of it


def given(value: object) -> str:
    """What was given, for a message: its type and itself when short
    (`int 404`), else its type alone (`a FunctionProvider`)."""
    kind = type(value).__name__
    text = repr(value)
    return f"{kind} {text}" if len(text) <= 60 else f"{_article(kind)} {kind}"


def check(name: str, value: object, kind: Kind, expected: str | None = None) -> None:
    """Refuse `value` for the parameter `name` unless it is of `kind` (a bool
    is no int, unless `kind` names `bool`).

    Args:
        name: the parameter, as the message names it.
        value: what the caller gave.
        kind: the classes it may be of (`str | None`).
        expected: what the message says it must be (default: from `kind`,
            "a str or None").

    Raises:
        ArgumentTypeError: it is not.
    """
    if isinstance(value, kind) and (type(value) is not bool or bool in _kinds(kind)):
        return
    raise ArgumentTypeError(
        f"{name} must be {expected or _expected(kind)}, got {given(value)}"
    )


def one_of(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Refuse `value` for the parameter `name` unless it is one of `choices`.

    Raises:
        ArgumentTypeError: it is not a str.
        ArgumentValueError: it is another str.
    """
    if value in choices and isinstance(value, str):
        return
    error = ArgumentValueError if isinstance(value, str) else ArgumentTypeError
    quoted = [repr(c) for c in choices]
    expected = (
        f"{', '.join(quoted[:-1])} or {quoted[-1]}" if len(quoted) > 1 else quoted[0]
    )
    raise error(f"{name} must be {expected}, got {_REPR.repr(value)}")


def seconds(
    name: str, value: object, *, positive: bool = False, rule: str | None = None
) -> float:
    """`value`, a duration in seconds, as a float.

    Args:
        name: the parameter, as the message names it.
        value: what the caller gave: a real number (a bool is none).
        positive: refuse 0 too (a timeout of 0 could never be met).
        rule: what the message says it must be (default: from `positive`).

    Raises:
        ArgumentTypeError: `value` is not a number.
        ArgumentValueError: it is NaN, infinite, negative, or 0 when `positive`
            (no timer takes NaN; `inf` cannot be stored, sent to Temporal or
            written as JSON: a parameter without a limit takes None instead).
    """
    number = _number(value)
    error: type[ConfigurationError]
    if number is None:
        shown, error = given(value), ArgumentTypeError
    elif (number > 0 or (number == 0 and not positive)) and number != math.inf:
        return number
    else:
        shown, error = _REPR.repr(value), ArgumentValueError
    rule = rule or (_POSITIVE if positive else _AT_LEAST_0)
    raise error(f"{name} must be {rule}, got {shown}")


def seconds_or_none(
    name: str, value: object, *, positive: bool = False, rule: str | None = None
) -> float | None:
    """`seconds`, taking None too (no limit) and returning it as it is."""
    if value is None:
        return None
    default = _POSITIVE if positive else _AT_LEAST_0
    return seconds(name, value, positive=positive, rule=rule or f"{default} or None")


def timeout_or_none(name: str, value: object) -> float | None:
    """A timeout: `seconds` > 0, or None for no limit."""
    return seconds_or_none(
        name,
        value,
        positive=True,
        rule="positive (a finite number of seconds) or None (no limit)",
    )


_POSITIVE: Final = "a positive, finite number of seconds"
_AT_LEAST_0: Final = "a finite number of seconds >= 0"


def _number(value: object) -> float | None:
    """`value` as a float, if it is a real number (a bool is none); `inf` for
    one too large for a float."""
    if type(value) is bool or not isinstance(value, Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _kinds(kind: Kind) -> tuple[type, ...]:
    if isinstance(kind, UnionType):
        return kind.__args__
    return kind if isinstance(kind, tuple) else (kind,)


def _expected(kind: Kind) -> str:
    """`str | None` as "a str or None"."""
    names = [
        "None" if k is NoneType else f"{_article(k.__name__)} {k.__name__}"
        for k in _kinds(kind)
    ]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _article(noun: str) -> str:
    return "an" if noun[:1].lower() in ("a", "e", "i", "o") else "a"


def file_mode_of(mode: object) -> int:
    """`file_mode`, permission bits for a file agentfsm creates (`0o600`).

    Raises:
        ArgumentTypeError: it is not an int.
        ArgumentValueError: it is not within 0 and 0o777.
    """
    check("file_mode", mode, int)
    assert isinstance(mode, int)
    if not 0 <= mode <= 0o777:
        raise ArgumentValueError(
            f"file_mode must be permission bits within 0 and 0o777, got {mode!r}"
        )
    return mode


def private_opener(mode: int) -> Callable[[str, int], int]:
    """An `opener` for `open()` that creates a missing file with permissions
    `mode` (less the umask) rather than 0o666: the files agentfsm writes hold
    prompts and tool outputs. An existing file keeps its own."""
    return lambda path, flags: os.open(path, flags, mode)
