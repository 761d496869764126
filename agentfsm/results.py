"""What the runtime tells about a loop: its view while it runs, its result when done."""

from datetime import datetime
from enum import StrEnum
from typing import Any, NamedTuple, final

from pydantic import BaseModel, ConfigDict

from .exceptions import LoopAborted, LoopFailedError
from .interception import PendingTransition
from .messages import ModelMessageItem, TokenUsage
from .states import LoopState, Outcome, Trigger

__all__ = (
    "ErrorInfo",
    "LoopFailedError",  # re-exported from agentfsm.exceptions, where it lives
    "LoopResult",
    "LoopStatus",
    "LoopView",
    "PathStep",
)


class LoopStatus(StrEnum):
    """Whether a loop is running, parked or finished."""

    running = "running"
    paused = "paused"
    done = "done"


class PathStep(NamedTuple):
    """One transition a loop took."""

    source: LoopState
    trigger: Trigger
    dest: LoopState
    rewritten_from: LoopState | None = None
    """The destination before a handler rewrote it, if one did."""


class ErrorInfo(BaseModel):
    """The error a loop failed with."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    type: str
    """The class name of the error."""
    message: str


@final
class LoopResult(BaseModel):
    """How a loop ended: outcome, answer, totals and the path it took."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    loop_id: str
    agent_id: str
    outcome: Outcome
    reason: str | None = None
    """Why it stopped, aborted, failed or was cancelled."""
    answer: ModelMessageItem | None = None
    """The published answer (outcome `answered`)."""
    output: Any = None
    """The answer parsed by `structured_output` (a model instance or JSON data)."""
    error: ErrorInfo | None = None
    """The error (outcome `failed`)."""
    usage: TokenUsage
    model_requests: int
    tool_calls: int
    path: tuple[PathStep, ...]
    started_at: datetime
    ended_at: datetime

    @property
    def states(self) -> tuple[LoopState, ...]:
        """The states visited, `idle` first and last."""
        return (LoopState.idle, *(step.dest for step in self.path))

    def raise_for_outcome(self) -> "LoopResult":
        """Return self if the loop answered or stopped; raise for the other outcomes.

        A cancelled loop raises `LoopAborted` (with its reason), never anyio's
        cancellation exception.

        Raises:
            LoopFailedError: the loop failed.
            LoopAborted: a handler aborted it, or it was cancelled.
        """
        if self.outcome is Outcome.failed and self.error is not None:
            raise LoopFailedError(self.loop_id, self.error, result=self)
        if self.outcome in (Outcome.aborted, Outcome.cancelled):
            raise LoopAborted(self.reason or self.outcome.value)
        return self


@final
class LoopView(BaseModel):
    """A snapshot of one loop, as `Runtime.get` returns it."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", arbitrary_types_allowed=True, defer_build=True
    )

    loop_id: str
    agent_id: str
    state: LoopState
    status: LoopStatus
    path: tuple[PathStep, ...]
    pending: PendingTransition | None = None
    """The transition a paused loop waits on."""
    pause_reason: str | None = None
    outcome: Outcome | None = None
    usage: TokenUsage
    model_requests: int
    tool_calls: int
    last_tools: tuple[str, ...] = ()
    """Names of the tools that ran in the last tool batch (for stop conditions)."""
