"""`agentfsm.otel`: GenAI spans of loops, model requests and tool calls.

Each test passes its own SDK tracer provider (with an in-memory exporter) to
`OpenTelemetry`, except those about the global provider, which reset
OpenTelemetry's globals around themselves (`global_provider`).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.util._once import Once

from agentfsm import (
    Abort,
    FunctionProvider,
    InferenceInput,
    InferenceOutput,
    LoopStatus,
    ModelContext,
    ModelMessageItem,
    Outcome,
    PendingTransition,
    Proceed,
    Rewrite,
    Runtime,
    TokenUsage,
    ToolResult,
    tool,
)
from agentfsm.exceptions import ConfigurationError, ProviderError
from agentfsm.inference import ModelNext, ModelRequest, StreamEvent
from agentfsm.otel import CAPTURE_CONTENT_ENV, OpenTelemetry, conversation
from agentfsm.providers.function import replay
from agentfsm.states import LoopState
from agentfsm.testing import ScriptedProvider, call, calls, text

# ------------------------------------------------------------------ fixtures


class Traces:
    """A tracer provider exporting to memory, and what it exported."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def instrument(self, **options: Any) -> OpenTelemetry:
        return OpenTelemetry(tracer_provider=self.provider, **options)

    @property
    def spans(self) -> tuple[ReadableSpan, ...]:
        return self.exporter.get_finished_spans()

    def named(self, prefix: str) -> list[ReadableSpan]:
        return [s for s in self.spans if s.name.startswith(prefix)]

    def one(self, name: str) -> ReadableSpan:
        [span] = [s for s in self.spans if s.name == name]
        return span


@pytest.fixture
def traces() -> Iterator[Traces]:
    t = Traces()
    yield t
    t.provider.shutdown()


@pytest.fixture
def global_provider(monkeypatch: pytest.MonkeyPatch) -> Iterator[Traces]:
    """OpenTelemetry's global provider unset for the test, and reset after it (it
    can be set once per process otherwise); the test sets `.provider` itself."""
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", Once())
    t = Traces()
    yield t
    t.provider.shutdown()


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def span_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.span_id)


def trace_id(span: ReadableSpan) -> int:
    assert span.context is not None
    return int(span.context.trace_id)


def times(span: ReadableSpan) -> tuple[int, int]:
    """When the span started and ended (ns)."""
    assert span.start_time is not None
    assert span.end_time is not None
    return span.start_time, span.end_time


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def events(span: ReadableSpan, name: str) -> list[dict[str, Any]]:
    return [dict(e.attributes or {}) for e in span.events if e.name == name]


@tool
async def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def request(
    *tools: Any, model: str = "scripted:demo", **settings: Any
) -> InferenceInput:
    return InferenceInput(model=model, context=ModelContext(), tools=tools, **settings)


ADD_THEN_ANSWER = [calls(call("add", call_id="c1", a=1, b=2)), text("3")]


async def run(
    instrument: OpenTelemetry,
    script: Sequence[Any] = ADD_THEN_ANSWER,
    inference_input: InferenceInput | None = None,
    handlers: Any = None,
    *,
    prefix: str = "scripted",
    **options: Any,
) -> Any:
    provider = ScriptedProvider(script)
    async with Runtime(
        providers={prefix: provider}, extensions=[instrument]
    ) as runtime:
        loop_id = runtime.run_loop(
            "calculator",
            "1+2?",
            inference_input or request(add),
            handlers,
            **options,
        )
        return await runtime.wait(loop_id)


# ------------------------------------------------------------------ structure


