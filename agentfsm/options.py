"""Per-loop options: limits, stop conditions, tool execution, wrappers, queues, retries.

`Runtime.run_loop(..., **options)` takes these as keyword arguments; they are
checked when the loop starts, so a bad value fails `run_loop` itself.

Example:
    ```python
    runtime.run_loop(
        "agent", "go", inference_input,
        max_turns=8,
        stop_when=[tool_called("submit")],
        tool_execution="parallel",
        max_tool_concurrency=4,
    )
    ```
"""

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias, TypedDict

from pydantic import BaseModel, ConfigDict

from ._arguments import ArgumentTypeError, seconds, seconds_or_none
from ._models import read_fields_fast
from .exceptions import ConfigurationError
from .inference import InferenceOutput, ModelWrapper
from .messages import ContextItem, FunctionCallOutputItem
from .results import LoopView
from .tools import ToolWrapper

__all__ = (
    "DEFAULT_MAX_CHARS",
    "DEFAULT_MAX_OUTPUT_CALLS",
    "DEFAULT_MAX_STREAM_SECONDS",
    "DEFAULT_MAX_TURNS",
    "MAX_TURNS_CAP",
    "FinishTurn",
    "LoopOptions",
    "LoopOptionsDict",
    "QueueMode",
    "StopCondition",
    "TurnSnapshot",
    "after_turns",
    "tool_called",
)

DEFAULT_MAX_TURNS: Final = 50
"""Model requests a loop may make unless `max_turns` says otherwise."""
MAX_TURNS_CAP: Final = 10_000
"""The most `max_turns` may be."""

DEFAULT_MAX_OUTPUT_CALLS: Final = 128
"""Function calls one model output may hold unless `max_output_calls` says otherwise."""
DEFAULT_MAX_CHARS: Final = 10_000_000
"""Characters one model output, or one tool output, may hold by default
(`max_output_chars`, `max_tool_output_chars`): ~10 MB of ASCII, far beyond
any context window, well within memory."""
DEFAULT_MAX_STREAM_SECONDS: Final = 1800.0
"""Seconds one streamed model request may take by default (`max_stream_seconds`):
long enough for the slowest reasoning model, short enough that a server
trickling bytes cannot hold a loop forever."""

QueueMode: TypeAlias = Literal["all", "one-at-a-time"]
"""How a steering or follow-up queue drains: everything queued, or one message per turn."""

StopCondition: TypeAlias = Callable[[LoopView], bool | str | None]
"""Checked after each turn; a true value (a string is the reason) stops the loop."""


class TurnSnapshot(BaseModel):
    """What `finish_turn` receives after each complete turn: an isolated copy."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    loop_id: str
    agent_id: str
    turn: int
    """The number of model requests made so far."""
    output: InferenceOutput
    """The model's output in this turn."""
    tool_outputs: tuple[FunctionCallOutputItem, ...]
    """The outputs of this turn's tool calls, in the model's order."""
    context: tuple[ContextItem, ...]
    """The context after the turn (a copy: changing the loop's context later
    does not change it)."""


FinishTurn: TypeAlias = Callable[[TurnSnapshot], Awaitable[None] | None]
"""Awaited after each complete turn; if it raises, the loop fails."""


def after_turns(turns: int) -> StopCondition:
    """Stop once the loop has made `turns` model requests (reason `turn_count`)."""

    def condition(view: LoopView) -> str | None:
        return "turn_count" if view.model_requests >= turns else None

    return condition


def tool_called(name: str) -> StopCondition:
    """Stop after a turn in which the tool `name` ran (reason `tool_called:<name>`)."""

    def condition(view: LoopView) -> str | None:
        return f"tool_called:{name}" if name in view.last_tools else None

    return condition


class LoopOptionsDict(TypedDict, total=False):
    """The keyword options of `run_loop` (see `LoopOptions`)."""

    max_turns: int
    stop_when: Sequence[StopCondition]
    tool_execution: Literal["sequential", "parallel"]
    max_tool_concurrency: int
    tool_wrappers: Sequence[ToolWrapper]
    model_wrappers: Sequence[ModelWrapper]
    steering_mode: QueueMode
    follow_up_mode: QueueMode
    inference_timeout: float | None
    deadline: float | None
    max_retries: int
    retry_backoff: float
    structured_output_retries: int
    finish_turn: FinishTurn | None
    max_output_calls: int
    max_output_chars: int
    max_stream_seconds: float | None
    max_tool_output_chars: int


