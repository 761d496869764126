"""One loop's driver: intercept the pending transition, take it, run the state.

A loop is a small record plus a pending transition (`_next`). A worker task
(`_workers`) runs `_drive`, which repeats: `_intercept` (handlers may rewrite,
pause or abort), `_commit` (record the edge, publish `loop.transition`), then
the state's coroutine, which leaves the next pending transition behind. A
paused loop's run simply returns: nothing waits on its behalf, and
`Runtime.resume` hands the loop to a worker again, which picks up at the same
pending transition.

Handlers run in `_intercept`, the states in `_states`, tool batches in `_batch`,
model requests in `_request`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Sequence
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

import anyio

from . import _fast
from ._batch import chain_tool_wrappers
from ._fast import _new, _setattr  # events are made as `_fast.trusted` makes models
from ._intercept import approval_gate, intercept
from ._logging import bind_contextvars, get_logger
from ._machine import TABLE
from ._request import chain_wrappers, context_scan, request_model
from ._states import _S, _T, STATES, Step
from .exceptions import (
    LoopAborted,
    LoopTimeout,
)
from .inference import InferenceInput, InferenceOutput, ModelRequest, RequestMetadata
from .interception import (
    Decision,
    InterceptionHandler,
    PendingTransition,
    TransitionPayload,
)
from .messages import (
    ModelMessageItem,
    TokenUsage,
    UserMessage,
)
from .options import LoopOptions
from .results import ErrorInfo, LoopResult, LoopStatus, LoopView, PathStep
from .states import LoopState, Outcome, Trigger
from .tools import Tool

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from . import events as ev
    from ._bus import Subscription
    from ._runtime import Runtime
    from ._workers import Worker

__all__ = ("Loop", "current_loop_id")

_tuple_new = tuple.__new__

EventType: TypeAlias = Literal[
    "loop.started",
    "transition.intercepted",
    "loop.paused",
    "loop.resumed",
    "loop.transition",
    "inference.stream",
    "inference.completed",
    "function_call.started",
    "function_call.progress",
    "function_call.completed",
    "model.answer",
    "loop.failed",
    "loop.idle",
]
"""The events a loop publishes, by type (`agentfsm.events` has their classes).

