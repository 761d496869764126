"""Tools built from typed Python functions.

pydantic reads the function's signature: it gives the JSON schema the model
sees and validates the arguments the model wrote. Sync functions run in a
worker thread so they never block the event loop; async functions are awaited.
Every call has a timeout (`DEFAULT_TOOL_TIMEOUT` unless the tool sets its own).

Example:
    ```python
    @tool
    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    add.definition.parameters  # {'type': 'object', 'properties': {...}, ...}
    ```
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any, Final, TypeAlias, cast, get_type_hints, overload

import anyio
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_core import to_json

from .exceptions import ConfigurationError, ToolArgumentsError, ToolError, ToolTimeout

__all__ = (
    "DEFAULT_TOOL_TIMEOUT",
    "Tool",
    "ToolDefinition",
    "ToolFunction",
    "format_validation_error",
    "tool",
)

DEFAULT_TOOL_TIMEOUT: Final = 60.0
"""Seconds a tool call may run unless its tool says otherwise."""

ToolFunction: TypeAlias = Callable[..., Any]
"""A sync or async function whose keyword arguments are the tool's parameters."""


class ToolDefinition(BaseModel):
    """What a provider sends to the model about a tool."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """The name the model calls the tool by."""
    description: str = ""
    """What the tool does, for the model."""
    parameters: dict[str, Any]
    """The JSON schema of the arguments object."""


def format_validation_error(error: ValidationError) -> str:
    """One line per problem: `field: message (got value)`."""
    problems = []
    for err in error.errors(include_url=False):
        where = ".".join(str(part) for part in err["loc"]) or "arguments"
        got = "" if err["type"] == "missing" else f" (got {err.get('input')!r})"
        problems.append(f"{where}: {err['msg']}{got}")
    return "; ".join(problems)


class Tool:
    """A tool the model can call: a function, its schema and how to run it.

    Build one with `@tool` or `Tool.from_function`; `Tool.invoke` validates the
    model's JSON arguments and runs the function.
    """

    __slots__ = (
        "_args_model",
        "_is_async",
        "definition",
        "function",
        "name",
        "run_in_thread",
        "timeout",
    )

    def __init__(
        self,
        function: ToolFunction,
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = DEFAULT_TOOL_TIMEOUT,
        run_in_thread: bool = True,
    ) -> None:
        if timeout is not None and timeout <= 0:
            raise ConfigurationError(f"tool timeout must be positive, got {timeout}")
        self.function = function
        self.name = name or function.__name__
        self.timeout = timeout
        """Seconds a call may run, or `None` for no limit."""
        self.run_in_thread = run_in_thread
        """Whether a sync function runs in a worker thread (set `False` only for
        functions that never block)."""
        self._is_async = inspect.iscoroutinefunction(function)
        self._args_model = _arguments_model(function, self.name)
        schema = self._args_model.model_json_schema()
        schema.pop("title", None)
        doc = inspect.getdoc(function) or ""
        self.definition = ToolDefinition(
            name=self.name,
            description=description if description is not None else doc,
            parameters=schema,
        )

    @classmethod
    def from_function(
        cls,
        function: ToolFunction,
        *,
        name: str | None = None,
        description: str | None = None,
        timeout: float | None = DEFAULT_TOOL_TIMEOUT,
        run_in_thread: bool = True,
    ) -> Tool:
        """Build a tool from a typed function (its docstring is the description)."""
        return cls(
            function,
            name=name,
            description=description,
            timeout=timeout,
            run_in_thread=run_in_thread,
        )

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    def validate_arguments(self, arguments: str | Mapping[str, Any]) -> dict[str, Any]:
        """Validate the model's arguments (a JSON object, as text or decoded).

        Raises:
            ToolArgumentsError: naming each field that is wrong and why.
        """
        try:
            if isinstance(arguments, str):
                model = self._args_model.model_validate_json(arguments or "{}")
            else:
                model = self._args_model.model_validate(arguments)
        except ValidationError as exc:
            raise ToolArgumentsError(
                f"invalid arguments for tool {self.name!r}: "
                f"{format_validation_error(exc)}",
                tool=self.name,
            ) from exc
        return {
            field.alias or name: getattr(model, name)
            for name, field in type(model).model_fields.items()
        }

    async def invoke(self, arguments: str | Mapping[str, Any]) -> str:
        """Validate the arguments, run the function and return its output as text.

        Raises:
            ToolArgumentsError: the arguments did not validate.
            ToolTimeout: the call ran past `timeout`.
            Exception: whatever the function raised.
        """
        kwargs = self.validate_arguments(arguments)
        if self.timeout is None:
            result = await self._call(kwargs)
        else:
            # A bare CancelScope is what fail_after builds, without its generator.
            with anyio.CancelScope(
                deadline=anyio.current_time() + self.timeout
            ) as scope:
                result = await self._call(kwargs)
            if scope.cancelled_caught:
                raise ToolTimeout(
                    f"tool {self.name!r} timed out after {self.timeout:g}s",
                    tool=self.name,
                )
        return result if isinstance(result, str) else to_json(result).decode()

    async def _call(self, kwargs: dict[str, Any]) -> Any:
        if self._is_async:
            return await cast("Callable[..., Awaitable[Any]]", self.function)(**kwargs)
        if self.run_in_thread:
            return await anyio.to_thread.run_sync(
                partial(self.function, **kwargs), abandon_on_cancel=True
            )
        result = self.function(**kwargs)
        if inspect.isawaitable(result):
            raise ToolError(
                f"tool {self.name!r} returned an awaitable from a sync function",
                tool=self.name,
            )
        return result


def _arguments_model(function: ToolFunction, name: str) -> type[BaseModel]:
    try:
        hints = get_type_hints(function)
    except NameError as exc:
        raise ConfigurationError(
            f"tool {name!r}: cannot resolve annotation: {exc}"
        ) from exc
    fields: dict[str, Any] = {}
    for param in inspect.signature(function).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigurationError(
                f"tool {name!r}: *args and **kwargs are not supported"
            )
        if param.kind is param.POSITIONAL_ONLY:
            raise ConfigurationError(
                f"tool {name!r}: positional-only parameter {param.name!r} is not supported"
            )
        annotation = hints.get(param.name, Any)
        default = ... if param.default is param.empty else param.default
        # Fields get neutral names and the parameter as alias, so a parameter may be
        # called `schema`, `json` or `model_config` without clashing with BaseModel.
        info = Field(default, alias=param.name)
        if isinstance(default, FieldInfo):  # `n: int = Field(1, ge=1)`
            info = FieldInfo.merge_field_infos(default, Field(alias=param.name))
        fields[f"p{len(fields)}"] = (annotation, info)
    return create_model(
        f"{name}_arguments",
        __config__=ConfigDict(extra="forbid"),
        **fields,
    )


@overload
def tool(function: ToolFunction, /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = DEFAULT_TOOL_TIMEOUT,
    run_in_thread: bool = True,
) -> Callable[[ToolFunction], Tool]: ...


def tool(
    function: ToolFunction | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout: float | None = DEFAULT_TOOL_TIMEOUT,
    run_in_thread: bool = True,
) -> Tool | Callable[[ToolFunction], Tool]:
    """Turn a typed function into a `Tool` (as `@tool` or `@tool(timeout=5)`)."""

    def wrap(fn: ToolFunction) -> Tool:
        return Tool(
            fn,
            name=name,
            description=description,
            timeout=timeout,
            run_in_thread=run_in_thread,
        )

    return wrap if function is None else wrap(function)
