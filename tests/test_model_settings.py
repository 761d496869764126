"""Model settings reach every provider's wire payload, or are refused by name."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from agentfsm import (
    Agent,
    ConfigurationError,
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    ModelMessageItem,
    UserMessage,
)
from agentfsm.providers._llama_chat import DEFAULT_TEMPERATURE, request_kwargs
from agentfsm.providers.function import FunctionProvider
from tests import test_provider_anthropic as anthropic_tests
from tests import test_provider_openai as openai_tests
from tests.helpers import add
from tests.http_mock import MockAPI, json_response

Sender = Callable[[InferenceInput], Awaitable[dict[str, Any]]]
"""Sends a request through one provider; returns the payload it sent."""


async def _responses(request: InferenceInput) -> dict[str, Any]:
    answer = openai_tests.response_body([openai_tests.message_item("ok")])
    async with MockAPI(json_response(answer)) as api:
        await openai_tests.responses_provider(api).complete(request)
    return api.body


async def _chat(request: InferenceInput) -> dict[str, Any]:
    answer = openai_tests.completion_body({"content": "ok"})
    async with MockAPI(json_response(answer)) as api:
        await openai_tests.chat_provider(api).complete(request)
    return api.body


async def _anthropic(request: InferenceInput) -> dict[str, Any]:
    async with MockAPI(anthropic_tests.ok()) as api:
        await anthropic_tests.provider_of(api).complete(request)
    return api.body


async def _local(request: InferenceInput) -> dict[str, Any]:
    # llama-cpp-python is called in process: its keyword arguments are the payload.
    return request_kwargs(request)


PROVIDERS: dict[str, tuple[str, Sender]] = {
    "responses": ("openai:gpt-4.1-mini", _responses),
    "chat": ("openai-chat:gpt-4.1-mini", _chat),
    "anthropic": (anthropic_tests.MODEL, _anthropic),
    "local": ("local:smollm2", _local),
}

STOP = ("END", "\n\n")
REFUSED = object()
"""The provider refuses the request with a `ConfigurationError` naming the setting."""
LEFT_OUT = object()
"""A sampling hint the provider has no field for: the request goes without it."""

# setting -> (request fields, {provider: what the payload holds, or REFUSED})
SETTINGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "temperature": (
        {"temperature": 0.3},
        {
            **{key: {"temperature": 0.3} for key in PROVIDERS},
            "anthropic": LEFT_OUT,
        },
    ),
    "top_p": (
        {"top_p": 0.9},
        {**{key: {"top_p": 0.9} for key in PROVIDERS}, "anthropic": LEFT_OUT},
    ),
    "seed": (
        {"seed": 7},
        {
            "responses": LEFT_OUT,
            "chat": {"seed": 7},
            "anthropic": LEFT_OUT,
            "local": {"seed": 7},
        },
    ),
    "stop_sequences": (
        {"stop_sequences": STOP},
        {
            "responses": REFUSED,
            "chat": {"stop": list(STOP)},
            "anthropic": {"stop_sequences": list(STOP)},
            "local": {"stop": list(STOP)},
        },
    ),
    "extra_body": (
        {"extra_body": {"top_k": 20, "min_p": 0.05}},
        {key: {"top_k": 20, "min_p": 0.05} for key in PROVIDERS},
    ),
    "parallel_tool_calls": (
        {"parallel_tool_calls": False, "tools": [add]},
        {
            "responses": {"parallel_tool_calls": False},
            "chat": {"parallel_tool_calls": False},
            "anthropic": {
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}
            },
            "local": REFUSED,
        },
    ),
}

CASES = [
    pytest.param(setting, provider, id=f"{setting}-{provider}")
    for setting in SETTINGS
    for provider in PROVIDERS
]


def _request(model: str, *items: Any, **fields: Any) -> InferenceInput:
    context = ModelContext(items=list(items or [UserMessage(content="hi")]))
    return InferenceInput(model=model, context=context, **fields)


@pytest.mark.parametrize(("setting", "provider"), CASES)
async def test_each_setting_on_each_provider(setting: str, provider: str) -> None:
    """The setting is in the payload under the provider's name for it, or refused
    (what changes the answer), or left out (a sampling hint the API lacks)."""
    fields, expected = SETTINGS[setting]
    model, send = PROVIDERS[provider]
    want = expected[provider]
    if want is REFUSED:
        with pytest.raises(ConfigurationError, match=f"has no {setting} setting"):
            await send(_request(model, **fields))
        return
    if want is LEFT_OUT:
        body = await send(_request(model, **fields))
        assert body == await send(_request(model))
        return
    body = await send(_request(model, **fields))
    assert {key: body.get(key) for key in want} == want


@pytest.mark.parametrize("provider", list(PROVIDERS))
async def test_unset_settings_are_not_sent(provider: str) -> None:
    """A request without settings sends none of their fields (local: its temperature)."""
    model, send = PROVIDERS[provider]
    body = await send(_request(model, tools=[add]))
    names = {"top_p", "seed", "stop", "stop_sequences", "parallel_tool_calls"}
    assert not names & set(body)
    assert ("temperature" in body) is (provider == "local")


async def test_the_local_model_runs_cool_by_default() -> None:
    """Without a temperature the local model samples at `DEFAULT_TEMPERATURE` (0.2)."""
    assert DEFAULT_TEMPERATURE == 0.2
    assert (await _local(_request("local:smollm2")))["temperature"] == 0.2
    explicit = await _local(_request("local:smollm2", temperature=0.0))
    assert explicit["temperature"] == 0.0


def test_a_refusal_points_to_what_has_the_setting() -> None:
    """The Responses API's refusal names Chat Completions, which has stop sequences."""
    from agentfsm.providers._openai_responses import request_params

    with pytest.raises(ConfigurationError, match="use the `openai-chat:` prefix"):
        request_params(
            _request("openai:gpt-4.1-mini", stop_sequences="END"),
            "gpt-4.1-mini",
            store=False,
            reasoning_summary=None,
            include_encrypted_reasoning=None,
        )


