"""`model_message`: the model's answer enters the context and is published.

The payload is the `ModelMessageItem` (a handler may have rewritten it). It is
written to the context after the output's other items (reasoning), and kept as
the turn's message. With a structured output it is validated first: a valid
answer is published as `model.answer` (with the parsed value); an invalid one
is not, and is sent back to the model with the validation error, until
`structured_output_retries` runs out (then the loop fails). An answer the
provider took from its final answer tool (`structured_output_mode="tool"`)
arrives here as a message like any other: only the retry's wording differs. A
`prompted` answer, which nothing but the prompt keeps to JSON, is validated as
the JSON document in it (in a code fence, or after a sentence).

Next: `follow_up` when the answer is retried or messages are queued (steering
first), unless a limit or stop condition ends the loop, which `finish`es with
that reason; else `finish`. The driver decides the outcome when `finish` is
taken (`driver.end`): a handler may still rewrite either edge.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Final

from pydantic import BaseModel, ValidationError
from pydantic_core import from_json

from agentfsm._errors import error_text
from agentfsm._loop.steps import _T, Step
from agentfsm._loop.turn import drain, finish_turn, stop_check, write
from agentfsm.exceptions import StructuredOutputError
from agentfsm.interception import TransitionPayload
from agentfsm.messages import (
    ContextItem,
    FunctionCallItem,
    ModelMessageItem,
    UserMessage,
)
from agentfsm.tools import format_validation_error

if TYPE_CHECKING:
    from agentfsm._loop.loop import Loop

__all__ = ("jsonable", "model_message")


async def model_message(loop: Loop, payload: TransitionPayload) -> Step:
    message = (
        payload
        if isinstance(payload, ModelMessageItem)
        else ModelMessageItem(content="")
    )
    output, loop.output = loop.output, None
    items: list[ContextItem] = []
    if output is not None:
        items.extend(
            i
            for i in output.items
            if not isinstance(i, FunctionCallItem | ModelMessageItem)
        )
    items.append(message)
    write(loop, items)
    loop.message = message
    loop.answer_at = len(loop.input.context.items) - 1
    schema = loop.request.structured_output
    problem = None
    if schema is not None:
        mode = None if output is None else output.structured_output_mode
        problem = parse(
            loop, schema, message, by_tool=mode == "tool", prompted=mode == "prompted"
        )
    if problem is None:
        loop.answer = message
        loop.emit_answer(message, jsonable(loop.parsed))
    if output is not None and loop.options.finish_turn is not None:
        await finish_turn(loop, output, ())
    # Limits and stop conditions only matter when the loop would go on: an
    # answer on the last allowed turn is still an answer.
    if problem is not None or loop.steering or loop.follow_ups:
        stop = stop_check(loop)
        if stop is not None:
            return (_T.finish, message, stop)
    if problem is not None:
        return (_T.follow_up, UserMessage(content=problem), None)
    if loop.steering:
        steering = drain(loop.steering, loop.options.steering_mode)
        return (_T.follow_up, steering, None)
    if loop.follow_ups:
        follow_ups = drain(loop.follow_ups, loop.options.follow_up_mode)
        return (_T.follow_up, follow_ups, None)
    return (_T.finish, message, None)


def parse(
    loop: Loop,
    schema: type[BaseModel] | dict[str, Any],
    message: ModelMessageItem,
    *,
    by_tool: bool = False,
    prompted: bool = False,
) -> str | None:
    """Validate the answer; return what to tell the model when it is invalid
    (`by_tool`: the answer came as the final answer tool's arguments, which is
    how the model should answer again; `prompted`: the answer may wrap its JSON
    in prose or a code fence, see `json_document`)."""
    text = json_document(message.content) if prompted else message.content
    try:
        if isinstance(schema, dict):
            loop.parsed = _validate_json_schema(schema, text)
        else:
            loop.parsed = schema.model_validate_json(text)
    except (ValidationError, ValueError) as exc:
        error = (
            format_validation_error(exc, "arguments" if by_tool else "answer")
            if isinstance(exc, ValidationError)
            else error_text(exc)
        )
        loop.structured_failures += 1
        if loop.structured_failures > loop.options.structured_output_retries:
            raise StructuredOutputError(
                f"the answer did not match the structured output after "
                f"{loop.structured_failures} attempts: {error}"
            ) from exc
        again = (
            "Call the final answer tool again with corrected arguments."
            if by_tool
            else "Answer again with only the corrected JSON."
        )
        return (
            f"Your answer does not match the required output format: {error}. {again}"
        )
    return None


_FENCED: Final = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL)
"""A Markdown code block (```json ... ```), its text captured."""


def json_document(text: str) -> str:
    """The JSON document in an answer: `text` when it is JSON, else the first
    code block that is, else the outermost `{...}` or `[...]` that is; `text`
    when none is (its validation error then says why)."""
    if _is_json(text):
        return text
    candidates = [m.group(1) for m in _FENCED.finditer(text)]
    for opening, closing in ("{}", "[]"):
        start, end = text.find(opening), text.rfind(closing)
        if start != -1 and end > start:
            candidates.append(text[start : end + 1])
    return next((c for c in candidates if _is_json(c)), text)


def _is_json(text: str) -> bool:
    try:
        from_json(text)
    except ValueError:
        return False
    return True


def _validate_json_schema(schema: dict[str, Any], text: str) -> Any:
    """Parse `text` as JSON and validate it against a JSON schema (needs
    `jsonschema`; imported here: only loops with a JSON-schema output need it).

    Raises:
        ValueError: the answer is not JSON, or does not fit the schema.
        StructuredOutputError: the schema itself cannot be used (the request
            checks it, so only a schema changed since can): no answer could fit.
    """
    from agentfsm._jsonschema import SchemaProblem, errors, validator

    try:
        check = validator(schema, draft="2020-12", checked=True)
        data = from_json(text)
        found = errors(check, data)
    except SchemaProblem as exc:
        raise StructuredOutputError(
            f"structured_output is not a usable JSON schema: {exc}"
        ) from None
    if found:
        found.sort(key=lambda e: list(e.path))
        raise ValueError(
            "; ".join(
                f"{'.'.join(map(str, e.path)) or 'answer'}: {e.message}" for e in found
            )
        )
    return data


def jsonable(value: Any) -> Any:
    """A parsed answer as JSON data (a model instance dumped)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return value