async def test_a_loop_is_an_invoke_agent_span_with_its_chat_and_tool_spans_under_it(
    traces: Traces,
) -> None:
    result = await run(traces.instrument())

    assert result.outcome is Outcome.answered
    agent = traces.one("invoke_agent calculator")
    chats = traces.named("chat ")
    tool_span = traces.one("execute_tool add")
    assert [s.name for s in chats] == ["chat demo", "chat demo"]
    assert len(traces.spans) == 4
    assert agent.kind is SpanKind.INTERNAL
    assert agent.parent is None
    assert all(s.kind is SpanKind.CLIENT for s in chats)
    assert tool_span.kind is SpanKind.INTERNAL
    for child in (*chats, tool_span):
        assert parent_id(child) == span_id(agent)
        assert trace_id(child) == trace_id(agent)
    assert attrs(agent) | {"agentfsm.loop_id": None} == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": "calculator",
        "gen_ai.conversation.id": result.loop_id,
        "gen_ai.provider.name": "scripted",
        "gen_ai.request.model": "demo",
        "agentfsm.loop_id": None,
        "agentfsm.segment": 0,
        "agentfsm.outcome": "answered",
        "agentfsm.model_requests": 2,
        "agentfsm.tool_calls": 1,
        # The script reports no usage: no token counts (a 0 would be made up).
        "agentfsm.usage.unreported_requests": 2,
    }
    assert attrs(agent)["agentfsm.loop_id"] == result.loop_id
    assert attrs(tool_span) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "add",
        "gen_ai.tool.call.id": "c1",
        "gen_ai.tool.type": "function",
    }
    assert agent.status.status_code is StatusCode.UNSET
    # The tool ran between the two requests, inside the loop's span.
    (agent_start, agent_end), (tool_start, tool_end) = times(agent), times(tool_span)
    assert agent_start <= times(chats[0])[0]
    assert times(chats[0])[1] <= tool_start <= tool_end <= times(chats[1])[0]
    assert times(chats[1])[1] <= agent_end


async def test_a_loop_started_inside_a_span_is_its_child(traces: Traces) -> None:
    tracer = traces.provider.get_tracer("app")
    with tracer.start_as_current_span("handle request") as outer:
        await run(traces.instrument())
    agent = traces.one("invoke_agent calculator")
    assert parent_id(agent) == outer.get_span_context().span_id


async def test_what_a_provider_opens_nests_under_its_chat_span(traces: Traces) -> None:
    """The chat span is current while the provider works (as an HTTP client's
    span would be opened), streaming or not, below the model wrappers."""
    http = traces.provider.get_tracer("httpx")

    def answer(request: InferenceInput) -> InferenceOutput:
        with http.start_as_current_span("POST /v1/responses"):
            return text("ok")

    async def stream(request: InferenceInput) -> AsyncIterator[StreamEvent]:
        with http.start_as_current_span("POST /v1/responses (stream)"):
            async with replay(text("ok")) as deltas:
                async for delta in deltas:
                    yield delta

    async def wrapper(request: ModelRequest, next_: ModelNext) -> InferenceOutput:
        return await next_(request)

    provider = FunctionProvider(answer, stream_handler=stream)
    async with Runtime(
        providers={"fn": provider}, extensions=[traces.instrument()]
    ) as runtime:
        for streaming in (False, True):
            loop_id = runtime.run_loop(
                "agent",
                "hi",
                request(model="fn:m", streaming=streaming),
                model_wrappers=[wrapper],
            )
            await runtime.wait(loop_id)

    chats = traces.named("chat m")
    posts = traces.named("POST")
    assert len(chats) == len(posts) == 2
    for chat, post in zip(chats, posts, strict=True):
        assert parent_id(post) == span_id(chat)
    assert [attrs(c)["gen_ai.request.stream"] for c in chats] == [False, True]


async def test_what_a_tool_opens_nests_under_its_tool_span(traces: Traces) -> None:
    """Async tools, sync tools in worker threads, and parallel calls each see
    their own `execute_tool` span as the current one."""
    app = traces.provider.get_tracer("app")
    threads: list[bool] = []

    @tool
    async def fetch(url: str) -> str:
        with app.start_as_current_span(f"GET {url}"):
            await anyio.lowlevel.checkpoint()
        return url

    @tool
    def parse(page: str) -> str:
        threads.append(threading.current_thread() is not threading.main_thread())
        with app.start_as_current_span(f"parse {page}"):
            return page.upper()

    script = [
        calls(
            call("fetch", call_id="f1", url="a"),
            call("fetch", call_id="f2", url="b"),
            call("parse", call_id="p1", page="c"),
        ),
        text("done"),
    ]
    await run(
        traces.instrument(),
        script,
        request(fetch, parse),
        tool_execution="parallel",
    )

    assert threads == [True]  # the sync tool ran in a worker thread
    agent = traces.one("invoke_agent calculator")
    by_call = {attrs(s)["gen_ai.tool.call.id"]: s for s in traces.named("execute_tool")}
    assert set(by_call) == {"f1", "f2", "p1"}
    for call_id, inner in (("f1", "GET a"), ("f2", "GET b"), ("p1", "parse c")):
        assert parent_id(by_call[call_id]) == span_id(agent)
        assert parent_id(traces.one(inner)) == span_id(by_call[call_id])


