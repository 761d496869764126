"""Token usage: `None` for a request whose server reported none (never a 0),
summed with how many did not report, shown as "unknown"; and the usage a
cancelled or failed stream had reported, kept.

The providers run for real against wire payloads (`tests/http_mock.py`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx2
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from agentfsm import (
    AgentEventAdapter,
    FunctionProvider,
    InferenceInput,
    InferenceOutput,
    LoopResult,
    ModelContext,
    Outcome,
    Runtime,
    TokenUsage,
)
from agentfsm._loop.loop import _NO_USAGE, one_more_unreported
from agentfsm.cli import main
from agentfsm.events import InferenceCompleted, InferenceStream, LoopIdle
from agentfsm.providers import (
    OutputCompleted,
    Provider,
    StreamEvent,
    TextDelta,
    UsageUpdate,
)
from agentfsm.providers.anthropic import AnthropicProvider
from agentfsm.providers.openai import OpenAIChatProvider, OpenAIResponsesProvider
from agentfsm.record import LoopRecord
from agentfsm.results import LoopStatus
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from agentfsm.timeline import build_timeline, format_table, format_timeline, summarize
from tests.helpers import add, pause_tools, wait_until
from tests.http_mock import (
    MockAPI,
    hanging_sse,
    json_response,
    sse_bytes,
    sse_response,
)
from tests.test_otel import Traces, attrs
from tests.test_provider_anthropic import stream_events, streamed_text
from tests.test_provider_openai import (
    call_item,
    chat_usage,
    chunk,
    completion_body,
    message_item,
    response_body,
    seq,
    tool_chunk,
    usage_body,
)

KNOWN = TokenUsage(input_tokens=20, output_tokens=5)
"""What a request reporting usage reports in these tests."""


# ================================================================== the sums


def test_a_total_says_whether_it_is_complete_partial_or_unknown() -> None:
    """`status` and `str` tell a known 0 from a sum of requests that reported none."""
    none = TokenUsage(unreported_requests=1)
    assert TokenUsage().status == "complete"
    assert str(TokenUsage()) == "0 in + 0 out = 0 total"
    assert KNOWN.status == "complete"
    assert str(KNOWN) == "20 in + 5 out = 25 total"

    partial = KNOWN + none + none
    assert partial == TokenUsage(
        input_tokens=20, output_tokens=5, unreported_requests=2
    )
    assert partial.status == "partial"
    assert str(partial) == "20 in + 5 out = 25 total (2 requests reported none)"
    assert str(KNOWN + none) == "20 in + 5 out = 25 total (1 request reported none)"

    unknown = none + none
    assert unknown.status == "unknown"
    assert str(unknown) == "unknown (not reported)"


def test_counting_unreported_requests_past_the_shared_totals() -> None:
    """The loop's shared totals for "n requests, none reported" (a speed
    measure, bench/PERFORMANCE.md) give the same sums as adding, past their
    end and once a request reported usage."""
    total = _NO_USAGE
    for n in range(1, 70):
        total = one_more_unreported(total)
        assert total == TokenUsage(unreported_requests=n)
    mixed = one_more_unreported(one_more_unreported(_NO_USAGE) + KNOWN)
    assert mixed == TokenUsage(input_tokens=20, output_tokens=5, unreported_requests=2)
    assert one_more_unreported(_NO_USAGE) is one_more_unreported(_NO_USAGE)


def test_a_usage_stored_before_the_field_existed_loads() -> None:
    """Records and events written without `unreported_requests` read as complete."""
    usage = TokenUsage.model_validate_json('{"input_tokens": 3, "output_tokens": 1}')
    assert usage == TokenUsage(input_tokens=3, output_tokens=1)
    assert usage.status == "complete"


# ============================================================ on the wire


def _chat_call() -> dict[str, Any]:
    return {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
    }


def _chat(streaming: bool, usage: list[dict[str, Any] | None]) -> list[httpx2.Response]:
    """A call of `add`, then the answer `5`, each with the usage given (None:
    the field is null, or, streaming, no usage chunk comes, as from a server
    that ignores `stream_options.include_usage`)."""
    if not streaming:
        first = completion_body(
            {"content": None, "tool_calls": [_chat_call()]}, "tool_calls", usage[0]
        )
        second = completion_body({"content": "5"}, "stop", usage[1])
        return [json_response(first), json_response(second)]
    turns = [
        [
            chunk({"role": "assistant", "content": None}),
            tool_chunk(0, id="call_1", name="add", arguments='{"a":2,"b":3}'),
            chunk({}, "tool_calls"),
        ],
        [chunk({"role": "assistant", "content": "5"}), chunk({}, "stop")],
    ]
    for chunks, reported in zip(turns, usage, strict=True):
        if reported is not None:
            chunks.append(chunk(usage=reported))
    return [sse_response(chunks, named=False, done=True) for chunks in turns]


def _responses(
    streaming: bool, usage: list[dict[str, Any] | None]
) -> list[httpx2.Response]:
    """The same two turns from the Responses API (`usage: null` when None)."""
    call = call_item("call_1", "add", '{"a":2,"b":3}')
    bodies = [
        response_body([call], usage=usage[0]),
        response_body([message_item("5")], usage=usage[1]),
    ]
    if not streaming:
        return [json_response(body) for body in bodies]
    return [
        sse_response(seq([{"type": "response.completed", "response": body}]))
        for body in bodies
    ]


def _provider(
    prefix: str, api: MockAPI
) -> OpenAIChatProvider | OpenAIResponsesProvider:
    if prefix == "openai-chat":
        client = AsyncOpenAI(
            api_key="sk-test",
            base_url="http://127.0.0.1:8080/v1",
            http_client=api.http,
            max_retries=0,
        )
        return OpenAIChatProvider(client=client)
    client = AsyncOpenAI(api_key="sk-test", http_client=api.http, max_retries=0)
    return OpenAIResponsesProvider(client=client)


async def _run_add(
    prefix: str, streaming: bool, usage: list[dict[str, Any] | None]
) -> tuple[LoopResult, list[InferenceCompleted], LoopIdle]:
    """Run the two turns; the result, the completed requests' events, `loop.idle`."""
    answers = (
        _chat(streaming, usage)
        if prefix == "openai-chat"
        else _responses(streaming, usage)
    )
    async with (
        MockAPI(*answers) as api,
        Runtime(providers={prefix: _provider(prefix, api)}) as runtime,
    ):
        recorder = EventRecorder(runtime.bus, ["inference.completed", "loop.idle"])
        inference_input = InferenceInput(
            model=f"{prefix}:m",
            context=ModelContext(),
            tools=[add],
            streaming=streaming,
        )
        loop_id = runtime.run_loop("agent", "2+3?", inference_input)
        result = await runtime.wait(loop_id)
        events = recorder.of_loop(loop_id)
    assert result.outcome is Outcome.answered
    completed = [e for e in events if isinstance(e, InferenceCompleted)]
    (idle,) = [e for e in events if isinstance(e, LoopIdle)]
    return result, completed, idle


