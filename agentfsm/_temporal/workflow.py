"""`LoopWorkflow`: one agentfsm loop as one Temporal workflow.

The unchanged `Runtime` runs in workflow code: the transition table, the
handlers, the wrappers, the stop conditions and the queues. Its clock is
`workflow.now()` and its loop id the workflow's, so the events a replay
publishes are the events the first run published. What is not deterministic
leaves the workflow as an activity:

- each model request: a provider (`_ActivityProvider`) whose `complete` runs
  the `agentfsm.<agent>.infer` activity, the context passed by reference;
- each tool body: the innermost tool wrapper (`_ToolActivities`) runs the
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

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

from pydantic import TypeAdapter
from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

from agentfsm._keys import idempotency_key
from agentfsm._replay.wire import request_data
from agentfsm._runtime.runtime import Runtime
from agentfsm.events import AgentEvent
from agentfsm.exceptions import (
    ConfigurationError,
    LoopStateError,
    ProviderError,
    ToolTimeout,
)
from agentfsm.inference import InferenceInput, InferenceOutput, OutputCompleted
from agentfsm.interception import (
    Decision,
    Pause,
    PendingTransition,
    Rewrite,
    ToolBatch,
)
from agentfsm.messages import ContextItem, ModelContext, UserMessage
from agentfsm.providers import _OneProviderRegistry
from agentfsm.results import LoopStatus, LoopView
from agentfsm.states import LoopState, Trigger
from agentfsm.tools import ToolCall, ToolNext, ToolResult, _current_call

from .agent import LocalActivityHandler, TemporalAgent, agent_named
from .wire import (
    CONTEXT_MISSING,
    InferArgs,
    InferResult,
    StartLoop,
    ToolArgs,
    ToolOutcome,
    chain_digest,
    dump,
)

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


async def _run(handle: Any) -> Any:
    """Await an activity's handle so that a cancellation ends the wait at once.

    anyio cancels a task by calling `cancel()` on it again at each turn of the
    event loop until it exits; awaiting the handle itself, the task would wait
    for Temporal to confirm the activity's cancellation, which needs the
    workflow to yield first, so the loop would spin until Temporal's deadlock
    detector fails the workflow task. Shielded, the task leaves at once, and
    the handle, cancelled, asks Temporal to cancel the activity.
    """
    import asyncio  # noqa: TID251 - workflow code runs on asyncio only

    try:
        return await asyncio.shield(handle)
    except asyncio.CancelledError:
        handle.cancel()
        # Nobody awaits the handle any more: retrieve its outcome, so that
        # asyncio does not report an exception that was never retrieved.
        handle.add_done_callback(lambda f: f.cancelled() or f.exception())
        raise


def view_data(view: LoopView) -> dict[str, Any]:
    """A `LoopView` as JSON data (a pending request's tools are objects: its
    payload is left out; the request's metadata too)."""
    pending = view.pending
    if pending is not None and isinstance(pending.payload, InferenceInput):
        pending = pending.model_copy(update={"payload": None})
    if pending is not view.pending:
        view = view.model_copy(update={"pending": pending})
    return view.model_dump(mode="json", exclude={"pending": {"metadata"}})


class _ContextRef:
    """Which prefix of the context the inference activities' store holds: the
    items sent so far (by identity: items are frozen, an edit replaces one)
    and their chain digests."""

    __slots__ = ("digests", "sent")

    def __init__(self) -> None:
        self.sent: list[ContextItem] = []
        self.digests: list[str] = []

    def split(
        self, items: Sequence[ContextItem], whole: bool
    ) -> tuple[int, str, tuple[ContextItem, ...], tuple[str, ...]]:
        """`(base, base_digest, new items, their digests)` of a request."""
        base = 0
        if not whole:
            sent = self.sent
            limit = min(len(sent), len(items))
            while base < limit and items[base] is sent[base]:
                base += 1
        digests = self.digests[:base]
        previous = digests[-1] if digests else ""
        fresh = tuple(items[base:])
        for item in fresh:
            previous = chain_digest(previous, item)
            digests.append(previous)
        self.sent = list(items)
        self.digests = digests
        return (
            base,
            (self.digests[base - 1] if base else ""),
            fresh,
            tuple(digests[base:]),
        )


class _ActivityProvider:
    """The workflow's provider: each request is an inference activity."""

    def __init__(self, agent: TemporalAgent, owner: LoopWorkflow) -> None:
        self.agent = agent
        self.owner = owner
        self.context = _ContextRef()
        self.requests = 0
        options = agent.options
        timeout = options.get("inference_timeout")
        self.timeout = (
            timedelta(seconds=timeout) if timeout is not None else agent.no_timeout
        )

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        return await self._infer(request, streaming=False)

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[OutputCompleted]]:
        # The activity consumes the stream (its chunks go to the worker's
        # `on_chunk`); the loop gets the completed output only.
        output = await self._infer(request, streaming=True)

        async def one() -> AsyncIterator[OutputCompleted]:
            yield OutputCompleted(output=output)

        yield one()

    async def _infer(
        self, request: InferenceInput, *, streaming: bool
    ) -> InferenceOutput:
        self.requests += 1
        data = request_data(request)
        schema = request.structured_output
        if isinstance(schema, type):
            schema = schema.model_json_schema()
        settings = dict(data.settings)
        settings.pop("streaming", None)
        items = request.context.items
        whole = False
        while True:
            base, digest, fresh, digests = self.context.split(items, whole)
            args = InferArgs(
                loop_id=self.owner.loop_id,
                request=self.requests,
                model=request.model,
                settings=settings,
                tools=data.tools,
                structured_output=schema,
                instructions=request.context.instructions,
                streaming=streaming,
                base=base,
                base_digest=digest,
                items=fresh,
                digests=digests,
            )
            try:
                raw = await _run(
                    workflow.start_activity(
                        f"agentfsm.{self.agent.name}.infer",
                        dump(args),
                        start_to_close_timeout=self.timeout,
                        heartbeat_timeout=self.agent.model_heartbeat,
                        retry_policy=self.agent.model_retry,
                        summary=f"request {self.requests}",
                    )
                )
            except ActivityError as exc:
                cause = exc.cause
                if (
                    isinstance(cause, ApplicationError)
                    and cause.type == CONTEXT_MISSING
                    and not whole
                ):
                    whole = True  # that worker's store lacks the prefix: send it all
                    continue
                raise ProviderError(
                    f"the inference activity for {request.model!r} failed: "
                    f"{cause or exc}",
                    retryable=False,
                ) from exc
            break
        result = InferResult.model_validate(raw)
        if result.error is not None:
            error = result.error
            raise ProviderError(
                error.message,
                retryable=error.retryable,
                status_code=error.status_code,
            )
        assert result.output is not None
        return result.output


