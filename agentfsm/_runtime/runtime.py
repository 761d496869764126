"""The runtime: one task group, the bus, the provider registry and the loops.

```python
async with Runtime(providers={"scripted": provider}) as runtime:
    loop_id = runtime.run_loop("agent-1", "hello", inference_input)  # returns at once
    result = await runtime.wait(loop_id)
```

Loops run in worker tasks of the runtime's task group (reused: see `workers`),
each in a copy of the context that started it. Leaving the block waits for
running loops; loops still paused then are cancelled. An exception leaving the
block cancels every loop (each still ends in `idle` with outcome `cancelled`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from contextvars import ContextVar, Token
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Self, TypeVar, Unpack

import anyio
from anyio.abc import TaskGroup

from agentfsm._arguments import (
    ArgumentTypeError,
    ArgumentValueError,
    check,
    given,
    seconds,
)
from agentfsm._bus import EventBus, Subscription
from agentfsm._loop import Loop
from agentfsm._loop.driver import end_paused, expire_paused, halt
from agentfsm._loop.images import refuse_unsupported_images
from agentfsm._text import encodable
from agentfsm.breakpoints import BREAKPOINT_HANDLER, Break, Breakpoints
from agentfsm.exceptions import (
    ConfigurationError,
    EventLogError,
    LeaseLostError,
    LoopDetachedError,
    LoopStateError,
    NoRuntimeError,
    StoreError,
    UnknownLoopError,
)
from agentfsm.inference import InferenceInput
from agentfsm.interception import (
    Abort,
    Decision,
    InterceptionHandler,
    Pause,
    Proceed,
    Rewrite,
)
from agentfsm.messages import UserMessage
from agentfsm.options import LoopOptions, LoopOptionsDict
from agentfsm.providers import Provider, ProviderRegistry
from agentfsm.results import LoopResult, LoopStatus, LoopView
from agentfsm.states import LoopState

from .backend import Primitives, primitives
from .extending import (
    extend,
    extensions_checked,
    loop_ended,
    run_ended,
    start_with_extensions,
)
from .ids import (
    Clock,
    IdSource,
    checked_clock,
    checked_ids,
    new_loop_id,
    utc_now,
    uuid7,
)
from .inputs import (
    agent_id_of,
    bindings_checked,
    checked_message,
    handlers_of,
    user_message_of,
)
from .services import Services
from .workers import WorkerPool

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from agentfsm._durable.keeper import Keeper, Recovery
    from agentfsm._durable.requests import Watcher
    from agentfsm.eventlog import EventLogWriter
    from agentfsm.events import AgentEvent
    from agentfsm.extensions import Extension
    from agentfsm.messages import ContextItem
    from agentfsm.record import LoopRecord
    from agentfsm.store import LoopStore
    from agentfsm.tools import Tool

__all__ = (
    "Runtime",
    "bound_callables",
    "current_runtime",
    "held_loop",
    "kept_result",
    "knows",
    "run_loop",
)

T = TypeVar("T")

_current: ContextVar[Runtime | None] = ContextVar("agentfsm_runtime", default=None)


def current_runtime() -> Runtime:
    """The runtime of the current context.

    Raises:
        NoRuntimeError: not inside `async with Runtime()`.
    """
    runtime = _current.get()
    if runtime is None:
        raise NoRuntimeError(
            "no agentfsm runtime in this context: call run_loop() inside "
            "`async with agentfsm.Runtime() as runtime:` (or use runtime.run_loop)"
        )
    return runtime


_NOT_RUNNING: Final = (
    "the runtime is not running: use `async with Runtime() as runtime:`"
)


class Runtime:
    """Owns the task group the loops run in, the event bus and the providers.

    Args:
        providers: `prefix -> provider` (or a ready `ProviderRegistry`); a loop
            whose model is `prefix:name` is served by that provider.
        keep_finished: how many finished loops are kept for `wait`/`get`
            (oldest forgotten first).
        keep_streams: how many loops started with `stream=True` that ended
            with their events not taken (`events`) keep them (oldest dropped
            first; never longer than their result, see `keep_finished`).
        event_log: append every event of every loop to this JSON-lines file
            (see `agentfsm.eventlog`); it is complete once the runtime exited.
        store: make every loop durable (`agentfsm.store`: `SQLiteStore`,
            `MemoryStore`, ...): its record is written at each transition, its
            tool calls go through a ledger, a paused loop stays paused when the
            runtime exits, and `recover()` continues what a crashed process
            left (see [Durable loops][durable-loops]).
        tools: the tools stored loops may be rebound to, by name (loops this
            runtime starts add theirs).
        handlers: the interception handlers and other callables (wrappers,
            stop conditions, `finish_turn`, structured-output classes) stored
            loops may be rebound to: a list (each named `module:qualname`) or
            a mapping from such names.
        extensions: plug into every loop (`agentfsm.extensions`): layers
            around its model requests and tool calls, hooks on its runs and
            commits; e.g. `agentfsm.otel.OpenTelemetry()` (GenAI spans).
        instrument: one more extension (the older spelling of
            `extensions=[instrument]`).
        clock: returns the time (a timezone-aware `datetime`) for event
            timestamps and a loop's `started_at`/`ended_at`; default
            `datetime.now(UTC)`. It must not raise.
        ids: returns a new loop id (a non-empty str, unique in the runtime);
            default a UUIDv7, which `loops()` sorts by creation time. A
            Temporal workflow passes sources built on `workflow.now()` and
            `workflow.uuid4()`; tests, a fixed clock and counter ids.
        breakpoints: pause every loop before it enters these states
            (`agentfsm.breakpoints.Break`); `runtime.breakpoints` adds and
            removes them while loops run, for one loop or one agent too.
        requests: apply the requests stored in the durable store's decision
            inbox (`agentfsm.store.Requests`: a person's resume or cancel,
            submitted from `agentfsm ui` or another process) to the loops this
            runtime holds, and forks of any loop whose tools it has, each once: `True` reads them every second, a number
            every that many seconds, at once when `poke_requests` is called
            (and, on PostgreSQL, when one is submitted). Needs `store=` (see
            [the decision inbox][the-decision-inbox]).

    Raises:
        TypeError: an argument of another type than the parameter takes (the
            message names it; a `ConfigurationError` too). Every method checks
            its arguments so, before it changes, stores or publishes anything.
    """

    def __init__(
        self,
        *,
        providers: Mapping[str, Provider] | ProviderRegistry | None = None,
        keep_finished: int = 10_000,
        keep_streams: int = 100,
        event_log: str | os.PathLike[str] | None = None,
        store: LoopStore | None = None,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        handlers: Mapping[str, Any] | Sequence[Any] = (),
        extensions: Sequence[Extension] = (),
        instrument: Extension | None = None,
        clock: Clock = utc_now,
        ids: IdSource = uuid7,
        breakpoints: Sequence[Break] = (),
        requests: bool | float = False,
    ) -> None:
        if not isinstance(providers, Mapping | ProviderRegistry | None):
            raise ArgumentTypeError(
                "providers must map model prefixes to providers, e.g. "
                f"providers={{'scripted': provider}}, got {given(providers)}"
            )
        if type(keep_finished) is not int or keep_finished < 0:  # bool, str: refused
            error = (
                ArgumentValueError if type(keep_finished) is int else ArgumentTypeError
            )
            raise error(f"keep_finished must be an int >= 0, got {keep_finished!r}")
        if type(keep_streams) is not int or keep_streams < 0:
            error = (
                ArgumentValueError if type(keep_streams) is int else ArgumentTypeError
            )
            raise error(f"keep_streams must be an int >= 0, got {keep_streams!r}")
        check("event_log", event_log, str | os.PathLike | None, "a path")
        extensions_checked(extensions)
        if instrument is not None:  # the older spelling of one extension
            extensions_checked([instrument], "instrument")
            extensions = (*extensions, instrument)
        bindings_checked(tools, handlers)
        self._extensions = tuple(extensions)
        self.providers = (
            providers
            if isinstance(providers, ProviderRegistry)
            else ProviderRegistry(providers)
        )
        self.bus = EventBus()
        self._loops: dict[str, Loop] = {}  # running and paused
        # Finished loops are kept as their results only: a whole Loop is ~40
        # objects that every full garbage collection would walk.
        self._results: dict[str, LoopResult] = {}
        self._keep_finished = keep_finished
        self._tg: TaskGroup | None = None
        self._token: Token[Runtime | None] | None = None
        self._closed = False
        self._closing = False
        self._workers: WorkerPool | None = None
        self._event_log_path = event_log
        self._event_log: EventLogWriter | None = None
        # anyio's own classes (each use finds the backend); the backend's once running.
        self._primitives = Primitives(anyio.CancelScope, anyio.Event)
        self._timers: dict[str, anyio.CancelScope] = {}
        """The deadline timers of paused loops, by loop id."""
        self._keeper: Keeper | None = None
        """The durable store's side (`agentfsm._durable.keeper`), with a store."""
        if store is not None:
            self._keeper = _keeper_of(store, self.bus, tools, handlers)
            self._keeper.on_lost = self._lease_lost
        elif tools or handlers:
            raise ConfigurationError(
                "tools= and handlers= bind a durable store's loops: give store= too"
            )
        self._streams: dict[str, Subscription] = {}
        """The events of live loops started with `stream=True` that `events`
        has not handed over yet."""
        self._ended_streams: dict[str, Subscription] = {}
        """The same, of loops that ended (or stopped here), in the order they
        did: the last `keep_streams`, as long as their results are kept."""
        self._keep_streams = keep_streams
        self._streaming: dict[str, Subscription] = {}
        """The subscriptions of the live loops started with `stream=True`,
        closed once each loop's last event is in its buffer."""
        self._detached: dict[str, LoopDetachedError] = {}
        """Durable loops that stopped in this runtime without ending, and why
        (`driver.halt`): their stores keep them, for `recover`."""
        self._services = Services()
        """Context managers held open until the loops have ended (MCP sessions)."""
        self._clock = checked_clock(clock)
        self._ids = checked_ids(ids, self._knows)
        self.breakpoints = Breakpoints(breakpoints, self._loops, self._live)
        """The breakpoints (`agentfsm.breakpoints`): add and remove them while
        loops run, for one loop, one agent's loops or all of them."""
        if self._keeper is not None:
            # Any runtime takes up a loop paused at a breakpoint: its record
            # names the handler, bound here to this runtime's.
            self._keeper.bindings.callables[BREAKPOINT_HANDLER] = self.breakpoints
        self._watcher: Watcher | None = None
        """Applies the store's requests (`Runtime(requests=)`), if asked to."""
        interval = _requests_interval(requests)
        if interval is not None:
            self._watcher = self._watching(store, interval)

    async def __aenter__(self) -> Self:
        if self._tg is not None or self._closed:
            raise LoopStateError("a Runtime can be entered only once")
        if self._event_log_path is not None:
            # Entered before the loops' task group and left after it (see
            # EventLogWriter): the writer outlives every loop, cancelled ones too.
            from agentfsm.eventlog import (
                EventLogWriter,  # only runtimes that keep a log
            )

            writer = EventLogWriter(self.bus, self._event_log_path)
            self._event_log = await writer.__aenter__()
        if self._keeper is not None:
            # Opened before the loops and closed after them; the leases are a
            # service (renewed until the loops have ended).
            await self._keeper.store.__aenter__()
        await self._services.open()  # left after the loops' task group, too
        if self._keeper is not None:
            await self._services.enter(
                self._keeper.running(), "store writer and leases"
            )
            if self._watcher is not None:  # (closed before the store's writer)
                await self._services.enter(self._watcher.running(), "request watcher")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._primitives = primitives()
        self.bus.use_backend(self._primitives.event)
        self._workers = WorkerPool(
            lambda work, worker: tg.start_soon(work, worker, name="agentfsm-worker"),
            self._primitives,
            self._run_ended,
        )
        self._token = _current.set(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tg is not None
        try:
            if exc is None:
                # Running loops finish; loops left paused once none runs are
                # cancelled, since nobody is left to resume them.
                self._closing = True
                if self._workers is not None:
                    self._workers.close()
                self._cancel_paused_if_idle()
            return await self._tg.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # Loops never raise into the group, so a group holding only the
            # caller's own exception is unwrapped: the caller sees what it raised.
            if exc is not None and group.exceptions == (exc,):
                return None
            raise
        finally:
            leaving = exc or sys.exception()  # what leaves the block, if anything
            self._closed = True
            self._tg = None
            await self._leave_paused_loops()
            try:
                # No loop is left to use what the services hold.
                await self._services.close()
            finally:
                # (Leaving a cancelled scope on trio, the close above raises
                # Cancelled: the rest is closed all the same.)
                await self._close_the_rest(leaving)

    async def _leave_paused_loops(self) -> None:
        """Leaving with an error cancels the running loops through the task
        group; paused ones have no task, so they are ended here (or, durable,
        left paused in the store, for any runtime). A method of its own: a
        loop variable in `__aexit__`'s frame, held by a traceback, kept the
        last loop alive until the cycle collector ran."""
        with anyio.CancelScope(shield=True):
            for loop in list(self._loops.values()):
                if loop.status is not LoopStatus.paused:
                    continue
                if self._keeper is None:
                    await end_paused(
                        loop, "the runtime closed while the loop was paused"
                    )
                else:
                    self._loops.pop(loop.loop_id, None)
                    self._keeper.forget(loop.loop_id)
                    loop.release_extensions()  # kept in the store, not here

    async def _close_the_rest(self, leaving: BaseException | None) -> None:
        """The store, the bus, the event log and the providers, once the loops
        and the services are done."""
        try:
            if self._keeper is not None:
                with anyio.CancelScope(shield=True):
                    await self._keeper.store.__aexit__(None, None, None)
        finally:
            self.bus.close()
            if self._token is not None:
                _current.reset(self._token)
                self._token = None
            try:
                if self._event_log is not None:
                    # Every loop has ended: write what is buffered, close the file.
                    writer, self._event_log = self._event_log, None
                    await writer.aclose()
            except EventLogError:
                # Logged already (`event_log_incomplete`); raised only when
                # nothing else leaves the block, so as not to replace it.
                if leaving is None:
                    raise
            finally:
                with anyio.CancelScope(shield=True):
                    await self.providers.aclose()

    async def enter_async_context(
        self, context: AbstractAsyncContextManager[T], *, name: str | None = None
    ) -> T:
        """Enter `context` now and exit it when the runtime exits, after every
        loop has ended; returns what entering it gave (as `async with` would).

        It is entered in a task of the runtime's own, so it may open task
        groups and cancel scopes; contexts are exited last entered first.
        `agentfsm.mcp.mcp_tools` holds its MCP session this way.

        Args:
            context: an async context manager, not yet entered.
            name: what logs call it (default: its type's name).

        Raises:
            LoopStateError: the runtime is not running.
            Exception: whatever entering `context` raised.
        """
        check(
            "context",
            context,
            AbstractAsyncContextManager,
            "an async context manager (with __aenter__ and __aexit__)",
        )
        check("name", name, str | None)
        if self._tg is None or self._closing:
            raise LoopStateError(_NOT_RUNNING)
        return await self._services.enter(context, name or type(context).__name__)

    def _spawn(self, loop: Loop) -> None:
        assert self._workers is not None
        if not loop.extensions:
            self._workers.run(loop)
        else:
            start_with_extensions(loop, self._workers.run)

    @property
    def _running(self) -> int:
        """How many loops are running (a paused loop is not: it holds no task)."""
        return 0 if self._workers is None else self._workers.running

    def _run_ended(self, loop: Loop) -> None:
        """A loop's run ended: it finished, or it paused (then its deadline, if it
        has one, is kept by a timer: a paused loop holds no task but this)."""
        if loop.extensions:
            run_ended(loop)
        if self._streaming and (loop.status is LoopStatus.done or loop.detached):
            self._stream_ended(loop)  # its held events are delivered now
        if (
            loop.status is LoopStatus.paused
            and not loop.detached
            and loop.deadline_at is not None
            and loop.loop_id not in self._timers
            and self._tg is not None
        ):
            timer = self._timers[loop.loop_id] = self._primitives.cancel_scope()
            self._tg.start_soon(
                self._expire_paused, loop, timer, name="agentfsm-deadline"
            )
        self._cancel_paused_if_idle()

    async def _expire_paused(self, loop: Loop, timer: anyio.CancelScope) -> None:
        """At the loop's deadline, end it if it is paused (resumed, it has its own)."""
        with timer:
            assert loop.deadline_at is not None
            await anyio.sleep_until(loop.deadline_at)
            self._timers.pop(loop.loop_id, None)
            if loop.status is LoopStatus.paused:
                await expire_paused(loop)
                if self._streaming:
                    self._stream_ended(loop)

    def _cancel_paused_if_idle(self) -> None:
        if self._closing and not self._running:
            if self._keeper is not None:
                # Paused loops stay paused in the store (any runtime may resume
                # them): only their deadline timers go.
                for timer in self._timers.values():
                    timer.cancel()
                return
            for loop in list(self._loops.values()):
                if loop.status is LoopStatus.paused:
                    self.cancel(
                        loop.loop_id, "the runtime closed while the loop was paused"
                    )

    # ------------------------------------------------------------------ loops

    def run_loop(
        self,
        agent_id: str,
        message: UserMessage | str | None,
        inference_input: InferenceInput,
        interception_handler: InterceptionHandler
        | Sequence[InterceptionHandler]
        | None = None,
        *,
        stream: bool = False,
        loop_id: str | None = None,
        **options: Unpack[LoopOptionsDict],
    ) -> str:
        """Start a loop in the background and return its `loop_id` at once.

        Args:
            agent_id: who the loop runs for; loops of one agent run independently.
            message: the user message to append first (`None` continues the context,
                which must then end with a user message or a function output).
            inference_input: model, settings, tools and the context to append to.
            interception_handler: one handler or a list, run before every transition.
            stream: keep the loop's events, from its first, for `events(loop_id)`
                (a loop started without it builds no event nobody subscribed to;
                see `events` for how long they are kept).
            loop_id: the new loop's id (default: a fresh UUIDv7 from the
                runtime's `ids`). A caller that names its loops makes a start
                idempotent across processes: a durable store refuses a second
                loop of the same id (`LoopIdTakenError`, as the loop's outcome),
                at its first commit, which a named loop waits for before its
                first model request.
            **options: see `agentfsm.options.LoopOptions` (`max_turns`, `stop_when`,
                `tool_execution`, wrappers, queues, timeouts, retries, ...).

        Raises:
            ConfigurationError: the input cannot start a loop (the error says
                why), or `loop_id` is not a new one.
            LoopStateError: the runtime is not running.
        """
        check("inference_input", inference_input, InferenceInput)
        if stream is not False:  # (no call on the common path)
            check("stream", stream, bool)
        named = loop_id is not None
        if named:
            new_loop_id(loop_id, self._knows, f"loop_id={loop_id!r}")
        agent_id = agent_id_of(agent_id)
        loop_options = LoopOptions.of(options)
        user_message = user_message_of(message, inference_input)
        handlers = handlers_of(interception_handler)
        if self._tg is None:
            raise LoopStateError(_NOT_RUNNING)
        # An unknown provider fails here, loudly, before the loop exists.
        self.providers.resolve(inference_input.model)
        if user_message is not None and type(user_message.content) is not str:
            refuse_unsupported_images(
                (user_message,), inference_input.model, self.providers
            )
        if loop_id is None:
            loop_id = self._ids()
        primitives = self._primitives
        loop = Loop(  # by position (see `Loop.__init__`)
            loop_id,
            agent_id,
            user_message,
            inference_input,
            handlers,
            loop_options,
            self.bus,
            self.providers,
            primitives.cancel_scope,
            primitives.event,
            primitives.run_tasks,
            self._loop_done,
            self._clock,
        )
        if self._extensions:  # before anything is stored or published
            extend(loop, self._extensions, strict=True)
        if self._keeper is not None:
            self._keeper.adopt(loop, named=named)
            loop.halts_to(self._loop_halted)
        if stream:
            # Subscribed before the first event: none is missed, however late
            # `events` is called. Unbounded: a slow reader never holds the loop.
            events = self.bus.subscribe(loop_id=loop_id, buffer=sys.maxsize)
            self._streams[loop_id] = self._streaming[loop_id] = events
        loop.emit_started(user_message, inference_input, loop_options, loop.handlers)
        if self.breakpoints.armed:  # after `loop.started`: a replay binds none
            self.breakpoints.chain(loop)
        self._loops[loop_id] = loop
        self._spawn(loop)
        return loop_id

    async def recover(self) -> Recovery:
        """Continue every unfinished loop of the store that no live runtime owns.

        Each goes on from its last committed transition: a paused loop stays
        paused (`resume` it), a model request whose output was recorded is not
        sent again, a tool call the ledger holds as done is never run again,
        and a call that was in flight when the process stopped runs again if
        its tool is `on_crash="retry"`, else the loop pauses, naming it. A
        loop naming a tool or callable this runtime was not given (or a tool
        whose schema changed) ends `failed` with an error that names it.

        Returns:
            What happened to each loop (`Recovery`).

        Raises:
            LoopStateError: the runtime has no store, or is not running.
        """
        keeper = self._keeper
        if keeper is None:
            raise LoopStateError("recover() needs a durable store: Runtime(store=...)")
        if self._tg is None or self._closing:
            raise LoopStateError(_NOT_RUNNING)
        report = await keeper.recover(self._loops, self._blank, self._take_recovered)
        if self._watcher is not None:
            self._watcher.poke()  # the loops taken up may have requests waiting
        return report

    @property
    def watches_requests(self) -> bool:
        """Whether the runtime applies its store's requests (`Runtime(requests=)`):
        without it, a request stored for one of its loops stays pending."""
        return self._watcher is not None

    def poke_requests(self) -> None:
        """Read the store's pending requests now (`Runtime(requests=)`), not at
        the next interval: what a process that submitted one calls (`agentfsm
        ui` mounted in this process, say). Nothing without `requests=`."""
        if self._watcher is not None:
            self._watcher.poke()

    def _watching(self, store: LoopStore | None, interval: float) -> Watcher:
        """The watcher of the store's requests (`Runtime(requests=)`).

        Raises:
            ConfigurationError: no store, or one that keeps no requests.
        """
        from agentfsm._durable.requests import Hooks, Watcher
        from agentfsm.replay.inbox import apply_fork
        from agentfsm.store import Requests

        keeper = self._keeper
        if keeper is None or store is None:
            raise ConfigurationError(
                "requests= applies the requests a durable store holds: give "
                "store= too (e.g. Runtime(store=SQLiteStore(path), requests=True))"
            )
        if not isinstance(store, Requests):
            raise ConfigurationError(
                f"requests= needs a store that keeps requests "
                f"(agentfsm.store.Requests): {type(store).__name__} does not"
            )
        hooks = Hooks(
            live=self._loops.get,
            ended=self._results.__contains__,
            resume=lambda loop_id, decision, by: self.resume(loop_id, decision, by=by),
            cancel=self.cancel,
            closing=lambda: self._closing or self._tg is None,
            breakpoints=self.breakpoints,
            fork=lambda request: apply_fork(self, keeper, store, request),
        )
        return Watcher(keeper, store, interval, hooks)

    def _blank(
        self,
        inference_input: InferenceInput,
        handlers: tuple[Any, ...],
        options: LoopOptions,
    ) -> Loop:
        """A loop of this runtime for `restore` to fill in from a record."""
        primitives = self._primitives
        loop = Loop(  # by position (see `Loop.__init__`); restore sets the rest
            "",
            "",
            None,
            inference_input,
            handlers,
            options,
            self.bus,
            self.providers,
            primitives.cancel_scope,
            primitives.event,
            primitives.run_tasks,
            self._loop_done,
            self._clock,
        )
        loop.halts_to(self._loop_halted)
        return loop

    def hand_over(
        self,
        loop_id: str,
        *,
        check: Callable[[LoopRecord, list[ContextItem]], object] | None = None,
    ) -> tuple[LoopRecord, list[ContextItem]]:
        """Take a loop out of this runtime without ending it, for another
        runtime to go on with (`adopt`): its record and its context's items.

        The loop must be paused, or waiting inside its provider for a request
        it has not sent (a Temporal workflow continuing as new,
        `agentfsm.temporal._carry`): its record then says it is in
        `inference`, and the runtime that adopts it sends the request. It
        publishes nothing more here and never runs here again; a task it
        still has ends with this runtime, without ending the loop. `check`
        sees what would be handed over first, and refuses it by raising: the
        loop then stays here as it was.

        Raises:
            UnknownLoopError: no such loop.
            LoopStateError: the loop has finished, or holds events for a
                subscriber with backpressure (it has more to publish here).
        """
        loop = self._live(loop_id)
        if loop is None:
            raise LoopStateError(f"loop {loop_id} has finished: nothing to hand over")
        if loop.outbox is not None:
            raise LoopStateError(
                f"loop {loop_id} still holds events for a subscriber with "
                "backpressure: hand it over once they are delivered"
            )
        record = loop.snapshot()
        items = list(loop.input.context.items)
        if check is not None:
            check(record, items)
        loop.detach()
        if loop.worker is None:  # no run of it returns here: no hook follows
            loop.release_extensions()
        del self._loops[loop_id]
        timer = self._timers.pop(loop_id, None)
        if timer is not None:
            timer.cancel()
        return record, items

    def adopt(
        self,
        record: LoopRecord,
        items: Sequence[ContextItem],
        *,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        handlers: Mapping[str, Any] | Sequence[Any] = (),
        started_with: tuple[Sequence[Any], LoopOptions] | None = None,
    ) -> str:
        """Go on with a loop another runtime handed over (`hand_over`),
        rebuilt from its record and its context's items, its callables bound
        by name to `tools` and `handlers` (as `Runtime(tools=, handlers=)`
        bind a store's loops). It publishes nothing as it arrives (its events
        go on from its record's `seq`): a paused loop stays paused, a running
        one goes on from where its record says. Its deadline is kept as
        recorded (`deadline_at`, on anyio's clock): the clock must go on where
        the loop does (a Temporal workflow's time does).

        `started_with` is the loop's handlers and options as it was started
        with them, built again (from the same agent, as a Temporal workflow's
        next run does): where the record names its handlers (its stop
        conditions, its wrappers) in the same order, each is bound to the one
        at its position, so two that share a name (closures of one factory,
        two `tool_called()` conditions) each stay themselves; else by name.

        Returns:
            The loop's id.

        Raises:
            LoopStateError: the runtime is not running, or knows a loop of
                that id.
            RecoveryError: a tool or callable the record names is missing, or
                a tool's schema changed.
        """
        from dataclasses import replace

        from agentfsm._loop.snapshot import Bindings, restore
        from agentfsm.record import callable_name

        if self._tg is None or self._closing:
            raise LoopStateError(_NOT_RUNNING)
        if self._knows(record.loop_id):
            raise LoopStateError(f"loop {record.loop_id} is in this runtime already")
        bindings = Bindings(tools, handlers)
        # A loop paused at a breakpoint names the runtime's own handler.
        bindings.callables.setdefault(BREAKPOINT_HANDLER, self.breakpoints)
        make: Callable[[InferenceInput, tuple[Any, ...], LoopOptions], Loop]
        make = self._blank
        if started_with is not None:
            own_handlers, own = started_with

            def mine(bound: Sequence[Any], given: Sequence[Any]) -> tuple[Any, ...]:
                # Bound by name, two callables of one name are both one of
                # them: the loop's own, named in the same order, are each itself.
                n = len(given)
                names = [callable_name(value) for value in given]
                if [callable_name(value) for value in bound[:n]] == names:
                    return (*given, *bound[n:])
                return tuple(bound)

            def make(
                inference_input: InferenceInput,
                bound: tuple[Any, ...],
                options: LoopOptions,
            ) -> Loop:
                finish = options.finish_turn
                if finish is not None and own.finish_turn is not None:
                    (finish,) = mine((finish,), (own.finish_turn,))
                options = replace(
                    options,
                    stop_when=mine(options.stop_when, own.stop_when),
                    tool_wrappers=mine(options.tool_wrappers, own.tool_wrappers),
                    model_wrappers=mine(options.model_wrappers, own.model_wrappers),
                    finish_turn=finish,
                )
                return self._blank(inference_input, mine(bound, own_handlers), options)

        loop = restore(record, items, bindings, make)
        loop.keep_deadline(record.deadline_at)
        self._take_recovered(loop)
        return loop.loop_id

    @property
    def store(self) -> LoopStore | None:
        """The durable store the runtime's loops are kept in (None: none)."""
        return None if self._keeper is None else self._keeper.store

    def watch(self, loop_id: str, after_seq: int = 0) -> AsyncGenerator[AgentEvent]:
        """A loop's events with a seq above `after_seq`, until its `loop.idle`:
        those its store kept, then the live ones, without a gap or a repeat. A
        watcher that reconnects passes the last seq it saw. While it is open,
        the loop's live events wait for it to read them (a backpressure
        subscription): close it when it stops reading.

        ```python
        async with contextlib.aclosing(runtime.watch(loop_id, last_seen)) as events:
            async for event in events:
                send(event)  # a watcher that may stop early closes it (aclosing)
        ```

        Raises:
            LoopStateError: the runtime's store keeps no events (make it with
                `events=True`).
        """
        check("loop_id", loop_id, str)
        check("after_seq", after_seq, int)
        keeper = self._keeper
        if keeper is None or not keeper.store.keeps_events:
            raise LoopStateError(
                "watch() reads the events a store keeps: "
                "Runtime(store=SQLiteStore(path, events=True))"
            )
        from agentfsm._durable.events import watch
        from agentfsm.store import EventArchive

        assert isinstance(keeper.store, EventArchive)
        return watch(self.bus, keeper.store, keeper, loop_id, after_seq)

    def events(self, loop_id: str) -> Subscription:
        """The events of a loop started with `stream=True`, from its first
        (`loop.started`) to its last (`loop.idle`, or `loop.detached` for a
        durable loop that stopped here without ending); the iteration ends after
        it. No store is needed.

        The loop's events are kept from its start, so none is missed however
        late this is called while the loop runs or is paused (its stream goes
        on after `resume`). After it ended (or, durable, stopped here), they
        are kept until `keep_streams` (`Runtime(keep_streams=)`, 100) other
        loops ended with their streams untaken after it, and no longer than
        its result (`keep_finished`); after the runtime exited, too. They are
        handed over to one reader: a second call raises. The buffer is
        unbounded, so a slow reader never holds the loop; events leave it as
        they are read. Closing the subscription (`with`, or `close()`) only
        stops new events coming: those already in it can still be read (the
        runtime closes it itself after the loop's last event), and they go
        when the subscription does.

        ```python
        loop_id = runtime.run_loop("agent", "hello", request, stream=True)
        with runtime.events(loop_id) as events:
            async for event in events:
                print(event.type)  # loop.started ... loop.idle
        ```

        Raises:
            UnknownLoopError: no such loop (or its result was forgotten).
            LoopStateError: the loop was not started with `stream=True`, its
                events were handed over already, or it ended `keep_streams`
                untaken streams ago (its events were dropped).
        """
        check("loop_id", loop_id, str)
        events = self._streams.pop(loop_id, None)
        if events is None:
            events = self._ended_streams.pop(loop_id, None)
        if events is None:
            self._live(loop_id)  # unknown, forgotten or detached: raises why
            raise LoopStateError(
                f"loop {loop_id}'s events are not kept: it was started without "
                "stream=True, or its events were handed over already (events() "
                "hands them to one reader), or it ended with them not taken "
                f"until keep_streams={self._keep_streams} other such loops "
                "ended after it. Start it with run_loop(..., stream=True) (or "
                "Agent.run_stream) and call events() once, soon enough"
            )
        return events

    def _stream_untaken(self, loop_id: str, *, kept: bool) -> None:
        """A loop ended, or stopped here: its events, if not taken, join the
        last `keep_streams` loops' (unless its result is not `kept`)."""
        events = self._streams.pop(loop_id, None)
        if events is not None and kept:
            ended = self._ended_streams
            ended[loop_id] = events
            if len(ended) > self._keep_streams:
                del ended[next(iter(ended))]  # the oldest untaken

    def _stream_ended(self, loop: Loop) -> None:
        """Close a streamed loop's subscription once its last event is in it
        (not while the loop still holds events for a full backpressure
        subscriber: its run closes it after it delivered them)."""
        if loop.outbox is None:
            events = self._streaming.pop(loop.loop_id, None)
            if events is not None:
                events.close()

    def _take_recovered(self, loop: Loop) -> None:
        if self._extensions:
            extend(loop, self._extensions, strict=False)
        self._detached.pop(loop.loop_id, None)
        self._loops[loop.loop_id] = loop
        self.breakpoints.chain(loop)  # this runtime's, not those it was stored with
        if loop.status is LoopStatus.paused:
            self._run_ended(loop)  # its deadline timer, if it has one
        else:
            self._spawn(loop)

    def _knows(self, loop_id: str) -> bool:
        """Whether a loop of this id is running, paused or kept finished."""
        return loop_id in self._loops or loop_id in self._results

    def _live(self, loop_id: str) -> Loop | None:
        """The running or paused loop with this id; None if it has finished.

        Raises:
            ArgumentTypeError: `loop_id` is not a str.
            UnknownLoopError: no such loop (never started, or forgotten).
        """
        check("loop_id", loop_id, str)
        loop = self._loops.get(loop_id)
        if loop is None and loop_id not in self._results:
            detached = self._detached.get(loop_id)
            if detached is not None:
                raise LoopDetachedError(loop_id, detached.reason, detached.cause)
            raise UnknownLoopError(loop_id)
        return loop

    async def wait(self, loop_id: str) -> LoopResult:
        """Wait for a loop to end and return its result (whatever its outcome).

        Raises:
            UnknownLoopError: no such loop.
            LoopDetachedError: a durable loop stopped in this runtime without
                ending (its store failed, another runtime took it, or this one
                closed): the store keeps it, for `recover`.
        """
        loop = self._live(loop_id)
        if loop is None:
            return self._results[loop_id]
        await loop.wait()
        result = self._results.get(loop_id)
        if result is not None:
            return result
        if loop.detached:
            self._live(loop_id)  # stopped here meanwhile: raises why
        return loop.result()

    def get(self, loop_id: str) -> LoopView:
        """A snapshot of a loop: its state, status, path and totals."""
        loop = self._live(loop_id)
        if loop is not None:
            return loop.view()
        result = self._results[loop_id]
        return LoopView(
            loop_id=loop_id,
            agent_id=result.agent_id,
            state=LoopState.idle,
            status=LoopStatus.done,
            path=result.path,
            outcome=result.outcome,
            usage=result.usage,
            model_requests=result.model_requests,
            tool_calls=result.tool_calls,
        )

    def snapshot(self, loop_id: str) -> LoopRecord:
        """The record of a running or paused loop, as data that round-trips
        through JSON (see `agentfsm.record.LoopRecord`).

        Raises:
            UnknownLoopError: no such loop.
            LoopStateError: the loop has finished (its record is not kept;
                `wait` and `get` tell how it ended).
        """
        loop = self._live(loop_id)
        if loop is None:
            raise LoopStateError(
                f"loop {loop_id} has finished: its record is not kept "
                "(use wait() or get() for its result)"
            )
        return loop.snapshot()

    def cancel(self, loop_id: str, reason: str | None = None) -> None:
        """Cancel a loop (running or paused); it ends in `idle` with outcome `cancelled`.

        Cancelling a finished loop does nothing.

        Args:
            loop_id: the loop.
            reason: why (the loop's result and `loop.idle` event carry it).
        """
        check("reason", reason, str | None)
        loop = self._live(loop_id)
        if reason is not None:
            reason = encodable(reason)
        if loop is not None and loop.cancel(reason) and self._tg is not None:
            self._spawn(loop)

    def resume(
        self, loop_id: str, decision: Decision | None = None, *, by: str | None = None
    ) -> None:
        """Continue a paused loop; `decision` replaces the handler's `Pause`.

        A durable loop stores the decision (with `by`, who gave it, and when)
        before it takes effect: a loop taken up after a crash never asks for it
        again, and `store.decisions(loop_id)` reads it back.

        Raises:
            LoopStateError: the loop is not paused.
        """
        # Refused before anything else: the loop stays paused as it was.
        if not isinstance(decision, Proceed | Rewrite | Pause | Abort | None):
            raise ArgumentTypeError(
                "resume() takes a decision (Proceed, Rewrite, Pause or Abort) or "
                f"None as decision, got {given(decision)}"
            )
        check("by", by, str | None)
        loop = self._live(loop_id)
        if loop is None:
            raise LoopStateError(f"loop {loop_id} is done, not paused")
        if loop.status is not LoopStatus.paused:
            raise LoopStateError(f"loop {loop_id} is {loop.status}, not paused")
        if self._tg is None:
            raise LoopStateError("the runtime is not running")
        workers = self._workers
        assert workers is not None
        chosen = decision if decision is not None else Proceed()

        def start(loop: Loop) -> None:
            loop.resume(chosen, by)
            workers.resume(loop)

        if not loop.extensions:
            start(loop)
        else:
            start_with_extensions(loop, start)

    def steer(self, loop_id: str, message: UserMessage | str) -> None:
        """Queue a steering message for a running loop.

        It enters the context after the current tool batch (or before the first
        request), ahead of the next model request. Steering never cancels a
        stream and never skips tools.

        Raises:
            LoopStateError: the loop has ended.
        """
        self._queue(loop_id, message, follow_up=False)

    def follow_up(self, loop_id: str, message: UserMessage | str) -> None:
        """Queue a follow-up: sent after an answer, when no steering is pending.

        Raises:
            LoopStateError: the loop has ended.
        """
        self._queue(loop_id, message, follow_up=True)

    def _queue(
        self, loop_id: str, message: UserMessage | str, *, follow_up: bool
    ) -> None:
        if not isinstance(message, str | UserMessage):  # callers without a type checker
            kind = "follow_up" if follow_up else "steer"  # type: ignore[unreachable]
            raise ArgumentTypeError(
                f"{kind}() takes a str or a UserMessage as message, got {given(message)}"
            )
        loop = self._live(loop_id)
        if loop is None or loop.status is LoopStatus.done:
            raise LoopStateError(f"loop {loop_id} has ended; start a new loop instead")
        if isinstance(message, str):
            message = UserMessage(content=message)
        message = checked_message("message", message)
        if type(message.content) is not str:
            refuse_unsupported_images((message,), loop.input.model, self.providers)
        loop.queue(message, follow_up=follow_up)
        if loop.journal is not None and loop.status is LoopStatus.paused:
            loop.journal.store_queued(loop)  # stored with the pause, not only in memory

    def loops(self, *, status: LoopStatus | None = None) -> list[str]:
        """Ids of the loops the runtime knows, oldest first (optionally of one status)."""
        check("status", status, LoopStatus | None)
        ids = [
            i for i, lp in self._loops.items() if status is None or lp.status is status
        ]
        if status is None or status is LoopStatus.done:
            ids.extend(self._results)
        return sorted(ids)  # UUIDv7: sorted by creation time

    def _loop_halted(self, loop: Loop, reason: str, error: StoreError | None) -> None:
        """A durable loop stopped here without ending (`driver.halt`): it is no
        longer this runtime's; whoever waits for it learns why."""
        self._loops.pop(loop.loop_id, None)
        self._detached[loop.loop_id] = LoopDetachedError(loop.loop_id, reason, error)
        if self._streams:
            self._stream_untaken(loop.loop_id, kept=True)
        while len(self._detached) > max(self._keep_finished, 1):
            forgotten = next(iter(self._detached))
            del self._detached[forgotten]
            self._ended_streams.pop(forgotten, None)
        if self._streaming:
            self._stream_ended(loop)
        if loop.extensions:
            loop_ended(loop)
        timer = self._timers.pop(loop.loop_id, None)
        if timer is not None:
            timer.cancel()
        keeper = self._keeper
        if keeper is not None:
            epoch = keeper.forget(loop.loop_id)
            if self._tg is not None and not isinstance(error, LeaseLostError):
                # Its lease, for whoever takes it up (here too: `recover`).
                self._tg.start_soon(keeper.release, loop.loop_id, epoch)
        if loop.done is not None:
            loop.done.set()

    def _lease_lost(self, loop_id: str, error: LeaseLostError) -> None:
        """Another runtime took a loop's lease. A running loop stops at its next
        step; a paused one, which holds no task to find out, stops here now
        (whoever waits for it learns why)."""
        loop = self._loops.get(loop_id)
        if loop is not None and loop.status is LoopStatus.paused and not loop.detached:
            halt(loop, str(error), error)

    def _loop_done(self, loop: Loop) -> None:
        self._loops.pop(loop.loop_id, None)
        if self._keeper is not None:
            self._keeper.forget(loop.loop_id)
        if loop.extensions:
            loop_ended(loop)
        timer = self._timers.pop(loop.loop_id, None)
        if timer is not None:
            timer.cancel()
        if self._streaming:
            self._stream_ended(loop)
        if self._streams:
            self._stream_untaken(loop.loop_id, kept=self._keep_finished > 0)
        if self._keep_finished:
            results = self._results
            results[loop.loop_id] = loop.result()
            if len(results) > self._keep_finished:
                forgotten = next(iter(results))  # the oldest finished
                del results[forgotten]
                if self._ended_streams:
                    self._ended_streams.pop(forgotten, None)


def _requests_interval(requests: object) -> float | None:
    """`Runtime(requests=)` as seconds between reads (None: no watcher).

    Raises:
        ArgumentTypeError, ArgumentValueError: neither a bool nor a duration.
    """
    if requests is False:
        return None
    if requests is True:
        return 1.0
    return seconds(
        "requests",
        requests,
        positive=True,
        rule="True, False or a number of seconds > 0",
    )


def _keeper_of(
    store: LoopStore,
    bus: EventBus,
    tools: Sequence[Tool | Callable[..., Any]],
    handlers: Mapping[str, Any] | Sequence[Any],
) -> Keeper:
    # Imported only by runtimes with a store (sqlite3 and the rest load then).
    from agentfsm._durable.keeper import Keeper
    from agentfsm.store import LoopStore

    check("store", store, LoopStore, "a LoopStore (agentfsm.store)")
    return Keeper(store, bus, tools, handlers)


def run_loop(
    agent_id: str,
    message: UserMessage | str | None,
    inference_input: InferenceInput,
    interception_handler: InterceptionHandler
    | Sequence[InterceptionHandler]
    | None = None,
    *,
    stream: bool = False,
    **options: Unpack[LoopOptionsDict],
) -> str:
    """`Runtime.run_loop` on the runtime of the current context.

    Raises:
        NoRuntimeError: not inside `async with Runtime()`.
    """
    return current_runtime().run_loop(
        agent_id,
        message,
        inference_input,
        interception_handler,
        stream=stream,
        **options,
    )


# What the library's own modules outside `_runtime` read of a runtime, by
# name (the test of the layers refuses its private attributes elsewhere).


def knows(runtime: Runtime, loop_id: str) -> bool:
    """Whether `runtime` holds a loop of this id: running, paused, or ended
    and kept."""
    return runtime._knows(loop_id)


def held_loop(runtime: Runtime, loop_id: str) -> Loop | None:
    """The running or paused loop of this id `runtime` holds, or None."""
    return runtime._loops.get(loop_id)


def kept_result(runtime: Runtime, loop_id: str) -> bool:
    """Whether `runtime` keeps the result of the loop of this id."""
    return loop_id in runtime._results


def bound_callables(runtime: Runtime) -> Mapping[str, Any] | None:
    """The callables by name `runtime` binds its store's loops to (None
    without a store)."""
    keeper = runtime._keeper
    return None if keeper is None else keeper.bindings.callables
