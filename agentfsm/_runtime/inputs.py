"""What `Runtime.run_loop` checks of its arguments before a loop exists: the
user message (or continuing the context) and the interception handlers."""

from __future__ import annotations

from collections.abc import Sequence

from agentfsm import _models
from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import InferenceInput
from agentfsm.interception import InterceptionHandler
from agentfsm.messages import UserMessage

__all__ = ("agent_id_of", "handlers_of", "user_message_of")


def user_message_of(
    message: UserMessage | str | None, inference_input: InferenceInput
) -> UserMessage | None:
    if isinstance(message, str):
        # Built without validation: a str is all a UserMessage's content is
        # (`str()` makes a str subclass, a StrEnum say, a plain one, as validating would).
        return _models.trusted(
            UserMessage, {"type": "user_message", "content": str(message)}, {"content"}
        )
    if isinstance(message, UserMessage):
        return message
    if message is not None:
        raise ConfigurationError(
            f"message must be a str, a UserMessage or None, got {type(message).__name__}"
        )
    items = inference_input.context.items
    if not items:
        raise ConfigurationError(
            "message=None continues the context, but the context is empty"
        )
    last = items[-1]
    if last.type not in ("user_message", "function_call_output"):
        raise ConfigurationError(
            "message=None continues the context, which must end with a user message or "
            f"a function output; it ends with a {last.type}"
        )
    return None


def handlers_of(
    handler: InterceptionHandler | Sequence[InterceptionHandler] | None,
) -> tuple[InterceptionHandler, ...]:
    if handler is None:
        return ()
    if isinstance(handler, str | bytes):
        raise ConfigurationError(
            f"interception_handler must be callable or a list of callables, got {handler!r}"
        )
    handlers = tuple(handler) if isinstance(handler, Sequence) else (handler,)
    for h in handlers:
        if not callable(h):
            raise ConfigurationError(f"interception handler {h!r} is not callable")
    return handlers


def agent_id_of(agent_id: object) -> str:
    """The agent id, which events and the event log carry as a str."""
    if not isinstance(agent_id, str) or not agent_id:
        raise ConfigurationError(
            f"agent_id must be a non-empty str, got {type(agent_id).__name__} {agent_id!r}"
        )
    return agent_id