# ------------------------------------------------------------------ chat attributes


async def test_chat_spans_carry_the_request_settings_usage_and_finish_reason(
    traces: Traces,
) -> None:
    usage = TokenUsage(
        input_tokens=120, output_tokens=30, reasoning_tokens=10, cached_input_tokens=100
    )
    output = InferenceOutput(
        items=(ModelMessageItem(content="hi"),),
        token_usage=usage,
        finish_reason="length",
        raw_response={"id": "resp_1", "model": "gpt-4.1-mini-2025-04-14"},
    )
    result = await run(
        traces.instrument(),
        [output],
        request(
            model="openai:gpt-4.1-mini",
            max_output_tokens=64,
            temperature=0.5,
            top_p=0.9,
            seed=7,
            stop_sequences=["\n\n"],
        ),
        prefix="openai",
    )

    chat = traces.one("chat gpt-4.1-mini")
    assert attrs(chat) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "gpt-4.1-mini",
        "gen_ai.conversation.id": result.loop_id,
        "gen_ai.request.stream": False,
        "gen_ai.request.max_tokens": 64,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.seed": 7,
        "gen_ai.request.stop_sequences": ("\n\n",),
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": 120,
        "gen_ai.usage.output_tokens": 30,
        "gen_ai.usage.cache_read.input_tokens": 100,
        "gen_ai.usage.reasoning.output_tokens": 10,
        "gen_ai.response.id": "resp_1",
        "gen_ai.response.model": "gpt-4.1-mini-2025-04-14",
    }
    # The loop's span has the usage of its segment.
    agent = attrs(traces.one("invoke_agent calculator"))
    assert agent["gen_ai.usage.input_tokens"] == 120
    assert agent["gen_ai.usage.reasoning.output_tokens"] == 10


@pytest.mark.parametrize(
    ("prefix", "names", "expected"),
    [
        ("anthropic", {}, "anthropic"),
        ("local", {}, "llama.cpp"),
        ("openai-chat", {}, "openai"),
        ("corp", {}, "corp"),
        ("corp", {"corp": "azure.ai.openai"}, "azure.ai.openai"),
    ],
)
async def test_the_provider_name_comes_from_the_model_prefix(
    traces: Traces, prefix: str, names: dict[str, str], expected: str
) -> None:
    await run(
        traces.instrument(provider_names=names),
        [text("hi")],
        request(model=f"{prefix}:m"),
        prefix=prefix,
    )
    assert attrs(traces.one("chat m"))["gen_ai.provider.name"] == expected
    agent = traces.one("invoke_agent calculator")
    assert attrs(agent)["gen_ai.provider.name"] == expected


async def test_a_stream_records_its_time_to_first_chunk(traces: Traces) -> None:
    await run(traces.instrument(), [text("a streamed answer")], request(streaming=True))
    chat = traces.one("chat demo")
    start, end = times(chat)
    first = attrs(chat)["gen_ai.response.time_to_first_chunk"]
    assert 0 <= first <= (end - start) / 1e9
    assert attrs(chat)["gen_ai.request.stream"] is True
    assert attrs(chat)["gen_ai.response.finish_reasons"] == ("stop",)


async def test_each_retry_of_a_transient_error_is_a_chat_span(traces: Traces) -> None:
    transient = ProviderError("rate limited", retryable=True)
    result = await run(
        traces.instrument(), [transient, text("hi")], request(), retry_backoff=0
    )
    assert result.outcome is Outcome.answered
    failed, ok = traces.named("chat demo")
    assert attrs(failed)["error.type"] == "agentfsm.exceptions.ProviderError"
    assert failed.status.status_code is StatusCode.ERROR
    assert "error.type" not in attrs(ok)
    assert ok.status.status_code is StatusCode.UNSET


# ------------------------------------------------------------------ span events


