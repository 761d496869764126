"""`tool_call._InContext`: a call of a parallel batch awaited in its own copy
of the context, every step of it (sends, throws, and its closing) included."""

from __future__ import annotations

import contextvars
from collections.abc import Coroutine
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from agentfsm._loop.tool_call import _InContext

VAR: contextvars.ContextVar[str | None] = contextvars.ContextVar("VAR", default=None)


def _as_result(coro: Coroutine[Any, Any, Any]) -> Any:
    return _InContext(coro)


async def test_what_a_call_sets_stays_with_it_across_its_steps() -> None:
    seen: list[str | None] = []

    async def call() -> Any:
        VAR.set("call")
        await anyio.lowlevel.checkpoint()
        seen.append(VAR.get())
        return ("out", False)

    assert await _as_result(call()) == ("out", False)
    assert seen == ["call"]
    assert VAR.get() is None


async def test_an_error_and_a_cancel_reach_the_call_in_its_context() -> None:
    resets: list[str] = []

    async def failing() -> Any:
        token = VAR.set("failing")
        try:
            await anyio.lowlevel.checkpoint()
            raise ValueError("boom")
        finally:
            VAR.reset(token)  # (a token of another context would raise)
            resets.append("failing")

    with pytest.raises(ValueError, match="boom"):
        await _as_result(failing())

    async def waiting() -> Any:
        token = VAR.set("waiting")
        try:
            await anyio.sleep(10)
        finally:
            VAR.reset(token)
            resets.append("waiting")

    with anyio.move_on_after(0.01):
        await _as_result(waiting())
    assert resets == ["failing", "waiting"]
    assert VAR.get() is None


async def test_closing_the_awaiter_closes_the_call_in_its_context() -> None:
    resets: list[str] = []

    async def waiting() -> Any:
        token = VAR.set("waiting")
        try:
            await anyio.sleep(10)
        finally:
            VAR.reset(token)  # (a token of another context would raise)
            resets.append("closed")

    async def awaiter() -> Any:
        return await _as_result(waiting())

    stepped = awaiter()
    stepped.send(None)  # by hand: suspended inside `waiting`
    stepped.close()  # as a task dropped while it waits is
    assert resets == ["closed"]
    assert VAR.get() is None
