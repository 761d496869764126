"""User code that misbehaves fails only its own loop, with a readable message,
and calls with bad arguments are refused without changing the loop (issue 12)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    LoopStatus,
    ModelRequest,
    Outcome,
    PendingTransition,
    Runtime,
    tool,
)
from agentfsm.exceptions import ConfigurationError
from agentfsm.providers import ModelNext
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import items_of, pause_tools, request, wait_until


class Unprintable(Exception):
    """An exception whose `str()` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no text for you")


def raising_provider(_: InferenceInput) -> InferenceOutput:
    raise Unprintable


def raising_handler(_: PendingTransition) -> None:
    raise Unprintable


async def raising_wrapper(request: ModelRequest, next_: ModelNext) -> InferenceOutput:
    raise Unprintable


def raising_condition(_: object) -> bool:
    raise Unprintable


def raising_finish_turn(_: object) -> None:
    raise Unprintable


async def none_wrapper(request: ModelRequest, next_: ModelNext) -> Any:
    return None


SOURCES: dict[
    str, tuple[Callable[[InferenceInput], InferenceOutput] | None, Any, dict[str, Any]]
] = {
    "provider": (raising_provider, None, {}),
    "handler": (None, raising_handler, {}),
    "model wrapper": (None, None, {"model_wrappers": [raising_wrapper]}),
    "stop condition": (None, None, {"stop_when": [raising_condition]}),
    "finish_turn": (None, None, {"finish_turn": raising_finish_turn}),
}


@pytest.mark.parametrize("source", list(SOURCES))
async def test_an_exception_whose_str_raises_fails_only_its_loop(source: str) -> None:
    answer, handler, options = SOURCES[source]

    def script(_: InferenceInput) -> InferenceOutput:
        return calls(call("add", a=1, b=2))

    provider = FunctionProvider(answer or script)
    healthy = ScriptedProvider([text("fine")])
    async with Runtime(providers={"bad": provider, "ok": healthy}) as runtime:
        bad = runtime.run_loop(
            "agent", "go", request(model="bad:x"), handler, **options
        )
        good = runtime.run_loop("agent", "go", request(model="ok:x"))
        failed = await runtime.wait(bad)
        fine = await runtime.wait(good)
    assert failed.outcome is Outcome.failed
    assert failed.error is not None
    assert failed.error.type == "Unprintable"
    assert "str() raised RuntimeError" in failed.error.message
    assert fine.outcome is Outcome.answered


async def test_a_tool_raising_an_unprintable_exception_is_an_error_output() -> None:
    @tool
    async def broken() -> str:
        """Raise an exception that cannot be printed."""
        raise Unprintable

    inference_input = request(broken)
    provider = ScriptedProvider([calls(call("broken", call_id="b")), text("sorry")])
    async with Runtime(providers={"scripted": provider}) as runtime:
        result = await runtime.wait(runtime.run_loop("agent", "go", inference_input))
    assert result.outcome is Outcome.answered
    assert items_of(inference_input.context)[2] == "out:b=ERR"


async def test_a_model_wrapper_returning_none_fails_with_what_it_returned() -> None:
    async with Runtime(providers={"scripted": ScriptedProvider([text("x")])}) as rt:
        result = await rt.wait(
            rt.run_loop("agent", "go", request(), model_wrappers=[none_wrapper])
        )
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert result.error.message == (
        "the model wrappers returned NoneType, not an InferenceOutput"
    )


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
