"""An MCP tool's arguments: the schema the model is sent, and the check of
what the model wrote against it (the server checks them again)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic_core import from_json, to_json

from agentfsm.exceptions import ToolArgumentsError

__all__ = ("Arguments",)


class Arguments:
    """The input schema of one tool, and its validator (made on first use:
    jsonschema costs ~50 ms to import)."""

    __slots__ = ("_validator", "schema", "tool")

    def __init__(self, tool: str, input_schema: Mapping[str, Any]) -> None:
        self.tool = tool
        # As the model is sent it: an object schema with `properties` (which
        # some providers require), without its title (the tool has a name).
        schema = {k: v for k, v in input_schema.items() if k != "title"}
        schema.setdefault("type", "object")
        schema.setdefault("properties", {})
        self.schema = schema
        self._validator: Any = None

    def validate(self, arguments: str | Mapping[str, Any]) -> dict[str, Any]:
        """The arguments as a dict, once they fit the schema.

        Raises:
            ToolArgumentsError: not a JSON object, or naming each field that
                does not fit the schema and why.
        """
        values = self._object(arguments)
        validator = self._validator
        if validator is None:
            validator = self._validator = _validator(self.schema)
        if validator is not False:
            problems = [
                f"{'.'.join(map(str, error.absolute_path)) or 'arguments'}: "
                f"{error.message}"
                for error in validator.iter_errors(values)
            ]
            if problems:
                raise self._error("; ".join(problems))
        return values

    def _object(self, arguments: str | Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(arguments, str):
            try:
                value = from_json(arguments or "{}")
            except ValueError as exc:
                raise self._error(f"not JSON ({exc})") from None
        else:
            value = dict(arguments)
        if not isinstance(value, dict):
            raise self._error(f"expected a JSON object, got {to_json(value).decode()}")
        return value

    def _error(self, problem: str) -> ToolArgumentsError:
        return ToolArgumentsError(
            f"invalid arguments for tool {self.tool!r}: {problem}", tool=self.tool
        )


def _validator(schema: dict[str, Any]) -> Any:
    """A jsonschema validator of the schema (of the draft it names, 2020-12 by
    default); `False` when the schema is not a valid one: the server alone
    checks the arguments then."""
    import jsonschema.validators
    from jsonschema.exceptions import SchemaError

    kind = jsonschema.validators.validator_for(
        schema, default=jsonschema.validators.Draft202012Validator
    )
    try:
        kind.check_schema(schema)
    except SchemaError:
        return False
    return kind(schema)
