"""The OpenAI providers against the real SDK, with wire payloads in the APIs' formats.

An `httpx2.MockTransport` under `openai.AsyncOpenAI` serves the Responses API's
and Chat Completions' documented JSON bodies and SSE streams, and records what
the SDK sent: nothing reaches the network.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx2
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from agentfsm import (
    Agent,
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
    tool,
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
from agentfsm.providers.openai import OpenAIChatProvider, OpenAIResponsesProvider
from agentfsm.testing import assert_path
from tests.helpers import add
from tests.http_mock import MockAPI, hanging_sse, json_response, raw_of, sse_response

ADD_SCHEMA = {
    "additionalProperties": False,
    "properties": {
        "a": {"title": "A", "type": "integer"},
        "b": {"title": "B", "type": "integer"},
    },
    "required": ["a", "b"],
    "type": "object",
}


@tool
def greet(name: str, punctuation: str = "!") -> str:
    """Greet someone."""
    return f"hello {name}{punctuation}"


class Weather(BaseModel):
    city: str
    celsius: float


def responses_provider(api: MockAPI, **options: Any) -> OpenAIResponsesProvider:
    client = AsyncOpenAI(api_key="sk-test", http_client=api.http, max_retries=0)
    return OpenAIResponsesProvider(client=client, **options)


def chat_provider(api: MockAPI, **options: Any) -> OpenAIChatProvider:
    client = AsyncOpenAI(
        api_key="sk-test",
        base_url="http://127.0.0.1:8080/v1",
        http_client=api.http,
        max_retries=0,
    )
    return OpenAIChatProvider(client=client, **options)


def make_request(
    model: str = "openai:gpt-4.1-mini", *items: Any, **fields: Any
) -> InferenceInput:
    context = ModelContext(items=list(items or [UserMessage(content="hi")]))
    return InferenceInput(model=model, context=context, **fields)


async def collect(
    provider: OpenAIResponsesProvider | OpenAIChatProvider, request: InferenceInput
) -> tuple[list[StreamEvent], InferenceOutput]:
    async with provider.stream(request) as stream:
        events = [event async for event in stream]
    last = events[-1]
    assert isinstance(last, OutputCompleted)
    return events[:-1], last.output


async def infer(
    provider: OpenAIResponsesProvider | OpenAIChatProvider,
    request: InferenceInput,
    *,
    streaming: bool,
) -> InferenceOutput:
    if streaming:
        return (await collect(provider, request))[1]
    return await provider.complete(request)


# ================================================================ Responses API

RESPONSE_ID = "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b"


def response_body(
    output: list[dict[str, Any]],
    *,
    status: str = "completed",
    usage: dict[str, Any] | None = None,
    incomplete: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `response` object as the Responses API documents it."""
    return {
        "id": RESPONSE_ID,
        "object": "response",
        "created_at": 1741476542,
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": None,
        "max_output_tokens": None,
        "model": "gpt-4.1-mini-2025-04-14",
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": {},
    }


def usage_body(
    inputs: int = 36, cached: int = 0, outputs: int = 87, reasoning: int = 0
) -> dict[str, Any]:
    return {
        "input_tokens": inputs,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": outputs,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": inputs + outputs,
    }


def message_item(
    text: str | None = None, *, refusal: str | None = None, item_id: str = "msg_1"
) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if text is not None:
        content.append({"type": "output_text", "text": text, "annotations": []})
    if refusal is not None:
        content.append({"type": "refusal", "refusal": refusal})
    return {
        "type": "message",
        "id": item_id,
        "status": "completed",
        "role": "assistant",
        "content": content,
    }


def reasoning_item(*summary: str, encrypted: str | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": s} for s in summary],
    }
    if encrypted is not None:
        item["encrypted_content"] = encrypted
    return item


def call_item(
    call_id: str, name: str, arguments: str, *, item_id: str = "fc_1"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


class TestResponsesRequest:
    async def test_context_and_settings_map_onto_the_request(self) -> None:
        """Instructions, every item type, tools, tool choice, limits, reasoning, schema."""
        context = ModelContext(
            instructions="Be brief.",
            items=[
                UserMessage(content="what is 2+3?"),
                ReasoningItem(content="add them", encrypted_content="gAAAAenc"),
                ReasoningItem(content="not sendable without encrypted content"),
                ModelMessageItem(content="Let me add."),
                FunctionCallItem(
                    call_id="call_1", name="add", arguments='{"a":2,"b":3}'
                ),
                FunctionCallOutputItem(call_id="call_1", output="5"),
                ModelMessageItem(content="", refusal="I can't"),
                ModelMessageItem(content=""),
            ],
        )
        request = InferenceInput(
            model="openai:gpt-5-mini",
            context=context,
            tools=[add, greet],
            tool_choice="add",
            max_output_tokens=256,
            reasoning_effort="low",
            structured_output=Weather,
        )
        async with MockAPI(json_response(response_body([message_item("{}")]))) as api:
            await responses_provider(api).complete(request)

        assert api.requests[0].url.path == "/v1/responses"
        body = api.body
        assert body["input"] == [
            {"role": "user", "content": "what is 2+3?"},
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "add them"}],
                "encrypted_content": "gAAAAenc",
            },
            {"role": "assistant", "content": "Let me add."},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "add",
                "arguments": '{"a":2,"b":3}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "5"},
            {"role": "assistant", "content": "I can't"},
        ]
        assert body["model"] == "gpt-5-mini"
        assert body["instructions"] == "Be brief."
        assert body["store"] is False
        assert body["max_output_tokens"] == 256
        assert body["reasoning"] == {"effort": "low", "summary": "auto"}
        assert body["include"] == ["reasoning.encrypted_content"]
        assert body["tool_choice"] == {"type": "function", "name": "add"}
        add_tool, greet_tool = body["tools"]
        assert add_tool == {
            "type": "function",
            "name": "add",
            "description": "Add two integers.",
            "parameters": ADD_SCHEMA,
            "strict": True,
        }
        # `punctuation` is optional: strict mode would force it, so not strict.
        assert greet_tool["name"] == "greet"
        assert greet_tool["strict"] is False
        text_format = body["text"]["format"]
        assert text_format["type"] == "json_schema"
        assert text_format["name"] == "Weather"
        assert text_format["strict"] is True
        assert text_format["schema"]["additionalProperties"] is False
        assert text_format["schema"]["required"] == ["city", "celsius"]
        assert "stream" not in body

    async def test_plain_request_sends_only_what_is_set(self) -> None:
        """No instructions, tools, limits or reasoning: none of their fields are sent."""
        async with MockAPI(json_response(response_body([message_item("hi")]))) as api:
            await responses_provider(api).complete(make_request())
        assert api.body == {
            "model": "gpt-4.1-mini",
            "input": [{"role": "user", "content": "hi"}],
            "store": False,
        }

    @pytest.mark.parametrize(
        ("choice", "sent"),
        [
            pytest.param("auto", "auto", id="auto"),
            pytest.param("required", "required", id="required"),
            pytest.param("none", "none", id="none"),
            pytest.param("add", {"type": "function", "name": "add"}, id="named"),
        ],
    )
    async def test_tool_choice(self, choice: str, sent: object) -> None:
        """`tool_choice` modes pass through; a tool's name forces that function."""
        async with MockAPI(json_response(response_body([message_item("x")]))) as api:
            await responses_provider(api).complete(
                make_request(tools=[add], tool_choice=choice)
            )
        assert api.body["tool_choice"] == sent

    async def test_dict_schema_is_sent_as_given(self) -> None:
        """A JSON schema dict goes as given; strict only when it already qualifies."""
        loose = {"title": "Answer", "type": "object", "properties": {"x": {}}}
        closed = {
            "type": "object",
            "properties": {"x": {"type": "string"}},
            "required": ["x"],
            "additionalProperties": False,
        }
        answers = [json_response(response_body([message_item("{}")])) for _ in range(2)]
        async with MockAPI(*answers) as api:
            provider = responses_provider(api)
            await provider.complete(make_request(structured_output=loose))
            await provider.complete(make_request(structured_output=closed))
        first, second = (b["text"]["format"] for b in api.bodies)
        assert first == {
            "type": "json_schema",
            "name": "Answer",
            "schema": loose,
            "strict": False,
        }
        assert second == {
            "type": "json_schema",
            "name": "output",
            "schema": closed,
            "strict": True,
        }

    async def test_reasoning_settings_follow_the_provider_options(self) -> None:
        """`store=True` sends no include; `reasoning_summary=None` asks for no summary."""
        async with MockAPI(json_response(response_body([message_item("x")]))) as api:
            provider = responses_provider(api, store=True, reasoning_summary=None)
            await provider.complete(make_request(reasoning_effort="high"))
        assert api.body["reasoning"] == {"effort": "high"}
        assert api.body["store"] is True
        assert "include" not in api.body


