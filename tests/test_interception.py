from __future__ import annotations

import anyio
import pytest
from structlog.typing import EventDict

from agentfsm import (
    Abort,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    LoopState,
    LoopStatus,
    ModelMessageItem,
    Outcome,
    Pause,
    PendingTransition,
    Proceed,
    Rewrite,
    Runtime,
    ToolBatch,
    Trigger,
    UserMessage,
)
from agentfsm.events import (
    LoopPaused,
    LoopTransition,
    ModelAnswer,
    TransitionIntercepted,
)
from agentfsm.exceptions import LoopStateError
from agentfsm.interception import Decision
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import (
    EventRecorder,
    RecordingHandler,
    ScriptedProvider,
    assert_path,
    call,
    calls,
    text,
)
from tests.helpers import request

TOOL_PATH = "idle context_update inference function_call inference model_message idle"


def tool_script() -> ScriptedProvider:
    return ScriptedProvider([calls(call("add", call_id="c1", a=2, b=3)), text("5")])


async def test_handler_sees_every_transition_with_its_payload() -> None:
    """The handler is called before each transition with the payload of DESIGN.md."""
    handler = RecordingHandler()
    async with Runtime(providers={"scripted": tool_script()}) as runtime:
        result = await runtime.wait(
            runtime.run_loop("agent", "2+3?", request(), handler)
        )
    assert_path(result, TOOL_PATH)
    assert handler.triggers == [
        "start",
        "infer",
        "call_tools",
        "infer",
        "answer",
        "finish",
    ]
    start, infer, call_tools, _, answer, finish = handler.seen
    assert start.payload == UserMessage(content="2+3?")
    assert (start.source, start.dest) == (LoopState.idle, LoopState.context_update)
    assert isinstance(infer.payload, InferenceInput)
    assert isinstance(call_tools.payload, ToolBatch)
    assert [c.call_id for c in call_tools.payload.calls] == ["c1"]
    assert answer.payload == ModelMessageItem(content="5")
    assert finish.payload == ModelMessageItem(content="5")
    assert [p.seq for p in handler.seen] == sorted(p.seq for p in handler.seen)
    assert call_tools.model_requests == 1
    second_infer = handler.seen[3]
    assert (second_infer.model_requests, second_infer.tool_calls) == (1, 1)


async def test_a_pending_transition_carries_the_seq_of_its_event() -> None:
    """`pending.seq` is the seq the transition's `transition.intercepted` event gets."""
    handler = RecordingHandler()
    async with Runtime(providers={"scripted": tool_script()}) as runtime:
        recorder = EventRecorder(runtime.bus, "transition.intercepted")
        await runtime.wait(runtime.run_loop("agent", "2+3?", request(), handler))
    assert [p.seq for p in handler.seen] == [e.seq for e in recorder.events]


@pytest.mark.parametrize("style", ["sync", "async"])
async def test_sync_and_async_handlers_proceed(style: str) -> None:
    """Sync and async handlers returning None or Proceed let the loop run unchanged."""
    seen: list[Trigger] = []

    def sync_handler(pending: PendingTransition) -> Decision | None:
        seen.append(pending.trigger)
        return Proceed() if len(seen) % 2 else None

    async def async_handler(pending: PendingTransition) -> Decision | None:
        await anyio.lowlevel.checkpoint()
        return sync_handler(pending)

    handler = sync_handler if style == "sync" else async_handler
    async with Runtime(providers={"scripted": tool_script()}) as runtime:
        result = await runtime.wait(
            runtime.run_loop("agent", "2+3?", request(), handler)
        )
    assert_path(result, TOOL_PATH)
    assert len(seen) == 6


async def test_handlers_run_in_order_each_seeing_the_previous_rewrite() -> None:
    """A list of handlers runs in order; the second sees the first one's rewrite."""
    seen_by_second: list[object] = []

    def first(pending: PendingTransition) -> Decision | None:
        if pending.trigger is Trigger.start:
            return Rewrite(payload=UserMessage(content="rewritten"))
        return None

    def second(pending: PendingTransition) -> Decision | None:
        seen_by_second.append(pending.payload)
        return None

    async with Runtime(
        providers={"scripted": ScriptedProvider([text("ok")])}
    ) as runtime:
        inference_input = request()
        await runtime.wait(
            runtime.run_loop("agent", "original", inference_input, [first, second])
        )
    assert seen_by_second[0] == UserMessage(content="rewritten")
    assert inference_input.context.items[0] == UserMessage(content="rewritten")


