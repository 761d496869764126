from __future__ import annotations

from enum import StrEnum

import anyio
import pytest

from agentfsm import (
    ConfigurationError,
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    LoopState,
    LoopStatus,
    ModelContext,
    ModelMessageItem,
    NoRuntimeError,
    Outcome,
    PathStep,
    PendingTransition,
    ReasoningItem,
    Rewrite,
    Runtime,
    TokenUsage,
    Trigger,
    UserMessage,
    run_loop,
    tool,
)
from agentfsm.events import (
    FunctionCallCompleted,
    InferenceCompleted,
    LoopIdle,
    ModelAnswer,
)
from agentfsm.exceptions import UnknownLoopError, UnknownProvider
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    assert_path,
    call,
    calls,
    text,
)
from tests.helpers import add, request

SEED_PATH = "idle context_update inference function_call inference model_message idle"
SEED_EVENTS = [
    "inference.completed",
    "function_call.completed",
    "inference.completed",
    "model.answer",
]


def seed_script() -> ScriptedProvider:
    return ScriptedProvider(
        [
            calls(
                call("add", call_id="c1", a=2, b=3),
                usage=TokenUsage(input_tokens=10, output_tokens=5),
            ),
            text(
                "5",
                usage=TokenUsage(input_tokens=20, output_tokens=1, reasoning_tokens=0),
            ),
        ]
    )


async def test_seed_flow_end_to_end() -> None:
    """The seed-001 flow: path, the four seed events in order, the context and the totals."""
    async with Runtime(providers={"scripted": seed_script()}) as runtime:
        recorder = EventRecorder(runtime.bus)
        inference_input = request()
        loop_id = runtime.run_loop("agent-1", "what is 2+3?", inference_input)
        result = await runtime.wait(loop_id)

    assert_path(result, SEED_PATH)
    assert result.outcome is Outcome.answered
    assert result.answer == ModelMessageItem(content="5")
    seed_types = [t for t in recorder.types(loop_id) if t in set(SEED_EVENTS)]
    assert seed_types == SEED_EVENTS
    assert recorder.types(loop_id)[0] == "loop.started"
    assert recorder.types(loop_id)[-1] == "loop.idle"
    assert inference_input.context.items == [
        UserMessage(content="what is 2+3?"),
        FunctionCallItem(call_id="c1", name="add", arguments='{"a":2,"b":3}'),
        FunctionCallOutputItem(call_id="c1", output="5"),
        ModelMessageItem(content="5"),
    ]
    assert result.usage == TokenUsage(input_tokens=30, output_tokens=6)
    assert (result.model_requests, result.tool_calls) == (2, 1)
    idle = recorder.of_loop(loop_id)[-1]
    assert isinstance(idle, LoopIdle)
    assert (idle.outcome, idle.model_requests, idle.tool_calls) == (
        Outcome.answered,
        2,
        1,
    )


async def test_run_loop_returns_before_the_first_model_call_completes() -> None:
    """Fire-and-forget: run_loop returns the id while the model has not been called yet."""
    called = anyio.Event()
    release = anyio.Event()

    async def slow_model(request: InferenceInput) -> InferenceOutput:
        called.set()
        await release.wait()
        return text("done")

    async with Runtime(providers={"fn": FunctionProvider(slow_model)}) as runtime:
        loop_id = runtime.run_loop("agent", "hi", request(model="fn:slow"))
        assert not called.is_set()
        assert runtime.get(loop_id).state is LoopState.idle
        with anyio.fail_after(5):
            await called.wait()
        assert runtime.get(loop_id).state is LoopState.inference
        release.set()
        result = await runtime.wait(loop_id)
    assert result.answer == ModelMessageItem(content="done")


