"""Shared test helpers: a typed `add` tool, request builders, handlers."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable, Sequence

import anyio
import pytest

from agentfsm import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    LoopState,
    ModelContext,
    ModelMessageItem,
    Pause,
    PendingTransition,
    Rewrite,
    Tool,
    Trigger,
    UserMessage,
    tool,
)
from agentfsm.messages import ContextItem

needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None,
    reason="graphviz's `dot` is not installed (apt-get install graphviz)",
)


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


def stream_after_tools(pending: PendingTransition) -> Rewrite | None:
    """Rewrite `function_call --infer--> inference` to the streaming edge."""
    if pending.source is LoopState.function_call and pending.trigger is Trigger.infer:
        return Rewrite(dest=LoopState.inference_streaming)
    return None


def pause_tools(pending: PendingTransition) -> Pause | None:
    """Pause before every tool batch."""
    return Pause("approval required") if pending.trigger is Trigger.call_tools else None


async def wait_until(predicate: Callable[[], object]) -> None:
    """Let the other tasks run until `predicate()` holds (a hang guard of 30 s:
    a store's writes run in threads, slow on a loaded machine)."""
    with anyio.fail_after(30):
        while not predicate():
            await anyio.wait_all_tasks_blocked()


def items_of(context: ModelContext) -> list[str]:
    """A compact view of a context: `user:hi`, `call:c1`, `out:c1=3`, `model:done`."""
    view = []
    for item in context.items:
        if isinstance(item, UserMessage):
            view.append(f"user:{item.content}")
        elif isinstance(item, FunctionCallItem):
            view.append(f"call:{item.call_id}")
        elif isinstance(item, FunctionCallOutputItem):
            view.append(f"out:{item.call_id}={'ERR' if item.is_error else item.output}")
        elif isinstance(item, ModelMessageItem):
            view.append(f"model:{item.content}")
    return view


def assert_one_output_per_call(
    items: Sequence[ContextItem], *, ids_repeat: bool = False
) -> None:
    """Every function call of `items` has exactly one output, and no output
    is without its call (call ids are unique, unless `ids_repeat`: a model or
    a handler may give two calls one id; then as many outputs as calls)."""
    called = [i.call_id for i in items if isinstance(i, FunctionCallItem)]
    answered = Counter(
        i.call_id for i in items if isinstance(i, FunctionCallOutputItem)
    )
    if not ids_repeat:
        assert len(set(called)) == len(called), f"a call id repeats: {called}"
    assert Counter(called) == answered, f"a call without exactly one output: {items}"