async def test_each_transition_and_each_decision_is_an_event_of_the_loop_span(
    traces: Traces,
) -> None:
    def first(pending: PendingTransition) -> Proceed | Rewrite | None:
        if pending.trigger == "infer":
            return Rewrite(dest=LoopState.inference_streaming)
        return None

    def second(pending: PendingTransition) -> Proceed:
        return Proceed()

    result = await run(traces.instrument(), handlers=[first, second])

    agent = traces.one("invoke_agent calculator")
    transitions = events(agent, "agentfsm.transition")
    assert [
        (e["agentfsm.source"], e["agentfsm.trigger"], e["agentfsm.dest"])
        for e in transitions
    ] == [(s.source, s.trigger, s.dest) for s in result.path]
    rewritten = [e for e in transitions if "agentfsm.rewritten_from" in e]
    # Both requests (the first, and the one after the tool) were rewritten.
    assert [e["agentfsm.rewritten_from"] for e in rewritten] == ["inference"] * 2
    decisions = events(agent, "agentfsm.decision")
    # Both handlers decide about each transition (`finish` included).
    assert len(decisions) == 2 * len(result.path)
    names = {e["agentfsm.handler"] for e in decisions}
    assert names == {
        f"{__name__}:test_each_transition_and_each_decision_is_an_event_of_the_loop_span.<locals>.first",
        f"{__name__}:test_each_transition_and_each_decision_is_an_event_of_the_loop_span.<locals>.second",
    }
    rewrite, _ = [e for e in decisions if e["agentfsm.decision"] == "rewrite"]
    assert rewrite["agentfsm.handler_index"] == 0
    assert rewrite["agentfsm.trigger"] == "infer"
    assert rewrite["agentfsm.dest"] == "inference"
    assert rewrite["agentfsm.new_dest"] == "inference_streaming"
    # Events are in order: each transition follows the decisions about it.
    kinds = [e.name for e in agent.events]
    assert kinds[:3] == [
        "agentfsm.decision",
        "agentfsm.decision",
        "agentfsm.transition",
    ]
    stamps = [e.timestamp for e in agent.events]
    assert stamps == sorted(stamps)


async def test_an_abort_is_a_decision_with_its_reason_and_ends_the_span(
    traces: Traces,
) -> None:
    def budget(pending: PendingTransition) -> Abort | None:
        return Abort("over budget") if pending.trigger == "call_tools" else None

    result = await run(traces.instrument(), handlers=budget)

    assert result.outcome is Outcome.aborted
    agent = traces.one("invoke_agent calculator")
    [abort] = [
        e
        for e in events(agent, "agentfsm.decision")
        if e["agentfsm.decision"] == "abort"
    ]
    assert abort["agentfsm.reason"] == "over budget"
    assert attrs(agent)["agentfsm.outcome"] == "aborted"
    assert attrs(agent)["agentfsm.reason"] == "over budget"
    assert events(agent, "agentfsm.transition")[-1]["agentfsm.trigger"] == "abort"
    assert traces.named("execute_tool") == []


async def test_a_paused_loop_ends_its_span_and_the_resumed_part_links_to_it(
    traces: Traces,
) -> None:
    @tool(needs_approval=True)
    async def delete(path: str) -> str:
        return f"deleted {path}"

    provider = ScriptedProvider(
        [calls(call("delete", call_id="d1", path="notes.txt")), text("deleted")]
    )
    async with Runtime(
        providers={"scripted": provider}, extensions=[traces.instrument()]
    ) as runtime:
        loop_id = runtime.run_loop("cleaner", "tidy up", request(delete))
        while runtime.get(loop_id).status is not LoopStatus.paused:
            await anyio.lowlevel.checkpoint()
        # The paused part is exported before the loop goes on.
        [paused] = traces.named("invoke_agent")
        runtime.resume(loop_id)
        result = await runtime.wait(loop_id)

    assert result.outcome is Outcome.answered
    first, second = traces.named("invoke_agent cleaner")
    assert paused.context == first.context
    assert attrs(first)["agentfsm.status"] == "paused"
    assert attrs(first)["agentfsm.pause_reason"] == "approval required: delete"
    assert attrs(first)["agentfsm.segment"] == 0
    assert "agentfsm.outcome" not in attrs(first)
    assert attrs(second)["agentfsm.segment"] == 1
    assert attrs(second)["agentfsm.outcome"] == "answered"
    assert attrs(second)["gen_ai.conversation.id"] == loop_id
    [link] = second.links
    assert link.context == first.context
    assert dict(link.attributes or {}) == {"agentfsm.link": "resumes"}
    assert times(first)[1] <= times(second)[0]
    # The pause and the resume are decisions of their segments.
    *proceeds, pause = events(first, "agentfsm.decision")
    assert [e["agentfsm.decision"] for e in proceeds] == ["proceed", "proceed"]
    assert pause["agentfsm.decision"] == "pause"
    assert pause["agentfsm.reason"] == "approval required: delete"
    assert pause["agentfsm.handler"] == "agentfsm._loop.intercept:approval_gate"
    resumed = events(second, "agentfsm.decision")[0]
    assert resumed["agentfsm.handler"] == "resume"
    assert resumed["agentfsm.decision"] == "proceed"
    # Each segment has the spans of its work.
    chat_one, chat_two = traces.named("chat demo")
    assert parent_id(chat_one) == span_id(first)
    assert parent_id(chat_two) == span_id(second)
    assert parent_id(traces.one("execute_tool delete")) == span_id(second)
    assert [e["agentfsm.trigger"] for e in events(first, "agentfsm.transition")] == [
        "start",
        "infer",
    ]