class TestResponsesOutput:
    async def test_items_usage_and_raw_response(self) -> None:
        """Reasoning, message and calls map onto items in order, with usage and raw."""
        body = response_body(
            [
                reasoning_item("First I add.", "Then I check.", encrypted="gAAAAxyz"),
                message_item("Adding now."),
                call_item("call_a", "add", '{"a":2,"b":3}', item_id="fc_a"),
                call_item("call_b", "add", '{"a":1,"b":1}', item_id="fc_b"),
            ],
            usage=usage_body(inputs=120, cached=64, outputs=80, reasoning=48),
        )
        async with MockAPI(json_response(body)) as api:
            output = await responses_provider(api).complete(make_request())

        assert output.items == (
            ReasoningItem(
                content="First I add.\n\nThen I check.", encrypted_content="gAAAAxyz"
            ),
            ModelMessageItem(content="Adding now."),
            FunctionCallItem(call_id="call_a", name="add", arguments='{"a":2,"b":3}'),
            FunctionCallItem(call_id="call_b", name="add", arguments='{"a":1,"b":1}'),
        )
        assert output.token_usage == TokenUsage(
            input_tokens=120,
            output_tokens=80,
            reasoning_tokens=48,
            cached_input_tokens=64,
        )
        assert output.finish_reason == "tool_calls"
        raw = raw_of(output)
        assert raw["id"] == RESPONSE_ID
        assert [item["type"] for item in raw["output"]] == [
            "reasoning",
            "message",
            "function_call",
            "function_call",
        ]

    async def test_answer_finishes_with_stop(self) -> None:
        """A message-only response finishes with `stop`."""
        body = response_body([message_item("Hello!")], usage=usage_body())
        async with MockAPI(json_response(body)) as api:
            output = await responses_provider(api).complete(make_request())
        assert output.items == (ModelMessageItem(content="Hello!"),)
        assert output.message == ModelMessageItem(content="Hello!")
        assert output.finish_reason == "stop"

    async def test_refusal(self) -> None:
        """A refusal content part becomes the message's `refusal`."""
        body = response_body([message_item(refusal="I can't help with that.")])
        async with MockAPI(json_response(body)) as api:
            output = await responses_provider(api).complete(make_request())
        assert output.items == (
            ModelMessageItem(content="", refusal="I can't help with that."),
        )

    async def test_cut_by_max_output_tokens_is_length(self) -> None:
        """`incomplete_details.reason == max_output_tokens` maps to `length`."""
        body = response_body(
            [call_item("call_1", "add", '{"a":2,')],
            status="incomplete",
            incomplete={"reason": "max_output_tokens"},
        )
        async with MockAPI(json_response(body)) as api:
            output = await responses_provider(api).complete(make_request())
        assert output.finish_reason == "length"
        assert output.function_calls[0].arguments == '{"a":2,'

    async def test_failed_response_raises(self) -> None:
        """A response with status `failed` raises, retryable for a server error."""
        body = response_body([], status="failed")
        body["error"] = {"code": "server_error", "message": "The server had an error."}
        async with MockAPI(json_response(body)) as api:
            with pytest.raises(ProviderError, match="server had an error") as caught:
                await responses_provider(api).complete(make_request())
        assert caught.value.retryable is True


