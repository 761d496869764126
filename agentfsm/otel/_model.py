"""`chat {model}` spans: one per request a provider is sent.

A traced loop's provider layer (`OpenTelemetry`'s part in the loop) wraps each
provider the loop resolves in a `TracedProvider`. The wrapper is the innermost layer
of a model request, below the model wrappers and the loop's retries: a wrapper
that answers from a cache makes no span, and each retry of a transient error is
a span of its own, as each is a request of its own. The span is current while
the provider works, so the spans of its HTTP client nest under it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from contextvars import Token
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from agentfsm.inference import (
    ImageSupport,
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    UsageUpdate,
)
from agentfsm.messages import TokenUsage
from agentfsm.providers import (
    Provider,
    StreamEvent,
    image_support_of,
    split_model,
)

from . import _content as content
from ._spans import (
    METADATA_CHARS,
    NO_SPAN,
    end,
    failed,
    guarded,
    provider_name,
    server_attributes,
    set_attributes,
    start_span,
)

if TYPE_CHECKING:
    from ._loop_trace import LoopTrace

__all__ = ("TracedProvider",)


class TracedProvider:
    """A provider whose every request is a `chat` span."""

    __slots__ = ("_inner", "_trace")

    def __init__(self, inner: Provider, trace: LoopTrace) -> None:
        self._inner = inner
        self._trace = trace

    def image_support(self, model: str) -> ImageSupport:
        """The traced provider's (a traced loop refuses what it would)."""
        return image_support_of(self._inner, model)

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        trace_ = self._trace
        span = guarded(
            "chat",
            start_chat,
            trace_,
            self._inner,
            request,
            streaming=False,
            otherwise=NO_SPAN,
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            output = await self._inner.complete(request)
        except BaseException as exc:
            failed(span, exc, trace_.capture_content)
            raise
        else:
            # Checked by the loop once the call returns (a provider returning
            # something else fails it): here it only decides what is recorded.
            if isinstance(output, InferenceOutput):
                guarded("chat", record_output, trace_, span, output, otherwise=None)
            return output
        finally:
            otel_context.detach(token)
            end(span)

    def stream(
        self, request: InferenceInput, /
    ) -> AbstractAsyncContextManager[AsyncIterator[StreamEvent]]:
        return _TracedStream(self._trace, self._inner, request)


def start_chat(
    trace_: LoopTrace, provider: Provider, request: InferenceInput, *, streaming: bool
) -> Span:
    """Start a request's span, with the attributes the request tells."""
    prefix, model = split_model(request.model)
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": provider_name(prefix, provider, trace_.provider_names),
        "gen_ai.request.model": model,
        "gen_ai.conversation.id": trace_.conversation_id,
        "gen_ai.request.stream": streaming,
        **server_attributes(provider),
    }
    if request.max_output_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = request.max_output_tokens
    if request.temperature is not None:
        attributes["gen_ai.request.temperature"] = request.temperature
    if request.top_p is not None:
        attributes["gen_ai.request.top_p"] = request.top_p
    if request.seed is not None:
        attributes["gen_ai.request.seed"] = request.seed
    if request.stop_sequences:
        attributes["gen_ai.request.stop_sequences"] = request.stop_sequences
    if request.structured_output is not None:
        attributes["gen_ai.output.type"] = "json"
    span = start_span(trace_.tracer, f"chat {model}", SpanKind.CLIENT, attributes)
    if trace_.capture_content and span.is_recording():
        # After the sampler, and only for a span it keeps: the content grows
        # with the context (the messages are serialized at every request).
        context = request.context
        captured = {"gen_ai.input.messages": content.input_messages(context.items)}
        if context.instructions:
            captured["gen_ai.system_instructions"] = content.system_instructions(
                context.instructions
            )
        if request.tools:
            captured["gen_ai.tool.definitions"] = content.tool_definitions(
                request.tools
            )
        set_attributes(span, captured)
    return span


_FINISH_REASONS: Final = frozenset(
    {
        "stop",
        "length",
        "tool_call",
        "tool_calls",
        "function_call",
        "content_filter",
        "end_turn",
        "max_tokens",
        "stop_sequence",
        "tool_use",
        "pause_turn",
        "refusal",
        "error",
    }
)
"""The finish reasons the providers' APIs define (recorded with content capture
off; any other is recorded as `other`)."""


