"""Requests and responses of llama-cpp-python's OpenAI-shaped chat API.

Pure functions, no llama-cpp-python import: `request_kwargs` builds the
keyword arguments of `Llama.create_chat_completion` for an `InferenceInput`;
`completion_output` reads a chat completion back; `ChunkAssembler` reads a
stream of chunks as deltas and assembles the output. `agentfsm.providers.local`
uses them, and re-exports them.
"""

from __future__ import annotations

import json
from typing import Any, Final

from agentfsm.exceptions import ConfigurationError
from agentfsm.messages import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ModelMessageItem,
    OutputItem,
    ReasoningItem,
    TokenUsage,
    UserMessage,
)
from agentfsm.providers import (
    NO_IMAGES,
    InferenceInput,
    InferenceOutput,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
)
from agentfsm.providers._common import ImageMapping, structured_schema
from agentfsm.providers._structured import Plan, plan_of

__all__ = (
    "DEFAULT_TEMPERATURE",
    "SAMPLING_PARAMETERS",
    "ChunkAssembler",
    "chat_messages",
    "completion_output",
    "request_kwargs",
    "structured_plan",
)


DEFAULT_TEMPERATURE: Final = 0.2
"""The local model's temperature when the request sets none: low, so a small
model answers sensibly (at llama.cpp's server default, 0.8, SmolLM2-135M answers
"What is the capital of France?" with nonsense; at 0.2, "Paris")."""


