"""Awaiting a coroutine with every step of it run in a given context.

What an asyncio task does for its own coroutine, done for one coroutine inside
another task: a worker runs each loop in a copy of its starter's context
(`_runtime.workers`, on asyncio), and a parallel batch runs each call in a copy
of the loop's (`_loop.tool_call.run_parallel`), so a `ContextVar` one of them
sets stays with it.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Coroutine, Generator
from contextvars import Context
from typing import Any, TypeVar

__all__ = ("in_context",)

T = TypeVar("T")


@types.coroutine
def in_context(
    context: Context, coro: Coroutine[Any, Any, T]
) -> Generator[Any, Any, T]:
    """Await `coro`, running each of its steps in `context`: every step runs
    inside `context.run`, whatever the coroutine yields goes up to the event
    loop, and whatever the event loop sends or throws (cancellation included)
    goes back down into it; its closing, too.

    (A generator, not an awaitable object holding bound methods: a coroutine
    waiting here keeps fewer objects alive for the garbage collector to walk.)
    """
    step: Callable[[Any], Any] = coro.send
    value: Any = None
    while True:
        try:
            yielded = context.run(step, value)
        except StopIteration as done:
            result: T = done.value
            return result
        except BaseException:
            # The error's traceback holds this frame: no cycle through what
            # was sent (trio sends an outcome, which may hold the error).
            del value
            raise
        try:
            value = yield yielded
        except GeneratorExit:
            context.run(coro.close)  # its `finally` blocks in its context too
            raise
        except BaseException as exc:  # noqa: BLE001 - forwarded into the coroutine
            step, value = coro.throw, exc
        else:
            step = coro.send
