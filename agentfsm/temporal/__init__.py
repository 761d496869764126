"""A loop as a durable Temporal workflow (`pip install agentfsm[temporal]`).

One loop is one workflow: agentfsm's machine (the unchanged `Runtime`) runs in
workflow code, each model request and each tool body runs as an activity, and
the loop survives its workers: a worker killed mid tool call is replaced, and
the loop goes on from its history without running completed calls again.

```python
from agentfsm.temporal import LoopClient, TemporalAgent, worker

calc = TemporalAgent(name="calc", model="openai:gpt-4.1-mini", tools=[add])

async with worker(client, task_queue="agents", agents=[calc]):
    loops = LoopClient(client, task_queue="agents")
    loop_id = await loops.start("calc", "what is 2+3?")
    result = await loops.wait(loop_id)
```

See [Loops on Temporal][loops-on-temporal] for the mapping (signals, updates, the query, the
search attribute, streaming, the context passed by reference).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Final

try:
    import temporalio  # noqa: F401 - only to say which extra is missing
except ImportError as exc:
    raise ImportError(
        "agentfsm.temporal needs the Temporal SDK: pip install 'agentfsm[temporal]'"
    ) from exc

# Imported eagerly, here and not inside the sandbox: anyio imports its asyncio
# backend lazily, at first use, and doing that inside a workflow trips the
# sandbox's restriction on `threading` (pydantic-ai does the same).
import anyio._backends._asyncio  # noqa: F401
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker, WorkflowRunner
from temporalio.worker.workflow_sandbox import (
    SandboxedWorkflowRunner,
    SandboxRestrictions,
)

from agentfsm.exceptions import ConfigurationError
from agentfsm.providers import Provider, ProviderRegistry
from agentfsm.temporal._activities import (
    Chunk,
    ContextStore,
    MemoryContextStore,
    SharedContextStore,
    activities_for,
)
from agentfsm.temporal._agent import (
    LocalActivityHandler,
    TemporalAgent,
    ToolActivityOptions,
    local_activity,
    register,
)
from agentfsm.temporal._client import LoopClient, workflow_id
from agentfsm.temporal._contexts import StoreContexts
from agentfsm.temporal._wire import IMAGE_MISSING, MAX_PAYLOAD, ToolArgs
from agentfsm.temporal._workflow import (
    AGENT_ATTRIBUTE,
    BAD_START,
    BAD_UPDATE,
    FAILURE_EXCEPTION_TYPES,
    IMAGE_NOT_SUPPORTED,
    LOOP_FAILED,
    OUTCOME_ATTRIBUTE,
    OUTCOME_MEMO,
    RESULT_MEMO,
    STATE_ATTRIBUTE,
    WORKFLOW_NAME,
    LoopWorkflow,
)

__all__ = (
    "AGENT_ATTRIBUTE",
    "BAD_START",
    "BAD_UPDATE",
    "FAILURE_EXCEPTION_TYPES",
    "IMAGE_MISSING",
    "IMAGE_NOT_SUPPORTED",
    "LOOP_FAILED",
    "MAX_GRACEFUL_SHUTDOWN",
    "MAX_PAYLOAD",
    "OUTCOME_ATTRIBUTE",
    "OUTCOME_MEMO",
    "PASSTHROUGH_MODULES",
    "RESULT_MEMO",
    "STATE_ATTRIBUTE",
    "WORKFLOW_NAME",
    "Chunk",
    "ContextStore",
    "LocalActivityHandler",
    "LoopClient",
    "LoopWorkflow",
    "MemoryContextStore",
    "SharedContextStore",
    "StoreContexts",
    "TemporalAgent",
    "ToolActivityOptions",
    "ToolArgs",
    "drop_replayed_logs",
    "local_activity",
    "worker",
    "workflow_id",
    "workflow_runner",
)

PASSTHROUGH_MODULES = (
    "agentfsm",
    "anyio",
    "sniffio",
    "structlog",
    "transitions",
    "jsonschema",
    "griffe",
    "pydantic",
    "pydantic_core",
)
"""The modules the sandbox imports once, from outside, instead of again for
each workflow: agentfsm and what it imports (their module-level state is
data, not per-workflow state)."""


MAX_GRACEFUL_SHUTDOWN: Final = timedelta(minutes=5)
"""The longest graceful shutdown `worker()` sets by itself: a worker being
stopped waits at most this long for its running activities, even for a tool
without a timeout (pass `graceful_shutdown_timeout=` for another)."""


def workflow_runner(*, sandboxed: bool = True) -> WorkflowRunner:
    """The workflow runner loop workflows need: Temporal's sandbox with
    agentfsm and its dependencies passed through, or no sandbox (faster,
    without the sandbox's checks against non-determinism in user code)."""
    if not sandboxed:
        return UnsandboxedWorkflowRunner()
    restrictions = SandboxRestrictions.default.with_passthrough_modules(
        *PASSTHROUGH_MODULES
    )
    return SandboxedWorkflowRunner(restrictions=restrictions)


def worker(
    client: Client,
    *,
    task_queue: str,
    agents: Sequence[TemporalAgent],
    providers: Mapping[str, Provider] | ProviderRegistry | None = None,
    context_store: ContextStore | None = None,
    on_chunk: Chunk | None = None,
    sandboxed: bool = True,
    workflows: bool = True,
    **options: Any,
) -> Worker:
    """A Temporal worker that runs the agents' loop workflows and activities.

    Use it as `async with worker(...):` (or `await w.run()`).

    A worker being stopped (`shutdown()`, leaving the `async with`: every
    deploy) stops taking tasks and waits for its running activities before it
    cancels them: as long as the longest start-to-close timeout among the
    activities it runs (the tools' and the model calls'), at most
    `MAX_GRACEFUL_SHUTDOWN`. A tool call that ends within it completes, and
    its loop goes on on another worker: no `on_crash="pause"` call is lost to
    a deploy. Give your platform's stop grace period (Kubernetes'
    `terminationGracePeriodSeconds`) more than that.

    Args:
        client: a connected Temporal client.
        task_queue: the queue to poll (the `LoopClient`'s, or, with
            `workflows=False`, the queue some tools are routed to).
        agents: the agents whose loops this worker runs (registered by name
            in this process: the workflow looks its agent up).
        providers: serve the agents' models inside the inference activity
            (`prefix -> provider`, as `Runtime(providers=)`).
        context_store: where inference activities keep each loop's context
            between requests (default: a `MemoryContextStore` per worker;
            `StoreContexts(store)` keeps it in a durable store every worker
            reads, so that no request after the first carries the whole
            context, whichever worker runs it, and images go by reference
            (`ImageBlock.as_reference`), their bytes kept once).
        on_chunk: called with each streamed delta of a streaming request, in
            the activity, with the attempt number.
        sandboxed: run workflows in Temporal's sandbox (see `workflow_runner`).
        workflows: run the loop workflows, their model calls, their
            `local_activity` handlers and the tools on their queue. False: a
            worker of activities only, which runs the tools routed to
            `task_queue` (`ToolActivityOptions(task_queue=...)`) and nothing
            else, for tools that need a machine of their own (a GPU, a
            network zone).
        **options: passed to `temporalio.worker.Worker` (tuning:
            `max_concurrent_activities`, `sticky_queue_schedule_to_start_timeout`,
            `graceful_shutdown_timeout` instead of the one set here, ...).

    Raises:
        ConfigurationError: no agents, or two of one name; with
            `workflows=False`, no tool routed to `task_queue`.
    """
    agents = tuple(agents)
    if not agents:
        raise ConfigurationError("worker() needs at least one TemporalAgent")
    named: dict[str, TemporalAgent] = {}
    for agent in agents:
        if not isinstance(agent, TemporalAgent):
            raise ConfigurationError(
                f"worker() takes TemporalAgents, got {type(agent).__name__}"
            )
        if agent.name in named:
            raise ConfigurationError(f"two agents named {agent.name!r}")
        named[agent.name] = agent
    for agent in agents:
        register(agent)
    registry = (
        providers
        if isinstance(providers, ProviderRegistry)
        else ProviderRegistry(providers)
    )
    activities = activities_for(
        named,
        registry,
        context_store or MemoryContextStore(),
        on_chunk,
        task_queue=task_queue,
        workflows=workflows,
    )
    if not workflows and not activities:
        routed = sorted(
            {
                queue
                for agent in agents
                for t in agent.tools
                if (queue := agent.activity_options(t).task_queue) is not None
            }
        )
        raise ConfigurationError(
            f"worker(workflows=False) on task queue {task_queue!r} would run "
            "nothing: no tool of these agents is routed to it (tools are "
            f"routed to: {', '.join(map(repr, routed)) or 'no queue'})"
        )
    options.setdefault(
        "graceful_shutdown_timeout", _graceful_shutdown(agents, task_queue, workflows)
    )
    if workflows:
        options.setdefault("workflow_runner", workflow_runner(sandboxed=sandboxed))
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[LoopWorkflow] if workflows else [],
        activities=activities,
        **options,
    )


