"""One loop's driver: intercept the pending transition, take it, run the state.

A loop is a small record plus a pending transition (`_next`). Its task runs
`_drive`, which repeats: `_intercept` (handlers may rewrite, pause or abort),
`_commit` (record the edge, publish `loop.transition`), then the state's
coroutine, which leaves the next pending transition behind. A paused loop's
task simply returns: nothing waits on its behalf, and `Runtime.resume` starts
a new task that picks up at the same pending transition.

The states run in `_states`, tool batches in `_batch`, model requests in `_request`.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Awaitable, Sequence
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

import anyio
import structlog
from anyio import TaskHandle
from structlog.typing import FilteringBoundLogger

from . import _fast
from . import events as ev
from ._batch import chain_tool_wrappers
from ._logging import logger
from ._machine import ALLOWED, TABLE
from ._request import ContextScan, chain_model_wrappers, request_model
from ._states import _S, _T, STATES, Step
from .exceptions import (
    LoopAborted,
    LoopTimeout,
    TransitionRejected,
)
from .interception import (
    Abort,
    Decision,
    InterceptionHandler,
    Pause,
    PendingTransition,
    Proceed,
    Rewrite,
    ToolBatch,
    TransitionPayload,
)
from .messages import (
    ModelMessageItem,
    TokenUsage,
    UserMessage,
)
from .options import LoopOptions
from .providers import InferenceInput, InferenceOutput, ModelRequest, RequestMetadata
from .results import ErrorInfo, LoopResult, LoopStatus, LoopView, PathStep
from .states import LoopState, Outcome, Trigger
from .tools import Tool

if TYPE_CHECKING:
    from ._bus import Subscription
    from ._runtime import Runtime

__all__ = ("Loop", "current_loop_id")

_new = object.__new__
_tuple_new = tuple.__new__
_setattr = object.__setattr__
_NO_USAGE: Final = TokenUsage()
_MESSAGE_TRIGGERS: Final = frozenset({_T.start, _T.steer, _T.follow_up})
_REQUEST_TRIGGERS: Final = frozenset({_T.infer, _T.infer_streaming})
_ANSWER_TRIGGERS: Final = frozenset({_T.answer, _T.finish})

_current_loop: ContextVar[str | None] = ContextVar("agentfsm_loop_id", default=None)


def current_loop_id() -> str | None:
    """The id of the loop whose task is running (tools and providers may ask), or None."""
    return _current_loop.get()


class Loop:
    """The state and driver of one loop (internal; users see `LoopView` and `LoopResult`)."""

    __slots__ = (
        "_bound_log",
        "_bus",
        "_cancel_reason",
        "_cancel_requested",
        "_deadline_at",
        "_done",
        "_follow_ups",
        "_gated",
        "_handle",
        "_handlers",
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
        "_truncated",
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
            handlers = (self._approval_gate, *handlers)
        self._handlers = tuple(handlers)
        self._tool_chain = chain_tool_wrappers(options.tool_wrappers)
        self._model_chain = (
            chain_model_wrappers(options.model_wrappers, self._request_model)
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
        self._request: InferenceInput = inference_input
        self._metadata: RequestMetadata | None = None
        self._scan = ContextScan()
        self._steering: deque[UserMessage] | None = None  # made on first use
        self._follow_ups: deque[UserMessage] | None = None
        self._last_tools: list[str] = []
        self._tool_index: tuple[Sequence[Tool], dict[str, Tool]] | None = None
        self._truncated = False
        self._structured_failures = 0
        self._stop_reason: str | None = None
        self._deadline_at: float | None = None
        self._paused: tuple[PendingTransition, int, str, LoopState] | None = None
        self._resume: tuple[Decision, int, LoopState] | None = None
        self._handle: TaskHandle[None] | None = None  # the running task, if any
        self._cancel_requested = False
        self._cancel_reason: str | None = None
        self._outbox: list[ev.AgentEvent] = []
        self._done: anyio.Event | None = None  # made when someone waits
        self._emit(
            ev.LoopStarted,
            message=message,
            model=inference_input.model,
            streaming=inference_input.streaming,
        )

    @property
    def _log(self) -> FilteringBoundLogger:
        """This loop's logger, bound to its ids (bound on first use: most loops
        log once, when they end)."""
        if self._bound_log is None:
            self._bound_log = logger.bind(loop_id=self.loop_id, agent_id=self.agent_id)
        return self._bound_log

    # ------------------------------------------------------------------ events

    def _emit(self, cls: type[ev.AgentEvent], /, **fields: Any) -> None:
        # The hot path of every step: a dozen events per step, so this stays flat
        # (no helper calls until there is a subscriber to deliver to).
        seq = self.seq = self.seq + 1
        bus = self._bus
        event_type = cls._type
        targets: Sequence[Subscription] | None = bus._routes.get(event_type)
        if targets is None or bus._by_loop:
            targets = bus.targets(event_type, self.loop_id)
        if not targets:
            return
        values = cls._defaults.copy()
        values.update(fields)
        values["event_id"] = f"{self.loop_id}:{seq}"
        values["loop_id"] = self.loop_id
        values["agent_id"] = self.agent_id
        values["seq"] = seq
        values["state"] = self.state
        values["ts"] = datetime.now(UTC)
        event = _new(cls)
        _setattr(event, "__dict__", values)
        _setattr(event, "__pydantic_fields_set__", cls._fields_set)
        _setattr(event, "__pydantic_extra__", None)
        _setattr(event, "__pydantic_private__", None)
        if bus.backpressure:
            self._outbox.append(event)
        else:
            bus._deliver(event, targets)

    async def _flush(self) -> None:
        outbox, self._outbox = self._outbox, []
        for event in outbox:
            await self._runtime.bus.publish(event)

    # ------------------------------------------------------------------ task

    async def run(self) -> None:
        """The loop's task: drive until idle or paused; never raises but cancellation."""
        # Each task runs in its own copy of the context, so binding needs no reset.
        _current_loop.set(self.loop_id)
        structlog.contextvars.bind_contextvars(
            loop_id=self.loop_id, agent_id=self.agent_id
        )
        await self._run()

    async def _run(self) -> None:
        # `Runtime.cancel` cancels the scope anyio gives each task (the task
        # handle's); the cancellation arrives here like the runtime closing does.
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
        """Ask the loop to cancel; returns whether a task must be started to finish it."""
        if self.status is LoopStatus.done or self._cancel_requested:
            return False
        self._cancel_requested = True
        self._cancel_reason = reason
        if self._handle is not None:
            self._handle.cancel()
            return False
        if self.status is LoopStatus.paused:
            self.status = LoopStatus.running
            self._paused = None
            return True
        return False  # not started yet: its task will see the flag

    def resume(self, decision: Decision) -> None:
        """Continue a paused loop with `decision` in place of the handler's `Pause`."""
        assert self._paused is not None
        pending, index, _, original = self._paused
        self._paused = None
        self._resume = (decision, index, original)
        self._next = (pending.trigger, pending.payload)
        self.status = LoopStatus.running
        self._emit(ev.LoopResumed, decision=decision.kind)

    async def wait(self) -> None:
        """Wait until the loop is done."""
        if self.status is LoopStatus.done:
            return
        if self._done is None:
            self._done = anyio.Event()
        await self._done.wait()

    # ------------------------------------------------------------------ driver

    async def _drive(self) -> None:
        while True:
            source = self.state
            trigger, payload = self._next
            dest = TABLE[source, trigger]
            original: LoopState | None = None
            if self._handlers or self._resume is not None:
                decided = await self._intercept(source, trigger, dest, payload)
                if decided is None:
                    return  # paused
                trigger, new_dest, payload, original = decided
                if new_dest is dest and original is dest:
                    original = None
                dest = new_dest
            self._commit(source, trigger, dest, original)
            if dest is _S.idle:
                # A handler may rewrite the final answer at `finish`.
                answered = trigger is _T.finish and self.answer is not None
                if answered and isinstance(payload, ModelMessageItem):
                    self.answer = payload
                if trigger is _T.finish and self._stop_reason is None:
                    self._finish(Outcome.answered, None)
                else:
                    self._finish(Outcome.stopped, self._stop_reason or "intercepted")
                return
            await STATES[dest](self, payload)
            if self._outbox:
                await self._flush()

    def _commit(
        self,
        source: LoopState,
        trigger: Trigger,
        dest: LoopState,
        rewritten_from: LoopState | None = None,
    ) -> None:
        self.path.append(_tuple_new(PathStep, (source, trigger, dest, rewritten_from)))
        self.state = dest
        self._emit(
            ev.LoopTransition,
            source=source,
            trigger=trigger,
            dest=dest,
            rewritten_from=rewritten_from,
        )

    # ------------------------------------------------------------------ interception

    def _pending(
        self,
        source: LoopState,
        trigger: Trigger,
        dest: LoopState,
        payload: TransitionPayload,
    ) -> PendingTransition:
        return PendingTransition(
            loop_id=self.loop_id,
            agent_id=self.agent_id,
            seq=self.seq + 1,
            source=source,
            trigger=trigger,
            dest=dest,
            payload=payload,
            model_requests=self.model_requests,
            tool_calls=self.tool_calls,
            usage=self.usage,
            metadata=self._metadata if trigger in _REQUEST_TRIGGERS else None,
        )

    def _approval_gate(self, pending: PendingTransition) -> Decision | None:
        """Pause a batch holding calls that need approval (runs as the first handler).

        The batch lists them in `awaiting_approval`; resuming approves every one
        the resuming decision did not deny.
        """
        batch = pending.payload
        if pending.trigger is not _T.call_tools or not isinstance(batch, ToolBatch):
            return None
        waiting = [c for c in batch.calls if c.call_id in batch.awaiting_approval]
        if not waiting:
            return None
        names = ", ".join(sorted({c.name for c in waiting}))
        return Pause(f"approval required: {names}")

    async def _intercept(
        self,
        source: LoopState,
        trigger: Trigger,
        dest: LoopState,
        payload: TransitionPayload,
    ) -> tuple[Trigger, LoopState, TransitionPayload, LoopState] | None:
        """Run the handlers; return the edge to take, or None when the loop paused."""
        original = dest
        start = 0
        resumed: Decision | None = None
        if self._resume is not None:
            resumed, start, original = self._resume
            self._resume = None
        stop = (
            len(self._handlers)
            if resumed is None
            else max(len(self._handlers), start + 1)
        )
        for index in range(start, stop):
            if resumed is not None:
                decision: Decision | None = resumed
                handler_index = -1
                resumed = None
            else:
                pending = self._pending(source, trigger, dest, payload)
                decision = await _call_handler(self._handlers[index], pending)
                handler_index = index
            match decision:
                case None | Proceed():
                    self._decided(source, trigger, dest, handler_index, "proceed")
                case Rewrite():
                    new_trigger, new_dest, payload = self._rewrite(
                        source, trigger, dest, payload, decision
                    )
                    # The event names the edge proposed to the handler, and its choice.
                    self._decided(
                        source,
                        trigger,
                        dest,
                        handler_index,
                        "rewrite",
                        new_dest=new_dest,
                        payload=_event_payload(payload),
                    )
                    trigger, dest = new_trigger, new_dest
                case Pause(reason=reason):
                    self._decided(
                        source, trigger, dest, handler_index, "pause", reason=reason
                    )
                    self._park(
                        self._pending(source, trigger, dest, payload),
                        index,
                        reason,
                        original,
                    )
                    return None
                case Abort(reason=reason):
                    self._decided(
                        source, trigger, dest, handler_index, "abort", reason=reason
                    )
                    raise LoopAborted(reason)
                case _:
                    raise TypeError(
                        f"interception handler returned {decision!r}; expected "
                        "Proceed, Rewrite, Pause, Abort or None"
                    )
        return trigger, dest, payload, original

    def _decided(
        self,
        source: LoopState,
        trigger: Trigger,
        dest: LoopState,
        handler: int,
        decision: str,
        **fields: Any,
    ) -> None:
        self._log.info(
            "transition_intercepted",
            source=source,
            trigger=trigger,
            dest=dest,
            decision=decision,
            handler=handler,
            **{k: v for k, v in fields.items() if k == "reason" or k == "new_dest"},
        )
        self._emit(
            ev.TransitionIntercepted,
            source=source,
            trigger=trigger,
            dest=dest,
            decision=decision,
            handler=handler,
            **fields,
        )

    def _park(
        self, pending: PendingTransition, index: int, reason: str, original: LoopState
    ) -> None:
        self._paused = (pending, index, reason, original)
        self.status = LoopStatus.paused
        self._emit(
            ev.LoopPaused,
            source=pending.source,
            trigger=pending.trigger,
            dest=pending.dest,
            reason=reason,
            payload=_event_payload(pending.payload),
        )

    def _rewrite(
        self,
        source: LoopState,
        trigger: Trigger,
        dest: LoopState,
        payload: TransitionPayload,
        rewrite: Rewrite,
    ) -> tuple[Trigger, LoopState, TransitionPayload]:
        new_dest = rewrite.dest if rewrite.dest is not None else dest
        new_trigger = trigger if new_dest is dest else ALLOWED[source].get(new_dest)
        if new_trigger is None:
            legal = ", ".join(f"{d} (via {t})" for d, t in ALLOWED[source].items())
            raise TransitionRejected(
                f"illegal rewrite of {source} --{trigger}--> {dest}: there is no edge from "
                f"{source} to {new_dest} (legal destinations: {legal})",
                loop_id=self.loop_id,
                source=source,
                trigger=trigger,
                dest=new_dest,
            )
        new_payload = rewrite.payload
        if new_payload is None and new_trigger is trigger:
            new_payload = payload
        elif new_payload is None:
            new_payload = self._derived_payload(new_trigger, payload)
        problem = _payload_problem(new_trigger, new_payload)
        if problem is not None:
            raise TransitionRejected(
                f"illegal rewrite of {source} --{trigger}--> {dest}: {problem}",
                loop_id=self.loop_id,
                source=source,
                trigger=trigger,
                dest=new_dest,
            )
        return new_trigger, new_dest, new_payload

    def _derived_payload(
        self, trigger: Trigger, payload: TransitionPayload
    ) -> TransitionPayload:
        """The payload a changed edge acts on when the rewrite did not give one."""
        if trigger in _REQUEST_TRIGGERS:
            return payload if isinstance(payload, InferenceInput) else self.input
        if trigger in _ANSWER_TRIGGERS:
            message = self._output.message if self._output is not None else None
            return message or ModelMessageItem(content="")
        return (
            None  # steer / follow_up with nothing queued, stop; call_tools is rejected
        )

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
                ev.LoopFailed, error_type=self.error.type, message=self.error.message
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
            ev.LoopIdle,
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
        return _fast.trusted(LoopResult, values, set(values))

    def view(self) -> LoopView:
        """A snapshot of the loop."""
        paused = self._paused
        return LoopView(
            loop_id=self.loop_id,
            agent_id=self.agent_id,
            state=self.state,
            status=self.status,
            path=tuple(self.path),
            pending=paused[0] if paused else None,
            pause_reason=paused[2] if paused else None,
            outcome=self.outcome,
            usage=self.usage,
            model_requests=self.model_requests,
            tool_calls=self.tool_calls,
            last_tools=tuple(self._last_tools),
        )