def seq(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Number the events (`sequence_number`), as the API does."""
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]


def responses_stream_events(final: dict[str, Any]) -> list[dict[str, Any]]:
    """A documented Responses stream: reasoning summary, text, a call in pieces."""
    in_progress = {**final, "status": "in_progress", "output": [], "usage": None}
    call = {**call_item("call_7", "add", ""), "status": "in_progress"}
    arguments = ['{"a"', ": 2", ', "b', '": ', "3}"]
    return seq(
        [
            {"type": "response.created", "response": in_progress},
            {"type": "response.in_progress", "response": in_progress},
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {"type": "reasoning", "id": "rs_1", "summary": []},
            },
            *[
                event
                for index, parts in enumerate([["Add", " them."], ["Check."]])
                for event in [
                    {
                        "type": "response.reasoning_summary_part.added",
                        "item_id": "rs_1",
                        "output_index": 0,
                        "summary_index": index,
                        "part": {"type": "summary_text", "text": ""},
                    },
                    *[
                        {
                            "type": "response.reasoning_summary_text.delta",
                            "item_id": "rs_1",
                            "output_index": 0,
                            "summary_index": index,
                            "delta": part,
                        }
                        for part in parts
                    ],
                    {
                        "type": "response.reasoning_summary_text.done",
                        "item_id": "rs_1",
                        "output_index": 0,
                        "summary_index": index,
                        "text": "".join(parts),
                    },
                ]
            ],
            {
                "type": "response.output_item.done",
                "output_index": 0,
                "item": final["output"][0],
            },
            {
                "type": "response.output_item.added",
                "output_index": 1,
                "item": {**message_item(), "status": "in_progress"},
            },
            {
                "type": "response.content_part.added",
                "item_id": "msg_1",
                "output_index": 1,
                "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []},
            },
            *[
                {
                    "type": "response.output_text.delta",
                    "item_id": "msg_1",
                    "output_index": 1,
                    "content_index": 0,
                    "delta": piece,
                    "logprobs": [],
                }
                for piece in ["Let", " me", " add."]
            ],
            {
                "type": "response.output_text.done",
                "item_id": "msg_1",
                "output_index": 1,
                "content_index": 0,
                "text": "Let me add.",
                "logprobs": [],
            },
            {
                "type": "response.output_item.done",
                "output_index": 1,
                "item": final["output"][1],
            },
            {"type": "response.output_item.added", "output_index": 2, "item": call},
            *[
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": "fc_1",
                    "output_index": 2,
                    "delta": piece,
                }
                for piece in arguments
            ],
            {
                "type": "response.function_call_arguments.done",
                "item_id": "fc_1",
                "output_index": 2,
                "arguments": "".join(arguments),
            },
            {
                "type": "response.output_item.done",
                "output_index": 2,
                "item": final["output"][2],
            },
            {"type": "response.completed", "response": final},
        ]
    )


class TestResponsesStreaming:
    async def test_deltas_and_completed_output(self) -> None:
        """Summary, text and argument deltas stream in order; the output is assembled."""
        final = response_body(
            [
                reasoning_item("Add them.", "Check.", encrypted="gAAAAenc"),
                message_item("Let me add."),
                call_item("call_7", "add", '{"a": 2, "b": 3}'),
            ],
            usage=usage_body(inputs=50, cached=10, outputs=30, reasoning=12),
        )
        async with MockAPI(sse_response(responses_stream_events(final))) as api:
            deltas, output = await collect(
                responses_provider(api), make_request(tools=[add])
            )

        assert api.body["stream"] is True
        assert deltas == [
            ReasoningDelta(text="Add"),
            ReasoningDelta(text=" them."),
            ReasoningDelta(text="\n\n"),
            ReasoningDelta(text="Check."),
            TextDelta(text="Let"),
            TextDelta(text=" me"),
            TextDelta(text=" add."),
            ToolCallDelta(index=0, call_id="call_7", name="add"),
            ToolCallDelta(index=0, arguments='{"a"'),
            ToolCallDelta(index=0, arguments=": 2"),
            ToolCallDelta(index=0, arguments=', "b'),
            ToolCallDelta(index=0, arguments='": '),
            ToolCallDelta(index=0, arguments="3}"),
        ]
        reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
        assert output.items == (
            ReasoningItem(content=reasoning, encrypted_content="gAAAAenc"),
            ModelMessageItem(content="Let me add."),
            FunctionCallItem(
                call_id="call_7", name="add", arguments='{"a": 2, "b": 3}'
            ),
        )
        assert output.token_usage == TokenUsage(
            input_tokens=50,
            output_tokens=30,
            reasoning_tokens=12,
            cached_input_tokens=10,
        )
        assert output.finish_reason == "tool_calls"
        assert raw_of(output)["status"] == "completed"

    async def test_streamed_and_whole_outputs_agree(self) -> None:
        """The streamed output equals the non-streamed one for the same response."""
        final = response_body(
            [
                reasoning_item("Add them.", "Check.", encrypted="gAAAAenc"),
                message_item("Let me add."),
                call_item("call_7", "add", '{"a": 2, "b": 3}'),
            ],
            usage=usage_body(),
        )
        answers = [sse_response(responses_stream_events(final)), json_response(final)]
        async with MockAPI(*answers) as api:
            provider = responses_provider(api)
            _, streamed = await collect(provider, make_request())
            whole = await provider.complete(make_request())
        assert streamed == whole

    async def test_items_only_in_done_events(self) -> None:
        """A `response.completed` without output falls back on the items' done events."""
        events = seq(
            [
                {
                    "type": "response.output_item.done",
                    "output_index": 0,
                    "item": message_item("hi"),
                },
                {"type": "response.completed", "response": response_body([])},
            ]
        )
        async with MockAPI(sse_response(events)) as api:
            _, output = await collect(responses_provider(api), make_request())
        assert output.items == (ModelMessageItem(content="hi"),)

    async def test_incomplete_stream_is_length(self) -> None:
        """`response.incomplete` for max_output_tokens completes with `length`."""
        final = response_body(
            [message_item("Once upon")],
            status="incomplete",
            incomplete={"reason": "max_output_tokens"},
        )
        events = seq([{"type": "response.incomplete", "response": final}])
        async with MockAPI(sse_response(events)) as api:
            _, output = await collect(responses_provider(api), make_request())
        assert output.finish_reason == "length"

    async def test_failed_event_raises(self) -> None:
        """`response.failed` raises with the response's error."""
        failed = response_body([], status="failed")
        failed["error"] = {"code": "rate_limit_exceeded", "message": "Slow down."}
        events = seq([{"type": "response.failed", "response": failed}])
        async with MockAPI(sse_response(events)) as api:
            with pytest.raises(ProviderError, match="Slow down") as caught:
                await collect(responses_provider(api), make_request())
        assert caught.value.retryable is True

    async def test_error_event_raises(self) -> None:
        """An `error` event raises a ProviderError with its message."""
        events = seq(
            [
                {
                    "type": "error",
                    "code": "invalid_prompt",
                    "message": "Invalid prompt.",
                    "param": None,
                }
            ]
        )
        async with MockAPI(sse_response(events)) as api:
            with pytest.raises(ProviderError, match="Invalid prompt") as caught:
                await collect(responses_provider(api), make_request())
        assert caught.value.retryable is False

    async def test_stream_without_completion_raises(self) -> None:
        """A stream that ends before `response.completed` raises."""
        events = seq(
            [
                {
                    "type": "response.created",
                    "response": response_body([], status="queued"),
                }
            ]
        )
        async with MockAPI(sse_response(events)) as api:
            with pytest.raises(ProviderError, match=r"before response\.completed"):
                await collect(responses_provider(api), make_request())


# ============================================================= Chat Completions


def completion_body(
    message: dict[str, Any],
    finish_reason: str = "stop",
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `chat.completion` object as Chat Completions documents it."""
    return {
        "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
        "object": "chat.completion",
        "created": 1741570283,
        "model": "gpt-4o-2024-08-06",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "refusal": None, **message},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
        "service_tier": "default",
        "system_fingerprint": "fp_fc9f1d7035",
    }


def chat_usage(
    prompt: int = 19, completion: int = 10, cached: int = 0, reasoning: int = 0
) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": reasoning,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def chunk(
    delta: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    *,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `chat.completion.chunk`; without a delta, the usage-only last chunk."""
    choices = (
        []
        if delta is None
        else [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ]
    )
    return {
        "id": "chatcmpl-123",
        "object": "chat.completion.chunk",
        "created": 1694268190,
        "model": "gpt-4o-mini",
        "system_fingerprint": "fp_44709d6fcb",
        "choices": choices,
        "usage": usage,
    }


def tool_chunk(index: int, **fields: Any) -> dict[str, Any]:
    """A chunk with one tool-call fragment: `id`, `name`, `arguments` as given."""
    call: dict[str, Any] = {"index": index}
    if "id" in fields:
        call["id"] = fields["id"]
        call["type"] = "function"
    function = {k: fields[k] for k in ("name", "arguments") if k in fields}
    if function:
        call["function"] = function
    return chunk({"tool_calls": [call]})


class TestChatRequest:
    async def test_context_and_settings_map_onto_messages(self) -> None:
        """System first, a turn's text and calls in one assistant message, tool outputs."""
        context = ModelContext(
            instructions="Be brief.",
            items=[
                UserMessage(content="add 2+3 and 1+1"),
                ReasoningItem(content="two calls"),
                ModelMessageItem(content="Adding both."),
                FunctionCallItem(call_id="c1", name="add", arguments='{"a":2,"b":3}'),
                FunctionCallItem(call_id="c2", name="add", arguments='{"a":1,"b":1}'),
                FunctionCallOutputItem(call_id="c1", output="5"),
                FunctionCallOutputItem(call_id="c2", output="boom", is_error=True),
                FunctionCallItem(call_id="c3", name="add", arguments='{"a":1,"b":1}'),
                FunctionCallOutputItem(call_id="c3", output="2"),
                ModelMessageItem(content="5 and 2"),
                UserMessage(content="thanks"),
            ],
        )
        request = InferenceInput(
            model="openai-chat:qwen2.5:7b",
            context=context,
            tools=[add, greet],
            tool_choice="required",
            max_output_tokens=64,
            reasoning_effort="medium",
            structured_output=Weather,
            structured_output_mode="native",
        )
        body = completion_body({"content": '{"city": "Oslo", "celsius": 3}'})
        async with MockAPI(json_response(body)) as api:
            await chat_provider(api).complete(request)

        sent = api.body
        assert api.requests[0].url.path == "/v1/chat/completions"
        assert sent["model"] == "qwen2.5:7b"
        assert sent["messages"] == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "add 2+3 and 1+1"},
            {
                "role": "assistant",
                "content": "Adding both.",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
                    },
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a":1,"b":1}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
            {"role": "tool", "tool_call_id": "c2", "content": "boom"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c3",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a":1,"b":1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c3", "content": "2"},
            {"role": "assistant", "content": "5 and 2"},
            {"role": "user", "content": "thanks"},
        ]
        # Not OpenAI's host: the field every compatible server knows.
        assert sent["max_tokens"] == 64
        assert "max_completion_tokens" not in sent
        assert sent["reasoning_effort"] == "medium"
        assert sent["tool_choice"] == "required"
        assert sent["tools"] == [
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "description": "Add two integers.",
                    "parameters": ADD_SCHEMA,
                    "strict": True,
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "greet",
                    "description": "Greet someone.",
                    "parameters": greet.definition.parameters,
                },
            },
        ]
        response_format = sent["response_format"]
        assert response_format["type"] == "json_schema"
        assert response_format["json_schema"]["name"] == "Weather"
        assert response_format["json_schema"]["strict"] is True
        assert response_format["json_schema"]["schema"]["required"] == [
            "city",
            "celsius",
        ]

    async def test_named_tool_choice(self) -> None:
        """A tool's name forces that function."""
        body = completion_body({"content": "ok"})
        async with MockAPI(json_response(body)) as api:
            await chat_provider(api).complete(
                make_request("openai-chat:m", tools=[add], tool_choice="add")
            )
        assert api.body["tool_choice"] == {
            "type": "function",
            "function": {"name": "add"},
        }

    async def test_openai_host_gets_max_completion_tokens(self) -> None:
        """On api.openai.com, `max_output_tokens` is `max_completion_tokens`."""
        body = completion_body({"content": "ok"})
        async with MockAPI(json_response(body)) as api:
            client = AsyncOpenAI(api_key="sk-test", http_client=api.http, max_retries=0)
            provider = OpenAIChatProvider(client=client)
            await provider.complete(make_request(max_output_tokens=10))
        assert api.body["max_completion_tokens"] == 10
        assert "max_tokens" not in api.body

    async def test_streaming_asks_for_usage(self) -> None:
        """Streaming requests ask for the usage chunk."""
        events = [chunk({"role": "assistant", "content": "hi"}, "stop")]
        async with MockAPI(sse_response(events, named=False, done=True)) as api:
            await collect(chat_provider(api), make_request("openai-chat:m"))
        assert api.body["stream"] is True
        assert api.body["stream_options"] == {"include_usage": True}

    async def test_an_agent_names_the_model_of_its_provider_object(self) -> None:
        """`Agent("llama3:8b", provider=obj)` sends that model name, colon and all
        (not the agent's name)."""
        body = completion_body({"content": "Paris."})
        async with MockAPI(json_response(body)) as api:
            agent = Agent("llama3:8b", provider=chat_provider(api), name="geo")
            result = await agent.run("The capital of France?")
        assert result.outcome is Outcome.answered, result
        assert api.body["model"] == "llama3:8b"


