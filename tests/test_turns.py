"""A turn's bookkeeping: transient model errors retried, `finish_turn`, totals."""

from __future__ import annotations

from agentfsm import (
    LoopState,
    ModelMessageItem,
    Outcome,
    ProviderError,
    Runtime,
    TokenUsage,
    TurnSnapshot,
)
from agentfsm.events import (
    LoopIdle,
)
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    assert_path,
    call,
    calls,
    text,
)
from tests.helpers import request


class TestTurns:
    async def test_transient_error_then_success(self) -> None:
        """A retryable provider error is retried; a permanent one fails with its message."""
        provider = ScriptedProvider(
            [ProviderError("rate limited", retryable=True), text("ok")]
        )
        permanent = ScriptedProvider([ProviderError("invalid api key")])
        async with Runtime(
            providers={"scripted": provider, "bad": permanent}
        ) as runtime:
            ok = await runtime.wait(
                runtime.run_loop("a", "q", request(), retry_backoff=0)
            )
            failed = await runtime.wait(
                runtime.run_loop("a", "q", request(model="bad:x"), retry_backoff=0)
            )
        assert ok.answer == ModelMessageItem(content="ok")
        assert ok.model_requests == 1
        assert failed.error is not None
        assert (failed.error.type, failed.error.message) == (
            "ProviderError",
            "invalid api key",
        )

    async def test_finish_turn_sees_isolated_snapshots_and_can_fail_the_loop(
        self,
    ) -> None:
        """finish_turn runs after each turn with a copy; if it raises, the loop fails."""
        snapshots: list[TurnSnapshot] = []

        def record(snapshot: TurnSnapshot) -> None:
            snapshots.append(snapshot)

        async def explode(snapshot: TurnSnapshot) -> None:
            raise RuntimeError("checkpoint store down")

        script = [calls(call("add", call_id="c", a=1, b=2)), text("3")]
        async with Runtime(
            providers={
                "scripted": ScriptedProvider(script),
                "again": ScriptedProvider(script),
            }
        ) as runtime:
            inference_input = request()
            ok = await runtime.wait(
                runtime.run_loop("a", "q", inference_input, finish_turn=record)
            )
            failed = await runtime.wait(
                runtime.run_loop(
                    "a", "q", request(model="again:x"), finish_turn=explode
                )
            )
        assert ok.outcome is Outcome.answered
        assert [s.turn for s in snapshots] == [1, 2]
        assert [o.output for o in snapshots[0].tool_outputs] == ["3"]
        assert len(snapshots[0].context) == 3
        assert len(inference_input.context.items) == 4  # the snapshot did not grow
        assert failed.error is not None
        assert (failed.error.type, failed.error.message) == (
            "RuntimeError",
            "checkpoint store down",
        )
        assert_path(failed, "idle context_update inference function_call idle")

    async def test_totals_in_result_and_idle_event(self) -> None:
        """Results and loop.idle carry requests, tool calls and token totals."""
        usage = TokenUsage(input_tokens=10, output_tokens=4, reasoning_tokens=2)
        provider = ScriptedProvider(
            [calls(call("add", a=1, b=1), usage=usage), text("2", usage=usage)]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(runtime.bus, "loop.idle")
            result = await runtime.wait(runtime.run_loop("a", "q", request()))
        idle = recorder.events[0]
        assert isinstance(idle, LoopIdle)
        expected = TokenUsage(input_tokens=20, output_tokens=8, reasoning_tokens=4)
        assert result.usage == idle.usage == expected
        assert (idle.model_requests, idle.tool_calls) == (2, 1)
        assert result.states[-1] is LoopState.idle
