"""One loop's record: every field that defines it at a committed transition.

A `Loop` is data plus the callables it was started with. The driver
(`driver.run`) takes its steps, the states (`states/`) fill in the current
turn, and `record.LoopRecord` is the same fields as a pydantic model
(`Runtime.snapshot`), with the context referenced by position and callables by
name. The entry points the runtime calls from outside the loop's task (cancel,
resume, queue, wait) and the views (`view`, `result`) are here too.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from agentfsm import _models
from agentfsm._bus import Emitter
from agentfsm._logging import get_logger
from agentfsm.extensions import LoopExtension, overrides, overrides_any
from agentfsm.inference import (
    InferenceInput,
    InferenceOutput,
    ModelRequest,
    RequestMetadata,
)
from agentfsm.interception import Decision, InterceptionHandler
from agentfsm.messages import ModelMessageItem, TokenUsage, UserMessage
from agentfsm.options import LoopOptions
from agentfsm.results import ErrorInfo, LoopResult, LoopStatus, LoopView, PathStep
from agentfsm.states import LoopState, Outcome
from agentfsm.tools import Tool

from .intercept import Paused, Resumed, approval_gate
from .model_call import request_model
from .repair import ContextScan, context_scan
from .steps import _S, _T, Step
from .tool_call import ToolChain, chain_tool_wrappers
from .wrappers import LayeredProviders, chain_wrappers, hook_failed

if TYPE_CHECKING:
    import anyio
    from structlog.typing import FilteringBoundLogger

    from agentfsm._bus import EventBus
    from agentfsm.exceptions import StoreError
    from agentfsm.providers import ProviderRegistry
    from agentfsm.record import LoopRecord

    from .batch import BatchPlan
    from .bounds import CallIds
    from .journal import Journal

__all__ = ("Loop", "current_loop_id", "one_more_unreported")

# The totals of a loop none of whose requests reported usage: entry n after n
# requests, shared (a `TokenUsage` is frozen) rather than summed anew per
# request, which was ~6% of a run of `make bench-instructions` (whose model
# reports none, as some servers do). Built without validation: validating at
# import would build TokenUsage's schema (and load pydantic's plugins) before
# anyone needs it.
_UNREPORTED_ONLY: Final = tuple(
    _models.trusted(
        TokenUsage,
        {
            "input_tokens": 0,
            "output_tokens": 0,
            "reasoning_tokens": 0,
            "cached_input_tokens": 0,
            "unreported_requests": n,
        },
        {"unreported_requests"} if n else set(),
    )
    for n in range(65)
)
_NO_USAGE: Final = _UNREPORTED_ONLY[0]


def one_more_unreported(total: TokenUsage) -> TokenUsage:
    """`total` plus one request that reported no usage."""
    count = total.unreported_requests
    if count < len(_UNREPORTED_ONLY) - 1 and total is _UNREPORTED_ONLY[count]:
        return _UNREPORTED_ONLY[count + 1]
    return total + _UNREPORTED_ONLY[1]


# Module constants: an enum member looked up on its class costs ~900
# instructions more (tests/internals/test_names.py checks they mirror the enums).
_RUNNING: Final = LoopStatus.running
_DONE: Final = LoopStatus.done

_NO_TOOLS: Final[dict[str, Tool]] = {}
"""What `tools_by_name` is before the first batch (never written to: `tool_index`
replaces it)."""

_RESULT_FIELDS: Final = set(LoopResult.model_fields)
"""Every field `Loop.result` sets (shared: pydantic copies it before changing it)."""

_VIEW_FIELDS: Final = set(LoopView.model_fields)

_current_loop: ContextVar[str | None] = ContextVar("agentfsm_loop_id", default=None)


def current_loop_id() -> str | None:
    """The id of the loop whose task is running (tools and providers may ask), or None."""
    return _current_loop.get()


class Loop(Emitter):
    """The record and the callables of one loop (internal; users see `LoopView`,
    `LoopResult` and `LoopRecord`)."""

    __slots__ = (  # noqa: RUF023 - grouped by topic, as the record is
        # what the loop was started with
        "agent_id",
        "gated",
        "handlers",
        "input",
        "loop_id",
        "model_chain",
        "options",
        "started_at",
        # where it is
        "path",
        "pending",
        "state",
        "status",
        "step",
        # a pause
        "paused",
        "resumed",
        # counters
        "model_requests",
        "structured_failures",
        "tool_calls",
        "usage",
        # queues
        "follow_ups",
        "steering",
        # the current turn
        "answer_at",
        "history",
        "last_tools",
        "message",
        "metadata",
        "output",
        "request",
        # stop bookkeeping
        "cancel_reason",
        "cancel_requested",
        "deadline_at",
        # the end
        "answer",
        "ended_at",
        "error",
        "outcome",
        "parsed",
        "reason",
        # what the loop runs with (not data: not in the record)
        "_bound_log",
        "call_ids",
        "clock",
        "detached",
        "done",
        "journal",
        "described",
        "cancel_scope",
        "event",
        "extensions",
        "on_commit",
        "on_end",
        "on_halt",
        "plan",
        "providers",
        "recorded_output",
        "released",
        "run_tasks",
        "scan",
        "tool_chain",
        "tools_by_name",
        "tools_of",
        "worker",
    )

    def __init__(
        self,
        loop_id: str,
        agent_id: str,
        message: UserMessage | None,
        inference_input: InferenceInput,
        handlers: Sequence[InterceptionHandler],
        options: LoopOptions,
        bus: EventBus,
        providers: ProviderRegistry,
        cancel_scope: Callable[..., anyio.CancelScope],
        event: Callable[[], anyio.Event],
        run_tasks: Callable[[int, Callable[[], Awaitable[None]], str], Awaitable[None]],
        on_end: Callable[[Loop], None],
        clock: Callable[[], datetime],
    ) -> None:
        # (The runtime passes these by position: keyword arguments to a class
        # cost ~2,000 instructions more per loop, a dict built and unpacked.)
        self.loop_id = loop_id
        self.agent_id = agent_id
        self.input = inference_input
        self.options = options
        # A loop, not `any()` of a generator: ~1,000 instructions a loop less.
        self.gated = False
        for tool in inference_input.tools:
            if tool.needs_approval:
                self.gated = True
                handlers = (approval_gate, *handlers)
                break
        self.handlers: tuple[InterceptionHandler, ...] = tuple(handlers)
        self.tool_chain: ToolChain | None = chain_tool_wrappers(options.tool_wrappers)
        self.model_chain: (
            Callable[[ModelRequest], Awaitable[InferenceOutput]] | None
        ) = (
            chain_wrappers(options.model_wrappers, self._request_model)
            if options.model_wrappers
            else None
        )
        self.clock = clock
        """The runtime's clock: `started_at`, `ended_at` and every event's `ts`."""
        self.started_at = clock()

        Emitter.__init__(self, bus)  # `seq`, and what events go out through
        self.state: LoopState = _S.idle
        self.status = _RUNNING
        self.path: list[PathStep] = []
        self.pending: Step | None = (_T.start, message, None)
        """The step waiting to be taken while no driver holds it: the first one
        before the loop runs, the paused one while it is paused."""
        self.step: Step | None = None
        """The step last committed: what the current state acts on."""

        self.paused: Paused | None = None
        self.resumed: Resumed | None = None

        self.usage = _NO_USAGE
        self.model_requests = 0
        self.tool_calls = 0
        self.structured_failures = 0

        self.steering: deque[UserMessage] | None = None  # made on first use
        self.follow_ups: deque[UserMessage] | None = None

        self.request: InferenceInput = inference_input
        """The last request sent (its tools are the ones calls are run with)."""
        self.output: InferenceOutput | None = None
        """The last model output, until the state after it has used it."""
        self.message: ModelMessageItem | None = None
        """The message `model_message` wrote last (answer or not)."""
        self.answer_at: int | None = None
        """Where that message sits in the context."""
        self.history = 0
        """Items in the context when the last request was made."""
        self.metadata: RequestMetadata | None = None  # made when first read
        self.last_tools: list[str] = []

        self.cancel_requested = False
        self.cancel_reason: str | None = None
        self.deadline_at: float | None = None
        """The deadline on anyio's clock, set when the loop first runs."""

        self.outcome: Outcome | None = None
        self.reason: str | None = None
        self.answer: ModelMessageItem | None = None
        """The published answer."""
        self.parsed: Any = None
        self.error: ErrorInfo | None = None
        self.ended_at: datetime | None = None

        self.providers = providers
        self.cancel_scope = cancel_scope
        self.event = event
        self.run_tasks = run_tasks
        """Runs a parallel batch's tasks: `(count, task, name)` (the backend's,
        `_runtime.backend.run_tasks`)."""
        self.on_end = on_end
        self.on_commit: Callable[[Loop], None] | None = None
        """The extensions' `committed` hooks, composed (`extend_with`)."""
        self.extensions: tuple[LoopExtension, ...] = ()
        """The runtime's extensions' parts in it (`extend_with`): the runtime
        calls their lifecycle hooks, and lets go of them after the last."""
        self.journal: Journal | None = None
        """What keeps it in the runtime's store (`journal.Journal`), if the
        runtime has one."""
        self.detached = False
        """It stopped in this process without ending (`driver.halt`): it never
        runs here again."""
        self.on_halt: Callable[[Loop, str, StoreError | None], None] | None = None
        """The runtime's, for a loop that stops here without ending (see
        `driver.halt`)."""
        self.plan: BatchPlan | None = None
        """The plan of the batch of the current `function_call` step."""
        self.recorded_output: InferenceOutput | None = None
        """The output its store recorded of the request a recovered loop was
        making (`states.inference.recover`): used instead of sending it."""
        self.described: tuple[Any, ...] | None = None
        """Its options and handlers as its records name them, with the objects
        they were made from (`snapshot.record_of`, made once per loop)."""
        self.scan: ContextScan = context_scan(inference_input.context)
        self.call_ids: CallIds | None = None
        """The ids of the calls in its context (`bounds.unique_call_ids`)."""
        self.released: InferenceInput | None = None
        """The input with its forced tool choice released (`turn.released`)."""
        self.tools_of: Sequence[Tool] | None = None
        self.tools_by_name: dict[str, Tool] = _NO_TOOLS
        self.worker: Any = None  # the `Worker` running the loop, if any
        self._bound_log: FilteringBoundLogger | None = None
        self.done: anyio.Event | None = None
        """Set when the loop ends; made when someone waits."""
        # (`loop.started` is published by the runtime once the loop is made; a
        # loop restored from a store publishes `loop.recovered` instead.)

    @property
    def log(self) -> FilteringBoundLogger:
        """This loop's logger, bound to its ids (bound on first use)."""
        if self._bound_log is None:
            self._bound_log = get_logger().bind(
                loop_id=self.loop_id, agent_id=self.agent_id
            )
        return self._bound_log

    def log_info(self, event: str, **values: Any) -> None:
        """One info line with the loop's ids, without binding a logger for it
        and without making it where info is filtered out.

        Most loops log once, at info, as they end, and most configurations
        drop info lines: binding a logger for that line, then calling its
        method, cost ~15,000 instructions a loop (`make bench-instructions`).
        `bind()` with no values hands out structlog's configured logger (once
        cached, the same one) without copying a context, and a filtering
        logger's class says whether it keeps info lines (other loggers are
        asked to log it).
        """
        bound = self._bound_log
        logger = bound or get_logger().bind()
        # Asked of the class: a generic logger's `__getattr__` answers any name.
        enabled = getattr(type(logger), "is_enabled_for", None)
        if enabled is not None and not enabled(logger, logging.INFO):
            return
        if bound is None:
            values = {"loop_id": self.loop_id, "agent_id": self.agent_id, **values}
        logger.info(event, **values)

    def _request_model(self, request: ModelRequest) -> Awaitable[InferenceOutput]:
        """The innermost link of the model wrappers' chain."""
        return request_model(self, request.input, request.streaming)

    # ------------------------------------------- what the runtime sets up, by name

    def extend_with(self, parts: Sequence[LoopExtension]) -> None:
        """Compose the runtime's extensions into the loop, once, as it is
        built: their provider and tool layers inside the loop's own wrappers,
        their `committed` hooks as its commit hook. Only what a part
        overrides is composed (`extensions.overrides`)."""
        providers = [p.provider for p in parts if overrides(p, "provider")]
        if providers:
            self.providers = LayeredProviders(self.providers, providers)
        tools = [p.call_tool for p in parts if overrides(p, "call_tool")]
        if tools:
            self.tool_chain = chain_tool_wrappers((*self.options.tool_wrappers, *tools))
        hooks = [p for p in parts if overrides(p, "committed")]
        if hooks:

            def committed(loop: Loop) -> None:
                for part in hooks:
                    try:
                        part.committed()
                    except Exception as exc:  # noqa: BLE001 - never stops the loop
                        hook_failed(loop, part, "committed", exc)

            self.on_commit = committed
        self.extensions = tuple(p for p in parts if overrides_any(p))

    def release_extensions(self) -> None:
        """Let go of the extensions' parts once no hook is left to call (the
        loop ended, or left this runtime): a part holds the loop's view, and
        the loop would be freed only by the cycle collector."""
        self.extensions = ()
        self.on_commit = None
        self.tool_chain = chain_tool_wrappers(self.options.tool_wrappers)
        if isinstance(self.providers, LayeredProviders):
            self.providers = self.providers.inner

    def attach_journal(self, journal: Journal) -> None:
        """Keep the loop in a store from now on, through `journal`."""
        self.journal = journal

    def halts_to(
        self, callback: Callable[[Loop, str, StoreError | None], None]
    ) -> None:
        """Call `callback` when the loop stops here without ending (`driver.halt`)."""
        self.on_halt = callback

    def events_after(self, seq: int) -> None:
        """Number the loop's next events after `seq` (a recovered loop whose
        store kept events past its record)."""
        self.seq = max(self.seq, seq)

    def keep_deadline(self, deadline_at: float | None) -> None:
        """The deadline a rebuilt loop had (on anyio's clock), not a new one."""
        self.deadline_at = deadline_at

    def detach(self) -> None:
        """The loop leaves this runtime without ending (handed over): a task
        it still has ends here without ending it (`driver.run`)."""
        self.detached = True

    def run_by(self, worker: Any) -> None:
        """The worker now running the loop (None: none)."""
        self.worker = worker

    def add_handler(self, handler: InterceptionHandler) -> None:
        """Run `handler` last, from the next transition on (a new tuple: a
        driver in the middle of `intercept` keeps the one it holds)."""
        self.handlers = (*self.handlers, handler)

    def drop_last_handler(self) -> None:
        """Stop running the handler `add_handler` added last."""
        self.handlers = self.handlers[:-1]

    # ------------------------------------------------ from outside the loop's task

    def cancel(self, reason: str | None) -> bool:
        """Ask the loop to cancel; returns whether it must be handed to a worker to
        finish (a paused loop). The driver honours the request before the next
        transition, whoever made it (the loop's own tool included); a loop in a
        worker is cancelled at its next checkpoint too."""
        if self.status is LoopStatus.done or self.cancel_requested:
            return False
        self.cancel_requested = True
        self.cancel_reason = reason
        if self.worker is not None:
            self.worker.cancel()
            return False
        if self.status is LoopStatus.paused:
            self.status = LoopStatus.running
            self.paused = None
            return True
        return False  # not started yet: its run will see the flag

    def resume(self, decision: Decision, by: str | None = None) -> None:
        """Continue a paused loop with `decision` in place of the handler's
        `Pause`; a durable loop stores it (who gave it, and when) before it
        takes effect."""
        paused = self.paused
        assert paused is not None
        self.paused = None
        self.resumed = Resumed(decision, paused.handler, paused.original_dest)
        self.status = LoopStatus.running
        if self.journal is not None:
            from .snapshot import decision_entry

            self.journal.store_decision(
                decision_entry(self, paused.pending, None, decision, by)
            )
        self.emit("loop.resumed", decision=decision.kind)

    def queue(self, message: UserMessage, *, follow_up: bool) -> None:
        """Queue a steering or follow-up message for this loop."""
        if follow_up:
            if self.follow_ups is None:
                self.follow_ups = deque()
            self.follow_ups.append(message)
        else:
            if self.steering is None:
                self.steering = deque()
            self.steering.append(message)

    async def wait(self) -> None:
        """Wait until the loop is done."""
        if self.status is _DONE:
            return
        if self.done is None:
            self.done = self.event()
        await self.done.wait()

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
            # A plain answer's output is its text; a structured one's, its parse
            # (of the schema the answering request had: a wrapper may change it).
            "output": self.parsed
            if self.answer is None or self.request.structured_output is not None
            else self.answer.content,
            "error": self.error,
            "usage": self.usage,
            "model_requests": self.model_requests,
            "tool_calls": self.tool_calls,
            "path": tuple(self.path),
            "started_at": self.started_at,
            "ended_at": self.ended_at,
        }
        return _models.trusted(LoopResult, values, _RESULT_FIELDS)

    def view(self) -> LoopView:
        """What `Runtime.get` shows of the loop."""
        paused = self.paused
        values = {
            "loop_id": self.loop_id,
            "agent_id": self.agent_id,
            "state": self.state,
            "status": self.status,
            "path": tuple(self.path),
            "pending": paused.pending if paused else None,
            "pause_reason": paused.reason if paused else None,
            "outcome": self.outcome,
            "usage": self.usage,
            "model_requests": self.model_requests,
            "tool_calls": self.tool_calls,
            "last_tools": tuple(self.last_tools),
        }
        # Built without validation: stop conditions ask for one every turn.
        return _models.trusted(LoopView, values, _VIEW_FIELDS)

    def snapshot(self) -> LoopRecord:
        """The record as data (see `record.LoopRecord`)."""
        from .snapshot import record_of

        return record_of(self)
