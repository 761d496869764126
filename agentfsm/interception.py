"""Interception: a handler sees every transition before it is taken.

Before each transition the loop builds a `PendingTransition` and awaits the
handler (a sync or async callable, or a list of them run in order, each seeing
the previous one's rewrite). A handler returns a decision:

- `Proceed()` or `None`: take the transition as it is.
- `Rewrite(dest=..., payload=...)`: take another edge leaving the same source,
  and/or act on another payload. An edge the machine does not have fails the
  loop with `TransitionRejected`.
- `Pause(reason)`: park the loop with the transition pending; no task stays
  busy. `Runtime.resume(loop_id, decision)` continues it.
- `Abort(reason)`: end the loop with outcome `aborted`.

The payload is what the transition will act on:

| trigger | payload |
|---|---|
| start | the `UserMessage` (or `None` to continue the context as it is) |
| infer, infer_streaming | the `InferenceInput` of the next request |
| call_tools | a `ToolBatch`: the calls, with denials and changed arguments |
| answer, finish | the `ModelMessageItem` |
| steer, follow_up | the queued `UserMessage`s |
| stop | `None` |

`abort`, `fail` and `cancel` are published but never intercepted.

Example:
    ```python
    def no_deletes(pending: PendingTransition) -> Decision | None:
        if isinstance(pending.payload, ToolBatch):
            batch = pending.payload
            for call in batch.calls:
                if call.name == "delete_file":
                    batch = batch.deny(call.call_id, "deleting files is not allowed")
            return Rewrite(payload=batch)
        return None
    ```
"""

from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, Final, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, InstanceOf, model_validator

from ._models import read_fields_fast
from ._text import EncodableStr, encodable, json_text
from .inference import InferenceInput, RequestMetadata
from .messages import FunctionCallItem, ModelMessageItem, TokenUsage, UserMessage
from .states import LoopState, Trigger

__all__ = (
    "APPROVAL_GATE",
    "Abort",
    "Decision",
    "InterceptionHandler",
    "Pause",
    "PendingTransition",
    "Proceed",
    "Rewrite",
    "ToolBatch",
    "TransitionPayload",
)


APPROVAL_GATE: Final = "agentfsm._loop.intercept:approval_gate"
"""The approval gate's name among a record's handlers (`LoopStarted.handlers`,
`LoopRecord`): a loop whose tools need approval runs this built-in handler
first and names it there; a loop rebuilt from a record (a replay, a fork)
leaves it out of the handlers it is given, since the loop adds it itself."""


class ToolBatch(BaseModel):
    """The function calls a `call_tools` transition will run.

    Handlers deny calls, change their arguments or answer them without running
    them by returning a rewritten batch. A denied call does not run; the model
    sees an error output with the reason. An answered call does not run
    either; the model sees the output given (a recovered loop's call whose
    outcome is uncertain is resolved this way, or by a denial, or by running it
    again).

    Each call's `call_id` is its own in the batch (the loop renames a model's
    repeated or empty ids before it builds the batch): a batch of calls
    sharing an id is refused, as a call id would not say which call a denial,
    an approval or an answer is for.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    kind: Literal["tool_batch"] = "tool_batch"
    calls: tuple[FunctionCallItem, ...]
    """The calls, in the model's order."""
    denied: dict[str, EncodableStr] = Field(default_factory=dict)
    """`call_id -> reason` for each denied call."""
    awaiting_approval: tuple[str, ...] = ()
    """Calls of tools that need approval; set while the loop waits for it.
    Resuming approves those not denied."""
    outputs: dict[str, EncodableStr] = Field(default_factory=dict)
    """`call_id -> output` for each call answered without running it."""

    @model_validator(mode="after")
    def _distinct_ids(self) -> "ToolBatch":
        repeated = _repeated_ids(self.calls)
        if repeated:
            raise ValueError(_repeated_message(repeated))
        return self

    def deny(self, call_id: str, reason: str) -> "ToolBatch":
        """This batch with one more call denied."""
        self._check(call_id)
        denied = {**self.denied, call_id: encodable(reason)}
        return self.model_copy(update={"denied": denied})

    def approve(self, call_id: str) -> "ToolBatch":
        """This batch with one call approved (no longer denied or awaiting approval)."""
        self._check(call_id)
        denied = {k: v for k, v in self.denied.items() if k != call_id}
        waiting = tuple(c for c in self.awaiting_approval if c != call_id)
        return self.model_copy(update={"denied": denied, "awaiting_approval": waiting})

    def answer(self, call_id: str, output: str) -> "ToolBatch":
        """This batch with one call answered by `output` instead of running it."""
        self._check(call_id)
        outputs = {**self.outputs, call_id: encodable(output)}
        return self.model_copy(update={"outputs": outputs})

    def with_arguments(
        self, call_id: str, arguments: Mapping[str, Any] | str
    ) -> "ToolBatch":
        """This batch with the arguments of one call replaced."""
        self._check(call_id)
        text = json_text(arguments)
        calls = tuple(
            c.model_copy(update={"arguments": text}) if c.call_id == call_id else c
            for c in self.calls
        )
        return self.model_copy(update={"calls": calls})

    def _check(self, call_id: str) -> None:
        matching = sum(c.call_id == call_id for c in self.calls)
        if not matching:
            known = ", ".join(c.call_id for c in self.calls)
            raise KeyError(f"no call {call_id!r} in this batch (calls: {known})")
        if matching > 1:  # a batch copied with such calls, past the validator
            raise ValueError(_repeated_message([call_id]))


