"""What the states share about the current turn: the next request, the context
writes, the queues, the limits and stop conditions, the `finish_turn` callback."""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentfsm._text import encodable
from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import InferenceInput, InferenceOutput, RequestMetadata
from agentfsm.messages import ContextItem, FunctionCallOutputItem, UserMessage
from agentfsm.options import QueueMode, TurnSnapshot
from agentfsm.record import callable_name
from agentfsm.tools import Tool

from .repair import normalized
from .steps import _T, Step

if TYPE_CHECKING:
    from .loop import Loop

__all__ = (
    "drain",
    "finish_turn",
    "infer_step",
    "request_metadata",
    "stop_check",
    "tool_index",
    "write",
)


def infer_step(loop: Loop) -> Step:
    """The step to the next model request: the loop's input, repaired if the
    context holds calls without outputs, its forced tool choice released after
    the loop's first request."""
    request = loop.input
    if loop.model_requests and request.reset_tool_choice is not None:
        request = released(loop)
    items = request.context.items
    scan = loop.scan
    loop.history = len(items)
    if scan.clean(items):
        loop.metadata = None  # nothing to repair: the request as it is
    else:
        request, loop.metadata = normalized(request, scan)
    return (_T.infer_streaming if request.streaming else _T.infer, request, None)


def released(loop: Loop) -> InferenceInput:
    """The loop's input with `tool_choice` set to its `reset_tool_choice`: a loop forces
    its tool on its first request only ("force once, then auto"), whatever
    enters the context after it (steering is a user message, which on its own
    would make `effective_tool_choice` force the tool again)."""
    request = loop.input
    if request.tool_choice == request.reset_tool_choice:
        return request
    if loop.released is None:  # made once per loop
        update = {"tool_choice": request.reset_tool_choice}
        loop.released = request.model_copy(update=update)
    return loop.released


def request_metadata(loop: Loop) -> RequestMetadata:
    """The metadata of the request `infer_step` made: made on first read (most
    requests have no handler or wrapper to read it), then the same object."""
    metadata = loop.metadata
    if metadata is None:
        metadata = loop.metadata = RequestMetadata(loop.history)
    return metadata


def drain(queue: deque[UserMessage], mode: QueueMode) -> tuple[UserMessage, ...]:
    """Take what a queue releases this turn: everything, or its first message."""
    if mode == "one-at-a-time":
        return (queue.popleft(),) if queue else ()
    drained = tuple(queue)
    queue.clear()
    return drained


def write(loop: Loop, items: list[ContextItem]) -> None:
    """Append to the context; items the loop writes never need a repair scan."""
    context_items = loop.input.context.items
    before = len(context_items)
    context_items.extend(items)
    loop.scan.skip(context_items, before, len(context_items))


def tool_index(loop: Loop) -> dict[str, Tool]:
    """The tools of the last request by name (rebuilt only when they change)."""
    tools = loop.request.tools
    if loop.tools_of is not tools:
        loop.tools_by_name = {t.name: t for t in tools}
        loop.tools_of = tools
    return loop.tools_by_name


def stop_check(loop: Loop) -> str | None:
    """Why the loop must stop after this turn (limit or stop condition), or None."""
    if loop.model_requests >= loop.options.max_turns:
        return "max_turns"
    if loop.options.stop_when:
        view = loop.view()
        for condition in loop.options.stop_when:
            verdict = condition(view)
            if verdict is None or verdict is False or verdict == "":
                continue
            if verdict is True:
                return "stop_condition"
            if isinstance(verdict, str):
                return encodable(verdict)
            raise ConfigurationError(
                f"stop condition {callable_name(condition)} returned "
                f"{type(verdict).__name__}: it returns a bool, a str (the reason) "
                "or None"
            )
    return None


async def finish_turn(
    loop: Loop,
    output: InferenceOutput | None,
    outputs: Sequence[FunctionCallOutputItem],
) -> None:
    """Await the loop's `finish_turn` callback with a copy of the turn."""
    callback = loop.options.finish_turn
    assert callback is not None  # callers check first, to skip the coroutine
    if output is None:
        return
    snapshot = TurnSnapshot(
        loop_id=loop.loop_id,
        agent_id=loop.agent_id,
        turn=loop.model_requests,
        output=output,
        tool_outputs=tuple(outputs),
        context=tuple(loop.input.context.items),
    )
    result = callback(snapshot)
    if inspect.isawaitable(result):
        await result
