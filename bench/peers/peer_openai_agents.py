"""The workload on the OpenAI Agents SDK: an `Agent` with a custom `Model`.

`ScriptedModel` implements the SDK's `Model` interface and returns the scripted
responses (Responses-API output items); tracing is disabled. Run by `run.py`
with `bench/.venvs/openai_agents/bin/python` (see harness.py).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Any

from agents import (
    Agent,
    Model,
    ModelResponse,
    Runner,
    Usage,
    function_tool,
    set_tracing_disabled,
)
from harness import ANSWER, PROMPT, Counter, Subject, main, script_step
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

SHARED_AGENT = "--shared-agent" in sys.argv
if SHARED_AGENT:
    sys.argv.remove("--shared-agent")


def tool_results(items: Any) -> int:
    if isinstance(items, str):
        return 0
    return sum(
        (item.get("type") if isinstance(item, dict) else getattr(item, "type", None))
        == "function_call_output"
        for item in items
    )


def reply(items: Any) -> ModelResponse:
    n = tool_results(items)
    step = script_step(n)
    output: Any
    if step is None:
        output = ResponseOutputMessage(
            id=f"msg_{n + 1}",
            type="message",
            role="assistant",
            status="completed",
            content=[
                ResponseOutputText(type="output_text", text=ANSWER, annotations=[])
            ],
        )
    else:
        name, args = step
        output = ResponseFunctionToolCall(
            id=f"fc_{n + 1}",
            call_id=f"call_{n + 1}",
            type="function_call",
            name=name,
            arguments=json.dumps(args),
        )
    return ModelResponse(output=[output], usage=Usage(), response_id=None)


class ScriptedModel(Model):
    """A zero-latency model playing the script (optionally yielding once)."""

    def __init__(self, checkpoint: bool) -> None:
        self.checkpoint = checkpoint

    async def get_response(
        self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        if self.checkpoint:
            await asyncio.sleep(0)
        return reply(input)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError


@asynccontextmanager
async def make_subject() -> AsyncIterator[Subject]:
    set_tracing_disabled(True)
    counter = Counter()

    @function_tool
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        counter.n += 1
        return a + b

    models = {cp: ScriptedModel(cp) for cp in (False, True)}
    shared = {cp: Agent(name="bench", model=models[cp], tools=[add]) for cp in models}

    async def one(checkpoint: bool) -> None:
        # An Agent per run: runs sharing one Agent scan each other's tool
        # configuration every turn (run_internal/agent_tool_configuration.py,
        # `_observe_tools`), which is quadratic in the runs in flight.
        agent = (
            shared[checkpoint]
            if SHARED_AGENT
            else Agent(name="bench", model=models[checkpoint], tools=[add])
        )
        result = await Runner.run(agent, PROMPT)
        assert result.final_output == ANSWER, result.final_output
        outputs = [
            item.output
            for item in result.new_items
            if item.type == "tool_call_output_item"
        ]
        assert outputs == [3, 6, 10], outputs

    yield Subject("openai-agents", one, counter=counter)


if __name__ == "__main__":
    main(
        make_subject,
        name="openai-agents",
        version=version("openai-agents"),
        imports=["agents"],
    )