def record_output(trace_: LoopTrace, span: Span, output: InferenceOutput) -> None:
    """What the response tells: usage, finish reason, its id and model, and
    (when content is captured) the output itself."""
    reason = content.finish_reason(output)
    if not trace_.capture_content and reason not in _FINISH_REASONS:
        reason = "other"  # a server's own words, withheld as content is
    attributes: dict[str, Any] = {"gen_ai.response.finish_reasons": (reason,)}
    usage = output.token_usage
    if usage is not None:  # a request that reported none has no usage attributes
        attributes.update(_usage_attributes(usage))
    raw = output.raw_response
    if isinstance(raw, dict):  # the providers keep the vendor's response here
        # Ids and model names are short; a server's longer text is not metadata.
        if isinstance(response_id := raw.get("id"), str):
            attributes["gen_ai.response.id"] = response_id[:METADATA_CHARS]
        if isinstance(response_model := raw.get("model"), str):
            attributes["gen_ai.response.model"] = response_model[:METADATA_CHARS]
    if trace_.capture_content and span.is_recording():
        attributes["gen_ai.output.messages"] = content.output_messages(output)
    set_attributes(span, attributes)


def _usage_attributes(usage: TokenUsage) -> dict[str, int]:
    """One request's usage as the chat span's attributes."""
    return {
        "gen_ai.usage.input_tokens": usage.input_tokens,
        "gen_ai.usage.output_tokens": usage.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": usage.cached_input_tokens,
        "gen_ai.usage.reasoning.output_tokens": usage.reasoning_tokens,
    }


class _TracedStream:
    """A provider's stream inside a `chat` span, which is current from entering
    the stream to leaving it (the loop reads the stream in one task, so the
    span is attached and detached in the same context)."""

    __slots__ = (
        "_chunks",
        "_inner",
        "_provider",
        "_request",
        "_span",
        "_token",
        "_trace",
    )

    def __init__(
        self, trace_: LoopTrace, provider: Provider, request: InferenceInput
    ) -> None:
        self._trace = trace_
        self._provider = provider
        self._request = request
        self._inner: AbstractAsyncContextManager[AsyncIterator[StreamEvent]] | None = (
            None
        )
        self._span: Span | None = None
        self._token: Token[Context] | None = None
        self._chunks: _Chunks | None = None

    async def __aenter__(self) -> AsyncIterator[StreamEvent]:
        span = self._span = guarded(
            "chat",
            start_chat,
            self._trace,
            self._provider,
            self._request,
            streaming=True,
            otherwise=NO_SPAN,
        )
        started = time.monotonic()
        self._token = otel_context.attach(trace.set_span_in_context(span))
        try:
            self._inner = self._provider.stream(self._request)
            deltas = await self._inner.__aenter__()
        except BaseException as exc:
            guarded("chat", self._finish, exc, otherwise=None)
            raise
        self._chunks = _Chunks(deltas, span, started)
        return self._chunks

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._inner is not None
        try:
            return await self._inner.__aexit__(exc_type, exc, tb)
        except BaseException as error:
            exc = error
            raise
        finally:
            guarded("chat", self._finish, exc, otherwise=None)

    def _finish(self, exc: BaseException | None) -> None:
        span = self._span
        assert span is not None
        assert self._token is not None
        otel_context.detach(self._token)
        chunks = self._chunks
        try:
            if exc is not None:
                failed(span, exc, self._trace.capture_content)
                if chunks is not None and chunks.usage is not None:
                    # What the stream reported before it failed or was cancelled.
                    set_attributes(span, _usage_attributes(chunks.usage))
            elif chunks is not None and chunks.output is not None:
                record_output(self._trace, span, chunks.output)
        finally:
            end(span)


class _Chunks:
    """The stream's deltas, passed on as they come; notes when the first came
    (`gen_ai.response.time_to_first_chunk`) and keeps the completed output."""

    __slots__ = ("_deltas", "_span", "_started", "output", "usage")

    def __init__(
        self, deltas: AsyncIterator[StreamEvent], span: Span, started: float
    ) -> None:
        self._deltas = aiter(deltas)
        self._span = span
        self._started: float | None = started
        """When the request started, until the first chunk came."""
        self.output: InferenceOutput | None = None
        self.usage: TokenUsage | None = None
        """The last `UsageUpdate`'s, for a stream that ends without its output."""

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> StreamEvent:
        delta = await anext(self._deltas)
        if isinstance(delta, UsageUpdate):
            self.usage = delta.usage
            return delta  # not a chunk of the response
        if self._started is not None:
            seconds = time.monotonic() - self._started
            set_attributes(self._span, {"gen_ai.response.time_to_first_chunk": seconds})
            self._started = None
        if isinstance(delta, OutputCompleted):
            self.output = delta.output
        return delta
