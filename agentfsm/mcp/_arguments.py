"""An MCP tool's arguments: the schema the model is sent, and the check of
what the model wrote against it (the server checks them again).

The schema comes from the server, which agentfsm does not trust: it is checked
when the tool is listed, and its references resolve within it or the tool is
not offered (`agentfsm._jsonschema`); a `$ref` never makes the host fetch a
URL or read a file."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentfsm._tool_schema import json_object
from agentfsm.exceptions import ToolArgumentsError

__all__ = ("Arguments",)


class Arguments:
    """The input schema of one tool, and its validator.

    Raises:
        SchemaProblem: the schema is not a valid one, or has a reference that
            does not resolve within it: the tool is not to be offered (see
            `agentfsm._jsonschema`).
    """

    __slots__ = ("_validator", "schema", "tool")

    def __init__(self, tool: str, input_schema: Mapping[str, Any]) -> None:
        self.tool = tool
        # As the model is sent it: an object schema with `properties` (which
        # some providers require), without its title (the tool has a name).
        schema = {k: v for k, v in input_schema.items() if k != "title"}
        schema.setdefault("type", "object")
        schema.setdefault("properties", {})
        self.schema = schema
        # Imported when a tool is listed: jsonschema costs ~50 ms to import.
        from agentfsm._jsonschema import SchemaProblem, validator

        try:
            self._validator = validator(schema)
        except SchemaProblem as exc:
            raise SchemaProblem(f"input schema {exc}") from None

    def validate(self, arguments: str | Mapping[str, Any]) -> dict[str, Any]:
        """The arguments as a dict, once they fit the schema.

        Raises:
            ToolArgumentsError: not a JSON object, or naming each field that
                does not fit the schema and why.
        """
        from agentfsm._jsonschema import SchemaProblem, errors

        values = json_object(self.tool, arguments)
        try:
            found = errors(self._validator, values)
        except SchemaProblem as exc:
            raise self._error(str(exc)) from None
        problems = [
            f"{'.'.join(map(str, error.absolute_path)) or 'arguments'}: {error.message}"
            for error in found
        ]
        if problems:
            raise self._error("; ".join(problems))
        return values

    def _error(self, problem: str) -> ToolArgumentsError:
        return ToolArgumentsError(
            f"invalid arguments for tool {self.tool!r}: {problem}", tool=self.tool
        )
