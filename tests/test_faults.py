"""Calls with bad arguments are refused without changing the loop, and a
provider streaming garbage or a resume racing a pause are safe (issue 12).

User code raising, returning garbage or sleeping forever is
`tests/test_fault_matrix.py`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    LoopStatus,
    Outcome,
    PendingTransition,
    Runtime,
)
from agentfsm.exceptions import ConfigurationError
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import pause_tools, request, wait_until


async def test_steer_and_follow_up_refuse_what_is_not_a_message() -> None:
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(providers={"scripted": provider}) as runtime:
        loop_id = runtime.run_loop("agent", "go", request(), pause_tools)
        with pytest.raises(ConfigurationError, match="steer\\(\\) takes a str"):
            runtime.steer(loop_id, {"content": "hi"})  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="follow_up\\(\\) takes a str"):
            runtime.follow_up(loop_id, 42)  # type: ignore[arg-type]
        await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
        runtime.resume(loop_id)
        result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.answered


async def test_a_refused_resume_leaves_the_loop_paused() -> None:
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(providers={"scripted": provider}) as runtime:
        loop_id = runtime.run_loop("agent", "go", request(), pause_tools)
        await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
        with pytest.raises(ConfigurationError, match="got str"):
            runtime.resume(loop_id, "yes")  # type: ignore[arg-type]
        assert runtime.get(loop_id).status is LoopStatus.paused
        runtime.resume(loop_id)
        result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.answered


@pytest.mark.parametrize(
    ("call_", "message"),
    [
        (lambda rt: rt.run_loop(1, "q", request()), "agent_id must be a non-empty str"),
        (
            lambda rt: rt.run_loop("", "q", request()),
            "agent_id must be a non-empty str",
        ),
        (
            lambda rt: rt.run_loop("a", "q", request(), "not a handler"),
            "interception_handler must be callable",
        ),
    ],
)
async def test_run_loop_refuses_bad_arguments_by_name(
    call_: Callable[[Runtime], str], message: str
) -> None:
    async with Runtime(providers={"scripted": ScriptedProvider([text("x")])}) as rt:
        with pytest.raises(ConfigurationError, match=message):
            call_(rt)
        assert rt.loops() == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_finished": "5"}, "keep_finished must be an int >= 0, got '5'"),
        ({"keep_finished": True}, "keep_finished must be an int >= 0, got True"),
        ({"keep_finished": -1}, "keep_finished must be an int >= 0"),
        ({"event_log": 123}, "event_log must be a path, got int"),
    ],
)
def test_runtime_refuses_bad_arguments_by_name(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Runtime(**kwargs)


async def test_a_stream_chunk_that_is_no_delta_fails_the_loop_by_name() -> None:
    """A provider streaming something else than a delta fails its loop saying
    what it sent; nothing unreadable reaches the event log."""
    from collections.abc import AsyncIterator
    from contextlib import asynccontextmanager

    class Odd:
        async def complete(self, request: InferenceInput, /) -> InferenceOutput:
            raise AssertionError("streaming only")

        @asynccontextmanager
        async def stream(self, request: InferenceInput, /) -> AsyncIterator[Any]:
            async def chunks() -> AsyncIterator[Any]:
                yield {"text": "hi"}

            stream = chunks()
            try:
                yield stream
            finally:
                await stream.aclose()  # type: ignore[attr-defined]

    async with Runtime(providers={"odd": Odd()}) as runtime:
        result = await runtime.wait(
            runtime.run_loop("a", "q", request(model="odd:x", streaming=True))
        )
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert "sent a dict, not a TextDelta" in result.error.message


async def test_a_resume_while_the_pause_is_still_published_runs_the_loop_once() -> None:
    """The loop pauses while a backpressure subscriber is full, so its worker
    still publishes `loop.paused` when `resume` comes: the same worker goes on,
    no second one runs the loop, the events keep their order, and a later
    cancel is not lost."""
    provider = ScriptedProvider(
        [calls(call("add", a=1, b=2)), calls(call("add", a=2, b=2)), text("4")]
    )
    pauses = 0

    def pause_first_batch(pending: PendingTransition) -> Any:
        nonlocal pauses
        if pending.trigger.value == "call_tools" and pauses == 0:
            pauses += 1
            from agentfsm import Pause

            return Pause("look")
        return None

    async with Runtime(providers={"scripted": provider}) as runtime:
        subscription = runtime.bus.subscribe(buffer=1, backpressure=True)
        loop_id = runtime.run_loop("agent", "go", request(), pause_first_batch)
        received = []
        while runtime.get(loop_id).status is not LoopStatus.paused:
            received.append(await subscription.receive())
        # Paused, with `loop.paused` still held for the full subscriber.
        runtime.resume(loop_id)
        async for event in subscription:
            received.append(event)
            if event.type == "function_call.started":
                runtime.cancel(loop_id, "enough")
            if event.type == "loop.idle":
                break
        result = await runtime.wait(loop_id)
    assert [e.seq for e in received] == list(range(1, len(received) + 1))
    assert [e.type for e in received].count("loop.resumed") == 1
    assert (result.outcome, result.reason) == (Outcome.cancelled, "enough")
