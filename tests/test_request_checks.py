"""An `InferenceInput` that no model request could serve is refused when it is made."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from agentfsm import Agent, InferenceInput, ModelContext
from agentfsm.exceptions import ConfigurationError
from agentfsm.tools import Tool


def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def subtract(a: int, b: int) -> int:
    """Subtract b from a."""
    return a - b


def make(**fields: object) -> InferenceInput:
    return InferenceInput.model_validate(
        {"model": "scripted:test", "context": ModelContext(), **fields}
    )


class TestToolNames:
    def test_two_tools_of_one_name_are_refused(self) -> None:
        """The error is a ValidationError on `tools` naming the name."""
        other_add = Tool(subtract, name="add")
        with pytest.raises(
            ValidationError, match="two tools are named 'add'"
        ) as caught:
            make(tools=[Tool(add), Tool(subtract), other_add])
        assert [e["loc"] for e in caught.value.errors()] == [("tools",)]

    def test_the_same_tool_twice_is_refused(self) -> None:
        """One Tool object listed twice is two functions of one name, too."""
        tool = Tool(add)
        with pytest.raises(ValidationError, match="two tools are named 'add'"):
            make(tools=(tool, tool))

    def test_every_duplicated_name_is_named(self) -> None:
        tools = [Tool(add), Tool(add), Tool(subtract), Tool(subtract, name="subtract")]
        with pytest.raises(
            ValidationError, match="two tools are named 'add', 'subtract'"
        ):
            make(tools=tools)

    def test_tools_of_distinct_names_are_kept_in_order(self) -> None:
        tools = [Tool(subtract), Tool(add), Tool(add, name="plus")]
        assert make(tools=tools).tools == tuple(tools)
        assert make(tools=[]).tools == ()


class Answer(BaseModel):
    value: int


class TestStructuredOutputSchema:
    @pytest.mark.parametrize(
        ("schema", "error"),
        [
            pytest.param(
                {"type": "object", "properties": {"a": {"type": "integr"}}},
                "$.properties.a.type: 'integr' is not valid under any of the given",
                id="unknown-type",
            ),
            pytest.param(
                {"type": "object", "required": "a"},
                "$.required: 'a' is not of type 'array'",
                id="required-not-a-list",
            ),
            pytest.param(
                {"properties": []},
                "$.properties: [] is not of type 'object'",
                id="properties-not-an-object",
            ),
            pytest.param(
                {"type": "integer", "minimum": "3"},
                "$.minimum: '3' is not of type 'number'",
                id="minimum-not-a-number",
            ),
        ],
    )
    def test_an_invalid_schema_is_refused_naming_what_is_wrong(
        self, schema: dict[str, object], error: str
    ) -> None:
        """A ValidationError on `structured_output` says where and what."""
        with pytest.raises(ValidationError) as caught:
            make(structured_output=schema)
        [problem] = caught.value.errors()
        assert problem["loc"] == ("structured_output",)
        assert f"not a valid JSON schema: {error}" in problem["msg"]

    def test_an_agent_with_an_invalid_schema_is_refused(self) -> None:
        """`Agent(output_type=...)` fails when it is made, before any model call."""
        with pytest.raises(
            ConfigurationError, match=r"structured_output: .*not a valid JSON schema"
        ):
            Agent("scripted:test", output_type={"type": "integr"})

    @pytest.mark.parametrize(
        "output",
        [
            pytest.param(
                {
                    "type": "object",
                    "properties": {"a": {"type": "integer", "minimum": 3}},
                    "required": ["a"],
                },
                id="schema",
            ),
            pytest.param({}, id="empty-schema"),
            pytest.param(Answer.model_json_schema(), id="pydantic-schema"),
            pytest.param(Answer, id="model"),
            pytest.param(None, id="none"),
        ],
    )
    def test_valid_outputs_are_kept(self, output: object) -> None:
        assert make(structured_output=output).structured_output == output