class TestChatOutput:
    async def test_message_calls_and_usage(self) -> None:
        """Content beside tool calls, then the calls; usage with its details."""
        body = completion_body(
            {
                "content": "Let me add.",
                "tool_calls": [
                    {
                        "id": "call_abc",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
                    }
                ],
            },
            finish_reason="tool_calls",
            usage=chat_usage(prompt=82, completion=17, cached=64, reasoning=5),
        )
        async with MockAPI(json_response(body)) as api:
            output = await chat_provider(api).complete(make_request("openai-chat:m"))
        assert output.items == (
            ModelMessageItem(content="Let me add."),
            FunctionCallItem(call_id="call_abc", name="add", arguments='{"a":2,"b":3}'),
        )
        assert output.token_usage == TokenUsage(
            input_tokens=82,
            output_tokens=17,
            reasoning_tokens=5,
            cached_input_tokens=64,
        )
        assert output.finish_reason == "tool_calls"
        assert raw_of(output)["id"] == "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG"

    async def test_calls_without_content_have_no_message(self) -> None:
        """`content: null` beside tool calls adds no message item."""
        body = completion_body(
            {
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": "{}"},
                    }
                ],
            },
            finish_reason="tool_calls",
        )
        async with MockAPI(json_response(body)) as api:
            output = await chat_provider(api).complete(make_request("openai-chat:m"))
        assert output.items == (
            FunctionCallItem(call_id="call_1", name="add", arguments="{}"),
        )

    async def test_refusal(self) -> None:
        """`message.refusal` becomes the message's `refusal`."""
        body = completion_body({"content": None, "refusal": "I can't help with that."})
        async with MockAPI(json_response(body)) as api:
            output = await chat_provider(api).complete(make_request("openai-chat:m"))
        assert output.items == (
            ModelMessageItem(content="", refusal="I can't help with that."),
        )

    async def test_reasoning_content_of_compatible_servers(self) -> None:
        """`reasoning_content` (vLLM, llama.cpp, DeepSeek) becomes a ReasoningItem."""
        body = completion_body({"content": "5", "reasoning_content": "2+3 is 5"})
        async with MockAPI(json_response(body)) as api:
            output = await chat_provider(api).complete(make_request("openai-chat:m"))
        assert output.items == (
            ReasoningItem(content="2+3 is 5"),
            ModelMessageItem(content="5"),
        )

    async def test_length(self) -> None:
        """`finish_reason: length` passes through (the loop refuses cut calls)."""
        body = completion_body({"content": "Once upon a"}, finish_reason="length")
        async with MockAPI(json_response(body)) as api:
            output = await chat_provider(api).complete(make_request("openai-chat:m"))
        assert output.finish_reason == "length"


class TestChatStreaming:
    async def test_tool_calls_split_across_chunks(self) -> None:
        """Ids and names are set once (even when repeated), arguments appended."""
        events = [
            chunk({"role": "assistant", "content": None}),
            chunk({"reasoning_content": "Two sums."}),
            chunk({"content": "Adding"}),
            chunk({"content": " both."}),
            tool_chunk(0, id="call_a", name="add", arguments=""),
            tool_chunk(0, arguments='{"a"'),
            # Some servers repeat the id and name on every chunk: set, not appended.
            tool_chunk(0, id="call_a", name="add", arguments=": 2, "),
            tool_chunk(0, arguments='"b": 3}'),
            tool_chunk(1, id="call_b", name="add"),
            tool_chunk(1, arguments='{"a": 1,'),
            tool_chunk(1, arguments=' "b": 1}'),
            chunk({}, "tool_calls"),
            chunk(usage=chat_usage(prompt=40, completion=25, cached=8, reasoning=3)),
        ]
        async with MockAPI(sse_response(events, named=False, done=True)) as api:
            deltas, output = await collect(
                chat_provider(api), make_request("openai-chat:m", tools=[add])
            )

        assert deltas == [
            ReasoningDelta(text="Two sums."),
            TextDelta(text="Adding"),
            TextDelta(text=" both."),
            ToolCallDelta(index=0, call_id="call_a", name="add"),
            ToolCallDelta(index=0, arguments='{"a"'),
            ToolCallDelta(index=0, arguments=": 2, "),
            ToolCallDelta(index=0, arguments='"b": 3}'),
            ToolCallDelta(index=1, call_id="call_b", name="add"),
            ToolCallDelta(index=1, arguments='{"a": 1,'),
            ToolCallDelta(index=1, arguments=' "b": 1}'),
            # The usage chunk, as it comes: kept if the stream were cut after it.
            UsageUpdate(
                usage=TokenUsage(
                    input_tokens=40,
                    output_tokens=25,
                    reasoning_tokens=3,
                    cached_input_tokens=8,
                )
            ),
        ]
        assert output.items == (
            ReasoningItem(content="Two sums."),
            ModelMessageItem(content="Adding both."),
            FunctionCallItem(
                call_id="call_a", name="add", arguments='{"a": 2, "b": 3}'
            ),
            FunctionCallItem(
                call_id="call_b", name="add", arguments='{"a": 1, "b": 1}'
            ),
        )
        assert output.token_usage == TokenUsage(
            input_tokens=40, output_tokens=25, reasoning_tokens=3, cached_input_tokens=8
        )
        assert output.finish_reason == "tool_calls"
        raw = raw_of(output)
        assert raw["id"] == "chatcmpl-123"
        assert raw["object"] == "chat.completion"
        assert raw["choices"][0]["finish_reason"] == "tool_calls"
        assert raw["choices"][0]["message"]["tool_calls"][1] == {
            "id": "call_b",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'},
        }
        assert raw["usage"]["prompt_tokens"] == 40

    async def test_new_id_at_a_used_index_starts_a_new_call(self) -> None:
        """Servers that number every call 0 still give two calls, by their ids."""
        events = [
            tool_chunk(0, id="call_1", name="add", arguments='{"a":1,"b":1}'),
            tool_chunk(0, id="call_2", name="greet", arguments='{"name":"Ada"}'),
            chunk({}, "tool_calls"),
        ]
        async with MockAPI(sse_response(events, named=False, done=True)) as api:
            deltas, output = await collect(
                chat_provider(api), make_request("openai-chat:m")
            )
        assert [d.index for d in deltas if isinstance(d, ToolCallDelta)] == [0, 1]
        assert output.items == (
            FunctionCallItem(call_id="call_1", name="add", arguments='{"a":1,"b":1}'),
            FunctionCallItem(
                call_id="call_2", name="greet", arguments='{"name":"Ada"}'
            ),
        )

    async def test_refusal_and_length(self) -> None:
        """Refusal deltas assemble into `refusal`; `length` is kept."""
        events = [
            chunk({"role": "assistant", "refusal": "I can't"}),
            chunk({"refusal": " do that."}, "length"),
        ]
        async with MockAPI(sse_response(events, named=False, done=True)) as api:
            deltas, output = await collect(
                chat_provider(api), make_request("openai-chat:m")
            )
        assert deltas == []
        assert output.items == (
            ModelMessageItem(content="", refusal="I can't do that."),
        )
        assert output.finish_reason == "length"
        assert output.token_usage is None

    async def test_error_inside_the_stream(self) -> None:
        """An `error` payload inside the stream raises, with its message."""
        events = [
            chunk({"content": "Hel"}),
            {"error": {"message": "model overloaded", "type": "server_error"}},
        ]
        async with MockAPI(sse_response(events, named=False)) as api:
            with pytest.raises(ProviderError, match="model overloaded") as caught:
                await collect(chat_provider(api), make_request("openai-chat:m"))
        assert caught.value.retryable is True


