"""How a loop ends: its outcome follows the edge it took into `idle` and that
edge's reason, whatever a handler did before, and a cancel is honoured before
the next transition wherever it came from."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from agentfsm import (
    InferenceInput,
    LoopResult,
    LoopState,
    ModelContext,
    ModelMessageItem,
    Outcome,
    PendingTransition,
    Rewrite,
    Runtime,
    ToolResult,
    Trigger,
    UserMessage,
    after_turns,
    current_loop_id,
    current_runtime,
    tool,
)
from agentfsm.events import ModelAnswer
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    ScriptStep,
    call,
    calls,
    text,
)
from tests.helpers import items_of, request

Handler = Callable[[PendingTransition], Rewrite | None]


def at(
    source: LoopState, trigger: Trigger, **rewrite: Any
) -> Callable[[PendingTransition], Rewrite | None]:
    """A handler rewriting the first `source --trigger-->` transition it sees."""
    done = False

    def handler(pending: PendingTransition) -> Rewrite | None:
        nonlocal done
        if done or pending.source is not source or pending.trigger is not trigger:
            return None
        done = True
        return Rewrite(**rewrite)

    return handler


async def run(
    script: list[ScriptStep],
    handler: Handler | None = None,
    *,
    inference_input: InferenceInput | None = None,
    follow_up: str | None = None,
    **options: Any,
) -> tuple[LoopResult, list[ModelAnswer], InferenceInput]:
    """Run one loop on `script`; its result, its `model.answer` events, its input."""
    inference_input = inference_input or request()
    async with Runtime(providers={"scripted": ScriptedProvider(script)}) as runtime:
        recorder = EventRecorder(runtime.bus, "model.answer")
        loop_id = runtime.run_loop("agent", "go", inference_input, handler, **options)
        if follow_up is not None:
            runtime.follow_up(loop_id, follow_up)
        result = await runtime.wait(loop_id)
        answers = [e for e in recorder.events if isinstance(e, ModelAnswer)]
    return result, answers, inference_input


class Answer(BaseModel):
    value: int


def structured() -> InferenceInput:
    return InferenceInput(
        model="scripted:test", context=ModelContext(), structured_output=Answer
    )


ADD = calls(call("add", a=1, b=2))


class TestTheThreeBugs:
    async def test_a_handler_taking_a_stopped_loop_on_to_an_answer_answers(
        self,
    ) -> None:
        """A stop condition stops at `function_call --stop-->`; a handler sends
        it on to `inference`: the loop answers, and the result says so (it said
        `stopped` with the stop's reason when that was a flag on the loop).
        (`max_turns` is a hard limit: tests/test_limits.py.)"""
        handler = at(LoopState.function_call, Trigger.stop, dest=LoopState.inference)
        result, answers, _ = await run(
            [ADD, text("3")], handler, stop_when=[after_turns(1)]
        )
        assert (result.outcome, result.reason) == (Outcome.answered, None)
        assert result.answer == ModelMessageItem(content="3")
        assert result.path[-1].trigger is Trigger.finish
        assert [a.message.content for a in answers] == ["3"]
        assert result.model_requests == 2

    async def test_an_invalid_structured_answer_a_handler_takes_is_the_answer(
        self,
    ) -> None:
        """`follow_up` (the answer failed validation) rewritten to `idle`: the
        loop answers with that message, unparsed, and publishes it (it ended
        `answered` with `answer=None` and no `model.answer`)."""
        handler = at(LoopState.model_message, Trigger.follow_up, dest=LoopState.idle)
        result, answers, _ = await run(
            [text("not json")], handler, inference_input=structured()
        )
        assert result.outcome is Outcome.answered
        assert result.answer == ModelMessageItem(content="not json")
        assert result.output is None
        assert [(a.message.content, a.parsed) for a in answers] == [("not json", None)]

    async def test_a_cancel_from_the_loops_own_tool_is_honoured(self) -> None:
        """The tool cancels its own loop and returns without a checkpoint, and the
        scripted model has none either: the loop ends `cancelled` before the next
        transition, with the call's output in the context (it asked the model
        again and ended `answered`)."""

        @tool
        async def quit_loop() -> str:
            """Cancel the loop this call runs in."""
            loop_id = current_loop_id()
            assert loop_id is not None
            current_runtime().cancel(loop_id, "the tool quit")
            return "quitting"

        inference_input = request(quit_loop)
        result, _, _ = await run(
            [calls(call("quit_loop", call_id="q")), text("never")],
            inference_input=inference_input,
        )
        assert (result.outcome, result.reason) == (Outcome.cancelled, "the tool quit")
        assert result.model_requests == 1
        assert result.path[-1] == (
            LoopState.function_call,
            Trigger.cancel,
            LoopState.idle,
            None,
        )
        assert items_of(inference_input.context) == [
            "user:go",
            "call:q",
            "out:q=quitting",
        ]


class TestRewritesOutOfFunctionCall:
    """Every legal edge out of `function_call`, chosen by a handler over the
    state's own, and the outcome it leads to."""

    async def test_terminated_sent_on_to_inference_answers(self) -> None:
        @tool
        async def done() -> ToolResult:
            """End the loop."""
            return ToolResult(output="bye", terminate=True)

        handler = at(LoopState.function_call, Trigger.stop, dest=LoopState.inference)
        result, _, _ = await run(
            [calls(call("done")), text("after")],
            handler,
            inference_input=request(done),
        )
        assert (result.outcome, result.reason) == (Outcome.answered, None)
        assert result.answer == ModelMessageItem(content="after")

    async def test_stopped_sent_on_to_context_update_with_a_message_answers(
        self,
    ) -> None:
        handler = at(
            LoopState.function_call,
            Trigger.stop,
            dest=LoopState.context_update,
            payload=UserMessage(content="one more"),
        )
        result, _, inference_input = await run(
            [ADD, text("ok")], handler, stop_when=[after_turns(1)]
        )
        assert (result.outcome, result.answer) == (
            Outcome.answered,
            ModelMessageItem(content="ok"),
        )
        assert "user:one more" in items_of(inference_input.context)

    @pytest.mark.parametrize("trigger", [Trigger.infer, Trigger.steer])
    async def test_going_on_rewritten_to_idle_stops(self, trigger: Trigger) -> None:
        """`infer` (or `steer`, when the tool queued steering) rewritten to `idle`
        takes `stop`: the loop ends `stopped` by the handler's choice."""

        @tool
        async def add_steering(a: int, b: int) -> int:
            """Add, and steer the loop when asked to."""
            loop_id = current_loop_id()
            if trigger is Trigger.steer and loop_id is not None:
                current_runtime().steer(loop_id, "hold on")
            return a + b

        handler = at(LoopState.function_call, trigger, dest=LoopState.idle)
        result, _, _ = await run(
            [calls(call("add_steering", a=1, b=2)), text("unused")],
            handler,
            inference_input=request(add_steering),
        )
        assert (result.outcome, result.reason) == (Outcome.stopped, "intercepted")
        assert result.path[-1][1:3] == (Trigger.stop, LoopState.idle)
        assert result.model_requests == 1

    async def test_going_on_rewritten_to_steer_goes_on(self) -> None:
        handler = at(
            LoopState.function_call,
            Trigger.infer,
            dest=LoopState.context_update,
            payload=(UserMessage(content="also"),),
        )
        result, _, inference_input = await run([ADD, text("ok")], handler)
        assert result.outcome is Outcome.answered
        assert items_of(inference_input.context)[-2:] == ["user:also", "model:ok"]

    async def test_stop_with_its_edge_kept_keeps_its_reason(self) -> None:
        """A rewrite that keeps the edge (here: only the payload) keeps the reason."""
        handler = at(LoopState.function_call, Trigger.stop, payload=None)
        result, _, _ = await run([ADD, text("unused")], handler, max_turns=1)
        assert (result.outcome, result.reason) == (Outcome.stopped, "max_turns")


