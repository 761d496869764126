"""A provider backed by a Python function: the test double and reference provider.

`FunctionProvider(handler)` answers each request with `handler(request)` (sync
or async). Streaming replays that same output as deltas (text in word-sized
chunks, each tool call's id and name first and then its arguments in pieces),
ending with the output itself, so the streaming and non-streaming paths agree.
A `stream_handler` takes over streaming when a test wants specific chunks.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeAlias

from agentfsm.messages import FunctionCallItem, ModelMessageItem, ReasoningItem
from agentfsm.providers import (
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    ReasoningDelta,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
)

__all__ = (
    "FunctionProvider",
    "InferenceFunction",
    "StreamFunction",
    "output_deltas",
    "replay",
)

InferenceFunction: TypeAlias = Callable[
    [InferenceInput], InferenceOutput | Awaitable[InferenceOutput]
]
"""Answers a request, sync or async."""

StreamFunction: TypeAlias = Callable[[InferenceInput], AsyncIterator[StreamEvent]]
"""Streams a request: an async generator ending with `OutputCompleted`."""

_WORDS = re.compile(r"\S+\s*|\s+")


def output_deltas(output: InferenceOutput, *, chunk: int = 8) -> list[StreamEvent]:
    """The deltas a streaming provider would send for `output`, then `OutputCompleted`."""
    deltas: list[StreamEvent] = []
    call_index = 0
    for item in output.items:
        if isinstance(item, ReasoningItem):
            deltas.extend(ReasoningDelta(text=t) for t in _WORDS.findall(item.content))
        elif isinstance(item, ModelMessageItem):
            deltas.extend(TextDelta(text=t) for t in _WORDS.findall(item.content))
        elif isinstance(item, FunctionCallItem):
            deltas.append(
                ToolCallDelta(index=call_index, call_id=item.call_id, name=item.name)
            )
            args = item.arguments
            deltas.extend(
                ToolCallDelta(index=call_index, arguments=args[i : i + chunk])
                for i in range(0, len(args), chunk)
            )
            call_index += 1
    deltas.append(OutputCompleted(output=output))
    return deltas


class FunctionProvider:
    """A provider whose answers come from a function.

    Example:
        ```python
        def answer(request: InferenceInput) -> InferenceOutput:
            return InferenceOutput(items=[ModelMessageItem(content="hello")])

        runtime = Runtime(providers={"fn": FunctionProvider(answer)})
        ```
    """

    __slots__ = ("_handler", "_stream_handler")

    def __init__(
        self,
        handler: InferenceFunction,
        *,
        stream_handler: StreamFunction | None = None,
    ) -> None:
        self._handler = handler
        self._stream_handler = stream_handler

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        """Answer with the handler's output."""
        result = self._handler(request)
        if inspect.isawaitable(result):
            return await result
        return result

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """Stream the handler's output as deltas (or the stream handler's events)."""
        if self._stream_handler is not None:
            events = self._stream_handler(request)
            try:
                yield events
            finally:
                aclose = getattr(events, "aclose", None)
                if aclose is not None:
                    await aclose()
            return
        async with replay(await self.complete(request)) as deltas:
            yield deltas


@asynccontextmanager
async def replay(output: InferenceOutput) -> AsyncIterator[AsyncIterator[StreamEvent]]:
    """`output` streamed as deltas (`output_deltas`), as a provider's `stream` yields them."""
    deltas = _iterate(output_deltas(output))
    try:
        yield deltas
    finally:
        await deltas.aclose()


async def _iterate(deltas: list[StreamEvent]) -> AsyncGenerator[StreamEvent, None]:
    for delta in deltas:
        yield delta
