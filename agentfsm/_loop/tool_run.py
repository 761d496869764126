"""Running one tool's function: what a loop's call and `Tool.invoke` share.

The arguments are validated, the function is called (a sync one in a worker
thread unless its tool says otherwise), its deadline armed only where a call
could be interrupted, and its value made what the loop takes: a `ToolResult`
or text. `tool_call.py` around it makes the call's context, output and events.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread

from agentfsm import _text
from agentfsm.exceptions import ToolError, ToolTimeout
from agentfsm.messages import ImageBlock, TextBlock
from agentfsm.tools import Tool, ToolResult

if TYPE_CHECKING:
    from agentfsm.tools import ToolFunction

__all__ = ("BASE_INVOKE", "output_of", "run_function")

BASE_INVOKE: Final = Tool.invoke
"""The base class's `invoke`: a subclass that overrides it runs itself (the
loop calls its `invoke` in place of `run_function`)."""

_TEXT_OR_RESULT: Final = (str, ToolResult)
"""What a tool may return as it is (`output_of`)."""

_IMAGES_OR_LIST: Final = (ImageBlock, list, tuple)
"""What may hold images among a tool's other values (one test for a value
that holds none, rather than three)."""

_SCALARS: Final = frozenset({int, float, bool, type(None)})
"""Values that are JSON as they are: neither text, a result nor images."""


async def run_function(
    tool: Tool,
    arguments: str | Mapping[str, Any],
    cancel_scope: Callable[[], anyio.CancelScope],
) -> str | ToolResult:
    """Validate `arguments` and run the tool's function within its timeout;
    return its `ToolResult`, or its value as text. `cancel_scope` makes the
    scope (a loop passes its backend's class, found once per runtime)."""
    kwargs = tool.validate_arguments(arguments)
    if tool.timeout is None or not (
        tool.suspends if tool.is_async else tool.run_in_thread
    ):
        # No scope where nothing could be interrupted: a call that never
        # suspends (an async function without an await, a sync function run
        # in the loop's thread) cannot be cancelled, so no deadline can end it.
        return output_of(tool, await _call(tool, kwargs))
    # The scope is entered before the first step: a step may open scopes of
    # its own, and scopes must nest.
    with cancel_scope() as scope:
        if tool.is_async:
            # Take the coroutine's first step inside the scope but before arming
            # its deadline: most async tools finish without waiting on anything
            # and need no timer, and arming one was the largest cost of a call.
            coro = tool.function(**kwargs)
            try:
                first = coro.send(None)
            except StopIteration as done:
                return output_of(tool, done.value)
            scope.deadline = anyio.current_time() + tool.timeout
            result = await _Resume(coro, first)
        else:
            scope.deadline = anyio.current_time() + tool.timeout
            result = await _call(tool, kwargs)
    if scope.cancelled_caught:
        raise ToolTimeout(
            f"tool {tool.name!r} timed out after {tool.timeout:g}s", tool=tool.name
        )
    return output_of(tool, result)


def output_of(tool: Tool, value: Any) -> str | ToolResult:
    """The function's value as the loop takes it: a `ToolResult` or text.

    Serialized here, not by the loop, so that a value JSON cannot hold is
    reported as that, not as the tool having raised.
    """
    kind = type(value)
    if kind is str or kind is ToolResult:  # the common values: no class test
        taken: str | ToolResult = value
        return taken
    if kind is int:
        # Its JSON is its digits: `str` costs ~1,600 instructions less than
        # the JSON encoder (an int past `str`'s digit limit goes to the encoder).
        try:
            return str(value)
        except ValueError:
            pass
    # A class test against a model class goes through its metaclass's
    # `__instancecheck__` (~1,200 instructions each): not for the JSON scalars.
    elif kind not in _SCALARS:
        if isinstance(value, _TEXT_OR_RESULT):  # a tuple: a union is built per call
            return value
        if isinstance(value, _IMAGES_OR_LIST):
            if isinstance(value, ImageBlock):
                return ToolResult(output="", images=(value,))
            if any(isinstance(v, ImageBlock) for v in value):
                return _blocks_output(tool.name, value)
    try:
        return _text.json_text(value)
    except ValueError as exc:  # PydanticSerializationError, circular references
        raise ToolError(
            f"tool {tool.name!r} returned a value that cannot be serialized "
            f"to JSON ({type(value).__name__}): {exc}",
            tool=tool.name,
        ) from exc


def _blocks_output(name: str, value: list[Any] | tuple[Any, ...]) -> ToolResult:
    """A list holding images: its text (strs, `TextBlock`s) a line each,
    and its images, in order.

    Raises:
        ToolError: the list holds something else beside them.
    """
    texts: list[str] = []
    images: list[ImageBlock] = []
    for item in value:
        if isinstance(item, ImageBlock):
            images.append(item)
        elif isinstance(item, str):
            texts.append(item)
        elif isinstance(item, TextBlock):
            texts.append(item.text)
        else:
            raise ToolError(
                f"tool {name!r} returned a list of images holding a "
                f"{type(item).__name__}: only text (str, TextBlock) may go "
                "beside images",
                tool=name,
            )
    return ToolResult(output="\n".join(texts), images=images)


def _call(tool: Tool, kwargs: dict[str, Any]) -> Awaitable[Any]:
    """The call to await (the function's own coroutine for an async tool: no
    coroutine of ours around it)."""
    if tool.is_async:
        # An annotation, not `typing.cast`: a call per tool call (~300
        # instructions) to tell mypy what `is_async` already says.
        coroutine_function: Callable[..., Awaitable[Any]] = tool.function
        return coroutine_function(**kwargs)
    if tool.run_in_thread:
        return anyio.to_thread.run_sync(
            partial(tool.function, **kwargs), abandon_on_cancel=True
        )
    return _call_here(tool.name, tool.function, kwargs)


async def _call_here(name: str, function: ToolFunction, kwargs: dict[str, Any]) -> Any:
    """A sync tool run in the loop's thread."""
    result = function(**kwargs)
    if inspect.isawaitable(result):
        raise ToolError(
            f"tool {name!r} returned an awaitable from a sync function", tool=name
        )
    return result


class _Resume:
    """Awaits a coroutine that was already started (its first step taken).

    This is what `await coro` does, from the second step on: every value the
    coroutine yields goes up to the event loop, and whatever the event loop
    sends or throws (cancellation included) goes back down into it.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self._coro, self._first
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # noqa: BLE001 - forwarded into the coroutine
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value
                except BaseException:
                    # Trio sends an outcome: an error one holds the exception,
                    # whose traceback holds this frame, which holds `sent`: a
                    # cycle (keeping the loop of a cancelled call) that only
                    # the cycle collector would free.
                    del sent
                    raise
