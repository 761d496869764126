"""Small built-in tools for demos: `agentfsm run --tool agentfsm.cli.demo_tools:add`.

`make demo` runs `add` on the embedded SmolLM2 model the way a model that
small answers reliably: the tool forced once, then an answer at temperature 0
(greedy), with instructions to answer with the tool's result.

Example:
    ```python
    context = ModelContext(instructions="Answer in one short sentence, "
                           "using the result of the tool you called.")
    InferenceInput(model="local:smollm2", context=context, tools=[add],
                   tool_choice="add", reset_tool_choice="none", temperature=0)
    ```
"""

from __future__ import annotations

from datetime import UTC, datetime

from agentfsm.tools import tool

__all__ = ("add", "clock")


@tool
def add(a: int, b: int) -> int:
    """Add two integers and return their sum."""
    return a + b


@tool
def clock() -> str:
    """The current date and time in UTC, as ISO 8601 text."""
    return datetime.now(UTC).isoformat(timespec="seconds")