@dataclass(frozen=True, slots=True, kw_only=True, weakref_slot=True)
class LoopOptions:
    """How one loop runs.

    Attributes:
        max_turns: the most model requests (tool runs do not count), whatever
            edge led to them; reaching it lets the requested tools finish, then
            ends the loop `stopped` (reason `max_turns`) without consuming
            queued messages. It is a hard limit: a handler that takes the loop
            on to another request fails it with `TurnLimitExceeded` (a stop
            condition is the limit a handler may lift).
        stop_when: conditions checked after each turn; the first that holds
            ends the loop `stopped` with its reason.
        tool_execution: run a batch's calls one by one, or concurrently. In
            parallel mode each of up to `max_tool_concurrency` tasks takes the
            batch's next call as it ends one; a batch whose calls cannot wait
            (async tools without an `await`, sync tools run in the loop's
            thread; no tool wrappers, no store) runs them one by one in the
            loop's task, as its tasks would.
        max_tool_concurrency: the most calls running at once in parallel mode.
        tool_wrappers: `(call, next)` wrappers around each tool call, outermost first.
        model_wrappers: `(request, next)` wrappers around each model request.
        steering_mode / follow_up_mode: how the queues drain.
        inference_timeout: seconds one model request may take (retried as transient;
            default: the provider's own timeout).
        deadline: seconds the whole loop may take, pauses included.
        max_retries: retries of a transient model error (rate limit, timeout, 5xx).
        retry_backoff: seconds before the first retry; doubled each time (capped at 8 s).
        structured_output_retries: how often an answer that fails `structured_output`
            goes back to the model before the loop fails.
        finish_turn: awaited after each complete turn with a `TurnSnapshot`.
        max_output_calls: the most function calls one model output may hold;
            more fail the loop (`OutputLimitExceeded`).
        max_output_chars: the most characters one model output may hold, its
            items together (a stream's chunks are counted as they come); more
            fail the loop (`OutputLimitExceeded`). Characters, not bytes:
            counting them costs nothing.
        max_stream_seconds: the longest one streamed model request may take
            (None: no bound); longer fails the loop (`OutputLimitExceeded`).
        max_tool_output_chars: the most characters one tool output may hold;
            a longer one reaches the model as an error output saying so (the
            call ran; its output is not kept).
    """

    max_turns: int = DEFAULT_MAX_TURNS
    stop_when: tuple[StopCondition, ...] = ()
    tool_execution: Literal["sequential", "parallel"] = "sequential"
    max_tool_concurrency: int = 8
    tool_wrappers: tuple[ToolWrapper, ...] = ()
    model_wrappers: tuple[ModelWrapper, ...] = ()
    steering_mode: QueueMode = "all"
    follow_up_mode: QueueMode = "all"
    inference_timeout: float | None = None
    deadline: float | None = None
    max_retries: int = 2
    retry_backoff: float = 0.5
    structured_output_retries: int = 2
    finish_turn: FinishTurn | None = field(default=None)
    max_output_calls: int = DEFAULT_MAX_OUTPUT_CALLS
    max_output_chars: int = DEFAULT_MAX_CHARS
    max_stream_seconds: float | None = DEFAULT_MAX_STREAM_SECONDS
    max_tool_output_chars: int = DEFAULT_MAX_CHARS

    def __post_init__(self) -> None:
        self._check_types()
        if not 1 <= self.max_turns <= MAX_TURNS_CAP:
            raise ConfigurationError(
                f"max_turns must be in 1..{MAX_TURNS_CAP}, got {self.max_turns}"
            )
        if self.tool_execution not in ("sequential", "parallel"):
            raise ConfigurationError(
                f"tool_execution must be 'sequential' or 'parallel', got {self.tool_execution!r}"
            )
        if self.max_tool_concurrency < 1:
            raise ConfigurationError(
                f"max_tool_concurrency must be at least 1, got {self.max_tool_concurrency}"
            )
        for name in ("steering_mode", "follow_up_mode"):
            if getattr(self, name) not in ("all", "one-at-a-time"):
                raise ConfigurationError(
                    f"{name} must be 'all' or 'one-at-a-time', got {getattr(self, name)!r}"
                )
        for name in ("max_output_calls", "max_output_chars", "max_tool_output_chars"):
            if getattr(self, name) < 1:
                raise ConfigurationError(
                    f"{name} must be at least 1, got {getattr(self, name)}"
                )
        for name in ("max_retries", "structured_output_retries"):
            if getattr(self, name) < 0:
                raise ConfigurationError(
                    f"{name} must be >= 0, got {getattr(self, name)}"
                )

    def _check_types(self) -> None:
        """Refuse a value of the wrong type (or a duration no timer can take:
        NaN, negative, infinite) by name, before it fails deep inside."""
        for name in _INTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ArgumentTypeError(
                    f"{name} must be an int, got {type(value).__name__} {value!r}"
                )
        for name in _SECONDS:
            if name == "retry_backoff":
                seconds(name, self.retry_backoff)
            else:  # a timeout or a deadline: NaN, 0, negatives and inf refused
                seconds_or_none(
                    name,
                    getattr(self, name),
                    positive=True,
                    rule="a finite number of seconds > 0 or None",
                )
        for name in _CALLABLES:
            for item in getattr(self, name):
                if not callable(item):
                    raise ArgumentTypeError(
                        f"{name} must hold callables, got {type(item).__name__} {item!r}"
                    )
        if self.finish_turn is not None and not callable(self.finish_turn):
            raise ArgumentTypeError(
                f"finish_turn must be callable, got {type(self.finish_turn).__name__}"
            )

    @classmethod
    def of(cls, options: LoopOptionsDict) -> "LoopOptions":
        """Options from `run_loop`'s keyword arguments (naming any unknown one)."""
        if not options:
            return _DEFAULT
        unknown = set(options) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigurationError(
                f"unknown loop options: {', '.join(sorted(unknown))} "
                f"(known: {', '.join(cls.__dataclass_fields__)})"
            )
        values = dict(options)
        for name in _CALLABLES:
            if name in values:
                given = values[name]
                if not isinstance(given, Sequence) or isinstance(given, str):
                    raise ArgumentTypeError(
                        f"{name} must be a list, got {type(given).__name__}"
                    )
                values[name] = tuple(given)
        return cls(**values)  # type: ignore[arg-type]


_INTS: Final = (
    "max_turns",
    "max_tool_concurrency",
    "max_retries",
    "structured_output_retries",
    "max_output_calls",
    "max_output_chars",
    "max_tool_output_chars",
)
_SECONDS: Final = (
    "inference_timeout",
    "deadline",
    "retry_backoff",
    "max_stream_seconds",
)
_CALLABLES: Final = ("stop_when", "tool_wrappers", "model_wrappers")

_DEFAULT: Final = LoopOptions()

read_fields_fast(globals())
