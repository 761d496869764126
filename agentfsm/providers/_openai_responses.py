"""The OpenAI Responses API mapping: requests, responses and stream events.

Imported only by `agentfsm.providers.openai`, after it checked the SDK is there.

| agentfsm                         | Responses API                                         |
|----------------------------------|-------------------------------------------------------|
| `ModelContext.instructions`      | `instructions`                                        |
| `UserMessage`                    | `{"role": "user", "content": ...}` (text, or `input_text` / `input_image` parts) |
| `ModelMessageItem`               | `{"role": "assistant", "content": ...}` / `message`   |
| `ReasoningItem`                  | `reasoning` (summary text, `encrypted_content`)       |
| `FunctionCallItem`               | `function_call`                                       |
| `FunctionCallOutputItem`         | `function_call_output` (with images: `input_text` + `input_image` parts) |

A `ReasoningItem` goes back only with its `encrypted_content`: without the server
storing responses, that is the only form the API accepts it in. An image goes
as an `input_image` of its URL, or of its bytes as a `data:` URL (detail
`auto`); a tool-result image the model cannot take is a line of text instead
(`ImageMapping.tool_output`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal, TypeAlias, assert_never

from openai.lib._pydantic import to_strict_json_schema
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseErrorEvent,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionToolCall,
    ResponseIncompleteEvent,
    ResponseOutputItem,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputRefusal,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningSummaryPartAddedEvent,
    ResponseReasoningSummaryTextDeltaEvent,
    ResponseReasoningTextDeltaEvent,
    ResponseStreamEvent,
    ResponseTextDeltaEvent,
    ResponseUsage,
)
from pydantic import BaseModel

from agentfsm.exceptions import ProviderError
from agentfsm.inference import TOOL_CHOICE_MODES
from agentfsm.messages import (
    ContextItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ImageBlock,
    ModelMessageItem,
    OutputItem,
    ReasoningItem,
    TokenUsage,
    UserMessage,
)
from agentfsm.providers import (
    ImageSupport,
    InferenceInput,
    InferenceOutput,
    ReasoningDelta,
    StreamingDelta,
    TextDelta,
    ToolCallDelta,
)
from agentfsm.providers._common import (
    ImageMapping,
    count,
    image_url,
    new_call_id,
    refuse_unsupported,
    schema_name,
    strict_compatible,
    structured_schema,
)
from agentfsm.providers._structured import Plan

__all__ = ("ReasoningSummary", "ResponsesStream", "output_of", "request_params")

ReasoningSummary: TypeAlias = Literal["auto", "concise", "detailed"]
"""How much of its reasoning a model summarizes (`reasoning.summary`)."""

_SUMMARY_SEPARATOR = "\n\n"
RETRYABLE_CODES: Final = frozenset({"server_error", "rate_limit_exceeded"})
"""Error codes of a failed response that a retry may clear."""

# --------------------------------------------------------------------- requests


def request_params(
    request: InferenceInput,
    model: str,
    *,
    store: bool,
    reasoning_summary: ReasoningSummary | None,
    include_encrypted_reasoning: bool | None,
    plan: Plan | None = None,
    images: ImageMapping | None = None,
) -> dict[str, Any]:
    """The keyword arguments of `client.responses.create` for a request (`plan`:
    how its structured output is asked for; none: not at all; `images`: what
    the model takes, default everything).

    Raises:
        ImageNotSupported: a user message holds an image the model cannot take.
    """
    context = request.context
    if images is None:
        images = ImageMapping(request.model, ImageSupport())
    params: dict[str, Any] = {
        "model": model,
        "input": input_items(context.items, images),
        "store": store,
    }
    instructions = context.instructions
    if plan is not None and plan.instructions is not None:
        instructions = plan.instructions
    if instructions:
        params["instructions"] = instructions
    if request.max_output_tokens is not None:
        params["max_output_tokens"] = request.max_output_tokens
    if request.reasoning_effort is not None:
        reasoning: dict[str, Any] = {"effort": request.reasoning_effort}
        if reasoning_summary is not None:
            reasoning["summary"] = reasoning_summary
        params["reasoning"] = reasoning
    encrypted = include_encrypted_reasoning
    if encrypted is None:  # reasoning can only come back encrypted when not stored
        encrypted = request.reasoning_effort is not None and not store
    if encrypted:
        params["include"] = ["reasoning.encrypted_content"]
    # No `seed`: the Responses API has none, and a seed is a hint (see
    # `agentfsm.providers.openai`). No stop sequences either, and those change
    # the answer: refused.
    if request.stop_sequences:
        refuse_unsupported(
            "the OpenAI Responses API",
            {"stop_sequences": "Chat Completions has: use the `openai-chat:` prefix"},
        )
    if request.temperature is not None:
        params["temperature"] = request.temperature
    if request.top_p is not None:
        params["top_p"] = request.top_p
    if request.tools:
        params["tools"] = [_tool(t.definition.model_dump()) for t in request.tools]
        if request.parallel_tool_calls is not None:
            params["parallel_tool_calls"] = request.parallel_tool_calls
    choice = request.effective_tool_choice
    if plan is not None and plan.final is not None:
        params.setdefault("tools", []).append(_tool(plan.final.definition))
        choice = plan.final.choice
    if choice is not None:
        params["tool_choice"] = _tool_choice(choice)
    output = request.structured_output
    if plan is not None and output is not None:
        if plan.mode == "native":
            params["text"] = {"format": _text_format(output)}
        elif plan.mode == "prompted":
            params["text"] = {"format": {"type": "json_object"}}
    if request.extra_body is not None:
        params["extra_body"] = request.extra_body
    return params


def input_items(
    items: Sequence[ContextItem], images: ImageMapping
) -> list[dict[str, Any]]:
    """The context as Responses API input items.

    Raises:
        ImageNotSupported: a user message holds an image the model cannot take.
    """
    result: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, UserMessage):
            result.append({"role": "user", "content": _user_content(item, images)})
        elif isinstance(item, ModelMessageItem):
            text = item.content or item.refusal or ""
            if text:
                result.append({"role": "assistant", "content": text})
        elif isinstance(item, ReasoningItem):
            if item.encrypted_content is not None:
                summary = (
                    [{"type": "summary_text", "text": item.content}]
                    if item.content
                    else []
                )
                result.append(
                    {
                        "type": "reasoning",
                        "summary": summary,
                        "encrypted_content": item.encrypted_content,
                    }
                )
        elif isinstance(item, FunctionCallItem):
            result.append(
                {
                    "type": "function_call",
                    "call_id": item.call_id,
                    "name": item.name,
                    "arguments": item.arguments,
                }
            )
        elif isinstance(item, FunctionCallOutputItem):
            text, sent = images.tool_output(item)
            output: str | list[dict[str, Any]] = text
            if sent:
                parts = [{"type": "input_text", "text": text}] if text else []
                output = parts + [_image(block) for block in sent]
            result.append(
                {
                    "type": "function_call_output",
                    "call_id": item.call_id,
                    "output": output,
                }
            )
        else:
            assert_never(item)
    return result


def _user_content(
    message: UserMessage, images: ImageMapping
) -> str | list[dict[str, Any]]:
    content = message.content
    if isinstance(content, str):
        return content
    images.check_user(message)
    return [
        _image(block)
        if isinstance(block, ImageBlock)
        else {"type": "input_text", "text": block.text}
        for block in content
    ]


def _image(block: ImageBlock) -> dict[str, Any]:
    return {"type": "input_image", "image_url": image_url(block), "detail": "auto"}


def _tool(definition: dict[str, Any]) -> dict[str, Any]:
    parameters = definition["parameters"]
    return {
        "type": "function",
        "name": definition["name"],
        "description": definition["description"],
        "parameters": parameters,
        # The Responses API makes tools strict unless told otherwise.
        "strict": strict_compatible(parameters),
    }


def _tool_choice(choice: str) -> str | dict[str, Any]:
    if choice in TOOL_CHOICE_MODES:
        return choice
    return {"type": "function", "name": choice}


def _text_format(output: type[BaseModel] | dict[str, Any]) -> dict[str, Any]:
    if isinstance(output, dict):
        schema = structured_schema(output)
        strict = strict_compatible(schema)
    else:
        # The SDK's own transform, as its `responses.parse()` uses for models.
        schema = to_strict_json_schema(output)
        strict = True
    return {
        "type": "json_schema",
        "name": schema_name(output),
        "schema": schema,
        "strict": strict,
    }


# -------------------------------------------------------------------- responses


def output_of(response: Response) -> InferenceOutput:
    """A complete `Response` as an `InferenceOutput`.

    Raises:
        ProviderError: the response failed.
    """
    return _output(response, response.output)


def _output(
    response: Response, output: Sequence[ResponseOutputItem]
) -> InferenceOutput:
    if response.status == "failed" or response.error is not None:
        raise _failure(response)
    items = output_items(output)
    return InferenceOutput(
        items=items,
        token_usage=usage_of(response.usage),
        raw_response=response.model_dump(mode="json", warnings=False),
        finish_reason=_finish_reason(response, items),
    )


def output_items(output: Sequence[ResponseOutputItem]) -> tuple[OutputItem, ...]:
    """Messages, reasoning and function calls, in order (other items are skipped)."""
    items: list[OutputItem] = []
    for entry in output:
        if isinstance(entry, ResponseOutputMessage):
            text = "".join(
                p.text for p in entry.content if isinstance(p, ResponseOutputText)
            )
            refusals = [
                p.refusal for p in entry.content if isinstance(p, ResponseOutputRefusal)
            ]
            refusal = "".join(refusals) if refusals else None
            items.append(ModelMessageItem(content=text, refusal=refusal))
        elif isinstance(entry, ResponseReasoningItem):
            parts = [s.text for s in entry.summary] or [
                c.text for c in entry.content or ()
            ]
            items.append(
                ReasoningItem(
                    content=_SUMMARY_SEPARATOR.join(parts),
                    encrypted_content=entry.encrypted_content,
                )
            )
        elif isinstance(entry, ResponseFunctionToolCall):
            items.append(
                FunctionCallItem(
                    call_id=entry.call_id or new_call_id(),
                    name=entry.name,
                    arguments=entry.arguments,
                )
            )
    return tuple(items)


def usage_of(usage: ResponseUsage | None) -> TokenUsage | None:
    """The response's token counts."""
    if usage is None:
        return None
    # Compatible servers leave out fields the SDK types call required.
    return TokenUsage(
        input_tokens=count(usage, "input_tokens"),
        output_tokens=count(usage, "output_tokens"),
        reasoning_tokens=count(
            getattr(usage, "output_tokens_details", None), "reasoning_tokens"
        ),
        cached_input_tokens=count(
            getattr(usage, "input_tokens_details", None), "cached_tokens"
        ),
    )