SERVERS = pytest.mark.parametrize(
    ("prefix", "streaming"),
    [
        ("openai-chat", True),
        ("openai-chat", False),
        ("openai", True),
        ("openai", False),
    ],
    ids=["chat-stream", "chat-whole", "responses-stream", "responses-whole"],
)


def _reported(prefix: str) -> dict[str, Any]:
    """`KNOWN` as the API spells it."""
    return chat_usage(20, 5) if prefix == "openai-chat" else usage_body(20, 0, 5)


@SERVERS
async def test_a_server_reporting_no_usage_gives_none_and_an_unknown_total(
    prefix: str, streaming: bool
) -> None:
    """Each request's usage is None, not 0; the total counts them as unreported."""
    result, completed, idle = await _run_add(prefix, streaming, [None, None])

    assert [e.output.token_usage for e in completed] == [None, None]
    assert result.usage == TokenUsage(unreported_requests=2)
    assert result.usage.unreported_requests == result.model_requests == 2
    assert result.usage.status == "unknown"
    assert idle.usage == result.usage


@SERVERS
async def test_some_requests_reporting_usage_give_a_partial_total(
    prefix: str, streaming: bool
) -> None:
    """The known usage is summed; the request that reported none is counted apart."""
    result, completed, _ = await _run_add(prefix, streaming, [_reported(prefix), None])

    assert [e.output.token_usage for e in completed] == [KNOWN, None]
    assert result.usage == TokenUsage(
        input_tokens=20, output_tokens=5, unreported_requests=1
    )
    assert result.usage.status == "partial"


# ====================================================== a stream cut short


def _anthropic(api: MockAPI) -> AnthropicProvider:
    client = AsyncAnthropic(api_key="sk-ant-test", http_client=api.http, max_retries=0)
    return AnthropicProvider(client=client)


