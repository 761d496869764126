"""The workload on LangGraph: the prebuilt ReAct agent with a scripted chat model.

`create_react_agent` (langgraph-prebuilt) binds the tools to a `BaseChatModel`
subclass that replies from the script, as a real chat model's `bind_tools`
does. Run by `run.py` with `bench/.venvs/langgraph/bin/python` (see harness.py).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Any

from harness import ANSWER, PROMPT, Counter, Subject, main, script_step
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool, tool
from langchain_core.utils.function_calling import convert_to_openai_tool

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # create_react_agent is deprecated in langgraph 1.x
    from langgraph.prebuilt import create_react_agent


def reply(messages: list[BaseMessage]) -> ChatResult:
    n = sum(isinstance(m, ToolMessage) for m in messages)
    step = script_step(n)
    if step is None:
        message = AIMessage(content=ANSWER)
    else:
        name, args = step
        message = AIMessage(
            content="",
            tool_calls=[{"name": name, "args": args, "id": f"call_{n + 1}"}],
        )
    return ChatResult(generations=[ChatGeneration(message=message)])


class ScriptedChatModel(BaseChatModel):
    """A zero-latency chat model playing the script (optionally yielding once)."""

    checkpoint: bool = False

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        return reply(messages)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.checkpoint:
            await asyncio.sleep(0)
        return reply(messages)

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools], **kwargs)


@asynccontextmanager
async def make_subject() -> AsyncIterator[Subject]:
    counter = Counter()

    @tool
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        counter.n += 1
        return a + b

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agents = {
            cp: create_react_agent(ScriptedChatModel(checkpoint=cp), [add])
            for cp in (False, True)
        }

    async def one(checkpoint: bool) -> None:
        state = await agents[checkpoint].ainvoke({"messages": [("user", PROMPT)]})
        messages = state["messages"]
        assert messages[-1].content == ANSWER, messages[-1]
        outputs = [m.content for m in messages if isinstance(m, ToolMessage)]
        assert outputs == ["3", "6", "10"], outputs

    yield Subject("langgraph", one, counter=counter)


if __name__ == "__main__":
    main(
        make_subject,
        name="langgraph",
        version=f"{version('langgraph')}",
        imports=["langgraph.prebuilt", "langchain_core.language_models"],
    )
