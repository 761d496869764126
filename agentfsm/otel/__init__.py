"""OpenTelemetry spans of a runtime's loops, following the GenAI semantic conventions.

`Runtime(extensions=[OpenTelemetry()])` traces every loop of the runtime (the
`agentfsm[otel]` extra: it needs only `opentelemetry-api`):

| span | kind | what |
|---|---|---|
| `invoke_agent {agent_id}` | INTERNAL | one run of a loop; a paused loop ends its span, and the resumed run is a new span that links to it |
| `chat {model}` | CLIENT | one request to a provider: `gen_ai.provider.name`, the request's settings, the usage, the finish reason, `gen_ai.response.time_to_first_chunk` for a stream |
| `execute_tool {tool}` | INTERNAL | one tool call, with `gen_ai.tool.call.id` |

Each committed transition is an `agentfsm.transition` event of the loop's
span, and each decision of an interception handler (proceed, rewrite, pause,
abort) an `agentfsm.decision` event naming the handler and its reason. A span
is current while its work runs, so the spans of a provider's HTTP client nest
under `chat`, and what a tool does (in a worker thread too) under `execute_tool`.

Messages, instructions, tool descriptions, arguments and results are recorded
only when content capture is on: `capture_content=True`, or, when it is not
given, `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true` in the
environment. So are the texts that may quote them: a tool's error output, an
exception's message and traceback, a failed loop's reason; with capture off a
span records their type (`error.type`) and says `content not captured` in their
place. Text is recorded with its lone surrogates escaped (`\\udcff`), and a
tracer, span processor or exporter that fails is logged (`otel_failed`): the
loop goes on as it would untraced.

A span never holds an image's bytes. With content capture on, an image is its
reference: a `file` part (`modality: image`, `mime_type`, `file_id`: its
`sha256:` digest, `size`) in the messages, and a tool's images as such parts
in `agentfsm.tool.call.images`; an image by URL is a `uri` part.

With no tracer provider configured (OpenTelemetry's default, a proxy until one
is set) the extension takes no part in a loop (it costs the lookups that find
no provider, when the loop is built) and makes no span; the first loop started
once a provider is set is traced.

Example:
    ```python
    from opentelemetry.sdk.trace import TracerProvider

    from agentfsm import Runtime
    from agentfsm.otel import OpenTelemetry, conversation

    async with Runtime(
        providers=providers,
        extensions=[OpenTelemetry(tracer_provider=TracerProvider())],
    ) as runtime:
        with conversation("support-ticket-42"):  # gen_ai.conversation.id (default: the loop id)
            loop_id = runtime.run_loop("support", "Where is my order?", request)
        await runtime.wait(loop_id)
    ```
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Final, final

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.trace import (
        NoOpTracer,
        ProxyTracerProvider,
        Span,
        Tracer,
        TracerProvider,
    )
except ImportError as exc:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "agentfsm.otel needs opentelemetry-api: pip install 'agentfsm[otel]'"
    ) from exc

from agentfsm.exceptions import ConfigurationError
from agentfsm.extensions import Extension, LoopExtension, LoopInfo
from agentfsm.otel._loop_trace import Decisions, LoopTrace
from agentfsm.otel._model import TracedProvider
from agentfsm.otel._spans import guarded
from agentfsm.results import LoopStatus

if TYPE_CHECKING:
    from agentfsm._bus import EventBus
    from agentfsm.providers import Provider
    from agentfsm.tools import ToolCall, ToolNext, ToolResult

__all__ = ("CAPTURE_CONTENT_ENV", "OpenTelemetry", "conversation")

CAPTURE_CONTENT_ENV: Final = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
"""The environment variable that turns content capture on (`true`, or the
`span_only` / `span_and_event` modes of opentelemetry-util-genai)."""

_CAPTURING: Final = frozenset({"true", "1", "yes", "on", "span_only", "span_and_event"})

_conversation: ContextVar[str | None] = ContextVar(
    "agentfsm_otel_conversation", default=None
)


@contextmanager
def conversation(conversation_id: str) -> Iterator[None]:
    """Loops started (or resumed) inside this block get `conversation_id` as
    their `gen_ai.conversation.id`, instead of their loop id.

    A loop keeps the conversation of its first run.

    Raises:
        ConfigurationError: `conversation_id` is not a non-empty str.
    """
    given: object = conversation_id  # checked for callers without a type checker
    if not isinstance(given, str) or not given:
        raise ConfigurationError(
            f"conversation_id must be a non-empty str, got {conversation_id!r}"
        )
    token = _conversation.set(conversation_id)
    try:
        yield
    finally:
        _conversation.reset(token)


def _global_provider() -> TracerProvider | None:
    """OpenTelemetry's global tracer provider, or None while none is set.

    `trace.get_tracer_provider()` answers the same, but while none is set it
    looks `OTEL_PYTHON_TRACER_PROVIDER` up in `os.environ` on every call (a
    KeyError raised and caught: `make bench-instructions` counted ~5,000 to
    10,000 instructions more per loop, more than the rest of the hooks). The variable is honoured once, when an
    `OpenTelemetry` is made; then the module's global is read (the API's own
    `ProxyTracer` reads it too), with `get_tracer_provider` as the fallback
    should a later API keep it elsewhere.
    """
    provider = getattr(trace, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is _UNKNOWN:
        return trace.get_tracer_provider()
    assert provider is None or isinstance(provider, TracerProvider)
    return provider


_UNKNOWN: Final = object()


def _capture_from_env() -> bool:
    return os.environ.get(CAPTURE_CONTENT_ENV, "").strip().lower() in _CAPTURING


@final
class OpenTelemetry(Extension):
    """Traces a runtime's loops: pass it as `Runtime(extensions=[...])`.

    One instance may serve several runtimes.

    Args:
        tracer_provider: where the spans go (default: OpenTelemetry's global
            provider, looked up as each loop is built until one is set: a
            loop built before then is not traced).
        capture_content: record messages, instructions, tool definitions, tool
            arguments and results (default: what
            `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT` says, read now).
        provider_names: `gen_ai.provider.name` by model prefix, for prefixes of
            your own (`{"corp": "azure.ai.openai"}`). The built-in prefixes are
            `openai`, `anthropic` and, for `local:`, `llama.cpp`; another prefix
            is its own name, unless it is served by a built-in provider.

    Raises:
        ConfigurationError: an argument of the wrong type.
    """

    __slots__ = (
        "_decisions",
        "_loops",
        "_off",
        "_provider",
        "_tracer",
        "capture_content",
        "provider_names",
    )

    def __init__(
        self,
        *,
        tracer_provider: TracerProvider | None = None,
        capture_content: bool | None = None,
        provider_names: Mapping[str, str] | None = None,
    ) -> None:
        if tracer_provider is not None and not isinstance(
            tracer_provider, TracerProvider
        ):
            raise ConfigurationError(
                "tracer_provider must be an opentelemetry TracerProvider, got "
                f"{type(tracer_provider).__name__}"
            )
        if capture_content is not None and not isinstance(capture_content, bool):
            raise ConfigurationError(
                f"capture_content must be a bool or None, got {capture_content!r}"
            )
        given: object = provider_names or {}  # checked for callers without mypy
        if not isinstance(given, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in given.items()
        ):
            raise ConfigurationError(
                f"provider_names must map prefixes to names (str to str), got {given!r}"
            )
        self.capture_content = (
            _capture_from_env() if capture_content is None else capture_content
        )
        """Whether messages, tool arguments and results are recorded."""
        self.provider_names: Mapping[str, str] = dict(provider_names or {})
        self._provider = tracer_provider
        if tracer_provider is None and "OTEL_PYTHON_TRACER_PROVIDER" in os.environ:
            trace.get_tracer_provider()  # loads the provider it names, once
        self._tracer: Tracer | None = None
        self._off = False
        """The provider makes no spans (a no-op one, or the SDK disabled)."""
        self._loops: dict[str, LoopTrace] = {}
        """The traced loops that have not ended, by id."""
        self._decisions: dict[EventBus, Decisions] = {}

    def _active_tracer(self) -> Tracer | None:
        """The tracer, or None while there is nothing to trace to."""
        if self._tracer is not None or self._off:
            return self._tracer
        provider = self._provider or _global_provider()
        if provider is None or isinstance(provider, ProxyTracerProvider):
            return None  # nothing set yet: looked up again at the next loop
        from agentfsm import __version__

        tracer = provider.get_tracer("agentfsm", __version__)
        if isinstance(tracer, NoOpTracer):
            self._off = True  # a provider, once set, is never replaced
            return None
        self._tracer = tracer
        return tracer

    # --------------------------------------------------------- the extension

    def open(self, loop: LoopInfo, /) -> LoopExtension | None:
        """Trace `loop`, if there is a tracer to trace to (else it costs the
        loop nothing)."""
        if self._tracer is None and self._active_tracer() is None:
            return None
        return _Traced(self, loop)

    # ------------------------------------------------------------------ loops

    def _trace(self, loop: LoopInfo, tracer: Tracer) -> LoopTrace:
        decisions = None
        if loop.handlers:
            decisions = self._decisions.get(loop.bus)
            if decisions is None:
                decisions = Decisions.open(loop.bus, self._loops)
                if decisions is not None:
                    self._decisions[loop.bus] = decisions
        trace_ = LoopTrace(
            loop,
            tracer,
            capture_content=self.capture_content,
            provider_names=self.provider_names,
            conversation_id=_conversation.get() or loop.loop_id,
            decisions=decisions,
        )
        if decisions is not None:
            decisions.users += 1
        self._loops[loop.loop_id] = trace_
        return trace_

    def _forget(self, trace_: LoopTrace) -> None:
        del self._loops[trace_.loop_id]
        decisions = trace_.decisions
        if decisions is not None:
            decisions.users -= 1
            if not decisions.users:
                # No traced loop with handlers is left on the bus: unsubscribe,
                # so its loops build no event fields for it.
                decisions.close()
                self._decisions = {
                    bus: d for bus, d in self._decisions.items() if d is not decisions
                }


@final
class _Traced(LoopExtension):
    """`OpenTelemetry`'s part in one loop. Its trace begins with the loop's
    first run (`start_run`); before that, and once it ended, it passes
    everything through."""

    __slots__ = ("_info", "_otel", "_trace")

    def __init__(self, otel: OpenTelemetry, info: LoopInfo) -> None:
        self._otel = otel
        self._info = info
        self._trace: LoopTrace | None = None

    def start_run(self, start: Callable[[], None], /) -> None:
        """Hand the run to a worker with its segment's span current (the worker
        runs it in a copy of this context; the caller's is left as it was)."""
        span = guarded("start_run", self._begin_run, otherwise=None)
        if span is None:  # nothing to trace to: the loop runs as it would
            start()
            return
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            start()
        finally:
            otel_context.detach(token)

    def _begin_run(self) -> Span | None:
        """The span of the run about to start; None if nothing is traced."""
        trace_ = self._trace
        info = self._info
        otel = self._otel
        if trace_ is None:
            # A loop this instance traced in another runtime (handed over,
            # or left paused in a store and taken up) goes on with its trace:
            # its segments link, its conversation is kept.
            trace_ = self._trace = otel._loops.get(info.loop_id)
        if trace_ is None:
            tracer = otel._tracer or otel._active_tracer()
            if tracer is None:
                return None
            trace_ = self._trace = otel._trace(info, tracer)
        elif trace_.span is not None:
            # Resumed while its paused run was still publishing the pause: that
            # run goes on with the resumed part, which is a segment of its own.
            trace_.end_segment(info)
        return trace_.begin(info, in_run=True)

    def run_ended(self) -> None:
        """A run returned: its segment ends."""
        trace_ = self._trace
        if trace_ is None:
            return
        guarded("run_ended", trace_.end_segment, self._info, otherwise=None)
        if self._info.status is LoopStatus.done:
            self._otel._forget(trace_)

    def loop_ended(self) -> None:
        """The loop ended: its outcome goes on its last segment."""
        trace_ = self._trace
        if trace_ is None:
            return
        guarded("loop_ended", trace_.ended, self._info, otherwise=None)
        if not trace_.in_run:  # ended without a run: no `run_ended` follows
            self._otel._forget(trace_)

    def committed(self) -> None:
        trace_ = self._trace
        if trace_ is not None:
            trace_.committed(self._info)

    def provider(self, provider: Provider, /) -> Provider:
        trace_ = self._trace
        return provider if trace_ is None else TracedProvider(provider, trace_)

    async def call_tool(self, call: ToolCall, next_: ToolNext, /) -> ToolResult:
        trace_ = self._trace
        if trace_ is None:
            return await next_(call)
        return await trace_.execute_tool(call, next_)
