"""`inference` and `inference_streaming`: one model request (the state says which).

The payload is the `InferenceInput` to send (a handler may have rewritten it).
The model wrappers run around the request (`model_call.request_model`); a
streaming request publishes each chunk as `inference.stream`. The output is
published as `inference.completed` and kept as the turn's output. Next:
`call_tools` with the output's function calls as a `ToolBatch` (calls of tools
that need approval listed as awaiting it), or `answer` with its message.

Recovered (`recover`): a loop taken up from its store in this state uses the
request's output if it was recorded (`loop.recorded_output`), and sends the
request otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from agentfsm import _models
from agentfsm._loop.bounds import checked_output, unique_call_ids
from agentfsm._loop.loop import one_more_unreported
from agentfsm._loop.model_call import request_model
from agentfsm._loop.steps import _S, _T, Step
from agentfsm._loop.turn import request_metadata, tool_index
from agentfsm.exceptions import ProviderError, TurnLimitExceeded
from agentfsm.inference import InferenceInput, InferenceOutput, ModelRequest
from agentfsm.interception import ToolBatch, TransitionPayload
from agentfsm.messages import FunctionCallItem, ModelMessageItem

if TYPE_CHECKING:
    from collections.abc import Sequence

    from agentfsm._loop.loop import Loop
    from agentfsm._loop.steps import Found

__all__ = ("calls_and_message", "completed", "inference", "recover")

_BATCH_FIELDS: Final = {"kind", "calls", "denied", "awaiting_approval", "outputs"}
_REQUEST_FIELDS: Final = {"input", "metadata", "streaming", "loop_id", "agent_id"}


async def inference(loop: Loop, payload: TransitionPayload) -> Step:
    assert isinstance(payload, InferenceInput)
    if loop.model_requests >= loop.options.max_turns:
        raise TurnLimitExceeded(over_the_limit(loop))
    streaming = loop.state is _S.inference_streaming
    if loop.recorded_output is not None:
        # A recovered loop whose request's output was recorded: not sent again.
        output, loop.recorded_output = loop.recorded_output, None
        # Its ids were made unique before it was recorded: this renames only
        # an output recorded by a version that did not.
        return completed(loop, payload, unique_call_ids(output, loop, payload.model))
    if loop.model_chain is None:
        output = await request_model(loop, payload, streaming)
    else:
        values = {
            "input": payload,
            "metadata": request_metadata(loop),
            "streaming": streaming,
            "loop_id": loop.loop_id,
            "agent_id": loop.agent_id,
        }
        request = _models.trusted(ModelRequest, values, _REQUEST_FIELDS)
        output = await loop.model_chain(request)
        if type(output) is not InferenceOutput and not isinstance(
            output, InferenceOutput
        ):
            raise ProviderError(
                f"the model wrappers returned {type(output).__name__}, "
                "not an InferenceOutput"
            )
    # Checked here, after the wrappers: what the loop publishes is what they
    # return, with its call ids unique in the loop.
    output = checked_output(output, payload.model, loop.options, loop)
    return completed(loop, payload, output)


def recover(loop: Loop, found: Found) -> list[str]:
    """A loop taken up in this state: the request's output, if its store
    recorded it, is used instead of sending the request again."""
    loop.recorded_output = found.output
    return []


def over_the_limit(loop: Loop) -> str:
    """Why the loop may not make this request, naming the rewrite that led here."""
    limit = loop.options.max_turns
    why = ""
    for edge in reversed(loop.path):
        if edge.rewritten_from is not None:
            why = (
                f" (by the rewrite of {edge.source} --> {edge.rewritten_from} "
                f"into --{edge.trigger}--> {edge.dest})"
            )
            break
    return (
        f"max_turns={limit} reached: a handler took the loop on to model request "
        f"{loop.model_requests + 1}{why}; max_turns counts every request "
        "(a stop condition, stop_when, is a limit a handler may lift)"
    )


def completed(loop: Loop, request: InferenceInput, output: InferenceOutput) -> Step:
    """Count and publish a model request's output; the step it leads to."""
    loop.model_requests += 1
    usage = output.token_usage
    if usage is not None:
        loop.usage = loop.usage + usage
    else:
        loop.usage = one_more_unreported(loop.usage)
    loop.request = request
    loop.output = output
    loop.emit_completed(request.model, output)
    calls, message = calls_and_message(output)
    if not calls:
        return (_T.answer, message or ModelMessageItem(content=""), None)
    batch = {
        "kind": "tool_batch",
        "calls": calls,
        "denied": {},
        "outputs": {},
        "awaiting_approval": awaiting_approval(loop, calls) if loop.gated else (),
    }
    return (_T.call_tools, _models.trusted(ToolBatch, batch, _BATCH_FIELDS), None)


def calls_and_message(
    output: InferenceOutput,
) -> tuple[tuple[FunctionCallItem, ...], ModelMessageItem | None]:
    """`output.function_calls` and `output.message`, in one pass by exact type.

    A checked output (`bounds.checked_output`) holds items of exactly these
    classes, so `type(i) is` tells them apart: the two properties cost a call,
    a comprehension and an `isinstance` per item each, ~1,500 instructions a
    request more (`make bench-instructions`).
    """
    calls: list[FunctionCallItem] = []
    message: ModelMessageItem | None = None
    for item in output.items:
        if type(item) is FunctionCallItem:
            calls.append(item)
        elif type(item) is ModelMessageItem:
            message = item
    return tuple(calls), message


def awaiting_approval(loop: Loop, calls: Sequence[FunctionCallItem]) -> tuple[str, ...]:
    """The calls of tools that need approval for these arguments."""
    tools = tool_index(loop)
    return tuple(
        c.call_id
        for c in calls
        if (tool := tools.get(c.name)) is not None
        and tool.requires_approval(c.arguments)
    )