# ======================================================================= errors

Factory = type[OpenAIResponsesProvider] | type[OpenAIChatProvider]
PROVIDERS = [
    pytest.param(OpenAIResponsesProvider, id="responses"),
    pytest.param(OpenAIChatProvider, id="chat"),
]


def provider_of(
    kind: Factory, api: MockAPI
) -> OpenAIResponsesProvider | OpenAIChatProvider:
    return (
        responses_provider(api)
        if kind is OpenAIResponsesProvider
        else chat_provider(api)
    )


def error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


@pytest.mark.parametrize("kind", PROVIDERS)
class TestErrors:
    @pytest.mark.parametrize(
        ("status", "body", "retryable", "text"),
        [
            pytest.param(
                429,
                error_body(
                    "Rate limit reached for gpt-4.1-mini.",
                    "requests",
                    "rate_limit_exceeded",
                ),
                True,
                "Rate limit reached",
                id="429",
            ),
            pytest.param(
                500,
                error_body("The server had an error.", "server_error"),
                True,
                "server had an error",
                id="500",
            ),
            pytest.param(
                503,
                error_body("The engine is currently overloaded.", "server_error"),
                True,
                "overloaded",
                id="503",
            ),
            pytest.param(
                400,
                error_body("Invalid value for 'tool_choice'.", "invalid_request_error"),
                False,
                "Invalid value for 'tool_choice'",
                id="400",
            ),
            pytest.param(
                401,
                error_body("Incorrect API key provided.", "invalid_request_error"),
                False,
                "Incorrect API key",
                id="401",
            ),
            pytest.param(
                404,
                error_body("The model `nope` does not exist.", "invalid_request_error"),
                False,
                "does not exist",
                id="404",
            ),
        ],
    )
    @pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
    async def test_http_errors(
        self,
        kind: Factory,
        status: int,
        body: dict[str, Any],
        retryable: bool,
        text: str,
        streaming: bool,
    ) -> None:
        """HTTP errors carry the API's message and status; transient ones are retryable."""
        async with MockAPI(json_response(body, status)) as api:
            provider = provider_of(kind, api)
            with pytest.raises(ProviderError, match=text) as caught:
                await infer(provider, make_request(), streaming=streaming)
        error = caught.value
        assert error.retryable is retryable
        assert error.status_code == status
        assert f"HTTP {status}" in str(error)
        assert not isinstance(error, ProviderTimeout)

    async def test_timeout(self, kind: Factory) -> None:
        """A timeout raises ProviderTimeout (retryable)."""

        def timeout(request: httpx2.Request) -> httpx2.Response:
            raise httpx2.ReadTimeout("timed out", request=request)

        async with MockAPI(timeout) as api:
            with pytest.raises(ProviderTimeout) as caught:
                await provider_of(kind, api).complete(make_request())
        assert caught.value.retryable is True

    async def test_connection_error(self, kind: Factory) -> None:
        """A connection failure is a retryable ProviderError."""

        def refuse(request: httpx2.Request) -> httpx2.Response:
            raise httpx2.ConnectError("connection refused", request=request)

        async with MockAPI(refuse) as api:
            with pytest.raises(ProviderError, match="connection refused") as caught:
                await provider_of(kind, api).complete(make_request())
        assert caught.value.retryable is True
        assert caught.value.status_code is None


# ================================================================ cancellation


@pytest.mark.parametrize("kind", PROVIDERS)
async def test_cancelled_stream_closes_the_response(kind: Factory) -> None:
    """Cancelling a loop mid-stream closes the HTTP response and propagates."""
    if kind is OpenAIResponsesProvider:
        first: dict[str, Any] = {
            "type": "response.output_text.delta",
            "item_id": "msg_1",
            "output_index": 0,
            "content_index": 0,
            "delta": "Once",
            "logprobs": [],
            "sequence_number": 0,
        }
        answer = hanging_sse([first])
    else:
        answer = hanging_sse([chunk({"content": "Once"})], named=False)
    async with MockAPI(answer) as api:
        provider = provider_of(kind, api)
        with anyio.CancelScope() as scope:
            async with provider.stream(make_request()) as stream:
                assert await anext(stream) == TextDelta(text="Once")
                scope.cancel()
                await anext(stream)  # waits on the body: cancelled
        assert scope.cancelled_caught
        assert api.responses[0].is_closed


async def test_stream_closed_early_closes_the_response() -> None:
    """Leaving the stream after one delta closes the HTTP response."""
    events = [chunk({"content": "a"}), chunk({"content": "b"}), chunk({}, "stop")]
    async with MockAPI(sse_response(events, named=False, done=True)) as api:
        async with chat_provider(api).stream(make_request()) as stream:
            assert await anext(stream) == TextDelta(text="a")
        assert api.responses[0].is_closed


# ================================================================ configuration


def test_key_and_url_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without arguments, `OPENAI_API_KEY` and `OPENAI_BASE_URL` configure the client."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9999/v1")
    provider = OpenAIChatProvider()
    assert provider.client.api_key == "sk-env"
    assert str(provider.client.base_url) == "http://127.0.0.1:9999/v1/"
    assert provider.client.max_retries == 0