class _ToolActivities:
    """The innermost tool wrapper: runs a call's tool body as an activity."""

    def __init__(self, agent: TemporalAgent, owner: LoopWorkflow) -> None:
        self.agent = agent
        self.owner = owner
        self.lost: list[tuple[str, str]] = []
        """`(call_id, tool)` of `on_crash="pause"` calls whose one attempt was
        lost: the loop pauses at its next transition (`pause_after_lost`)."""

    async def __call__(self, call: ToolCall, next_: ToolNext) -> ToolResult:
        tool = call.tool
        if tool is None or self.agent.tool(tool.name) is not tool:
            # Not one of the agent's tools (an unknown name; a tool a wrapper
            # or handler made up): the loop's own handling, in the workflow.
            return await next_(call)
        item = call.call
        # The loop's own record of the call (request number, position, key):
        # the activity's tool sees the same `current_call()` as in a process.
        running = _current_call.get()
        if running is not None and running.call_id == item.call_id:
            request, position = running.request, running.position
            key = running.idempotency_key
            if call.arguments != item.arguments:  # a wrapper changed them
                key = idempotency_key(
                    call.loop_id, request, position, item.name, call.arguments
                )
        else:  # a wrapper of ours called from elsewhere: the same rule
            request, position = self.owner.provider.requests, 0
            key = idempotency_key(
                call.loop_id, request, position, item.name, call.arguments
            )
        args = ToolArgs(
            loop_id=call.loop_id,
            agent_id=call.agent_id,
            call_id=item.call_id,
            name=tool.name,
            arguments=call.arguments,
            request=request,
            position=position,
            idempotency_key=key,
        )
        retry = tool.on_crash == "retry"
        timeout = (
            timedelta(seconds=tool.timeout)
            if tool.timeout is not None
            else self.agent.no_timeout
        )
        try:
            raw = await _run(
                workflow.start_activity(
                    f"agentfsm.{self.agent.name}.tool.{tool.name}",
                    dump(args),
                    start_to_close_timeout=timeout,
                    heartbeat_timeout=self.agent.tool_heartbeat,
                    retry_policy=RetryPolicy(
                        maximum_attempts=self.agent.tool_attempts if retry else 1
                    ),
                    summary=f"{tool.name} {item.call_id}",
                )
            )
        except ActivityError as exc:
            cause = exc.cause
            if not retry:
                self.lost.append((item.call_id, tool.name))
            if isinstance(cause, TimeoutError):
                raise ToolTimeout(
                    f"tool {tool.name!r}: its activity timed out "
                    f"({cause.type.name if cause.type else 'timeout'}) "
                    + (
                        f"after {self.agent.tool_attempts} attempts"
                        if retry
                        else "and was not retried (on_crash='pause')"
                    ),
                    tool=tool.name,
                ) from exc
            return ToolResult.error(
                f"tool {tool.name!r}: its activity failed: {cause or exc}"
            )
        outcome = ToolOutcome.model_validate(raw)
        return ToolResult(
            output=outcome.output,
            is_error=outcome.is_error,
            terminate=outcome.terminate,
        )

    def pause_after_lost(self, pending: PendingTransition) -> Decision | None:
        """Pause a loop whose `on_crash="pause"` call was lost, before it goes
        on: a person decides (resume goes on; the model sees the call's error)."""
        if not self.lost or pending.source is not LoopState.function_call:
            return None
        lost, self.lost = self.lost, []
        names = ", ".join(f"{tool} ({call_id})" for call_id, tool in lost)
        return Pause(
            f"tool call {names} was lost with its worker or timed out and is "
            "not retried (on_crash='pause'): it may or may not have run"
        )


def _local(agent: TemporalAgent, marked: LocalActivityHandler) -> Callable[..., Any]:
    """A `local_activity` handler as the loop calls it: a local activity."""

    async def decide(pending: PendingTransition) -> Decision | None:
        sent = pending
        if isinstance(pending.payload, InferenceInput):
            sent = pending.model_copy(update={"payload": None})
        raw = await _run(
            workflow.start_local_activity(
                f"agentfsm.{agent.name}.handler.{marked.name}",
                sent.model_dump(mode="json", exclude={"metadata"}),
                start_to_close_timeout=marked.timeout,
            )
        )
        return None if raw is None else _decisions.validate_python(raw)

    decide.__qualname__ = decide.__name__ = marked.name
    return decide


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
        self.provider: _ActivityProvider
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
        self.provider = _ActivityProvider(agent, self)
        tools = _ToolActivities(agent, self)
        handlers: list[Any] = [tools.pause_after_lost]
        for h in agent.handlers:
            handlers.append(
                _local(agent, h) if isinstance(h, LocalActivityHandler) else h
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