async def test_a_paused_loop_ended_by_the_runtime_closing_gets_a_linked_span(
    traces: Traces,
) -> None:
    def hold(pending: PendingTransition) -> Any:
        from agentfsm import Pause

        return Pause("hold") if pending.trigger == "infer" else None

    async with Runtime(
        providers={"scripted": ScriptedProvider([text("hi")])},
        extensions=[traces.instrument()],
    ) as runtime:
        loop_id = runtime.run_loop("agent", "hi", request(), hold)
        while runtime.get(loop_id).status is not LoopStatus.paused:
            await anyio.lowlevel.checkpoint()
    result = await runtime.wait(loop_id)

    assert result.outcome is Outcome.cancelled
    first, last = traces.named("invoke_agent agent")
    assert attrs(first)["agentfsm.status"] == "paused"
    assert attrs(last)["agentfsm.outcome"] == "cancelled"
    assert [link.context for link in last.links] == [first.context]
    assert [e["agentfsm.trigger"] for e in events(last, "agentfsm.transition")] == [
        "cancel"
    ]


async def test_the_record_of_a_traced_loop_does_not_show_the_tracing(
    traces: Traces,
) -> None:
    """The wrappers are the runtime's, not the loop's options: a record taken
    from a traced loop is the one taken without tracing."""

    def hold(pending: PendingTransition) -> Any:
        from agentfsm import Pause

        return Pause("hold") if pending.trigger == "infer" else None

    records = []
    for instrument in (traces.instrument(), None):
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hi")])},
            extensions=[] if instrument is None else [instrument],
        ) as runtime:
            loop_id = runtime.run_loop("agent", "hi", request(add), hold)
            while runtime.get(loop_id).status is not LoopStatus.paused:
                await anyio.lowlevel.checkpoint()
            records.append(runtime.snapshot(loop_id).options)
            runtime.cancel(loop_id)
    assert records[0] == records[1]
    assert records[0].tool_wrappers == ()


# ------------------------------------------------------------------ content


def content_attributes(traces: Traces) -> set[str]:
    opt_in = {
        "gen_ai.input.messages",
        "gen_ai.output.messages",
        "gen_ai.system_instructions",
        "gen_ai.tool.definitions",
        "gen_ai.tool.description",
        "gen_ai.tool.call.arguments",
        "gen_ai.tool.call.result",
    }
    return {key for span in traces.spans for key in attrs(span) if key in opt_in}


async def test_content_is_not_captured_by_default(
    traces: Traces, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CAPTURE_CONTENT_ENV, raising=False)
    await run(traces.instrument())
    assert len(traces.spans) == 4
    assert content_attributes(traces) == set()


