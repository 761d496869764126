"""A loop's start as data (`loop.started`'s `request`, `options`, `handlers`)
and back again.

`started_fields` is what the emitter publishes with `loop.started`; it runs
only when someone listens. `request_of` turns the recorded request back into an
`InferenceInput` for a replay or a fork, with the tools given for it.

This module converts public data only (it imports none of `_loop` or
`_runtime`), so the emitter may import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

from pydantic import BaseModel

from agentfsm import _models
from agentfsm.events import ForkOrigin, RequestData, ToolSpec
from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import InferenceInput
from agentfsm.messages import ModelContext, UserMessage
from agentfsm.options import LoopOptions
from agentfsm.record import callable_name, options_record

if TYPE_CHECKING:
    from agentfsm.interception import InterceptionHandler
    from agentfsm.tools import Tool

__all__ = (
    "FORKED_FROM",
    "request_data",
    "request_of",
    "started_fields",
    "tool_spec",
)

FORKED_FROM: ContextVar[ForkOrigin | None] = ContextVar(
    "agentfsm_forked_from", default=None
)
"""Set by `fork` around the `run_loop` it makes: the loop it starts records it
in `loop.started` (a context variable, so `run_loop` needs no parameter that
only forks use)."""

_NOT_SETTINGS: Final = frozenset({"model", "context", "tools", "structured_output"})
_SETTINGS: Final = tuple(
    name for name in InferenceInput.model_fields if name not in _NOT_SETTINGS
)
"""Every setting of an `InferenceInput`, in field order."""

_REQUEST_FIELDS: Final = set(RequestData.model_fields)
_TOOL_FIELDS: Final = set(ToolSpec.model_fields)


def started_fields(
    message: UserMessage | None,
    request: InferenceInput,
    options: LoopOptions,
    handlers: Sequence[InterceptionHandler],
) -> dict[str, Any]:
    """The fields of a `loop.started` event (someone listens)."""
    return {
        "message": message,
        "model": request.model,
        "streaming": request.streaming,
        "request": request_data(request),
        "options": options_record(options),
        "handlers": tuple([callable_name(h) for h in handlers]) if handlers else (),
        "forked_from": FORKED_FROM.get(),
    }


def request_data(request: InferenceInput) -> RequestData:
    """An `InferenceInput` as data: the settings it was given, the tools' specs,
    and the context's items as they are now."""
    settings: dict[str, Any] = {}
    given = request.model_fields_set
    if not given <= _NOT_SETTINGS:  # a setting was given
        for name in _SETTINGS:
            if name in given:
                value = getattr(request, name)
                settings[name] = list(value) if isinstance(value, tuple) else value
    schema = request.structured_output
    values = {
        "model": request.model,
        "settings": settings,
        "tools": tuple([tool_spec(t) for t in request.tools]),
        "structured_output": schema
        if schema is None or isinstance(schema, dict)
        else callable_name(schema),
        "instructions": request.context.instructions,
        # A copy of the list, not of the items: they are frozen.
        "items": tuple(request.context.items),
    }
    # Built without validation (here and below): every value is the input's
    # own, valid already; validating a tool's schema as JSON data cost ~3 us.
    return _models.trusted(RequestData, values, _REQUEST_FIELDS)


def tool_spec(tool: Tool) -> ToolSpec:
    """A tool as data."""
    definition = tool.definition
    approval = tool.needs_approval
    values = {
        "name": definition.name,
        "description": definition.description,
        "parameters": definition.parameters,
        "needs_approval": "rule" if callable(approval) else bool(approval),
        "execution_mode": tool.execution_mode,
        "timeout": tool.timeout,
    }
    return _models.trusted(ToolSpec, values, _TOOL_FIELDS)


def request_of(
    data: RequestData,
    tools: Mapping[str, Tool],
    structured_output: type[BaseModel] | dict[str, Any] | None,
    *,
    model: str | None = None,
) -> InferenceInput:
    """The `InferenceInput` `data` records, in a context of its own, offering
    `tools[name]` for each tool it names.

    Raises:
        ConfigurationError: a tool the recording offered is not in `tools`, or
            the recording names a structured-output class and none is given.
    """
    missing = [spec.name for spec in data.tools if spec.name not in tools]
    if missing:
        raise ConfigurationError(
            f"the recorded request offered tools that were not given: "
            f"{', '.join(missing)}"
        )
    schema: type[BaseModel] | dict[str, Any] | None
    if isinstance(data.structured_output, str):
        if structured_output is None:
            raise ConfigurationError(
                f"the recorded request's structured_output is the class "
                f"{data.structured_output}: pass structured_output= to use it again"
            )
        schema = structured_output
    else:
        schema = structured_output or data.structured_output
    return InferenceInput(
        model=model or data.model,
        context=ModelContext(instructions=data.instructions, items=list(data.items)),
        tools=[tools[spec.name] for spec in data.tools],
        structured_output=schema,
        **data.settings,  # type: ignore[arg-type]
    )


def rebound(names: Sequence[str], given: Mapping[str, Any], what: str) -> list[Any]:
    """The callables recorded by `names`, looked up in `given` (by
    `module:qualname`, or by the bare qualname).

    Raises:
        ConfigurationError: naming each one not given.
    """
    found: list[Any] = []
    missing: list[str] = []
    for name in names:
        value = given.get(name)
        if value is None:
            value = given.get(name.partition(":")[2])
        if value is None:
            missing.append(name)
        else:
            found.append(value)
    if missing:
        raise ConfigurationError(
            f"the recording used {what} that were not given: {', '.join(missing)} "
            f"(pass {what}= a mapping from these names, or a list to use instead)"
        )
    return found
