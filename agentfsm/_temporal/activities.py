"""The activities: each model request, each tool body, each I/O handler.

They run in the worker's ordinary event loop (not in workflow code), so they
may do anything: call the provider, run the tool, reach a database. Each
heartbeats while it works, so that a lost worker is noticed within the
heartbeat timeout and the attempt runs again on another worker.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import anyio
from pydantic import TypeAdapter
from temporalio import activity
from temporalio.exceptions import ApplicationError

from agentfsm._errors import error_text
from agentfsm._loop.intercept import call_handler
from agentfsm.events import ToolSpec
from agentfsm.exceptions import ProviderError
from agentfsm.inference import (
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    UsageUpdate,
)
from agentfsm.interception import Decision, PendingTransition
from agentfsm.messages import ContextItem, ModelContext
from agentfsm.providers import Provider, ProviderRegistry
from agentfsm.tools import (
    Tool,
    ToolCallContext,
    ToolDefinition,
    ToolResult,
    _current_call,
)

from .agent import LocalActivityHandler, TemporalAgent
from .contexts import StoreContexts
from .wire import (
    CONTEXT_MISSING,
    ErrorData,
    InferArgs,
    InferResult,
    ToolArgs,
    ToolOutcome,
    dump,
)

__all__ = (
    "Chunk",
    "ContextStore",
    "MemoryContextStore",
    "activities_for",
)

T = TypeVar("T")


class ContextStore(Protocol):
    """Where inference activities keep each loop's context between requests,
    so that a request carries only the items added since the last one.

    A store every worker reads (a database) saves the one request per worker
    that otherwise sends its loop's whole context; either way a miss is only
    slower, never wrong: a prefix is used only when its digest matches.
    """

    async def get(self, loop_id: str) -> tuple[list[ContextItem], list[str]] | None:
        """The items held for the loop and the chain digest after each."""
        ...

    async def put(
        self, loop_id: str, items: list[ContextItem], digests: list[str]
    ) -> None:
        """Hold `items` (and their digests) as the loop's context."""
        ...


class MemoryContextStore:
    """A `ContextStore` in the worker's memory, the most recent `max_loops`
    loops. A request that lands on another worker (or after a restart) misses,
    and the workflow sends that request's whole context once."""

    def __init__(self, max_loops: int = 1_000) -> None:
        self.max_loops = max_loops
        self._loops: OrderedDict[str, tuple[list[ContextItem], list[str]]] = (
            OrderedDict()
        )
        self.misses = 0
        """How many requests referred to a prefix this store did not hold."""

    async def get(self, loop_id: str) -> tuple[list[ContextItem], list[str]] | None:
        entry = self._loops.get(loop_id)
        if entry is not None:
            self._loops.move_to_end(loop_id)
        return entry

    async def put(
        self, loop_id: str, items: list[ContextItem], digests: list[str]
    ) -> None:
        self._loops[loop_id] = (items, digests)
        self._loops.move_to_end(loop_id)
        while len(self._loops) > self.max_loops:
            self._loops.popitem(last=False)


class Chunk(Protocol):
    """Called with each streamed delta of a model request, in the activity.

    `attempt` is the activity's attempt number: a retried request streams its
    chunks again, from index 0, with a higher attempt.
    """

    def __call__(
        self, loop_id: str, request: int, attempt: int, index: int, delta: Any
    ) -> object: ...


def _spec_tool(spec: ToolSpec) -> Tool:
    """A stand-in `Tool` that only describes itself: what a provider reads
    (the model sees its name, description and schema). Its body never runs
    here; the workflow runs calls as their own activities."""
    stand_in: Tool = object.__new__(Tool)
    stand_in._describe(
        ToolDefinition(
            name=spec.name, description=spec.description, parameters=spec.parameters
        ),
        _never_here,
        timeout=spec.timeout,
        needs_approval=False,
        execution_mode=spec.execution_mode,
        awaits=False,
    )
    return stand_in


async def _never_here(**arguments: Any) -> Any:
    raise AssertionError("a stand-in tool never runs in the activity")


async def _context(args: InferArgs, store: ContextStore) -> list[ContextItem]:
    """The request's whole context: the prefix the store holds, then the
    items sent; refused (the workflow then sends the whole context) when the
    store does not hold that prefix."""
    if args.base == 0:
        items, digests = list(args.items), list(args.digests)
    else:
        held = await store.get(args.loop_id)
        if (
            held is None
            or len(held[1]) < args.base
            or held[1][args.base - 1] != args.base_digest
        ):
            if isinstance(store, MemoryContextStore | StoreContexts):
                store.misses += 1
            raise ApplicationError(
                f"loop {args.loop_id}: this worker's context store does not hold "
                f"the request's first {args.base} items",
                type=CONTEXT_MISSING,
                non_retryable=True,
            )
        items = held[0][: args.base] + list(args.items)
        digests = held[1][: args.base] + list(args.digests)
    await store.put(args.loop_id, items, digests)
    return items


async def _heartbeating(work: Awaitable[T], every: float | None) -> T:
    """Await `work`, heartbeating every `every` seconds meanwhile (a
    cancellation of the activity, which Temporal delivers with a heartbeat's
    answer, cancels `work`)."""
    if every is None:
        return await work
    outcome: list[T] = []
    failure: list[BaseException] = []

    async def run() -> None:
        try:
            outcome.append(await work)
        except Exception as exc:  # noqa: BLE001 - re-raised below, not as a group
            failure.append(exc)
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while True:
            await anyio.sleep(every)
            activity.heartbeat()
    if failure:
        raise failure[0]
    return outcome[0]


