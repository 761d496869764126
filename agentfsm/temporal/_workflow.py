"""`LoopWorkflow`: one agentfsm loop as one Temporal workflow.

The unchanged `Runtime` runs in workflow code: the transition table, the
handlers, the wrappers, the stop conditions and the queues. Its clock is
`workflow.now()` and its loop id the workflow's, so the events a replay
publishes are the events the first run published. What is not deterministic
leaves the workflow as an activity:

- each model request: a provider (`calls.ActivityProvider`) whose `complete` runs
  the `agentfsm.<agent>.infer` activity, the context passed by reference;
- each tool body: the workflow's extension's tool layer (`calls.ToolActivities`,
  inside the agent's tool wrappers) runs the
  `agentfsm.<agent>.tool.<name>` activity, the tool's timeout its
  start-to-close timeout (the tool's own in-workflow timer is never armed:
  the tool's function does not run in the workflow), its crash policy its
  retry policy, the call's idempotency key among its arguments;
- each handler marked `local_activity`: a local activity.

Signals steer, follow up and cancel; updates resume and approve (their
validators reject a loop that is not paused, and call ids that are not the
ones waiting; one that arrives before the run has its loop, with the start or
while a continued run reads its carried context back, waits for the loop and
is checked then); the `view` and `transcript` queries answer with the loop's
`LoopView` and its context.

Nothing that arrives from outside wedges the workflow: every input is checked
where it crosses in (a bad start fails the workflow `BAD_START`, one whose
image the agent's model cannot take `IMAGE_NOT_SUPPORTED`; a bad signal, one
with no input or too many, or one whose image the model cannot take, is
dropped with a warning and an `input.dropped` event; a bad update is
refused), the subscribers' calls are guarded, and the loop's outcome is the
workflow's (a failed loop fails it `LOOP_FAILED`; Temporal's own cancel
cancels the loop and ends the workflow canceled).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from pydantic import TypeAdapter, ValidationError
from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ApplicationError

from agentfsm._logging import get_logger
from agentfsm._runtime.runtime import Runtime
from agentfsm._text import encodable
from agentfsm.events import AgentEvent
from agentfsm.exceptions import (
    AgentFSMError,
    ConfigurationError,
    ImageNotSupported,
    LoopStateError,
)
from agentfsm.extensions import Extension, LoopExtension, LoopInfo
from agentfsm.inference import InferenceInput
from agentfsm.interception import Decision, Rewrite, ToolBatch
from agentfsm.messages import ContextItem, UserMessage
from agentfsm.providers import OneProviderRegistry
from agentfsm.results import LoopResult, LoopStatus, LoopView
from agentfsm.states import LoopState, Outcome, Trigger
from agentfsm.tools import ToolCall, ToolNext, ToolResult

from ._agent import LocalActivityHandler, TemporalAgent, agent_named
from ._calls import ActivityProvider, ToolActivities, local_handler
from ._carry import Carry
from ._wire import (
    MAX_PAYLOAD,
    MAX_RESULT,
    StartLoop,
    clipped,
    fitted_result,
    payload_size,
)

__all__ = (
    "AGENT_ATTRIBUTE",
    "BAD_START",
    "BAD_UPDATE",
    "FAILURE_EXCEPTION_TYPES",
    "IMAGE_NOT_SUPPORTED",
    "LOOP_FAILED",
    "OUTCOME_ATTRIBUTE",
    "OUTCOME_MEMO",
    "RESULT_MEMO",
    "STATE_ATTRIBUTE",
    "WORKFLOW_NAME",
    "LoopWorkflow",
    "view_data",
)

WORKFLOW_NAME: Final = "agentfsm.loop"
STATE_ATTRIBUTE: Final = SearchAttributeKey.for_keyword("AgentFsmState")
"""`<status>:<state>` of the loop (`running:idle`, `paused:function_call`,
`done:idle`), upserted when a run of the loop starts and when it returns
(pauses or ends): the points where a loop waits for someone, so that waiting
loops can be listed. Set only on workflows started with it
(`LoopClient(state_attribute=True)`): an attribute the namespace has not
registered would fail the workflow task."""
AGENT_ATTRIBUTE: Final = SearchAttributeKey.for_keyword("AgentFsmAgent")
"""The loop's agent (the `TemporalAgent`'s name), set at the start, so that
listings can tell agents apart (on workflows started with search attributes)."""
OUTCOME_ATTRIBUTE: Final = SearchAttributeKey.for_keyword("AgentFsmOutcome")
"""How the loop ended (an `Outcome`: `answered`, `failed`, `aborted`,
`cancelled`, ...), set when it ends (on workflows started with search
attributes)."""
LOOP_FAILED: Final = "agentfsm.LoopFailed"
"""The `ApplicationError` type a failed loop's workflow fails with; its first
detail is the loop's `LoopResult` as JSON data."""
RESULT_MEMO: Final = "agentfsm.result"
"""The memo key a cancelled workflow (Temporal's own cancel) leaves the loop's
`LoopResult` under, as JSON data: a cancelled workflow has no result."""
OUTCOME_MEMO: Final = "agentfsm.outcome"
"""The memo key of the loop's outcome, set when it ends: shown in Temporal's
UI and listings with no search attribute registered."""
BAD_START: Final = "agentfsm.BadStart"
"""The `ApplicationError` type a workflow whose input is not a valid
`StartLoop` fails with (non-retryable); its message names the fields."""
IMAGE_NOT_SUPPORTED: Final = "ImageNotSupported"
"""The `ApplicationError` type a workflow fails with (non-retryable) when its
start's message holds an image the agent's model cannot take
(`TemporalAgent.images`); its message is `ImageNotSupported`'s, its first
detail `{"model", "capability", "block"}`. Nothing was sent."""
BAD_UPDATE: Final = "agentfsm.BadUpdate"
"""The `ApplicationError` type an update validator refuses bad arguments with
(a decision that is not a `Decision`, call ids that are not strings)."""
FAILURE_EXCEPTION_TYPES: Final[tuple[type[Exception], ...]] = (
    AgentFSMError,
    ValidationError,
)
"""What fails the workflow, not its task, when it escapes workflow code
(besides Temporal's own `FailureError`s): agentfsm's errors and pydantic's
validation errors say that the data or the agent's configuration is wrong, so
a retried task would raise them again. Anything else (a bug, a
non-determinism error) fails the task, which Temporal retries until a fixed
worker is deployed."""

