"""Structured output: an invalid answer goes back to the model, then fails the loop."""

from __future__ import annotations

from pydantic import BaseModel

from agentfsm import (
    InferenceInput,
    ModelContext,
    Runtime,
    UserMessage,
)
from agentfsm.events import (
    ModelAnswer,
)
from agentfsm.testing import (
    EventRecorder,
    ScriptedProvider,
    assert_path,
    text,
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
