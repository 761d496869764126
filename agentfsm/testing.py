"""Helpers for testing code built on agentfsm (and agentfsm itself).

- `ScriptedProvider`: answers each loop from a script of outputs, one per model
  request, with a separate cursor per loop.
- `text`, `calls`, `call`, `reasoning`: build scripted outputs.
- `EventRecorder`: records what the bus published.
- `RecordingHandler`: an interception handler that records what it saw.
- `assert_path`: check the states a loop went through.

Example:
    ```python
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    async with Runtime(providers={"scripted": provider}) as runtime:
        recorder = EventRecorder(runtime.bus)
        loop_id = runtime.run_loop("agent", "1+2?", InferenceInput(
            model="scripted:demo", context=ModelContext(), tools=[add]))
        result = await runtime.wait(loop_id)
    assert_path(result, "idle context_update inference function_call inference model_message idle")
    ```
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Self

from pydantic_core import to_json

from ._bus import EventBus, Subscription
from ._loop import current_loop_id
from ._runtime import current_runtime
from ._runtime.runtime import held_loop, kept_result
from .events import AgentEvent
from .exceptions import NoRuntimeError, ProviderError
from .inference import InferenceInput, InferenceOutput, StreamEvent
from .interception import Decision, PendingTransition
from .messages import FunctionCallItem, ModelMessageItem, ReasoningItem, TokenUsage
from .providers.function import replay
from .results import LoopResult, LoopView
from .states import LoopState

if TYPE_CHECKING:
    from ._loop import Loop
    from ._runtime import Runtime

__all__ = (
    "EventRecorder",
    "RecordingHandler",
    "ScriptStep",
    "ScriptedProvider",
    "assert_path",
    "call",
    "calls",
    "reasoning",
    "text",
)

_call_ids = itertools.count(1)


def call(
    name: str, /, call_id: str | None = None, **arguments: Any
) -> FunctionCallItem:
    """A function call item (`call_id` defaults to a fresh `call_<n>`)."""
    return FunctionCallItem(
        call_id=call_id or f"call_{next(_call_ids)}",
        name=name,
        arguments=to_json(arguments).decode(),
    )


def calls(
    *items: FunctionCallItem, usage: TokenUsage | None = None, text: str | None = None
) -> InferenceOutput:
    """An output asking for these function calls (optionally with text before
    them), reporting `usage` (None: no usage, as some servers report none)."""
    prefix = [ModelMessageItem(content=text)] if text is not None else []
    return InferenceOutput(
        items=(*prefix, *items), token_usage=usage, finish_reason="tool_calls"
    )


def text(content: str, *, usage: TokenUsage | None = None) -> InferenceOutput:
    """An output answering with `content`, reporting `usage` (None: no usage)."""
    return InferenceOutput(
        items=(ModelMessageItem(content=content),),
        token_usage=usage,
        finish_reason="stop",
    )


def reasoning(thought: str, output: InferenceOutput) -> InferenceOutput:
    """`output` with a reasoning item in front."""
    return output.model_copy(
        update={"items": (ReasoningItem(content=thought), *output.items)}
    )


ScriptStep = (
    InferenceOutput | BaseException | Callable[[InferenceInput], InferenceOutput]
)
"""An output, an error to raise, or a function of the request."""


class _Cursor:
    """The next step of a loop the provider cannot watch (or of requests made
    outside a loop)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _LoopCursor(weakref.ref["Loop"]):
    """The next step of a loop, and a weak reference to the loop: one object
    per loop (benchmarks measure a loop's memory with this provider)."""

    __slots__ = ("index", "loop_id", "provider", "runtime")

    def __new__(
        cls, loop: Loop, provider: ScriptedProvider, runtime: Runtime, index: int
    ) -> Self:
        return super().__new__(cls, loop, _loop_freed)

    def __init__(
        self, loop: Loop, provider: ScriptedProvider, runtime: Runtime, index: int
    ) -> None:
        # (`ref.__init__` only checks the arguments `__new__` took.)
        self.loop_id = loop.loop_id
        self.provider = provider
        self.runtime = runtime
        self.index = index


def _loop_freed(cursor: _LoopCursor) -> None:
    cursor.provider._loop_freed(cursor)


