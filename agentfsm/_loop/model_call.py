"""One model request: the provider, under its timeout, with transient retries,
streamed chunk by chunk when the request streams.

The request reaching here is already repaired (`repair`) and wrapped (the model
wrappers run around `request_model`; see `states.inference`). A stream's
`UsageUpdate`s are not published: the last one is added to the loop's usage
when the stream ends without its output (cancelled, failed, timed out), each
attempt's own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Final

import anyio

from agentfsm._errors import error_text
from agentfsm.exceptions import OutputLimitExceeded, ProviderError, ProviderTimeout
from agentfsm.inference import (
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    StreamEvent,
    UsageUpdate,
)
from agentfsm.messages import TokenUsage

from .bounds import checked_delta, checked_usage

if TYPE_CHECKING:
    from .loop import Loop

__all__ = ("request_model",)

_MAX_BACKOFF: Final = 8.0


async def request_model(
    loop: Loop, request: InferenceInput, streaming: bool
) -> InferenceOutput:
    """The innermost model call: the provider, with timeout and transient retries."""
    options = loop.options
    timeout = options.inference_timeout
    # A stream's own bound, when it is the nearer one: a server trickling
    # chunks never times out a read, so only a deadline ends it.
    limit = options.max_stream_seconds if streaming else None
    if limit is not None and (timeout is None or limit < timeout):
        timeout = limit
    else:
        limit = None
    attempt = 0
    while True:
        published = loop.seq
        try:
            provider = loop.providers.resolve(request.model)
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
                    if limit is not None:
                        raise OutputLimitExceeded(
                            f"the stream from {request.model!r} ran past "
                            f"max_stream_seconds={timeout:g}",
                            limit="max_stream_seconds",
                        )
                    raise ProviderTimeout(
                        f"the request to {request.model!r} timed out after {timeout:g}s"
                    )
        except ProviderError as exc:
            chunks_sent = streaming and loop.seq != published
            if not exc.retryable or attempt >= options.max_retries or chunks_sent:
                raise
            delay = min(options.retry_backoff * 2**attempt, _MAX_BACKOFF)
            attempt += 1
            loop.log.warning(
                "model_retry",
                model=request.model,
                attempt=attempt,
                error=error_text(exc),
            )
        else:
            if not isinstance(output, InferenceOutput):
                raise ProviderError(
                    f"provider for {request.model!r} returned {type(output).__name__}, "
                    "not an InferenceOutput"
                )
            return output
        # The backoff sleeps outside the `except`: a cancellation during it
        # would carry the error (and, through its traceback, the loop) as its
        # context, which anyio's asyncio task keeps until the collector runs.
        await anyio.sleep(delay)
        if loop.journal is not None:
            await loop.journal.act()  # a stall may have outlasted the lease


async def _stream(
    loop: Loop,
    stream: AbstractAsyncContextManager[AsyncIterator[StreamEvent]],
    model: str,
) -> InferenceOutput:
    output: InferenceOutput | None = None
    seen: TokenUsage | None = None  # the last `UsageUpdate`
    index = chars = 0
    options = loop.options
    try:
        async with stream as deltas:
            async for delta in deltas:
                if isinstance(delta, OutputCompleted):
                    output = delta.output
                    continue  # read to the end, so the provider's iterator finishes
                if output is not None:
                    raise ProviderError(
                        f"the stream from {model!r} sent a chunk after its output"
                    )
                if isinstance(delta, UsageUpdate):
                    seen = checked_usage(delta.usage, model)
                    continue
                delta, chars = checked_delta(delta, model, options, chars)
                loop.emit_stream(index, delta)
                index += 1
                if loop.outbox is not None:
                    await loop.flush()
        if output is None:
            raise ProviderError(
                f"the stream from {model!r} ended without a completed output"
            )
    except BaseException:
        # Cancelled, failed or timed out: the tokens the server said it spent
        # count in the loop's total (`completed` counts a returned output's).
        if seen is not None:
            loop.usage = loop.usage + seen
        raise
    return output
