"""Limits and stop conditions: max_turns, stop_when, timeouts, the deadline."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    LoopState,
    LoopStatus,
    ModelContext,
    ModelMessageItem,
    Outcome,
    Pause,
    PendingTransition,
    Rewrite,
    Runtime,
    Trigger,
    UserMessage,
    after_turns,
    tool,
    tool_called,
)
from agentfsm.events import (
    LoopIdle,
)
from agentfsm.exceptions import ConfigurationError
from agentfsm.options import MAX_TURNS_CAP
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    call,
    calls,
    text,
)
from tests.helpers import items_of, request, wait_until


class TestLimits:
    async def test_max_turns_with_tools_pending_and_a_queued_follow_up(self) -> None:
        """At max_turns the requested tools finish, no request follows, the queue stays."""
        provider = ScriptedProvider(
            [
                calls(
                    call("add", call_id="a", a=1, b=1),
                    call("add", call_id="b", a=2, b=2),
                )
            ]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(runtime.bus, "loop.idle")
            inference_input = request()
            loop_id = runtime.run_loop("agent", "go", inference_input, max_turns=1)
            runtime.follow_up(loop_id, "not consumed")
            result = await runtime.wait(loop_id)
        assert (result.outcome, result.reason) == (Outcome.stopped, "max_turns")
        assert items_of(inference_input.context) == [
            "user:go",
            "call:a",
            "call:b",
            "out:a=2",
            "out:b=4",
        ]
        assert result.path[-1].trigger is Trigger.stop
        idle = recorder.events[-1]
        assert isinstance(idle, LoopIdle)
        assert (idle.model_requests, idle.tool_calls) == (1, 2)

    async def test_max_turns_is_bounded(self) -> None:
        """max_turns has a hard cap, and unknown options are named."""
        async with Runtime(providers={"scripted": ScriptedProvider([])}) as runtime:
            with pytest.raises(
                ConfigurationError, match=r"max_turns must be in 1\.\.10000"
            ):
                runtime.run_loop("agent", "x", request(), max_turns=10_001)
            with pytest.raises(
                ConfigurationError, match="unknown loop options: max_turn"
            ):
                runtime.run_loop("agent", "x", request(), max_turn=3)  # type: ignore[call-arg]

    @pytest.mark.parametrize(
        ("condition", "reason", "requests"),
        [
            pytest.param(tool_called("add"), "tool_called:add", 1, id="tool-called"),
            pytest.param(after_turns(2), "turn_count", 2, id="turn-count"),
            pytest.param(
                lambda view: "two tools" if view.tool_calls >= 2 else None,
                "two tools",
                2,
                id="callable",
            ),
        ],
    )
    async def test_stop_when(
        self, condition: object, reason: str, requests: int
    ) -> None:
        """The first stop condition that holds ends the loop stopped, with its reason."""
        provider = ScriptedProvider(
            [calls(call("add", a=1, b=1))] * 3 + [text("never")]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            result = await runtime.wait(
                runtime.run_loop("agent", "go", request(), stop_when=[condition])  # type: ignore[list-item]
            )
        assert (result.outcome, result.reason, result.model_requests) == (
            Outcome.stopped,
            reason,
            requests,
        )

    async def test_inference_timeout_names_what_timed_out(self) -> None:
        """A request past inference_timeout is retried, then fails naming the model."""

        async def slow(req: InferenceInput) -> InferenceOutput:
            await anyio.sleep(10)
            return text("late")

        async with Runtime(providers={"fn": FunctionProvider(slow)}) as runtime:
            result = await runtime.wait(
                runtime.run_loop(
                    "agent",
                    "q",
                    request(model="fn:slow"),
                    inference_timeout=0.02,
                    max_retries=1,
                    retry_backoff=0,
                )
            )
        assert result.error is not None
        assert (result.error.type, result.error.message) == (
            "ProviderTimeout",
            "the request to 'fn:slow' timed out after 0.02s",
        )

    async def test_loop_deadline(self) -> None:
        """A loop past its deadline fails with LoopTimeout; its calls still get outputs."""

        @tool
        async def forever() -> str:
            """Never ends."""
            await anyio.sleep_forever()
            return "x"

        provider = ScriptedProvider([calls(call("forever", call_id="f"))])
        async with Runtime(providers={"scripted": provider}) as runtime:
            inference_input = request(forever)
            result = await runtime.wait(
                runtime.run_loop("agent", "q", inference_input, deadline=0.05)
            )
        assert result.error is not None
        assert result.error.type == "LoopTimeout"
        assert "deadline of 0.05s" in result.error.message
        assert items_of(inference_input.context) == ["user:q", "call:f", "out:f=ERR"]


async def test_an_answer_on_the_last_allowed_turn_is_answered() -> None:
    """Reaching max_turns with an answer ends `answered`; a queued follow-up is kept."""
    async with Runtime(providers={"scripted": ScriptedProvider([text("hi")])}) as rt:
        plain = await rt.wait(rt.run_loop("a", "q", request(), max_turns=1))
        loop_id = rt.run_loop("a", "q", request(), max_turns=1)
        rt.follow_up(loop_id, "more")
        queued = await rt.wait(loop_id)
    assert (plain.outcome, plain.answer) == (
        Outcome.answered,
        ModelMessageItem(content="hi"),
    )
    assert (queued.outcome, queued.reason) == (Outcome.stopped, "max_turns")
    assert queued.model_requests == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_turns": "3"}, "max_turns must be an int, got str"),
        ({"max_turns": 2.5}, "max_turns must be an int, got float"),
        ({"max_turns": True}, "max_turns must be an int, got bool"),
        ({"max_retries": None}, "max_retries must be an int"),
        ({"deadline": float("nan")}, "deadline must be a finite number"),
        ({"inference_timeout": "5"}, "inference_timeout must be a finite number"),
        ({"stop_when": [1]}, "stop_when must hold callables, got int"),
        ({"stop_when": after_turns}, "stop_when must be a list, got function"),
        ({"tool_wrappers": [None]}, "tool_wrappers must hold callables"),
        ({"model_wrappers": "wrap"}, "model_wrappers must be a list, got str"),
        ({"finish_turn": 3}, "finish_turn must be callable, got int"),
    ],
)
async def test_options_of_the_wrong_type_are_refused_by_name(
    options: dict[str, object], message: str
) -> None:
    """A wrong type fails `run_loop` itself, naming the option, not the loop later."""
    async with Runtime(providers={"scripted": ScriptedProvider([text("x")])}) as rt:
        with pytest.raises(ConfigurationError, match=message):
            rt.run_loop("a", "q", request(), **options)  # type: ignore[arg-type]
        assert rt.loops() == []


async def test_the_deadline_holds_while_a_loop_is_paused() -> None:
    """A loop paused past its deadline fails with the deadline's error at the
    deadline, without anyone resuming it; the runtime then exits at once."""

    def pause_batches(pending: PendingTransition) -> Pause | None:
        return Pause("wait") if pending.trigger is Trigger.call_tools else None

    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    with anyio.fail_after(5):
        async with Runtime(providers={"scripted": provider}) as runtime:
            loop_id = runtime.run_loop("a", "q", request(), pause_batches, deadline=0.2)
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert result.error.type == "LoopTimeout"
    assert "deadline of 0.2s (paused)" in result.error.message
    assert result.path[-1][1:3] == (Trigger.fail, LoopState.idle)


async def test_a_resumed_loop_leaves_no_deadline_timer_behind() -> None:
    """Resumed before its deadline, a loop ends as usual, and leaving the
    runtime does not wait for the paused loop's timer."""

    def pause_once(pending: PendingTransition) -> Pause | None:
        return Pause("wait") if pending.trigger is Trigger.call_tools else None

    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    with anyio.fail_after(5):
        async with Runtime(providers={"scripted": provider}) as runtime:
            loop_id = runtime.run_loop("a", "q", request(), pause_once, deadline=60)
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
            runtime.resume(loop_id)
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.answered