def test_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """`api_key=` and `base_url=` take precedence over the environment."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    provider = OpenAIResponsesProvider(api_key="sk-arg", base_url="http://h:1/v1")
    assert provider.client.api_key == "sk-arg"
    assert provider.client.base_url.host == "h"


def test_compatible_server_needs_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a base URL and no key, a placeholder key is sent (local servers take any)."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    provider = OpenAIChatProvider(base_url="http://127.0.0.1:8080/v1")
    assert provider.client.api_key == "EMPTY"


def test_openai_without_key_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No key and no base URL: a ConfigurationError that says what to set."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ConfigurationError, match="OPENAI_API_KEY"):
        OpenAIResponsesProvider()


def test_client_excludes_key_and_url() -> None:
    """A ready client and `api_key=` together are refused."""
    with pytest.raises(ConfigurationError, match="not both"):
        OpenAIChatProvider(client=AsyncOpenAI(api_key="k"), api_key="k")


async def test_provider_closes_the_client_it_made() -> None:
    """`async with` closes a client the provider created, not one it was given."""
    async with OpenAIChatProvider(base_url="http://127.0.0.1:1/v1") as provider:
        client = provider.client
    assert client.is_closed()
    given = AsyncOpenAI(api_key="k")
    async with OpenAIChatProvider(client=given):
        pass
    assert not given.is_closed()
    await given.close()


# ========================================================================= loops


def responses_turns() -> list[httpx2.Response]:
    return [
        json_response(
            response_body(
                [call_item("call_1", "add", '{"a":2,"b":3}')],
                usage=usage_body(20, 0, 5),
            )
        ),
        json_response(response_body([message_item("5")], usage=usage_body(30, 0, 1))),
    ]


def responses_stream_turns() -> list[httpx2.Response]:
    call = call_item("call_1", "add", '{"a":2,"b":3}')
    first = seq(
        [
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": {**call, "arguments": "", "status": "in_progress"},
            },
            *[
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": "fc_1",
                    "output_index": 0,
                    "delta": piece,
                }
                for piece in ['{"a":', "2,", '"b":3}']
            ],
            {"type": "response.output_item.done", "output_index": 0, "item": call},
            {
                "type": "response.completed",
                "response": response_body([call], usage=usage_body(20, 0, 5)),
            },
        ]
    )
    second = seq(
        [
            {
                "type": "response.output_text.delta",
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": "5",
                "logprobs": [],
            },
            {
                "type": "response.completed",
                "response": response_body(
                    [message_item("5")], usage=usage_body(30, 0, 1)
                ),
            },
        ]
    )
    return [sse_response(first), sse_response(second)]


def chat_turns() -> list[httpx2.Response]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a":2,"b":3}'},
    }
    return [
        json_response(
            completion_body(
                {"content": None, "tool_calls": [call]},
                "tool_calls",
                chat_usage(20, 5),
            )
        ),
        json_response(completion_body({"content": "5"}, "stop", chat_usage(30, 1))),
    ]


def chat_stream_turns() -> list[httpx2.Response]:
    first = [
        chunk({"role": "assistant", "content": None}),
        tool_chunk(0, id="call_1", name="add", arguments=""),
        tool_chunk(0, arguments='{"a":2,'),
        tool_chunk(0, arguments='"b":3}'),
        chunk({}, "tool_calls"),
        chunk(usage=chat_usage(20, 5)),
    ]
    second = [
        chunk({"role": "assistant", "content": "5"}),
        chunk({}, "stop"),
        chunk(usage=chat_usage(30, 1)),
    ]
    return [
        sse_response(first, named=False, done=True),
        sse_response(second, named=False, done=True),
    ]


def inputs_of(kind: str, body: dict[str, Any]) -> list[Any]:
    items = body["input"] if kind == "openai" else body["messages"]
    assert isinstance(items, list)
    return items


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
@pytest.mark.parametrize("prefix", ["openai", "openai-chat"])
async def test_loop_with_a_tool_call(prefix: str, streaming: bool) -> None:
    """A whole loop through the SDK: call `add`, answer, the context and the totals."""
    if prefix == "openai":
        answers = responses_stream_turns() if streaming else responses_turns()
    else:
        answers = chat_stream_turns() if streaming else chat_turns()
    async with MockAPI(*answers) as api:
        provider = responses_provider(api) if prefix == "openai" else chat_provider(api)
        inference_input = InferenceInput(
            model=f"{prefix}:gpt-4.1-mini",
            context=ModelContext(instructions="Use the tools."),
            tools=[add],
            tool_choice="auto",
            streaming=streaming,
        )
        async with Runtime(providers={prefix: provider}) as runtime:
            loop_id = runtime.run_loop("agent", "what is 2+3?", inference_input)
            result = await runtime.wait(loop_id)

    infer = "inference_streaming" if streaming else "inference"
    assert_path(
        result, f"idle context_update {infer} function_call {infer} model_message idle"
    )
    assert result.outcome is Outcome.answered
    assert result.answer == ModelMessageItem(content="5")
    assert result.usage == TokenUsage(input_tokens=50, output_tokens=6)
    assert inference_input.context.items == [
        UserMessage(content="what is 2+3?"),
        FunctionCallItem(call_id="call_1", name="add", arguments='{"a":2,"b":3}'),
        FunctionCallOutputItem(call_id="call_1", output="5"),
        ModelMessageItem(content="5"),
    ]
    first, second = api.bodies
    assert len(inputs_of(prefix, first)) < len(inputs_of(prefix, second))
    sent = json.dumps(inputs_of(prefix, second))
    assert '"call_1"' in sent
    assert '"5"' in sent


async def test_loop_retries_a_rate_limit() -> None:
    """A 429 is retried by the loop, and the retry answers."""
    limited = json_response(error_body("Rate limit reached.", "requests"), 429)
    answer = json_response(response_body([message_item("hi")]))
    async with MockAPI(limited, answer) as api:
        inference_input = InferenceInput(
            model="openai:gpt-4.1-mini", context=ModelContext()
        )
        async with Runtime(providers={"openai": responses_provider(api)}) as runtime:
            loop_id = runtime.run_loop(
                "agent", "hello", inference_input, retry_backoff=0.001
            )
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.answered
    assert len(api.requests) == 2


# ======================================================= structured output modes

WEATHER = Weather.model_json_schema()
WEATHER_ARGS = '{"city": "Oslo", "celsius": 3}'


def final_call(
    arguments: str = WEATHER_ARGS, *, call_id: str = "call_f"
) -> dict[str, Any]:
    """A Chat Completions message calling the final answer tool."""
    return {
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "final_result", "arguments": arguments},
            }
        ],
    }


def openai_chat_provider(api: MockAPI) -> OpenAIChatProvider:
    """A chat provider on OpenAI's own host (native structured output first)."""
    client = AsyncOpenAI(api_key="sk-test", http_client=api.http, max_retries=0)
    return OpenAIChatProvider(client=client)


def refused_json_schema() -> httpx2.Response:
    """llama.cpp's server refusing `response_format: json_schema` (a 500)."""
    message = (
        "1 validation error:\n  {'type': 'literal_error', 'loc': ('body', "
        "'response_format', 'type'), 'msg': \"Input should be 'text' or "
        "'json_object'\", 'input': 'json_schema'}\n\n" + "  File ...\n" * 60
    )
    return json_response(error_body(message, "internal_server_error"), 500)


def openai_refused_json_schema() -> httpx2.Response:
    """OpenAI's API refusing `response_format: json_schema` for a model (a 400)."""
    message = (
        "Invalid parameter: 'response_format' of type 'json_schema' is not "
        "supported with this model."
    )
    return json_response(error_body(message, "invalid_request_error"), 400)


def error_of(status: int, message: str, kind: str = "server_error") -> httpx2.Response:
    return json_response(error_body(message, kind), status)


def modes_sent(bodies: list[dict[str, Any]]) -> list[str]:
    """The structured output mode of each Chat Completions body sent."""
    sent = []
    for body in bodies:
        names = [t["function"]["name"] for t in body.get("tools", [])]
        kind = body.get("response_format", {}).get("type")
        if "final_result" in names:
            sent.append("tool")
        else:
            sent.append({"json_schema": "native", "json_object": "prompted"}[kind])
    return sent


class Other(BaseModel):
    n: int