def _repeated_ids(calls: tuple[FunctionCallItem, ...]) -> list[str]:
    """The call ids more than one of `calls` has, in order."""
    seen: set[str] = set()
    repeated: list[str] = []
    for call in calls:
        if call.call_id in seen and call.call_id not in repeated:
            repeated.append(call.call_id)
        seen.add(call.call_id)
    return repeated


def _repeated_message(repeated: list[str]) -> str:
    shown = " and ".join(repr(encodable(i)) for i in repeated)
    return (
        f"a ToolBatch's calls must have distinct call_ids, and more than one "
        f"call has {shown}: a denial, approval or answer by id would not say "
        "which call it is for"
    )


TransitionPayload: TypeAlias = (
    UserMessage
    | tuple[UserMessage, ...]
    | InferenceInput
    | ToolBatch
    | ModelMessageItem
    | None
)
"""What a transition acts on (see the module docstring)."""


class PendingTransition(BaseModel):
    """A transition about to be taken, as a handler sees it."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", arbitrary_types_allowed=True, defer_build=True
    )

    loop_id: str
    agent_id: str
    seq: int
    """The sequence number the transition's event will carry."""
    source: LoopState
    trigger: Trigger
    dest: LoopState
    payload: TransitionPayload = None
    """What the transition acts on; see `TransitionPayload`."""
    model_requests: int = 0
    """Model requests the loop has made so far."""
    tool_calls: int = 0
    """Tool calls the loop has run so far."""
    usage: TokenUsage = Field(default_factory=TokenUsage)
    """Tokens the loop has used so far."""
    metadata: InstanceOf[RequestMetadata] | None = None
    """For `infer`/`infer_streaming`: where each item of the request came from."""


class Proceed(BaseModel):
    """Take the transition as it is (returning `None` means the same)."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    kind: Literal["proceed"] = "proceed"


class Rewrite(BaseModel):
    """Take another edge from the same source, and/or act on another payload."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", arbitrary_types_allowed=True, defer_build=True
    )

    kind: Literal["rewrite"] = "rewrite"
    dest: LoopState | None = None
    """The new destination (`None` keeps it); must be an edge leaving the source."""
    payload: TransitionPayload = None
    """The new payload (`None` keeps it, or derives it when the edge changes)."""


class Pause(BaseModel):
    """Park the loop with the transition pending until `Runtime.resume`."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    kind: Literal["pause"] = "pause"
    reason: EncodableStr

    def __init__(self, reason: str | None = None, /, **data: Any) -> None:
        """`Pause("why")` or `Pause(reason="why")`."""
        if reason is not None:
            data["reason"] = reason
        super().__init__(**data)


class Abort(BaseModel):
    """End the loop now with outcome `aborted`."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    kind: Literal["abort"] = "abort"
    reason: EncodableStr

    def __init__(self, reason: str | None = None, /, **data: Any) -> None:
        """`Abort("why")` or `Abort(reason="why")`."""
        if reason is not None:
            data["reason"] = reason
        super().__init__(**data)


Decision: TypeAlias = Annotated[
    Proceed | Rewrite | Pause | Abort, Field(discriminator="kind")
]
"""What an interception handler (or `Runtime.resume`) decides."""

InterceptionHandler: TypeAlias = Callable[
    [PendingTransition], Awaitable[Decision | None] | Decision | None
]
"""A sync or async callable deciding about one pending transition."""

read_fields_fast(globals())
