"""What the loop workflow sends out as activities: each model request
(`ActivityProvider`), each tool body (`ToolActivities`, the innermost tool
wrapper) and each handler marked `local_activity` (`local_handler`).

Each is awaited through `_run`, so that a cancelled loop leaves at once; the
workflow (`workflow.py`) plugs them into its unchanged `Runtime`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

from agentfsm._keys import idempotency_key
from agentfsm._replay.wire import request_data
from agentfsm.exceptions import ProviderError, ToolTimeout
from agentfsm.inference import InferenceInput, InferenceOutput, OutputCompleted
from agentfsm.interception import Decision, Pause, PendingTransition
from agentfsm.messages import ContextItem
from agentfsm.states import LoopState
from agentfsm.tools import ToolCall, ToolNext, ToolResult, _current_call

from .agent import LocalActivityHandler, TemporalAgent
from .wire import (
    CONTEXT_MISSING,
    InferArgs,
    InferResult,
    ToolArgs,
    ToolOutcome,
    chain_digest,
    dump,
)

if TYPE_CHECKING:
    from .workflow import LoopWorkflow

__all__ = ("ActivityProvider", "ToolActivities", "local_handler", "run_activity")

_decisions: TypeAdapter[Decision] = TypeAdapter(Decision)


async def run_activity(handle: Any) -> Any:
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


class ActivityProvider:
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
                raw = await run_activity(
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


class ToolActivities:
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
            raw = await run_activity(
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


def local_handler(
    agent: TemporalAgent, marked: LocalActivityHandler
) -> Callable[..., Any]:
    """A `local_activity` handler as the loop calls it: a local activity."""

    async def decide(pending: PendingTransition) -> Decision | None:
        sent = pending
        if isinstance(pending.payload, InferenceInput):
            sent = pending.model_copy(update={"payload": None})
        raw = await run_activity(
            workflow.start_local_activity(
                f"agentfsm.{agent.name}.handler.{marked.name}",
                sent.model_dump(mode="json", exclude={"metadata"}),
                start_to_close_timeout=marked.timeout,
            )
        )
        return None if raw is None else _decisions.validate_python(raw)

    decide.__qualname__ = decide.__name__ = marked.name
    return decide
