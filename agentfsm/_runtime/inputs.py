"""What `Runtime.run_loop` checks of its arguments before a loop exists: the
user message (or continuing the context), the interception handlers and the
agent id; and the checks of the runtime's other public calls (see
`agentfsm._arguments`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agentfsm import _models
from agentfsm._arguments import ArgumentTypeError, ArgumentValueError, given
from agentfsm._loop.bounds import checked_user
from agentfsm._text import encodable
from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import InferenceInput
from agentfsm.interception import InterceptionHandler
from agentfsm.messages import ImageBlock, UserMessage
from agentfsm.tools import Tool

__all__ = (
    "agent_id_of",
    "bindings_checked",
    "checked_message",
    "handlers_of",
    "user_message_of",
)


def user_message_of(
    message: UserMessage | str | None, inference_input: InferenceInput
) -> UserMessage | None:
    if isinstance(message, str):
        # Built without validation: a str is all a UserMessage's content is
        # (`str()` makes a str subclass, a StrEnum say, a plain one, as validating would).
        return _models.trusted(
            UserMessage,
            {"type": "user_message", "content": encodable(str(message))},
            {"content"},
        )
    if isinstance(message, UserMessage):
        return checked_message("message", message)
    if message is not None:
        raise ArgumentTypeError(
            f"message must be a str, a UserMessage or None, got {given(message)}"
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


def checked_message(name: str, message: UserMessage) -> UserMessage:
    """A caller's `UserMessage`, its content a str or blocks (one built without
    validation may hold anything: its blocks are validated again). Its text is
    made encodable where every message enters the context
    (`states.context_update`)."""
    content = message.__dict__.get("content")
    if type(content) is str:
        return message
    if type(content) is not tuple:
        raise ArgumentTypeError(
            f"{name}.content must be a str or a tuple of blocks, got {given(content)}"
        )
    try:
        message = checked_user(message)
    except ConfigurationError as exc:
        raise ArgumentTypeError(str(exc)) from None
    for index, block in enumerate(message.content):
        if type(block) is ImageBlock and block.is_reference:
            # Only a store or a workflow reads its bytes back: a caller's
            # message must carry them.
            raise ArgumentValueError(
                f"{name}.content[{index}] is {block.reference} by reference, "
                "without its bytes: give them (ImageBlock.with_data)"
            )
    return message


def handlers_of(
    handler: InterceptionHandler | Sequence[InterceptionHandler] | None,
) -> tuple[InterceptionHandler, ...]:
    if handler is None:
        return ()
    must = "interception_handler must be callable or a list of callables"
    if isinstance(handler, str | bytes):
        raise ArgumentTypeError(f"{must}, got {given(handler)}")
    handlers = tuple(handler) if isinstance(handler, Sequence) else (handler,)
    for h in handlers:
        if not callable(h):
            raise ArgumentTypeError(
                f"{must}, got {given(h)}{'' if h is handler else ' in the list'}"
            )
    return handlers


def agent_id_of(agent_id: object) -> str:
    """The agent id, which events and the event log carry as a str."""
    if not isinstance(agent_id, str) or not agent_id:
        error = ArgumentValueError if isinstance(agent_id, str) else ArgumentTypeError
        raise error(f"agent_id must be a non-empty str, got {given(agent_id)}")
    if encodable(agent_id) is not agent_id:
        # An id is not rewritten (the caller looks loops up by it): refused.
        raise ArgumentValueError(
            f"agent_id cannot hold a lone surrogate (no store or log can write it), "
            f"got {agent_id!r}"
        )
    return agent_id


def bindings_checked(tools: object, handlers: object) -> None:
    """Refuse `Runtime(tools=..., handlers=...)` that are not lists (or, for
    `handlers`, a mapping from names) of tools and callables."""
    for t in _list_of("tools", tools, "a list of tools or functions"):
        if not isinstance(t, Tool) and not callable(t):
            raise ArgumentTypeError(
                f"tools must hold tools or functions, got {given(t)} in the list"
            )
    if isinstance(handlers, Mapping):
        for name, value in handlers.items():
            if not isinstance(name, str) or not callable(value):
                raise ArgumentTypeError(
                    "handlers must map names ('module:qualname') to callables, got "
                    f"{given(name)}: {given(value)}"
                )
        return
    expected = "a list of callables, or a mapping from names"
    for h in _list_of("handlers", handlers, expected):
        if not callable(h):
            raise ArgumentTypeError(
                f"handlers must hold callables, got {given(h)} in the list"
            )


def _list_of(name: str, value: object, expected: str) -> Sequence[object]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ArgumentTypeError(f"{name} must be {expected}, got {given(value)}")
    return value