def _cut_stream(prefix: str) -> httpx2.Response:
    """A stream that reports its usage so far, sends one chunk of text, and
    then nothing more, ever."""
    if prefix == "anthropic":
        # message_start (25 in, 1 out), ping, the block's start, "Once".
        return hanging_sse(stream_events([streamed_text("Once")])[:4])
    # A server sending usage with every chunk (vLLM's continuous usage stats).
    first = {
        **chunk({"role": "assistant", "content": "Once"}),
        "usage": chat_usage(25, 1),
    }
    return hanging_sse([first], named=False)


def _cut_provider(prefix: str, api: MockAPI) -> AnthropicProvider | OpenAIChatProvider:
    if prefix == "anthropic":
        return _anthropic(api)
    provider = _provider(prefix, api)
    assert isinstance(provider, OpenAIChatProvider)
    return provider


@pytest.mark.parametrize("prefix", ["anthropic", "openai-chat"])
async def test_a_cancelled_stream_keeps_the_usage_it_reported(prefix: str) -> None:
    """Cancelled mid-stream: the tokens reported so far are in the loop's total,
    and in the `loop.idle` it publishes."""
    async with (
        MockAPI(_cut_stream(prefix)) as api,
        Runtime(providers={prefix: _cut_provider(prefix, api)}) as runtime,
    ):
        with runtime.bus.subscribe(["inference.stream", "loop.idle"]) as events:
            inference_input = InferenceInput(
                model=f"{prefix}:m", context=ModelContext(), streaming=True
            )
            loop_id = runtime.run_loop("agent", "a story?", inference_input)
            first = await events.receive()
            assert first.type == "inference.stream"
            runtime.cancel(loop_id, "enough")
            result = await runtime.wait(loop_id)
            idle = await events.receive()

    assert result.outcome is Outcome.cancelled
    assert result.model_requests == 0  # it never completed
    assert result.usage == TokenUsage(input_tokens=25, output_tokens=1)
    assert isinstance(idle, LoopIdle)
    assert idle.usage == result.usage


async def test_a_failed_stream_keeps_the_usage_it_reported() -> None:
    """A stream that reports its usage and then fails: the loop fails with it counted."""
    events = [
        *stream_events([streamed_text("Once")])[:2],  # message_start, ping
        {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "Bad input."},
        },
    ]
    async with (
        MockAPI(sse_response(events)) as api,
        Runtime(providers={"anthropic": _anthropic(api)}) as runtime,
    ):
        inference_input = InferenceInput(
            model="anthropic:m", context=ModelContext(), streaming=True
        )
        result = await runtime.wait(runtime.run_loop("a", "hi", inference_input))

    assert result.outcome is Outcome.failed
    assert result.usage == TokenUsage(input_tokens=25, output_tokens=1)


async def test_a_retried_stream_counts_both_attempts() -> None:
    """An attempt that failed after reporting usage, then one that completed:
    the total holds both; one model request is counted."""
    overloaded = [
        *stream_events([streamed_text("Once")])[:2],
        {"type": "error", "error": {"type": "overloaded_error", "message": "Busy."}},
    ]
    whole = stream_events([streamed_text("Done.")], output_tokens=3)
    async with (
        MockAPI(sse_response(overloaded), sse_response(whole)) as api,
        Runtime(providers={"anthropic": _anthropic(api)}) as runtime,
    ):
        inference_input = InferenceInput(
            model="anthropic:m", context=ModelContext(), streaming=True
        )
        loop_id = runtime.run_loop(
            "a", "hi", inference_input, max_retries=1, retry_backoff=0
        )
        result = await runtime.wait(loop_id)

    assert result.outcome is Outcome.answered
    assert len(api.requests) == 2
    assert result.model_requests == 1
    assert result.usage == TokenUsage(input_tokens=25 + 25, output_tokens=1 + 3)


async def test_any_provider_may_report_usage_mid_stream() -> None:
    """A provider's own stream: the last `UsageUpdate` before it failed counts
    (each replaces the one before); none is published as a chunk."""

    async def stream(request: InferenceInput) -> AsyncIterator[StreamEvent]:
        yield UsageUpdate(usage=TokenUsage(input_tokens=7))
        yield TextDelta(text="Half")
        yield UsageUpdate(usage=TokenUsage(input_tokens=7, output_tokens=2))
        raise ValueError("the connection dropped")

    provider = FunctionProvider(lambda _: text("unused"), stream_handler=stream)
    async with Runtime(providers={"fn": provider}) as runtime:
        recorder = EventRecorder(runtime.bus, "inference.stream")
        inference_input = InferenceInput(
            model="fn:m", context=ModelContext(), streaming=True
        )
        result = await runtime.wait(runtime.run_loop("a", "hi", inference_input))

    assert result.outcome is Outcome.failed
    assert result.usage == TokenUsage(input_tokens=7, output_tokens=2)
    chunks = [e.delta for e in recorder.events if isinstance(e, InferenceStream)]
    assert chunks == [TextDelta(text="Half")]


