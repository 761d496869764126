"""`LoopClient`: loops on Temporal, driven like `Runtime`'s loops.

```python
loops = LoopClient(client, task_queue="agents")
loop_id = await loops.start("calc", "what is 2+3?")   # returns once the workflow exists
await loops.steer(loop_id, "use integers")
result = await loops.wait(loop_id)                    # a LoopResult, whatever the outcome
```

A loop's workflow id is `agentfsm/<loop_id>`. Signals (steer, follow_up,
cancel) return once the server has them; updates (resume, approve) once the
workflow accepted and applied them; queries (get, transcript) once a worker
answered.

Every method raises `LoopStateError` for a loop that does not fit the call
(none of that id, an ended loop for a signal or an update, a refused update,
a workflow terminated or timed out for `wait`) and `TemporalTimeout` when no
answer came within the client's `timeout` (queries and updates need a worker
of the loop's task queue). Temporal's own errors never escape.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Final, TypeVar

import anyio
from pydantic import TypeAdapter, ValidationError
from temporalio.client import (
    Client,
    RPCTimeoutOrCancelledError,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import (
    ApplicationError,
    CancelledError,
    TerminatedError,
    WorkflowAlreadyStartedError,
)
from temporalio.exceptions import TimeoutError as WorkflowTimeoutError
from temporalio.service import RPCError, RPCStatusCode

from agentfsm._arguments import ArgumentValueError, check, timeout_or_none
from agentfsm._runtime.ids import uuid7
from agentfsm.exceptions import (
    ConfigurationError,
    ImageNotSupported,
    LoopStateError,
    TemporalTimeout,
)
from agentfsm.interception import Decision
from agentfsm.messages import ContextItem, ModelContext, UserMessage
from agentfsm.results import LoopResult, LoopView

from ._wire import MAX_PAYLOAD, StartLoop, dump, payload_size
from ._workflow import (
    AGENT_ATTRIBUTE,
    IMAGE_NOT_SUPPORTED,
    LOOP_FAILED,
    RESULT_MEMO,
    STATE_ATTRIBUTE,
    WORKFLOW_NAME,
)

__all__ = ("DEFAULT_TIMEOUT", "LoopClient", "workflow_id")

DEFAULT_TIMEOUT: Final = 10.0
"""Seconds a `LoopClient` call waits for an answer by default (a query or an
update needs a worker; without one, Temporal would hold the call ~30 s)."""

_TRANSCRIPT_PAGE: Final = MAX_PAYLOAD // 2
"""The bytes of context items one `transcript` query answers with at most."""

T = TypeVar("T")

_decisions: TypeAdapter[Decision] = TypeAdapter(Decision)
_items: TypeAdapter[list[ContextItem]] = TypeAdapter(list[ContextItem])


def workflow_id(loop_id: str) -> str:
    """The id of a loop's workflow."""
    return f"agentfsm/{loop_id}"


def _message(message: UserMessage | str, what: str) -> dict[str, Any]:
    if isinstance(message, str):
        message = UserMessage(content=message)
    if not isinstance(message, UserMessage):
        raise ConfigurationError(
            f"{what}() takes a str or a UserMessage, got {type(message).__name__}"
        )
    return dump(message)


def _seed(context: ModelContext | Sequence[ContextItem]) -> ModelContext:
    """`start(context=)` as a `ModelContext` (items are checked here, not in
    the workflow, so that a mistake is the caller's error, not a failed loop)."""
    if isinstance(context, ModelContext):
        return context
    given: object = context  # its annotation is what callers should pass
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        raise ConfigurationError(
            "start(context=) takes a ModelContext or a sequence of context "
            f"items, got {type(given).__name__}"
        )
    try:
        return ModelContext(items=_items.validate_python(list(context)))
    except ValidationError as exc:
        raise ConfigurationError(
            f"start(context=): not a sequence of context items: {exc}"
        ) from exc


def _fits(loop_id: str, call: str, what: str, data: Any) -> None:
    """Refuse to send `data` over the payload limit: the server would refuse
    it with an error that names neither the call nor the loop."""
    size = payload_size(data)
    if size > MAX_PAYLOAD:
        raise ArgumentValueError(
            f"{call}() of loop {loop_id}: {what} is {size:,} bytes, over the "
            f"{MAX_PAYLOAD:,} bytes a Temporal payload may carry (the server's "
            "limit.blobSize.error is 2 MiB by default)"
        )


