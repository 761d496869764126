"""How a Python function becomes a tool: its arguments model (the JSON schema the
model sees and the validation of what it sends), its description and parameter
descriptions from the docstring, and whether its body can suspend; and, for
a tool with no Python signature (an MCP server's, a stand-in), the model's
arguments as the JSON object they must be.

`agentfsm.tools.Tool` calls these once, when the tool is made (`json_object`
at each call of such a tool).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Final, Protocol, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.fields import FieldInfo
from pydantic_core import SchemaValidator, from_json, to_json

from .exceptions import ConfigurationError, ToolArgumentsError

ToolFunction = Callable[..., Any]


def json_object(tool: str, arguments: str | Mapping[str, Any]) -> dict[str, Any]:
    """The model's arguments (JSON text, or decoded) as a dict.

    Raises:
        ToolArgumentsError: not JSON, or not an object, naming the tool.
    """
    if isinstance(arguments, str):
        try:
            value = from_json(arguments or "{}")
        except ValueError as exc:
            raise ToolArgumentsError(
                f"invalid arguments for tool {tool!r}: not JSON ({exc})", tool=tool
            ) from None
    else:
        value = dict(arguments)
    if not isinstance(value, dict):
        raise ToolArgumentsError(
            f"invalid arguments for tool {tool!r}: expected a JSON object, "
            f"got {to_json(value).decode()}",
            tool=tool,
        )
    return value


def awaits(function: Callable[..., Any]) -> bool:
    """Whether an async function may suspend: whether its code has a yield point
    (any `await`, `async for` or `async with`). Unknown code counts as yes."""
    code = getattr(function, "__code__", None)
    if code is None or not code.co_flags & inspect.CO_COROUTINE:
        return True  # e.g. a sync function marked as a coroutine function
    import dis  # only when a tool is made

    return any(i.opname == "YIELD_VALUE" for i in dis.get_instructions(code))


def arguments_model(
    function: ToolFunction, name: str, descriptions: Mapping[str, str]
) -> type[BaseModel]:
    try:
        hints = get_type_hints(function, include_extras=True)
    except NameError as exc:
        raise ConfigurationError(
            f"tool {name!r}: cannot resolve annotation: {exc}"
        ) from exc
    fields: dict[str, Any] = {}
    parameters = inspect.signature(function).parameters
    _check_described(descriptions, parameters, name)
    for param in parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigurationError(
                f"tool {name!r}: *args and **kwargs are not supported"
            )
        if param.kind is param.POSITIONAL_ONLY:
            raise ConfigurationError(
                f"tool {name!r}: positional-only parameter {param.name!r} is not supported"
            )
        if param.name not in hints:
            # The model would be told nothing about the value, and anything it
            # wrote would be passed on unchecked.
            raise ConfigurationError(
                f"tool {name!r}: parameter {param.name!r} has no type annotation "
                f"(annotate it, e.g. `{param.name}: str`, or `Any` to accept anything)"
            )
        annotation = hints[param.name]
        default = ... if param.default is param.empty else param.default
        # The docstring's description, unless the parameter's own `Field` (in
        # `Annotated` or as the default) gives one.
        described: dict[str, Any] = {}  # (a `description=None` would erase one)
        if param.name in descriptions and not _describes(annotation, default):
            described["description"] = descriptions[param.name]
        info = Field(default, alias=param.name, **described)
        if isinstance(default, FieldInfo):  # `n: int = Field(1, ge=1)`
            info = FieldInfo.merge_field_infos(
                default, Field(alias=param.name, **described)
            )
        # A field is named after its parameter, unless BaseModel has that name
        # (`schema`, `json`, `model_config`, ...) or pydantic reserves it (`_x`):
        # then it gets a neutral name no parameter has (p<position>, and
        # underscores after it while taken), and the parameter as alias.
        key = param.name
        if key.startswith(("_", "model_")) or hasattr(BaseModel, key):
            key = f"p{len(fields)}"
            while key in parameters or hasattr(BaseModel, key):
                key += "_"
        fields[key] = (annotation, info)
    return create_model(
        f"{name}_arguments",
        __config__=ConfigDict(extra="forbid", defer_build=True),
        **fields,
    )


class FieldsValidator(Protocol):
    """Validates a tool's arguments into `(values, ...)`: a dict of the
    arguments model's fields first (what pydantic-core's model-fields
    validator returns)."""

    def validate_json(self, data: str, /) -> tuple[Any, ...]: ...

    def validate_python(self, data: Any, /) -> tuple[Any, ...]: ...


def fields_validator(model: type[BaseModel]) -> FieldsValidator:
    """A validator of an arguments model's fields alone: the same checks,
    errors and values as the model's own validator, without making the model
    a call keeps only the dict of (~2,700 instructions a tool call less, `make
    bench-instructions`). Built on a tool's first call: the model's schema is
    deferred until then. A schema it cannot take apart (a model referring to
    itself is wrapped in its definitions) is validated as a whole model."""
    schema: Any = model.__pydantic_core_schema__
    if schema["type"] == "model" and schema["schema"]["type"] == "model-fields":
        return SchemaValidator(schema["schema"], schema.get("config"))
    return _WholeModel(model)


class _WholeModel:
    """`fields_validator`'s answer for a schema it cannot take apart."""

    __slots__ = ("_validator",)

    def __init__(self, model: type[BaseModel]) -> None:
        self._validator = model.__pydantic_validator__

    def validate_json(self, data: str, /) -> tuple[Any, ...]:
        return (self._validator.validate_json(data).__dict__,)

    def validate_python(self, data: Any, /) -> tuple[Any, ...]:
        return (self._validator.validate_python(data).__dict__,)