class TestRewritesOutOfModelMessage:
    """Every legal edge out of `model_message`, chosen by a handler."""

    async def test_a_queued_follow_up_rewritten_to_idle_answers(self) -> None:
        handler = at(LoopState.model_message, Trigger.follow_up, dest=LoopState.idle)
        result, answers, _ = await run(
            [text("first"), text("unused")], handler, follow_up="more"
        )
        assert (result.outcome, result.answer) == (
            Outcome.answered,
            ModelMessageItem(content="first"),
        )
        assert len(answers) == 1  # published once, not again at `finish`

    async def test_finish_rewritten_to_a_follow_up_answers_again(self) -> None:
        handler = at(
            LoopState.model_message,
            Trigger.finish,
            dest=LoopState.context_update,
            payload=UserMessage(content="and?"),
        )
        result, answers, _ = await run([text("first"), text("second")], handler)
        assert result.answer == ModelMessageItem(content="second")
        assert [a.message.content for a in answers] == ["first", "second"]

    async def test_a_stopping_finish_sent_on_ends_by_its_last_edge(self) -> None:
        """A stop condition with a follow-up queued `finish`es with its reason;
        a handler sends the loop on once: it answers again, and since the
        follow-up is still queued, that `finish` stops it too. The outcome is
        the last edge's, and the answer the last one published."""
        handler = at(
            LoopState.model_message, Trigger.finish, dest=LoopState.context_update
        )
        result, answers, _ = await run(
            [text("first"), text("second")],
            handler,
            follow_up="more",
            stop_when=[after_turns(1)],
        )
        assert (result.outcome, result.reason) == (Outcome.stopped, "turn_count")
        assert result.answer == ModelMessageItem(content="second")
        assert [a.message.content for a in answers] == ["first", "second"]
        assert result.model_requests == 2

    async def test_a_rewritten_answer_is_the_answer(self) -> None:
        new = ModelMessageItem(content="edited")
        handler = at(LoopState.model_message, Trigger.finish, payload=new)
        result, answers, inference_input = await run([text("raw")], handler)
        assert (result.outcome, result.answer) == (Outcome.answered, new)
        assert [a.message.content for a in answers] == ["raw", "edited"]
        assert items_of(inference_input.context) == ["user:go", "model:edited"]

    async def test_a_stopping_finish_keeps_its_reason_and_a_rewritten_answer(
        self,
    ) -> None:
        new = ModelMessageItem(content="edited")
        handler = at(LoopState.model_message, Trigger.finish, payload=new)
        result, _, _ = await run([text("raw")], handler, follow_up="more", max_turns=1)
        assert (result.outcome, result.reason, result.answer) == (
            Outcome.stopped,
            "max_turns",
            new,
        )

    async def test_an_invalid_answer_stopped_by_the_limit_is_not_the_answer(
        self,
    ) -> None:
        """An answer that failed validation on the last turn ends `stopped`
        without an answer (nobody took it)."""
        result, answers, _ = await run(
            [text("not json")], inference_input=structured(), max_turns=1
        )
        assert (result.outcome, result.reason) == (Outcome.stopped, "max_turns")
        assert (result.answer, answers) == (None, [])


