"""A loop's record as data: `LoopRecord`, what `Runtime.snapshot` returns.

Every field of a `Loop` that defines it at a committed transition, as a frozen
pydantic model that round-trips through JSON:

- the context is referenced by position (`context_items`, and each request's
  `context_items`): the items themselves are the context's, appended to only;
- callables (tools, handlers, wrappers, stop conditions, `finish_turn`, a
  structured-output class) appear by name (`module:qualname`) and are never
  serialized;
- what a loop keeps only to run faster (its repair scan, its tool index, its
  logger, its worker) is not in it.

The runtime takes it from a live loop (`agentfsm._loop.snapshot`); it is the
shape the durable store writes at each commit.

Example:
    ```python
    record = runtime.snapshot(loop_id)
    text = record.model_dump_json()
    assert LoopRecord.model_validate_json(text) == record
    ```
"""

import dataclasses
import weakref
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from . import _models
from .inference import InferenceOutput
from .interception import ToolBatch
from .messages import ContextItem, ModelMessageItem, TokenUsage, UserMessage
from .options import (
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_OUTPUT_CALLS,
    DEFAULT_MAX_STREAM_SECONDS,
)
from .results import ErrorInfo, LoopStatus, PathStep
from .states import LoopState, Outcome, Trigger

if TYPE_CHECKING:
    from .options import LoopOptions

__all__ = (
    "DecisionEntry",
    "DecisionRecord",
    "LoopRecord",
    "MessagesRecord",
    "OptionsRecord",
    "PauseRecord",
    "PayloadRecord",
    "RequestRecord",
    "ResumeRecord",
    "StepRecord",
    "TurnRecord",
    "callable_name",
)

RECORD_VERSION: Literal[1] = 1

_CONFIG = ConfigDict(frozen=True, extra="forbid", defer_build=True)


def callable_name(value: Any) -> str:
    """How a record names a callable: `module:qualname` (a bound method by its
    function, a partial by what it wraps, any other object by its class)."""
    target = getattr(value, "__func__", value)
    target = getattr(target, "func", target)  # functools.partial
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if module is None or qualname is None:
        cls = type(value)
        module, qualname = cls.__module__, cls.__qualname__
    return f"{module}:{qualname}"


class RequestRecord(BaseModel):
    """An `InferenceInput`: settings as data, tools by name, context by position."""

    model_config = _CONFIG

    kind: Literal["request"] = "request"
    model: str
    settings: dict[str, JsonValue] = Field(default_factory=dict)
    """Every other field of the input, as JSON data (`streaming`, `tool_choice`, ...)."""
    tools: tuple[str, ...] = ()
    """The tools offered, by name."""
    tool_schemas: tuple[str, ...] = ()
    """A digest of each tool's name and parameters schema, in the order of
    `tools`: a loop is never resumed with a tool whose schema changed."""
    structured_output: str | dict[str, JsonValue] | None = None
    """A pydantic class by name, a JSON schema as it is."""
    instructions: str | None = None
    context_items: int
    """How many items the request's context holds."""
    own_context: bool
    """Whether the request's context is the loop's own (or a copy a repair or a
    handler made)."""
    repairs: tuple[tuple[int, int, str], ...] | None = None
    """A repaired copy of the loop's own context (calls without outputs given
    synthetic ones): its first `context_items - len(repairs)` items with an
    error output inserted for each `(position, call position, call id)`."""
    items: tuple[ContextItem, ...] | None = None
    """The items of a context that is neither the loop's own nor its repair (a
    copy a handler made), so the request can be rebuilt; None otherwise (the
    loop's own context is referenced by position only; the turn's last
    request, of which the loop uses the tools and settings, is rebuilt on
    it)."""


class MessagesRecord(BaseModel):
    """Messages a queue released (the payload of `steer` and `follow_up`)."""

    model_config = _CONFIG

    kind: Literal["messages"] = "messages"
    messages: tuple[UserMessage, ...]


PayloadRecord: TypeAlias = (
    UserMessage | MessagesRecord | RequestRecord | ToolBatch | ModelMessageItem | None
)
"""A transition's payload as data."""


class StepRecord(BaseModel):
    """A step: the trigger, its payload and the reason of an ending edge."""

    model_config = _CONFIG

    trigger: Trigger
    payload: PayloadRecord = None
    reason: str | None = None


class PauseRecord(BaseModel):
    """Where and why a loop waits."""

    model_config = _CONFIG

    source: LoopState
    trigger: Trigger
    dest: LoopState
    seq: int
    """The seq the transition's event will carry."""
    payload: PayloadRecord = None
    handler: int
    """The handler that paused: resuming continues with the ones after it."""
    reason: str
    original_dest: LoopState
    """The destination before any handler rewrote it."""


class DecisionRecord(BaseModel):
    """A decision (`Proceed`, `Rewrite`, `Pause`, `Abort`) as data."""

    model_config = _CONFIG

    kind: Literal["proceed", "rewrite", "pause", "abort"]
    dest: LoopState | None = None
    payload: PayloadRecord = None
    reason: str | None = None


class ResumeRecord(BaseModel):
    """The decision a paused loop was resumed with, not yet applied."""

    model_config = _CONFIG

    decision: DecisionRecord
    handler: int
    original_dest: LoopState