def _check_described(
    descriptions: Mapping[str, str], parameters: Mapping[str, object], name: str
) -> None:
    """Refuse a docstring describing parameters the function does not have: a
    typo (`citty:`) would leave the real one undescribed, and nothing would say."""
    unknown = [n for n in descriptions if n not in parameters]
    if unknown:
        listed = ", ".join(map(repr, unknown))
        raise ConfigurationError(
            f"tool {name!r}: the docstring describes {listed}, which "
            f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'}"
            f" of the function (its parameters: {', '.join(parameters) or 'none'})"
        )


def _describes(annotation: Any, default: Any) -> bool:
    """Whether a parameter's own `Field` (as default or in `Annotated`) describes it."""
    infos = [default] if isinstance(default, FieldInfo) else []
    if get_origin(annotation) is Annotated:
        infos.extend(m for m in annotation.__metadata__ if isinstance(m, FieldInfo))
    return any(info.description is not None for info in infos)


# A docstring with any of these has sections for griffe to find: Google's
# `Args:` and friends, NumPy's underlined headings, Sphinx's `:param x:` fields.
_SECTIONED: Final = re.compile(
    r"^\s*(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments"
    r"|Other Parameters|Returns?|Yields|Raises|Examples?|Notes?|Warnings?):\s*$"
    r"|^\s*-{3,}\s*$"
    r"|^\s*:(param|parameter|arg|argument|key|keyword|type|returns?|rtype|raises?)\b",
    re.MULTILINE,
)


def docstring(function: ToolFunction) -> tuple[str, dict[str, str]]:
    """The tool's description and each parameter's, from the function's docstring.

    The description is the docstring without its parameters section (Google
    `Args:`, NumPy `Parameters`, Sphinx `:param x:`, whichever style it is
    written in), which describes the parameters instead. Every other section
    stays, as `Title: text` or an indented block: `Returns`, `Raises`, `Note`,
    `Warning`, `Example(s)`, ... tell the model what it gets back and how to
    call the tool.
    """
    doc = inspect.getdoc(function) or ""
    if not _SECTIONED.search(doc):
        return doc, {}
    import griffe  # here: ~45 ms to import, and most tools have one-line docstrings

    quiet: Any = {"warnings": False}  # griffe would log each parameter it cannot type
    sections = griffe.Docstring(
        doc,
        parser="auto",
        parser_options={
            "default": "google",
            "per_style_options": {"google": quiet, "numpy": quiet, "sphinx": quiet},
        },
    ).parse()
    text: list[str] = []
    parameters: dict[str, str] = {}
    for section in sections:
        kind = section.kind.value
        if kind in ("parameters", "other parameters"):
            parameters.update((p.name, p.description) for p in section.value)
        elif kind != "type parameters":  # (a generic's: the model never sees them)
            text.append(_section_text(kind, section.title, section.value))
    return "\n\n".join(t for t in text if t).strip(), parameters


def _section_text(kind: str, title: str | None, value: Any) -> str:
    """A docstring section (but the parameters) as the model reads it."""
    match kind:
        case "text":
            return str(value)
        case "admonition":  # Note:, Warning:, Example:, Tip:, ...
            return _titled(title or value.annotation.title(), value.description)
        case "examples":  # prose and `>>>` blocks, in order
            return _titled(title or "Examples", "\n\n".join(t for _, t in value))
        case "returns" | "yields" | "receives":
            described = " ".join(r.description for r in value if r.description)
            return _titled(title or kind.title(), described)
        case _:  # raises, warns (`ValueError: why`), and any other entries
            entries = []
            for entry in value if isinstance(value, list) else [value]:
                name = getattr(entry, "name", None)
                label = name or getattr(entry, "annotation", None)
                description = getattr(entry, "description", "")
                entries.append(f"{label}: {description}" if label else description)
            return _titled(title or kind.title(), "\n".join(entries))


def _titled(title: str, body: str) -> str:
    """`Title: body`, or the title over the body indented (as it was written)."""
    if not body:
        return ""
    if "\n" not in body:
        return f"{title}: {body}"
    return f"{title}:\n" + "\n".join(
        f"    {line}" if line else "" for line in body.splitlines()
    )
