"""Extensions: what plugs into every loop of a runtime, through one seam.

A loop's side effects go through layers composed once, when the runtime
builds the loop (a new one, or one taken up from a store):

```text
model request:  the loop's model wrappers -> the loop's checks and streaming
                -> each extension's `provider` layer -> the provider
tool call:      the loop's tool wrappers -> each extension's `call_tool`
                layer -> the tool's function
```

and its lifecycle calls each extension's hooks (`start_run`, `committed`,
`run_ended`, `loop_ended`), which see the loop through a read-only
`LoopInfo`. `agentfsm.otel.OpenTelemetry` is one; Temporal's workflow is
another. A runtime without extensions, or a loop none of them takes part in
(`Extension.open` returned None), runs as if there were none: no layer, no
hook, no check per step. What a `LoopExtension` does not override is left
out of the loop altogether.

Example:
    ```python
    from collections import Counter
    from agentfsm.extensions import Extension, LoopExtension, LoopInfo

    class CallCounter(Extension):
        def __init__(self) -> None:
            self.calls: Counter[str] = Counter()

        def open(self, loop: LoopInfo) -> LoopExtension | None:
            return Counted(self.calls, loop.agent_id)

    class Counted(LoopExtension):
        def __init__(self, calls: Counter[str], agent_id: str) -> None:
            self.calls, self.agent_id = calls, agent_id

        async def call_tool(self, call, next_):
            self.calls[self.agent_id] += 1
            return await next_(call)

    async with Runtime(extensions=[CallCounter()]) as runtime: ...
    ```

Hooks run in the loop's task (or the caller's, for `start_run`). One that
raises is logged (`extension_hook_failed`) and passed over: an extension's
bookkeeping never decides whether a loop runs (`start_run` still starts the
run, once). A layer that raises fails what it wraps, as a wrapper would: the
model request, or the tool call (an error output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, final

from agentfsm.messages import UserMessage
from agentfsm.results import ErrorInfo, LoopResult, LoopStatus, LoopView, PathStep
from agentfsm.states import LoopState, Outcome

if TYPE_CHECKING:
    from agentfsm._bus import EventBus
    from agentfsm._loop import Loop
    from agentfsm.inference import InferenceInput
    from agentfsm.messages import ModelContext, ModelMessageItem, TokenUsage
    from agentfsm.providers import Provider
    from agentfsm.record import LoopRecord
    from agentfsm.tools import ToolCall, ToolNext, ToolResult

__all__ = ("Extension", "LoopExtension", "LoopInfo", "overrides", "overrides_any")


class Extension:
    """Plugs into the loops of a runtime: `Runtime(extensions=[...])`.

    Subclass it and override `open`.
    """

    __slots__ = ()

    def open(self, loop: LoopInfo, /) -> LoopExtension | None:
        """The runtime built `loop` (started it, or took it up from a store):
        return this extension's part in it, or None to take no part (the loop
        then pays nothing for this extension)."""
        return None


class LoopExtension:
    """One extension's part in one loop. Override what it needs: what it does
    not override is not composed into the loop."""

    __slots__ = ()

    def provider(self, provider: Provider, /) -> Provider:
        """The layer around the loop's model requests: the provider the loop
        resolved for a request (per request: a handler may change the model),
        or one that wraps it (`complete`, `stream`, `image_support`)."""
        return provider

    async def call_tool(self, call: ToolCall, next_: ToolNext, /) -> ToolResult:
        """The layer around each tool call, inside the loop's tool wrappers:
        `await next_(call)` runs the tool (or the next extension's layer)."""
        return await next_(call)

    def start_run(self, start: Callable[[], None], /) -> None:
        """A run of the loop is being handed to a worker (its first run, a
        resume, a cancel that ends it while paused): call `start()` exactly
        once. The run sees the context variables current during `start()`
        (a span made current around it is the run's parent); for a resume,
        `start` also applies the decision (the loop is still paused here)."""
        start()

    def committed(self) -> None:
        """A transition was committed (`LoopInfo.last_step`); the state it
        entered has not run yet."""

    def run_ended(self) -> None:
        """A run of the loop returned: it ended, paused, or stopped here. Also
        called once, with no run, for a paused loop taken up from a store
        (the run that paused it was another runtime's)."""

    def loop_ended(self) -> None:
        """The loop ended (`LoopInfo.outcome` is set): in a run (`run_ended`
        follows), or without one (a paused loop that the runtime's closing or
        its deadline ended). Also called when a durable loop stopped in this
        runtime without ending (its store could not take a write, or another
        runtime took it): `outcome` is then None, and its store keeps it."""


def overrides(part: LoopExtension, name: str) -> bool:
    """Whether `part`'s class overrides the hook or layer `name`."""
    return getattr(type(part), name) is not getattr(LoopExtension, name)


_HOOKS: Final = (
    "provider",
    "call_tool",
    "start_run",
    "committed",
    "run_ended",
    "loop_ended",
)


def overrides_any(part: LoopExtension) -> bool:
    """Whether `part`'s class overrides any hook or layer (one that does not
    takes no part in the loop)."""
    return any(overrides(part, name) for name in _HOOKS)


_NO_MESSAGES: Final[tuple[UserMessage, ...]] = ()


@final
class LoopInfo:
    """A read-only view of one loop, for extensions: it reads the loop as it
    is now (nothing is copied until asked for)."""

    __slots__ = ("_loop", "_providers")

    def __init__(self, loop: Loop) -> None:
        self._loop = loop
        self._providers = loop.providers  # the runtime's, without the layers

    def __repr__(self) -> str:
        loop = self._loop
        return f"LoopInfo({loop.loop_id!r}, state={loop.state}, status={loop.status})"

    @property
    def loop_id(self) -> str:
        return self._loop.loop_id

    @property
    def agent_id(self) -> str:
        return self._loop.agent_id

    @property
    def model(self) -> str:
        """The model the loop was started with."""
        return self._loop.input.model

    @property
    def handlers(self) -> tuple[Any, ...]:
        """Its interception handlers, in the order they run."""
        return self._loop.handlers

    @property
    def state(self) -> LoopState:
        return self._loop.state

    @property
    def status(self) -> LoopStatus:
        return self._loop.status

    @property
    def seq(self) -> int:
        """The number of the loop's last event."""
        return self._loop.seq

    @property
    def last_step(self) -> PathStep | None:
        """The transition committed last: (source, trigger, dest, rewritten_from)."""
        path = self._loop.path
        return path[-1] if path else None

    @property
    def step_reason(self) -> str | None:
        """The reason the last committed step carries (a failure's, a handler's)."""
        step = self._loop.step
        return None if step is None else step[2]

    @property
    def pause_reason(self) -> str | None:
        paused = self._loop.paused
        return None if paused is None else paused.reason

    @property
    def pending_message(self) -> UserMessage | None:
        """The user message of the step waiting to be taken, if it carries one
        (before the first run: the message the loop was started with)."""
        pending = self._loop.pending
        if pending is None:
            return None
        message = pending[1]
        return message if isinstance(message, UserMessage) else None

    @property
    def context(self) -> ModelContext:
        """The loop's context as it is now (what its record references)."""
        return self._loop.input.context

    @property
    def request(self) -> InferenceInput:
        """The request the loop sent last (before its first: its own input;
        a handler's rewrite may have given it another context)."""
        return self._loop.request

    @property
    def queued(self) -> tuple[UserMessage, ...]:
        """Steering and follow-up messages waiting to enter the context."""
        loop = self._loop
        if loop.steering is None and loop.follow_ups is None:
            return _NO_MESSAGES
        return (*(loop.steering or ()), *(loop.follow_ups or ()))

    @property
    def usage(self) -> TokenUsage:
        return self._loop.usage

    @property
    def model_requests(self) -> int:
        return self._loop.model_requests

    @property
    def tool_calls(self) -> int:
        return self._loop.tool_calls

    @property
    def outcome(self) -> Outcome | None:
        return self._loop.outcome

    @property
    def reason(self) -> str | None:
        return self._loop.reason

    @property
    def answer(self) -> ModelMessageItem | None:
        return self._loop.answer

    @property
    def error(self) -> ErrorInfo | None:
        return self._loop.error

    @property
    def bus(self) -> EventBus:
        """The bus the loop publishes its events on."""
        return self._loop.bus

    def resolve_provider(self) -> Provider | None:
        """The provider the runtime resolves the loop's model to (None if it
        resolves to none)."""
        try:
            return self._providers.resolve(self._loop.input.model)
        except Exception:  # noqa: BLE001 - a name for it is all that is asked
            return None

    def view(self) -> LoopView:
        """What `Runtime.get` shows of the loop."""
        return self._loop.view()

    def result(self) -> LoopResult | None:
        """Its result, once it ended."""
        loop = self._loop
        return loop.result() if loop.status is LoopStatus.done else None

    def snapshot(self) -> LoopRecord:
        """Its record (`Runtime.snapshot`)."""
        return self._loop.snapshot()

    def input_dropped(self, value: str, reason: str) -> None:
        """Publish `input.dropped` on the loop's events: an input sent to it
        from outside (a signal's payload) was not valid and was dropped."""
        loop = self._loop
        if loop.status is not LoopStatus.done:
            loop.emit("input.dropped", input=value, reason=reason)
