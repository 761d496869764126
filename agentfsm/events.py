"""Typed events published on the bus.

Every event is a frozen pydantic model with the same envelope: `type` (a dotted
name), `event_id`, `loop_id`, `agent_id`, `seq` (monotonic per loop, without
holes: a subscriber sees a gap exactly when it missed an event), `ts` and
`state` (the loop's state when the event was published). `AgentEventAdapter`
reads any of them back from JSON.

| type | when |
|---|---|
| `loop.started` | `run_loop` accepted the loop |
| `transition.intercepted` | a handler decided about a pending transition |
| `loop.paused` / `loop.resumed` | a handler paused the loop / `resume` continued it |
| `loop.recovered` | `Runtime.recover` took the loop from a durable store |
| `loop.transition` | a transition was taken (the path, one edge at a time) |
| `inference.stream` | a streamed chunk, in order |
| `inference.completed` | a model request returned |
| `function_call.started` / `.progress` / `.completed` | a tool call began / reported / ended |
| `model.answer` | the answer was published |
| `loop.failed` | the loop failed (published before its `loop.idle`) |
| `input.dropped` | an input sent from outside was not valid and was dropped (a Temporal signal's payload) |
| `loop.idle` | the loop ended, with its outcome and totals |
"""

from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeAlias, final

from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter

from . import _models
from .inference import InferenceOutput, StreamingDelta
from .interception import ToolBatch
from .messages import (
    ContextItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ModelMessageItem,
    TokenUsage,
    UserMessage,
)
from .record import OptionsRecord
from .states import LoopState, Outcome, Trigger

__all__ = (
    "EVENT_SPECS",
    "EVENT_TYPES",
    "AgentEvent",
    "AgentEventAdapter",
    "EventPayload",
    "FunctionCallCompleted",
    "FunctionCallProgress",
    "FunctionCallStarted",
    "ForkOrigin",
    "InferenceCompleted",
    "InferenceStream",
    "InputDropped",
    "LoopDetached",
    "LoopFailed",
    "LoopIdle",
    "LoopPaused",
    "LoopRecovered",
    "LoopResumed",
    "LoopStarted",
    "LoopTransition",
    "ModelAnswer",
    "ReconciledCall",
    "RequestData",
    "RequestSummary",
    "ToolSpec",
    "TransitionIntercepted",
)


class RequestSummary(BaseModel):
    """An inference request as events record it (the settings, not the whole context)."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    kind: Literal["request"] = "request"
    model: str
    max_output_tokens: int | None = None
    reasoning_effort: str | None = None
    tool_choice: str | None = None
    tools: tuple[str, ...] = ()
    """The names of the tools offered."""
    instructions: str | None = None
    context_items: int = 0
    """How many items the context held."""


class ToolSpec(BaseModel):
    """A tool as `loop.started` records it: what the model was shown, and how
    the loop ran it (its function is not data)."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    name: str
    description: str = ""
    parameters: dict[str, JsonValue]
    """The JSON schema of the arguments."""
    needs_approval: bool | Literal["rule"] = False
    """`"rule"`: a function of the arguments decided."""
    execution_mode: Literal["parallel", "sequential"] = "parallel"
    timeout: float | None = None


class RequestData(BaseModel):
    """A loop's `InferenceInput` as data, context included: what a replay
    starts the same loop from."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    model: str
    settings: dict[str, JsonValue] = Field(default_factory=dict)
    """The other fields of the input that differ from their defaults
    (`streaming`, `tool_choice`, `temperature`, ...), as JSON data."""
    tools: tuple[ToolSpec, ...] = ()
    structured_output: str | dict[str, JsonValue] | None = None
    """A pydantic class by name (`module:qualname`), a JSON schema as it is."""
    instructions: str | None = None
    items: tuple[ContextItem, ...] = ()
    """The context as the loop found it (before its own message entered)."""


class ForkOrigin(BaseModel):
    """Where a forked loop came from: `agentfsm.replay.fork`."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    loop_id: str
    """The loop it was forked from."""
    seq: int
    """The seq of that loop's `loop.transition` it continues after."""


EventPayload: TypeAlias = (
    UserMessage
    | tuple[UserMessage, ...]
    | ToolBatch
    | ModelMessageItem
    | RequestSummary
)
"""A transition payload as events record it."""


def _none(self: object) -> None:
    return None


