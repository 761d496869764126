"""`TemporalAgent`: what a loop workflow runs, registered by name in the
worker's process.

A workflow's input is data (the agent's name and the first message); the
agent's tools, handlers and options are Python objects, so the worker holds
them and the workflow looks its agent up by name here. This module is passed
through the workflow sandbox (agentfsm is), so the workflow and the worker
see the same registry.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

from temporalio.common import RetryPolicy

from agentfsm.events import AgentEvent
from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import ImageSupport, InferenceInput
from agentfsm.interception import InterceptionHandler
from agentfsm.messages import ModelContext
from agentfsm.options import LoopOptions
from agentfsm.tools import Tool

__all__ = (
    "ROUTED_WAIT",
    "LocalActivityHandler",
    "TemporalAgent",
    "ToolActivityOptions",
    "agent_named",
    "local_activity",
)

_NAME: Final = re.compile(r"^[A-Za-z0-9_.-]+$")

ROUTED_WAIT: Final = timedelta(minutes=5)
"""How long a call of a tool routed to a task queue of its own waits for a
worker of that queue to take it, by default (`ToolActivityOptions.
schedule_to_start_timeout`): with no worker polling the queue, the call ends
as an error output naming the queue instead of waiting for ever."""

_agents: dict[str, TemporalAgent] = {}


@dataclass(frozen=True, slots=True)
class LocalActivityHandler:
    """An interception handler that does I/O: the workflow runs it as a local
    activity (made by `local_activity`)."""

    handler: InterceptionHandler
    name: str
    timeout: timedelta


def local_activity(
    handler: InterceptionHandler | None = None,
    /,
    *,
    name: str | None = None,
    timeout: timedelta = timedelta(seconds=30),
) -> Any:
    """Mark an interception handler that does I/O (a database, a policy
    service): in a workflow it runs as a local activity, its decision recorded
    in the history, so a replay does not call it again.

    The handler sees the pending transition as data: a request payload (an
    `InferenceInput`, whose tools are objects) reaches it as `None`, and a
    `Rewrite` it returns may not carry one. Use as `@local_activity` or
    `local_activity(handler, name=..., timeout=...)`.
    """

    def mark(fn: InterceptionHandler) -> LocalActivityHandler:
        label = name or getattr(fn, "__name__", None)
        if not isinstance(label, str) or not _NAME.match(label):
            raise ConfigurationError(
                f"local_activity needs a name of letters, digits, '_', '.', '-' "
                f"for {fn!r}: pass name=..."
            )
        return LocalActivityHandler(fn, label, timeout)

    return mark if handler is None else mark(handler)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolActivityOptions:
    """How a tool's calls run as activities: given per tool name in
    `TemporalAgent(tool_options={...})`, or for every tool in
    `TemporalAgent(tool_defaults=...)`.

    A field left None takes `tool_defaults`' value, and then the default
    named below.

    Args:
        retry_policy: Temporal's retry policy of the tool's activity (it
            covers a lost worker and a timed-out attempt; a tool that raises
            is an error output, never retried). Default:
            `TemporalAgent.tool_attempts` attempts for an `on_crash="retry"`
            tool, one for an `on_crash="pause"` tool. `tool_defaults`' policy
            applies to the `on_crash="retry"` tools only; a pause tool given a
            policy of more than one attempt by name is refused (its calls must
            not run twice).
        task_queue: the task queue the activity is scheduled on, so that only
            the workers polling it run the tool (`worker(..., task_queue=...,
            workflows=False)` runs only such tools). Default: the loop's own
            queue, where its model calls run.
        heartbeat_timeout: opt in to heartbeats: the activity heartbeats
            every third of it while the tool runs, and Temporal ends an
            attempt not heard from within it (a lost worker is noticed this
            soon, and a cancelled loop's call is interrupted). Only for tools
            that leave their event loop free (sync tools run in a thread); an
            async tool that blocks it past this timeout has its attempt ended.
            Default: none, so an attempt is bounded by its start-to-close
            timeout only.
        start_to_close_timeout: one attempt's timeout. Default: the tool's
            `timeout`, or for a tool without one `TemporalAgent.no_timeout`
            (or `schedule_to_close_timeout`, if shorter).
        schedule_to_close_timeout: the timeout of all attempts together.
            Default: none.
        schedule_to_start_timeout: how long a call waits for a worker of its
            task queue to take it (Temporal does not retry it: the call never
            ran). When it lapses the model sees an error output naming the
            queue, whatever the tool's crash policy. Default: `ROUTED_WAIT`
            (5 minutes) for a tool routed to a `task_queue`, so that a queue
            no worker polls does not hold the loop for ever; none on the
            loop's own queue, whose workers run the loop itself.
    """

    retry_policy: RetryPolicy | None = None
    task_queue: str | None = None
    heartbeat_timeout: timedelta | None = None
    start_to_close_timeout: timedelta | None = None
    schedule_to_close_timeout: timedelta | None = None
    schedule_to_start_timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.retry_policy is not None:
            if not isinstance(self.retry_policy, RetryPolicy):
                raise ConfigurationError(
                    "ToolActivityOptions.retry_policy must be a "
                    f"temporalio.common.RetryPolicy, got {self.retry_policy!r}"
                )
            try:
                self.retry_policy._validate()
            except ValueError as exc:
                raise ConfigurationError(
                    f"ToolActivityOptions.retry_policy is invalid: {exc}"
                ) from exc
        queue: object = self.task_queue  # checked as what a caller may pass
        if queue is not None and not (isinstance(queue, str) and queue.strip()):
            raise ConfigurationError(
                "ToolActivityOptions.task_queue must be a non-empty str, "
                f"got {self.task_queue!r}"
            )
        for name in (
            "heartbeat_timeout",
            "start_to_close_timeout",
            "schedule_to_close_timeout",
            "schedule_to_start_timeout",
        ):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, timedelta) or value <= timedelta()
            ):
                raise ConfigurationError(
                    f"ToolActivityOptions.{name} must be a positive timedelta, "
                    f"got {value!r}"
                )

    def over(self, defaults: ToolActivityOptions) -> ToolActivityOptions:
        """These options, each field left None taken from `defaults`."""
        return ToolActivityOptions(
            retry_policy=self.retry_policy or defaults.retry_policy,
            task_queue=self.task_queue or defaults.task_queue,
            heartbeat_timeout=self.heartbeat_timeout or defaults.heartbeat_timeout,
            start_to_close_timeout=self.start_to_close_timeout
            or defaults.start_to_close_timeout,
            schedule_to_close_timeout=self.schedule_to_close_timeout
            or defaults.schedule_to_close_timeout,
            schedule_to_start_timeout=self.schedule_to_start_timeout
            or defaults.schedule_to_start_timeout,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TemporalAgent:
    """What one kind of loop runs as a Temporal workflow.

    Args:
        name: the agent's name, part of every activity's name
            (`agentfsm.<name>.infer`, `agentfsm.<name>.tool.<tool>`): activity
            names are compatibility data a running workflow depends on, so
            never rename an agent that has loops in flight.
        model: the `provider:model` the loop asks; the worker's `providers`
            serve it inside the inference activity.
        tools: the tools offered; each call's body runs as an activity.
        instructions: the system instructions of each loop's context.
        handlers: interception handlers, run in workflow code (so they must be
            deterministic), or marked with `local_activity` when they do I/O.
        options: the loop's options (`agentfsm.options.LoopOptions`);
            `inference_timeout` becomes the inference activity's
            start-to-close timeout instead of an in-workflow timer.
        settings: other `InferenceInput` fields (`temperature`,
            `tool_choice`, `streaming`, ...).
        subscribers: called with each event of the loop, in workflow code,
            and skipped while the workflow replays (so a side effect happens
            once per event, not once per replay).
        model_retry: Temporal's retry policy of the inference activity: it
            covers a lost worker or a timed-out attempt; a provider's own
            errors are retried by the loop (`max_retries`).
        model_heartbeat: the inference activity's heartbeat timeout (it
            heartbeats while the provider works, so a lost worker is noticed
            this soon).
        tool_attempts: how many times a tool whose crash policy is
            `on_crash="retry"` is attempted when its worker is lost or the
            attempt times out (unless its options give a retry policy); an
            `on_crash="pause"` tool is attempted once.
        tool_defaults: how every tool's calls run as activities (retry
            policy, task queue, heartbeat, timeouts): `ToolActivityOptions`.
            Default: no heartbeat, the loop's task queue, the retry policy of
            the tool's crash policy.
        tool_options: per tool name, `ToolActivityOptions` over
            `tool_defaults` (a field left None takes `tool_defaults`' value).
        no_timeout: the start-to-close timeout of an activity whose tool
            (or `inference_timeout`) has none: Temporal needs one.
        images: where the agent's model takes images (`agentfsm.inference.
            ImageSupport`; `NO_IMAGES` for a text-only model). Declared with
            the agent, so that workflow code decides alike on every worker and
            every replay: a start whose message holds an image the model cannot
            take fails the workflow (`ImageNotSupported`), a steer or follow-up
            holding one is dropped (`input.dropped`), and a handler's rewrite
            adding one fails the loop, in each case before anything is sent.
            Default None: the workflow takes every image, and the worker's
            provider refuses the request that holds one it cannot take.
    """

    name: str
    model: str
    tools: Sequence[Tool] = ()
    instructions: str | None = None
    handlers: Sequence[InterceptionHandler | LocalActivityHandler] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    settings: Mapping[str, Any] = field(default_factory=dict)
    subscribers: Sequence[Callable[[AgentEvent], object]] = ()
    model_retry: RetryPolicy = field(
        default_factory=lambda: RetryPolicy(maximum_attempts=3)
    )
    model_heartbeat: timedelta | None = timedelta(seconds=30)
    tool_attempts: int = 3
    tool_defaults: ToolActivityOptions = field(default_factory=ToolActivityOptions)
    tool_options: Mapping[str, ToolActivityOptions] = field(default_factory=dict)
    no_timeout: timedelta = timedelta(hours=1)
    images: ImageSupport | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(str(self.name)):
            raise ConfigurationError(
                f"TemporalAgent name must be letters, digits, '_', '.', '-', "
                f"got {self.name!r}"
            )
        if self.images is not None and not isinstance(self.images, ImageSupport):
            raise ConfigurationError(
                f"TemporalAgent {self.name!r}: images must be an "
                "agentfsm.inference.ImageSupport (NO_IMAGES for a text-only "
                f"model) or None, got {self.images!r}"
            )
        tools = tuple(self.tools)
        for t in tools:
            if not isinstance(t, Tool):
                raise ConfigurationError(
                    f"TemporalAgent {self.name!r}: tools must be Tools "
                    f"(decorate functions with @tool), got {t!r}"
                )
            if not _NAME.match(t.name):
                raise ConfigurationError(
                    f"TemporalAgent {self.name!r}: tool name {t.name!r} cannot be "
                    "part of an activity name (letters, digits, '_', '.', '-')"
                )
        if type(self.tool_attempts) is not int or self.tool_attempts < 1:
            raise ConfigurationError(
                f"tool_attempts must be an int >= 1, got {self.tool_attempts!r}"
            )
        object.__setattr__(self, "tools", tools)
        object.__setattr__(self, "handlers", tuple(self.handlers))
        self._check_tool_options()
        # Checked now, in the worker, not at a loop's start inside a workflow.
        LoopOptions.of(dict(self.options))  # type: ignore[arg-type]
        self.request(ModelContext())

    def request(self, context: ModelContext) -> InferenceInput:
        """A loop's request on `context` (a fresh one per loop: loops append)."""
        try:
            return InferenceInput(
                model=self.model,
                context=context.model_copy(update={"instructions": self.instructions})
                if self.instructions is not None
                else context,
                tools=self.tools,
                **dict(self.settings),
            )
        except ConfigurationError:
            raise
        except Exception as exc:
            raise ConfigurationError(
                f"TemporalAgent {self.name!r}: invalid model or settings: {exc}"
            ) from exc

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def activity_options(self, tool: Tool) -> ToolActivityOptions:
        """The options of `tool`'s activity, every default applied: a retry
        policy, a start-to-close timeout, a schedule-to-start timeout when it
        is routed; the task queue is None for the loop's own."""
        given = self.tool_options.get(tool.name)
        options = given.over(self.tool_defaults) if given else self.tool_defaults
        retry = given.retry_policy if given else None
        if retry is None and tool.on_crash == "retry":
            retry = self.tool_defaults.retry_policy or RetryPolicy(
                maximum_attempts=self.tool_attempts
            )
        if retry is None:  # on_crash="pause": the default policy is not for it
            retry = RetryPolicy(maximum_attempts=1)
        start_to_close = options.start_to_close_timeout
        if start_to_close is None and tool.timeout is not None:
            start_to_close = timedelta(seconds=tool.timeout)
        if start_to_close is None:  # Temporal needs one: `no_timeout`, in all
            start_to_close = min(
                self.no_timeout, options.schedule_to_close_timeout or self.no_timeout
            )
        waiting = options.schedule_to_start_timeout
        if waiting is None and options.task_queue is not None:
            waiting = ROUTED_WAIT
        return ToolActivityOptions(
            retry_policy=retry,
            task_queue=options.task_queue,
            heartbeat_timeout=options.heartbeat_timeout,
            start_to_close_timeout=start_to_close,
            schedule_to_close_timeout=options.schedule_to_close_timeout,
            schedule_to_start_timeout=waiting,
        )

    def _check_tool_options(self) -> None:
        if not isinstance(self.tool_defaults, ToolActivityOptions):
            raise ConfigurationError(
                f"TemporalAgent {self.name!r}: tool_defaults must be "
                f"ToolActivityOptions, got {self.tool_defaults!r}"
            )
        if not isinstance(self.tool_options, Mapping):
            raise ConfigurationError(
                f"TemporalAgent {self.name!r}: tool_options must map tool names "
                f"to ToolActivityOptions, got {self.tool_options!r}"
            )
        names = [t.name for t in self.tools]
        for name, options in self.tool_options.items():
            if name not in names:
                raise ConfigurationError(
                    f"TemporalAgent {self.name!r}: tool_options names {name!r}, "
                    f"which is not one of its tools ({', '.join(names) or 'none'})"
                )
            if not isinstance(options, ToolActivityOptions):
                raise ConfigurationError(
                    f"TemporalAgent {self.name!r}: tool_options[{name!r}] must be "
                    f"ToolActivityOptions, got {options!r}"
                )
        object.__setattr__(self, "tool_options", dict(self.tool_options))
        for t in self.tools:
            policy = self.activity_options(t).retry_policy
            assert policy is not None
            if t.on_crash == "pause" and policy.maximum_attempts != 1:
                # Only a policy given for this tool by name gets here.
                attempts = policy.maximum_attempts or "unlimited"
                raise ConfigurationError(
                    f"TemporalAgent {self.name!r}: tool {t.name!r} has "
                    f"on_crash='pause' (a lost call must not run again) but a "
                    f"retry policy of {attempts} attempts: give it "
                    "maximum_attempts=1, or make the tool on_crash='retry'"
                )


def register(agent: TemporalAgent) -> None:
    """Make `agent` the one workflows of its name run (in this process)."""
    _agents[agent.name] = agent


def agent_named(name: str) -> TemporalAgent:
    agent = _agents.get(name)
    if agent is None:
        known = ", ".join(sorted(_agents)) or "none"
        raise ConfigurationError(
            f"no TemporalAgent {name!r} on this worker (registered: {known}): "
            "pass it in agentfsm.temporal.worker(..., agents=[...])"
        )
    return agent