async def test_a_thousand_loops_at_once() -> None:
    """1,000 loops started at once all finish, each with its own answer and a distinct id."""

    def echo(req: InferenceInput) -> InferenceOutput:
        last = req.context.items[-1]
        if isinstance(last, UserMessage):
            n = int(last.text)
            return calls(call("add", a=n, b=n))
        assert isinstance(last, FunctionCallOutputItem)
        return text(f"answer {last.output}")

    async with Runtime(providers={"fn": FunctionProvider(echo)}) as runtime:
        ids = [
            runtime.run_loop(f"agent-{i % 7}", str(i), request(model="fn:echo"))
            for i in range(1000)
        ]
        with anyio.fail_after(30):
            results = [await runtime.wait(loop_id) for loop_id in ids]
    assert len(set(ids)) == 1000
    assert sorted(ids) == ids  # UUIDv7: sortable by creation time
    for i, result in enumerate(results):
        assert result.outcome is Outcome.answered
        assert result.answer == ModelMessageItem(content=f"answer {2 * i}")


async def test_two_loops_of_one_agent_share_a_context_without_sharing_a_cursor() -> (
    None
):
    """Two loops of one agent on one context each get their own script cursor and pairs."""
    provider = ScriptedProvider([calls(call("add", a=1, b=1)), text("ok")])
    context = ModelContext()
    async with Runtime(providers={"scripted": provider}) as runtime:
        inference_input = InferenceInput(
            model="scripted:x", context=context, tools=[add]
        )
        first = runtime.run_loop("same-agent", "one", inference_input)
        second = runtime.run_loop("same-agent", "two", inference_input)
        results = [await runtime.wait(first), await runtime.wait(second)]
    assert [r.outcome for r in results] == [Outcome.answered, Outcome.answered]
    items = context.items
    for position, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            assert isinstance(items[position + 1], FunctionCallOutputItem)
    assert sum(isinstance(i, ModelMessageItem) for i in items) == 2


async def test_module_level_run_loop_uses_the_current_runtime() -> None:
    """agentfsm.run_loop works inside a runtime and fails clearly outside one."""
    with pytest.raises(NoRuntimeError, match=r"async with agentfsm\.Runtime"):
        run_loop("agent", "hi", request())
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("hi")])}
    ) as runtime:
        loop_id = run_loop("agent", "hi", request())
        assert (await runtime.wait(loop_id)).outcome is Outcome.answered
    with pytest.raises(NoRuntimeError):
        run_loop("agent", "hi", request())


async def test_tool_errors_become_outputs_and_the_loop_goes_on() -> None:
    """Unknown tool, invalid arguments, a raising tool, a timed-out tool: error outputs, loop continues."""

    @tool
    def explode(reason: str) -> str:
        """Always fails."""
        raise RuntimeError(reason)

    @tool(timeout=0.05)
    async def hang() -> str:
        """Never returns in time."""
        await anyio.sleep(10)
        return "late"

    provider = ScriptedProvider(
        [
            calls(call("missing", call_id="u", x=1)),
            calls(call("add", call_id="v", a=1, b="two")),
            calls(call("explode", call_id="r", reason="boom")),
            calls(call("hang", call_id="t")),
            text("survived"),
        ]
    )
    async with Runtime(providers={"scripted": provider}) as runtime:
        recorder = EventRecorder(runtime.bus, "function_call.completed")
        inference_input = request(add, explode, hang)
        result = await runtime.wait(runtime.run_loop("agent", "go", inference_input))

    assert result.outcome is Outcome.answered
    outputs = {
        i.call_id: i
        for i in inference_input.context.items
        if isinstance(i, FunctionCallOutputItem)
    }
    assert all(o.is_error for o in outputs.values())
    assert "unknown tool 'missing'" in outputs["u"].output
    assert "add, explode, hang" in outputs["u"].output
    assert "b:" in outputs["v"].output
    assert "valid integer" in outputs["v"].output
    assert outputs["r"].output == "tool 'explode' raised RuntimeError: boom"
    assert "timed out after 0.05s" in outputs["t"].output
    completed = [e for e in recorder.events if isinstance(e, FunctionCallCompleted)]
    assert [e.output.call_id for e in completed] == ["u", "v", "r", "t"]
    assert_path(
        result,
        "idle context_update "
        + "inference function_call " * 4
        + "inference model_message idle",
    )