@pytest.mark.parametrize("value", ["true", "True", "SPAN_ONLY", "span_and_event"])
async def test_the_environment_variable_turns_content_capture_on(
    traces: Traces, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(CAPTURE_CONTENT_ENV, value)
    context = ModelContext(instructions="Be brief.")
    await run(
        traces.instrument(),
        inference_input=InferenceInput(
            model="scripted:demo", context=context, tools=[add]
        ),
    )

    assert content_attributes(traces) == {
        "gen_ai.input.messages",
        "gen_ai.output.messages",
        "gen_ai.system_instructions",
        "gen_ai.tool.definitions",
        "gen_ai.tool.description",
        "gen_ai.tool.call.arguments",
        "gen_ai.tool.call.result",
    }
    first, second = traces.named("chat demo")
    assert attrs(first)["gen_ai.system_instructions"] == (
        '[{"type":"text","content":"Be brief."}]'
    )
    assert attrs(first)["gen_ai.output.messages"] == (
        '[{"role":"assistant","parts":[{"type":"tool_call","id":"c1","name":"add",'
        '"arguments":{"a":1,"b":2}}],"finish_reason":"tool_calls"}]'
    )
    assert attrs(second)["gen_ai.input.messages"] == (
        '[{"role":"user","parts":[{"type":"text","content":"1+2?"}]},'
        '{"role":"assistant","parts":[{"type":"tool_call","id":"c1","name":"add",'
        '"arguments":{"a":1,"b":2}}]},'
        '{"role":"tool","parts":[{"type":"tool_call_response","id":"c1","response":"3"}]}]'
    )
    tool_span = traces.one("execute_tool add")
    assert attrs(tool_span)["gen_ai.tool.call.arguments"] == '{"a":1,"b":2}'
    assert attrs(tool_span)["gen_ai.tool.call.result"] == "3"
    assert attrs(tool_span)["gen_ai.tool.description"] == "Add two numbers."
    agent = traces.one("invoke_agent calculator")
    assert attrs(agent)["gen_ai.output.messages"] == (
        '[{"role":"assistant","parts":[{"type":"text","content":"3"}],"finish_reason":"stop"}]'
    )


@pytest.mark.parametrize("value", ["false", "NO_CONTENT", "EVENT_ONLY", ""])
async def test_other_values_of_the_variable_leave_it_off(
    traces: Traces, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(CAPTURE_CONTENT_ENV, value)
    await run(traces.instrument())
    assert content_attributes(traces) == set()


async def test_the_argument_overrides_the_environment_variable(
    traces: Traces, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CAPTURE_CONTENT_ENV, "true")
    await run(traces.instrument(capture_content=False))
    assert content_attributes(traces) == set()
    monkeypatch.delenv(CAPTURE_CONTENT_ENV)
    assert OpenTelemetry(capture_content=True).capture_content is True


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("capture", [True, False])
async def test_a_failing_request_fails_its_chat_span_and_the_loop_span(
    traces: Traces, capture: bool
) -> None:
    result = await run(
        traces.instrument(capture_content=capture), [ProviderError("bad request")]
    )

    assert result.outcome is Outcome.failed
    # An error's message may quote the model's server: it is content.
    message = "bad request" if capture else "content not captured"
    chat = traces.one("chat demo")
    assert chat.status.status_code is StatusCode.ERROR
    assert chat.status.description == message
    assert attrs(chat)["error.type"] == "agentfsm.exceptions.ProviderError"
    [exception] = events(chat, "exception")
    assert exception["exception.type"] == "agentfsm.exceptions.ProviderError"
    assert exception.get("exception.message") == (message if capture else None)
    assert ("exception.stacktrace" in exception) is capture
    agent = traces.one("invoke_agent calculator")
    assert agent.status.status_code is StatusCode.ERROR
    assert agent.status.description == message
    assert attrs(agent)["error.type"] == "ProviderError"
    assert attrs(agent)["agentfsm.outcome"] == "failed"
    assert attrs(agent)["agentfsm.reason"] == message
    expected = {"exception.type": "ProviderError"}
    if capture:
        expected["exception.message"] = "bad request"
    assert events(agent, "exception") == [expected]


@pytest.mark.parametrize("capture", [True, False])
async def test_a_failing_tool_call_fails_its_span_and_the_loop_goes_on(
    traces: Traces, capture: bool
) -> None:
    @tool
    async def boom() -> str:
        raise ValueError("no")

    @tool
    async def refuse() -> ToolResult:
        return ToolResult.error("not today")

    script = [
        calls(
            call("boom", call_id="b"),
            call("refuse", call_id="r"),
            call("missing", call_id="m"),
        ),
        text("sorry"),
    ]
    result = await run(
        traces.instrument(capture_content=capture), script, request(boom, refuse)
    )

    assert result.outcome is Outcome.answered
    spans = {attrs(s)["gen_ai.tool.call.id"]: s for s in traces.named("execute_tool")}
    assert attrs(spans["b"])["error.type"] == "ValueError"
    [exception] = events(spans["b"], "exception")
    assert exception["exception.type"] == "ValueError"
    assert exception.get("exception.message") == ("no" if capture else None)
    assert attrs(spans["r"])["error.type"] == "tool_error"
    assert spans["r"].status.description == (
        "not today" if capture else "content not captured"
    )
    assert attrs(spans["m"])["error.type"] == "agentfsm.exceptions.UnknownTool"
    # A name no tool has is the model's text: content.
    assert spans["m"].name == (
        "execute_tool missing" if capture else "execute_tool unknown"
    )
    assert all(s.status.status_code is StatusCode.ERROR for s in spans.values())
    assert traces.one("invoke_agent calculator").status.status_code is StatusCode.UNSET


# ------------------------------------------------------------------ providers, options


async def test_without_a_tracer_provider_nothing_is_traced_until_one_is_set(
    global_provider: Traces,
) -> None:
    instrument = OpenTelemetry()  # the global provider: a proxy, nothing set
    provider = ScriptedProvider([text("hi")])
    async with Runtime(providers={"scripted": provider}, extensions=[instrument]) as rt:
        first = rt.run_loop("agent", "hi", request())
        untraced = rt._loops[first]  # its direct path: no layer, no hook
        assert (untraced.extensions, untraced.tool_chain) == ((), None)
        assert untraced.providers is rt.providers
        await rt.wait(first)
        assert len(global_provider.exporter.get_finished_spans()) == 0
        trace.set_tracer_provider(global_provider.provider)
        second = rt.run_loop("agent", "hi", request())
        await rt.wait(second)
    [agent] = global_provider.named("invoke_agent")
    assert attrs(agent)["agentfsm.loop_id"] == second
    assert [span.name for span in global_provider.spans] == [
        "chat demo",
        "invoke_agent agent",
    ]


async def test_a_no_op_tracer_provider_traces_nothing(global_provider: Traces) -> None:
    """An explicit no-op provider wins over a global one that records."""
    from opentelemetry.trace import NoOpTracerProvider

    trace.set_tracer_provider(global_provider.provider)
    result = await run(OpenTelemetry(tracer_provider=NoOpTracerProvider()))
    assert result.outcome is Outcome.answered
    assert global_provider.spans == ()
    await run(OpenTelemetry())  # the global one does record, here
    assert global_provider.spans != ()


async def test_conversation_sets_the_conversation_id(traces: Traces) -> None:
    with conversation("ticket-42"):
        await run(traces.instrument())
    ids = {attrs(s).get("gen_ai.conversation.id") for s in traces.spans}
    assert ids == {"ticket-42", None}  # None: the tool span has none
    with pytest.raises(ConfigurationError, match="conversation_id"), conversation(""):
        pass


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match="tracer_provider"):
        OpenTelemetry(tracer_provider="console")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="capture_content"):
        OpenTelemetry(capture_content="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="provider_names"):
        OpenTelemetry(provider_names={"corp": 1})  # type: ignore[dict-item]
    with pytest.raises(ConfigurationError, match=r"extensions\[0\]"):
        Runtime(extensions=["otel"])  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="extensions must be a list"):
        Runtime(extensions=OpenTelemetry())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="instrument must be an agentfsm"):
        Runtime(instrument="otel")  # type: ignore[arg-type]


