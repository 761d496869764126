"""The Anthropic provider against the real SDK, with Messages API wire payloads.

An `httpx2.MockTransport` under `anthropic.AsyncAnthropic` serves the Messages
API's documented JSON bodies and SSE event streams, and records what the SDK
sent: nothing reaches the network.
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx2
import pytest
from anthropic import AsyncAnthropic
from pydantic import BaseModel

from agentfsm import (
    ConfigurationError,
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    ModelMessageItem,
    Outcome,
    ProviderError,
    ReasoningItem,
    Runtime,
    TokenUsage,
    UserMessage,
)
from agentfsm.exceptions import ProviderTimeout
from agentfsm.providers import (
    OutputCompleted,
    ReasoningDelta,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    UsageUpdate,
)
from agentfsm.providers.anthropic import AnthropicProvider
from agentfsm.testing import assert_path
from tests.helpers import add
from tests.http_mock import MockAPI, hanging_sse, json_response, raw_of, sse_response

MODEL = "anthropic:claude-sonnet-4-6"
SIGNATURE = "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"


class Weather(BaseModel):
    city: str
    celsius: float


def provider_of(api: MockAPI, **options: Any) -> AnthropicProvider:
    client = AsyncAnthropic(api_key="sk-ant-test", http_client=api.http, max_retries=0)
    return AnthropicProvider(client=client, **options)


def make_request(*items: Any, **fields: Any) -> InferenceInput:
    context = ModelContext(items=list(items or [UserMessage(content="hi")]))
    return InferenceInput(model=MODEL, context=context, **fields)


def message_body(
    content: list[dict[str, Any]],
    stop_reason: str | None = "end_turn",
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `message` object as the Messages API documents it."""
    return {
        "id": "msg_01XFDUDYJgAACzvnptvVoYEL",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-6",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage or {"input_tokens": 12, "output_tokens": 6},
    }


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def tool_use(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


async def collect(
    provider: AnthropicProvider, request: InferenceInput
) -> tuple[list[StreamEvent], InferenceOutput]:
    async with provider.stream(request) as stream:
        events = [event async for event in stream]
    last = events[-1]
    assert isinstance(last, OutputCompleted)
    return events[:-1], last.output


async def infer(
    provider: AnthropicProvider, request: InferenceInput, *, streaming: bool
) -> InferenceOutput:
    if streaming:
        return (await collect(provider, request))[1]
    return await provider.complete(request)


def ok() -> httpx2.Response:
    return json_response(message_body([text_block("ok")]))


# ===================================================================== requests


class TestRequest:
    async def test_context_maps_onto_grouped_messages(self) -> None:
        """A turn's thinking, text and calls are one assistant message; outputs one user message."""
        context = ModelContext(
            instructions="Be brief.",
            items=[
                UserMessage(content="add 2+3 and 1+1"),
                ReasoningItem(content="Two sums.", encrypted_content=SIGNATURE),
                ReasoningItem(
                    content="", encrypted_content="anthropic-redacted-thinking:EmwKAhgB"
                ),
                ReasoningItem(content="no signature: not sent"),
                ModelMessageItem(content="Adding both."),
                FunctionCallItem(
                    call_id="toolu_1", name="add", arguments='{"a":2,"b":3}'
                ),
                FunctionCallItem(call_id="toolu_2", name="add", arguments='{"a":1,'),
                FunctionCallOutputItem(call_id="toolu_1", output="5"),
                FunctionCallOutputItem(
                    call_id="toolu_2", output="invalid arguments", is_error=True
                ),
                UserMessage(content="also 4+4"),
                ModelMessageItem(content=""),
                ModelMessageItem(content="5, and the second failed."),
                UserMessage(content="thanks"),
            ],
        )
        async with MockAPI(ok()) as api:
            await provider_of(api).complete(
                InferenceInput(model=MODEL, context=context)
            )

        assert api.requests[0].url.path == "/v1/messages"
        body = api.body
        assert body["model"] == "claude-sonnet-4-6"
        assert body["system"] == "Be brief."
        assert body["max_tokens"] == 4096
        assert body["messages"] == [
            {"role": "user", "content": [text_block("add 2+3 and 1+1")]},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "thinking",
                        "thinking": "Two sums.",
                        "signature": SIGNATURE,
                    },
                    {"type": "redacted_thinking", "data": "EmwKAhgB"},
                    text_block("Adding both."),
                    tool_use("toolu_1", "add", {"a": 2, "b": 3}),
                    # Arguments cut short are not JSON: sent as an empty object.
                    tool_use("toolu_2", "add", {}),
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": "invalid arguments",
                        "is_error": True,
                    },
                    text_block("also 4+4"),
                ],
            },
            {"role": "assistant", "content": [text_block("5, and the second failed.")]},
            {"role": "user", "content": [text_block("thanks")]},
        ]
        for absent in ("tools", "tool_choice", "thinking", "output_config", "stream"):
            assert absent not in body

    async def test_tools_limits_and_structured_output(self) -> None:
        """Tools with their input schema, `max_tokens`, and the output format."""
        request = make_request(
            tools=[add], max_output_tokens=512, structured_output=Weather
        )
        async with MockAPI(ok()) as api:
            await provider_of(api).complete(request)
        body = api.body
        assert body["tools"] == [
            {
                "name": "add",
                "description": "Add two integers.",
                "input_schema": add.definition.parameters,
            }
        ]
        assert body["max_tokens"] == 512
        output_format = body["output_config"]["format"]
        assert output_format["type"] == "json_schema"
        schema = output_format["schema"]
        assert schema["additionalProperties"] is False
        assert schema["required"] == ["city", "celsius"]

    async def test_dict_schema_is_sent_as_given(self) -> None:
        """A JSON schema dict is the output format as it is."""
        schema = {"type": "object", "properties": {"x": {"type": "string"}}}
        async with MockAPI(ok()) as api:
            await provider_of(api).complete(make_request(structured_output=schema))
        assert api.body["output_config"] == {
            "format": {"type": "json_schema", "schema": schema}
        }

    @pytest.mark.parametrize(
        ("choice", "sent"),
        [
            pytest.param("auto", {"type": "auto"}, id="auto"),
            pytest.param("required", {"type": "any"}, id="required"),
            pytest.param("none", {"type": "none"}, id="none"),
            pytest.param("add", {"type": "tool", "name": "add"}, id="named"),
        ],
    )
    async def test_tool_choice(self, choice: str, sent: dict[str, str]) -> None:
        """`required` is `any`, a tool's name is `tool`; the modes pass through."""
        async with MockAPI(ok()) as api:
            await provider_of(api).complete(
                make_request(tools=[add], tool_choice=choice)
            )
        assert api.body["tool_choice"] == sent

    @pytest.mark.parametrize(
        ("effort", "budget", "max_tokens"),
        [
            pytest.param("minimal", 1024, 1024 + 4096, id="minimal"),
            pytest.param("low", 2048, 2048 + 4096, id="low"),
            pytest.param("medium", 8192, 8192 + 4096, id="medium"),
            pytest.param("high", 16384, 16384 + 4096, id="high"),
            pytest.param("3000", 3000, 3000 + 4096, id="tokens"),
        ],
    )
    async def test_reasoning_effort_is_a_thinking_budget(
        self, effort: str, budget: int, max_tokens: int
    ) -> None:
        """Effort names map onto budgets; without a limit, max_tokens makes room."""
        async with MockAPI(ok()) as api:
            await provider_of(api).complete(make_request(reasoning_effort=effort))
        assert api.body["thinking"] == {"type": "enabled", "budget_tokens": budget}
        assert api.body["max_tokens"] == max_tokens

    async def test_budget_within_an_explicit_limit(self) -> None:
        """With `max_output_tokens`, the budget must fit under it."""
        async with MockAPI(ok()) as api:
            await provider_of(api).complete(
                make_request(reasoning_effort="low", max_output_tokens=4000)
            )
        assert api.body["max_tokens"] == 4000
        assert api.body["thinking"]["budget_tokens"] == 2048
        async with MockAPI() as api:
            with pytest.raises(ConfigurationError, match="must be below max_output"):
                await provider_of(api).complete(
                    make_request(reasoning_effort="high", max_output_tokens=4000)
                )

    async def test_unknown_effort(self) -> None:
        """An effort the provider does not know is a ConfigurationError naming the valid ones."""
        async with MockAPI() as api:
            with pytest.raises(ConfigurationError, match="minimal, low, medium"):
                await provider_of(api).complete(
                    make_request(reasoning_effort="extreme")
                )

    async def test_effort_none_disables_thinking(self) -> None:
        """`none` sends thinking disabled."""
        async with MockAPI(ok()) as api:
            await provider_of(api).complete(make_request(reasoning_effort="none"))
        assert api.body["thinking"] == {"type": "disabled"}
        assert api.body["max_tokens"] == 4096

    async def test_adaptive_thinking(self) -> None:
        """`thinking="adaptive"` sends adaptive thinking and the effort."""
        async with MockAPI(ok(), ok()) as api:
            provider = provider_of(api, thinking="adaptive")
            await provider.complete(make_request(reasoning_effort="high"))
            await provider.complete(make_request(reasoning_effort="minimal"))
        first, second = api.bodies
        assert first["thinking"] == {"type": "adaptive"}
        assert first["output_config"] == {"effort": "high"}
        assert first["max_tokens"] == 4096
        assert second["output_config"] == {"effort": "low"}


