"""The Chat Completions mapping: requests, completions and stream chunks.

Imported only by `agentfsm.providers.openai`, after it checked the SDK is there.
Chat Completions is what OpenAI-compatible servers (vLLM, llama.cpp's server,
Ollama, LM Studio) speak, so the mapping asks for nothing beyond the common
ground and reads the `reasoning_content` / `reasoning` fields those servers add.

| agentfsm                    | Chat Completions                                       |
|-----------------------------|--------------------------------------------------------|
| `ModelContext.instructions` | a `system` message, first                              |
| `UserMessage`               | a `user` message (text, or `text` / `image_url` parts) |
| `ModelMessageItem`          | an `assistant` message                                 |
| `FunctionCallItem`s of a turn | one `assistant` message's `tool_calls` (content `""`) |
| `FunctionCallOutputItem`    | a `tool` message (text only: an image is a line of text) |
| `ReasoningItem`             | not sent (the API has no place for it)                 |

An image in a user message is an `image_url` part of its URL, or of its bytes
as a `data:` URL. A `tool` message holds text only, so each image of a tool's
output is sent as a line of text after it, its reference (`[image: image/png,
70 bytes, sha256:...]`), and the output's `images_described` names it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, assert_never

from openai.lib._pydantic import to_strict_json_schema
from openai.types import CompletionUsage
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessageFunctionToolCall,
)
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall
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
    UsageUpdate,
)
from agentfsm.providers._common import (
    ImageMapping,
    count,
    image_url,
    new_call_id,
    schema_name,
    strict_compatible,
    structured_schema,
)
from agentfsm.providers._structured import Plan

__all__ = ("ChatStream", "chat_messages", "output_of", "request_params")

_REASONING_FIELDS = ("reasoning_content", "reasoning")
"""Where compatible servers put reasoning text (OpenAI itself sends none)."""

# --------------------------------------------------------------------- requests


def request_params(
    request: InferenceInput,
    model: str,
    *,
    max_tokens_field: str,
    plan: Plan | None = None,
    json_schema_in_json_object: bool = False,
    images: ImageMapping | None = None,
) -> dict[str, Any]:
    """The keyword arguments of `client.chat.completions.create` for a request.

    `plan` says how its structured output is asked for (none: not at all);
    `json_schema_in_json_object` adds the schema to a prompted request's
    `json_object` format, which OpenAI refuses and llama.cpp's server turns
    into a grammar; `images` what the model takes (default: images in user
    messages) and which tool-result images were described.

    Raises:
        ImageNotSupported: a user message holds an image the model cannot take.
    """
    instructions = request.context.instructions
    if plan is not None and plan.instructions is not None:
        instructions = plan.instructions
    if images is None:
        images = ImageMapping(request.model, ImageSupport(tool_results=False))
    params: dict[str, Any] = {
        "model": model,
        "messages": chat_messages(instructions, request.context.items, images),
    }
    if request.max_output_tokens is not None:
        params[max_tokens_field] = request.max_output_tokens
    if request.reasoning_effort is not None:
        params["reasoning_effort"] = request.reasoning_effort
    if request.temperature is not None:
        params["temperature"] = request.temperature
    if request.top_p is not None:
        params["top_p"] = request.top_p
    if request.seed is not None:
        params["seed"] = request.seed
    if request.stop_sequences:
        params["stop"] = list(request.stop_sequences)
    if request.tools:
        params["tools"] = [_tool(t.definition.model_dump()) for t in request.tools]
        # Servers reject `parallel_tool_calls` on a request without tools.
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
            params["response_format"] = _response_format(output)
        elif plan.mode == "prompted":
            params["response_format"] = {"type": "json_object"}
            if json_schema_in_json_object:
                params["response_format"]["schema"] = structured_schema(output)
    if request.extra_body is not None:
        params["extra_body"] = request.extra_body
    return params


def chat_messages(
    instructions: str | None, items: Sequence[ContextItem], images: ImageMapping
) -> list[dict[str, Any]]:
    """The instructions and the context as chat messages.

    Raises:
        ImageNotSupported: a user message holds an image the model cannot take.
    """
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if isinstance(item, UserMessage):
            messages.append({"role": "user", "content": _user_content(item, images)})
        elif isinstance(item, ModelMessageItem):
            text = item.content or item.refusal or ""
            messages.append({"role": "assistant", "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            # A turn's text and its calls are one assistant message; a message
            # with tool calls still carries content "" (some servers reject None).
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(
                    {"role": "assistant", "content": "", "tool_calls": [call]}
                )
        elif isinstance(item, FunctionCallOutputItem):
            text, _ = images.tool_output(item, takes_images=False)
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": text}
            )
        elif not isinstance(item, ReasoningItem):  # reasoning has no place here
            assert_never(item)
    return messages


def _user_content(
    message: UserMessage, images: ImageMapping
) -> str | list[dict[str, Any]]:
    content = message.content
    if isinstance(content, str):
        return content
    images.check_user(message)
    return [
        {"type": "image_url", "image_url": {"url": image_url(block)}}
        if isinstance(block, ImageBlock)
        else {"type": "text", "text": block.text}
        for block in content
    ]


def _tool(definition: dict[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {
        "name": definition["name"],
        "description": definition["description"],
        "parameters": definition["parameters"],
    }
    if strict_compatible(definition["parameters"]):
        function["strict"] = True
    return {"type": "function", "function": function}


def _tool_choice(choice: str) -> str | dict[str, Any]:
    if choice in TOOL_CHOICE_MODES:
        return choice
    return {"type": "function", "function": {"name": choice}}


def _response_format(output: type[BaseModel] | dict[str, Any]) -> dict[str, Any]:
    if isinstance(output, dict):
        schema = structured_schema(output)
        strict = strict_compatible(schema)
    else:
        # The SDK's own transform, as its `chat.completions.parse()` uses for models.
        schema = to_strict_json_schema(output)
        strict = True
    return {
        "type": "json_schema",
        "json_schema": {
            "name": schema_name(output),
            "schema": schema,
            "strict": strict,
        },
    }


# ------------------------------------------------------------------ completions


def output_of(completion: ChatCompletion) -> InferenceOutput:
    """A complete `ChatCompletion` as an `InferenceOutput`.

    Raises:
        ProviderError: the completion holds no choice.
    """
    if not completion.choices:
        raise ProviderError("the chat completion holds no choices")
    choice = completion.choices[0]
    message = choice.message
    calls = [
        FunctionCallItem(
            call_id=call.id or new_call_id(),
            name=call.function.name,
            arguments=call.function.arguments or "",
        )
        for call in message.tool_calls or ()
        if isinstance(call, ChatCompletionMessageFunctionToolCall)
    ]
    items = _items(
        _reasoning(message), message.content or "", message.refusal or None, calls
    )
    return InferenceOutput(
        items=items,
        token_usage=usage_of(completion.usage),
        raw_response=completion.model_dump(mode="json", warnings=False),
        finish_reason=choice.finish_reason,
    )


def _items(
    reasoning: str, text: str, refusal: str | None, calls: Sequence[FunctionCallItem]
) -> tuple[OutputItem, ...]:
    items: list[OutputItem] = []
    if reasoning:
        items.append(ReasoningItem(content=reasoning))
    if text or refusal is not None or not calls:
        items.append(ModelMessageItem(content=text, refusal=refusal))
    items.extend(calls)
    return tuple(items)


def _reasoning(message: object) -> str:
    for name in _REASONING_FIELDS:
        value = getattr(message, name, None)
        if isinstance(value, str) and value:
            return value
    return ""


def usage_of(usage: CompletionUsage | None) -> TokenUsage | None:
    """The completion's token counts."""
    if usage is None:
        return None
    return TokenUsage(
        input_tokens=count(usage, "prompt_tokens"),
        output_tokens=count(usage, "completion_tokens"),
        reasoning_tokens=count(
            getattr(usage, "completion_tokens_details", None), "reasoning_tokens"
        ),
        cached_input_tokens=count(
            getattr(usage, "prompt_tokens_details", None), "cached_tokens"
        ),
    )