async def test_reasoning_and_text_beside_calls_enter_the_context_in_order() -> None:
    """Reasoning and text that came with calls are written before the calls and their outputs."""
    output = InferenceOutput(
        items=(
            ReasoningItem(content="need to add"),
            ModelMessageItem(content="adding"),
            FunctionCallItem(call_id="a", name="add", arguments='{"a":1,"b":1}'),
            FunctionCallItem(call_id="b", name="add", arguments='{"a":2,"b":2}'),
        )
    )
    provider = ScriptedProvider(
        [
            output,
            InferenceOutput(
                items=(
                    ReasoningItem(content="done"),
                    ModelMessageItem(content="2 and 4"),
                )
            ),
        ]
    )
    async with Runtime(providers={"scripted": provider}) as runtime:
        inference_input = request()
        result = await runtime.wait(runtime.run_loop("agent", "go", inference_input))
    assert result.tool_calls == 2
    assert [i.type for i in inference_input.context.items] == [
        "user_message",
        "reasoning",
        "model_message",
        "function_call",
        "function_call",
        "function_call_output",
        "function_call_output",
        "reasoning",
        "model_message",
    ]


async def test_provider_error_fails_the_loop_into_idle() -> None:
    """A provider that raises fails the loop: loop.failed then loop.idle, outcome failed."""
    provider = ScriptedProvider([RuntimeError("the model is down")])
    async with Runtime(providers={"scripted": provider}) as runtime:
        recorder = EventRecorder(runtime.bus)
        loop_id = runtime.run_loop("agent", "hi", request())
        result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert (result.error.type, result.error.message) == (
        "RuntimeError",
        "the model is down",
    )
    assert_path(result, "idle context_update inference idle")
    assert result.path[-1].trigger == "fail"
    assert recorder.types(loop_id)[-3:] == [
        "loop.failed",
        "loop.transition",
        "loop.idle",
    ]


async def test_max_turns_stops_the_loop_after_the_tools_ran() -> None:
    """Reaching max_turns ends the loop with outcome stopped after the requested tools ran."""
    provider = ScriptedProvider([calls(call("add", a=1, b=1))] * 5)
    async with Runtime(providers={"scripted": provider}) as runtime:
        inference_input = request()
        result = await runtime.wait(
            runtime.run_loop("agent", "go", inference_input, max_turns=2)
        )
    assert (result.outcome, result.reason) == (Outcome.stopped, "max_turns")
    assert (result.model_requests, result.tool_calls) == (2, 2)
    *_, last_call, last_output = inference_input.context.items
    assert isinstance(last_call, FunctionCallItem)
    assert last_output == FunctionCallOutputItem(call_id=last_call.call_id, output="2")


async def test_bad_input_is_rejected_before_anything_changes() -> None:
    """run_loop rejects bad input with an error naming what was wrong."""
    async with Runtime(providers={"scripted": ScriptedProvider([])}) as runtime:
        with pytest.raises(ConfigurationError, match="context is empty"):
            runtime.run_loop("agent", None, request())
        answered = InferenceInput(
            model="scripted:x",
            context=ModelContext(
                items=[UserMessage(content="q"), ModelMessageItem(content="a")]
            ),
        )
        with pytest.raises(ConfigurationError, match=r"ends with a model_message"):
            runtime.run_loop("agent", None, answered)
        with pytest.raises(UnknownProvider, match="prefix 'nope' is not registered"):
            runtime.run_loop("agent", "hi", request(model="nope:x"))
        with pytest.raises(ConfigurationError, match="max_turns"):
            runtime.run_loop("agent", "hi", request(), max_turns=0)
        with pytest.raises(UnknownLoopError):
            await runtime.wait("no-such-loop")
        assert runtime.loops() == []