async def test_a_usage_update_of_the_wrong_type_fails_the_request() -> None:
    """What a provider reports is checked as an output's `token_usage` is."""

    async def stream(request: InferenceInput) -> AsyncIterator[StreamEvent]:
        bad: Any = {"input_tokens": -1}
        yield UsageUpdate.model_construct(usage=bad)
        yield OutputCompleted(output=text("never"))

    provider = FunctionProvider(lambda _: text("unused"), stream_handler=stream)
    async with Runtime(providers={"fn": provider}) as runtime:
        inference_input = InferenceInput(
            model="fn:m", context=ModelContext(), streaming=True
        )
        result = await runtime.wait(runtime.run_loop("a", "hi", inference_input))

    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert "UsageUpdate.usage" in result.error.message
    assert result.usage == TokenUsage()


@pytest.mark.parametrize("streaming", [False, True])
async def test_one_request_cannot_claim_unreported_requests(streaming: bool) -> None:
    """Only the loop counts the requests that reported nothing: a request's
    usage (an output's or a stream's) claiming some fails the request, and the
    loop's total does not take the made-up count."""
    claimed = TokenUsage(input_tokens=3, unreported_requests=7)

    async def stream(request: InferenceInput) -> AsyncIterator[StreamEvent]:
        yield UsageUpdate(usage=claimed)
        yield OutputCompleted(output=text("never"))

    provider = FunctionProvider(
        lambda _: text("answer", usage=claimed), stream_handler=stream
    )
    async with Runtime(providers={"fn": provider}) as runtime:
        inference_input = InferenceInput(
            model="fn:m", context=ModelContext(), streaming=streaming
        )
        result = await runtime.wait(runtime.run_loop("a", "hi", inference_input))

    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert "unreported_requests is int 7" in result.error.message
    assert result.usage.unreported_requests == 0


# ============================================================ OpenTelemetry


async def test_chat_spans_carry_only_the_usage_reported() -> None:
    """A request that reported none has no usage attributes; a cancelled
    stream's span has those it reported before the cancel."""
    traces = Traces()
    try:
        async with MockAPI(_cut_stream("anthropic")) as api:
            providers: dict[str, Provider] = {
                "anthropic": _anthropic(api),
                "scripted": ScriptedProvider([text("hello")]),
            }
            async with Runtime(
                providers=providers, extensions=[traces.instrument()]
            ) as runtime:
                plain = InferenceInput(model="scripted:demo", context=ModelContext())
                await runtime.wait(runtime.run_loop("a", "hi", plain))
                with runtime.bus.subscribe("inference.stream") as chunks:
                    cut = InferenceInput(
                        model="anthropic:m", context=ModelContext(), streaming=True
                    )
                    loop_id = runtime.run_loop("b", "a story?", cut)
                    await chunks.receive()
                    runtime.cancel(loop_id)
                    await runtime.wait(loop_id)
        unreported = attrs(traces.one("chat demo"))
        cancelled = attrs(traces.one("chat m"))
    finally:
        traces.provider.shutdown()

    assert not [name for name in unreported if name.startswith("gen_ai.usage.")]
    assert cancelled["gen_ai.usage.input_tokens"] == 25
    assert cancelled["gen_ai.usage.output_tokens"] == 1


# =================================================== the reports and the CLI


async def _events_of(*outputs: InferenceOutput) -> list[Any]:
    """The events of a loop answering with `outputs` in turn."""
    provider = ScriptedProvider(list(outputs))
    async with Runtime(providers={"s": provider}) as runtime:
        recorder = EventRecorder(runtime.bus)
        inference_input = InferenceInput(
            model="s:m", context=ModelContext(), tools=[add]
        )
        await runtime.wait(runtime.run_loop("agent", "2+3?", inference_input))
        return recorder.events


