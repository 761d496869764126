"""What the runtime tells about a loop: its view while it runs, its result when done."""

from datetime import datetime
from enum import StrEnum
from typing import Any, Generic, NamedTuple, Self, final

from pydantic import BaseModel, ConfigDict
from typing_extensions import TypeVar  # (a default: Python 3.13's typing has it)

from ._models import read_fields_fast
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
    "OutputT",
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


OutputT = TypeVar("OutputT", default=Any)
"""What a loop answers with, `LoopResult.output`: `str` for a plain answer, the
`structured_output` model for a structured one. Type checkers infer it for an
agent: `Agent(...)` is an `Agent[str]`, `Agent(..., output_type=Person)` an
`Agent[Person]`, whose `run` returns a `LoopResult[Person]`. `Any` where
nothing says (`Runtime.wait`, a bare `Agent` annotation)."""


@final
class LoopResult(BaseModel, Generic[OutputT]):
    """How a loop ended: outcome, answer, totals and the path it took.

    Generic in its `output` for type checkers only: `Agent.run` of an
    `Agent[Person]` returns a `LoopResult[Person]`, whose `output` is a
    `Person | None`. The runtime builds plain `LoopResult`s; nothing is
    validated again.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    loop_id: str
    agent_id: str
    outcome: Outcome
    reason: str | None = None
    """Why it stopped, aborted, failed or was cancelled."""
    answer: ModelMessageItem | None = None
    """The published answer (outcome `answered`)."""
    output: OutputT | None = None
    """What the loop answered: the answer's text for a plain answer; with
    `structured_output`, the answer parsed (a model instance, or JSON data for
    a JSON schema), None if no answer passed it. None without an answer."""
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

    def raise_for_outcome(self) -> Self:
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


read_fields_fast(globals())