def _graceful_shutdown(
    agents: Sequence[TemporalAgent], task_queue: str, workflows: bool
) -> timedelta:
    """The longest attempt of the activities a worker runs, at most
    `MAX_GRACEFUL_SHUTDOWN`: what a stopping worker waits for before it
    cancels the activities still running."""
    longest = timedelta()
    for agent in agents:
        if workflows:
            timeout = agent.options.get("inference_timeout")
            longest = max(
                longest,
                agent.no_timeout if timeout is None else timedelta(seconds=timeout),
            )
        for t in agent.tools:
            options = agent.activity_options(t)
            if options.task_queue not in (None, task_queue) or (
                options.task_queue is None and not workflows
            ):
                continue  # another worker runs it
            attempt = options.start_to_close_timeout
            assert attempt is not None  # activity_options always sets one
            longest = max(longest, attempt)
    return min(longest, MAX_GRACEFUL_SHUTDOWN)


def drop_replayed_logs(logger: object, method: str, event_dict: Any) -> Any:
    """A structlog processor that drops what workflow code logs while the
    workflow replays (it was logged on the first run): add it to
    `structlog.configure(processors=[...])` ahead of the renderer."""
    import structlog
    from temporalio import workflow

    try:
        replaying = workflow.unsafe.is_replaying()
    except Exception:  # noqa: BLE001 - not in workflow code
        return event_dict
    if replaying:
        raise structlog.DropEvent
    return event_dict