def _set_none(self: object, value: object) -> None:
    if value is not None:
        raise TypeError(f"events hold no extra or private values, got {value!r}")


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    # An event has no extra fields (`extra="forbid"`) and no private attributes,
    # so these two of pydantic's four instance slots always hold None. Read from
    # the class instead, they need not be written for every event `Emitter.emit`
    # makes (two slot writes, ~2,600 instructions an event); pydantic's own
    # writes of None (validation, copies, unpickling) go through the setter.
    __pydantic_extra__ = property(_none, _set_none)
    __pydantic_private__ = property(_none, _set_none)

    event_id: str
    """Unique: `<loop_id>:<seq>`."""
    loop_id: str
    """The loop that published the event."""
    agent_id: str
    """The agent the loop runs for."""
    seq: int
    """Monotonic per loop, starting at 1, without holes."""
    ts: datetime = Field(default_factory=lambda: datetime.now(UTC))
    """When the event was published (UTC)."""
    state: LoopState
    """The loop's state when the event was published."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        defaults = _models.defaults(cls)
        # Every field in declaration order, holding its default (None until set).
        template = {name: defaults.get(name) for name in cls.model_fields}
        EVENT_SPECS[defaults["type"]] = (cls, template, set(cls.model_fields))


EVENT_SPECS: dict[str, tuple[type[_Event], dict[str, Any], set[str]]] = {}
"""Per event type, what `Emitter.emit` builds its events from: the class, a dict of
every field (defaults filled in) to copy, and the set of fields it sets.
(Kept in a plain dict: class attributes of a pydantic model are looked up
through its metaclass, several times slower.)"""


@final
class LoopStarted(_Event):
    """`run_loop` accepted the loop; it starts in `idle`."""

    type: Literal["loop.started"] = "loop.started"
    message: UserMessage | None
    """The message the loop starts with (`None` continues the context)."""
    model: str
    streaming: bool
    request: RequestData | None = None
    """The input the loop was started with, context and tools included (what
    `agentfsm.replay` re-drives it from)."""
    options: OptionsRecord | None = None
    """Its options, callables by name."""
    handlers: tuple[str, ...] = ()
    """Its interception handlers by name, in order (the approval gate first
    when a tool needs approval)."""
    forked_from: ForkOrigin | None = None
    """For a loop `fork` started: the loop and seq it continues from."""


@final
class TransitionIntercepted(_Event):
    """A handler (or `resume`) decided about a pending transition."""

    type: Literal["transition.intercepted"] = "transition.intercepted"
    source: LoopState
    trigger: Trigger
    dest: LoopState
    """The destination proposed to the handler."""
    decision: Literal["proceed", "rewrite", "pause", "abort"]
    new_dest: LoopState | None = None
    """For a rewrite, the destination it chose."""
    reason: str | None = None
    """For a pause or an abort, why."""
    payload: EventPayload | None = None
    """For a rewrite, the payload it chose."""
    handler: int
    """Index of the handler in the loop's list (`-1` for `resume`)."""


@final
class LoopPaused(_Event):
    """A handler paused the loop with a transition pending."""

    type: Literal["loop.paused"] = "loop.paused"
    source: LoopState
    trigger: Trigger
    dest: LoopState
    reason: str
    payload: EventPayload | None = None
    """What the pending transition would act on (e.g. the calls awaiting approval)."""


@final
class LoopResumed(_Event):
    """`Runtime.resume` continued a paused loop."""

    type: Literal["loop.resumed"] = "loop.resumed"
    decision: Literal["proceed", "rewrite", "pause", "abort"]