class ScriptedProvider:
    """A provider that plays a script: the n-th request of a loop gets the n-th step.

    Each loop has its own cursor, so any number of loops can run the same script
    at once. A step may be an `InferenceOutput`, an exception to raise, or a
    function of the request. Running past the end raises `ProviderError` naming
    the script's length (a script one step short fails the loop, rather than
    starting over). `requests` records every request, in arrival order.

    A loop's cursor goes with the loop: once the loop has ended (whenever in its
    script) and its runtime has freed it, so a provider serving loops for ever
    holds the cursors of live loops only. A loop that leaves its runtime without
    ending (paused as the runtime exits, or detached) keeps its cursor, so the
    runtime that takes it up goes on with its script; so do requests made
    outside a loop, or from a loop the runtime of the current context does not
    hold: the latest `_UNWATCHED_KEPT` of those are kept.
    """

    __slots__ = ("_cursors", "_record", "_unwatched", "requests", "script")

    _UNWATCHED_KEPT: ClassVar[int] = 4096
    """How many cursors of loops the provider cannot watch are kept: enough for
    any such loop still running, bounded for long benchmarks."""

    def __init__(self, script: Sequence[ScriptStep], *, record: bool = True) -> None:
        self.script = tuple(script)
        self._cursors: dict[str | None, _Cursor | _LoopCursor] = {}
        """Each loop's next step (`len(script)` once it played its last)."""
        self._unwatched: dict[str | None, None] = {}
        """The keys of the `_Cursor`s, oldest first (a dict keeps order)."""
        self._record = record
        self.requests: list[InferenceInput] = []
        """Every request, in arrival order (unless built with `record=False`,
        as benchmarks do: the list keeps every request's context alive)."""

    def _step(self, request: InferenceInput) -> InferenceOutput:
        if self._record:
            self.requests.append(request)
        key = current_loop_id()
        cursor = self._cursors.get(key)
        if cursor is None or type(cursor) is _Cursor:
            # New, or unwatched: a loop that left its runtime may be in this one.
            cursor = self._watch(key, 0 if cursor is None else cursor.index)
        index = cursor.index
        if index == len(self.script):
            where = "outside a loop" if key is None else f"loop {key}"
            raise ProviderError(
                f"the script has {len(self.script)} steps and {where} asked for "
                f"step {len(self.script) + 1}"
            )
        cursor.index = index + 1
        step = self.script[index]
        if isinstance(step, InferenceOutput):
            return step
        if isinstance(step, BaseException):
            raise step
        return step(request)

    def _watch(self, key: str | None, index: int) -> _Cursor | _LoopCursor:
        """Cursor `key` at `index`, made to go with its loop if the runtime of
        the current context holds the loop (a loop runs in a copy of the context
        that started it), or kept among the unwatched ones."""
        runtime = _runtime_of_context()
        loop = None if key is None or runtime is None else held_loop(runtime, key)
        if runtime is None or loop is None:
            cursor = self._cursors[key] = _Cursor(index)
            self._keep_unwatched(key)
            return cursor
        self._unwatched.pop(key, None)
        watched = self._cursors[key] = _LoopCursor(loop, self, runtime, index)
        return watched

    def _loop_freed(self, cursor: _LoopCursor) -> None:
        """A watched loop was freed: its cursor goes if the loop ended (the
        runtime keeps its result); otherwise it left the runtime unfinished,
        and the cursor is kept for whoever takes the loop up (as are those of
        loops a `Runtime(keep_finished=0)` ended: it keeps no result to tell)."""
        loop_id = cursor.loop_id
        if kept_result(cursor.runtime, loop_id):
            del self._cursors[loop_id]
        else:
            self._cursors[loop_id] = _Cursor(cursor.index)
            self._keep_unwatched(loop_id)

    def _keep_unwatched(self, key: str | None) -> None:
        unwatched = self._unwatched
        unwatched[key] = None
        if len(unwatched) > self._UNWATCHED_KEPT:
            oldest = next(iter(unwatched))
            del unwatched[oldest], self._cursors[oldest]

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        """The next step of this loop's script."""
        return self._step(request)

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """The next step as deltas, ending with the same output `complete` returns."""
        async with replay(self._step(request)) as events:
            yield events


def _runtime_of_context() -> Runtime | None:
    try:
        return current_runtime()
    except NoRuntimeError:
        return None


class EventRecorder:
    """Records the events a bus publishes (subscribed with an unbounded-enough buffer).

    `events` returns everything recorded so far; no task is needed.
    """

    def __init__(
        self,
        bus: EventBus,
        types: str | Sequence[str] = "*",
        *,
        loop_id: str | None = None,
    ) -> None:
        self._subscription: Subscription = bus.subscribe(
            types, loop_id=loop_id, buffer=10**9
        )
        self._events: list[AgentEvent] = []

    @property
    def events(self) -> list[AgentEvent]:
        """Every event recorded so far, in publication order."""
        sub = self._subscription
        while sub.statistics().buffered:
            self._events.append(sub.receive_nowait())
        return self._events

    def of_loop(self, loop_id: str) -> list[AgentEvent]:
        """The events of one loop."""
        return [e for e in self.events if e.loop_id == loop_id]

    def types(self, loop_id: str | None = None) -> list[str]:
        """The event types, in order (of one loop, or all)."""
        events = self.events if loop_id is None else self.of_loop(loop_id)
        return [e.type for e in events]

    def close(self) -> None:
        """Stop recording."""
        self.events  # noqa: B018 - drain what is buffered before unsubscribing
        self._subscription.close()


class RecordingHandler:
    """An interception handler that records each pending transition.

    It proceeds, unless built with a `decide` function whose decision it returns.
    """

    def __init__(
        self, decide: Callable[[PendingTransition], Decision | None] | None = None
    ) -> None:
        self.seen: list[PendingTransition] = []
        self._decide = decide

    def __call__(self, pending: PendingTransition) -> Decision | None:
        self.seen.append(pending)
        if self._decide is None:
            return None
        decision = self._decide(pending)
        assert not inspect.isawaitable(decision), "decide must be synchronous"
        return decision

    @property
    def triggers(self) -> list[str]:
        """The triggers seen, in order."""
        return [p.trigger.value for p in self.seen]


def assert_path(
    loop: LoopResult | LoopView, states: str | Sequence[str | LoopState]
) -> None:
    """Assert the states a loop visited, `idle` first (a space-separated string or a list)."""
    expected = states.split() if isinstance(states, str) else [str(s) for s in states]
    actual = [LoopState.idle.value, *(step.dest.value for step in loop.path)]
    assert actual == expected, f"loop {loop.loop_id} took {' -> '.join(actual)}"