_TRACE: Final = 16 * 1024
"""Room for the stack trace a workflow failure carries beside its message."""

_decisions: TypeAdapter[Decision] = TypeAdapter(Decision)


def view_data(
    view: LoopView,
    wire: Callable[[Sequence[UserMessage]], Sequence[ContextItem]] | None = None,
) -> dict[str, Any]:
    """A `LoopView` as JSON data (a pending request's tools are objects: its
    payload is left out; the request's metadata too). A pending message's
    images go as `wire` has them (references, for those the context store
    holds): an update's result is in the history."""
    pending = view.pending
    if pending is not None and isinstance(pending.payload, InferenceInput):
        pending = pending.model_copy(update={"payload": None})
    elif pending is not None and wire is not None:
        payload = pending.payload
        if isinstance(payload, UserMessage):
            pending = pending.model_copy(update={"payload": wire((payload,))[0]})
        elif isinstance(payload, tuple) and payload:
            pending = pending.model_copy(update={"payload": tuple(wire(payload))})
    if pending is not view.pending:
        view = view.model_copy(update={"pending": pending})
    return view.model_dump(mode="json", exclude={"pending": {"metadata"}})


class _InWorkflow(Extension):
    """The workflow's extension of its runtime: each tool body runs as an
    activity (its tool layer); it holds the loop's view (what `input.dropped`
    is published on, what the transcript reads) and keeps the state search
    attribute current when a run starts and when it returns."""

    __slots__ = ("owner", "tools")

    def __init__(self, owner: LoopWorkflow, tools: ToolActivities) -> None:
        self.owner = owner
        self.tools = tools

    def open(self, loop: LoopInfo, /) -> LoopExtension:
        # A paused loop a run took up (continue-as-new) is opened too: the
        # transcript reads it before it runs.
        self.owner.loop = loop
        return _InLoop(self.owner, loop, self.tools)


