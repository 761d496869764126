"""`LoopClient`: loops on Temporal, driven like `Runtime`'s loops.

```python
loops = LoopClient(client, task_queue="agents")
loop_id = await loops.start("calc", "what is 2+3?")   # returns once the workflow exists
await loops.steer(loop_id, "use integers")
result = await loops.wait(loop_id)                    # a LoopResult
```

A loop's workflow id is `agentfsm/<loop_id>`. Signals (steer, follow_up,
cancel) return once the server has them; updates (resume, approve) once the
workflow accepted and applied them, and raise `LoopStateError` when its
validator refused them (the loop is not paused; stale call ids).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from pydantic import TypeAdapter
from temporalio.client import (
    Client,
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
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from agentfsm._runtime.ids import uuid7
from agentfsm.exceptions import ConfigurationError, LoopStateError
from agentfsm.interception import Decision
from agentfsm.messages import UserMessage
from agentfsm.results import LoopResult, LoopView

from .wire import StartLoop, dump
from .workflow import STATE_ATTRIBUTE, WORKFLOW_NAME

__all__ = ("LoopClient", "workflow_id")

_decisions: TypeAdapter[Decision] = TypeAdapter(Decision)


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


class LoopClient:
    """Starts and drives loop workflows on a Temporal client.

    Args:
        client: a connected `temporalio.client.Client`.
        task_queue: the queue the workers of `agentfsm.temporal.worker` poll.
        state_attribute: start each workflow with the `AgentFsmState` search
            attribute, which the workflow keeps current (the namespace must
            have it registered, as a Keyword: `temporal operator
            search-attribute create --name AgentFsmState --type Keyword`).
        execution_timeout: the longest a loop's workflow may run, pauses
            included (default: no limit; a loop's `deadline` is its own).
    """

    def __init__(
        self,
        client: Client,
        *,
        task_queue: str,
        state_attribute: bool = False,
        execution_timeout: timedelta | None = None,
    ) -> None:
        if not isinstance(client, Client):
            raise ConfigurationError(
                f"LoopClient needs a temporalio Client, got {type(client).__name__}"
            )
        self.client = client
        self.task_queue = task_queue
        self.state_attribute = state_attribute
        self.execution_timeout = execution_timeout

    def handle(self, loop_id: str) -> WorkflowHandle[Any, Any]:
        """The Temporal handle of a loop's workflow."""
        return self.client.get_workflow_handle(workflow_id(loop_id))

    async def start(
        self,
        agent: str,
        message: UserMessage | str | None,
        *,
        loop_id: str | None = None,
        agent_id: str | None = None,
    ) -> str:
        """Start a loop of `agent` (a `TemporalAgent`'s name) and return its id
        as soon as its workflow exists (the loop runs on the workers).

        With a `loop_id` given, starting it again attaches to the running
        loop instead of starting another (start-or-attach).
        """
        if message is not None and not isinstance(message, str | UserMessage):
            raise ConfigurationError(
                "start() takes a str, a UserMessage or None, got "
                f"{type(message).__name__}"
            )
        loop_id = loop_id or uuid7()
        start = StartLoop(
            agent=agent,
            loop_id=loop_id,
            message=UserMessage(content=message)
            if isinstance(message, str)
            else message,
            agent_id=agent_id,
        )
        attributes = (
            TypedSearchAttributes(
                [SearchAttributePair(STATE_ATTRIBUTE, "running:idle")]
            )
            if self.state_attribute
            else None
        )
        # The loop ended already (its id is taken): `wait` gives its result.
        with contextlib.suppress(WorkflowAlreadyStartedError):
            await self.client.start_workflow(
                WORKFLOW_NAME,
                dump(start),
                id=workflow_id(loop_id),
                task_queue=self.task_queue,
                # Start-or-attach, for a running loop and for an ended one: a
                # loop id names one loop, never a second run of another.
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                execution_timeout=self.execution_timeout,
                search_attributes=attributes,
            )
        return loop_id

    async def wait(self, loop_id: str) -> LoopResult:
        """Wait for the loop to end; its result, whatever its outcome."""
        try:
            data = await self.handle(loop_id).result()
        except WorkflowFailureError as exc:
            cause = exc.cause
            if (
                isinstance(cause, ApplicationError)
                and cause.type == "ConfigurationError"
            ):
                raise ConfigurationError(cause.message) from exc
            raise
        return LoopResult.model_validate(data)

    async def get(self, loop_id: str) -> LoopView:
        """The loop's view (a query): state, status, pending transition, totals."""
        try:
            data = await self.handle(loop_id).query("view")
        except WorkflowQueryFailedError as exc:
            raise LoopStateError(f"loop {loop_id}: {exc.message}") from exc
        return LoopView.model_validate(data)

    async def steer(self, loop_id: str, message: UserMessage | str) -> None:
        """Queue a steering message (a signal)."""
        await self.handle(loop_id).signal("steer", _message(message, "steer"))

    async def follow_up(self, loop_id: str, message: UserMessage | str) -> None:
        """Queue a follow-up (a signal)."""
        await self.handle(loop_id).signal("follow_up", _message(message, "follow_up"))

    async def cancel(self, loop_id: str, reason: str | None = None) -> None:
        """Cancel the loop (a signal); it ends `cancelled`."""
        await self.handle(loop_id).signal("cancel", reason)

    async def resume(self, loop_id: str, decision: Decision | None = None) -> LoopView:
        """Resume the paused loop with `decision` (an update).

        Raises:
            LoopStateError: the loop is not paused (the update was refused).
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
            LoopStateError: the loop is not paused before that batch (the call
                ids are stale, or some are left out).
        """
        return await self._update(
            loop_id, "approve", [list(call_ids), dict(denied or {})]
        )

    async def _update(self, loop_id: str, name: str, args: list[Any]) -> LoopView:
        try:
            data = await self.handle(loop_id).execute_update(name, args=args)
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            raise LoopStateError(
                f"{name} of loop {loop_id} was refused: {getattr(cause, 'message', cause)}"
            ) from exc
        except RPCError as exc:
            if exc.status is not RPCStatusCode.NOT_FOUND:
                raise
            raise LoopStateError(
                f"{name} of loop {loop_id} was refused: the loop has ended "
                f"(or never existed): {exc.message}"
            ) from exc
        return LoopView.model_validate(data)