class TestValidation:
    @pytest.mark.parametrize(
        "fields",
        [
            pytest.param({"temperature": -0.1}, id="temperature-low"),
            pytest.param({"temperature": 2.5}, id="temperature-high"),
            pytest.param({"top_p": 0}, id="top_p-zero"),
            pytest.param({"top_p": 1.5}, id="top_p-high"),
            pytest.param({"stop_sequences": ["ok", ""]}, id="empty-stop"),
            pytest.param({"reset_tool_choice": "required"}, id="reset-required"),
        ],
    )
    def test_out_of_range(self, fields: dict[str, Any]) -> None:
        """Settings out of range fail when the request is built, naming the field."""
        with pytest.raises(ValidationError, match=next(iter(fields))):
            _request("x:y", **fields)

    def test_one_stop_sequence_as_a_string(self) -> None:
        assert _request("x:y", stop_sequences="END").stop_sequences == ("END",)


# ------------------------------------------------------- force once, then auto

CALL = FunctionCallItem(call_id="c1", name="add", arguments='{"a":1,"b":2}')
OUTPUT = FunctionCallOutputItem(call_id="c1", output="3")

FORCED = {
    "responses": {"type": "function", "name": "add"},
    "chat": {"type": "function", "function": {"name": "add"}},
    "anthropic": {"type": "tool", "name": "add"},
    "local": {"type": "function", "function": {"name": "add"}},
}
AUTO = {
    "responses": "auto",
    "chat": "auto",
    "anthropic": {"type": "auto"},
    "local": "auto",
}


