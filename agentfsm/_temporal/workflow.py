"""`LoopWorkflow`: one agentfsm loop as one Temporal workflow.

The unchanged `Runtime` runs in workflow code: the transition table, the
handlers, the wrappers, the stop conditions and the queues. Its clock is
`workflow.now()` and its loop id the workflow's, so the events a replay
publishes are the events the first run published. What is not deterministic
leaves the workflow as an activity:

- each model request: a provider (`calls.ActivityProvider`) whose `complete` runs
  the `agentfsm.<agent>.infer` activity, the context passed by reference;
- each tool body: the innermost tool wrapper (`calls.ToolActivities`) runs the
  `agentfsm.<agent>.tool.<name>` activity, the tool's timeout its
  start-to-close timeout (the tool's own in-workflow timer is never armed:
  the tool's function does not run in the workflow), its crash policy its
  retry policy, the call's idempotency key among its arguments;
- each handler marked `local_activity`: a local activity.

Signals steer, follow up and cancel; updates resume and approve (their
validators reject a loop that is not paused, and call ids that are not the
ones waiting); the `view` query answers with the loop's `LoopView`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from pydantic import TypeAdapter
from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ApplicationError

from agentfsm._runtime.runtime import Runtime
from agentfsm.events import AgentEvent
from agentfsm.exceptions import ConfigurationError, LoopStateError
from agentfsm.inference import InferenceInput
from agentfsm.interception import Decision, Rewrite, ToolBatch
from agentfsm.messages import ModelContext, UserMessage
from agentfsm.providers import _OneProviderRegistry
from agentfsm.results import LoopStatus, LoopView
from agentfsm.states import LoopState, Trigger

from .agent import LocalActivityHandler, agent_named
from .calls import ActivityProvider, ToolActivities, local_handler
from .wire import StartLoop

if TYPE_CHECKING:
    from agentfsm._loop import Loop

__all__ = ("STATE_ATTRIBUTE", "WORKFLOW_NAME", "LoopWorkflow", "view_data")

WORKFLOW_NAME: Final = "agentfsm.loop"
STATE_ATTRIBUTE: Final = SearchAttributeKey.for_keyword("AgentFsmState")
"""`<status>:<state>` of the loop (`running:idle`, `paused:function_call`,
`done:idle`), upserted when a run of the loop starts and when it returns
(pauses or ends): the points where a loop waits for someone, so that waiting
loops can be listed. Set only on workflows started with it
(`LoopClient(state_attribute=True)`): an attribute the namespace has not
registered would fail the workflow task."""

_decisions: TypeAdapter[Decision] = TypeAdapter(Decision)


def view_data(view: LoopView) -> dict[str, Any]:
    """A `LoopView` as JSON data (a pending request's tools are objects: its
    payload is left out; the request's metadata too)."""
    pending = view.pending
    if pending is not None and isinstance(pending.payload, InferenceInput):
        pending = pending.model_copy(update={"payload": None})
    if pending is not view.pending:
        view = view.model_copy(update={"pending": pending})
    return view.model_dump(mode="json", exclude={"pending": {"metadata"}})


class _Status:
    """The runtime's instrument: keeps the state search attribute current,
    when a run of the loop starts and when it returns (pauses or ends)."""

    def __init__(self, owner: LoopWorkflow) -> None:
        self.owner = owner

    def start_run(self, loop: Loop, start: Callable[[Loop], None], /) -> None:
        start(loop)
        self.owner.upsert(f"running:{loop.state}")

    def run_ended(self, loop: Loop, /) -> None:
        self.owner.upsert(f"{loop.status}:{loop.state}")

    def loop_ended(self, loop: Loop, /) -> None:
        self.owner.upsert(f"done:{LoopState.idle}")


@workflow.defn(name=WORKFLOW_NAME)
class LoopWorkflow:
    """One loop of a `TemporalAgent` (start it with `LoopClient.start`)."""

    def __init__(self) -> None:
        self.loop_id = ""
        self.runtime: Runtime | None = None
        self.provider: ActivityProvider
        self._early: list[Callable[[Runtime], None]] = []
        self._state = ""

    # ------------------------------------------------------------------- run

    @workflow.run
    async def run(self, data: dict[str, Any]) -> dict[str, Any]:
        start = StartLoop.model_validate(data)
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
        tools = ToolActivities(agent, self)
        handlers: list[Any] = [tools.pause_after_lost]
        for h in agent.handlers:
            handlers.append(
                local_handler(agent, h) if isinstance(h, LocalActivityHandler) else h
            )
        options = dict(agent.options)
        # The activity's start-to-close timeout, not an in-workflow timer.
        options.pop("inference_timeout", None)
        options["tool_wrappers"] = (*options.get("tool_wrappers", ()), tools)
        # Kept current only on workflows started with it (the namespace has it).
        self._state = workflow.info().typed_search_attributes.get(STATE_ATTRIBUTE) or ""
        ids = iter((start.loop_id,))
        runtime = Runtime(
            providers=_OneProviderRegistry(self.provider),  # served in the activity
            clock=workflow.now,
            ids=lambda: next(ids),
            instrument=_Status(self),
        )
        async with runtime:
            self.runtime = runtime
            if agent.subscribers:
                subscription = runtime.bus.subscribe("*", loop_id=start.loop_id)
                drain = _drain(subscription, agent.subscribers)
            else:
                drain = None
            loop_id = runtime.run_loop(
                start.agent_id or agent.name,
                start.message,
                agent.request(ModelContext()),
                handlers,
                **options,
            )
            for early in self._early:
                early(runtime)
            self._early.clear()
            if drain is not None:
                import asyncio  # noqa: TID251 - workflow code runs on asyncio only

                drained = asyncio.ensure_future(drain)
            result = await runtime.wait(loop_id)
        if drain is not None:
            await drained
        # Let update handlers that resumed the loop finish before the workflow does.
        await workflow.wait_condition(workflow.all_handlers_finished)
        return result.model_dump(mode="json")

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

    @workflow.signal
    def steer(self, message: dict[str, Any]) -> None:
        """Queue a steering message (`Runtime.steer`)."""
        msg = UserMessage.model_validate(message)
        self._when_running(lambda rt: _ignore_ended(rt.steer, self.loop_id, msg))

    @workflow.signal
    def follow_up(self, message: dict[str, Any]) -> None:
        """Queue a follow-up (`Runtime.follow_up`)."""
        msg = UserMessage.model_validate(message)
        self._when_running(lambda rt: _ignore_ended(rt.follow_up, self.loop_id, msg))

    @workflow.signal
    def cancel(self, reason: str | None = None) -> None:
        """Cancel the loop (`Runtime.cancel`): it ends `cancelled`."""
        self._when_running(lambda rt: rt.cancel(self.loop_id, reason))

    # --------------------------------------------------------------- updates

    @workflow.update
    async def resume(self, decision: dict[str, Any] | None = None) -> dict[str, Any]:
        """Resume the paused loop with `decision` (default `Proceed`)."""
        assert self.runtime is not None
        chosen = None if decision is None else _decisions.validate_python(decision)
        self.runtime.resume(self.loop_id, chosen)
        return view_data(self._view())

    @resume.validator
    def _check_resume(self, decision: dict[str, Any] | None = None) -> None:
        view = self._view()
        if view.status is not LoopStatus.paused:
            raise LoopStateError(f"loop {self.loop_id} is {view.status}, not paused")
        if decision is not None:
            _decisions.validate_python(decision)

    @workflow.update
    async def approve(
        self, call_ids: list[str], denied: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Approve the calls waiting for approval (`call_ids`), deny `denied`
        (`call_id -> reason`), and resume the loop."""
        assert self.runtime is not None
        batch = self._batch()
        for call_id, reason in (denied or {}).items():
            batch = batch.deny(call_id, reason)
        for call_id in call_ids:
            batch = batch.approve(call_id)
        self.runtime.resume(self.loop_id, Rewrite(payload=batch))
        return view_data(self._view())

    @approve.validator
    def _check_approve(
        self, call_ids: list[str], denied: dict[str, str] | None = None
    ) -> None:
        view = self._view()
        if view.status is not LoopStatus.paused:
            raise LoopStateError(f"loop {self.loop_id} is {view.status}, not paused")
        waiting = set(self._batch().awaiting_approval)
        named = set(call_ids) | set(denied or {})
        if named != waiting:
            raise LoopStateError(
                f"loop {self.loop_id} is waiting for approval of "
                f"{sorted(waiting) or 'no calls'}; the update named {sorted(named)} "
                "(stale call ids, or calls left out: approve or deny each)"
            )

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
        return view_data(self._view())


def _ignore_ended(
    queue: Callable[[str, UserMessage], None], loop_id: str, msg: UserMessage
) -> None:
    # A signal cannot be refused: one that reaches an ended loop is dropped
    # (it is in the history; the loop's result says what it saw).
    try:
        queue(loop_id, msg)
    except LoopStateError:
        workflow.logger.info(
            "agentfsm: a message reached loop %s after it ended", loop_id
        )


async def _drain(
    subscription: Any, subscribers: Sequence[Callable[[AgentEvent], object]]
) -> None:
    """Hand each event to the agent's subscribers, except while replaying:
    the first run already did (a subscriber's side effect happens once)."""
    async for event in subscription:
        if workflow.unsafe.is_replaying():
            continue
        for subscriber in subscribers:
            subscriber(event)
        if event.type == "loop.idle":
            break
