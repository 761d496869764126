"""What each state does, one module per state.

A state function takes the loop and the payload of the transition that led to
it, does the state's work, and returns the next `Step`. `idle` has no function:
a loop that reaches it has ended (see `driver.end`).

A state with side effects outside the loop also says how a loop taken up from
its store in that state goes on (`RECOVER`): what its store found of the turn
(`Found`) decides. The others (`context_update`, `model_message`) run again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final, TypeAlias

from agentfsm._loop.steps import _S, Found, Step
from agentfsm.interception import TransitionPayload
from agentfsm.states import LoopState

from . import function_call as _function_call
from . import inference as _inference
from .context_update import context_update
from .function_call import function_call
from .inference import inference
from .model_message import model_message

if TYPE_CHECKING:
    from agentfsm._loop.loop import Loop

__all__ = ("RECOVER", "STATES", "StateFn")

StateFn: TypeAlias = "Callable[[Loop, TransitionPayload], Awaitable[Step]]"

STATES: Final[dict[LoopState, StateFn]] = {
    _S.context_update: context_update,
    _S.inference: inference,
    _S.inference_streaming: inference,
    _S.function_call: function_call,
    _S.model_message: model_message,
}
"""The function each state runs (both inference states run `inference`)."""

RECOVER: Final[dict[LoopState, Callable[[Loop, Found], list[str]]]] = {
    _S.inference: _inference.recover,
    _S.inference_streaming: _inference.recover,
    _S.function_call: _function_call.recover,
}
"""How a loop taken up in a state with side effects goes on: each returns the
ledger keys of the calls it parked the loop over (their outcome uncertain)."""
