"""Structured output modes: how a request asks for an answer that follows a
schema, and how a provider falls back when a server refuses one.

Nothing here imports a vendor SDK. Each built-in provider builds its own
request for a `Plan` (`native`: the API's JSON-schema format; `tool`: a final
answer tool; `prompted`: instructions with the schema, and a JSON response
format where the API has one), and hands its answer to `answer_of` (or its
stream to `AnswerStream`), which makes the final tool's call the answer's
`ModelMessageItem` and publishes the mode used on the output.

`Modes` sends a provider's requests (with a structured output or not) and is
what a provider instance remembers: in `auto` mode it tries the provider's
modes in order, and a mode a server refused (see `refuses`) is skipped by its
later requests of that model, once the next mode worked (of that schema only,
when the refusal was about the schema).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any, Final, Literal, NamedTuple, TypeAlias

from pydantic import BaseModel
from pydantic_core import from_json, to_json

from agentfsm._jsonschema import SchemaProblem, errors, validator
from agentfsm.exceptions import ProviderError
from agentfsm.inference import (
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    StreamEvent,
    StructuredOutputMode,
    TextDelta,
    ToolCallDelta,
)
from agentfsm.messages import FunctionCallItem, ModelMessageItem, OutputItem
from agentfsm.providers._common import structured_schema

__all__ = (
    "DETAIL_CHARS",
    "FINAL_TOOL",
    "NATIVE_FIRST",
    "NO_REASON",
    "TOOL_FIRST",
    "AnswerStream",
    "FinalTool",
    "Mode",
    "Modes",
    "Plan",
    "answer_of",
    "final_tool_name",
    "plan_of",
    "prompted_instructions",
)

Mode: TypeAlias = Literal["native", "tool", "prompted"]
"""A mode a request is actually sent in (`auto` resolves to one of these)."""

FINAL_TOOL: Final = "final_result"
"""The final answer tool's name (`final_result_2`, ... when a tool has it)."""

_WRAPPED: Final = "response"
"""The one property of the final tool's parameters when the schema is not an
object (tool parameters must be one): `{"response": <the answer>}`."""

NO_REASON: Final = "(the server gave no reason)"
"""The message of a provider error whose JSON body had an empty one."""

DETAIL_CHARS: Final = 300
"""How much of a server's error message an error quotes (llama.cpp's server
quotes a whole validation error, request included)."""

_REFUSAL_WORDS: Final[Mapping[Mode, tuple[str, ...]]] = {
    "native": (
        "response_format",
        "json_schema",
        "text.format",
        "output_config",
        "output format",
        "structured output",
    ),
    # Not "tool" or "function" alone: a user tool's own bad schema names them.
    "tool": (
        "tool_choice",
        "tool choice",
        "tools param",
        "support tools",
        "tools are not supported",
        "tool use",
        "tool calling",
        "function calling",
    ),
    "prompted": ("response_format", "json_object", "text.format"),
}
"""What a server's error names when it refuses what a mode sends (tool mode:
also the final tool's name)."""

_TRANSIENT_WORDS: Final = (
    "retry",
    "try again",
    "temporar",
    "overload",
    "unavailable",
    "timed out",
    "timeout",
    "rate limit",
)
"""An error saying one of these is passing, whatever else it names."""

_ABOUT_SCHEMA: Final = re.compile(r"\bschemas?\b", re.IGNORECASE)
"""An error about the schema itself ("Invalid schema for response_format
'Weather'"), not the mode: `json_schema`, the format's name, does not match."""

_PROMPT: Final = (
    "Give your final answer as a JSON value that follows this JSON schema, "
    "and nothing else (no prose, no code fences):\n{schema}"
)
_TOOL_DESCRIPTION: Final = (
    "Give your final answer by calling this tool: its arguments are the answer."
)


class FinalTool(NamedTuple):
    """The final answer tool of a `tool`-mode request."""

    name: str
    definition: dict[str, Any]
    """`{"name", "description", "parameters"}`, as `ToolDefinition.model_dump()` gives."""
    choice: str
    """The request's tool choice in tool mode: `required`, this tool's name, or
    the name of a user tool the request forces."""
    wrapped: bool
    """The schema is not an object: the answer is the arguments' `response`."""


class Plan(NamedTuple):
    """How one attempt of a request asks for its structured output."""

    mode: Mode
    final: FinalTool | None = None
    """The final answer tool (`tool` mode)."""
    instructions: str | None = None
    """The request's instructions with the schema prompt (`prompted` mode)."""
    output: type[BaseModel] | dict[str, Any] | None = None
    """The request's structured output (to choose between two final calls)."""


