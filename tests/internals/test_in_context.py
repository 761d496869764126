"""`_in_context.in_context`: a coroutine awaited in a copy of the context (a
call of a parallel batch, a worker's loop), every step of it (sends, throws,
and its closing) included."""

from __future__ import annotations

import contextvars
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from agentfsm._in_context import in_context

VAR: contextvars.ContextVar[str | None] = contextvars.ContextVar("VAR", default=None)


async def waiting(resets: list[str], label: str) -> Any:
    """Sets VAR, waits long, and resets VAR on its way out, however it ends
    (a token of another context would raise there)."""
    token = VAR.set(label)
    try:
        await anyio.sleep(10)
    finally:
        VAR.reset(token)
        resets.append(label)


async def test_what_a_call_sets_stays_with_it_across_its_steps() -> None:
    seen: list[str | None] = []

    async def call() -> Any:
        VAR.set("call")
        await anyio.lowlevel.checkpoint()
        seen.append(VAR.get())
        return ("out", False)

    result: Any = await in_context(contextvars.copy_context(), call())
    assert result == ("out", False)
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
            VAR.reset(token)
            resets.append("failing")

    with pytest.raises(ValueError, match="boom"):
        await in_context(contextvars.copy_context(), failing())
    with anyio.move_on_after(0.01):
        await in_context(contextvars.copy_context(), waiting(resets, "cancelled"))
    assert resets == ["failing", "cancelled"]
    assert VAR.get() is None


async def test_closing_the_awaiter_closes_the_call_in_its_context() -> None:
    resets: list[str] = []

    async def awaiter() -> Any:
        return await in_context(contextvars.copy_context(), waiting(resets, "closed"))

    stepped = awaiter()
    stepped.send(None)  # by hand: suspended inside `waiting`
    stepped.close()  # as a task dropped while it waits is
    assert resets == ["closed"]
    assert VAR.get() is None