# ---------------------------------------------------------------------- streams


class _Call:
    __slots__ = ("arguments", "call_id", "name")

    def __init__(self) -> None:
        self.call_id: str | None = None
        self.name: str | None = None
        self.arguments: list[str] = []


class ChatStream:
    """Maps completion chunks onto deltas and assembles the completed output.

    Tool-call chunks carry an `index`; the first chunk of a call has its `id`
    and name, and servers differ in whether later chunks repeat them: they are
    set, never appended, while `arguments` text is appended. A chunk that
    brings a different `id` under an index already in use starts a new call
    (some servers number every call 0).
    """

    __slots__ = (
        "_calls",
        "_finish",
        "_meta",
        "_reasoning",
        "_refusal",
        "_slots",
        "_text",
        "_usage",
    )

    def __init__(self) -> None:
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._refusal: list[str] = []
        self._calls: list[_Call] = []
        self._slots: dict[int, int] = {}
        """`chunk tool-call index -> position in _calls`."""
        self._finish: str | None = None
        self._usage: CompletionUsage | None = None
        self._meta: dict[str, Any] | None = None

    def feed(self, chunk: ChatCompletionChunk) -> list[StreamingDelta | UsageUpdate]:
        """The deltas one chunk carries, and its usage, if it reports one."""
        if self._meta is None:
            self._meta = {
                "id": chunk.id,
                "created": chunk.created,
                "model": chunk.model,
                "system_fingerprint": chunk.system_fingerprint,
            }
        deltas: list[StreamingDelta | UsageUpdate] = []
        if chunk.usage is not None:  # the last chunk, when include_usage is asked
            self._usage = chunk.usage
            usage = usage_of(chunk.usage)
            if usage is not None:
                deltas.append(UsageUpdate(usage=usage))
        for choice in chunk.choices:
            if choice.index != 0:
                continue
            delta = choice.delta
            reasoning = _reasoning(delta)
            if reasoning:
                self._reasoning.append(reasoning)
                deltas.append(ReasoningDelta(text=reasoning))
            if delta.content:
                self._text.append(delta.content)
                deltas.append(TextDelta(text=delta.content))
            if delta.refusal:
                self._refusal.append(delta.refusal)
            for call in delta.tool_calls or ():
                deltas.extend(self._tool_call(call))
            if choice.finish_reason is not None:
                self._finish = choice.finish_reason
        return deltas

    def output(self) -> InferenceOutput:
        """The completed output, its raw response assembled from the chunks.

        Raises:
            ProviderError: the stream sent no chunk.
        """
        if self._meta is None:
            raise ProviderError("the chat completion stream ended without a chunk")
        calls = [
            FunctionCallItem(
                call_id=c.call_id or new_call_id(),
                name=c.name or "",
                arguments="".join(c.arguments),
            )
            for c in self._calls
        ]
        text = "".join(self._text)
        refusal = "".join(self._refusal) if self._refusal else None
        reasoning = "".join(self._reasoning)
        return InferenceOutput(
            items=_items(reasoning, text, refusal, calls),
            token_usage=usage_of(self._usage),
            raw_response=self._raw(text, refusal, reasoning, calls),
            finish_reason=self._finish,
        )

    def _tool_call(self, chunk: ChoiceDeltaToolCall) -> list[StreamingDelta]:
        slot = self._slots.get(chunk.index)
        call = None if slot is None else self._calls[slot]
        if call is None or (chunk.id and call.call_id and chunk.id != call.call_id):
            slot = self._slots[chunk.index] = len(self._calls)
            call = _Call()
            self._calls.append(call)
        assert slot is not None
        function = chunk.function
        new_id = chunk.id if chunk.id and chunk.id != call.call_id else None
        name = function.name if function is not None else None
        new_name = name if name and name != call.name else None
        arguments = (function.arguments if function is not None else None) or ""
        if new_id:
            call.call_id = new_id
        if new_name:
            call.name = new_name
        call.arguments.append(arguments)
        if new_id is None and new_name is None and not arguments:
            return []
        return [
            ToolCallDelta(
                index=slot, call_id=new_id, name=new_name, arguments=arguments
            )
        ]

    def _raw(
        self,
        text: str,
        refusal: str | None,
        reasoning: str,
        calls: Sequence[FunctionCallItem],
    ) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text or None,
            "refusal": refusal,
        }
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [
                {
                    "id": c.call_id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        usage = self._usage
        return {
            **(self._meta or {}),
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": message, "finish_reason": self._finish}
            ],
            "usage": None
            if usage is None
            else usage.model_dump(mode="json", warnings=False),
        }
