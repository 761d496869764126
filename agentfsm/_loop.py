"""One loop's driver: intercept the pending transition, take it, run the state.

A loop is a small record plus a pending transition (`_next`). Its task runs
`_drive`, which repeats: `_intercept` (handlers may rewrite, pause or abort),
`_commit` (record the edge, publish `loop.transition`), then the state's
coroutine, which leaves the next pending transition behind. A paused loop's
task simply returns: nothing waits on its behalf, and `Runtime.resume` starts
a new task that picks up at the same pending transition.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import anyio
import structlog

from . import events as ev
from ._fast import trusted
from ._logging import logger
from ._machine import ALLOWED, TABLE
from .exceptions import (
    LoopAborted,
    ProviderError,
    ToolError,
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
    ContextItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ModelMessageItem,
    TokenUsage,
    UserMessage,
)
from .providers import InferenceInput, InferenceOutput, OutputCompleted
from .results import ErrorInfo, LoopResult, LoopStatus, LoopView, PathStep
from .states import LoopState, Outcome, Trigger

if TYPE_CHECKING:
    from ._runtime import Runtime

__all__ = ("Loop", "current_loop_id")

_current_loop: ContextVar[str | None] = ContextVar("agentfsm_loop_id", default=None)


def current_loop_id() -> str | None:
    """The id of the loop whose task is running (tools and providers may ask), or None."""
    return _current_loop.get()


_S = LoopState
_T = Trigger
_NO_USAGE: Final = TokenUsage()

_Step: TypeAlias = tuple[Trigger, TransitionPayload]

_MESSAGE_TRIGGERS: Final = frozenset({_T.start, _T.steer, _T.follow_up})
_REQUEST_TRIGGERS: Final = frozenset({_T.infer, _T.infer_streaming})
_ANSWER_TRIGGERS: Final = frozenset({_T.answer, _T.finish})


class Loop:
    """The state and driver of one loop (internal; users see `LoopView` and `LoopResult`)."""

    __slots__ = (
        "_cancel_reason",
        "_cancel_requested",
        "_done",
        "_handlers",
        "_log",
        "_next",
        "_outbox",
        "_output",
        "_paused",
        "_request",
        "_resume",
        "_runtime",
        "_scope",
        "_stop_reason",
        "agent_id",
        "answer",
        "ended_at",
        "error",
        "input",
        "loop_id",
        "max_turns",
        "model_requests",
        "outcome",
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
        max_turns: int,
    ) -> None:
        self._runtime = runtime
        self.loop_id = loop_id
        self.agent_id = agent_id
        self.input = inference_input
        self.max_turns = max_turns
        self._handlers = tuple(handlers)
        self._log = logger.bind(loop_id=loop_id, agent_id=agent_id)
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
        self.error: ErrorInfo | None = None
        self.started_at = datetime.now(UTC)
        self.ended_at: datetime | None = None
        self._next: _Step = (_T.start, message)
        self._output: InferenceOutput | None = None
        self._request: InferenceInput = inference_input
        self._stop_reason: str | None = None
        self._paused: tuple[PendingTransition, int, str, LoopState] | None = None
        self._resume: tuple[Decision, int, LoopState] | None = None
        self._scope: anyio.CancelScope | None = None
        self._cancel_requested = False
        self._cancel_reason: str | None = None
        self._outbox: list[ev.AgentEvent] = []
        self._done = anyio.Event()
        self._emit(
            ev.LoopStarted,
            message=message,
            model=inference_input.model,
            streaming=inference_input.streaming,
        )

    # ------------------------------------------------------------------ events

    def _emit(self, cls: type[ev.AgentEvent], /, **fields: Any) -> None:
        self.seq += 1
        bus = self._runtime.bus
        targets = bus.targets(cls._defaults["type"], self.loop_id)
        if not targets:
            return
        fields["event_id"] = f"{self.loop_id}:{self.seq}"
        fields["loop_id"] = self.loop_id
        fields["agent_id"] = self.agent_id
        fields["seq"] = self.seq
        fields["state"] = self.state
        fields["ts"] = datetime.now(UTC)
        event = cls._trusted(fields)
        if bus.backpressure:
            self._outbox.append(event)
        else:
            bus.deliver_nowait(event, targets)

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
        try:
            if not self._cancel_requested:
                with anyio.CancelScope() as scope:
                    self._scope = scope
                    await self._drive()
                self._scope = None
            if self._cancel_requested and self.status is not LoopStatus.done:
                self._end(
                    _T.cancel, Outcome.cancelled, self._cancel_reason or "cancelled"
                )
        except anyio.get_cancelled_exc_class():
            # The runtime is closing: end the loop as cancelled, then let it go on.
            with anyio.CancelScope(shield=True):
                self._end(_T.cancel, Outcome.cancelled, "runtime closed")
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

    def cancel(self, reason: str | None) -> bool:
        """Ask the loop to cancel; returns whether a task must be started to finish it."""
        if self.status is LoopStatus.done or self._cancel_requested:
            return False
        self._cancel_requested = True
        self._cancel_reason = reason
        if self._scope is not None:
            self._scope.cancel()
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
                if trigger is _T.finish:
                    if isinstance(payload, ModelMessageItem):
                        self.answer = payload
                    self._finish(Outcome.answered, None)
                else:
                    self._finish(Outcome.stopped, self._stop_reason or "intercepted")
                return
            await _STATES[dest](self, payload)
            if self._outbox:
                await self._flush()

    def _commit(
        self,
        source: LoopState,
        trigger: Trigger,
        dest: LoopState,
        rewritten_from: LoopState | None = None,
    ) -> None:
        self.path.append(PathStep(source, trigger, dest, rewritten_from))
        self.state = dest
        self._log.debug("transition", source=source, trigger=trigger, dest=dest)
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
        )

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
                    trigger, dest, payload = self._rewrite(
                        source, trigger, dest, payload, decision
                    )
                    self._decided(
                        source,
                        trigger,
                        dest,
                        handler_index,
                        "rewrite",
                        new_dest=dest,
                        payload=_event_payload(payload),
                    )
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

    # ------------------------------------------------------------------ states

    async def _context_update(self, payload: TransitionPayload) -> None:
        if isinstance(payload, UserMessage):
            self.input.context.append(payload)
        elif isinstance(payload, tuple):
            self.input.context.extend(payload)
        self._next = self._infer_step()

    def _infer_step(self) -> _Step:
        return (_T.infer_streaming if self.input.streaming else _T.infer, self.input)

    async def _inference(self, payload: TransitionPayload) -> None:
        request = _as_request(payload)
        output = await self._runtime.providers.resolve(request.model).complete(request)
        self._completed(request, output)

    async def _inference_streaming(self, payload: TransitionPayload) -> None:
        request = _as_request(payload)
        provider = self._runtime.providers.resolve(request.model)
        output: InferenceOutput | None = None
        index = 0
        async with provider.stream(request) as stream:
            async for delta in stream:
                if isinstance(delta, OutputCompleted):
                    output = delta.output
                    continue  # read to the end, so the provider's iterator finishes cleanly
                if output is not None:
                    raise ProviderError(
                        f"the stream from {request.model!r} sent a chunk after its output"
                    )
                self._emit(ev.InferenceStream, index=index, delta=delta)
                index += 1
                if self._outbox:
                    await self._flush()
        if output is None:
            raise ProviderError(
                f"the stream from {request.model!r} ended without a completed output"
            )
        self._completed(request, output)

    def _completed(self, request: InferenceInput, output: InferenceOutput) -> None:
        if not isinstance(output, InferenceOutput):
            raise ProviderError(
                f"provider for {request.model!r} returned {type(output).__name__}, "
                "not an InferenceOutput"
            )
        self.model_requests += 1
        if output.token_usage is not None:
            self.usage = self.usage + output.token_usage
        self._request = request
        self._output = output
        self._emit(ev.InferenceCompleted, model=request.model, output=output)
        calls = output.function_calls
        if calls:
            self._next = (_T.call_tools, ToolBatch(calls=calls))
        else:
            self._next = (_T.answer, output.message or ModelMessageItem(content=""))

    async def _function_call(self, payload: TransitionPayload) -> None:
        batch = payload if isinstance(payload, ToolBatch) else ToolBatch(calls=())
        output, self._output = self._output, None
        items: list[ContextItem] = []
        if output is not None:
            items.extend(i for i in output.items if not isinstance(i, FunctionCallItem))
        results: list[FunctionCallOutputItem | None] = [None] * len(batch.calls)
        try:
            tools = {t.name: t for t in self._request.tools}
            for position, call in enumerate(batch.calls):
                results[position] = await self._run_call(
                    call, batch.denied.get(call.call_id), tools
                )
        finally:
            # Whatever happened, every call gets an output, and calls and outputs
            # enter the context together so loops sharing it never split a pair.
            for position, call in enumerate(batch.calls):
                if results[position] is None:
                    out = FunctionCallOutputItem.error(
                        call.call_id,
                        "the tool call did not run: the loop was interrupted",
                    )
                    results[position] = out
                    self._emit(
                        ev.FunctionCallCompleted, call=call, output=out, duration=0.0
                    )
            items.extend(batch.calls)
            items.extend(r for r in results if r is not None)
            self.input.context.extend(items)
        if self.model_requests >= self.max_turns:
            self._stop_reason = "max_turns"
            self._next = (_T.stop, None)
        else:
            self._next = self._infer_step()

    async def _run_call(
        self, call: FunctionCallItem, denial: str | None, tools: dict[str, Any]
    ) -> FunctionCallOutputItem:
        started = time.perf_counter()
        tool = tools.get(call.name)
        if denial is not None:
            out = FunctionCallOutputItem.error(
                call.call_id, f"the call was denied: {denial}"
            )
        elif tool is None:
            offered = ", ".join(sorted(tools)) or "none"
            out = FunctionCallOutputItem.error(
                call.call_id, f"unknown tool {call.name!r} (available tools: {offered})"
            )
        else:
            self._emit(ev.FunctionCallStarted, call=call)
            self.tool_calls += 1
            try:
                out = FunctionCallOutputItem(
                    call_id=call.call_id, output=await tool.invoke(call.arguments)
                )
            except ToolError as exc:
                out = FunctionCallOutputItem.error(call.call_id, str(exc))
            except Exception as exc:  # noqa: BLE001 - a raising tool becomes an error output
                out = FunctionCallOutputItem.error(
                    call.call_id,
                    f"tool {call.name!r} raised {type(exc).__name__}: {exc}",
                )
        if out.is_error:
            self._log.info(
                "tool_call_error",
                call_id=call.call_id,
                tool=call.name,
                error=out.output,
            )
        self._emit(
            ev.FunctionCallCompleted,
            call=call,
            output=out,
            duration=time.perf_counter() - started,
        )
        return out

    async def _model_message(self, payload: TransitionPayload) -> None:
        message = (
            payload
            if isinstance(payload, ModelMessageItem)
            else ModelMessageItem(content="")
        )
        output, self._output = self._output, None
        items: list[ContextItem] = []
        if output is not None:
            items.extend(
                i
                for i in output.items
                if not isinstance(i, FunctionCallItem | ModelMessageItem)
            )
        items.append(message)
        self.input.context.extend(items)
        self.answer = message
        self._emit(ev.ModelAnswer, message=message)
        self._next = (_T.finish, message)

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
            "error": self.error,
            "usage": self.usage,
            "model_requests": self.model_requests,
            "tool_calls": self.tool_calls,
            "path": tuple(self.path),
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }
        return trusted(LoopResult, values, set(values))

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
        )


async def _call_handler(
    handler: InterceptionHandler, pending: PendingTransition
) -> Decision | None:
    result = handler(pending)
    if inspect.isawaitable(result):
        result = await result
    return result


def _as_request(payload: TransitionPayload) -> InferenceInput:
    assert isinstance(payload, InferenceInput)
    return payload


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


_StateFn: TypeAlias = Callable[[Loop, TransitionPayload], Awaitable[None]]

_STATES: Final[dict[LoopState, _StateFn]] = {
    _S.context_update: Loop._context_update,
    _S.inference: Loop._inference,
    _S.inference_streaming: Loop._inference_streaming,
    _S.function_call: Loop._function_call,
    _S.model_message: Loop._model_message,
}