Loops name events by type, and `agentfsm.events` is imported only once someone
subscribes (`EventBus.subscribe` imports it): a loop nobody watches builds no
event, and its ~15 model classes are the largest part of `import agentfsm`
(~10 ms)."""

_SPECS: dict[str, tuple[Any, dict[str, Any], set[str]]] = {}
"""`events._SPECS` (type -> event class, template, fields set) once
`_event_specs` has found it."""


def _event_specs() -> dict[str, tuple[Any, dict[str, Any], set[str]]]:
    """`events._SPECS`, imported on the first event built (someone subscribed)."""
    from .events import _SPECS as specs

    _SPECS.update(specs)
    return _SPECS


_STEPS: dict[tuple[LoopState, Trigger, LoopState, LoopState | None], PathStep] = {}
"""One `PathStep` per edge taken (a few dozen), shared by every loop's path: a
step is an immutable tuple, and a path of shared steps leaves the garbage
collector ten objects fewer to walk per loop in flight or kept for `wait`."""
# Built without validation: validating at import would build TokenUsage's schema
# (and load pydantic's plugins) before anyone needs it.
_NO_USAGE: Final = _fast.trusted(
    TokenUsage,
    {
        "input_tokens": 0,
        "output_tokens": 0,
        "reasoning_tokens": 0,
        "cached_input_tokens": 0,
    },
    set(),
)

_RESULT_FIELDS: Final = set(LoopResult.model_fields)
"""Every field `Loop.result` sets (shared: pydantic copies it before changing it)."""

_VIEW_FIELDS: Final = set(LoopView.model_fields)

_current_loop: ContextVar[str | None] = ContextVar("agentfsm_loop_id", default=None)


def current_loop_id() -> str | None:
    """The id of the loop whose task is running (tools and providers may ask), or None."""
    return _current_loop.get()


class Loop:
    """The state and driver of one loop (internal; users see `LoopView` and `LoopResult`)."""

    __slots__ = (
        "_answer_at",
        "_bound_log",
        "_bus",
        "_cancel_reason",
        "_cancel_requested",
        "_deadline_at",
        "_done",
        "_follow_ups",
        "_gated",
        "_handlers",
        "_history",
        "_last_tools",
        "_metadata",
        "_model_chain",
        "_next",
        "_outbox",
        "_output",
        "_paused",
        "_request",
        "_resume",
        "_runtime",
        "_scan",
        "_steering",
        "_stop_reason",
        "_structured_failures",
        "_tool_chain",
        "_tool_index",
        "_worker",
        "agent_id",
        "answer",
        "ended_at",
        "error",
        "input",
        "loop_id",
        "model_requests",
        "options",
        "outcome",
        "parsed",
        "path",
        "reason",
        "seq",
        "started_at",
        "state",
        "status",
        "tool_calls",
        "usage",
    )

    def __init__(
        self,
        runtime: Runtime,
        loop_id: str,
        agent_id: str,
        message: UserMessage | None,
        inference_input: InferenceInput,
        handlers: Sequence[InterceptionHandler],
        options: LoopOptions,
    ) -> None:
        self._runtime = runtime
        self._bus = runtime.bus
        self.loop_id = loop_id
        self.agent_id = agent_id
        self.input = inference_input
        self.options = options
        self._gated = any(t.needs_approval for t in inference_input.tools)
        if self._gated:
            handlers = (approval_gate, *handlers)
        self._handlers = tuple(handlers)
        self._tool_chain = chain_tool_wrappers(options.tool_wrappers)
        self._model_chain = (
            chain_wrappers(options.model_wrappers, self._request_model)
            if options.model_wrappers
            else None
        )
        self._bound_log: FilteringBoundLogger | None = None
        self.state = _S.idle
        self.status = LoopStatus.running
        self.seq = 0
        self.path: list[PathStep] = []
        self.usage = _NO_USAGE
        self.model_requests = 0
        self.tool_calls = 0
        self.outcome: Outcome | None = None
        self.reason: str | None = None
        self.answer: ModelMessageItem | None = None
        self.parsed: Any = None
        self.error: ErrorInfo | None = None
        self.started_at = datetime.now(UTC)
        self.ended_at: datetime | None = None
        self._next: Step = (_T.start, message)
        self._output: InferenceOutput | None = None
        self._answer_at: int | None = None  # where the answer sits in the context
        self._request: InferenceInput = inference_input
        self._metadata: RequestMetadata | None = None  # made when first read
        self._history = 0  # items in the context when the last request was made
        self._scan = context_scan(inference_input.context)
        self._steering: deque[UserMessage] | None = None  # made on first use
        self._follow_ups: deque[UserMessage] | None = None
        self._last_tools: list[str] = []
        self._tool_index: tuple[Sequence[Tool], dict[str, Tool]] | None = None
        self._structured_failures = 0
        self._stop_reason: str | None = None
        self._deadline_at: float | None = None
        self._paused: tuple[PendingTransition, int, str, LoopState] | None = None
        self._resume: tuple[Decision, int, LoopState] | None = None
        self._worker: Worker | None = None  # the worker running the loop, if any
        self._cancel_requested = False
        self._cancel_reason: str | None = None
        # Events waiting to be published; made when a subscriber with
        # backpressure needs them held.
        self._outbox: list[ev.AgentEvent] | None = None
        self._done: anyio.Event | None = None  # made when someone waits
        self._emit(
            "loop.started",
            message=message,
            model=inference_input.model,
            streaming=inference_input.streaming,
        )

    @property
    def _log(self) -> FilteringBoundLogger:
        """This loop's logger, bound to its ids (bound on first use: most loops
        log once, when they end)."""
        if self._bound_log is None:
            self._bound_log = get_logger().bind(
                loop_id=self.loop_id, agent_id=self.agent_id
            )
        return self._bound_log

    # ------------------------------------------------------------------ events

    def _emit(self, event_type: EventType, /, **fields: Any) -> None:
        seq = self.seq = self.seq + 1
        bus = self._bus
        if not bus.listening:
            return
        # `bus.targets()`, its common case inlined: this runs for every event.
        targets: Sequence[Subscription] | None = bus._routes.get(event_type)
        if targets is None or bus._by_loop:
            targets = bus.targets(event_type, self.loop_id)
        if not targets:
            return  # nobody listens: the event is not even built
        cls, template, fields_set = (_SPECS or _event_specs())[event_type]
        # What `_fast.trusted` does, for an event (see `events._Event`): the loop
        # made every value itself, in the right type, so nothing is validated.
        event = _new(cls)
        values = event.__dict__  # a new, empty dict
        values.update(template)
        loop_id = self.loop_id
        values["event_id"] = f"{loop_id}:{seq}"
        values["loop_id"] = loop_id
        values["agent_id"] = self.agent_id
        values["seq"] = seq
        values["ts"] = datetime.now(UTC)
        values["state"] = self.state
        values.update(fields)
        _setattr(event, "__pydantic_fields_set__", fields_set)
        if bus.backpressure:
            if self._outbox is None:
                self._outbox = []
            self._outbox.append(event)
        else:
            bus._deliver(event, targets)

    async def _flush(self) -> None:
        outbox, self._outbox = self._outbox, None
        for event in outbox or ():
            await self._bus.publish(event)

    # ------------------------------------------------------------------ task

    async def run(self) -> None:
        """The loop's run: drive until idle or paused; never raises but cancellation."""
        # Each run is in its own copy of the starter's context (see `_workers`),
        # so binding needs no reset.
        _current_loop.set(self.loop_id)
        bind_contextvars(loop_id=self.loop_id, agent_id=self.agent_id)
        # `Runtime.cancel` cancels the task of the worker running the loop; the
        # cancellation arrives here like the runtime closing does.
        try:
            if not self._cancel_requested:
                if self.options.deadline is None:
                    await self._drive()
                else:
                    await self._drive_until_deadline()
            if self._cancel_requested and self.status is not LoopStatus.done:
                self._end(
                    _T.cancel, Outcome.cancelled, self._cancel_reason or "cancelled"
                )
        except anyio.get_cancelled_exc_class():
            # Cancelled (by `Runtime.cancel` or the runtime closing): end the loop
            # as cancelled, then let the cancellation go on.
            reason = (
                self._cancel_reason or "cancelled"
                if self._cancel_requested
                else "runtime closed"
            )
            with anyio.CancelScope(shield=True):
                self._end(_T.cancel, Outcome.cancelled, reason)
                await self._flush()
            raise
        except LoopAborted as exc:
            self._end(_T.abort, Outcome.aborted, exc.reason)
        except Exception as exc:  # noqa: BLE001 - any error fails the loop, never the runtime
            self._log.warning(
                "loop_failed", state=self.state, error=f"{type(exc).__name__}: {exc}"
            )
            self._end(_T.fail, Outcome.failed, str(exc), exc)
        if self._outbox:
            with anyio.CancelScope(shield=True):
                await self._flush()

    async def _drive_until_deadline(self) -> None:
        """`_drive` under the loop's deadline (pauses count: it is set on the first run)."""
        assert self.options.deadline is not None
        if self._deadline_at is None:
            self._deadline_at = anyio.current_time() + self.options.deadline
        with anyio.CancelScope(deadline=self._deadline_at) as scope:
            await self._drive()
        if scope.cancelled_caught:
            raise LoopTimeout(
                f"the loop ran past its deadline of {self.options.deadline:g}s"
            )

    def cancel(self, reason: str | None) -> bool:
        """Ask the loop to cancel; returns whether it must be handed to a worker to
        finish (a paused loop)."""
        if self.status is LoopStatus.done or self._cancel_requested:
            return False
        self._cancel_requested = True
        self._cancel_reason = reason
        if self._worker is not None:
            self._worker.cancel()
            return False
        if self.status is LoopStatus.paused:
            self.status = LoopStatus.running
            self._paused = None
            return True
        return False  # not started yet: its run will see the flag

    async def end_paused(self, reason: str) -> None:
        """End a paused loop as cancelled, without a task (the runtime is closing)."""
        self._cancel_requested = True
        self._cancel_reason = reason
        self._paused = None
        self._end(_T.cancel, Outcome.cancelled, reason)
        await self._flush()

    def resume(self, decision: Decision) -> None:
        """Continue a paused loop with `decision` in place of the handler's `Pause`."""
        assert self._paused is not None
        pending, index, _, original = self._paused
        self._paused = None
        self._resume = (decision, index, original)
        self._next = (pending.trigger, pending.payload)
        self.status = LoopStatus.running
        self._emit("loop.resumed", decision=decision.kind)

    async def wait(self) -> None:
        """Wait until the loop is done."""
        if self.status is LoopStatus.done:
            return
        if self._done is None:
            self._done = self._runtime._primitives.event()
        await self._done.wait()

    # ------------------------------------------------------------------ driver

    async def _drive(self) -> None:
        while True:
            source = self.state
            trigger, payload = self._next
            dest = TABLE[source, trigger]
            original: LoopState | None = None
            if self._handlers or self._resume is not None:
                decided = await intercept(self, source, trigger, dest, payload)
                if decided is None:
                    return  # paused
                trigger, new_dest, payload, original = decided
                if new_dest is dest and original is dest:
                    original = None
                dest = new_dest
            self._commit(source, trigger, dest, original)
            if dest is _S.idle:
                if trigger is _T.finish and self.answer is not None:
                    self._final_answer(payload)
                if trigger is _T.finish and self._stop_reason is None:
                    self._finish(Outcome.answered, None)
                else:
                    self._finish(Outcome.stopped, self._stop_reason or "intercepted")
                return
            await STATES[dest](self, payload)
            if self._outbox:
                await self._flush()

    def _final_answer(self, payload: TransitionPayload) -> None:
        """A handler rewrote the answer at `finish`: the context, the result and a
        second `model.answer` carry the new one."""
        if (
            payload is self.answer
            or not isinstance(payload, ModelMessageItem)
            or payload == self.answer
        ):
            return
        items = self.input.context.items
        at = self._answer_at
        if at is not None and at < len(items) and items[at] is self.answer:
            items[at] = payload
        self.answer = payload
        self._emit("model.answer", message=payload, parsed=None)

    def _commit(
        self,
        source: LoopState,
        trigger: Trigger,
        dest: LoopState,
        rewritten_from: LoopState | None = None,
    ) -> None:
        edge = (source, trigger, dest, rewritten_from)
        step = _STEPS.get(edge)
        if step is None:
            step = _STEPS[edge] = _tuple_new(PathStep, edge)
        self.path.append(step)
        self.state = dest
        if self._bus.listening:
            self._emit(
                "loop.transition",
                source=source,
                trigger=trigger,
                dest=dest,
                rewritten_from=rewritten_from,
            )
        else:
            self.seq += 1  # what `_emit` does when nobody listens, without the call

    # ------------------------------------------------------------------ queues

    def queue(self, message: UserMessage, *, follow_up: bool) -> None:
        """Queue a steering or follow-up message for this loop."""
        if follow_up:
            if self._follow_ups is None:
                self._follow_ups = deque()
            self._follow_ups.append(message)
        else:
            if self._steering is None:
                self._steering = deque()
            self._steering.append(message)

    # ------------------------------------------------------------------ states
    def _request_model(self, request: ModelRequest) -> Awaitable[InferenceOutput]:
        """The innermost link of the model wrappers' chain."""
        return request_model(self, request.input, request.streaming)

    # ------------------------------------------------------------------ endings

    def _end(
        self,
        trigger: Trigger,
        outcome: Outcome,
        reason: str | None,
        error: BaseException | None = None,
    ) -> None:
        if self.status is LoopStatus.done:
            return
        if error is not None:
            self.error = ErrorInfo(type=type(error).__name__, message=str(error))
            self._emit(
                "loop.failed", error_type=self.error.type, message=self.error.message
            )
        if self.state is not _S.idle:
            self._commit(self.state, trigger, _S.idle)
        self._finish(outcome, reason)

    def _finish(self, outcome: Outcome, reason: str | None) -> None:
        self.outcome = outcome
        self.reason = reason
        self.status = LoopStatus.done
        self.ended_at = datetime.now(UTC)
        self._paused = None
        self._emit(
            "loop.idle",
            outcome=outcome,
            reason=reason,
            answer=self.answer,
            usage=self.usage,
            model_requests=self.model_requests,
            tool_calls=self.tool_calls,
        )
        self._log.info("loop_idle", outcome=outcome, reason=reason)
        self._output = None
        if self._done is not None:
            self._done.set()
        self._runtime._loop_done(self)

    # ------------------------------------------------------------------ views

    def result(self) -> LoopResult:
        """The loop's result (only once it is done)."""
        assert self.outcome is not None
        assert self.ended_at is not None
        values = {
            "loop_id": self.loop_id,
            "agent_id": self.agent_id,
            "outcome": self.outcome,
            "reason": self.reason,
            "answer": self.answer,
            "output": self.parsed,
            "error": self.error,
            "usage": self.usage,
            "model_requests": self.model_requests,
            "tool_calls": self.tool_calls,
            "path": tuple(self.path),
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }
        return _fast.trusted(LoopResult, values, _RESULT_FIELDS)

    def view(self) -> LoopView:
        """A snapshot of the loop."""
        paused = self._paused
        values = {
            "loop_id": self.loop_id,
            "agent_id": self.agent_id,
            "state": self.state,
            "status": self.status,
            "path": tuple(self.path),
            "pending": paused[0] if paused else None,
            "pause_reason": paused[2] if paused else None,
            "outcome": self.outcome,
            "usage": self.usage,
            "model_requests": self.model_requests,
            "tool_calls": self.tool_calls,
            "last_tools": tuple(self._last_tools),
        }
        # Built without validation: stop conditions ask for one every turn.
        return _fast.trusted(LoopView, values, _VIEW_FIELDS)