@final
class ReconciledCall(BaseModel):
    """What recovery learned from a tool's `reconcile` function about a call
    in flight at the crash (`@tool(reconcile=...)`), and did."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    call_id: str
    tool: str
    idempotency_key: str
    answer: Literal["ran", "not_run", "unknown", "failed"]
    """`ran`: its output is recorded and it is never run again; `not_run`: it
    runs again, with the same key; `unknown` (the function returned None) and
    `failed` (it raised, timed out or returned something else): the loop
    paused over it."""
    output: FunctionCallOutputItem | None = None
    """The output recorded for a call that ran."""
    error: str | None = None
    """Why asking failed."""


@final
class LoopRecovered(_Event):
    """`Runtime.recover` took the loop from a durable store; it goes on from its
    last committed transition (`state`), or stays paused."""

    type: Literal["loop.recovered"] = "loop.recovered"
    status: Literal["running", "paused"]
    uncertain_calls: tuple[str, ...] = ()
    """Ids of calls that were in flight when the process died, over which the
    loop paused (their tools' `on_crash="pause"`)."""
    reconciled: tuple[ReconciledCall, ...] = ()
    """What each in-flight call's tool's `reconcile` function answered, in
    batch order (stored with the ledger's entries it led to)."""


@final
class LoopTransition(_Event):
    """A transition was taken; `state` is its destination."""

    type: Literal["loop.transition"] = "loop.transition"
    source: LoopState
    trigger: Trigger
    dest: LoopState
    rewritten_from: LoopState | None = None
    """The destination before a handler rewrote it, if one did."""


@final
class InferenceStream(_Event):
    """One chunk of a streaming model response."""

    type: Literal["inference.stream"] = "inference.stream"
    index: int
    """Position of the chunk in this response, from 0."""
    delta: StreamingDelta


@final
class InferenceCompleted(_Event):
    """A model request returned."""

    type: Literal["inference.completed"] = "inference.completed"
    model: str
    output: InferenceOutput


@final
class FunctionCallStarted(_Event):
    """A tool call began."""

    type: Literal["function_call.started"] = "function_call.started"
    call: FunctionCallItem


@final
class FunctionCallProgress(_Event):
    """A running tool reported progress."""

    type: Literal["function_call.progress"] = "function_call.progress"
    call_id: str
    progress: JsonValue


@final
class FunctionCallCompleted(_Event):
    """A tool call ended (its output may be an error)."""

    type: Literal["function_call.completed"] = "function_call.completed"
    call: FunctionCallItem
    output: FunctionCallOutputItem
    duration: float
    """Seconds the call took."""


@final
class ModelAnswer(_Event):
    """The model's answer was published."""

    type: Literal["model.answer"] = "model.answer"
    message: ModelMessageItem
    parsed: JsonValue = None
    """With `structured_output`: the validated answer as JSON data."""


@final
class LoopFailed(_Event):
    """The loop failed; `loop.idle` follows."""

    type: Literal["loop.failed"] = "loop.failed"
    error_type: str
    """The class name of the error."""
    message: str


@final
class LoopDetached(_Event):
    """The loop stopped in this process without ending: its store could not
    take a write, another runtime took it (its lease went stale), or the
    runtime closed while it ran. The store keeps it as of its last commit
    (`state` is where it was here), and the runtime that takes it up
    (`Runtime.recover`) goes on from there; no `loop.idle` follows here."""

    type: Literal["loop.detached"] = "loop.detached"
    reason: str
    """Why, naming the store and the cause."""
    error_type: str | None = None
    """The class name of the store's error, if one stopped it."""


@final
class InputDropped(_Event):
    """An input sent to the loop from outside was not valid and was dropped;
    the loop goes on as if it had not been sent. A Temporal workflow publishes
    it for a signal it cannot use (a signal cannot be refused)."""

    type: Literal["input.dropped"] = "input.dropped"
    input: str
    """Which input: the signal's name (`steer`, `follow_up`, `cancel`)."""
    reason: str
    """What was wrong with it."""


@final
class LoopIdle(_Event):
    """The loop ended in `idle`, with its outcome and totals."""

    type: Literal["loop.idle"] = "loop.idle"
    outcome: Outcome
    reason: str | None = None
    """Why it stopped, aborted, failed or was cancelled."""
    answer: ModelMessageItem | None = None
    usage: TokenUsage
    model_requests: int
    tool_calls: int


AgentEvent: TypeAlias = Annotated[
    LoopStarted
    | TransitionIntercepted
    | LoopPaused
    | LoopResumed
    | LoopRecovered
    | LoopTransition
    | InferenceStream
    | InferenceCompleted
    | FunctionCallStarted
    | FunctionCallProgress
    | FunctionCallCompleted
    | ModelAnswer
    | LoopFailed
    | LoopDetached
    | InputDropped
    | LoopIdle,
    Field(discriminator="type"),
]
"""Any event the bus carries."""

AgentEventAdapter: TypeAdapter[AgentEvent] = TypeAdapter(
    AgentEvent, config=ConfigDict(defer_build=True)
)
"""(De)serializes any event, e.g. `AgentEventAdapter.validate_json(line)`."""

EVENT_TYPES: tuple[str, ...] = tuple(EVENT_SPECS)
"""Every event type name."""

_models.read_fields_fast(globals())
