"""`agentfsm.otel` keeps untrusted text in its bounds.

With content capture off, no text from a model, a tool, a user or an MCP server
reaches a span (its name, attributes, events, links or status), not even
quoted in an error. With it on, text that cannot be encoded (a lone surrogate)
is recorded escaped, and a tracing failure never changes how a loop ends.

Spans are walked generically (`span_texts`), so a new place that leaks is
caught without naming it here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.util.types import Attributes
from pydantic import BaseModel
from structlog.typing import EventDict

from agentfsm import (
    Abort,
    InferenceInput,
    ModelContext,
    Outcome,
    PendingTransition,
    Runtime,
    ToolResult,
    tool,
)
from agentfsm.exceptions import ProviderError
from agentfsm.otel import OpenTelemetry
from agentfsm.testing import ScriptedProvider, call, calls, text

MARKER = "SECRET-7f3a"
"""A text that comes from a model, a tool, a user or an MCP server."""


class Traces:
    """A tracer provider exporting to memory (see tests/test_otel.py)."""

    def __init__(self, *processors: SpanProcessor) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        for processor in processors:
            self.provider.add_span_processor(processor)
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    @property
    def spans(self) -> tuple[ReadableSpan, ...]:
        return self.exporter.get_finished_spans()

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.name.startswith(prefix)]


@pytest.fixture
def traces() -> Iterator[Traces]:
    t = Traces()
    yield t
    t.provider.shutdown()


def _attribute_texts(attributes: Attributes) -> Iterator[str]:
    for key, value in (attributes or {}).items():
        yield key
        values = (
            value
            if isinstance(value, Sequence) and not isinstance(value, str)
            else (value,)
        )
        yield from (v for v in values if isinstance(v, str))


def span_texts(span: ReadableSpan) -> Iterator[str]:
    """Every text a span holds: name, attributes, events (recorded exceptions
    too), links, status."""
    yield span.name
    yield from _attribute_texts(span.attributes)
    for event in span.events:
        yield event.name
        yield from _attribute_texts(event.attributes)
    for link in span.links:
        yield from _attribute_texts(link.attributes)
    if span.status.description is not None:
        yield span.status.description


def all_texts(traces: Traces) -> list[str]:
    return [t for span in traces.spans for t in span_texts(span)]


class Answer(BaseModel):
    n: int


@tool(description=f"Look a note up (as its MCP server describes it: {MARKER}).")
async def lookup(note: str) -> ToolResult:
    return ToolResult.error(f"no note named {note}; {MARKER} in the error output")


@tool
async def explode() -> str:
    """Fail."""
    raise ValueError(f"the tool's exception quotes {MARKER}")


def marked_script() -> list[Any]:
    """A model whose every turn carries the marker: a provider error, a text
    beside two calls (one with it in its arguments, one raising it), then a
    structured answer that fails validation, quoted in the loop's error."""
    return [
        ProviderError(f"rate limited: {MARKER}", retryable=True),
        calls(
            call("lookup", call_id="c1", note=MARKER),
            call("explode", call_id="c2"),
            text=f"the model says {MARKER}",
        ),
        text(f'{{"n": "{MARKER}"}}'),
    ]


async def run_marked(instrument: OpenTelemetry | None, *, streaming: bool) -> Any:
    provider = ScriptedProvider(marked_script())
    request = InferenceInput(
        model="scripted:demo",
        context=ModelContext(instructions=f"Be brief. {MARKER}"),
        tools=[lookup, explode],
        structured_output=Answer,
        streaming=streaming,
    )
    extensions = [] if instrument is None else [instrument]
    async with Runtime(providers={"scripted": provider}, extensions=extensions) as rt:
        loop_id = rt.run_loop(
            "notes",
            f"the user asks about {MARKER}",
            request,
            retry_backoff=0,
            structured_output_retries=0,
        )
        return await rt.wait(loop_id)


# ------------------------------------------------------------ capture off


@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_with_capture_off_no_untrusted_text_reaches_a_span(
    streaming: bool,
) -> None:
    captured, withheld = Traces(), Traces()
    try:
        for traces, capture in ((captured, True), (withheld, False)):
            result = await run_marked(
                OpenTelemetry(tracer_provider=traces.provider, capture_content=capture),
                streaming=streaming,
            )
            # The marker was in play: the loop failed quoting the model's answer.
            assert result.outcome is Outcome.failed
            assert result.error is not None
            assert MARKER in result.error.message
            assert len(traces.named("chat demo")) == 3  # the failed request, then two
            assert len(traces.named("execute_tool")) == 2
    finally:
        captured.provider.shutdown()
        withheld.provider.shutdown()

    # With capture on, the walk finds the marker (so it would find a leak):
    # in the status of the failed request, both tools and the loop.
    statuses = [s.status.description or "" for s in captured.spans]
    assert sum(MARKER in d for d in statuses) == 4
    assert [t for t in all_texts(withheld) if MARKER in t] == []