# ====================================================================== outputs


class TestOutput:
    async def test_blocks_usage_and_raw(self) -> None:
        """Thinking, redacted thinking, text and tool_use blocks map onto items in order."""
        body = message_body(
            [
                {"type": "thinking", "thinking": "Add both.", "signature": SIGNATURE},
                {"type": "redacted_thinking", "data": "EmwKAhgB"},
                text_block("Adding "),
                text_block("both."),
                tool_use("toolu_01A", "add", {"a": 2, "b": 3}),
                tool_use("toolu_01B", "add", {"a": 1, "b": 1}),
            ],
            stop_reason="tool_use",
            usage={
                "input_tokens": 50,
                "cache_creation_input_tokens": 100,
                "cache_read_input_tokens": 1000,
                "output_tokens": 120,
                "output_tokens_details": {"thinking_tokens": 80},
            },
        )
        async with MockAPI(json_response(body)) as api:
            output = await provider_of(api).complete(make_request())
        assert output.items == (
            ReasoningItem(content="Add both.", encrypted_content=SIGNATURE),
            ReasoningItem(
                content="", encrypted_content="anthropic-redacted-thinking:EmwKAhgB"
            ),
            ModelMessageItem(content="Adding both."),
            FunctionCallItem(
                call_id="toolu_01A", name="add", arguments='{"a":2,"b":3}'
            ),
            FunctionCallItem(
                call_id="toolu_01B", name="add", arguments='{"a":1,"b":1}'
            ),
        )
        assert output.token_usage == TokenUsage(
            input_tokens=1150,
            output_tokens=120,
            reasoning_tokens=80,
            cached_input_tokens=1000,
        )
        assert output.finish_reason == "tool_calls"
        assert raw_of(output)["id"] == "msg_01XFDUDYJgAACzvnptvVoYEL"

    async def test_reasoning_round_trips(self) -> None:
        """Thinking read from a response goes back as the same blocks."""
        blocks = [
            {"type": "thinking", "thinking": "Hmm.", "signature": SIGNATURE},
            {"type": "redacted_thinking", "data": "EmwKAhgB"},
            tool_use("toolu_1", "add", {"a": 1, "b": 2}),
        ]
        answers = [json_response(message_body(blocks, "tool_use")), ok()]
        async with MockAPI(*answers) as api:
            provider = provider_of(api)
            output = await provider.complete(make_request())
            context = [
                UserMessage(content="hi"),
                *output.items,
                FunctionCallOutputItem(call_id="toolu_1", output="3"),
            ]
            await provider.complete(make_request(*context))
        assistant = api.bodies[1]["messages"][1]
        assert assistant == {"role": "assistant", "content": blocks}

    @pytest.mark.parametrize(
        ("stop_reason", "finish_reason"),
        [
            pytest.param("end_turn", "stop", id="end_turn"),
            pytest.param("stop_sequence", "stop", id="stop_sequence"),
            pytest.param("max_tokens", "length", id="max_tokens"),
            pytest.param("model_context_window_exceeded", "length", id="window"),
            pytest.param("pause_turn", "pause_turn", id="pause_turn"),
        ],
    )
    async def test_stop_reasons(self, stop_reason: str, finish_reason: str) -> None:
        """`stop_reason` maps onto `finish_reason` (`max_tokens` is `length`)."""
        body = message_body([text_block("Once upon")], stop_reason=stop_reason)
        async with MockAPI(json_response(body)) as api:
            output = await provider_of(api).complete(make_request())
        assert output.finish_reason == finish_reason

    async def test_refusal(self) -> None:
        """`stop_reason: refusal` sets the message's refusal (the explanation if any)."""
        body = message_body([text_block("I")], stop_reason="refusal")
        body["stop_details"] = {
            "type": "refusal",
            "category": "cyber",
            "explanation": "This request was declined.",
        }
        async with MockAPI(json_response(body)) as api:
            output = await provider_of(api).complete(make_request())
        assert output.items == (
            ModelMessageItem(content="I", refusal="This request was declined."),
        )
        assert output.finish_reason == "content_filter"

    async def test_refusal_without_text(self) -> None:
        """A refusal with no text block still yields a message with `refusal` set."""
        body = message_body([], stop_reason="refusal")
        async with MockAPI(json_response(body)) as api:
            output = await provider_of(api).complete(make_request())
        assert output.items == (
            ModelMessageItem(content="", refusal="the model declined to answer"),
        )