async def _call_handler(
    handler: InterceptionHandler, pending: PendingTransition
) -> Decision | None:
    result = handler(pending)
    if inspect.isawaitable(result):
        result = await result
    return result


def _payload_problem(trigger: Trigger, payload: TransitionPayload) -> str | None:
    """Why `payload` cannot go with `trigger`, or None when it can."""
    if trigger in _MESSAGE_TRIGGERS:
        ok = (
            payload is None
            or isinstance(payload, UserMessage)
            or (
                isinstance(payload, tuple)
                and all(isinstance(m, UserMessage) for m in payload)
            )
        )
        expected = "a UserMessage, a tuple of them, or None"
    elif trigger in _REQUEST_TRIGGERS:
        ok, expected = isinstance(payload, InferenceInput), "an InferenceInput"
    elif trigger is _T.call_tools:
        ok, expected = isinstance(payload, ToolBatch), "a ToolBatch"
    elif trigger in _ANSWER_TRIGGERS:
        ok, expected = isinstance(payload, ModelMessageItem), "a ModelMessageItem"
    else:
        return None
    if ok:
        return None
    return f"{trigger} needs {expected} as payload, got {type(payload).__name__}"


def _event_payload(payload: TransitionPayload) -> ev.EventPayload | None:
    if isinstance(payload, InferenceInput):
        return ev.RequestSummary(
            model=payload.model,
            max_output_tokens=payload.max_output_tokens,
            reasoning_effort=payload.reasoning_effort,
            tool_choice=payload.tool_choice,
            tools=tuple(t.name for t in payload.tools),
            instructions=payload.context.instructions,
            context_items=len(payload.context.items),
        )
    return payload
