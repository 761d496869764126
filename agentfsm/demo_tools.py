"""Small built-in tools for demos: `agentfsm run --tool agentfsm.demo_tools:add`.

Example:
    ```python
    InferenceInput(model="local:smollm2", context=ModelContext(), tools=[add, clock])
    ```
"""

from __future__ import annotations

from datetime import UTC, datetime

from .tools import tool

__all__ = ("add", "clock")


@tool
def add(a: int, b: int) -> int:
    """Add two integers and return their sum."""
    return a + b


@tool
def clock() -> str:
    """The current date and time in UTC, as ISO 8601 text."""
    return datetime.now(UTC).isoformat(timespec="seconds")