class _InLoop(LoopExtension):
    __slots__ = ("info", "owner", "tools")

    def __init__(
        self, owner: LoopWorkflow, info: LoopInfo, tools: ToolActivities
    ) -> None:
        self.owner = owner
        self.info = info
        self.tools = tools

    async def call_tool(self, call: ToolCall, next_: ToolNext, /) -> ToolResult:
        return await self.tools(call, next_)

    def start_run(self, start: Callable[[], None], /) -> None:
        start()
        self.owner.upsert(f"running:{self.info.state}")

    def run_ended(self) -> None:
        # `done:idle` is upserted with the outcome, in one command (`_ended`).
        info = self.info
        if info.status is not LoopStatus.done:
            self.owner.upsert(f"{info.status}:{info.state}")


@workflow.defn(name=WORKFLOW_NAME, failure_exception_types=FAILURE_EXCEPTION_TYPES)
class LoopWorkflow:
    """One loop of a `TemporalAgent` (start it with `LoopClient.start`)."""

    def __init__(self) -> None:
        self.loop_id = ""
        self.runtime: Runtime | None = None
        self.loop: LoopInfo | None = None
        self.provider: ActivityProvider
        self._early: list[Callable[[Runtime], None]] = []
        self._state = ""
        self._outcome_attribute = False

    # ------------------------------------------------------------------- run

    @workflow.run
    async def run(self, data: Any) -> dict[str, Any]:
        """Run the loop; its `LoopResult` as JSON data (a failed loop fails
        the workflow, `LOOP_FAILED`, the result its first detail)."""
        # `data: Any`: a typed parameter that does not convert would fail the
        # workflow task, retried forever; `_start_of` fails the workflow instead.
        start = _start_of(data)
        try:
            agent = agent_named(start.agent)
        except ConfigurationError as exc:
            # A workflow failure, not a failed workflow task (which Temporal
            # would retry forever): no worker of this queue knows the agent.
            raise ApplicationError(
                str(exc), type="ConfigurationError", non_retryable=True
            ) from exc
        self.loop_id = start.loop_id
        self.provider = ActivityProvider(agent, self)
        self.carry = Carry(start, agent, self.provider)  # continue-as-new
        tools = ToolActivities(agent, self)
        handlers: list[Any] = [tools.pause_after_lost]
        for h in agent.handlers:
            handlers.append(
                local_handler(agent, h) if isinstance(h, LocalActivityHandler) else h
            )
        options = dict(agent.options)
        # The activity's start-to-close timeout, not an in-workflow timer.
        options.pop("inference_timeout", None)
        # Kept current only on workflows started with it (the namespace has it).
        attributes = workflow.info().typed_search_attributes
        self._state = attributes.get(STATE_ATTRIBUTE) or ""
        # The outcome too, on workflows started with the agent's attribute (the
        # client that sets it has the three registered): an attribute the
        # namespace lacks would fail every workflow task from then on.
        self._outcome_attribute = attributes.get(AGENT_ATTRIBUTE) is not None
        import asyncio  # noqa: TID251 - workflow code runs on asyncio only

        # The loop runs in a task of its own that Temporal's cancel does not
        # reach: the cancel asks the loop to end (`Runtime.cancel`), and the
        # workflow waits for it to end in idle, its result kept in the memo.
        running = asyncio.ensure_future(
            self._run(start, agent, tools, handlers, options)
        )
        try:
            result = await asyncio.shield(running)
        except asyncio.CancelledError:
            reason = workflow.cancellation_reason() or "the workflow was cancelled"
            self._when_running(lambda rt: rt.cancel(self.loop_id, reason))
            result = await running
            # A loop that ended otherwise before the cancel reached it keeps
            # its outcome: the workflow ends as that outcome says.
            if result.outcome is Outcome.cancelled:
                await self._ended(result, kept=True)
                raise
        await self._ended(result, kept=False)
        # What the workflow ends with fits the server's limit, whatever the
        # loop holds: over it, completing would fail every workflow task.
        if result.outcome is Outcome.failed:
            error = result.error
            message = clipped(
                f"loop {self.loop_id} failed: "
                + (f"{error.type}: {error.message}" if error else "no error recorded")
            )
            raise ApplicationError(
                message,
                self._fitted(result, MAX_RESULT - payload_size(message) - _TRACE),
                type=LOOP_FAILED,
                non_retryable=True,
            )
        return self._fitted(result, MAX_RESULT)

    async def _run(
        self,
        start: StartLoop,
        agent: TemporalAgent,
        tools: ToolActivities,
        handlers: list[Any],
        options: dict[str, Any],
    ) -> LoopResult:
        runtime = Runtime(
            providers=OneProviderRegistry(self.carry.provider()),
            clock=workflow.now,
            extensions=[_InWorkflow(self, tools)],
        )
        async with runtime:
            # Subscribed before the loop starts, drained once it has: a start
            # that fails leaves no coroutine behind.
            subscription = (
                runtime.bus.subscribe("*", loop_id=start.loop_id)
                if agent.subscribers
                else None
            )

            def start_loop() -> str:
                try:
                    return runtime.run_loop(
                        start.agent_id or agent.name,
                        start.message,
                        agent.request(start.seeded()),
                        handlers,
                        loop_id=start.loop_id,
                        **options,
                    )
                except ImageNotSupported as exc:
                    # Nothing was sent: the workflow fails at once, not retried.
                    raise ApplicationError(
                        str(exc),
                        {
                            "model": exc.model,
                            "capability": exc.capability,
                            "block": exc.block,
                        },
                        type=IMAGE_NOT_SUPPORTED,
                        non_retryable=True,
                    ) from exc

            # A new loop, or the one the run before carried (continue-as-new).
            loop_id = await self.carry.begin(runtime, handlers, options, start_loop)
            # Signals and updates act from here on; those that came before
            # (with the start, or while a carried context was read back) waited.
            self.runtime = runtime
            for early in self._early:
                early(runtime)
            self._early.clear()
            drained = None
            if subscription is not None:
                import asyncio  # noqa: TID251 - workflow code runs on asyncio only

                drained = asyncio.ensure_future(
                    _drain(subscription, agent.subscribers, start.loop_id)
                )
            # Or the loop goes on in a new run (`ContinueAsNewError`).
            result = await self.carry.wait(runtime, loop_id, subscription)
        if drained is not None:
            await drained
        return result

    async def _ended(self, result: LoopResult, *, kept: bool) -> None:
        """Say how the loop ended where Temporal shows it (the memo; the
        search attributes when the workflow has them), its result too when the
        workflow ends without one (`kept`: canceled), then let update handlers
        that resumed the loop finish before the workflow does."""
        outcome = result.outcome.value
        memo: dict[str, Any] = {OUTCOME_MEMO: outcome}
        if kept:
            memo[RESULT_MEMO] = self._fitted(result, MAX_RESULT)
        workflow.upsert_memo(memo)
        updates = []
        done = f"done:{LoopState.idle}"
        if self._state and self._state != done:
            self._state = done
            updates.append(STATE_ATTRIBUTE.value_set(done))
        if self._outcome_attribute:
            updates.append(OUTCOME_ATTRIBUTE.value_set(outcome))
        if updates:  # one command, one history event
            workflow.upsert_search_attributes(updates)
        await workflow.wait_condition(workflow.all_handlers_finished)

    def _fitted(self, result: LoopResult, limit: int) -> dict[str, Any]:
        """The loop's result as JSON data in at most `limit` bytes: what was
        left out to fit is said in its `reason` and in the workflow's log."""
        fitted, dropped = fitted_result(result, limit)
        if dropped:
            workflow.logger.warning(
                "agentfsm: loop %s's result left out %s to fit in %d bytes",
                self.loop_id,
                ", ".join(dropped),
                limit,
            )
        return fitted.model_dump(mode="json")

    def upsert(self, state: str) -> None:
        if self._state and state != self._state:
            self._state = state
            workflow.upsert_search_attributes([STATE_ATTRIBUTE.value_set(state)])

    def _view(self) -> LoopView:
        if self.runtime is None:
            raise LoopStateError("the loop has not started yet")
        return self.runtime.get(self.loop_id)

    def _when_running(self, action: Callable[[Runtime], None]) -> None:
        if self.runtime is None:
            self._early.append(action)  # a signal delivered with the start
        else:
            action(self.runtime)

    # --------------------------------------------------------------- signals

    # A signal cannot be refused, and one whose handler raised would fail the
    # workflow task (or, with a failure type, the workflow): each takes its
    # inputs as `*args: Any` (the SDK calls a handler with as many as were
    # sent, none or several) and drops what it cannot use, saying so (`_drop`).

    @workflow.signal
    def steer(self, *args: Any) -> None:
        """Queue a steering message (`Runtime.steer`): a `UserMessage` as JSON
        data (text, or text and image blocks), a plain string (its text), or
        `{"role": "user", "content": str}`."""
        msg = self._message("steer", args)
        if msg is not None:
            self._when_running(lambda rt: self._queue("steer", rt.steer, msg))

    @workflow.signal
    def follow_up(self, *args: Any) -> None:
        """Queue a follow-up (`Runtime.follow_up`); the input as for `steer`."""
        msg = self._message("follow_up", args)
        if msg is not None:
            self._when_running(lambda rt: self._queue("follow_up", rt.follow_up, msg))

    @workflow.signal
    def cancel(self, *args: Any) -> None:
        """Cancel the loop (`Runtime.cancel`): it ends `cancelled`. Its input,
        the reason, is a string or null, or left out."""
        if len(args) > 1:
            self._drop(
                "cancel", f"it takes one input at most (a reason), got {len(args)}"
            )
            return
        reason = args[0] if args else None
        if reason is not None and not isinstance(reason, str):
            self._drop(
                "cancel", f"reason must be a string or null, got {_kind(reason)}"
            )
            return
        self._when_running(lambda rt: rt.cancel(self.loop_id, reason))

    def _message(self, signal: str, args: tuple[Any, ...]) -> UserMessage | None:
        if len(args) != 1:
            self._drop(signal, f"it takes one input (the message), got {len(args)}")
            return None
        data = args[0]
        try:
            return _user_message(data)
        except (ValidationError, ValueError, TypeError) as exc:
            problem = _problems(exc) if isinstance(exc, ValidationError) else str(exc)
            self._drop(
                signal,
                "the message must be a string, a UserMessage "
                '({"type": "user_message", "content": str or a list of text '
                "and image blocks}) or "
                f'{{"role": "user", "content": str}}, got {_kind(data)}'
                + (f": {problem}" if isinstance(data, dict) else ""),
            )
            return None

    def _queue(
        self, signal: str, queue: Callable[[str, UserMessage], None], msg: UserMessage
    ) -> None:
        """Queue a signal's message, unless the loop has ended or its model
        cannot take the message's images (dropped: a signal cannot be refused)."""
        try:
            queue(self.loop_id, msg)
        except ImageNotSupported as exc:
            self._drop(signal, str(exc))
        except LoopStateError:
            # It is in the history; the loop's result says what it saw.
            workflow.logger.info(
                "agentfsm: a message reached loop %s after it ended", self.loop_id
            )

    def _drop(self, signal: str, reason: str) -> None:
        """Drop a signal's payload: a warning in the workflow's log (and
        structlog's), and `input.dropped` on the loop's bus while it runs."""
        reason = encodable(reason)  # it may quote the sender's keys
        workflow.logger.warning(
            "agentfsm: loop %s dropped a %s signal: %s", self.loop_id, signal, reason
        )
        if not workflow.unsafe.is_replaying():
            get_logger().warning(
                "signal_dropped", loop_id=self.loop_id, signal=signal, reason=reason
            )

        def publish(_: Runtime) -> None:
            if self.loop is not None:
                self.loop.input_dropped(signal, reason)

        self._when_running(publish)

    # --------------------------------------------------------------- updates

    # The updates take `Any` and their validators check it: arguments that
    # did not convert to a typed parameter would be refused by the SDK with a
    # message about converters, not about the update. An update may arrive
    # before the loop is there (with the run's start, or while a carried
    # context is read back): its validator then checks its arguments alone,
    # and the handler waits for the loop and checks the rest.

    @workflow.update
    async def resume(self, decision: Any = None) -> dict[str, Any]:
        """Resume the paused loop with `decision` (a `Decision` as JSON data;
        default `Proceed`)."""
        runtime = await self._started()
        runtime.resume(self.loop_id, _decision_of(decision, self.loop_id))
        return view_data(self._view(), self.provider.images.wire)

    @resume.validator
    def _check_resume(self, decision: Any = None) -> None:
        _decision_of(decision, self.loop_id)
        if self.runtime is not None:
            self._paused_view()

    @workflow.update
    async def approve(self, call_ids: Any, denied: Any = None) -> dict[str, Any]:
        """Approve the calls waiting for approval (`call_ids`, a list of call
        ids), deny `denied` (`{call_id: reason}`), and resume the loop."""
        runtime = await self._started()
        approved, refused = self._approval(call_ids, denied)
        batch = self._batch()
        for call_id, reason in refused.items():
            batch = batch.deny(call_id, reason)
        for call_id in approved:
            batch = batch.approve(call_id)
        runtime.resume(self.loop_id, Rewrite(payload=batch))
        return view_data(self._view(), self.provider.images.wire)

    @approve.validator
    def _check_approve(self, call_ids: Any, denied: Any = None) -> None:
        if self.runtime is None:
            _approval_of(call_ids, denied, self.loop_id)
        else:
            self._approval(call_ids, denied)

    async def _started(self) -> Runtime:
        """The runtime, once the loop is in it (an update that came first
        waits here)."""
        await workflow.wait_condition(lambda: self.runtime is not None)
        assert self.runtime is not None
        return self.runtime

    def _paused_view(self) -> LoopView:
        view = self._view()
        if view.status is not LoopStatus.paused:
            raise LoopStateError(f"loop {self.loop_id} is {view.status}, not paused")
        return view

    def _approval(
        self, call_ids: object, denied: object
    ) -> tuple[list[str], dict[str, str]]:
        """An approve's calls to approve and to deny, checked against the
        batch the paused loop waits on."""
        approved, refused = _approval_of(call_ids, denied, self.loop_id)
        self._paused_view()
        waiting = set(self._batch().awaiting_approval)
        named = set(approved) | set(refused)
        if named != waiting:
            raise LoopStateError(
                f"loop {self.loop_id} is waiting for approval of "
                f"{sorted(waiting) or 'no calls'}; the update named {sorted(named)} "
                "(stale call ids, or calls left out: approve or deny each)"
            )
        return approved, refused

    def _batch(self) -> ToolBatch:
        pending = self._view().pending
        if (
            pending is None
            or pending.trigger is not Trigger.call_tools
            or not isinstance(pending.payload, ToolBatch)
        ):
            raise LoopStateError(
                f"loop {self.loop_id} is not paused before a tool batch"
            )
        return pending.payload

    # ----------------------------------------------------------------- query

    @workflow.query
    def view(self) -> dict[str, Any]:
        """The loop's `LoopView`: state, status, pending transition, totals."""
        return view_data(self._view(), self.provider.images.wire)

    @workflow.query
    def transcript(
        self, first: int = 0, max_bytes: int = MAX_PAYLOAD // 2
    ) -> dict[str, Any]:
        """The loop's context from item `first` on, as many items as fit in
        `max_bytes` (one at least): `{"instructions", "items", "total"}`, page
        by page (`LoopClient.transcript`), so no answer outgrows a payload."""
        if self.loop is None:
            raise LoopStateError(f"loop {self.loop_id} has not started yet")
        context = self.loop.request.context
        items: list[Any] = []
        size = 0
        # The images the context store holds as their references (as requests
        # send them): an answer over gRPC's limit would fail the query.
        for item in self.provider.images.wire(context.items[first:]):
            data = item.model_dump(mode="json")
            size += payload_size(data)
            if items and size > max_bytes:
                break
            items.append(data)
        return {
            "instructions": context.instructions,
            "items": items,
            "total": len(context.items),
        }


