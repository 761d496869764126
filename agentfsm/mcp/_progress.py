"""A server's progress notifications for a call, as the call's progress.

The toolset sends a progress token with each `tools/call` (the SDK makes one
when given a callback); each `notifications/progress` for it is published as
the running call's `function_call.progress`: `{"progress": 3, "total": 10,
"message": "..."}` (`total` and `message` only when the server sent them).
"""

from __future__ import annotations

import contextvars
import math
from typing import Final

from mcp.shared.dispatcher import ProgressFnT
from pydantic import JsonValue

from agentfsm._text import clip, printable
from agentfsm.tools import report_progress

__all__ = ("MESSAGE_CHARS", "payload", "reporter")

MESSAGE_CHARS: Final = 1000
"""The most characters of a progress message kept (the server's text; a
status line, not a channel for the server's output)."""


def reporter() -> ProgressFnT:
    """A progress callback for one call, made in the call's task.

    The SDK runs it in a task of its own, so it reports in the context it was
    made in (the running call's). Reports are kept in order: the protocol says
    progress increases, so one that goes back (out of order, or a confused
    server) is dropped, as is one that is no finite number.
    """
    context = contextvars.copy_context()
    last = -math.inf

    async def report(progress: float, total: float | None, message: str | None) -> None:
        nonlocal last
        # Over JSON-RPC the SDK passes floats; in process, what the server gave.
        progress = _finite(progress)
        if math.isnan(progress) or progress < last:
            return
        last = progress
        # No await before this: the order the SDK starts the callbacks in is
        # the order the server sent the notifications in.
        context.run(report_progress, payload(progress, total, message))

    return report


def payload(progress: float, total: float | None, message: str | None) -> JsonValue:
    """A progress notification as `function_call.progress`'s `progress`: its
    numbers (whole ones as ints), its message on one printable line, clipped."""
    value: dict[str, JsonValue] = {"progress": _number(progress)}
    if total is not None and not math.isnan(_finite(total)):
        value["total"] = _number(total)
    if isinstance(message, str) and message:
        value["message"] = clip(printable(message, newlines=False), MESSAGE_CHARS)
    return value


def _finite(value: object) -> float:
    """`value` as a float, NaN when it is no finite number."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number):
            return number
    return math.nan


_EXACT: Final = 2**53
"""Beyond it a float's whole value is no exact count (and `int(1e308)` would
be a 309-digit number): kept a float."""


def _number(value: float) -> int | float:
    number = float(value)
    return int(number) if number.is_integer() and abs(number) < _EXACT else number
