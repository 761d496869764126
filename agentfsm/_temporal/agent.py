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
from agentfsm.inference import InferenceInput
from agentfsm.interception import InterceptionHandler
from agentfsm.messages import ModelContext
from agentfsm.options import LoopOptions
from agentfsm.tools import Tool

__all__ = ("LocalActivityHandler", "TemporalAgent", "agent_named", "local_activity")

_NAME: Final = re.compile(r"^[A-Za-z0-9_.-]+$")

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
            attempt times out; an `on_crash="pause"` tool is attempted once.
        tool_heartbeat: the tool activities' heartbeat timeout (the activity
            heartbeats while the tool runs; a CPU-bound tool run in the event
            loop's thread would starve it: tools run in a thread by default).
        no_timeout: the start-to-close timeout of an activity whose tool
            (or `inference_timeout`) has none: Temporal needs one.
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
    tool_heartbeat: timedelta | None = timedelta(seconds=30)
    no_timeout: timedelta = timedelta(hours=1)

    def __post_init__(self) -> None:
        if not _NAME.match(str(self.name)):
            raise ConfigurationError(
                f"TemporalAgent name must be letters, digits, '_', '.', '-', "
                f"got {self.name!r}"
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