def _kind(data: object) -> str:
    """What JSON value `data` is, for an error message (never the value)."""
    if data is None:
        return "null"
    if isinstance(data, dict):
        return f"an object with keys {sorted(str(k)[:40] for k in data)[:10]}"
    kinds = {str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return kinds.get(type(data), "an array" if isinstance(data, list) else "a value")


def _problems(exc: ValidationError) -> str:
    """A validation error's problems, each by the field it is in."""
    return "; ".join(
        f"{'.'.join(str(part)[:40] for part in e['loc']) or 'the input'}: {e['msg']}"
        for e in exc.errors()[:10]
    )


def _start_of(data: object) -> StartLoop:
    """The workflow's input as a `StartLoop`, or the workflow fails
    (`BAD_START`, not retried) naming what is wrong with it."""
    if isinstance(data, dict):
        try:
            return StartLoop.model_validate(data)
        except ValidationError as exc:
            problem = _problems(exc)
    else:
        problem = (
            'the input must be an object {"agent": str, "loop_id": str, '
            f'"message": ..., "agent_id": ...}}, got {_kind(data)}'
        )
    raise ApplicationError(
        f"workflow {workflow.info().workflow_id} was started with a bad "
        f"input: {problem}",
        type=BAD_START,
        non_retryable=True,
    )


def _user_message(data: object) -> UserMessage:
    """A signal's message: a `UserMessage` as data; a plain string (what
    `temporal workflow signal --input '"text"'` sends) is its text, and so is
    the OpenAI shape `{"role": "user", "content": str}`."""
    if isinstance(data, str):
        return UserMessage(content=data)
    if (
        isinstance(data, dict)
        and data.keys() == {"role", "content"}
        and data["role"] == "user"
        and isinstance(data["content"], str)
    ):
        return UserMessage(content=data["content"])
    return UserMessage.model_validate(data)


def _decision_of(data: object, loop_id: str) -> Decision | None:
    if data is None:
        return None
    try:
        return _decisions.validate_python(data)
    except ValidationError as exc:
        raise ApplicationError(
            f"resume of loop {loop_id}: the decision must be null or a Decision "
            '({"kind": "proceed" | "rewrite" | "pause" | "abort", ...}), got '
            f"{_kind(data)}: {_problems(exc)}",
            type=BAD_UPDATE,
            non_retryable=True,
        ) from None


def _approval_of(
    call_ids: object, denied: object, loop_id: str
) -> tuple[list[str], dict[str, str]]:
    if not isinstance(call_ids, list) or not all(isinstance(c, str) for c in call_ids):
        problem = f"call_ids must be an array of call id strings, got {_kind(call_ids)}"
    elif denied is not None and (
        not isinstance(denied, dict)
        or not all(isinstance(v, str) for v in denied.values())
    ):
        problem = (
            "denied must be null or an object of call id -> reason string, "
            f"got {_kind(denied)}"
        )
    else:
        return call_ids, dict(denied or {})
    raise ApplicationError(
        f"approve of loop {loop_id}: {problem}", type=BAD_UPDATE, non_retryable=True
    )


async def _drain(
    subscription: Any,
    subscribers: Sequence[Callable[[AgentEvent], object]],
    loop_id: str,
) -> None:
    """Hand each event to the agent's subscribers, except while replaying:
    the first run already did (a subscriber's side effect happens once)."""
    async for event in subscription:
        if not workflow.unsafe.is_replaying():
            _deliver(event, subscribers, loop_id)
        if event.type == "loop.idle":
            break


def _deliver(
    event: AgentEvent,
    subscribers: Sequence[Callable[[AgentEvent], object]],
    loop_id: str,
) -> None:
    # Outside the sandbox's restrictions: subscribers are where side effects
    # go (a file, a queue), and they never run on a replay, so what they do
    # cannot make the workflow diverge.
    with workflow.unsafe.sandbox_unrestricted():
        for subscriber in subscribers:
            try:
                subscriber(event)
            except Exception:  # noqa: BLE001 - a subscriber's bug loses no event
                name = getattr(subscriber, "__qualname__", None) or repr(subscriber)
                workflow.logger.exception(
                    "agentfsm: subscriber %s raised on %s (seq %d) of loop %s; "
                    "it still gets the loop's later events",
                    name,
                    event.type,
                    event.seq,
                    loop_id,
                )
                get_logger().exception(
                    "subscriber_failed",
                    loop_id=loop_id,
                    subscriber=name,
                    event_type=event.type,
                    seq=event.seq,
                )