async def test_continue_without_a_new_message() -> None:
    """message=None continues a context that ends with a user message."""
    context = ModelContext(items=[UserMessage(content="already asked")])
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("answer")])}
    ) as runtime:
        result = await runtime.wait(
            runtime.run_loop(
                "agent", None, InferenceInput(model="scripted:x", context=context)
            )
        )
    assert result.outcome is Outcome.answered
    assert context.items == [
        UserMessage(content="already asked"),
        ModelMessageItem(content="answer"),
    ]


async def test_model_answer_event_carries_the_message() -> None:
    """model.answer and inference.completed carry the message and the provider's output."""
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("hello")])}
    ) as runtime:
        recorder = EventRecorder(runtime.bus, ["model.answer", "inference.completed"])
        loop_id = runtime.run_loop("agent", "hi", request())
        await runtime.wait(loop_id)
    completed, answer = recorder.events
    assert isinstance(completed, InferenceCompleted)
    assert completed.output == text("hello")
    assert isinstance(answer, ModelAnswer)
    assert answer.message == ModelMessageItem(content="hello")
    assert answer.state is LoopState.model_message


async def test_finished_loops_are_kept_as_results_up_to_a_limit() -> None:
    """The runtime keeps the last `keep_finished` results; older loops are forgotten."""
    provider = ScriptedProvider([text("a")])
    async with Runtime(providers={"scripted": provider}, keep_finished=2) as runtime:
        ids = []
        for _ in range(3):  # one after the other, so they finish in this order
            ids.append(runtime.run_loop("agent", "q", request()))
            await runtime.wait(ids[-1])
        with pytest.raises(UnknownLoopError):
            runtime.get(ids[0])
        view = runtime.get(ids[2])
        assert (view.status, view.state, view.outcome) == (
            LoopStatus.done,
            LoopState.idle,
            Outcome.answered,
        )
        assert (await runtime.wait(ids[1])).answer == ModelMessageItem(content="a")
        assert runtime.loops() == ids[1:]
        assert runtime._loops == {}  # nothing but results is kept for finished loops


async def test_a_str_subclass_message_becomes_a_plain_str() -> None:
    """A `StrEnum` (or any str subclass) message is stored as its plain text."""

    class Prompt(StrEnum):
        HELLO = "hello"

    inference_input = request()
    async with Runtime(providers={"scripted": ScriptedProvider([text("hi")])}) as rt:
        await rt.wait(rt.run_loop("agent", Prompt.HELLO, inference_input))
    first = inference_input.context.items[0]
    assert isinstance(first, UserMessage)
    assert type(first.content) is str
    assert first.content == "hello"


async def test_loops_share_their_path_steps_and_a_rewrite_has_its_own() -> None:
    """Each edge taken is one shared `PathStep`: equal paths hold the same steps,
    and a rewritten transition's step records where it was headed."""

    def stream(pending: PendingTransition) -> Rewrite | None:
        if pending.trigger is Trigger.infer:
            return Rewrite(dest=LoopState.inference_streaming)
        return None

    async with Runtime(providers={"scripted": seed_script()}) as runtime:
        first = await runtime.wait(runtime.run_loop("a", "2+3?", request()))
        second = await runtime.wait(runtime.run_loop("a", "2+3?", request()))
        rewritten = await runtime.wait(runtime.run_loop("a", "2+3?", request(), stream))
    assert first.path == second.path
    assert all(a is b for a, b in zip(first.path, second.path, strict=True))
    assert rewritten.path[1] == PathStep(
        LoopState.context_update,
        Trigger.infer_streaming,
        LoopState.inference_streaming,
        rewritten_from=LoopState.inference,
    )
    assert rewritten.path[1] not in first.path
