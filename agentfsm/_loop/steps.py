"""What a state returns: the next step, and the names the hot path compares.

A state function does its work and returns a `Step`: the trigger to take next,
the payload that transition acts on, and, for an edge that ends the loop, the
reason it will end with (`max_turns`, `terminated`, a stop condition's verdict).
Only the driver holds the step until it is taken; a handler that changes the
edge drops the reason, since the reason belongs to the edge it came with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Final, NamedTuple, TypeAlias

from agentfsm.interception import TransitionPayload
from agentfsm.states import LoopState, Trigger

if TYPE_CHECKING:
    from agentfsm.inference import InferenceOutput
    from agentfsm.store import CallRecord

__all__ = ("Found", "Step", "_S", "_T")


Step: TypeAlias = tuple[Trigger, TransitionPayload, str | None]
"""`(trigger, payload, reason)`: the next transition, what it acts on, and why
the loop will end for an ending edge the state chose (`stop`, or a `finish`
that stops rather than answers), else None.

A plain tuple, not a named one: a state returns one per step, and building a
`NamedTuple` (its Python-level `__new__`) and reading its fields cost ~2,000
instructions per step more (`make bench-instructions`). Readers unpack it:
`trigger, payload, reason = step`."""


class _S:
    """`LoopState` members as plain class attributes: the hot path compares states
    many times per step, and looking members up on the enum class costs ~5x more."""

    idle: Final = LoopState.idle
    context_update: Final = LoopState.context_update
    inference: Final = LoopState.inference
    inference_streaming: Final = LoopState.inference_streaming
    function_call: Final = LoopState.function_call
    model_message: Final = LoopState.model_message


class _T:
    """`Trigger` members as plain class attributes (see `_S`)."""

    start: Final = Trigger.start
    infer: Final = Trigger.infer
    infer_streaming: Final = Trigger.infer_streaming
    call_tools: Final = Trigger.call_tools
    answer: Final = Trigger.answer
    steer: Final = Trigger.steer
    stop: Final = Trigger.stop
    follow_up: Final = Trigger.follow_up
    finish: Final = Trigger.finish
    abort: Final = Trigger.abort
    fail: Final = Trigger.fail
    cancel: Final = Trigger.cancel


class Found(NamedTuple):
    """What a loop's store holds of its current turn, as it is taken up (see
    `states.RECOVER`)."""

    output: InferenceOutput | None
    """The recorded output of the request the loop was making (in
    `inference`), if any."""
    ledger: Mapping[str, CallRecord]
    """The ledger's entries of its latest request's calls, by key."""
    notes: Mapping[str, str] | None = None
    """Why a call's tool's `reconcile` function did not settle it, by key (for
    the reason of a pause over it)."""