def final_tool_name(request: InferenceInput) -> str:
    """`final_result`, or `final_result_<n>` when one of the request's tools has it."""
    names = {tool.name for tool in request.tools}
    name, n = FINAL_TOOL, 1
    while name in names:
        n += 1
        name = f"{FINAL_TOOL}_{n}"
    return name


def _final_tool(
    request: InferenceInput, output: type[BaseModel] | dict[str, Any]
) -> FinalTool:
    schema = structured_schema(output)
    description = _TOOL_DESCRIPTION
    about = schema.get("description")
    if isinstance(about, str) and about:
        description = f"{description} {about}"
    wrapped = schema.get("type") != "object"
    if wrapped:
        # `$defs` stay at the root, so the `$ref`s into them still resolve.
        defs = schema.pop("$defs", None)
        schema = {
            "type": "object",
            "properties": {_WRAPPED: schema},
            "required": [_WRAPPED],
            "additionalProperties": False,
        }
        if defs is not None:
            schema["$defs"] = defs
    name = final_tool_name(request)
    choice = request.effective_tool_choice
    if choice in (None, "auto", "required"):
        # The model must call a tool; with no other tool, this one by name
        # (servers that have no `required`, llama.cpp's, know a named tool).
        choice = "required" if request.tools else name
    elif choice == "none":
        choice = name  # no tool but the answer
    definition = {"name": name, "description": description, "parameters": schema}
    return FinalTool(name, definition, choice, wrapped)


def prompted_instructions(
    request: InferenceInput, output: type[BaseModel] | dict[str, Any]
) -> str:
    """The request's instructions followed by the schema prompt."""
    schema = json.dumps(structured_schema(output), ensure_ascii=False)
    prompt = _PROMPT.format(schema=schema)
    instructions = request.context.instructions
    return f"{instructions}\n\n{prompt}" if instructions else prompt


def plan_of(request: InferenceInput, mode: Mode) -> Plan:
    """The plan of a request with a structured output, sent in `mode`."""
    output = request.structured_output
    assert output is not None
    if mode == "tool":
        return Plan(mode, final=_final_tool(request, output), output=output)
    if mode == "prompted":
        return Plan(mode, instructions=prompted_instructions(request, output))
    return Plan(mode)


# ----------------------------------------------------------------- the answer


def answer_of(output: InferenceOutput, plan: Plan) -> InferenceOutput:
    """`output` with the mode it was asked in, and in tool mode the final
    tool's call made the answer.

    The final tool's arguments become a `ModelMessageItem`, last, so the loop
    takes it to `model_message`, where it is validated (and retried) like any
    answer. Of two final calls or more, the answer is the first whose
    arguments follow the schema (the first, when none does: its validation
    error goes back to the model); the others are dropped. A final call beside
    calls of other tools is dropped: the tools run, and the model answers again
    once it has seen their outputs (an answer given with them could not have
    used them, and dropping the calls instead would skip what they do).
    """
    update: dict[str, Any] = {"structured_output_mode": plan.mode}
    final = plan.final
    if final is not None:
        calls = [i for i in output.items if isinstance(i, FunctionCallItem)]
        finals = [c for c in calls if c.name == final.name]
        if finals:
            items: list[OutputItem] = [
                i
                for i in output.items
                if not (isinstance(i, FunctionCallItem) and i.name == final.name)
            ]
            if len(finals) == len(calls):
                texts = [_answer_text(c.arguments, final) for c in finals]
                items.append(ModelMessageItem(content=_chosen(texts, plan.output)))
                if output.finish_reason == "tool_calls":
                    update["finish_reason"] = "stop"
            update["items"] = tuple(items)
    return output.model_copy(update=update)


def _answer_text(arguments: str, final: FinalTool) -> str:
    if not final.wrapped:
        return arguments
    try:
        value = from_json(arguments or "null")
    except ValueError:
        return arguments  # validation reports it, and the model tries again
    if isinstance(value, dict) and _WRAPPED in value:
        return to_json(value[_WRAPPED]).decode()
    return arguments


def _chosen(texts: list[str], output: type[BaseModel] | dict[str, Any] | None) -> str:
    """The first of the final calls' answers that follows the schema, else the first."""
    if len(texts) == 1 or output is None:
        return texts[0]
    return next((t for t in texts if _valid(t, output)), texts[0])


def _valid(text: str, output: type[BaseModel] | dict[str, Any]) -> bool:
    try:
        if isinstance(output, dict):
            check = validator(output, draft="2020-12", checked=True)
            return not errors(check, from_json(text))
        output.model_validate_json(text)
    except (ValueError, SchemaProblem):  # a ValidationError is a ValueError
        return False
    return True