async def test_with_capture_off_errors_keep_their_type(traces: Traces) -> None:
    await run_marked(
        OpenTelemetry(tracer_provider=traces.provider, capture_content=False),
        streaming=False,
    )

    by_name = {s.name: s for s in traces.spans}
    failed_tool = by_name["execute_tool lookup"]
    assert dict(failed_tool.attributes or {})["error.type"] == "tool_error"
    assert failed_tool.status.description == "content not captured"
    raised = by_name["execute_tool explode"]
    assert [dict(e.attributes or {}) for e in raised.events] == [
        {"exception.type": "ValueError"}
    ]
    agent = by_name["invoke_agent notes"]
    assert dict(agent.attributes or {})["error.type"] == "StructuredOutputError"
    assert dict(agent.attributes or {})["agentfsm.reason"] == "content not captured"


# ------------------------------------------------------------ lone surrogates


@tool
async def listing() -> ToolResult:
    """List a directory (a result made as an MCP server's is)."""
    return ToolResult(output="report-\udcff.txt")


async def run_surrogates(instrument: OpenTelemetry | None, *, streaming: bool) -> Any:
    # The vendor's response, as its JSON (with a `\ud800` escape) decoded.
    raw = {"id": "resp-\udcfd", "model": "demo-\udcfc"}
    answer = text("found report-\udcfe.txt").model_copy(update={"raw_response": raw})
    provider = ScriptedProvider([calls(call("listing", call_id="c1")), answer])
    request = InferenceInput(
        model="scripted:demo",
        context=ModelContext(),
        tools=[listing],
        streaming=streaming,
    )
    extensions = [] if instrument is None else [instrument]
    async with Runtime(providers={"scripted": provider}, extensions=extensions) as rt:
        return await rt.wait(rt.run_loop("files", "what is there?", request))


def assert_encodable(traces: Traces) -> None:
    for t in all_texts(traces):
        t.encode()  # raises on a lone surrogate


@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_a_lone_surrogate_with_capture_on_is_recorded_escaped(
    traces: Traces, streaming: bool
) -> None:
    untraced = await run_surrogates(None, streaming=streaming)
    traced = await run_surrogates(
        OpenTelemetry(tracer_provider=traces.provider, capture_content=True),
        streaming=streaming,
    )

    assert untraced.outcome is Outcome.answered
    assert traced.outcome is untraced.outcome
    assert traced.path == untraced.path
    assert len(traces.spans) == 4
    assert_encodable(traces)
    [tool_span] = traces.named("execute_tool listing")
    assert dict(tool_span.attributes or {})["gen_ai.tool.call.result"] == (
        "report-\\udcff.txt"
    )
    _, answer = traces.named("chat demo")
    attributes = dict(answer.attributes or {})
    [message] = json.loads(str(attributes["gen_ai.output.messages"]))
    assert message["parts"][0]["content"] == "found report-\\udcfe.txt"
    assert attributes["gen_ai.response.id"] == "resp-\\udcfd"
    assert attributes["gen_ai.response.model"] == "demo-\\udcfc"


@tool
async def broken() -> str:
    """Fail on a file name that is not UTF-8."""
    raise OSError("cannot open report-\udcff.txt")


async def test_lone_surrogates_in_errors_and_reasons_are_recorded_escaped(
    traces: Traces,
) -> None:
    """Text the loop does not pass to the model (an exception's message, a
    handler's reason, a provider's error) is escaped by the spans themselves."""

    def stop(pending: PendingTransition) -> Abort | None:
        return Abort("over budget \udcfd") if pending.trigger == "answer" else None

    provider = ScriptedProvider(
        [
            ProviderError("bad gateway \udcfc", retryable=True),
            calls(call("broken", call_id="c1")),
            text("done"),
        ]
    )
    request = InferenceInput(
        model="scripted:demo", context=ModelContext(), tools=[broken]
    )
    instrument = OpenTelemetry(tracer_provider=traces.provider, capture_content=True)
    async with Runtime(providers={"scripted": provider}, extensions=[instrument]) as rt:
        loop_id = rt.run_loop("files", "go", request, stop, retry_backoff=0)
        result = await rt.wait(loop_id)

    assert result.outcome is Outcome.aborted
    assert len(traces.spans) == 5
    assert_encodable(traces)
    [agent] = traces.named("invoke_agent")
    assert dict(agent.attributes or {})["agentfsm.reason"] == "over budget \\udcfd"
    [tool_span] = traces.named("execute_tool broken")
    [exception] = [dict(e.attributes or {}) for e in tool_span.events]
    assert exception["exception.message"] == "cannot open report-\\udcff.txt"
    assert tool_span.status.description == "cannot open report-\\udcff.txt"
    failed_chat = traces.named("chat demo")[0]
    assert failed_chat.status.description == "bad gateway \\udcfc"


# ------------------------------------------------------------ tracing failures


class Failing(SpanProcessor):
    """A span processor that raises wherever the SDK calls it."""

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        raise RuntimeError("processor failed at start")

    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("processor failed at end")


@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_a_failing_span_processor_never_fails_a_loop(
    streaming: bool, log_output: list[EventDict]
) -> None:
    traces = Traces(Failing())
    try:
        untraced = await run_surrogates(None, streaming=streaming)
        traced = await run_surrogates(
            OpenTelemetry(tracer_provider=traces.provider, capture_content=True),
            streaming=streaming,
        )
    finally:
        traces.provider.shutdown()

    assert traced.outcome is untraced.outcome is Outcome.answered
    assert traced.path == untraced.path
    failures = [e for e in log_output if e["event"] == "otel_failed"]
    assert failures
    assert all("RuntimeError: processor failed" in e["error"] for e in failures)
