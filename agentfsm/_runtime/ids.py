"""Where a runtime reads the time and makes loop ids: `Runtime(clock=, ids=)`.

By default the time is `datetime.now(UTC)` and loop ids are UUIDv7s (unique,
and sortable by creation time within a process). A runtime given its own
sources uses them for everything it stamps or names: event timestamps (`ts`),
a loop's `started_at` and `ended_at`, and loop ids (event ids are
`<loop_id>:<seq>`, so they follow). A Temporal workflow passes sources built on
`workflow.now()` and `workflow.uuid4()`, which replay the same values; a test
passes a fixed clock and counter ids, which make a run's events repeat exactly.

The sources a user gives are wrapped so that a wrong value is refused by name
(`checked_clock`, `checked_ids`); the defaults are used as they are, at no cost
over reading the clock directly.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from typing import TypeAlias

from agentfsm._arguments import ArgumentTypeError, given
from agentfsm._text import encodable
from agentfsm.exceptions import ConfigurationError

__all__ = ("Clock", "IdSource", "checked_clock", "checked_ids", "utc_now", "uuid7")

Clock: TypeAlias = Callable[[], datetime]
"""Returns the current time, timezone-aware (events and results say UTC)."""

IdSource: TypeAlias = Callable[[], str]
"""Returns a new loop id, unique within the runtime."""

utc_now: Clock = partial(datetime.now, UTC)
"""The default clock. A partial of the C function, not a lambda: a call is one
C-level hop, about what `datetime.now(UTC)` written out costs (a Python
function around it would be a frame per event)."""

_last_ms = 0
_counter = 0


def uuid7() -> str:
    """A UUIDv7 string (RFC 9562): 48-bit milliseconds, a 12-bit counter, 62 random bits.

    The counter orders ids made in the same millisecond; when it would overflow,
    the timestamp is advanced by one millisecond, so ids keep increasing.
    """
    global _last_ms, _counter
    ms = time.time_ns() // 1_000_000
    if ms > _last_ms:
        _last_ms, _counter = ms, 0
    else:
        _counter += 1
        if _counter > 0xFFF:
            _last_ms, _counter = _last_ms + 1, 0
    # Uniqueness, not secrecy: the module's generator is reseeded after a fork.
    rand = random.getrandbits(62)
    value = (_last_ms << 80) | (0x7 << 76) | (_counter << 64) | (0b10 << 62) | rand
    # Its text, 8-4-4-4-12 hex digits: its bytes' hex with a dash every 4
    # digits (8 groups), the first and the last two of those dashes left out
    # (~1,700 instructions less than formatting the int and joining five
    # slices of it; tests/test_clock_ids.py checks it against `uuid.UUID`).
    h = value.to_bytes(16, "big").hex("-", 2)
    return h[:4] + h[5:29] + h[30:34] + h[35:]


def checked_clock(clock: object) -> Clock:
    """`clock` (a user's), wrapped so that each time it gives is checked.

    A naive datetime (or anything else) would reach events and results, which
    say UTC; refused at the first use instead, which is `run_loop` (the loop's
    `started_at`), so the caller sees the error, not a loop.

    Raises:
        ArgumentTypeError: `clock` is not callable.
    """
    if clock is utc_now:
        return utc_now
    if not callable(clock):
        raise ArgumentTypeError(
            f"clock must be a callable returning a datetime, got {given(clock)}"
        )

    def checked() -> datetime:
        now = clock()
        if not isinstance(now, datetime) or now.utcoffset() is None:
            raise ConfigurationError(
                f"clock {clock!r} returned {now!r}: a timezone-aware datetime "
                "is needed (e.g. datetime.now(UTC))"
            )
        return now

    return checked


def checked_ids(ids: object, known: Callable[[str], bool]) -> IdSource:
    """`ids` (a user's), wrapped so that each id it gives is checked.

    `known(loop_id)` says whether the runtime already holds a loop of that id:
    a repeated id would replace a loop the runtime still tracks.

    Raises:
        ArgumentTypeError: `ids` is not callable.
    """
    if ids is uuid7:
        return uuid7
    if not callable(ids):
        raise ArgumentTypeError(
            f"ids must be a callable returning a str, got {given(ids)}"
        )

    def checked() -> str:
        loop_id = ids()
        return new_loop_id(loop_id, known, f"ids {ids!r} returned {loop_id!r}")

    return checked


def new_loop_id(loop_id: object, known: Callable[[str], bool], origin: str) -> str:
    """A new loop's id (from the runtime's `ids`, or `run_loop(loop_id=)`:
    `origin` says which, for the error), checked.

    Raises:
        ConfigurationError: not a non-empty str, a lone surrogate in it, or
            the id of a loop the runtime already has (`known`).
    """
    if not isinstance(loop_id, str) or not loop_id:
        raise ConfigurationError(f"{origin}: a loop id is a non-empty str")
    if encodable(loop_id) is not loop_id:
        raise ConfigurationError(
            f"{origin}: a loop id cannot hold a lone surrogate (no store or log "
            "can write it)"
        )
    if known(loop_id):
        raise ConfigurationError(
            f"{origin}, the id of a loop this runtime already has: loop ids "
            "must be unique"
        )
    return loop_id
