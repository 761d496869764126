"""`context_update`: the user's message (or the queued ones) enters the context.

Entered by `start` (the payload is the user message, or None to continue the
context as it is), `steer` and `follow_up` (the messages the queues released).
Steering queued before the first request is taken here too. Every message
enters the context here, so here its text is made encodable
(`bounds.checked_user`) and its images are checked against the model
(`images.refuse_unsupported_images`: the loop fails, nothing appended). Next: the model
request (`infer` or `infer_streaming`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentfsm._loop.bounds import checked_user
from agentfsm._loop.images import refuse_unsupported_images
from agentfsm._loop.steps import _T, Step
from agentfsm._loop.turn import drain, infer_step
from agentfsm.interception import TransitionPayload
from agentfsm.messages import UserMessage

if TYPE_CHECKING:
    from collections.abc import Sequence

    from agentfsm._loop.loop import Loop

__all__ = ("context_update",)


async def context_update(loop: Loop, payload: TransitionPayload) -> Step:
    context = loop.input.context
    if isinstance(payload, UserMessage):
        message = checked_user(payload)
        if type(message.content) is not str:
            refuse_unsupported_images((message,), loop.input.model, loop.providers)
        context.append(message)
    elif isinstance(payload, tuple):
        context.extend(_checked(loop, payload))
    if loop.path[-1].trigger is _T.start and loop.steering:
        # Steering is polled before the first request, too.
        steering = drain(loop.steering, loop.options.steering_mode)
        context.extend(_checked(loop, steering))
    return infer_step(loop)


def _checked(loop: Loop, messages: Sequence[UserMessage]) -> list[UserMessage]:
    """The messages as the context may hold them, all or none: a message with
    an image the model cannot take refuses them all, before any is appended."""
    checked = [checked_user(m) for m in messages]
    if any(type(m.content) is not str for m in checked):
        refuse_unsupported_images(checked, loop.input.model, loop.providers)
    return checked