def _beat(timeout: timedelta | None) -> float | None:
    return None if timeout is None else max(timeout.total_seconds() / 3, 0.05)


def activities_for(
    agents: Mapping[str, TemporalAgent],
    providers: ProviderRegistry,
    store: ContextStore,
    on_chunk: Chunk | None,
) -> list[Callable[..., Any]]:
    """Every activity the agents' workflows call, named after the agent."""
    found: list[Callable[..., Any]] = []
    for agent in agents.values():
        found.append(_infer(agent, providers, store, on_chunk))
        found.extend(_tool(agent, t) for t in agent.tools)
        found.extend(
            _handler(agent, h)
            for h in agent.handlers
            if isinstance(h, LocalActivityHandler)
        )
    return found


def _infer(
    agent: TemporalAgent,
    providers: ProviderRegistry,
    store: ContextStore,
    on_chunk: Chunk | None,
) -> Callable[..., Any]:
    every = _beat(agent.model_heartbeat)

    async def infer(data: dict[str, Any]) -> dict[str, Any]:
        args = InferArgs.model_validate(data)
        request = InferenceInput(
            model=args.model,
            context=ModelContext(
                instructions=args.instructions, items=await _context(args, store)
            ),
            tools=tuple(_spec_tool(s) for s in args.tools),
            structured_output=args.structured_output,
            streaming=args.streaming,
            **args.settings,  # type: ignore[arg-type]
        )
        try:
            provider = providers.resolve(args.model)
            if args.streaming:
                work = _stream(provider, request, args, on_chunk)
            else:
                work = provider.complete(request)
            output = await _heartbeating(work, every)
        except ProviderError as exc:
            error = ErrorData(
                type=type(exc).__name__,
                message=error_text(exc),
                retryable=exc.retryable,
                status_code=exc.status_code,
            )
            return dump(InferResult(error=error))
        return dump(InferResult(output=output))

    return activity.defn(name=f"agentfsm.{agent.name}.infer")(infer)


async def _stream(
    provider: Provider,
    request: InferenceInput,
    args: InferArgs,
    on_chunk: Chunk | None,
) -> InferenceOutput:
    """Consume the stream here, in the activity: its chunks go to `on_chunk`
    (with the attempt number), only the output goes back to the workflow."""
    attempt = activity.info().attempt
    output: InferenceOutput | None = None
    index = 0
    async with provider.stream(request) as deltas:
        async for delta in deltas:
            if isinstance(delta, OutputCompleted):
                output = delta.output
                continue
            if isinstance(delta, UsageUpdate):
                continue  # a chunk's usage is the output's, sent back whole
            if on_chunk is not None:
                on_chunk(args.loop_id, args.request, attempt, index, delta)
            index += 1
    if output is None:
        raise ProviderError(
            f"the stream from {args.model!r} ended without a completed output"
        )
    return output


def _tool(agent: TemporalAgent, tool: Tool) -> Callable[..., Any]:
    every = _beat(agent.tool_heartbeat)
    # The tool's timeout is the activity's start-to-close timeout (Temporal
    # ends the attempt, and retries it by the tool's crash policy): the copy
    # run here has none of its own, which would end the call first, as an
    # error output that no retry policy sees.
    tool = copy.copy(tool)
    tool.timeout = None

    async def run(data: dict[str, Any]) -> dict[str, Any]:
        args = ToolArgs.model_validate(data)
        # What `agentfsm.current_call()` says in the tool, as in a process:
        # the loop's call, its idempotency key (progress reports are dropped:
        # the loop is in the workflow).
        running = ToolCallContext(
            args.loop_id,
            args.agent_id,
            args.call_id,
            args.name,
            args.request,
            args.position,
            args.arguments,
            args.idempotency_key,
        )
        token = _current_call.set(running)
        returned = False
        try:
            result = await _heartbeating(tool.invoke(args.arguments), every)
            returned = True
        except Exception as exc:  # noqa: BLE001 - a raising tool is an error output
            returned = True
            result = ToolResult.error(
                f"tool {args.name!r} raised {type(exc).__name__}: {error_text(exc)}"
            )
        finally:
            if not returned:  # cancelled: a sync tool's thread may run on
                running._interrupt()
            _current_call.reset(token)
        return dump(
            ToolOutcome(
                output=result.output,
                is_error=result.is_error,
                terminate=result.terminate,
            )
        )

    return activity.defn(name=f"agentfsm.{agent.name}.tool.{tool.name}")(run)


_decisions: TypeAdapter[Decision] = TypeAdapter(Decision)


def _handler(agent: TemporalAgent, marked: LocalActivityHandler) -> Callable[..., Any]:
    async def decide(data: dict[str, Any]) -> dict[str, Any] | None:
        pending = PendingTransition.model_validate(data)
        decision = await call_handler(marked.handler, pending)
        if decision is None:
            return None
        dumped: dict[str, Any] = _decisions.dump_python(decision, mode="json")
        return dumped

    return activity.defn(name=f"agentfsm.{agent.name}.handler.{marked.name}")(decide)