async def test_a_loop_resumed_while_still_publishing_its_pause(traces: Traces) -> None:
    """With a full backpressure subscriber, a paused loop's run is still
    delivering the pause when it is resumed, and goes on with the resumed part
    in the same worker: that part is a segment of its own all the same."""

    def hold(pending: PendingTransition) -> Any:
        from agentfsm import Pause

        return Pause("hold") if pending.trigger == "infer" else None

    async with Runtime(
        providers={"scripted": ScriptedProvider([text("hi")])},
        extensions=[traces.instrument()],
    ) as runtime:
        slow = runtime.bus.subscribe("*", buffer=1, backpressure=True)
        loop_id = runtime.run_loop("agent", "hi", request(), hold)
        while runtime.get(loop_id).status is not LoopStatus.paused:
            await slow.receive()
            await anyio.lowlevel.checkpoint()
        runtime.resume(loop_id)
        [paused] = traces.named("invoke_agent")  # ended at once
        received: list[Any] = []
        while not received or received[-1].type != "loop.idle":
            received.append(await slow.receive())
        slow.close()
    result = await runtime.wait(loop_id)

    assert result.outcome is Outcome.answered
    assert "loop.paused" in [e.type for e in received]  # it was still held
    first, second = traces.named("invoke_agent agent")
    assert first.context == paused.context
    assert attrs(first)["agentfsm.pause_reason"] == "hold"
    assert [link.context for link in second.links] == [first.context]
    assert parent_id(traces.one("chat demo")) == span_id(second)
    # The pause (held until after its segment ended) is no decision of the next.
    assert "pause" not in [
        e["agentfsm.decision"] for e in events(second, "agentfsm.decision")
    ]
    assert events(second, "agentfsm.decision")[0]["agentfsm.handler"] == "resume"


