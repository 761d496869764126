"""The loop's machine as data: states, triggers, outcomes and the transition table.

This module has no behaviour. `agentfsm._machine` builds a `transitions` machine
from `TRANSITIONS`, validates it and compiles the frozen table the loop runs.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, TypedDict

__all__ = (
    "ERROR_TRIGGERS",
    "TRANSITIONS",
    "LoopState",
    "Outcome",
    "TransitionSpec",
    "Trigger",
)


class LoopState(StrEnum):
    """Where a loop is. A loop starts in `idle` and ends in `idle`."""

    # Members hash as their string: the loop looks them up in tables on every
    # step, and Enum's own __hash__ is a Python-level call (~3x slower).
    __hash__ = str.__hash__

    idle = "idle"
    context_update = "context_update"
    inference = "inference"
    inference_streaming = "inference_streaming"
    function_call = "function_call"
    model_message = "model_message"


class Trigger(StrEnum):
    """The name of an edge of the machine."""

    # Members hash as their string: the loop looks them up in tables on every
    # step, and Enum's own __hash__ is a Python-level call (~3x slower).
    __hash__ = str.__hash__

    start = "start"
    infer = "infer"
    infer_streaming = "infer_streaming"
    call_tools = "call_tools"
    answer = "answer"
    steer = "steer"
    stop = "stop"
    follow_up = "follow_up"
    finish = "finish"
    abort = "abort"
    fail = "fail"
    cancel = "cancel"


class Outcome(StrEnum):
    """How a loop ended."""

    # Members hash as their string: the loop looks them up in tables on every
    # step, and Enum's own __hash__ is a Python-level call (~3x slower).
    __hash__ = str.__hash__

    answered = "answered"
    """The model answered and the answer was published."""
    stopped = "stopped"
    """Every tool asked to terminate, or a turn limit or stop condition was reached."""
    aborted = "aborted"
    """An interception handler returned `Abort`."""
    cancelled = "cancelled"
    """The loop was cancelled (`Runtime.cancel` or the runtime closing)."""
    failed = "failed"
    """An error: the provider, a handler, an illegal rewrite, bad input."""


ERROR_TRIGGERS: Final = frozenset({Trigger.abort, Trigger.fail, Trigger.cancel})
"""Edges that leave every non-idle state for `idle` and cannot be intercepted."""


class TransitionSpec(TypedDict):
    """One transition in `transitions`' config form."""

    trigger: Trigger
    source: LoopState | list[LoopState]
    dest: LoopState


_S = LoopState
_T = Trigger
_ACTIVE: list[LoopState] = [s for s in LoopState if s is not LoopState.idle]

TRANSITIONS: Final[tuple[TransitionSpec, ...]] = (
    {"trigger": _T.start, "source": _S.idle, "dest": _S.context_update},
    {"trigger": _T.infer, "source": _S.context_update, "dest": _S.inference},
    {
        "trigger": _T.infer_streaming,
        "source": _S.context_update,
        "dest": _S.inference_streaming,
    },
    {"trigger": _T.call_tools, "source": _S.inference, "dest": _S.function_call},
    {"trigger": _T.answer, "source": _S.inference, "dest": _S.model_message},
    {
        "trigger": _T.call_tools,
        "source": _S.inference_streaming,
        "dest": _S.function_call,
    },
    {"trigger": _T.answer, "source": _S.inference_streaming, "dest": _S.model_message},
    {"trigger": _T.infer, "source": _S.function_call, "dest": _S.inference},
    {
        "trigger": _T.infer_streaming,
        "source": _S.function_call,
        "dest": _S.inference_streaming,
    },
    {"trigger": _T.steer, "source": _S.function_call, "dest": _S.context_update},
    {"trigger": _T.stop, "source": _S.function_call, "dest": _S.idle},
    {"trigger": _T.follow_up, "source": _S.model_message, "dest": _S.context_update},
    {"trigger": _T.finish, "source": _S.model_message, "dest": _S.idle},
    {"trigger": _T.abort, "source": _ACTIVE, "dest": _S.idle},
    {"trigger": _T.fail, "source": _ACTIVE, "dest": _S.idle},
    {"trigger": _T.cancel, "source": _ACTIVE, "dest": _S.idle},
)
"""The transition table of DESIGN.md, declared once."""
