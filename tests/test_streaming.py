from __future__ import annotations

from collections.abc import AsyncIterator

from agentfsm import (
    FunctionCallItem,
    InferenceInput,
    InferenceOutput,
    ModelMessageItem,
    Outcome,
    ReasoningItem,
    Runtime,
)
from agentfsm.events import InferenceCompleted, InferenceStream
from agentfsm.providers import StreamEvent, TextDelta, ToolCallDelta
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import (
    EventRecorder,
    RecordingHandler,
    ScriptedProvider,
    assert_path,
    call,
    calls,
    reasoning,
    text,
)
from tests.helpers import request

SCRIPT = [
    reasoning(
        "think first", calls(call("add", call_id="c1", a=20, b=22), text="let me add")
    ),
    text("The answer is forty two, as computed."),
]


async def run(
    streaming: bool,
) -> tuple[
    list[InferenceStream], list[InferenceCompleted], list[object], RecordingHandler
]:
    handler = RecordingHandler()
    async with Runtime(providers={"scripted": ScriptedProvider(SCRIPT)}) as runtime:
        recorder = EventRecorder(runtime.bus, ["inference.*"])
        inference_input = request(streaming=streaming)
        result = await runtime.wait(
            runtime.run_loop("agent", "sum?", inference_input, handler)
        )
    assert result.outcome is Outcome.answered
    kind = "inference_streaming" if streaming else "inference"
    assert_path(
        result, f"idle context_update {kind} function_call {kind} model_message idle"
    )
    stream = [e for e in recorder.events if isinstance(e, InferenceStream)]
    completed = [e for e in recorder.events if isinstance(e, InferenceCompleted)]
    return stream, completed, list(inference_input.context.items), handler


async def test_streaming_publishes_chunks_in_order_and_matches_the_plain_path() -> None:
    """Chunks arrive in order; the completed outputs and the context equal the non-streaming run."""
    stream, completed, context, handler = await run(streaming=True)
    plain_stream, plain_completed, plain_context, plain_handler = await run(
        streaming=False
    )

    assert plain_stream == []
    assert (
        [e.output for e in completed] == [e.output for e in plain_completed] == SCRIPT
    )
    assert context == plain_context
    # Per loop, seq increases and each response's chunk index restarts at 0.
    assert [e.seq for e in stream] == sorted(e.seq for e in stream)
    first_response = [e for e in stream if e.seq < completed[0].seq]
    assert [e.index for e in first_response] == list(range(len(first_response)))
    # Text chunks reassemble the message; tool-call chunks reassemble id, name and arguments.
    second = [e.delta for e in stream if e.seq > completed[0].seq]
    assert (
        "".join(d.text for d in second if isinstance(d, TextDelta))
        == "The answer is forty two, as computed."
    )
    tool_chunks = [
        e.delta for e in first_response if isinstance(e.delta, ToolCallDelta)
    ]
    assert tool_chunks[0].call_id == "c1"
    assert tool_chunks[0].name == "add"
    assert "".join(d.arguments for d in tool_chunks) == '{"a":20,"b":22}'
    # Interception is identical on both paths but for the infer trigger's name.
    assert [
        t.replace("infer_streaming", "infer") for t in handler.triggers
    ] == plain_handler.triggers


async def test_custom_stream_handler_chunks_are_published_verbatim() -> None:
    """A provider's own chunks are published as they come, then its output completes the step."""
    output = InferenceOutput(
        items=(ReasoningItem(content="hm"), ModelMessageItem(content="hi there"))
    )

    async def chunks(req: InferenceInput) -> AsyncIterator[StreamEvent]:
        from agentfsm.providers import OutputCompleted, ReasoningDelta

        yield ReasoningDelta(text="hm")
        yield TextDelta(text="hi ")
        yield TextDelta(text="there")
        yield OutputCompleted(output=output)

    provider = FunctionProvider(lambda req: output, stream_handler=chunks)
    async with Runtime(providers={"fn": provider}) as runtime:
        recorder = EventRecorder(runtime.bus, "inference.stream")
        result = await runtime.wait(
            runtime.run_loop("agent", "hi", request(model="fn:x", streaming=True))
        )
    assert result.answer == ModelMessageItem(content="hi there")
    assert [
        e.delta.kind for e in recorder.events if isinstance(e, InferenceStream)
    ] == ["reasoning", "text", "text"]


async def test_a_stream_without_a_completed_output_fails_the_loop() -> None:
    """A stream that ends without OutputCompleted fails the loop with a clear error."""

    async def cut_short(req: InferenceInput) -> AsyncIterator[StreamEvent]:
        yield TextDelta(text="partial")

    provider = FunctionProvider(lambda req: text("unused"), stream_handler=cut_short)
    async with Runtime(providers={"fn": provider}) as runtime:
        result = await runtime.wait(
            runtime.run_loop("agent", "hi", request(model="fn:x", streaming=True))
        )
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert "ended without a completed output" in result.error.message


def test_output_items_helpers() -> None:
    """InferenceOutput exposes its function calls and last message."""
    output = SCRIPT[0]
    assert [c.call_id for c in output.function_calls] == ["c1"]
    assert isinstance(output.function_calls[0], FunctionCallItem)
    assert output.message == ModelMessageItem(content="let me add")
