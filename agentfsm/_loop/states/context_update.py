"""`context_update`: the user's message (or the queued ones) enters the context.

Entered by `start` (the payload is the user message, or None to continue the
context as it is), `steer` and `follow_up` (the messages the queues released).
Steering queued before the first request is taken here too. Every message
enters the context here, so here its text is made encodable
(`bounds.checked_user`). Next: the model
request (`infer` or `infer_streaming`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentfsm._loop.bounds import checked_user
from agentfsm._loop.steps import _T, Step
from agentfsm._loop.turn import drain, infer_step
from agentfsm.interception import TransitionPayload
from agentfsm.messages import UserMessage

if TYPE_CHECKING:
    from agentfsm._loop.loop import Loop

__all__ = ("context_update",)


async def context_update(loop: Loop, payload: TransitionPayload) -> Step:
    context = loop.input.context
    if isinstance(payload, UserMessage):
        context.append(checked_user(payload))
    elif isinstance(payload, tuple):
        context.extend([checked_user(m) for m in payload])
    if loop.path[-1].trigger is _T.start and loop.steering:
        # Steering is polled before the first request, too.
        steering = drain(loop.steering, loop.options.steering_mode)
        context.extend([checked_user(m) for m in steering])
    return infer_step(loop)