def chat_messages(
    request: InferenceInput,
    *,
    instructions: str | None = None,
    tools: bool = False,
    images: ImageMapping | None = None,
) -> list[dict[str, Any]]:
    """The request's instructions and context as OpenAI-shaped chat messages.

    Function calls join the assistant message before them (content `""`, never
    `None`); tool outputs become user messages naming the call, since the
    `chatml-function-calling` template drops the content of `tool` messages.
    With tools (the request's, or others: `tools=True`) there is always a
    system message, since the template lists the tools in it. Reasoning items
    are not sent. `instructions` replace the context's.

    The template renders text only: a tool's images are each a line of text
    after its output (their reference), recorded in `images` (made here when
    not given).

    Raises:
        ImageNotSupported: a user message holds an image.
    """
    if images is None:
        images = ImageMapping(request.model, NO_IMAGES)
    messages: list[dict[str, Any]] = []
    system = instructions or request.context.instructions
    if system or request.tools or tools:
        messages.append({"role": "system", "content": system or ""})
    names: dict[str, str] = {}
    # When the request's tools may not be called now (a forced tool has
    # answered), the template shows no tool format, and a small model shown its
    # calls as `functions.add:` lines imitates them instead of answering: each
    # call is told in its result's message instead ("Result of add(a=2, b=3)").
    told = bool(request.tools) and not tools and request.effective_tool_choice == "none"
    for item in request.context.items:
        if isinstance(item, UserMessage):
            images.check_user(item)
            messages.append({"role": "user", "content": item.text})
        elif isinstance(item, ModelMessageItem):
            messages.append({"role": "assistant", "content": item.content})
        elif isinstance(item, FunctionCallItem) and told:
            names[item.call_id] = _call_text(item)
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(
                {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
            )
        elif isinstance(item, FunctionCallOutputItem):
            name = names.get(item.call_id, "the tool")
            what = "Error from" if item.is_error else "Result of"
            output, _ = images.tool_output(item, takes_images=False)
            messages.append({"role": "user", "content": f"{what} {name}: {output}"})
        else:
            assert isinstance(item, ReasoningItem)
    return messages


def _call_text(call: FunctionCallItem) -> str:
    """A call as prose shows it: `add(a=2, b=3)` (its raw arguments when they
    are not a JSON object)."""
    try:
        arguments = json.loads(call.arguments or "{}")
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        return f"{call.name}({call.arguments})"
    shown = ", ".join(f"{k}={json.dumps(v)}" for k, v in arguments.items())
    return f"{call.name}({shown})"


def _tool_choice(choice: str | None, names: list[str]) -> str | dict[str, Any]:
    choice = choice or "auto"
    if choice in ("auto", "none"):
        return choice
    if choice == "required":
        # chatml-function-calling has no `required`: force the only tool, or let
        # the model choose among several.
        if len(names) == 1:
            return {"type": "function", "function": {"name": names[0]}}
        return "auto"
    if choice not in names:
        offered = ", ".join(names) or "none"
        raise ConfigurationError(
            f"tool_choice {choice!r} names no tool of the request (offered: {offered})"
        )
    return {"type": "function", "function": {"name": choice}}


SAMPLING_PARAMETERS: Final = frozenset(
    {
        "top_k",
        "min_p",
        "typical_p",
        "presence_penalty",
        "frequency_penalty",
        "repeat_penalty",
        "tfs_z",
        "mirostat_mode",
        "mirostat_tau",
        "mirostat_eta",
    }
)
"""The `extra_body` keys the local model takes: llama.cpp's own sampling
parameters of `Llama.create_chat_completion`, each a number."""


def structured_plan(request: InferenceInput) -> Plan | None:
    """How the local model asks for the request's structured output: `auto` is
    a grammar built from the schema (`native`) when no tool may be called, and
    the final answer tool (whose arguments are generated under a grammar too)
    when one may."""
    if request.structured_output is None:
        return None
    mode = request.structured_output_mode
    if mode == "auto":
        no_tool = not request.tools or request.effective_tool_choice == "none"
        mode = "native" if no_tool else "tool"
    return plan_of(request, mode)


def _sampling(extra_body: dict[str, Any]) -> dict[str, Any]:
    """`extra_body` as keyword arguments of `create_chat_completion`."""
    unknown = sorted(set(extra_body) - SAMPLING_PARAMETERS)
    if unknown:
        raise ConfigurationError(
            f"the local provider has no parameter {', '.join(map(repr, unknown))} "
            f"for extra_body: it takes {', '.join(sorted(SAMPLING_PARAMETERS))}"
        )
    for key, value in extra_body.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigurationError(
                f"extra_body[{key!r}] must be a number for the local provider, "
                f"got {type(value).__name__}"
            )
    return dict(extra_body)


def request_kwargs(
    request: InferenceInput,
    plan: Plan | None = None,
    *,
    images: ImageMapping | None = None,
) -> dict[str, Any]:
    """The keyword arguments of `Llama.create_chat_completion` for a request
    (`plan`: how its structured output is asked for; default: `structured_plan`;
    `images`: records the tool-result images sent as text, see `chat_messages`).

    Raises:
        ConfigurationError: `tool_choice` names a tool the request does not
            offer, `parallel_tool_calls=False` (which llama.cpp cannot honour),
            or `extra_body` has a key that is not one of `SAMPLING_PARAMETERS`.
        ImageNotSupported: a user message holds an image (a
            `ConfigurationError` too).
    """
    if plan is None:
        plan = structured_plan(request)
    final = None if plan is None else plan.final
    kwargs: dict[str, Any] = {
        "messages": chat_messages(
            request,
            instructions=None if plan is None else plan.instructions,
            tools=final is not None,
            images=images,
        )
    }
    tool_choice: str | dict[str, Any] = "none"
    definitions = [t.definition.model_dump() for t in request.tools]
    if final is not None:
        definitions.append(final.definition)
    if definitions:
        kwargs["tools"] = [{"type": "function", "function": d} for d in definitions]
        choice = request.effective_tool_choice if final is None else final.choice
        tool_choice = _tool_choice(choice, [d["name"] for d in definitions])
        kwargs["tool_choice"] = tool_choice
    if request.max_output_tokens is not None:
        kwargs["max_tokens"] = request.max_output_tokens
    if request.tools and request.parallel_tool_calls is False:
        raise ConfigurationError(
            "the local provider has no parallel_tool_calls setting (llama.cpp's "
            "chatml-function-calling has no way to ask for one call at most)"
        )
    kwargs["temperature"] = (
        DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
    )
    if request.top_p is not None:
        kwargs["top_p"] = request.top_p
    if request.seed is not None:
        kwargs["seed"] = request.seed
    if request.stop_sequences:
        kwargs["stop"] = list(request.stop_sequences)
    output = request.structured_output
    if output is not None and plan is not None and tool_choice == "none":
        # llama-cpp-python spells a JSON-schema answer `json_object` + `schema`
        # and turns it into a grammar (only when no tool may be called); a
        # bare `json_object` is any JSON.
        if plan.mode == "native":
            kwargs["response_format"] = {
                "type": "json_object",
                "schema": structured_schema(output),
            }
        elif plan.mode == "prompted":
            kwargs["response_format"] = {"type": "json_object"}
    if request.extra_body is not None:
        kwargs.update(_sampling(request.extra_body))
    return kwargs


def _usage(usage: Any) -> TokenUsage | None:
    if not isinstance(usage, dict):
        return None
    return TokenUsage(
        input_tokens=int(usage.get("prompt_tokens") or 0),
        output_tokens=int(usage.get("completion_tokens") or 0),
    )


def _output_items(
    content: str, calls: list[tuple[str, str, str]]
) -> tuple[OutputItem, ...]:
    items: list[OutputItem] = []
    if content or not calls:
        items.append(ModelMessageItem(content=content))
    items.extend(
        FunctionCallItem(call_id=call_id, name=name, arguments=arguments)
        for call_id, name, arguments in calls
    )
    return tuple(items)


def completion_output(response: dict[str, Any]) -> InferenceOutput:
    """Our output for a (non-streaming) OpenAI-shaped chat completion."""
    choice = response["choices"][0]
    message = choice.get("message") or {}
    calls = [
        (
            call.get("id") or f"call_{index}",
            call["function"]["name"],
            call["function"].get("arguments") or "",
        )
        for index, call in enumerate(message.get("tool_calls") or ())
    ]
    return InferenceOutput(
        items=_output_items(message.get("content") or "", calls),
        token_usage=_usage(response.get("usage")),
        raw_response=response,
        finish_reason=choice.get("finish_reason"),
    )


class ChunkAssembler:
    """Turns OpenAI-shaped chat completion chunks into deltas and an output.

    Tool-call chunks repeat the call's id and name: they are set, never
    appended; only the arguments are appended.

    Example:
        ```python
        assembler = ChunkAssembler()
        for chunk in chunks:
            deltas.extend(assembler.add(chunk))
        output = assembler.output()
        ```
    """

    __slots__ = ("_calls", "_text", "finish_reason", "model", "response_id", "usage")

    def __init__(self) -> None:
        self._text: list[str] = []
        self._calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
        self.finish_reason: str | None = None
        self.usage: TokenUsage | None = None
        self.response_id: str | None = None
        self.model: str | None = None

    def add(self, chunk: dict[str, Any]) -> list[StreamEvent]:
        """Take one chunk; return the deltas it carries."""
        self.response_id = self.response_id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        deltas: list[StreamEvent] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self._text.append(delta["content"])
                deltas.append(TextDelta(text=delta["content"]))
            for call in delta.get("tool_calls") or ():
                deltas.extend(self._add_call(call))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return deltas

    def _add_call(self, call: dict[str, Any]) -> list[StreamEvent]:
        index = int(call.get("index") or 0)
        function = call.get("function") or {}
        arguments = function.get("arguments") or ""
        known = self._calls.get(index)
        if known is None:
            known = self._calls[index] = [
                call.get("id") or f"call_{index}",
                function.get("name") or "",
                arguments,
            ]
            return [
                ToolCallDelta(
                    index=index, call_id=known[0], name=known[1], arguments=arguments
                )
            ]
        known[0] = call.get("id") or known[0]
        known[1] = function.get("name") or known[1]
        known[2] += arguments
        return [ToolCallDelta(index=index, arguments=arguments)] if arguments else []

    def cut(self) -> None:
        """Mark the output as cut at the token limit."""
        self.finish_reason = "length"

    def output(self, usage: TokenUsage | None = None) -> InferenceOutput:
        """The completed output (`usage` when the chunks carried none)."""
        calls = [tuple(self._calls[i]) for i in sorted(self._calls)]
        content = "".join(self._text)
        usage = self.usage or usage
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": c, "type": "function", "function": {"name": n, "arguments": a}}
                for c, n, a in calls
            ]
        raw: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion",
            "model": self.model,
            "choices": [
                {"index": 0, "message": message, "finish_reason": self.finish_reason}
            ],
            "usage": None
            if usage is None
            else {
                "prompt_tokens": usage.input_tokens,
                "completion_tokens": usage.output_tokens,
                "total_tokens": usage.total_tokens,
            },
        }
        return InferenceOutput(
            items=_output_items(content, [(c, n, a) for c, n, a in calls]),
            token_usage=usage,
            raw_response=raw,
            finish_reason=self.finish_reason,
        )