class TestChatStructuredModes:
    async def test_auto_on_a_compatible_server_is_the_final_tool(self) -> None:
        """No other tool: the final tool is forced by name; its call is the answer."""
        request = make_request("openai-chat:smollm2", structured_output=Weather)
        body = completion_body(final_call(), finish_reason="tool_calls")
        async with MockAPI(json_response(body)) as api:
            output = await chat_provider(api).complete(request)
        sent = api.body
        assert sent["tools"] == [
            {
                "type": "function",
                "function": {
                    "name": "final_result",
                    "description": "Give your final answer by calling this tool: "
                    "its arguments are the answer.",
                    "parameters": WEATHER,
                },
            }
        ]
        assert sent["tool_choice"] == {
            "type": "function",
            "function": {"name": "final_result"},
        }
        assert "response_format" not in sent
        assert output.items == (ModelMessageItem(content=WEATHER_ARGS),)
        assert output.finish_reason == "stop"
        assert output.structured_output_mode == "tool"

    @pytest.mark.parametrize(
        ("choice", "sent"),
        [
            pytest.param(None, "required", id="none-given"),
            pytest.param("auto", "required", id="auto"),
            pytest.param("required", "required", id="required"),
            pytest.param(
                "none",
                {"type": "function", "function": {"name": "final_result"}},
                id="none",
            ),
            pytest.param(
                "add", {"type": "function", "function": {"name": "add"}}, id="forced"
            ),
        ],
    )
    async def test_tool_choice_beside_other_tools(
        self, choice: str | None, sent: object
    ) -> None:
        """A tool must be called; `none` leaves only the answer; a forced tool stays."""
        request = make_request(
            "openai-chat:m",
            tools=[add],
            tool_choice=choice,
            structured_output=Weather,
            structured_output_mode="tool",
        )
        body = completion_body(final_call(), finish_reason="tool_calls")
        async with MockAPI(json_response(body)) as api:
            await chat_provider(api).complete(request)
        assert [t["function"]["name"] for t in api.body["tools"]] == [
            "add",
            "final_result",
        ]
        assert api.body["tool_choice"] == sent

    async def test_final_tool_name_avoids_a_tool_of_that_name(self) -> None:
        """A user tool called `final_result` keeps its name; the answer tool moves."""

        @tool(name="final_result")
        def mine(x: int) -> int:
            """Not the answer."""
            return x

        request = make_request("openai-chat:m", tools=[mine], structured_output=Weather)
        message = final_call()
        message["tool_calls"][0]["function"]["name"] = "final_result_2"
        async with MockAPI(json_response(completion_body(message))) as api:
            output = await chat_provider(api).complete(request)
        names = [t["function"]["name"] for t in api.body["tools"]]
        assert names == ["final_result", "final_result_2"]
        assert output.message == ModelMessageItem(content=WEATHER_ARGS)

    async def test_a_schema_that_is_no_object_is_wrapped(self) -> None:
        """Tool parameters are an object: the schema is its `response`, unwrapped after."""
        schema = {
            "type": "array",
            "items": {"$ref": "#/$defs/n"},
            "$defs": {"n": {"type": "integer"}},
        }
        request = make_request("openai-chat:m", structured_output=schema)
        body = completion_body(final_call('{"response": [1, 2]}'))
        async with MockAPI(json_response(body)) as api:
            output = await chat_provider(api).complete(request)
        assert api.body["tools"][0]["function"]["parameters"] == {
            "type": "object",
            "properties": {
                "response": {"type": "array", "items": {"$ref": "#/$defs/n"}}
            },
            "required": ["response"],
            "additionalProperties": False,
            "$defs": {"n": {"type": "integer"}},
        }
        assert output.message == ModelMessageItem(content="[1,2]")

    async def test_final_call_beside_a_real_call_is_dropped(self) -> None:
        """The real call runs first: the model answers once it has seen its output."""
        message = final_call()
        message["tool_calls"].insert(
            0,
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a":1,"b":2}'},
            },
        )
        request = make_request("openai-chat:m", tools=[add], structured_output=Weather)
        body = completion_body(message, finish_reason="tool_calls")
        async with MockAPI(json_response(body)) as api:
            output = await chat_provider(api).complete(request)
        assert output.items == (
            FunctionCallItem(call_id="call_a", name="add", arguments='{"a":1,"b":2}'),
        )
        assert output.finish_reason == "tool_calls"

    async def test_a_final_call_beside_another_tool_is_not_streamed(self) -> None:
        """The answer is dropped beside another call, so none of its text is
        streamed (it was, chunk by chunk); the other call is renumbered."""
        chunks = [
            chunk({"role": "assistant", "content": None}),
            tool_chunk(0, id="call_f", name="final_result", arguments=""),
            tool_chunk(0, arguments='{"city": "Oslo", '),
            tool_chunk(1, id="call_a", name="add", arguments='{"a":1,"b":2}'),
            tool_chunk(0, arguments='"celsius": 3}'),
            chunk({}, "tool_calls"),
        ]
        request = make_request("openai-chat:m", tools=[add], structured_output=Weather)
        async with MockAPI(sse_response(chunks, named=False, done=True)) as api:
            deltas, output = await collect(chat_provider(api), request)
        assert deltas == [
            ToolCallDelta(
                index=0, call_id="call_a", name="add", arguments='{"a":1,"b":2}'
            ),
        ]
        assert output.message is None
        assert output.function_calls == (
            FunctionCallItem(call_id="call_a", name="add", arguments='{"a":1,"b":2}'),
        )
        assert output.structured_output_mode == "tool"

    @pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
    async def test_of_two_final_calls_the_first_valid_one_is_the_answer(
        self, streaming: bool
    ) -> None:
        """Streamed or not, the same answer (the second call here: the first is
        invalid), and the stream's text is that answer alone (it was both
        documents run together, and the answer the first)."""
        invalid = '{"city": 1}'
        chunks = [
            tool_chunk(0, id="call_1", name="final_result", arguments=invalid),
            tool_chunk(1, id="call_2", name="final_result", arguments=WEATHER_ARGS),
            chunk({}, "tool_calls"),
        ]
        body = completion_body(
            {
                "content": None,
                "tool_calls": [
                    final_call(invalid, call_id="call_1")["tool_calls"][0],
                    final_call(WEATHER_ARGS, call_id="call_2")["tool_calls"][0],
                ],
            },
            finish_reason="tool_calls",
        )
        answer = (
            sse_response(chunks, named=False, done=True)
            if streaming
            else json_response(body)
        )
        request = make_request(
            "openai-chat:m", structured_output=Weather, streaming=streaming
        )
        async with MockAPI(answer) as api:
            provider = chat_provider(api)
            if streaming:
                deltas, output = await collect(provider, request)
                assert deltas == [TextDelta(text=WEATHER_ARGS)]
            else:
                output = await provider.complete(request)
        assert output.items == (ModelMessageItem(content=WEATHER_ARGS),)
        assert output.finish_reason == "stop"

    @pytest.mark.parametrize(
        ("url", "response_format"),
        [
            pytest.param(
                "http://127.0.0.1:8080/v1",
                {"type": "json_object", "schema": WEATHER},
                id="compatible",
            ),
            pytest.param(None, {"type": "json_object"}, id="openai"),
        ],
    )
    async def test_prompted_sends_the_schema_in_the_instructions(
        self, url: str | None, response_format: dict[str, Any]
    ) -> None:
        """Instructions with the schema, and JSON mode (a grammar on llama.cpp)."""
        request = InferenceInput(
            model="openai-chat:m",
            context=ModelContext(
                instructions="Be brief.", items=[UserMessage(content="hi")]
            ),
            structured_output=Weather,
            structured_output_mode="prompted",
        )
        body = completion_body({"content": WEATHER_ARGS})
        async with MockAPI(json_response(body)) as api:
            client = AsyncOpenAI(
                api_key="sk-test", base_url=url, http_client=api.http, max_retries=0
            )
            output = await OpenAIChatProvider(client=client).complete(request)
        system = api.body["messages"][0]
        assert system["role"] == "system"
        assert system["content"].startswith("Be brief.\n\nGive your final answer as")
        assert json.dumps(WEATHER) in system["content"]
        assert api.body["response_format"] == response_format
        assert "tools" not in api.body
        assert output.message == ModelMessageItem(content=WEATHER_ARGS)
        assert output.structured_output_mode == "prompted"

    async def test_native_on_openai_is_published(self) -> None:
        """`auto` on OpenAI's host is the json_schema format, and says so."""
        body = completion_body({"content": WEATHER_ARGS})
        async with MockAPI(json_response(body)) as api:
            output = await openai_chat_provider(api).complete(
                make_request(structured_output=Weather)
            )
        assert api.body["response_format"]["type"] == "json_schema"
        assert output.structured_output_mode == "native"

    @pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
    async def test_refused_json_schema_falls_back_to_tool_once(
        self, streaming: bool
    ) -> None:
        """A refused json_schema is tried as a tool, and not sent again."""
        answer = completion_body(final_call(), finish_reason="tool_calls")
        stream = [
            chunk({"role": "assistant", "content": None}),
            tool_chunk(0, id="call_f", name="final_result", arguments=WEATHER_ARGS),
            chunk({}, "tool_calls"),
        ]

        def ok() -> httpx2.Response:
            if streaming:
                return sse_response(stream, named=False, done=True)
            return json_response(answer)

        request = make_request(structured_output=Weather, streaming=streaming)
        async with MockAPI(openai_refused_json_schema(), ok(), ok()) as api:
            provider = openai_chat_provider(api)
            first = await infer(provider, request, streaming=streaming)
            second = await infer(provider, request, streaming=streaming)
        refused, tried, again = api.bodies
        assert refused["response_format"]["type"] == "json_schema"
        assert "response_format" not in tried
        assert tried["tools"][0]["function"]["name"] == "final_result"
        assert again == tried
        for output in (first, second):
            assert output.message == ModelMessageItem(content=WEATHER_ARGS)
            assert output.structured_output_mode == "tool"

    async def test_a_reasonless_refusal_of_the_tool_falls_back_to_prompted(
        self,
    ) -> None:
        """llama.cpp's server fails `required` with an empty 500: prompted next."""
        reasonless = json_response(error_body("", "internal_server_error"), 500)
        answer = json_response(completion_body({"content": WEATHER_ARGS}))
        request = make_request("openai-chat:m", tools=[add], structured_output=Weather)
        async with MockAPI(reasonless, answer) as api:
            output = await chat_provider(api).complete(request)
        tried, prompted = api.bodies
        assert tried["tool_choice"] == "required"
        assert prompted["response_format"]["type"] == "json_object"
        assert [t["function"]["name"] for t in prompted["tools"]] == ["add"]
        assert output.structured_output_mode == "prompted"

    async def test_a_refused_explicit_mode_is_not_retried_and_says_why(self) -> None:
        """An explicit mode the server refuses: a short, final error with the modes to try."""
        request = make_request(
            "openai-chat:m", structured_output=Weather, structured_output_mode="native"
        )
        async with MockAPI(refused_json_schema()) as api:
            with pytest.raises(ProviderError) as caught:
                await chat_provider(api).complete(request)
        error = caught.value
        assert not error.retryable
        assert error.status_code == 500
        message = str(error)
        assert message.startswith(
            "the server refused structured output mode 'native': try "
            "structured_output_mode='tool' or 'prompted'"
        )
        assert "response_format" in message
        assert len(message) < 500

    async def test_a_user_tools_bad_schema_is_not_a_refusal_of_tool_mode(
        self,
    ) -> None:
        """A 400 about a user tool's schema names a function, not the mode:
        it fails the request as it is, and tool mode stays (it was taken for
        a refusal, prompted tried with the same tool, and tool mode skipped
        for good)."""
        bad = "Invalid schema for function 'add': 'integer' is not valid."
        answer = json_response(
            completion_body(final_call(), finish_reason="tool_calls")
        )
        request = make_request("openai-chat:m", tools=[add], structured_output=Weather)
        async with MockAPI(error_of(400, bad, "invalid_request_error"), answer) as api:
            provider = chat_provider(api)
            with pytest.raises(ProviderError, match="function 'add'"):
                await provider.complete(request)
            later = make_request("openai-chat:m", structured_output=Weather)
            output = await provider.complete(later)
        assert modes_sent(api.bodies) == ["tool", "tool"]
        assert output.structured_output_mode == "tool"

    async def test_a_5xx_on_openai_is_never_a_refusal(self) -> None:
        """An empty 500 on OpenAI's host is its own failure: the loop's to
        retry, and native is still tried next time (it was a refusal, and
        native never sent again)."""
        empty = json_response({"error": {"message": "", "type": "server_error"}}, 500)
        ok = json_response(completion_body({"content": WEATHER_ARGS}))
        request = make_request(structured_output=Weather)
        async with MockAPI(empty, ok) as api:
            provider = openai_chat_provider(api)
            with pytest.raises(ProviderError) as caught:
                await provider.complete(request)
            output = await provider.complete(request)
        assert caught.value.retryable
        assert modes_sent(api.bodies) == ["native", "native"]
        assert output.structured_output_mode == "native"

    async def test_a_schema_rejection_is_remembered_for_that_schema_only(
        self,
    ) -> None:
        """Strict mode rejecting one schema: that schema goes on in tool mode,
        another schema is still sent native (it skipped native for good)."""
        rejected = error_of(
            400,
            "Invalid schema for response_format 'Weather': In context=('properties',"
            " 'city'), 'format' is not permitted.",
            "invalid_request_error",
        )
        tool_answer = json_response(
            completion_body(final_call(), finish_reason="tool_calls")
        )
        native_answer = json_response(completion_body({"content": '{"n": 1}'}))
        async with MockAPI(rejected, tool_answer, tool_answer, native_answer) as api:
            provider = openai_chat_provider(api)
            await provider.complete(make_request(structured_output=Weather))
            await provider.complete(make_request(structured_output=Weather))
            other = await provider.complete(make_request(structured_output=Other))
        assert modes_sent(api.bodies) == ["native", "tool", "tool", "native"]
        assert other.structured_output_mode == "native"

    async def test_a_refusal_is_remembered_only_once_the_next_mode_worked(
        self,
    ) -> None:
        """The fallback failing too (a 429): nothing is learnt, and the next
        request starts from the first mode again."""
        limited = error_of(429, "Rate limit reached.", "requests")
        ok = json_response(completion_body({"content": WEATHER_ARGS}))
        request = make_request(structured_output=Weather)
        async with MockAPI(openai_refused_json_schema(), limited, ok) as api:
            provider = openai_chat_provider(api)
            with pytest.raises(ProviderError, match="Rate limit"):
                await provider.complete(request)
            await provider.complete(request)
        assert modes_sent(api.bodies) == ["native", "tool", "native"]

    async def test_a_forced_modes_transient_500_stays_retryable(self) -> None:
        """A passing 500 naming a function in forced tool mode is the server's
        failure, retried like any (it was a final "refused" error)."""
        transient = error_of(500, "upstream error in function dispatcher, please retry")
        request = make_request(
            "openai-chat:m", structured_output=Weather, structured_output_mode="tool"
        )
        async with MockAPI(transient) as api:
            with pytest.raises(ProviderError) as caught:
                await chat_provider(api).complete(request)
        assert caught.value.retryable
        assert "refused" not in str(caught.value)

    async def test_a_transient_error_is_not_a_refusal(self) -> None:
        """A rate limit in auto mode is the loop's to retry: no other mode is tried."""
        limited = json_response(error_body("Rate limit reached.", "requests"), 429)
        async with MockAPI(limited) as api:
            with pytest.raises(ProviderError) as caught:
                await openai_chat_provider(api).complete(
                    make_request(structured_output=Weather)
                )
        assert caught.value.retryable
        assert len(api.requests) == 1


