"""An `InferenceInput` that no model request could serve is refused when it is made."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentfsm import InferenceInput, ModelContext
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