class TurnRecord(BaseModel):
    """The current turn's working data."""

    model_config = _CONFIG

    request: RequestRecord
    """The last request sent (calls run with its tools)."""
    output: InferenceOutput | None = None
    """The last model output, until the state after it used it."""
    message: ModelMessageItem | None = None
    """The message `model_message` wrote last."""
    answer_at: int | None = None
    """Where that message sits in the context."""
    history: int = 0
    """Items in the context when the last request was made."""
    last_tools: tuple[str, ...] = ()


class OptionsRecord(BaseModel):
    """`LoopOptions`, callables by name."""

    model_config = _CONFIG

    max_turns: int
    stop_when: tuple[str, ...]
    tool_execution: Literal["sequential", "parallel"]
    max_tool_concurrency: int
    tool_wrappers: tuple[str, ...]
    model_wrappers: tuple[str, ...]
    steering_mode: Literal["all", "one-at-a-time"]
    follow_up_mode: Literal["all", "one-at-a-time"]
    inference_timeout: float | None
    deadline: float | None
    max_retries: int
    retry_backoff: float
    structured_output_retries: int
    finish_turn: str | None
    # Defaults: a record written before these limits existed restores with them.
    max_output_calls: int = DEFAULT_MAX_OUTPUT_CALLS
    max_output_chars: int = DEFAULT_MAX_CHARS
    max_stream_seconds: float | None = DEFAULT_MAX_STREAM_SECONDS
    max_tool_output_chars: int = DEFAULT_MAX_CHARS


_last_options: "tuple[weakref.ref[LoopOptions], OptionsRecord] | None" = None
"""The options last described, while they live (most loops share theirs:
`run_loop` without options gives every loop one object), and their record:
`loop.started` describes them at every loop's start; remembering them saves
~44,000 instructions a benchmark run with a subscriber (`make
bench-instructions`: 1,175,129 -> 1,130,641). A weak reference: it keeps
neither the options nor their callables alive (tests/test_snapshot.py)."""


def options_record(options: "LoopOptions") -> OptionsRecord:
    """`LoopOptions` as data, callables by name (built without validation: the
    values come from `LoopOptions`, checked when it was made)."""
    global _last_options
    last = _last_options
    if last is not None and last[0]() is options:
        return last[1]
    values: dict[str, Any] = {}
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if isinstance(value, tuple):
            value = tuple(callable_name(v) for v in value)
        elif callable(value):
            value = callable_name(value)
        values[field.name] = value
    record = _models.trusted(OptionsRecord, values, _OPTIONS_FIELDS)
    _last_options = (weakref.ref(options), record)
    return record


_OPTIONS_FIELDS = set(OptionsRecord.model_fields)


class LoopRecord(BaseModel):
    """Everything that defines a loop at a committed transition, as data."""

    model_config = _CONFIG

    version: Literal[1] = RECORD_VERSION
    loop_id: str
    agent_id: str
    started_at: datetime
    input: RequestRecord
    """What the loop was started with."""
    handlers: tuple[str, ...]
    """The interception handlers, by name, in order (the approval gate first
    when a tool needs approval)."""
    options: OptionsRecord

    state: LoopState
    status: LoopStatus
    seq: int
    """The number of the loop's last event."""
    path: tuple[PathStep, ...]
    context_items: int
    """How many items the loop's context holds."""
    pending: StepRecord | None = None
    """The step waiting while no driver holds it: the first one before the loop
    runs, the paused one while it is paused."""
    step: StepRecord | None = None
    """The step last committed: what the current state acts on."""
    pause: PauseRecord | None = None
    resume: ResumeRecord | None = None

    model_requests: int
    tool_calls: int
    structured_failures: int
    usage: TokenUsage

    steering: tuple[UserMessage, ...] = ()
    follow_ups: tuple[UserMessage, ...] = ()
    turn: TurnRecord

    cancel_requested: bool = False
    cancel_reason: str | None = None
    deadline_at: float | None = None
    """The loop's deadline on anyio's clock (`anyio.current_time()`)."""
    deadline_utc: datetime | None = None
    """The same deadline as a wall-clock time (what a durable store restores it
    from, in another process)."""

    outcome: Outcome | None = None
    reason: str | None = None
    answer: ModelMessageItem | None = None
    parsed: JsonValue = None
    """The structured answer as JSON data."""
    error: ErrorInfo | None = None
    ended_at: datetime | None = None


class DecisionEntry(BaseModel):
    """One decision about one transition, as the loop's store keeps it (the
    audit trail: who decided what, and when), written before the decision took
    effect: a handler's with the commit of the transition it decided about, a
    resume's as the loop is resumed."""

    model_config = _CONFIG

    seq: int
    """The seq of the transition decided about (`PendingTransition.seq`)."""
    source: LoopState
    trigger: Trigger
    dest: LoopState
    """Where the transition led when the decision was asked for."""
    handler: str | None
    """The interception handler that decided, by name; None for a decision
    given through `Runtime.resume`."""
    decision: DecisionRecord
    by: str | None = None
    """Who gave it (`Runtime.resume(..., by=...)`); None for a handler's."""
    at: datetime
    """When it was made (the runtime's clock)."""


_models.read_fields_fast(globals())