def _finish_reason(response: Response, items: Sequence[OutputItem]) -> str:
    if response.status == "incomplete":
        details = response.incomplete_details
        reason = details.reason if details is not None else None
        if reason == "max_output_tokens":
            return "length"  # the loop refuses function calls a limit cut short
        return reason or "incomplete"
    if any(isinstance(item, FunctionCallItem) for item in items):
        return "tool_calls"
    return "stop"


def _failure(response: Response) -> ProviderError:
    error = response.error
    if error is None:
        return ProviderError(f"the response {response.id!r} failed")
    code = getattr(error, "code", None) or "error"  # servers may leave it out
    return ProviderError(
        f"the response failed ({code}): {getattr(error, 'message', '')}",
        retryable=code in RETRYABLE_CODES,
    )


# ---------------------------------------------------------------------- streams


class ResponsesStream:
    """Maps Responses stream events onto deltas and keeps the completed response.

    Each function call gets the next `ToolCallDelta.index` when its item is
    added (with its id and name); its argument deltas follow under that index.
    """

    __slots__ = ("_calls", "_done", "_final")

    def __init__(self) -> None:
        self._calls: dict[int, int] = {}
        """`output_index -> call index` of the function calls seen so far."""
        self._done: list[ResponseOutputItem] = []
        self._final: Response | None = None

    def feed(self, event: ResponseStreamEvent) -> list[StreamingDelta]:
        """The deltas one event carries (most carry none).

        Raises:
            ProviderError: the event reports an error or a failed response.
        """
        if isinstance(event, ResponseTextDeltaEvent):
            return [TextDelta(text=event.delta)] if event.delta else []
        if isinstance(
            event,
            ResponseReasoningSummaryTextDeltaEvent | ResponseReasoningTextDeltaEvent,
        ):
            return [ReasoningDelta(text=event.delta)] if event.delta else []
        if isinstance(event, ResponseReasoningSummaryPartAddedEvent):
            # Summary parts are joined with a blank line in the completed item.
            if event.summary_index > 0:
                return [ReasoningDelta(text=_SUMMARY_SEPARATOR)]
            return []
        if isinstance(event, ResponseFunctionCallArgumentsDeltaEvent):
            index = self._call_index(event.output_index)
            return [ToolCallDelta(index=index, arguments=event.delta)]
        if isinstance(event, ResponseOutputItemAddedEvent):
            return self._added(event)
        if isinstance(event, ResponseOutputItemDoneEvent):
            self._done.append(event.item)
        elif isinstance(event, ResponseCompletedEvent | ResponseIncompleteEvent):
            self._final = event.response
        elif isinstance(event, ResponseFailedEvent):
            raise _failure(event.response)
        elif isinstance(event, ResponseErrorEvent):
            code = event.code or "error"
            raise ProviderError(
                f"the response stream failed ({code}): {event.message}",
                retryable=code in RETRYABLE_CODES,
            )
        return []

    def output(self) -> InferenceOutput:
        """The completed output.

        Raises:
            ProviderError: the stream ended before the response completed.
        """
        final = self._final
        if final is None:
            raise ProviderError("the response stream ended before response.completed")
        # Some compatible servers send the items only as output_item.done events.
        return _output(final, final.output or self._done)

    def _added(self, event: ResponseOutputItemAddedEvent) -> list[StreamingDelta]:
        item = event.item
        if not isinstance(item, ResponseFunctionToolCall):
            return []
        index = self._call_index(event.output_index)
        # Arguments follow as deltas (the added item holds none yet).
        return [ToolCallDelta(index=index, call_id=item.call_id, name=item.name)]

    def _call_index(self, output_index: int) -> int:
        index = self._calls.get(output_index)
        if index is None:
            index = self._calls[output_index] = len(self._calls)
        return index