async def test_reports_say_unknown_when_no_request_reported_usage() -> None:
    """The table's TOKENS, the totals and each request's row say unknown, not 0."""
    events = await _events_of(calls(call("add", a=2, b=3)), text("5"))
    (summary,) = summarize(events)
    assert summary.usage.status == "unknown"
    header, row, _ = format_table([summary]).splitlines()
    assert row.split()[header.split().index("TOKENS")] == "unknown"
    report = format_timeline(build_timeline(events, summary.loop_id))
    assert "2 model requests, 1 tool call, tokens unknown (not reported)" in report
    assert report.count("tokens unknown (not reported)") == 3  # totals, 2 requests
    assert " 0 in" not in report


async def test_reports_mark_a_partial_total() -> None:
    """A total that misses some requests' usage says so."""
    events = await _events_of(calls(call("add", a=2, b=3), usage=KNOWN), text("5"))
    (summary,) = summarize(events)
    header, row, _ = format_table([summary]).splitlines()
    assert row.split()[header.split().index("TOKENS")] == "25+"
    report = format_timeline(build_timeline(events, summary.loop_id))
    assert "25+ tokens (20 in, 5 out; 1 request reported none)" in report


async def test_a_log_of_a_loop_still_running_sums_what_its_requests_reported() -> None:
    """Without `loop.idle` (the log ends mid-loop), the report sums the
    completed requests, the unreported counted apart."""
    events = await _events_of(calls(call("add", a=2, b=3), usage=KNOWN), text("5"))
    running = [e for e in events if not isinstance(e, LoopIdle)]
    (summary,) = summarize(running)
    assert summary.outcome is None
    assert summary.usage == TokenUsage(
        input_tokens=20, output_tokens=5, unreported_requests=1
    )


def test_an_event_logged_before_the_field_existed_loads() -> None:
    """A `loop.idle` written without `unreported_requests` reads as complete."""
    line = json.dumps(
        {
            "type": "loop.idle",
            "event_id": "l1:9",
            "loop_id": "l1",
            "agent_id": "a",
            "seq": 9,
            "ts": "2026-01-01T00:00:00Z",
            "state": "idle",
            "outcome": "answered",
            "usage": {"input_tokens": 20, "output_tokens": 5},
            "model_requests": 1,
            "tool_calls": 0,
        }
    )
    idle = AgentEventAdapter.validate_json(line)
    assert isinstance(idle, LoopIdle)
    assert idle.usage == KNOWN


async def test_a_record_written_before_the_field_existed_loads() -> None:
    """A paused loop's record keeps `unreported_requests`; one written without
    it loads, as 0."""
    provider = ScriptedProvider([calls(call("add", a=2, b=3)), text("5")])
    async with Runtime(providers={"s": provider}) as runtime:
        inference_input = InferenceInput(
            model="s:m", context=ModelContext(), tools=[add]
        )
        loop_id = runtime.run_loop("agent", "2+3?", inference_input, pause_tools)
        await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
        record = runtime.snapshot(loop_id)
        runtime.cancel(loop_id)
    assert record.usage == TokenUsage(unreported_requests=1)
    data = json.loads(record.model_dump_json())
    assert LoopRecord.model_validate(data).usage == record.usage
    del data["usage"]["unreported_requests"]
    assert LoopRecord.model_validate(data).usage == TokenUsage()


class _Server(ThreadingHTTPServer):
    """Answers each POST with the next canned body (an OpenAI-compatible server)."""

    daemon_threads = True

    def __init__(self, bodies: list[tuple[str, bytes]]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.bodies = bodies

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        kind, body = self.server.bodies.pop(0)
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # not to the test's stderr


@pytest.fixture
def server() -> Iterator[_Server]:
    # llama.cpp's server streaming: no usage chunk.
    chunks = [chunk({"role": "assistant", "content": "5"}), chunk({}, "stop")]
    served = _Server([("text/event-stream", sse_bytes(chunks, named=False, done=True))])
    thread = threading.Thread(target=served.serve_forever, daemon=True)
    thread.start()
    yield served
    served.shutdown()
    served.server_close()
    thread.join()


def test_the_cli_prints_unknown_tokens(
    server: _Server, capsys: pytest.CaptureFixture[str]
) -> None:
    """`agentfsm run` on a server that reports no usage says so, not `0 in + 0 out`."""
    code = main(
        [
            "run",
            "2+3?",
            "--model",
            "openai-chat:m",
            "--base-url",
            server.base_url,
            "--api-key",
            "sk-test",
            "--stream",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tokens: unknown (not reported), over 1 model request(s)" in out
    assert "0 in + 0 out" not in out
