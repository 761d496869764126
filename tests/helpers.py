"""Shared test helpers: a typed `add` tool and request builders."""

from __future__ import annotations

from agentfsm import InferenceInput, ModelContext, Tool, tool


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def request(
    *tools: Tool, model: str = "scripted:test", streaming: bool = False
) -> InferenceInput:
    """A request on a fresh context offering `tools` (default: `add`)."""
    return InferenceInput(
        model=model, context=ModelContext(), tools=tools or (add,), streaming=streaming
    )
