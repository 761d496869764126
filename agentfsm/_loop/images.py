"""Whether a loop's model takes the images of a message, asked before the
message enters the context (`states.context_update`, and `Runtime.run_loop`,
`steer` and `follow_up` before a loop queues one)."""

from __future__ import annotations

from collections.abc import Iterable

from agentfsm.exceptions import ImageNotSupported
from agentfsm.messages import UserMessage
from agentfsm.providers import ProviderRegistry, image_support_of

__all__ = ("refuse_unsupported_images",)


def refuse_unsupported_images(
    messages: Iterable[UserMessage], model: str, providers: ProviderRegistry
) -> None:
    """Raise when `model` cannot take an image of `messages` as a user message.

    Raises:
        ImageNotSupported: naming the model, the capability and the block.
    """
    support = image_support_of(providers.resolve(model), model)
    for message in messages:
        refused = support.refusal(message)
        if refused is not None:
            lacking, where = refused
            raise ImageNotSupported(
                f"model {model!r} does not take {lacking}: the message's "
                f"{where} was refused before it entered the context",
                model=model,
                capability=lacking,
                block=where,
            )
