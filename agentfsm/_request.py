"""Making one model request: normalize the context, wrap, time out, retry, stream.

Normalization works on a copy: a function call without an output (left by a
crash or a cancellation upstream) gets a synthetic error output in the request
only, never in the loop's context. Finding such calls is incremental: each
request scans only the items appended since the previous one, so a step costs
the same whatever the context's length.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Final, TypeVar

import anyio

from .exceptions import ProviderError, ProviderTimeout
from .inference import (
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    RequestMetadata,
    StreamEvent,
)
from .messages import (
    ContextItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ModelContext,
)

if TYPE_CHECKING:
    from ._loop import Loop

__all__ = (
    "ContextScan",
    "chain_wrappers",
    "normalized",
    "request_model",
)

REPAIRED: Final = (
    "no output was recorded for this call (it was interrupted before it finished)"
)
_MAX_BACKOFF: Final = 8.0

In = TypeVar("In")
Out = TypeVar("Out")


class ContextScan:
    """Tracks the function calls of a context that have no output yet."""

    __slots__ = ("_items", "_open", "_scanned")

    def __init__(self) -> None:
        self._items: list[ContextItem] | None = None
        self._scanned = 0
        self._open: dict[str, int] = {}

    def open_calls(self, items: list[ContextItem]) -> dict[str, int]:
        """`call_id -> index` of the calls without an output in `items`."""
        if items is not self._items or len(items) < self._scanned:
            self._items, self._scanned, self._open = items, 0, {}
        open_calls = self._open
        for index in range(self._scanned, len(items)):
            item = items[index]
            if isinstance(item, FunctionCallItem):
                open_calls[item.call_id] = index
            elif isinstance(item, FunctionCallOutputItem):
                open_calls.pop(item.call_id, None)
        self._scanned = len(items)
        return open_calls

    def clean(self, items: list[ContextItem]) -> bool:
        """Whether `items` is known to have no call without an output (the scan
        read every item and found none open): then `open_calls` has nothing to do."""
        return items is self._items and self._scanned == len(items) and not self._open

    def skip(self, items: list[ContextItem], before: int, after: int) -> None:
        """Mark `items[before:after]` scanned: the loop wrote them, calls with outputs.

        Only when the scan had reached `before`; otherwise the next scan reads them.
        """
        if items is self._items and self._scanned == before:
            self._scanned = after


# The slot's descriptor: reading the slot through it skips the model's `__getattr__`.
_scan_slot = ModelContext.__dict__["_scan"]


def context_scan(context: ModelContext) -> ContextScan:
    """The scan kept with `context`, shared by every loop appending to it."""
    try:
        scan: ContextScan = _scan_slot.__get__(context)
    except AttributeError:  # the context's first loop
        scan = ContextScan()
        _scan_slot.__set__(context, scan)
    return scan


def normalized(
    request: InferenceInput, scan: ContextScan
) -> tuple[InferenceInput, RequestMetadata | None]:
    """The request to send (a repaired copy when calls lack outputs) and, for a
    repaired one, its metadata (see `metadata`)."""
    items = request.context.items
    open_calls = scan.open_calls(items)
    if not open_calls:
        return request, None
    # Each synthetic output goes after the run of calls and outputs holding its
    # call, so providers that group a turn's calls still see them together.
    inserts: dict[int, list[tuple[int, str]]] = {}
    for call_id, index in sorted(open_calls.items(), key=lambda kv: kv[1]):
        end = index
        while end + 1 < len(items) and items[end + 1].type in (
            "function_call",
            "function_call_output",
        ):
            end += 1
        inserts.setdefault(end, []).append((index, call_id))
    repaired: list[ContextItem] = []
    repairs: list[tuple[int, int, str]] = []
    for index, item in enumerate(items):
        repaired.append(item)
        for call_index, call_id in inserts.get(index, ()):
            repairs.append((len(repaired), call_index, call_id))
            repaired.append(FunctionCallOutputItem.error(call_id, REPAIRED))
    context = request.context.model_copy(update={"items": repaired})
    return request.model_copy(update={"context": context}), RequestMetadata(
        len(items), repairs
    )


def chain_wrappers(
    wrappers: Sequence[Callable[[In, Callable[[In], Awaitable[Out]]], Awaitable[Out]]],
    innermost: Callable[[In], Awaitable[Out]],
) -> Callable[[In], Awaitable[Out]]:
    """Compose `(value, next)` wrappers around `innermost`, the first outermost
    (the model wrappers around the provider call, the tool wrappers around a tool)."""
    chain = innermost
    for wrapper in reversed(wrappers):
        chain = _bind(wrapper, chain)
    return chain


def _bind(
    wrapper: Callable[[In, Callable[[In], Awaitable[Out]]], Awaitable[Out]],
    inner: Callable[[In], Awaitable[Out]],
) -> Callable[[In], Awaitable[Out]]:
    def call(value: In) -> Awaitable[Out]:
        return wrapper(value, inner)

    return call


async def request_model(
    loop: Loop, request: InferenceInput, streaming: bool
) -> InferenceOutput:
    """The innermost model call: the provider, with timeout and transient retries."""
    options = loop.options
    timeout = options.inference_timeout
    attempt = 0
    while True:
        published = loop.seq
        try:
            provider = loop._runtime.providers.resolve(request.model)
            call = (
                _stream(loop, provider.stream(request), request.model)
                if streaming
                else provider.complete(request)
            )
            if timeout is None:
                output = await call
            else:
                with anyio.CancelScope(
                    deadline=anyio.current_time() + timeout
                ) as scope:
                    output = await call
                if scope.cancelled_caught:
                    raise ProviderTimeout(
                        f"the request to {request.model!r} timed out after {timeout:g}s"
                    )
        except ProviderError as exc:
            chunks_sent = streaming and loop.seq != published
            if not exc.retryable or attempt >= options.max_retries or chunks_sent:
                raise
            delay = min(options.retry_backoff * 2**attempt, _MAX_BACKOFF)
            attempt += 1
            loop._log.warning(
                "model_retry", model=request.model, attempt=attempt, error=str(exc)
            )
            await anyio.sleep(delay)
            continue
        if not isinstance(output, InferenceOutput):
            raise ProviderError(
                f"provider for {request.model!r} returned {type(output).__name__}, "
                "not an InferenceOutput"
            )
        return output


async def _stream(
    loop: Loop,
    stream: AbstractAsyncContextManager[AsyncIterator[StreamEvent]],
    model: str,
) -> InferenceOutput:
    output: InferenceOutput | None = None
    index = 0
    async with stream as deltas:
        async for delta in deltas:
            if isinstance(delta, OutputCompleted):
                output = delta.output
                continue  # read to the end, so the provider's iterator finishes cleanly
            if output is not None:
                raise ProviderError(
                    f"the stream from {model!r} sent a chunk after its output"
                )
            loop._emit("inference.stream", index=index, delta=delta)
            index += 1
            if loop._outbox:
                await loop._flush()
    if output is None:
        raise ProviderError(
            f"the stream from {model!r} ended without a completed output"
        )
    return output
