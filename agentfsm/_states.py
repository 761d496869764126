"""What each state does: the state functions the loop runs after each transition.

Each takes the loop and the payload of the transition that led to it, does the
state's work, and leaves the next pending transition in `loop._next`. Tool
batches run in `_batch`, model requests in `_request`.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from . import _fast
from ._batch import INTERRUPTED, run_batch
from ._batch import Outcome as CallOutcome
from ._request import normalized, request_model
from .exceptions import StructuredOutputError
from .inference import InferenceInput, InferenceOutput, ModelRequest, RequestMetadata
from .interception import ToolBatch, TransitionPayload
from .messages import (
    ContextItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ModelMessageItem,
    UserMessage,
)
from .options import QueueMode, TurnSnapshot
from .states import LoopState, Trigger
from .tools import Tool, format_validation_error

if TYPE_CHECKING:
    from ._loop import Loop

__all__ = ("STATES", "drain", "infer_step")


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


_BATCH_FIELDS: Final = {"kind", "calls", "denied", "awaiting_approval"}
_REQUEST_FIELDS: Final = {"input", "metadata", "streaming", "loop_id", "agent_id"}

Step: TypeAlias = tuple[Trigger, TransitionPayload]
"""A pending transition: the trigger and its payload."""


def drain(queue: deque[UserMessage], mode: QueueMode) -> tuple[UserMessage, ...]:
    if mode == "one-at-a-time":
        return (queue.popleft(),) if queue else ()
    drained = tuple(queue)
    queue.clear()
    return drained


def awaiting_approval(loop: Loop, calls: Sequence[FunctionCallItem]) -> tuple[str, ...]:
    tools = tool_index(loop)
    return tuple(
        c.call_id
        for c in calls
        if (tool := tools.get(c.name)) is not None
        and tool.requires_approval(c.arguments)
    )


async def context_update(loop: Loop, payload: TransitionPayload) -> None:
    context = loop.input.context
    if isinstance(payload, UserMessage):
        context.append(payload)
    elif isinstance(payload, tuple):
        context.extend(payload)
    if loop.path[-1].trigger is _T.start and loop._steering:
        # Steering is polled before the first request, too.
        context.extend(drain(loop._steering, loop.options.steering_mode))
    loop._next = infer_step(loop)


def infer_step(loop: Loop) -> Step:
    request = loop.input
    items = request.context.items
    scan = loop._scan
    loop._history = len(items)
    if scan.clean(items):
        loop._metadata = None  # nothing to repair: the request as it is
    else:
        request, loop._metadata = normalized(request, scan)
    return (_T.infer_streaming if request.streaming else _T.infer, request)


def request_metadata(loop: Loop) -> RequestMetadata:
    """The metadata of the request `infer_step` made: made on first read (most
    requests have no handler or wrapper to read it), then the same object."""
    metadata = loop._metadata
    if metadata is None:
        metadata = loop._metadata = RequestMetadata(loop._history)
    return metadata


async def inference(loop: Loop, payload: TransitionPayload) -> None:
    """`inference` and `inference_streaming`: the state says which."""
    assert isinstance(payload, InferenceInput)
    streaming = loop.state is _S.inference_streaming
    if loop._model_chain is None:
        output = await request_model(loop, payload, streaming)
    else:
        values = {
            "input": payload,
            "metadata": request_metadata(loop),
            "streaming": streaming,
            "loop_id": loop.loop_id,
            "agent_id": loop.agent_id,
        }
        request = _fast.trusted(ModelRequest, values, _REQUEST_FIELDS)
        output = await loop._model_chain(request)
    completed(loop, payload, output)


def completed(loop: Loop, request: InferenceInput, output: InferenceOutput) -> None:
    loop.model_requests += 1
    if output.token_usage is not None:
        loop.usage = loop.usage + output.token_usage
    loop._request = request
    loop._output = output
    loop._emit("inference.completed", model=request.model, output=output)
    calls = output.function_calls
    if calls:
        waiting = awaiting_approval(loop, calls) if loop._gated else ()
        batch = {
            "kind": "tool_batch",
            "calls": calls,
            "denied": {},
            "awaiting_approval": waiting,
        }
        loop._next = (_T.call_tools, _fast.trusted(ToolBatch, batch, _BATCH_FIELDS))
    else:
        loop._next = (_T.answer, output.message or ModelMessageItem(content=""))


async def function_call(loop: Loop, payload: TransitionPayload) -> None:
    batch = payload if isinstance(payload, ToolBatch) else ToolBatch(calls=())
    output, loop._output = loop._output, None
    items: list[ContextItem] = (
        []
        if output is None
        else [i for i in output.items if not isinstance(i, FunctionCallItem)]
    )
    loop._last_tools.clear()
    results: list[CallOutcome | None] = [None] * len(batch.calls)
    # A response cut by the token limit may hold truncated arguments.
    truncated = output is not None and output.finish_reason == "length"
    try:
        await run_batch(loop, batch, tool_index(loop), results, truncated=truncated)
    finally:
        # Whatever happened, every call gets an output, and calls and outputs
        # enter the context together so loops sharing it never split a pair.
        outputs = [
            settled(loop, call, r) for call, r in zip(batch.calls, results, strict=True)
        ]
        items.extend(batch.calls)
        items.extend(outputs)
        write(loop, items)
    if loop.options.finish_turn is not None:
        await finish_turn(loop, output, outputs)
    stop = "terminated" if _all_terminate(results) else stop_check(loop)
    if stop is not None:
        loop._stop_reason = stop
        loop._next = (_T.stop, None)
    elif loop._steering:
        loop._next = (
            _T.steer,
            drain(loop._steering, loop.options.steering_mode),
        )
    else:
        loop._next = infer_step(loop)


def _all_terminate(results: list[CallOutcome | None]) -> bool:
    """Whether the batch ran calls and every one asked to end the loop."""
    for result in results:
        if result is None or not result[1]:
            return False
    return bool(results)


def tool_index(loop: Loop) -> dict[str, Tool]:
    """The tools of the last request by name (rebuilt only when they change)."""
    tools = loop._request.tools
    cached = loop._tool_index
    if cached is None or cached[0] is not tools:
        cached = loop._tool_index = (tools, {t.name: t for t in tools})
    return cached[1]


def write(loop: Loop, items: list[ContextItem]) -> None:
    """Append to the context; items the loop writes never need a repair scan."""
    context_items = loop.input.context.items
    before = len(context_items)
    context_items.extend(items)
    loop._scan.skip(context_items, before, len(context_items))


def settled(
    loop: Loop, call: FunctionCallItem, result: CallOutcome | None
) -> FunctionCallOutputItem:
    if result is not None:
        return result[0]
    out = FunctionCallOutputItem.error(call.call_id, INTERRUPTED)
    loop._emit("function_call.completed", call=call, output=out, duration=0.0)
    return out


def stop_check(loop: Loop) -> str | None:
    """Why the loop must stop after this turn (limit or stop condition), or None."""
    if loop.model_requests >= loop.options.max_turns:
        return "max_turns"
    if loop.options.stop_when:
        view = loop.view()
        for condition in loop.options.stop_when:
            verdict = condition(view)
            if verdict:
                return verdict if isinstance(verdict, str) else "stop_condition"
    return None


async def finish_turn(
    loop: Loop,
    output: InferenceOutput | None,
    outputs: Sequence[FunctionCallOutputItem],
) -> None:
    callback = loop.options.finish_turn
    assert callback is not None  # callers check first, to skip the coroutine
    if output is None:
        return
    snapshot = TurnSnapshot(
        loop_id=loop.loop_id,
        agent_id=loop.agent_id,
        turn=loop.model_requests,
        output=output,
        tool_outputs=tuple(outputs),
        context=tuple(loop.input.context.items),
    )
    result = callback(snapshot)
    if inspect.isawaitable(result):
        await result


async def model_message(loop: Loop, payload: TransitionPayload) -> None:
    message = (
        payload
        if isinstance(payload, ModelMessageItem)
        else ModelMessageItem(content="")
    )
    output, loop._output = loop._output, None
    items: list[ContextItem] = []
    if output is not None:
        items.extend(
            i
            for i in output.items
            if not isinstance(i, FunctionCallItem | ModelMessageItem)
        )
    items.append(message)
    write(loop, items)
    loop._answer_at = len(loop.input.context.items) - 1
    schema = loop._request.structured_output
    problem = None if schema is None else parse(loop, schema, message)
    if problem is None:
        loop.answer = message
        loop._emit("model.answer", message=message, parsed=_jsonable(loop.parsed))
    if output is not None and loop.options.finish_turn is not None:
        await finish_turn(loop, output, ())
    # Limits and stop conditions only matter when the loop would go on: an
    # answer on the last allowed turn is still an answer.
    go_on = problem is not None or bool(loop._steering) or bool(loop._follow_ups)
    stop = stop_check(loop) if go_on else None
    if stop is not None:
        loop._stop_reason = stop
        loop._next = (_T.finish, message)
    elif problem is not None:
        loop._next = (_T.follow_up, UserMessage(content=problem))
    elif loop._steering:
        loop._next = (
            _T.follow_up,
            drain(loop._steering, loop.options.steering_mode),
        )
    elif loop._follow_ups:
        loop._next = (
            _T.follow_up,
            drain(loop._follow_ups, loop.options.follow_up_mode),
        )
    else:
        loop._next = (_T.finish, message)


def parse(
    loop: Loop, schema: type[BaseModel] | dict[str, Any], message: ModelMessageItem
) -> str | None:
    """Validate the answer; return what to tell the model when it is invalid."""
    try:
        if isinstance(schema, dict):
            loop.parsed = _validate_json_schema(schema, message.content)
        else:
            loop.parsed = schema.model_validate_json(message.content)
    except (ValidationError, ValueError) as exc:
        error = (
            format_validation_error(exc)
            if isinstance(exc, ValidationError)
            else str(exc)
        )
        loop._structured_failures += 1
        if loop._structured_failures > loop.options.structured_output_retries:
            raise StructuredOutputError(
                f"the answer did not match the structured output after "
                f"{loop._structured_failures} attempts: {error}"
            ) from exc
        return (
            f"Your answer does not match the required output format: {error}. "
            "Answer again with only the corrected JSON."
        )
    return None


def _validate_json_schema(schema: dict[str, Any], text: str) -> Any:
    """Parse `text` as JSON and validate it against a JSON schema (needs `jsonschema`)."""
    import jsonschema  # imported here: only loops with a JSON-schema output need it

    data = from_json(text)
    errors = sorted(
        jsonschema.Draft202012Validator(schema).iter_errors(data),
        key=lambda e: list(e.path),
    )
    if errors:
        raise ValueError(
            "; ".join(
                f"{'.'.join(map(str, e.path)) or 'answer'}: {e.message}" for e in errors
            )
        )
    return data


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value


StateFn: TypeAlias = "Callable[[Loop, TransitionPayload], Awaitable[None]]"

STATES: Final[dict[LoopState, StateFn]] = {
    _S.context_update: context_update,
    _S.inference: inference,
    _S.inference_streaming: inference,
    _S.function_call: function_call,
    _S.model_message: model_message,
}