class AnswerStream:
    """A provider's stream as the request's structured output sees it.

    In tool mode the final tool's argument chunks are held back: which call
    is the answer (or whether there is one: a call of another tool beside it
    drops it) is known only when the output is complete, and the stream's text
    must be the answer's. The answer's text is then published as one
    `TextDelta`, just before the completed output (which is `answer_of` it);
    other calls keep their order, numbered without the final ones. A class,
    not an async generator: one left unfinished would be finalized by the
    garbage collector.
    """

    __slots__ = ("_events", "_final", "_indices", "_pending", "_plan")

    def __init__(self, events: AsyncIterator[StreamEvent], plan: Plan) -> None:
        self._events = events
        self._plan = plan
        self._final: set[int] = set()
        self._indices: dict[int, int] = {}
        self._pending: StreamEvent | None = None

    def __aiter__(self) -> AnswerStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._pending is not None:
            event, self._pending = self._pending, None
            return event
        while True:
            event = await self._events.__anext__()
            mapped = self._map(event)
            if mapped is not None:
                return mapped

    def _map(self, event: StreamEvent) -> StreamEvent | None:
        if isinstance(event, OutputCompleted):
            completed = OutputCompleted(output=answer_of(event.output, self._plan))
            message = completed.output.message
            if self._plan.final is None or message is None or not message.content:
                return completed
            self._pending = completed
            return TextDelta(text=message.content)
        final = self._plan.final
        if final is None or not isinstance(event, ToolCallDelta):
            return event
        index = event.index
        if index in self._final or event.name == final.name:
            self._final.add(index)
            return None
        mapped = self._indices.setdefault(index, len(self._indices))
        if mapped == index:
            return event
        return event.model_copy(update={"index": mapped})


# ------------------------------------------------------------------- fallback


def refuses(error: ProviderError, plan: Plan, *, vendor: bool = False) -> bool:
    """Whether `error` is a server refusing what `plan`'s mode sends.

    That is an HTTP 400 or 422 (or, on a server that is not the vendor's own
    API, a 500: llama.cpp's server answers a request it cannot parse with one)
    whose message names what the mode sends and says nothing of being
    transient. In tool mode on such a server an empty message counts too:
    llama.cpp's server, asked for a tool choice its chat format lacks
    (`required`), fails an assertion with none.

    Args:
        vendor: the server is the API's own (OpenAI's, Anthropic's), whose 5xx
            errors are its own failures, never a refusal.
    """
    status = error.status_code
    if status not in (400, 422) and (vendor or status != 500):
        return False
    text = str(error)
    if text.endswith(NO_REASON):
        return not vendor and plan.mode == "tool"
    text = text.lower()
    if any(word in text for word in _TRANSIENT_WORDS):
        return False
    words = _REFUSAL_WORDS[plan.mode]
    if plan.final is not None:
        words = (*words, plan.final.name)
    return any(word in text for word in words)


def _about_schema(error: ProviderError) -> bool:
    return _ABOUT_SCHEMA.search(str(error)) is not None


