"""One traced loop: its `invoke_agent` spans, their events, its tool spans.

A loop is traced in segments: each run of it (from `run_loop`, from a resume,
from a cancel that ends it while paused) is one `invoke_agent {agent_id}` span,
which links to the segment before it. A paused loop holds no task, and a span
open for the hours a human takes to approve a call would be an open span that
no backend shows until it ends.

The spans of a segment (its `chat` and `execute_tool` spans, and whatever the
handlers, tools and providers open) nest under it: the runtime starts the run
with the segment's span current (`_Traced.start_run`, the extension's part). Each committed
transition is an `agentfsm.transition` event of the segment's span, and each
handler's decision an `agentfsm.decision` event (read from the bus: see
`Decisions`).

A failed loop's reason and error message may quote a model's answer or a
tool's output: they are recorded only when content is captured
(`content.untrusted`). The reasons a handler, a stop condition or a
`cancel` gives are the application's own, and are recorded as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Tracer

from agentfsm.events import TransitionIntercepted
from agentfsm.exceptions import BusClosed
from agentfsm.messages import TokenUsage
from agentfsm.providers import split_model
from agentfsm.record import callable_name
from agentfsm.results import LoopStatus
from agentfsm.states import Outcome, Trigger
from agentfsm.tools import ToolCall, ToolNext, ToolResult

from . import _content as content
from ._spans import (
    METADATA_CHARS,
    NO_SPAN,
    add_event,
    end,
    failed,
    guarded,
    provider_name,
    set_attributes,
    set_error,
    start_span,
)

if TYPE_CHECKING:
    from agentfsm._bus import EventBus, Subscription
    from agentfsm.extensions import LoopInfo

__all__ = ("Decisions", "LoopTrace")


class Decisions:
    """The interception decisions of a bus's loops, as they are published.

    A decision is published as `transition.intercepted` and nowhere else, so a
    traced loop with handlers reads them from one subscription per bus, shared
    by the bus's traced loops and open while one of them lives (while it is
    open, the bus listens: every loop of the bus passes its events' fields to
    the emitter, which drops those nobody takes, `loop.started` unbuilt). It
    is never awaited: the traced loops drain it in
    their own hooks (at each commit, at the end of a run), so each decision
    becomes an event of its loop's span in that loop's own task, stamped with
    the time it was published.
    """

    __slots__ = ("_subscription", "_traces", "users")

    def __init__(self, subscription: Subscription, traces: Mapping[str, LoopTrace]):
        self._subscription = subscription
        self._traces = traces
        self.users = 0
        """The traced loops reading it; closed when the last one ends."""

    @classmethod
    def open(cls, bus: EventBus, traces: Mapping[str, LoopTrace]) -> Decisions | None:
        try:
            return cls(bus.subscribe("transition.intercepted"), traces)
        except BusClosed:  # the runtime is closing: no decision comes any more
            return None

    def drain(self) -> None:
        """Turn every decision published so far into an event of its loop's span."""
        subscription = self._subscription
        traces = self._traces
        while True:
            try:
                event = subscription.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                return
            trace_ = traces.get(event.loop_id)
            if trace_ is not None and isinstance(event, TransitionIntercepted):
                trace_.add_decision(event)

    def close(self) -> None:
        self._subscription.close()


