"""Structured output: an invalid answer goes back to the model, then fails the
loop; the modes a provider asks for it in, and `auto`'s fallback, in whole loops."""

from __future__ import annotations

from typing import Any

import anyio
import httpx2
import pytest
from pydantic import BaseModel

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    LoopResult,
    LoopStatus,
    ModelContext,
    ModelMessageItem,
    Proceed,
    Runtime,
    UserMessage,
    tool,
)
from agentfsm.events import (
    InferenceCompleted,
    ModelAnswer,
)
from agentfsm.providers.function import FunctionProvider
from agentfsm.providers.openai import OpenAIChatProvider
from agentfsm.store import MemoryStore
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    assert_path,
    call,
    calls,
    text,
)
from tests.helpers import add, wait_until
from tests.http_mock import MockAPI, json_response
from tests.test_provider_openai import (
    chat_provider,
    completion_body,
    error_body,
    openai_chat_provider,
    openai_refused_json_schema,
)


class TestStructuredOutput:
    async def test_structured_output_invalid_then_valid(self) -> None:
        """An invalid answer goes back with the error; the valid one is parsed."""

        class Answer(BaseModel):
            city: str
            population: int

        provider = ScriptedProvider(
            [
                text('{"city": "Oslo", "population": "many"}'),
                text('{"city": "Oslo", "population": 709000}'),
            ]
        )
        async with Runtime(providers={"scripted": provider}) as runtime:
            recorder = EventRecorder(runtime.bus, "model.answer")
            inference_input = InferenceInput(
                model="scripted:x", context=ModelContext(), structured_output=Answer
            )
            result = await runtime.wait(
                runtime.run_loop("agent", "biggest city?", inference_input)
            )
        assert result.output == Answer(city="Oslo", population=709000)
        retry = inference_input.context.items[2]
        assert isinstance(retry, UserMessage)
        assert "population" in retry.content
        assert "valid integer" in retry.content
        answers = [e for e in recorder.events if isinstance(e, ModelAnswer)]
        assert len(answers) == 1
        assert answers[0].parsed == {"city": "Oslo", "population": 709000}
        assert_path(
            result,
            "idle context_update inference model_message context_update inference model_message idle",
        )

    async def test_structured_output_fails_after_its_retries(self) -> None:
        """An answer that keeps failing a JSON schema fails the loop with the error."""
        schema = {
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
        }
        provider = ScriptedProvider([text('{"n": "x"}'), text("{}")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            result = await runtime.wait(
                runtime.run_loop(
                    "agent",
                    "n?",
                    InferenceInput(
                        model="scripted:x",
                        context=ModelContext(),
                        structured_output=schema,
                    ),
                    structured_output_retries=1,
                )
            )
        assert result.error is not None
        assert result.error.type == "StructuredOutputError"
        assert "after 2 attempts" in result.error.message
        assert "'n' is a required property" in result.error.message


# ------------------------------------------------- modes, through a real provider


class Weather(BaseModel):
    city: str
    celsius: float


def _chat_call(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _calls(*calls: dict[str, Any]) -> httpx2.Response:
    message = {"content": None, "tool_calls": list(calls)}
    return json_response(completion_body(message, finish_reason="tool_calls"))


async def _run(
    provider: OpenAIChatProvider, request: InferenceInput, question: str
) -> tuple[LoopResult, list[InferenceCompleted]]:
    async with Runtime(providers={"openai-chat": provider}) as runtime:
        recorder = EventRecorder(runtime.bus, "inference.completed")
        result = await runtime.wait(runtime.run_loop("agent", question, request))
        completed = [e for e in recorder.events if isinstance(e, InferenceCompleted)]
        recorder.close()
    return result, completed


class TestModes:
    async def test_auto_falls_back_to_the_tool_and_publishes_it(self) -> None:
        """json_schema refused: the answer comes through the final tool, and
        `inference.completed` says which mode was used."""
        args = '{"city": "Oslo", "celsius": 3}'
        async with MockAPI(
            openai_refused_json_schema(),
            _calls(_chat_call("final_result", args, "c1")),
        ) as api:
            request = InferenceInput(
                model="openai-chat:gpt-4.1-mini",
                context=ModelContext(),
                structured_output=Weather,
            )
            result, completed = await _run(
                openai_chat_provider(api), request, "weather?"
            )
        assert result.output == Weather(city="Oslo", celsius=3)
        assert [e.output.structured_output_mode for e in completed] == ["tool"]
        assert_path(result, "idle context_update inference model_message idle")
        # The context holds the answer as a message: no call waits for an output.
        assert request.context.items[-1] == ModelMessageItem(content=args)

    async def test_invalid_final_arguments_are_retried_as_a_tool_call(self) -> None:
        """An invalid answer from the final tool goes back asking for the tool again."""
        bad = '{"city": "Oslo", "celsius": "cold"}'
        good = '{"city": "Oslo", "celsius": -2.5}'
        async with MockAPI(
            _calls(_chat_call("final_result", bad, "c1")),
            _calls(_chat_call("final_result", good, "c2")),
        ) as api:
            request = InferenceInput(
                model="openai-chat:smollm2",
                context=ModelContext(),
                structured_output=Weather,
            )
            result, completed = await _run(chat_provider(api), request, "weather?")
        assert result.output == Weather(city="Oslo", celsius=-2.5)
        retry = request.context.items[2]
        assert isinstance(retry, UserMessage)
        assert "celsius" in retry.content
        assert retry.text.endswith(
            "Call the final answer tool again with corrected arguments."
        )
        assert [e.output.structured_output_mode for e in completed] == ["tool", "tool"]

    @pytest.mark.parametrize(
        "content",
        [
            '```json\n{"city": "Oslo", "celsius": 3}\n```',
            'Here is the answer: {"city": "Oslo", "celsius": 3}',
            'Sure.\n```\n{"city": "Oslo", "celsius": 3}\n```\nAnything else?',
        ],
        ids=["fenced", "prose", "fenced-in-prose"],
    )
    async def test_a_prompted_answer_is_the_json_in_it(self, content: str) -> None:
        """Prompted mode validates the JSON document in the answer (a fenced
        or prose-wrapped one was refused); the message keeps what was said."""
        answer = json_response(completion_body({"content": content}))
        async with MockAPI(answer) as api:
            request = InferenceInput(
                model="openai-chat:m",
                context=ModelContext(),
                structured_output=Weather,
                structured_output_mode="prompted",
            )
            result, _ = await _run(chat_provider(api), request, "weather?")
        assert result.output == Weather(city="Oslo", celsius=3)
        assert len(api.requests) == 1
        assert request.context.items[-1] == ModelMessageItem(content=content)

    async def test_a_plain_text_answer_is_named_the_answer(self) -> None:
        """The retry message names the answer, not `arguments`, outside tool mode."""
        retry = json_response(completion_body({"content": "It is 3 degrees."}))
        good = json_response(
            completion_body({"content": '{"city": "Oslo", "celsius": 3}'})
        )
        async with MockAPI(retry, good) as api:
            request = InferenceInput(
                model="openai-chat:m",
                context=ModelContext(),
                structured_output=Weather,
                structured_output_mode="prompted",
            )
            result, _ = await _run(chat_provider(api), request, "weather?")
        assert result.output == Weather(city="Oslo", celsius=3)
        told = request.context.items[2]
        assert isinstance(told, UserMessage)
        assert told.text.startswith(
            "Your answer does not match the required output format: answer: Invalid JSON"
        )

    async def test_a_transient_500_in_a_forced_mode_is_retried(self) -> None:
        """Forced tool mode, a passing 500 naming a function: the loop retries
        it like any transient error (it failed the loop as "refused")."""
        transient = json_response(
            error_body("upstream error in function dispatcher, please retry", "x"), 500
        )
        args = '{"city": "Oslo", "celsius": 3}'
        async with MockAPI(
            transient, _calls(_chat_call("final_result", args, "c1"))
        ) as api:
            request = InferenceInput(
                model="openai-chat:m",
                context=ModelContext(),
                structured_output=Weather,
                structured_output_mode="tool",
            )
            async with Runtime(providers={"openai-chat": chat_provider(api)}) as rt:
                loop_id = rt.run_loop(
                    "agent", "weather?", request, max_retries=2, retry_backoff=0
                )
                result = await rt.wait(loop_id)
        assert result.output == Weather(city="Oslo", celsius=3)
        assert len(api.requests) == 2

    async def test_final_call_beside_a_tool_waits_for_its_output(self) -> None:
        """The tool runs; the answer given beside it is asked again after its output."""
        args = '{"city": "Oslo", "celsius": 3}'
        async with MockAPI(
            _calls(
                _chat_call("add", '{"a": 1, "b": 2}', "c1"),
                _chat_call("final_result", '{"city": "?", "celsius": 0}', "c2"),
            ),
            _calls(_chat_call("final_result", args, "c3")),
        ) as api:
            request = InferenceInput(
                model="openai-chat:smollm2",
                context=ModelContext(),
                tools=[add],
                structured_output=Weather,
            )
            result, _ = await _run(chat_provider(api), request, "weather?")
        assert_path(
            result,
            "idle context_update inference function_call inference model_message idle",
        )
        assert result.output == Weather(city="Oslo", celsius=3)
        second = api.bodies[1]
        assert second["tool_choice"] == "required"
        sent_calls = [
            call["function"]["name"]
            for message in second["messages"]
            for call in message.get("tool_calls", ())
        ]
        assert sent_calls == ["add"]


@tool(needs_approval=True)
def confirm(n: int) -> str:
    """Confirm a number."""
    return f"confirmed {n}"


async def test_the_mode_and_extra_body_outlive_their_runtime() -> None:
    """A durable loop taken up by another runtime sends its requests with the
    structured output mode and `extra_body` it was started with."""
    memory = MemoryStore()
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
    }
    request = InferenceInput(
        model="scripted:m",
        context=ModelContext(),
        tools=[confirm],
        structured_output=schema,
        structured_output_mode="prompted",
        extra_body={"top_k": 3},
    )
    first_provider = ScriptedProvider([calls(call("confirm", n=1))])
    async with Runtime(providers={"scripted": first_provider}, store=memory) as first:
        loop_id = first.run_loop("agent", "n?", request)
        await wait_until(lambda: first.get(loop_id).status is LoopStatus.paused)

    seen: list[InferenceInput] = []

    def answer(sent: InferenceInput) -> InferenceOutput:
        seen.append(sent)
        return text('{"n": 1}')

    async with Runtime(
        providers={"scripted": FunctionProvider(answer)}, store=memory, tools=[confirm]
    ) as second:
        assert (await second.recover()).paused == [loop_id]
        second.resume(loop_id, Proceed())
        with anyio.fail_after(20):
            result = await second.wait(loop_id)
    assert result.output == {"n": 1}
    assert [(r.structured_output_mode, r.extra_body) for r in seen] == [
        ("prompted", {"top_k": 3})
    ]