async def test_content_is_not_serialized_for_spans_the_sampler_drops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With content captured and every span sampled out, the messages, tools
    and outputs are never serialized (they grow with the context)."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    from agentfsm.otel import _content as content

    made: list[str] = []
    for name in ("input_messages", "tool_definitions", "output_messages"):
        real = getattr(content, name)

        def counted(*args: Any, _real: Any = real, _name: str = name) -> Any:
            made.append(_name)
            return _real(*args)

        monkeypatch.setattr(content, name, counted)
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    result = await run(OpenTelemetry(tracer_provider=provider, capture_content=True))
    assert result.outcome is Outcome.answered
    assert exporter.get_finished_spans() == ()
    assert [m for m in made if m != "input_messages"] == []
    # (the `invoke_agent` span's first message is made once, at its start)
    assert made.count("input_messages") <= 1


async def test_content_is_serialized_for_spans_kept(
    monkeypatch: pytest.MonkeyPatch, traces: Traces
) -> None:
    """The same counts with the default sampler: the content is made."""
    from agentfsm.otel import _content as content

    made: list[str] = []
    real = content.output_messages

    def counted(*args: Any) -> Any:
        made.append("output_messages")
        return real(*args)

    monkeypatch.setattr(content, "output_messages", counted)
    await run(traces.instrument(capture_content=True))
    assert made == ["output_messages"] * 2  # one per model request


@pytest.mark.parametrize("how", ["hand_over", "store"])
async def test_a_loop_taken_up_by_another_runtime_goes_on_with_its_trace(
    traces: Traces, how: str
) -> None:
    """One `OpenTelemetry` serving two runtimes: a loop handed over (or left
    paused in a store and recovered) continues its trace, its next segment
    linked to the last, in its conversation; nothing of the first runtime's
    bus is kept once the loop ended."""
    from agentfsm.store import MemoryStore

    def hold(pending: PendingTransition) -> Any:
        from agentfsm import Pause

        return Pause("hold") if pending.trigger == "call_tools" else None

    otel = traces.instrument()
    store = MemoryStore() if how == "store" else None
    first = ScriptedProvider([calls(call("add", a=1, b=2))])
    async with Runtime(
        providers={"scripted": first}, extensions=[otel], store=store
    ) as before:
        with conversation("conv-1"):
            loop_id = before.run_loop("agent", "hi", request(add), hold)
        while before.get(loop_id).status is not LoopStatus.paused:
            await anyio.lowlevel.checkpoint()
        if how == "hand_over":
            record, items = before.hand_over(loop_id)
    bindings: dict[str, Any] = {"tools": [add], "handlers": [hold]} if store else {}
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("3")])},
        extensions=[otel],
        store=store,
        **bindings,
    ) as after:
        if how == "hand_over":
            after.adopt(record, items, tools=[add], handlers=[hold])
        else:
            await after.recover()
        after.resume(loop_id)
        assert (await after.wait(loop_id)).outcome is Outcome.answered
    segments = [
        (
            attrs(s)["agentfsm.segment"],
            len(s.links),
            attrs(s)["gen_ai.conversation.id"],
        )
        for s in traces.named("invoke_agent")
    ]
    assert segments == [(0, 0, "conv-1"), (1, 1, "conv-1")]
    assert otel._loops == {}
    assert otel._decisions == {}