class TestResponsesStructuredModes:
    async def test_tool_mode(self) -> None:
        """The final tool as a Responses function; its call becomes the answer."""
        request = make_request(structured_output=Weather, structured_output_mode="tool")
        body = response_body([call_item("call_f", "final_result", WEATHER_ARGS)])
        async with MockAPI(json_response(body)) as api:
            output = await responses_provider(api).complete(request)
        assert api.body["tools"] == [
            {
                "type": "function",
                "name": "final_result",
                "description": "Give your final answer by calling this tool: "
                "its arguments are the answer.",
                "parameters": WEATHER,
                "strict": False,
            }
        ]
        assert api.body["tool_choice"] == {"type": "function", "name": "final_result"}
        assert "text" not in api.body
        assert output.items == (ModelMessageItem(content=WEATHER_ARGS),)
        assert output.finish_reason == "stop"
        assert output.structured_output_mode == "tool"

    async def test_prompted_mode(self) -> None:
        """The schema joins the instructions; the format is json_object."""
        request = make_request(
            structured_output=Weather, structured_output_mode="prompted"
        )
        body = response_body([message_item(WEATHER_ARGS)])
        async with MockAPI(json_response(body)) as api:
            output = await responses_provider(api).complete(request)
        assert api.body["instructions"].startswith("Give your final answer as")
        assert api.body["text"] == {"format": {"type": "json_object"}}
        assert output.structured_output_mode == "prompted"

    async def test_request_params_per_mode(self) -> None:
        """`request_params(mode=)` builds the request of any mode; default: native."""
        async with MockAPI() as api:
            provider = responses_provider(api)
        request = make_request(structured_output=Weather)
        assert provider.request_params(request)["text"]["format"]["type"] == (
            "json_schema"
        )
        assert "text" not in provider.request_params(request, mode="tool")
        plain = make_request()
        assert "text" not in provider.request_params(plain, mode="tool")
        assert "tools" not in provider.request_params(plain, mode="tool")


class TestResponsesNotFound:
    @pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streaming"])
    async def test_404_from_another_server_suggests_openai_chat(
        self, streaming: bool
    ) -> None:
        """Ollama, vLLM and llama.cpp have no Responses API: the error says what to use."""
        not_found = httpx2.Response(404, text="404 page not found")
        async with MockAPI(not_found) as api:
            client = AsyncOpenAI(
                api_key="x",
                base_url="http://127.0.0.1:11434/v1",
                http_client=api.http,
                max_retries=0,
            )
            provider = OpenAIResponsesProvider(client=client)
            with pytest.raises(ProviderError) as caught:
                await infer(provider, make_request(), streaming=streaming)
        message = str(caught.value)
        assert message.startswith(
            "http://127.0.0.1:11434/v1/responses answered HTTP 404"
        )
        assert "404 page not found" in message
        assert "`openai-chat:` prefix" in message
        assert caught.value.status_code == 404
        assert not caught.value.retryable

    async def test_404_from_openai_is_left_as_it_is(self) -> None:
        """On OpenAI's own API a 404 is a wrong model, not a missing API."""
        missing = error_body(
            "The model `nope` does not exist.", "invalid_request_error"
        )
        async with MockAPI(json_response(missing, 404)) as api:
            with pytest.raises(ProviderError) as caught:
                await responses_provider(api).complete(make_request())
        assert "openai-chat" not in str(caught.value)


@pytest.mark.parametrize("kind", PROVIDERS)
async def test_extra_body_is_merged_into_the_body(kind: Factory) -> None:
    """Server-specific keys reach the body; a key agentfsm sets is overridden."""
    extra = {
        "top_k": 20,
        "min_p": 0.05,
        "temperature": 0.1,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    request = make_request(temperature=0.7, extra_body=extra)
    answer = (
        response_body([message_item("ok")])
        if kind is OpenAIResponsesProvider
        else completion_body({"content": "ok"})
    )
    async with MockAPI(json_response(answer)) as api:
        await provider_of(kind, api).complete(request)
    for key, value in extra.items():
        assert api.body[key] == value