async def test_rewrite_infer_to_streaming() -> None:
    """Rewriting infer to inference_streaming takes the streaming edge and publishes chunks."""

    def stream_it(pending: PendingTransition) -> Decision | None:
        if pending.trigger is Trigger.infer:
            return Rewrite(dest=LoopState.inference_streaming)
        return None

    async with Runtime(
        providers={"scripted": ScriptedProvider([text("hello there")])}
    ) as runtime:
        recorder = EventRecorder(runtime.bus)
        loop_id = runtime.run_loop("agent", "hi", request(), stream_it)
        result = await runtime.wait(loop_id)
    assert_path(result, "idle context_update inference_streaming model_message idle")
    assert result.path[1].rewritten_from is LoopState.inference
    assert result.path[1].trigger is Trigger.infer_streaming
    assert recorder.types(loop_id).count("inference.stream") == 2
    transition = next(
        e
        for e in recorder.events
        if isinstance(e, LoopTransition) and e.dest is LoopState.inference_streaming
    )
    assert transition.rewritten_from is LoopState.inference
    intercepted = [
        e
        for e in recorder.events
        if isinstance(e, TransitionIntercepted) and e.decision == "rewrite"
    ]
    assert len(intercepted) == 1
    assert intercepted[0].new_dest is LoopState.inference_streaming
    # The event names the edge the handler was offered, and the one it chose.
    assert (intercepted[0].trigger, intercepted[0].dest) == (
        Trigger.infer,
        LoopState.inference,
    )


async def test_rewrite_the_model_for_the_next_inference() -> None:
    """A handler can swap the model of a request; the other provider serves it."""
    served: list[str] = []

    def model(name: str) -> FunctionProvider:
        def answer(req: InferenceInput) -> InferenceOutput:
            served.append(req.model)
            return text(f"from {req.model}")

        return FunctionProvider(answer)

    def swap(pending: PendingTransition) -> Decision | None:
        if isinstance(pending.payload, InferenceInput):
            return Rewrite(
                payload=pending.payload.model_copy(update={"model": "cheap:mini"})
            )
        return None

    async with Runtime(
        providers={"big": model("big"), "cheap": model("cheap")}
    ) as runtime:
        result = await runtime.wait(
            runtime.run_loop("agent", "hi", request(model="big:large"), swap)
        )
    assert served == ["cheap:mini"]
    assert result.answer == ModelMessageItem(content="from cheap:mini")


async def test_deny_and_change_arguments_of_tool_calls() -> None:
    """A call_tools rewrite denies one call and changes another's arguments."""

    def approve(pending: PendingTransition) -> Decision | None:
        batch = pending.payload
        if isinstance(batch, ToolBatch):
            return Rewrite(
                payload=batch.deny("c1", "not allowed").with_arguments(
                    "c2", {"a": 10, "b": 20}
                )
            )
        return None

    provider = ScriptedProvider(
        [
            calls(
                call("add", call_id="c1", a=1, b=1), call("add", call_id="c2", a=2, b=2)
            ),
            text("done"),
        ]
    )
    async with Runtime(providers={"scripted": provider}) as runtime:
        inference_input = request()
        result = await runtime.wait(
            runtime.run_loop("agent", "go", inference_input, approve)
        )
    outputs = [
        i
        for i in inference_input.context.items
        if isinstance(i, FunctionCallOutputItem)
    ]
    assert outputs == [
        FunctionCallOutputItem(
            call_id="c1", output="the call was denied: not allowed", is_error=True
        ),
        FunctionCallOutputItem(call_id="c2", output="30"),
    ]
    assert result.tool_calls == 1


async def test_rewrite_an_answer_into_a_follow_up() -> None:
    """At finish a handler can send the loop back to context_update with a new message."""
    rejected = False

    def redirect(pending: PendingTransition) -> Decision | None:
        nonlocal rejected
        if pending.trigger is Trigger.finish and not rejected:
            rejected = True
            return Rewrite(
                dest=LoopState.context_update, payload=UserMessage(content="try again")
            )
        return None

    provider = ScriptedProvider([text("first"), text("second")])
    async with Runtime(providers={"scripted": provider}) as runtime:
        result = await runtime.wait(
            runtime.run_loop("agent", "hi", request(), redirect)
        )
    assert_path(
        result,
        "idle context_update inference model_message context_update inference model_message idle",
    )
    assert result.answer == ModelMessageItem(content="second")
    assert result.path[3].trigger is Trigger.follow_up