class _Instant:
    """A provider that answers at once and never awaits: with a handler that
    never awaits either, the loop reaches no checkpoint of its own."""

    def __init__(self) -> None:
        self.requests = 0
        self.fifth: anyio.Event | None = None
        """Set at the fifth request, if made (inside a test, on its backend)."""

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        self.requests += 1
        if self.requests == 5 and self.fifth is not None:
            self.fifth.set()
        return text(f"answer {self.requests}")

    def stream(self, request: InferenceInput, /) -> Any:
        raise AssertionError("the tests here never stream")


def _never_finish(pending: PendingTransition) -> Rewrite | None:
    """Rewrite every `finish` into `context_update` with a new message."""
    if pending.trigger is Trigger.finish:
        return Rewrite(
            dest=LoopState.context_update, payload=UserMessage(content="again")
        )
    return None


class TestARunawayHandler:
    async def test_max_turns_counts_every_request_whatever_edge_led_to_it(
        self,
    ) -> None:
        """A handler rewriting every `finish` into `context_update` made
        thousands of requests past `max_turns=3`; now the fourth one fails the
        loop, naming the limit and the rewrite."""
        provider = _Instant()
        async with Runtime(providers={"instant": provider}) as runtime:
            result = await runtime.wait(
                runtime.run_loop(
                    "agent",
                    "go",
                    InferenceInput(model="instant:m", context=ModelContext()),
                    _never_finish,
                    max_turns=3,
                )
            )
        assert (result.outcome, result.model_requests, provider.requests) == (
            Outcome.failed,
            3,
            3,
        )
        assert result.error is not None
        assert result.error.type == "TurnLimitExceeded"
        assert "max_turns=3" in result.error.message
        assert "model_message --> idle" in result.error.message
        assert result.path[-1][:3] == (
            LoopState.inference,
            Trigger.fail,
            LoopState.idle,
        )

    async def test_a_loop_that_never_awaits_lets_others_run_and_can_be_cancelled(
        self,
    ) -> None:
        """The driver yields every few transitions: the test's task runs while
        the loop spins, and its cancel ends the loop (before, the process froze
        until the loop had made all its requests)."""
        provider = _Instant()
        provider.fifth = anyio.Event()
        async with Runtime(providers={"instant": provider}) as runtime:
            loop_id = runtime.run_loop(
                "agent",
                "go",
                InferenceInput(model="instant:m", context=ModelContext()),
                _never_finish,
                max_turns=MAX_TURNS_CAP,
            )
            with anyio.fail_after(5):
                await provider.fifth.wait()
            runtime.cancel(loop_id)
            result = await runtime.wait(loop_id)
        assert result.outcome is Outcome.cancelled
        assert result.model_requests < MAX_TURNS_CAP

    async def test_the_deadline_holds_for_a_loop_that_never_awaits(self) -> None:
        provider = _Instant()
        async with Runtime(providers={"instant": provider}) as runtime:
            result = await runtime.wait(
                runtime.run_loop(
                    "agent",
                    "go",
                    InferenceInput(model="instant:m", context=ModelContext()),
                    _never_finish,
                    max_turns=MAX_TURNS_CAP,
                    deadline=0.05,
                )
            )
        assert result.outcome is Outcome.failed
        assert result.error is not None
        assert result.error.type == "LoopTimeout"
        assert result.model_requests < MAX_TURNS_CAP