class TestReviewFindings:
    @pytest.mark.parametrize(
        ("trigger", "options", "outcome", "reason"),
        [
            (Trigger.finish, {}, Outcome.answered, None),
            (Trigger.stop, {"max_turns": 1}, Outcome.stopped, "max_turns"),
        ],
    )
    async def test_a_pause_keeps_the_steps_own_reason(
        self,
        trigger: Trigger,
        options: dict[str, Any],
        outcome: Outcome,
        reason: str | None,
    ) -> None:
        """Paused on an ending edge and resumed with Proceed, the loop ends as
        the edge says, not with the pause's reason."""
        from agentfsm import LoopStatus, Pause
        from tests.helpers import wait_until

        def pause_at(pending: PendingTransition) -> Pause | None:
            return Pause("have a look") if pending.trigger is trigger else None

        provider = ScriptedProvider([ADD, text("3")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            loop_id = runtime.run_loop("agent", "go", request(), pause_at, **options)
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
            runtime.resume(loop_id)
            result = await runtime.wait(loop_id)
        assert (result.outcome, result.reason) == (outcome, reason)

    async def test_a_cancel_from_a_handler_is_honoured_before_the_edge(self) -> None:
        def cancel_at_infer(pending: PendingTransition) -> None:
            if pending.trigger is Trigger.infer:
                current_runtime().cancel(pending.loop_id, "not now")

        result, _, _ = await run([text("never")], cancel_at_infer)
        assert (result.outcome, result.reason) == (Outcome.cancelled, "not now")
        assert result.model_requests == 0
        assert [s.dest for s in result.path] == [
            LoopState.context_update,
            LoopState.idle,
        ]

    async def test_a_stopping_finish_keeps_the_valid_answer(self) -> None:
        """A valid answer, a follow-up, then an invalid one on the last turn: the
        loop stops with the valid answer, published once."""
        result, answers, _ = await run(
            [text('{"value": 1}'), text("bad")],
            inference_input=structured(),
            follow_up="again",
            max_turns=2,
        )
        assert (result.outcome, result.reason) == (Outcome.stopped, "max_turns")
        assert result.answer == ModelMessageItem(content='{"value": 1}')
        assert result.output == Answer(value=1)
        assert len(answers) == 1

    async def test_a_rewritten_structured_answer_drops_the_old_parse(self) -> None:
        new = ModelMessageItem(content='{"value": 9}')
        handler = at(LoopState.model_message, Trigger.finish, payload=new)
        result, answers, _ = await run(
            [text('{"value": 1}')], handler, inference_input=structured()
        )
        assert (result.answer, result.output) == (new, None)
        assert [a.parsed for a in answers] == [{"value": 1}, None]