async def test_abort_ends_the_loop_with_outcome_aborted() -> None:
    """Abort(reason) takes the abort edge to idle; the result carries the reason."""

    def budget(pending: PendingTransition) -> Decision | None:
        if pending.trigger is Trigger.call_tools:
            return Abort("over budget")
        return None

    async with Runtime(providers={"scripted": tool_script()}) as runtime:
        recorder = EventRecorder(runtime.bus, "transition.intercepted")
        result = await runtime.wait(runtime.run_loop("agent", "hi", request(), budget))
    assert (result.outcome, result.reason) == (Outcome.aborted, "over budget")
    assert_path(result, "idle context_update inference idle")
    assert result.path[-1].trigger is Trigger.abort
    assert [
        e.decision for e in recorder.events if isinstance(e, TransitionIntercepted)
    ] == ["proceed", "proceed", "abort"]


async def test_illegal_rewrite_fails_the_loop_with_transition_rejected() -> None:
    """A rewrite to a destination with no edge fails the loop, naming source, trigger and dest."""

    def illegal(pending: PendingTransition) -> Decision | None:
        if pending.trigger is Trigger.infer:
            return Rewrite(dest=LoopState.model_message)
        return None

    async with Runtime(providers={"scripted": tool_script()}) as runtime:
        result = await runtime.wait(runtime.run_loop("agent", "hi", request(), illegal))
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert result.error.type == "TransitionRejected"
    assert "context_update --infer--> inference" in result.error.message
    assert "no edge from context_update to model_message" in result.error.message
    assert_path(result, "idle context_update idle")


async def test_rewrite_with_a_payload_of_the_wrong_kind_is_rejected() -> None:
    """A payload that does not fit the edge is rejected like an illegal edge."""

    def wrong(pending: PendingTransition) -> Decision | None:
        if pending.trigger is Trigger.infer:
            return Rewrite(payload=UserMessage(content="not a request"))
        return None

    async with Runtime(providers={"scripted": tool_script()}) as runtime:
        result = await runtime.wait(runtime.run_loop("agent", "hi", request(), wrong))
    assert result.error is not None
    assert result.error.type == "TransitionRejected"
    assert (
        "infer needs an InferenceInput as payload, got UserMessage"
        in result.error.message
    )


async def test_raising_handler_fails_the_loop_with_that_error() -> None:
    """A handler that raises fails the loop with its error; the loop still ends idle."""

    def broken(pending: PendingTransition) -> Decision | None:
        if pending.trigger is Trigger.answer:
            raise ValueError("handler bug")
        return None

    async with Runtime(providers={"scripted": tool_script()}) as runtime:
        recorder = EventRecorder(runtime.bus)
        loop_id = runtime.run_loop("agent", "hi", request(), broken)
        result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert (result.error.type, result.error.message) == ("ValueError", "handler bug")
    assert recorder.types(loop_id)[-1] == "loop.idle"
    assert runtime.get(loop_id).status is LoopStatus.done


async def test_decisions_are_published_and_logged(log_output: list[EventDict]) -> None:
    """Every decision is a transition.intercepted event and a log line."""
    async with Runtime(providers={"scripted": tool_script()}) as runtime:
        recorder = EventRecorder(runtime.bus, "transition.intercepted")
        loop_id = runtime.run_loop("agent", "hi", request(), RecordingHandler())
        await runtime.wait(loop_id)
    decisions = [e for e in recorder.events if isinstance(e, TransitionIntercepted)]
    assert [e.trigger for e in decisions] == [
        "start",
        "infer",
        "call_tools",
        "infer",
        "answer",
        "finish",
    ]
    logged = [
        entry for entry in log_output if entry["event"] == "transition_intercepted"
    ]
    assert len(logged) == 6
    assert all(
        entry["loop_id"] == loop_id and entry["decision"] == "proceed"
        for entry in logged
    )


