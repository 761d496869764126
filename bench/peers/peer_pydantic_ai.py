"""The workload on pydantic-ai: an `Agent` with a `FunctionModel` and one tool.

Run by `run.py` with `bench/.venvs/pydantic_ai/bin/python` (see harness.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version

from harness import ANSWER, PROMPT, TOOL_CALLS, Counter, Subject, main, script_step
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel


def tool_results(messages: list[ModelMessage]) -> int:
    return sum(
        isinstance(part, ToolReturnPart)
        for message in messages
        if isinstance(message, ModelRequest)
        for part in message.parts
    )


def reply(messages: list[ModelMessage]) -> ModelResponse:
    n = tool_results(messages)
    step = script_step(n)
    if step is None:
        return ModelResponse(parts=[TextPart(ANSWER)])
    name, args = step
    return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=f"call_{n + 1}")])


# An async model function: a sync one would run in a worker thread.
async def scripted(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    return reply(messages)


async def scripted_checkpoint(
    messages: list[ModelMessage], info: AgentInfo
) -> ModelResponse:
    await asyncio.sleep(0)
    return reply(messages)


def build_agent(model: FunctionModel, counter: Counter) -> Agent[None, str]:
    agent = Agent(model)

    @agent.tool_plain
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        counter.n += 1
        return a + b

    return agent


@asynccontextmanager
async def make_subject() -> AsyncIterator[Subject]:
    counter = Counter()
    agents = {
        False: build_agent(FunctionModel(scripted), counter),
        True: build_agent(FunctionModel(scripted_checkpoint), counter),
    }

    async def one(checkpoint: bool) -> None:
        result = await agents[checkpoint].run(PROMPT)
        assert result.output == ANSWER, result.output
        assert tool_results(result.all_messages()) == TOOL_CALLS

    yield Subject("pydantic-ai", one, counter=counter)


if __name__ == "__main__":
    main(
        make_subject,
        name="pydantic-ai",
        version=version("pydantic-ai-slim"),
        imports=["pydantic_ai", "pydantic_ai.models.function"],
    )