def _digest(request: InferenceInput) -> str:
    output = request.structured_output
    assert output is not None
    text = json.dumps(structured_schema(output), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


Send: TypeAlias = Callable[[InferenceInput, Plan | None], Awaitable[InferenceOutput]]
"""A provider's request: `(request, plan)` (no plan: no structured output)."""

Open: TypeAlias = Callable[
    [InferenceInput, Plan | None],
    AbstractAsyncContextManager[AsyncIterator[StreamEvent]],
]
"""A provider's streaming request, as `Send`."""


NATIVE_FIRST: Final[tuple[Mode, ...]] = ("native", "tool", "prompted")
"""`auto` on an API with a JSON-schema format (OpenAI's, Anthropic's)."""
TOOL_FIRST: Final[tuple[Mode, ...]] = ("tool", "prompted")
"""`auto` on a server whose JSON-schema support is unknown."""

_Refusal: TypeAlias = tuple[str, str | None, Mode]
"""`(model, schema digest or None for every schema, mode)`."""


class Modes:
    """How one provider instance sends its requests' structured output, and
    what it learnt of its server.

    Args:
        auto: the modes `auto` tries, in order (the provider's choice: what its
            API or server does best first), or a function of the request
            giving them.
        vendor: the server is the API's own (OpenAI's, Anthropic's): its 5xx
            errors are never taken as a refusal (see `refuses`).
    """

    __slots__ = ("_auto", "_refused", "_vendor")

    def __init__(
        self,
        auto: tuple[Mode, ...] | Callable[[InferenceInput], tuple[Mode, ...]],
        *,
        vendor: bool = False,
    ) -> None:
        self._auto = auto
        self._vendor = vendor
        self._refused: dict[str, dict[str | None, set[Mode]]] = {}
        """`model -> schema digest (None: any schema) -> the modes refused`."""

    def modes(self, request: InferenceInput) -> tuple[Mode, ...]:
        """The modes to try for `request`, in order."""
        asked: StructuredOutputMode = request.structured_output_mode
        if asked != "auto":
            return (asked,)
        modes = self._auto if isinstance(self._auto, tuple) else self._auto(request)
        learnt = self._refused.get(request.model)
        if learnt:
            refused = set(learnt.get(None, ()))
            if any(digest is not None for digest in learnt):
                refused |= learnt.get(_digest(request), set())
            left = tuple(m for m in modes if m not in refused)
            modes = left or modes[-1:]
        return modes

    def plan(self, request: InferenceInput, mode: Mode | None = None) -> Plan | None:
        """How `request` asks for its structured output in `mode` (default: the
        first mode its provider tries); `None` without one."""
        if request.structured_output is None:
            return None
        return plan_of(request, self.modes(request)[0] if mode is None else mode)

    def _refusal(
        self, request: InferenceInput, plan: Plan, error: ProviderError, last: bool
    ) -> _Refusal | None:
        """What to remember (once the next mode works) when `error` is the
        server refusing `plan` in `auto` mode and another mode is left."""
        if (
            last
            or request.structured_output_mode != "auto"
            or not refuses(error, plan, vendor=self._vendor)
        ):
            return None
        digest = _digest(request) if _about_schema(error) else None
        return (request.model, digest, plan.mode)

    def _note_refusal(
        self,
        exc: ProviderError,
        request: InferenceInput,
        plan: Plan,
        last: bool,
        refusals: list[_Refusal],
    ) -> None:
        """A request's `exc`: a refusal of `plan`'s mode joins `refusals` (the
        next mode is tried); anything else is raised again, a final refusal as
        what `_raise_refused` makes of it."""
        refusal = self._refusal(request, plan, exc, last)
        if refusal is None:
            self._raise_refused(exc, request, plan)
            raise exc
        refusals.append(refusal)

    def _remember(self, refusals: list[_Refusal]) -> None:
        for model, digest, mode in refusals:
            self._refused.setdefault(model, {}).setdefault(digest, set()).add(mode)

    async def complete(self, request: InferenceInput, send: Send) -> InferenceOutput:
        """Send `request` (without a structured output: as it is; with one: in
        the first mode the server takes)."""
        if request.structured_output is None:
            return await send(request, None)
        modes = self.modes(request)
        refusals: list[_Refusal] = []
        for position, mode in enumerate(modes):
            plan = plan_of(request, mode)
            try:
                output = await send(request, plan)
            except ProviderError as exc:
                self._note_refusal(
                    exc, request, plan, position == len(modes) - 1, refusals
                )
                continue
            self._remember(refusals)
            return answer_of(output, plan)
        raise AssertionError("unreachable: the last mode raises or returns")

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, open_: Open
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """Open `request`'s stream as `complete` sends it (a refusal comes as
        the stream opens, before any chunk)."""
        if request.structured_output is None:
            async with open_(request, None) as events:
                yield events
            return
        modes = self.modes(request)
        refusals: list[_Refusal] = []
        for position, mode in enumerate(modes):
            plan = plan_of(request, mode)
            stack = AsyncExitStack()
            try:
                events = await stack.enter_async_context(open_(request, plan))
            except ProviderError as exc:
                self._note_refusal(
                    exc, request, plan, position == len(modes) - 1, refusals
                )
                continue
            self._remember(refusals)
            async with stack:
                yield AnswerStream(events, plan)
            return
        raise AssertionError("unreachable: the last mode raises or yields")

    def _raise_refused(
        self, error: ProviderError, request: InferenceInput, plan: Plan
    ) -> None:
        """Raise an error naming the modes to try instead, when `error` is the
        server refusing `plan`'s mode (final: the same request would only be
        refused again; unless all the server said was an empty 500, which a
        passing failure may give too)."""
        if not refuses(error, plan, vendor=self._vendor):
            return
        detail = str(error)
        if len(detail) > DETAIL_CHARS:
            detail = detail[:DETAIL_CHARS] + "..."
        mode = plan.mode
        if request.structured_output_mode == "auto":
            hint = "the server refused every structured output mode auto tries"
        else:
            others = " or ".join(
                repr(m) for m in ("tool", "prompted", "native") if m != mode
            )
            hint = (
                f"the server refused structured output mode {mode!r}: try "
                f"structured_output_mode={others}, or 'auto'"
            )
        retryable = error.retryable and str(error).endswith(NO_REASON)
        raise ProviderError(
            f"{hint} ({detail})", retryable=retryable, status_code=error.status_code
        ) from error