# ====================================================================== streams


def stream_events(
    blocks: list[tuple[dict[str, Any], list[dict[str, Any]]]],
    stop_reason: str = "end_turn",
    *,
    input_tokens: int = 25,
    output_tokens: int = 89,
) -> list[dict[str, Any]]:
    """A documented Messages stream: start, each block with its deltas, the end."""
    start = message_body([], stop_reason=None, usage={"input_tokens": input_tokens})
    start["usage"]["output_tokens"] = 1
    events: list[dict[str, Any]] = [
        {"type": "message_start", "message": start},
        {"type": "ping"},
    ]
    for index, (block, deltas) in enumerate(blocks):
        events.append(
            {"type": "content_block_start", "index": index, "content_block": block}
        )
        events.extend(
            {"type": "content_block_delta", "index": index, "delta": delta}
            for delta in deltas
        )
        events.append({"type": "content_block_stop", "index": index})
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {"output_tokens": output_tokens},
        }
    )
    events.append({"type": "message_stop"})
    return events


def thinking_block(*pieces: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    deltas: list[dict[str, Any]] = [
        {"type": "thinking_delta", "thinking": piece} for piece in pieces
    ]
    deltas.append({"type": "signature_delta", "signature": SIGNATURE})
    return {"type": "thinking", "thinking": ""}, deltas


def streamed_text(*pieces: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return text_block(""), [{"type": "text_delta", "text": piece} for piece in pieces]


def streamed_tool(
    call_id: str, name: str, *pieces: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return tool_use(call_id, name, {}), [
        {"type": "input_json_delta", "partial_json": piece} for piece in pieces
    ]


class TestStreaming:
    async def test_deltas_and_completed_output(self) -> None:
        """Thinking, text and tool input stream as deltas; the output is assembled."""
        events = stream_events(
            [
                thinking_block("Two", " sums."),
                streamed_text("Adding", " both."),
                streamed_tool("toolu_01A", "add", "", '{"a"', ": 2, ", '"b": 3}'),
                streamed_tool("toolu_01B", "add", '{"a": 1,', ' "b": 1}'),
            ],
            "tool_use",
        )
        async with MockAPI(sse_response(events)) as api:
            deltas, output = await collect(provider_of(api), make_request(tools=[add]))

        assert api.body["stream"] is True
        assert deltas == [
            # message_start's usage: the input, and the output's first token.
            UsageUpdate(usage=TokenUsage(input_tokens=25, output_tokens=1)),
            ReasoningDelta(text="Two"),
            ReasoningDelta(text=" sums."),
            TextDelta(text="Adding"),
            TextDelta(text=" both."),
            ToolCallDelta(index=0, call_id="toolu_01A", name="add"),
            ToolCallDelta(index=0, arguments='{"a"'),
            ToolCallDelta(index=0, arguments=": 2, "),
            ToolCallDelta(index=0, arguments='"b": 3}'),
            ToolCallDelta(index=1, call_id="toolu_01B", name="add"),
            ToolCallDelta(index=1, arguments='{"a": 1,'),
            ToolCallDelta(index=1, arguments=' "b": 1}'),
            # message_delta's: the output counted to the end.
            UsageUpdate(usage=TokenUsage(input_tokens=25, output_tokens=89)),
        ]
        assert output.items == (
            ReasoningItem(content="Two sums.", encrypted_content=SIGNATURE),
            ModelMessageItem(content="Adding both."),
            FunctionCallItem(
                call_id="toolu_01A", name="add", arguments='{"a":2,"b":3}'
            ),
            FunctionCallItem(
                call_id="toolu_01B", name="add", arguments='{"a":1,"b":1}'
            ),
        )
        assert output.token_usage == TokenUsage(input_tokens=25, output_tokens=89)
        assert output.finish_reason == "tool_calls"
        raw = raw_of(output)
        assert raw["stop_reason"] == "tool_use"
        assert [block["type"] for block in raw["content"]] == [
            "thinking",
            "text",
            "tool_use",
            "tool_use",
        ]

    async def test_streamed_and_whole_outputs_agree(self) -> None:
        """The streamed output's items equal the non-streamed ones for the same message."""
        events = stream_events(
            [
                thinking_block("Hmm."),
                streamed_text("Hi"),
                streamed_tool("t1", "add", "{}"),
            ],
            "tool_use",
        )
        whole = message_body(
            [
                {"type": "thinking", "thinking": "Hmm.", "signature": SIGNATURE},
                text_block("Hi"),
                tool_use("t1", "add", {}),
            ],
            "tool_use",
            {"input_tokens": 25, "output_tokens": 89},
        )
        async with MockAPI(sse_response(events), json_response(whole)) as api:
            provider = provider_of(api)
            _, streamed = await collect(provider, make_request())
            complete = await provider.complete(make_request())
        assert streamed.items == complete.items
        assert streamed.token_usage == complete.token_usage
        assert streamed.finish_reason == complete.finish_reason

    async def test_cut_by_max_tokens_is_length(self) -> None:
        """A stream that stops at `max_tokens` completes with `length`."""
        events = stream_events(
            [streamed_tool("toolu_1", "add", '{"a": 2,')], "max_tokens"
        )
        async with MockAPI(sse_response(events)) as api:
            _, output = await collect(provider_of(api), make_request())
        assert output.finish_reason == "length"

    async def test_error_event_mid_stream(self) -> None:
        """An `overloaded_error` event mid-stream raises a retryable ProviderError."""
        events = stream_events([streamed_text("Hel")])[:4]
        events.append(
            {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "Overloaded"},
            }
        )
        async with MockAPI(sse_response(events)) as api:
            with pytest.raises(ProviderError, match="Overloaded") as caught:
                await collect(provider_of(api), make_request())
        assert caught.value.retryable is True

    async def test_invalid_request_event_mid_stream(self) -> None:
        """An `invalid_request_error` event is not retryable."""
        events = [
            {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "Bad input."},
            }
        ]
        async with MockAPI(sse_response(events)) as api:
            with pytest.raises(ProviderError, match="Bad input") as caught:
                await collect(provider_of(api), make_request())
        assert caught.value.retryable is False


async def test_cancelled_stream_closes_the_response() -> None:
    """Cancelling mid-stream closes the HTTP response and propagates."""
    # message_start, ping, content_block_start, the first text_delta; then silence.
    answer = hanging_sse(stream_events([streamed_text("Once")])[:4])
    async with MockAPI(answer) as api:
        with anyio.CancelScope() as scope:
            async with provider_of(api).stream(make_request()) as stream:
                assert isinstance(await anext(stream), UsageUpdate)  # message_start
                assert await anext(stream) == TextDelta(text="Once")
                scope.cancel()
                await anext(stream)  # waits on the body: cancelled
        assert scope.cancelled_caught
        assert api.responses[0].is_closed


async def test_stream_closed_early_closes_the_response() -> None:
    """Leaving the stream after one delta closes the HTTP response."""
    events = stream_events([streamed_text("a", "b", "c")])
    async with MockAPI(sse_response(events)) as api:
        async with provider_of(api).stream(make_request()) as stream:
            assert isinstance(await anext(stream), UsageUpdate)  # message_start
            assert await anext(stream) == TextDelta(text="a")
        assert api.responses[0].is_closed


# ======================================================================= errors


def error_body(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
@pytest.mark.parametrize(
    ("status", "kind", "message", "retryable"),
    [
        pytest.param(
            429, "rate_limit_error", "Number of requests exceeded.", True, id="429"
        ),
        pytest.param(529, "overloaded_error", "Overloaded", True, id="529"),
        pytest.param(500, "api_error", "Internal server error", True, id="500"),
        pytest.param(
            400, "invalid_request_error", "max_tokens: Field required", False, id="400"
        ),
        pytest.param(401, "authentication_error", "invalid x-api-key", False, id="401"),
        pytest.param(404, "not_found_error", "model: claude-nope", False, id="404"),
    ],
)
async def test_http_errors(
    status: int, kind: str, message: str, retryable: bool, streaming: bool
) -> None:
    """HTTP errors carry the API's message, type and status; transient ones retry."""
    async with MockAPI(json_response(error_body(kind, message), status)) as api:
        with pytest.raises(ProviderError) as caught:
            await infer(provider_of(api), make_request(), streaming=streaming)
    error = caught.value
    assert str(error) == f"Anthropic answered HTTP {status}: {kind}: {message}"
    assert error.retryable is retryable
    assert error.status_code == status


async def test_timeout() -> None:
    """A timeout raises ProviderTimeout."""

    def timeout(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ReadTimeout("timed out", request=request)

    async with MockAPI(timeout) as api:
        with pytest.raises(ProviderTimeout):
            await provider_of(api).complete(make_request())


async def test_connection_error() -> None:
    """A connection failure is a retryable ProviderError."""

    def refuse(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused", request=request)

    async with MockAPI(refuse) as api:
        with pytest.raises(ProviderError, match="connection refused") as caught:
            await provider_of(api).complete(make_request())
    assert caught.value.retryable is True


# ================================================================ configuration


def test_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ANTHROPIC_API_KEY` and `ANTHROPIC_BASE_URL` configure the client."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-env")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9999")
    provider = AnthropicProvider()
    assert provider.client.api_key == "sk-ant-env"
    assert provider.client.base_url.host == "127.0.0.1"
    assert provider.client.max_retries == 0


def test_missing_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """No key anywhere: a ConfigurationError that says what to set."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    with pytest.raises(ConfigurationError, match="ANTHROPIC_API_KEY"):
        AnthropicProvider()


def test_bad_options() -> None:
    """Invalid options are refused up front."""
    with pytest.raises(ConfigurationError, match="default_max_tokens"):
        AnthropicProvider(api_key="k", default_max_tokens=0)
    with pytest.raises(ConfigurationError, match="thinking"):
        AnthropicProvider(api_key="k", thinking="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not both"):
        AnthropicProvider(client=AsyncAnthropic(api_key="k"), api_key="k")


async def test_provider_closes_the_client_it_made() -> None:
    """`async with` closes a client the provider created."""
    async with AnthropicProvider(api_key="k") as provider:
        client = provider.client
    assert client.is_closed()


# ========================================================================= loops


def whole_turns() -> list[httpx2.Response]:
    return [
        json_response(
            message_body(
                [
                    {
                        "type": "thinking",
                        "thinking": "Use add.",
                        "signature": SIGNATURE,
                    },
                    tool_use("toolu_1", "add", {"a": 2, "b": 3}),
                ],
                "tool_use",
                {"input_tokens": 20, "output_tokens": 5},
            )
        ),
        json_response(
            message_body(
                [text_block("5")], usage={"input_tokens": 30, "output_tokens": 1}
            )
        ),
    ]


def streamed_turns() -> list[httpx2.Response]:
    first = stream_events(
        [
            thinking_block("Use", " add."),
            streamed_tool("toolu_1", "add", '{"a": 2,', ' "b": 3}'),
        ],
        "tool_use",
        input_tokens=20,
        output_tokens=5,
    )
    second = stream_events([streamed_text("5")], input_tokens=30, output_tokens=1)
    return [sse_response(first), sse_response(second)]


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
async def test_loop_with_a_tool_call(streaming: bool) -> None:
    """A whole loop through the SDK: thinking, a tool call, the answer, the context."""
    answers = streamed_turns() if streaming else whole_turns()
    async with MockAPI(*answers) as api:
        inference_input = InferenceInput(
            model=MODEL,
            context=ModelContext(instructions="Use the tools."),
            tools=[add],
            reasoning_effort="low",
            streaming=streaming,
        )
        async with Runtime(providers={"anthropic": provider_of(api)}) as runtime:
            loop_id = runtime.run_loop("agent", "what is 2+3?", inference_input)
            result = await runtime.wait(loop_id)

    infer_state = "inference_streaming" if streaming else "inference"
    assert_path(
        result,
        f"idle context_update {infer_state} function_call {infer_state} "
        "model_message idle",
    )
    assert result.outcome is Outcome.answered
    assert result.answer == ModelMessageItem(content="5")
    assert result.usage == TokenUsage(input_tokens=50, output_tokens=6)
    assert inference_input.context.items == [
        UserMessage(content="what is 2+3?"),
        ReasoningItem(content="Use add.", encrypted_content=SIGNATURE),
        FunctionCallItem(call_id="toolu_1", name="add", arguments='{"a":2,"b":3}'),
        FunctionCallOutputItem(call_id="toolu_1", output="5"),
        ModelMessageItem(content="5"),
    ]
    second = api.bodies[1]
    assert second["messages"] == [
        {"role": "user", "content": [text_block("what is 2+3?")]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use add.", "signature": SIGNATURE},
                tool_use("toolu_1", "add", {"a": 2, "b": 3}),
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}
            ],
        },
    ]
    assert second["thinking"] == {"type": "enabled", "budget_tokens": 2048}


# ======================================================= structured output modes

WEATHER = {"city": "Oslo", "celsius": 3}


def answered(call_id: str = "toolu_f") -> httpx2.Response:
    """A message calling the final answer tool."""
    body = message_body([tool_use(call_id, "final_result", WEATHER)], "tool_use")
    return json_response(body)


class TestStructuredModes:
    async def test_tool_mode_forces_the_final_tool(self) -> None:
        """The final tool's `input_schema` is the schema; its input is the answer."""
        request = make_request(structured_output=Weather, structured_output_mode="tool")
        async with MockAPI(answered()) as api:
            output = await provider_of(api).complete(request)
        body = api.body
        assert body["tools"] == [
            {
                "name": "final_result",
                "description": "Give your final answer by calling this tool: "
                "its arguments are the answer.",
                "input_schema": Weather.model_json_schema(),
            }
        ]
        assert body["tool_choice"] == {"type": "tool", "name": "final_result"}
        assert "output_config" not in body
        assert output.items == (
            ModelMessageItem(content='{"city":"Oslo","celsius":3}'),
        )
        assert output.finish_reason == "stop"
        assert output.structured_output_mode == "tool"

    async def test_tool_mode_with_thinking_lets_the_model_choose(self) -> None:
        """Thinking refuses a forced tool: the choice is `auto`, beside other tools too."""
        request = make_request(
            tools=[add],
            reasoning_effort="low",
            max_output_tokens=4000,
            structured_output=Weather,
            structured_output_mode="tool",
        )
        async with MockAPI(answered()) as api:
            await provider_of(api).complete(request)
        assert api.body["tool_choice"] == {"type": "auto"}
        assert [t["name"] for t in api.body["tools"]] == ["add", "final_result"]

    async def test_streamed_tool_answer_is_text(self) -> None:
        """The final tool's input streams as one text delta, once complete:
        the answer's text (the chunks were streamed as they came, before it was
        known which call is the answer)."""
        events = stream_events(
            [
                streamed_tool(
                    "toolu_f", "final_result", '{"city": "Oslo",', ' "celsius": 3}'
                )
            ],
            "tool_use",
        )
        request = make_request(structured_output=Weather, structured_output_mode="tool")
        async with MockAPI(sse_response(events)) as api:
            deltas, output = await collect(provider_of(api), request)
        assert not any(isinstance(d, ToolCallDelta) for d in deltas)
        assert [d for d in deltas if isinstance(d, TextDelta)] == [
            TextDelta(text='{"city":"Oslo","celsius":3}')
        ]
        assert output.message == ModelMessageItem(content='{"city":"Oslo","celsius":3}')

    async def test_prompted_mode(self) -> None:
        """The schema joins the system prompt (the API has no JSON mode)."""
        request = InferenceInput(
            model=MODEL,
            context=ModelContext(
                instructions="Be brief.", items=[UserMessage(content="hi")]
            ),
            structured_output=Weather,
            structured_output_mode="prompted",
        )
        async with MockAPI(ok()) as api:
            output = await provider_of(api).complete(request)
        system = api.body["system"]
        assert system.startswith("Be brief.\n\nGive your final answer as a JSON value")
        assert '"celsius"' in system
        assert "output_config" not in api.body
        assert "tools" not in api.body
        assert output.structured_output_mode == "prompted"

    @pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
    async def test_refused_output_format_falls_back_to_the_tool(
        self, streaming: bool
    ) -> None:
        """A model without `output_config.format`: auto asks through the tool."""
        refused = json_response(
            error_body(
                "invalid_request_error",
                "output_config.format: this model does not support structured outputs",
            ),
            400,
        )
        events = stream_events(
            [
                streamed_tool(
                    "toolu_f", "final_result", '{"city": "Oslo", "celsius": 3}'
                )
            ],
            "tool_use",
        )
        second = sse_response(events) if streaming else answered()
        request = make_request(structured_output=Weather)
        async with MockAPI(refused, second) as api:
            output = await infer(provider_of(api), request, streaming=streaming)
        first, retried = api.bodies
        assert "format" in first["output_config"]
        assert "output_config" not in retried
        assert retried["tool_choice"] == {"type": "tool", "name": "final_result"}
        assert output.structured_output_mode == "tool"
        assert output.message is not None

    @pytest.mark.parametrize(
        ("url", "falls_back"),
        [("https://api.anthropic.com", False), ("http://127.0.0.1:8080", True)],
        ids=["anthropic", "compatible"],
    )
    async def test_a_500_is_a_refusal_only_off_anthropics_host(
        self, url: str, falls_back: bool
    ) -> None:
        """A 500 naming the output format: on Anthropic's own API it is its
        failure, retryable, and native is kept (it moved on to the tool for
        good); a compatible server's 500 may be its way of refusing."""
        failed = json_response(
            error_body("api_error", "internal error handling output_config"), 500
        )
        request = make_request(structured_output=Weather)
        answers = (failed, answered()) if falls_back else (failed,)
        async with MockAPI(*answers) as api:
            client = AsyncAnthropic(
                api_key="sk-ant-test", base_url=url, http_client=api.http, max_retries=0
            )
            provider = AnthropicProvider(client=client)
            if falls_back:
                output = await provider.complete(request)
                assert output.structured_output_mode == "tool"
            else:
                with pytest.raises(ProviderError) as caught:
                    await provider.complete(request)
                assert caught.value.retryable
                assert len(api.requests) == 1
        assert "format" in api.bodies[0]["output_config"]

    async def test_native_is_published(self) -> None:
        """`auto` is the API's output format, and says so."""
        body = message_body([text_block('{"city": "Oslo", "celsius": 3}')])
        async with MockAPI(json_response(body)) as api:
            output = await provider_of(api).complete(
                make_request(structured_output=Weather)
            )
        assert api.body["output_config"]["format"]["type"] == "json_schema"
        assert output.structured_output_mode == "native"


async def test_extra_body_is_merged_into_the_body() -> None:
    """Keys the SDK does not know reach the body as they are."""
    extra = {"top_k": 5, "metadata": {"user_id": "u1"}}
    async with MockAPI(ok()) as api:
        await provider_of(api).complete(make_request(extra_body=extra))
    assert api.body["top_k"] == 5
    assert api.body["metadata"] == {"user_id": "u1"}