class LoopTrace:
    """What is traced of one loop, from its first run to its end."""

    __slots__ = (
        "agent_id",
        "capture_content",
        "conversation_id",
        "decisions",
        "first_seq",
        "handlers",
        "in_run",
        "loop_id",
        "model",
        "previous",
        "provider",
        "provider_names",
        "segments",
        "span",
        "tracer",
        "usage_at_start",
    )

    def __init__(
        self,
        loop: LoopInfo,
        tracer: Tracer,
        *,
        capture_content: bool,
        provider_names: Mapping[str, str],
        conversation_id: str,
        decisions: Decisions | None,
    ) -> None:
        self.tracer = tracer
        self.capture_content = capture_content
        self.provider_names = provider_names
        self.conversation_id = conversation_id
        self.decisions = decisions
        self.loop_id = loop.loop_id
        self.agent_id = loop.agent_id
        self.handlers = tuple(callable_name(h) for h in loop.handlers)
        prefix, self.model = split_model(loop.model)
        served_by = loop.resolve_provider()  # (only names depend on it)
        self.provider = provider_name(prefix, served_by, provider_names)
        self.span: Span | None = None
        """The open segment's span."""
        self.in_run = False
        """Whether the open segment is a run (a worker ends it when the run returns)."""
        self.previous: SpanContext | None = None
        """The last segment's span, which the next one links to."""
        self.segments = 0
        self.usage_at_start = loop.usage
        self.first_seq = loop.seq
        """The last event's number when the open segment began."""

    # ---------------------------------------------------------------- segments

    def begin(self, loop: LoopInfo, *, in_run: bool) -> Span:
        """Open a segment's span, a child of the current span (whoever started,
        resumed or cancelled the loop), linked to the last segment."""
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": self.agent_id,
            "gen_ai.conversation.id": self.conversation_id,
            "gen_ai.provider.name": self.provider,
            "gen_ai.request.model": self.model,
            "agentfsm.loop_id": self.loop_id,
            "agentfsm.segment": self.segments,
        }
        if self.capture_content and self.segments == 0:
            message = loop.pending_message  # the first step's: the loop's message
            if message is not None:
                attributes["gen_ai.input.messages"] = content.input_messages([message])
        links: tuple[Link, ...] = ()
        if self.previous is not None:
            links = (Link(self.previous, {"agentfsm.link": "resumes"}),)
        span = self.span = start_span(
            self.tracer,
            f"invoke_agent {self.agent_id}",
            SpanKind.INTERNAL,
            attributes,
            links,
        )
        self.in_run = in_run
        self.usage_at_start = loop.usage
        self.first_seq = loop.seq
        return span

    def end_segment(self, loop: LoopInfo) -> None:
        """End the open segment (the loop ended, or paused)."""
        span = self.span
        if span is None:
            return
        try:
            if self.decisions is not None:
                self.decisions.drain()
            attributes: dict[str, Any] = _usage(loop.usage, self.usage_at_start)
            if loop.status is not LoopStatus.done:
                # Paused (a resume calls `start_run` before it applies its decision).
                attributes["agentfsm.status"] = "paused"
                if loop.pause_reason is not None:
                    attributes["agentfsm.pause_reason"] = loop.pause_reason
            set_attributes(span, attributes)
        finally:
            end(span)
            self.previous = span.get_span_context()
            self.span = None
            self.in_run = False
            self.segments += 1

    def ended(self, loop: LoopInfo) -> None:
        """Record how the loop ended on its segment (one opened for it if it
        ended while paused, with no run: the runtime closed, its deadline)."""
        try:
            if self.decisions is not None:
                self.decisions.drain()
            self._outcome(self.span or self.begin(loop, in_run=False), loop)
        finally:
            if not self.in_run:
                self.end_segment(loop)

    def _outcome(self, span: Span, loop: LoopInfo) -> None:
        failure = loop.outcome is Outcome.failed
        attributes: dict[str, Any] = {
            "agentfsm.outcome": str(loop.outcome),
            "agentfsm.model_requests": loop.model_requests,
            "agentfsm.tool_calls": loop.tool_calls,
        }
        if loop.reason is not None:
            attributes["agentfsm.reason"] = self._reason(loop.reason, failure)
        if self.capture_content and loop.answer is not None:
            attributes["gen_ai.output.messages"] = content.answer_messages(loop.answer)
        error = loop.error
        if failure and error is not None:
            attributes["error.type"] = error.type
            message = content.untrusted(error.message, self.capture_content)
            exception = {"exception.type": error.type}
            if self.capture_content:
                exception["exception.message"] = message
            add_event(span, "exception", exception)
            set_error(span, message)
        set_attributes(span, attributes)

    def _reason(self, reason: str, failure: bool) -> str:
        """A reason as a span holds it: a failure's is its error's message."""
        return content.untrusted(reason, self.capture_content) if failure else reason

    # ---------------------------------------------------------------- events

    def committed(self, loop: LoopInfo) -> None:
        """The loop's commit hook: the transition, after the decisions about it."""
        guarded("transition", self._committed, loop, otherwise=None)

    def _committed(self, loop: LoopInfo) -> None:
        if self.decisions is not None:
            self.decisions.drain()
        span = self.span or self.begin(loop, in_run=False)
        if not span.is_recording():
            return  # sampled out: the event would be dropped
        step = loop.last_step
        if step is None:
            return
        source, trigger, dest, rewritten_from = step
        attributes = {
            "agentfsm.source": source.value,
            "agentfsm.trigger": trigger.value,
            "agentfsm.dest": dest.value,
            "agentfsm.seq": loop.seq,
        }
        if rewritten_from is not None:
            attributes["agentfsm.rewritten_from"] = rewritten_from.value
        reason = loop.step_reason
        if reason is not None:
            attributes["agentfsm.reason"] = self._reason(
                reason, trigger == Trigger.fail
            )
        add_event(span, "agentfsm.transition", attributes)

    def add_decision(self, event: TransitionIntercepted) -> None:
        """A handler's decision (drained from the bus by `Decisions`)."""
        span = self.span
        if span is None or event.seq <= self.first_seq:
            # Made in an earlier segment, and held until after it ended (for a
            # full backpressure subscriber): it is not this segment's decision.
            return
        index = event.handler
        handler = self.handlers[index] if 0 <= index < len(self.handlers) else None
        attributes: dict[str, Any] = {
            "agentfsm.decision": event.decision,
            "agentfsm.handler": "resume" if index == -1 else handler or str(index),
            "agentfsm.handler_index": index,
            "agentfsm.source": event.source.value,
            "agentfsm.trigger": event.trigger.value,
            "agentfsm.dest": event.dest.value,
        }
        if event.new_dest is not None:
            attributes["agentfsm.new_dest"] = event.new_dest.value
        if event.reason is not None:
            attributes["agentfsm.reason"] = event.reason
        add_event(
            span,
            "agentfsm.decision",
            attributes,
            timestamp=int(event.ts.timestamp() * 1e9),
        )

    # ---------------------------------------------------------------- tools

    async def execute_tool(self, call: ToolCall, next_: ToolNext) -> ToolResult:
        """The tool layer: an `execute_tool {name}` span, current
        while the tool runs (a sync tool's worker thread runs in a copy of the
        context, so it sees the span too)."""
        span = guarded("execute_tool", self._tool_span, call, otherwise=NO_SPAN)
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            result = await next_(call)
        except BaseException as exc:
            failed(span, exc, self.capture_content)
            raise
        else:
            guarded("execute_tool", self._tool_result, span, result, otherwise=None)
            return result
        finally:
            otel_context.detach(token)
            end(span)

    def _tool_span(self, call: ToolCall) -> Span:
        # A tool the request offers is named by the application; a name no
        # tool has is the model's own text, withheld as content is.
        known = call.tool is not None or self.capture_content
        name = call.call.name if known else "unknown"
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.call.id": call.call.call_id[:METADATA_CHARS],
            "gen_ai.tool.type": "function",
        }
        if self.capture_content:
            # An MCP server's tool describes itself: its description is content.
            if call.tool is not None and call.tool.definition.description:
                attributes["gen_ai.tool.description"] = call.tool.definition.description
            attributes["gen_ai.tool.call.arguments"] = call.arguments
        return start_span(
            self.tracer, f"execute_tool {name}", SpanKind.INTERNAL, attributes
        )

    def _tool_result(self, span: Span, result: ToolResult) -> None:
        output = content.untrusted(result.output, self.capture_content)
        if result.is_error:
            set_attributes(span, {"error.type": "tool_error"})
            set_error(span, output)
        if self.capture_content:
            captured = {"gen_ai.tool.call.result": output}
            if result.images:
                # By reference, as the messages hold them: never the bytes.
                captured["agentfsm.tool.call.images"] = content.images(result.images)
            set_attributes(span, captured)


def _usage(now: TokenUsage, before: TokenUsage) -> dict[str, int]:
    """The tokens a segment used (the loop's usage is a running total); with
    how many of its requests reported none, if any did, and no counts when
    none of them reported any (a zero would claim what is not known)."""
    counts = {
        "gen_ai.usage.input_tokens": now.input_tokens - before.input_tokens,
        "gen_ai.usage.output_tokens": now.output_tokens - before.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": now.cached_input_tokens
        - before.cached_input_tokens,
        "gen_ai.usage.reasoning.output_tokens": now.reasoning_tokens
        - before.reasoning_tokens,
    }
    unreported = now.unreported_requests - before.unreported_requests
    if not unreported:
        return counts
    noted = {"agentfsm.usage.unreported_requests": unreported}
    if now.total_tokens == before.total_tokens:
        return noted
    return noted | counts