class TestResetToolChoice:
    def test_forced_until_a_tool_answers(self) -> None:
        """Before any tool output (since the last user message) the tool is forced."""
        before = _request(
            "x:y", tools=[add], tool_choice="add", reset_tool_choice="auto"
        )
        assert before.effective_tool_choice == "add"
        after = _request(
            "x:y",
            UserMessage(content="1+2?"),
            CALL,
            OUTPUT,
            tools=[add],
            tool_choice="add",
            reset_tool_choice="none",
        )
        assert after.effective_tool_choice == "none"

    def test_a_new_user_message_forces_it_again(self) -> None:
        """A tool output of an earlier turn does not release the next turn's choice."""
        again = _request(
            "x:y",
            UserMessage(content="1+2?"),
            CALL,
            OUTPUT,
            UserMessage(content="and 2+2?"),
            tools=[add],
            tool_choice="required",
            reset_tool_choice="auto",
        )
        assert again.effective_tool_choice == "required"

    def test_without_reset_it_is_forced_every_time(self) -> None:
        forced = _request(
            "x:y",
            UserMessage(content="q"),
            CALL,
            OUTPUT,
            tools=[add],
            tool_choice="add",
        )
        assert forced.effective_tool_choice == "add"

    @pytest.mark.parametrize("provider", list(PROVIDERS))
    async def test_every_provider_sends_the_effective_choice(
        self, provider: str
    ) -> None:
        """Each provider forces the tool first, then sends `auto` once it answered."""
        model, send = PROVIDERS[provider]
        fields = {"tools": [add], "tool_choice": "add", "reset_tool_choice": "auto"}
        first = await send(_request(model, **fields))
        assert first["tool_choice"] == FORCED[provider]
        later = await send(
            _request(model, UserMessage(content="1+2?"), CALL, OUTPUT, **fields)
        )
        assert later["tool_choice"] == AUTO[provider]


class TestExtraBody:
    @pytest.mark.parametrize(
        ("value", "message"),
        [
            pytest.param([1, 2], "must be a JSON object (a dict), got list", id="list"),
            pytest.param(
                "top_k=3", "must be a JSON object (a dict), got str", id="str"
            ),
            pytest.param({"stream": True}, "cannot set stream", id="stream"),
            pytest.param({"model": "x"}, "cannot set model", id="model"),
            pytest.param({"top_k": {1, 2}}, "extra_body.top_k", id="not-json"),
            pytest.param(
                {"min_p": float("nan")}, "extra_body['min_p'] is nan", id="nan"
            ),
            pytest.param(
                {"a": {"b": [1, float("-inf")]}},
                "extra_body['a']['b'][1] is -inf",
                id="nested-inf",
            ),
        ],
    )
    def test_it_must_be_a_json_object(self, value: object, message: str) -> None:
        """Anything but a JSON object, a key of the request's own, or a number
        JSON cannot carry (it failed the loop at send with a bare ValueError)
        is refused, naming where."""
        with pytest.raises(ValidationError, match=re.escape(message)):
            _request("openai-chat:m", extra_body=value)

    def test_the_local_model_refuses_what_llama_cpp_lacks(self) -> None:
        """An unknown key names the keys the local model takes."""
        with pytest.raises(ConfigurationError) as caught:
            request_kwargs(
                _request("local:smollm2", extra_body={"chat_template_kwargs": {}})
            )
        message = str(caught.value)
        assert "no parameter 'chat_template_kwargs'" in message
        assert "min_p" in message
        assert "top_k" in message

    def test_the_local_model_takes_numbers(self) -> None:
        """llama.cpp's sampling parameters are numbers: anything else is refused."""
        with pytest.raises(ConfigurationError, match=r"extra_body\['top_k'\] must be"):
            request_kwargs(_request("local:smollm2", extra_body={"top_k": "40"}))
        kwargs = request_kwargs(
            _request("local:smollm2", extra_body={"repeat_penalty": 1.1, "top_k": 1})
        )
        assert (kwargs["repeat_penalty"], kwargs["top_k"]) == (1.1, 1)


async def test_an_agent_passes_the_structured_settings_through() -> None:
    """`model_settings` carries `structured_output_mode` and `extra_body` to requests."""
    seen: list[InferenceInput] = []

    def answer(request: InferenceInput) -> InferenceOutput:
        seen.append(request)
        return InferenceOutput(items=(ModelMessageItem(content='{"value": 1}'),))

    class Answer(BaseModel):
        value: int

    agent = Agent(
        FunctionProvider(answer),
        output_type=Answer,
        model_settings={"structured_output_mode": "prompted", "extra_body": {"k": 1}},
    )
    result = await agent.run("one?")
    assert result.output == Answer(value=1)
    assert [(r.structured_output_mode, r.extra_body) for r in seen] == [
        ("prompted", {"k": 1})
    ]