async def test_pause_holds_no_task_and_resume_continues() -> None:
    """A paused loop has no task; resume with a rewrite continues from the pending transition."""

    def ask_human(pending: PendingTransition) -> Decision | None:
        return Pause("approve tools") if pending.trigger is Trigger.call_tools else None

    async with Runtime(providers={"scripted": tool_script()}) as runtime:
        recorder = EventRecorder(runtime.bus)
        inference_input = request()
        loop_id = runtime.run_loop("agent", "hi", inference_input, ask_human)
        with anyio.fail_after(5):
            while runtime.get(loop_id).status is not LoopStatus.paused:
                await anyio.wait_all_tasks_blocked()
        view = runtime.get(loop_id)
        assert view.state is LoopState.inference
        assert view.pause_reason == "approve tools"
        assert view.pending is not None
        assert view.pending.trigger is Trigger.call_tools
        assert runtime._running == 0  # nothing runs on the paused loop's behalf
        paused = [e for e in recorder.events if isinstance(e, LoopPaused)]
        assert isinstance(paused[0].payload, ToolBatch)
        batch = view.pending.payload
        assert isinstance(batch, ToolBatch)
        runtime.resume(loop_id, Rewrite(payload=batch.deny("c1", "human said no")))
        result = await runtime.wait(loop_id)
        with pytest.raises(LoopStateError, match="not paused"):
            runtime.resume(loop_id)
    assert result.outcome is Outcome.answered
    outputs = [
        i
        for i in inference_input.context.items
        if isinstance(i, FunctionCallOutputItem)
    ]
    assert outputs[0].output == "the call was denied: human said no"
    types = recorder.types(loop_id)
    assert types.index("loop.paused") < types.index("loop.resumed")
    resumed = [
        e
        for e in recorder.events
        if isinstance(e, TransitionIntercepted) and e.trigger is Trigger.call_tools
    ][-1]
    assert (resumed.decision, resumed.handler) == ("rewrite", -1)  # -1: resume


async def test_pause_a_hundred_loops_and_resume_each() -> None:
    """100 loops paused at once all resume and answer."""

    def pause_start(pending: PendingTransition) -> Decision | None:
        return Pause("hold") if pending.trigger is Trigger.start else None

    def answer(req: InferenceInput) -> InferenceOutput:
        last = req.context.items[-1]
        assert isinstance(last, UserMessage)
        return text(f"re: {last.content}")

    async with Runtime(providers={"fn": FunctionProvider(answer)}) as runtime:
        ids = [
            runtime.run_loop("agent", f"m{i}", request(model="fn:x"), pause_start)
            for i in range(100)
        ]
        with anyio.fail_after(10):
            while len(runtime.loops(status=LoopStatus.paused)) < 100:
                await anyio.wait_all_tasks_blocked()
        assert runtime._running == 0
        assert all(runtime.get(i).state is LoopState.idle for i in ids)
        for loop_id in reversed(ids):
            runtime.resume(loop_id)
        results = [await runtime.wait(loop_id) for loop_id in ids]
    assert [r.answer for r in results] == [
        ModelMessageItem(content=f"re: m{i}") for i in range(100)
    ]


async def test_resume_with_abort_and_paused_loops_cancelled_on_exit() -> None:
    """Resuming with Abort aborts; a loop left paused is cancelled when the runtime exits."""

    def hold(pending: PendingTransition) -> Decision | None:
        return Pause("hold") if pending.trigger is Trigger.infer else None

    async with Runtime(
        providers={"scripted": ScriptedProvider([text("x")])}
    ) as runtime:
        first = runtime.run_loop("agent", "a", request(), hold)
        second = runtime.run_loop("agent", "b", request(), hold)
        with anyio.fail_after(5):
            while len(runtime.loops(status=LoopStatus.paused)) < 2:
                await anyio.wait_all_tasks_blocked()
        runtime.resume(first, Abort("nope"))
        aborted = await runtime.wait(first)
    left = await runtime.wait(second)
    assert (aborted.outcome, aborted.reason) == (Outcome.aborted, "nope")
    assert left.outcome is Outcome.cancelled
    assert left.reason is not None
    assert "paused" in left.reason


async def test_rewriting_the_answer_at_finish_reaches_context_result_and_events() -> (
    None
):
    """A finish rewrite replaces the answer in the context and result, and is published."""

    def polish(pending: PendingTransition) -> Decision | None:
        if pending.trigger is Trigger.finish:
            return Rewrite(payload=ModelMessageItem(content="final!"))
        return None

    async with Runtime(providers={"scripted": ScriptedProvider([text("3")])}) as rt:
        recorder = EventRecorder(rt.bus, "model.answer")
        inference_input = request()
        result = await rt.wait(rt.run_loop("agent", "hi", inference_input, polish))
    assert result.answer == ModelMessageItem(content="final!")
    assert inference_input.context.items[-1] == ModelMessageItem(content="final!")
    answers = [e.message.content for e in recorder.events if isinstance(e, ModelAnswer)]
    assert answers == ["3", "final!"]