class LoopClient:
    """Starts and drives loop workflows on a Temporal client.

    ```python
    loops = LoopClient(client, task_queue="agents", search_attributes=True)
    loop_id = await loops.start("calc", "what is 2+3?")
    result = await loops.wait(loop_id)       # answered, failed, cancelled, ...
    transcript = await loops.transcript(loop_id)
    ```

    Args:
        client: a connected `temporalio.client.Client`.
        task_queue: the queue the workers of `agentfsm.temporal.worker` poll.
        search_attributes: start each workflow with the `AgentFsmState`
            (`<status>:<state>`, kept current) and `AgentFsmAgent` (the agent's
            name) search attributes; the workflow sets `AgentFsmOutcome` when
            the loop ends. The namespace must have the three registered, as
            Keywords.
        state_attribute: `AgentFsmState` alone (for a namespace that has only
            it registered); `search_attributes=True` includes it.
        execution_timeout: the longest a loop's workflow may run, pauses
            included (default: no limit; a loop's `deadline` is its own).
        timeout: the seconds each call waits for an answer before it raises
            `TemporalTimeout` (None: no limit); `wait` has none (a loop may
            wait days for a person).

    Raises:
        ConfigurationError: `client` is not a Temporal client, or `timeout` is
            not a positive number of seconds or None.
    """

    def __init__(
        self,
        client: Client,
        *,
        task_queue: str,
        search_attributes: bool = False,
        state_attribute: bool = False,
        execution_timeout: timedelta | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        if not isinstance(client, Client):
            raise ConfigurationError(
                f"LoopClient needs a temporalio Client, got {type(client).__name__}"
            )
        check("LoopClient(task_queue=)", task_queue, str)
        check("LoopClient(search_attributes=)", search_attributes, bool)
        check("LoopClient(state_attribute=)", state_attribute, bool)
        check("LoopClient(execution_timeout=)", execution_timeout, timedelta | None)
        self.client = client
        self.task_queue = task_queue
        self.search_attributes = search_attributes
        self.state_attribute = state_attribute or search_attributes
        self.execution_timeout = execution_timeout
        self.timeout = timeout_or_none("LoopClient(timeout=)", timeout)

    def handle(self, loop_id: str) -> WorkflowHandle[Any, Any]:
        """The Temporal handle of a loop's workflow."""
        return self.client.get_workflow_handle(workflow_id(loop_id))

    # ----------------------------------------------------------------- start

    async def start(
        self,
        agent: str,
        message: UserMessage | str | None,
        *,
        loop_id: str | None = None,
        agent_id: str | None = None,
        context: ModelContext | Sequence[ContextItem] | None = None,
        from_loop: str | None = None,
    ) -> str:
        """Start a loop of `agent` (a `TemporalAgent`'s name) and return its id
        as soon as its workflow exists (the loop runs on the workers).

        With a `loop_id` given, starting it again attaches to that loop,
        running or ended, instead of starting another (start-or-attach; the
        message and the seed are then ignored).

        Args:
            agent: the `TemporalAgent`'s name.
            message: the first message (None: the loop starts on its context);
                a `UserMessage`'s images go in the start's input, their bytes
                within its payload limit (the workflow hands them to the
                workers' context store before its first request).
            loop_id: the loop's id (default: a new one).
            agent_id: who the loop runs for (default: the agent's name).
            context: a prior conversation to start on: a `ModelContext` or its
                items (the agent's instructions, when it has some, replace the
                context's). It goes in the workflow's start input.
            from_loop: start on the transcript of that loop instead (read with
                `transcript`, so a worker must be up).

        Raises:
            ConfigurationError: bad arguments; `context` and `from_loop` both
                given; the namespace lacks a search attribute the client sets.
            ArgumentValueError: the start input would exceed Temporal's payload
                limit (it names its size and the limit), images included.
            LoopStateError: `from_loop` names no loop.
            TemporalTimeout: no answer within the client's timeout.
        """
        if message is not None and not isinstance(message, str | UserMessage):
            raise ConfigurationError(
                "start() takes a str, a UserMessage or None, got "
                f"{type(message).__name__}"
            )
        check("start(agent=)", agent, str)
        check("start(loop_id=)", loop_id, str | None)
        check("start(agent_id=)", agent_id, str | None)
        check("start(from_loop=)", from_loop, str | None)
        if context is not None and from_loop is not None:
            raise ConfigurationError(
                "start() takes context= or from_loop=, not both: seed the loop "
                "with one conversation"
            )
        seed = None if context is None else _seed(context)
        loop_id = loop_id or uuid7()
        if from_loop is not None:
            seed = await self.transcript(from_loop)
        data = dump(
            StartLoop(
                agent=agent,
                loop_id=loop_id,
                message=UserMessage(content=message)
                if isinstance(message, str)
                else message,
                agent_id=agent_id,
                context=seed,
            )
        )
        _fits(loop_id, "start", "its start input (the message and the seed)", data)
        await self._call(
            loop_id, "start", lambda: self._start(loop_id, agent, data), worker=False
        )
        return loop_id

    async def _start(self, loop_id: str, agent: str, data: dict[str, Any]) -> None:
        try:
            await self.client.start_workflow(
                WORKFLOW_NAME,
                data,
                id=workflow_id(loop_id),
                task_queue=self.task_queue,
                # Start-or-attach, for a running loop and for an ended one: a
                # loop id names one loop, never a second run of another.
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                execution_timeout=self.execution_timeout,
                search_attributes=self._attributes(agent),
            )
        except WorkflowAlreadyStartedError:
            pass  # the loop ended already (its id is taken): `wait` has its result
        except RPCError as exc:
            if exc.status is RPCStatusCode.INVALID_ARGUMENT and (
                "search attribute" in exc.message.lower()
            ):
                raise ConfigurationError(
                    f"start() of loop {loop_id}: the namespace lacks a search "
                    f"attribute this LoopClient sets ({exc.message}); register "
                    "AgentFsmState, AgentFsmAgent and AgentFsmOutcome as Keywords "
                    "(temporal operator search-attribute create)"
                ) from exc
            raise

    def _attributes(self, agent: str) -> TypedSearchAttributes | None:
        pairs: list[SearchAttributePair[Any]] = []
        if self.state_attribute:
            pairs.append(SearchAttributePair(STATE_ATTRIBUTE, "running:idle"))
        if self.search_attributes:
            # The workflow sets the outcome only on workflows that have this.
            pairs.append(SearchAttributePair(AGENT_ATTRIBUTE, agent))
        return TypedSearchAttributes(pairs) if pairs else None

    # ------------------------------------------------------------ the result

    async def wait(self, loop_id: str) -> LoopResult:
        """Wait for the loop to end; its `LoopResult`, whatever its outcome
        (answered, failed, aborted, cancelled by `cancel` or by Temporal's own
        cancel, ...). It waits without the client's timeout (a paused loop may
        wait days for a person): bound it with `anyio.fail_after`.

        Raises:
            LoopStateError: no loop of that id, or its workflow ended without
                the loop (terminated, timed out past `execution_timeout`,
                failed before the loop started); the message names the status.
            ConfigurationError: no worker of the queue knows the agent.
        """
        try:
            data = await self._call(
                loop_id, "wait", self.handle(loop_id).result, worker=True, bounded=False
            )
        except WorkflowFailureError as exc:
            return await self._ended_without_result(loop_id, exc)
        return LoopResult.model_validate(data)

    async def _ended_without_result(
        self, loop_id: str, failure: WorkflowFailureError
    ) -> LoopResult:
        """The result of a loop whose workflow did not complete: a failed loop
        (the result in the failure's details), a cancelled workflow (the
        result in its memo); otherwise the workflow ended without the loop."""
        cause = failure.cause
        if isinstance(cause, ApplicationError):
            if cause.type == LOOP_FAILED and cause.details:
                return LoopResult.model_validate(cause.details[0])
            if cause.type == "ConfigurationError":
                raise ConfigurationError(cause.message) from failure
            if cause.type == IMAGE_NOT_SUPPORTED and cause.details:
                named = cause.details[0]
                raise ImageNotSupported(
                    cause.message,
                    model=str(named.get("model", "")),
                    capability=str(named.get("capability", "")),
                    block=str(named.get("block", "")),
                ) from failure
            raise LoopStateError(
                f"loop {loop_id}: its workflow failed (FAILED) without the loop's "
                f"result: {cause.type}: {cause.message}"
            ) from failure
        if isinstance(cause, CancelledError):
            memo = await self._memo(loop_id)
            if RESULT_MEMO in memo:
                return LoopResult.model_validate(memo[RESULT_MEMO])
            raise LoopStateError(
                f"loop {loop_id}: its workflow was cancelled (CANCELED) before "
                "the loop started: it has no result"
            ) from failure
        if isinstance(cause, TerminatedError):
            raise LoopStateError(
                f"loop {loop_id}: its workflow was terminated (TERMINATED): "
                f"{cause.message or 'no reason given'}; the loop has no result"
            ) from failure
        if isinstance(cause, WorkflowTimeoutError):
            raise LoopStateError(
                f"loop {loop_id}: its workflow timed out (TIMED_OUT, past the "
                "client's execution_timeout); the loop has no result"
            ) from failure
        raise LoopStateError(
            f"loop {loop_id}: its workflow failed (FAILED) without the loop's "
            f"result: {cause or failure}"
        ) from failure

    async def _memo(self, loop_id: str) -> Mapping[str, Any]:
        description = await self._call(
            loop_id, "wait", self.handle(loop_id).describe, worker=False
        )
        return await description.memo()

    # --------------------------------------------------------------- queries

    async def get(self, loop_id: str) -> LoopView:
        """The loop's view (a query): state, status, pending transition,
        totals; an ended loop's too (a worker replays its history).

        Raises:
            LoopStateError: no loop of that id, or it has not started yet.
            TemporalTimeout: no worker of the queue answered in time.
        """
        data = await self._query(loop_id, "get", "view")
        return LoopView.model_validate(data)

    async def transcript(self, loop_id: str) -> ModelContext:
        """The loop's context (a query, page by page): its instructions and
        every item, as the model saw them; an ended loop's too, while a worker
        is up (it replays the history to answer). A tool output kept by
        reference in the worker's context store appears as its reference, and
        so does an image the store keeps (`ImageBlock.is_reference`: digest,
        media type and size, no bytes; the workers read the bytes by digest,
        so a loop started `from_loop=` on it sees them).

        Raises:
            LoopStateError: no loop of that id, or it has not started yet.
            TemporalTimeout: no worker of the queue answered in time.
        """
        items: list[ContextItem] = []
        instructions: str | None = None
        while True:
            page = await self._query(
                loop_id, "transcript", "transcript", len(items), _TRANSCRIPT_PAGE
            )
            instructions = page["instructions"]
            items.extend(_items.validate_python(page["items"]))
            if len(items) >= page["total"] or not page["items"]:
                return ModelContext(instructions=instructions, items=items)

    async def _query(self, loop_id: str, call: str, name: str, *args: Any) -> Any:
        try:
            return await self._call(
                loop_id,
                call,
                lambda: self.handle(loop_id).query(name, args=args),
                worker=True,
            )
        except WorkflowQueryFailedError as exc:
            raise LoopStateError(f"{call}() of loop {loop_id}: {exc.message}") from exc

    # --------------------------------------------------------------- signals

    async def steer(self, loop_id: str, message: UserMessage | str) -> None:
        """Queue a steering message (a signal).

        Raises:
            LoopStateError: no loop of that id, or it has ended.
            TemporalTimeout: the server did not answer in time.
        """
        await self._signal(loop_id, "steer", _message(message, "steer"))

    async def follow_up(self, loop_id: str, message: UserMessage | str) -> None:
        """Queue a follow-up (a signal).

        Raises:
            LoopStateError: no loop of that id, or it has ended.
            TemporalTimeout: the server did not answer in time.
        """
        await self._signal(loop_id, "follow_up", _message(message, "follow_up"))

    async def cancel(
        self, loop_id: str, reason: str | None = None, *, native: bool = False
    ) -> None:
        """Cancel the loop: it ends `cancelled`, and `wait` returns its result.

        By default a `cancel` signal, as `Runtime.cancel`: the workflow
        completes with the cancelled loop's result. With `native=True`,
        Temporal's own cancellation (what Temporal's UI, its CLI and a parent
        workflow's cancel send): the workflow asks its loop to cancel, keeps
        the result in its memo and ends CANCELED, so Temporal's listings show
        it cancelled. A loop that ended first keeps its own outcome either way.

        Raises:
            LoopStateError: no loop of that id, or it has ended.
            TemporalTimeout: the server did not answer in time.
        """
        check("cancel(reason=)", reason, str | None)
        check("cancel(native=)", native, bool)
        if not native:
            await self._signal(loop_id, "cancel", reason)
            return
        handle = self.handle(loop_id)
        # The server takes a cancel of a closed workflow silently: ask first.
        described = await self._call(loop_id, "cancel", handle.describe, worker=False)
        if described.status is not WorkflowExecutionStatus.RUNNING:
            raise self._ended(loop_id, "cancel", described.status)
        await self._call(
            loop_id, "cancel", lambda: handle.cancel(reason=reason or ""), worker=False
        )

    async def _signal(self, loop_id: str, name: str, arg: Any) -> None:
        _fits(loop_id, name, "the signal's input", arg)
        await self._call(
            loop_id, name, lambda: self.handle(loop_id).signal(name, arg), worker=False
        )

    # --------------------------------------------------------------- updates

    async def resume(self, loop_id: str, decision: Decision | None = None) -> LoopView:
        """Resume the paused loop with `decision` (an update).

        Raises:
            LoopStateError: no loop of that id, it has ended, or it is not
                paused (the update was refused).
            TemporalTimeout: no worker of the queue answered in time.
        """
        data = (
            None if decision is None else _decisions.dump_python(decision, mode="json")
        )
        return await self._update(loop_id, "resume", [data])

    async def approve(
        self,
        loop_id: str,
        call_ids: list[str],
        denied: Mapping[str, str] | None = None,
    ) -> LoopView:
        """Approve the calls waiting for approval and deny `denied`
        (`call_id -> reason`); every waiting call must be named (an update).

        Raises:
            LoopStateError: no loop of that id, it has ended, or it is not
                paused before that batch (the call ids are stale, or some are
                left out).
            TemporalTimeout: no worker of the queue answered in time.
        """
        return await self._update(
            loop_id, "approve", [list(call_ids), dict(denied or {})]
        )

    async def _update(self, loop_id: str, name: str, args: list[Any]) -> LoopView:
        _fits(loop_id, name, "the update's input", args)
        try:
            data = await self._call(
                loop_id,
                name,
                lambda: self.handle(loop_id).execute_update(name, args=args),
                worker=True,
            )
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            raise LoopStateError(
                f"{name} of loop {loop_id} was refused: "
                f"{getattr(cause, 'message', cause)}"
            ) from exc
        return LoopView.model_validate(data)

    # ---------------------------------------------------------------- errors

    async def _call(
        self,
        loop_id: str,
        call: str,
        work: Callable[[], Awaitable[T]],
        *,
        worker: bool,
        bounded: bool = True,
    ) -> T:
        """`work()` within the client's timeout (unless not `bounded`),
        Temporal's errors turned into agentfsm's: `TemporalTimeout` when no
        answer came, `LoopStateError` when the workflow is not there to take
        the call."""
        limit = self.timeout if bounded else None
        deadline = math.inf if limit is None else anyio.current_time() + limit
        gone: RPCError | None = None
        with anyio.CancelScope(deadline=deadline) as scope:
            try:
                return await work()
            except RPCError as exc:
                if exc.status is RPCStatusCode.NOT_FOUND:
                    gone = exc
                elif (
                    scope.cancel_called or exc.status is RPCStatusCode.DEADLINE_EXCEEDED
                ):
                    raise self._timed_out(loop_id, call, worker, limit) from exc
                else:
                    raise
            except RPCTimeoutOrCancelledError as exc:
                # How the SDK reports an update the scope's deadline cancelled.
                if scope.cancel_called:
                    raise self._timed_out(loop_id, call, worker, limit) from exc
                raise
        if gone is None:  # the scope's deadline cancelled the call
            raise self._timed_out(loop_id, call, worker, limit)
        raise await self._gone(loop_id, call, gone) from gone

    def _timed_out(
        self, loop_id: str, call: str, worker: bool, limit: float | None
    ) -> TemporalTimeout:
        seconds = math.inf if limit is None else limit
        if worker:
            why = (
                f"no worker polled task queue {self.task_queue!r} (a query or an "
                "update needs one running)"
            )
        else:
            why = "the Temporal server did not answer"
        return TemporalTimeout(
            f"{call}() of loop {loop_id}: {why} within {seconds:g} s",
            loop_id=loop_id,
            call=call,
            timeout=seconds,
        )

    async def _gone(self, loop_id: str, call: str, error: RPCError) -> LoopStateError:
        """The error for a call the server answered NOT_FOUND: a workflow that
        never was, or (signals, updates) one that ended, named by its status."""
        unknown = LoopStateError(
            f"{call}() of loop {loop_id}: no such loop (no workflow "
            f"{workflow_id(loop_id)!r})"
        )
        status: WorkflowExecutionStatus | None = None
        with anyio.move_on_after(math.inf if self.timeout is None else self.timeout):
            try:
                status = (await self.handle(loop_id).describe()).status
            except RPCError as exc:
                if exc.status is RPCStatusCode.NOT_FOUND:
                    return unknown
                raise
        if status is None:  # no description in time: the server's word alone
            if "already completed" in error.message:
                return self._ended(loop_id, call, None)
            return unknown
        if status is WorkflowExecutionStatus.RUNNING:
            return LoopStateError(f"{call}() of loop {loop_id}: {error.message}")
        return self._ended(loop_id, call, status)

    def _ended(
        self, loop_id: str, call: str, status: WorkflowExecutionStatus | None
    ) -> LoopStateError:
        name = "closed" if status is None else status.name
        return LoopStateError(
            f"{call}() of loop {loop_id}: the loop has ended (its workflow is {name})"
        )
