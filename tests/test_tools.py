"""Tools from typed functions: schema, validation, threads, timeouts, results."""

from __future__ import annotations

import inspect
import subprocess
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import anyio
import anyio.lowlevel
import pytest
from pydantic import BaseModel, Field, ValidationError

from agentfsm import Outcome, Runtime
from agentfsm.exceptions import (
    ConfigurationError,
    ToolArgumentsError,
    ToolError,
    ToolTimeout,
)
from agentfsm.messages import FunctionCallOutputItem, ModelContext
from agentfsm.providers import InferenceInput
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.tools import (
    DEFAULT_TOOL_TIMEOUT,
    Tool,
    ToolDefinition,
    ToolResult,
    format_validation_error,
    tool,
)


class Point(BaseModel):
    """A point on the plane."""

    x: int
    y: int = 0


@tool
def scale(point: Point, factor: float = 2.0, label: str | None = None) -> Point:
    """Scale a point.

    The label is ignored.
    """
    return Point(x=int(point.x * factor), y=int(point.y * factor))


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _undocumented(count: int = 3, names: list[str] = ["a"]) -> list[str]:  # noqa: B006
    return names * count


class TestSchema:
    def test_parameters_from_signature(self) -> None:
        """Each parameter becomes a typed property; those without default are required."""
        params = add.definition.parameters
        assert params["type"] == "object"
        assert params["properties"] == {
            "a": {"title": "A", "type": "integer"},
            "b": {"title": "B", "type": "integer"},
        }
        assert params["required"] == ["a", "b"]
        assert params["additionalProperties"] is False
        assert "title" not in params

    def test_name_and_description_from_function(self) -> None:
        """The tool is named after the function; its dedented docstring describes it."""
        assert add.name == "add"
        assert add.definition.name == "add"
        assert add.definition.description == "Add two integers."
        assert scale.definition.description == "Scale a point.\n\nThe label is ignored."

    def test_no_docstring(self) -> None:
        """A function without a docstring gets an empty description."""
        assert Tool.from_function(_undocumented).definition.description == ""

    def test_defaults(self) -> None:
        """Defaults appear in the schema and the parameters with defaults are optional."""
        params = Tool.from_function(_undocumented).definition.parameters
        assert params["properties"]["count"] == {
            "default": 3,
            "title": "Count",
            "type": "integer",
        }
        assert params["properties"]["names"]["default"] == ["a"]
        assert params["properties"]["names"]["items"] == {"type": "string"}
        assert "required" not in params

    def test_pydantic_model_parameter(self) -> None:
        """A pydantic model parameter is a `$ref` to its schema in `$defs`."""
        params = scale.definition.parameters
        assert params["properties"]["point"] == {"$ref": "#/$defs/Point"}
        point = params["$defs"]["Point"]
        assert point["properties"]["x"]["type"] == "integer"
        assert point["properties"]["y"]["default"] == 0
        assert point["required"] == ["x"]
        assert params["required"] == ["point"]
        assert params["properties"]["factor"]["default"] == 2.0
        assert params["properties"]["label"]["anyOf"] == [
            {"type": "string"},
            {"type": "null"},
        ]

    def test_field_constraints(self) -> None:
        """`Annotated[..., Field(...)]` constraints and descriptions reach the schema."""
        params = Tool.from_function(_bounded).definition.parameters
        assert params["properties"]["n"]["minimum"] == 1
        assert params["properties"]["n"]["description"] == "How many."

    def test_overrides(self) -> None:
        """`name=` and `description=` replace the function's name and docstring."""
        t = Tool.from_function(add.function, name="plus", description="Sum.")
        assert (t.name, t.definition.name, t.definition.description) == (
            "plus",
            "plus",
            "Sum.",
        )

    def test_decorator_with_options(self) -> None:
        """`@tool(...)` with options builds a tool with those options."""

        def f(x: int) -> int:
            return x

        t = tool(name="ident", timeout=5, run_in_thread=False)(f)
        assert isinstance(t, Tool)
        assert (t.name, t.timeout, t.run_in_thread) == ("ident", 5, False)
        assert add.timeout == DEFAULT_TOOL_TIMEOUT

    def test_parameter_named_like_a_basemodel_attribute(self) -> None:
        """A parameter named `schema` or `json` builds a tool without warnings."""
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            t = Tool.from_function(_query)
        assert set(t.definition.parameters["properties"]) == {"sql", "schema", "json"}
        assert t.validate_arguments({"sql": "s", "schema": "x", "json": True}) == {
            "sql": "s",
            "schema": "x",
            "json": True,
        }


def test_a_neutral_field_name_never_takes_another_parameters_name() -> None:
    """`json` needs a neutral field name; `p1` and `p1_` are parameters already."""

    def clash(x: int, json: str, p1: int, p1_: int = 3) -> str:
        return f"{x}{json}{p1}{p1_}"

    t = Tool.from_function(clash)
    assert set(t.definition.parameters["properties"]) == {"x", "json", "p1", "p1_"}
    assert t.validate_arguments({"x": 1, "json": "j", "p1": 2}) == {
        "x": 1,
        "json": "j",
        "p1": 2,
        "p1_": 3,
    }


def _bounded(n: int = Field(default=1, ge=1, description="How many.")) -> int:
    return n


def _query(sql: str, schema: str = "public", json: bool = False) -> str:
    return f"{schema}.{sql}"


class _Tree(BaseModel):
    name: str
    children: list[_Tree] = []


def _grow(tree: _Tree, depth: Annotated[int, Field(ge=0)] = 1) -> str:
    """A model referring to itself: its schema comes wrapped in definitions."""
    return tree.name


def _by_the_model(tool_: Tool, arguments: str | dict[str, Any]) -> object:
    """What `validate_arguments` gave when it made the arguments model."""
    assert tool_._args_model is not None
    validator = tool_._args_model.__pydantic_validator__
    try:
        if isinstance(arguments, str):
            model = validator.validate_json(arguments or "{}")
        else:
            model = validator.validate_python(arguments)
    except ValidationError as exc:
        return format_validation_error(exc)
    names = tool_._parameters or tuple(model.__dict__)
    return dict(zip(names, model.__dict__.values(), strict=True))


class TestValidation:
    @pytest.mark.parametrize(
        "arguments",
        [
            '{"point": {"x": 2}}',
            '{"point": {"x": "two"}, "factor": "x"}',
            '{"point": {"x": 1}, "other": 1}',
            "{}",
            "[1]",
            "not json",
            '{"point": {"x": 1, "y": 2}, "label": null, "factor": 1e400}',
            {"point": {"x": 1}, "factor": "3"},
            {"point": Point(x=1, y=2)},
            {"point": 3},
        ],
    )
    def test_the_fields_validator_gives_what_the_model_gave(
        self, arguments: str | dict[str, Any]
    ) -> None:
        """`validate_arguments` validates the model's fields alone
        (`_tool_schema.fields_validator`): the same values and errors as
        validating the whole model, for every kind of tool."""
        tools = [
            scale,
            add,
            Tool.from_function(_bounded),
            Tool.from_function(_query),  # parameters named like model attributes
            Tool.from_function(_grow),  # validated as a whole model
        ]
        for tool_ in tools:
            expected = _by_the_model(tool_, arguments)
            try:
                got: object = tool_.validate_arguments(arguments)
            except ToolArgumentsError as exc:
                got = str(exc).removeprefix(
                    f"invalid arguments for tool {tool_.name!r}: "
                )
            assert got == expected, tool_.name
        kinds = [type(t._fields).__name__ for t in tools]
        assert kinds == ["SchemaValidator"] * 4 + ["_WholeModel"]

    def test_valid_arguments(self) -> None:
        """Valid JSON text is decoded into typed values, defaults filled in."""
        assert scale.validate_arguments('{"point": {"x": 2}}') == {
            "point": Point(x=2, y=0),
            "factor": 2.0,
            "label": None,
        }

    def test_mapping_arguments(self) -> None:
        """Already-decoded arguments validate too (with lax coercion of `"3"`)."""
        assert add.validate_arguments({"a": 1, "b": "3"}) == {"a": 1, "b": 3}

    def test_empty_text_means_no_arguments(self) -> None:
        """An empty argument string is an empty object."""
        assert Tool.from_function(_undocumented).validate_arguments("") == {
            "count": 3,
            "names": ["a"],
        }

    @pytest.mark.parametrize(
        ("arguments", "expected"),
        [
            pytest.param('{"a": 1}', "b: Field required", id="missing"),
            pytest.param(
                '{"a": 1, "b": "two"}',
                "b: Input should be a valid integer",
                id="wrong-type",
            ),
            pytest.param(
                '{"a": 1, "b": 2, "c": 3}',
                "c: Extra inputs are not permitted",
                id="extra",
            ),
            pytest.param('{"a": 1,', "arguments: Invalid JSON", id="bad-json"),
            pytest.param(
                "[1, 2]", "arguments: Input should be an object", id="not-object"
            ),
        ],
    )
    def test_error_names_field_and_reason(self, arguments: str, expected: str) -> None:
        """A validation error names the tool, the field and why it is wrong."""
        with pytest.raises(ToolArgumentsError) as info:
            add.validate_arguments(arguments)
        message = str(info.value)
        assert message.startswith("invalid arguments for tool 'add': ")
        assert expected in message
        assert info.value.tool == "add"

    def test_nested_field_path(self) -> None:
        """An error inside a model parameter names the dotted path and the bad value."""
        with pytest.raises(ToolArgumentsError, match=r"point\.x: .*valid integer.*'a'"):
            scale.validate_arguments('{"point": {"x": "a"}}')

    def test_every_problem_reported(self) -> None:
        """All invalid fields are reported, not just the first."""
        with pytest.raises(ToolArgumentsError) as info:
            add.validate_arguments('{"a": "x", "b": "y"}')
        assert "a: " in str(info.value)
        assert "b: " in str(info.value)

    async def test_invoke_validates_before_running(self) -> None:
        """`invoke` raises `ToolArgumentsError` and does not call the function."""
        ran: list[int] = []

        def record(n: int) -> int:
            ran.append(n)
            return n

        with pytest.raises(ToolArgumentsError, match="n: "):
            await Tool.from_function(record).invoke('{"n": "many"}')
        assert ran == []


class TestRunning:
    async def test_sync_tool_runs_in_worker_thread(self) -> None:
        """A sync tool runs in a worker thread, not the event loop's thread."""
        seen: list[int] = []

        def where() -> str:
            seen.append(threading.get_ident())
            return "ok"

        assert (await Tool.from_function(where).invoke("{}")).output == "ok"
        assert seen
        assert seen[0] != threading.get_ident()

    async def test_sync_tool_inline_when_asked(self) -> None:
        """`run_in_thread=False` runs a sync tool on the event loop's thread."""
        seen: list[int] = []

        def where() -> str:
            seen.append(threading.get_ident())
            return "ok"

        assert (
            await Tool.from_function(where, run_in_thread=False).invoke("{}")
        ).output == "ok"
        assert seen == [threading.get_ident()]

    async def test_async_tool_awaited(self) -> None:
        """An async tool is awaited on the event loop and its result returned."""
        seen: list[int] = []

        async def slow_add(a: int, b: int) -> int:
            await anyio.lowlevel.checkpoint()
            seen.append(threading.get_ident())
            return a + b

        assert (
            await Tool.from_function(slow_add).invoke('{"a": 2, "b": 3}')
        ).output == "5"
        assert seen == [threading.get_ident()]

    async def test_inline_sync_returning_awaitable(self) -> None:
        """An inline sync function that returns an awaitable is a `ToolError`."""

        async def inner() -> int:
            return 1

        def sneaky() -> Any:
            return inner()

        t = Tool.from_function(sneaky, run_in_thread=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the unawaited coroutine
            with pytest.raises(ToolError, match="returned an awaitable"):
                await t.invoke("{}")

    async def test_exception_propagates(self) -> None:
        """Whatever the function raises comes out of `invoke` unchanged."""

        def broken() -> str:
            raise ValueError("no")

        with pytest.raises(ValueError, match="no"):
            await Tool.from_function(broken).invoke("{}")

    async def test_own_timeout_error_is_not_tool_timeout(self) -> None:
        """A `TimeoutError` raised by the tool itself is not reported as `ToolTimeout`."""

        def connect() -> str:
            raise TimeoutError("connection timed out")

        with pytest.raises(TimeoutError, match="connection timed out") as info:
            await Tool.from_function(connect).invoke("{}")
        assert not isinstance(info.value, ToolTimeout)


class TestTimeout:
    async def test_async_tool_timeout(self) -> None:
        """An async tool running past its timeout raises `ToolTimeout`."""

        @tool(timeout=0.05)
        async def hang() -> str:
            await anyio.sleep_forever()
            return "never"

        # The hang guard (5 s) is far below the tool's own end (never): only
        # the deadline can end the call in time.
        with anyio.fail_after(5):
            with pytest.raises(
                ToolTimeout, match=r"tool 'hang' timed out after 0\.05s"
            ) as info:
                await hang.invoke("{}")
        assert info.value.tool == "hang"

    async def test_sync_tool_timeout(self) -> None:
        """A sync tool in a thread running past its timeout raises `ToolTimeout` at once."""
        release = threading.Event()
        finished = threading.Event()

        @tool(timeout=0.05)
        def block() -> str:
            release.wait(10)
            finished.set()
            return "late"

        try:
            # The thread holds on for 10 s: only a call that does not wait for
            # it ends inside the 5 s hang guard.
            with anyio.fail_after(5):
                with pytest.raises(ToolTimeout, match=r"timed out after 0\.05s"):
                    await block.invoke("{}")
            assert not finished.is_set()  # the thread was abandoned, not waited for
        finally:
            release.set()

    async def test_a_wait_inside_async_for_or_async_with_times_out_too(self) -> None:
        """Whatever the await is written as, a call that waits gets its deadline."""

        async def never() -> AsyncIterator[int]:
            await anyio.sleep_forever()
            yield 1

        @tool(timeout=0.05)
        async def iterate() -> str:
            async for _ in never():
                pass
            return "never"

        @tool(timeout=0.05)
        async def hold() -> str:
            async with anyio.Lock():
                await anyio.sleep_forever()
            return "never"

        for hangs in (iterate, hold):
            with anyio.fail_after(5), pytest.raises(ToolTimeout):
                await hangs.invoke("{}")

    def test_which_calls_can_be_interrupted(self) -> None:
        """Only a call that can suspend gets a cancel scope: an async function
        without an await (or a sync one run in the loop's thread) cannot be
        interrupted, so a scope would never end it."""

        async def pure(a: int) -> int:
            def helper() -> int:  # an inner function's code is not the tool's
                return a

            return helper()

        async def waits(a: int) -> int:
            await anyio.lowlevel.checkpoint()
            return a

        class Methods:
            async def waits(self) -> None:
                await anyio.lowlevel.checkpoint()

        assert not Tool.from_function(pure).suspends
        assert Tool.from_function(waits).suspends
        assert Tool.from_function(Methods().waits).suspends

    @pytest.mark.skipif(
        sys.version_info < (3, 12), reason="inspect.markcoroutinefunction is 3.12+"
    )
    def test_a_sync_function_marked_as_a_coroutine_function_can_suspend(self) -> None:
        """Its own code has no yield point, but the coroutine it returns may wait:
        it keeps its deadline."""

        async def wait() -> str:
            await anyio.lowlevel.checkpoint()
            return "done"

        def marked() -> Any:
            return wait()

        inspect.markcoroutinefunction(marked)  # type: ignore[attr-defined,unused-ignore]
        assert Tool.from_function(marked, name="marked").suspends

    async def test_no_timeout(self) -> None:
        """`timeout=None` means no limit."""

        @tool(timeout=None)
        async def quick() -> str:
            await anyio.lowlevel.checkpoint()  # a call that could be interrupted
            return "done"

        assert quick.timeout is None
        assert (await quick.invoke("{}")).output == "done"


class TestResults:
    @pytest.mark.parametrize(
        ("value", "expected"),
        [
            pytest.param("plain text", "plain text", id="str-unchanged"),
            pytest.param('"quoted"', '"quoted"', id="str-not-reencoded"),
            pytest.param(3, "3", id="int"),
            pytest.param(1.5, "1.5", id="float"),
            pytest.param(None, "null", id="none"),
            pytest.param(True, "true", id="bool"),
            pytest.param({"a": [1, "b"]}, '{"a":[1,"b"]}', id="dict"),
            pytest.param([1, 2], "[1,2]", id="list"),
            pytest.param(Point(x=1, y=2), '{"x":1,"y":2}', id="model"),
        ],
    )
    async def test_result_as_text(self, value: object, expected: str) -> None:
        """Strings are returned as they are; anything else is JSON-encoded."""

        async def give() -> object:
            return value

        assert (await Tool.from_function(give).invoke("{}")).output == expected

    def test_text_and_results_are_taken_as_they_are(self) -> None:
        """Text and a `ToolResult`, subclasses included, are kept (not JSON);
        a JSON scalar is its JSON (the loop tests its type before any class)."""
        from agentfsm._loop.tool_run import output_of

        class Label(str):
            pass

        class Marked(ToolResult):
            pass

        label, result, marked = Label("x"), ToolResult(output="r"), Marked(output="m")
        for value in (label, result, marked, "plain"):
            assert output_of(scale, value) is value
        assert [output_of(scale, v) for v in (2, 2.5, False, None)] == [
            "2",
            "2.5",
            "false",
            "null",
        ]

    def test_an_int_is_its_json(self) -> None:
        """An int is taken as its digits (`str`, not the JSON encoder), as the
        encoder writes it: negative, huge (past `str`'s digit limit) and
        subclasses (an `IntEnum`, `True`) included."""
        from enum import IntEnum

        from pydantic_core import to_json

        from agentfsm._loop.tool_run import output_of

        class Level(IntEnum):
            high = 3

        huge = 10**5000  # `str(huge)` raises: the encoder takes it
        for value in (0, 7, -12, 2**64 + 1, huge, Level.high, True):
            assert output_of(scale, value) == to_json(value).decode()

    async def test_model_argument_result(self) -> None:
        """A model argument arrives as a model instance and the model result is JSON."""
        assert (
            await scale.invoke('{"point": {"x": 1, "y": 2}, "factor": 3}')
        ).output == ('{"x":3,"y":6}')


class TestConfiguration:
    def test_var_positional(self) -> None:
        """`*args` cannot be described to the model."""

        def f(*args: int) -> int:
            return sum(args)

        with pytest.raises(ConfigurationError, match=r"\*args and \*\*kwargs"):
            Tool.from_function(f)

    def test_var_keyword(self) -> None:
        """`**kwargs` cannot be described to the model."""

        def f(**kwargs: int) -> int:
            return len(kwargs)

        with pytest.raises(ConfigurationError, match=r"\*args and \*\*kwargs"):
            tool(f)

    def test_positional_only(self) -> None:
        """Positional-only parameters cannot be passed by name."""

        def f(x: int, /) -> int:
            return x

        with pytest.raises(ConfigurationError, match="positional-only parameter 'x'"):
            Tool.from_function(f)

    @pytest.mark.parametrize("timeout", [0, -1.0], ids=["zero", "negative"])
    def test_bad_timeout(self, timeout: float) -> None:
        """A timeout must be positive."""
        with pytest.raises(ConfigurationError, match="timeout must be positive"):
            Tool.from_function(_undocumented, timeout=timeout)

    def test_unresolvable_annotation(self) -> None:
        """An annotation that names nothing is a `ConfigurationError`."""

        def f(x: int) -> int:
            return x

        f.__annotations__["x"] = "Nowhere"
        with pytest.raises(ConfigurationError, match="cannot resolve annotation"):
            Tool.from_function(f)


class TestOffered:
    """How a request takes its tools."""

    def test_a_list_or_tuple_is_kept_as_a_tuple_in_order(self) -> None:
        @tool
        async def first() -> str:
            return "1"

        @tool
        def second() -> str:
            return "2"

        for given in ([first, second], (first, second)):
            request = InferenceInput(model="m:x", context=ModelContext(), tools=given)
            assert request.tools == (first, second)
        request = InferenceInput(model="m:x", context=ModelContext(), tools=[first])
        definition = first.definition.model_dump()
        assert request.model_dump()["tools"] == (definition,)
        assert request.model_dump(mode="json")["tools"] == [definition]

    @pytest.mark.parametrize(
        ("tools", "error"),
        [
            ("abc", "a sequence of tools, got str"),
            ({add}, "a sequence of tools, got set"),
            ((t for t in [add]), "a sequence of tools, got generator"),
            ([len], "instance of Tool"),
        ],
    )
    def test_anything_else_is_refused_by_name(self, tools: Any, error: str) -> None:
        """A set or a generator (no order to keep) and a str are refused, as by
        `Sequence`, and so is anything but a `Tool` in it."""
        with pytest.raises(ValidationError, match=f"tools(.0)?\n.*{error}"):
            InferenceInput(model="m:x", context=ModelContext(), tools=tools)

    def test_strict_validation_takes_a_list_too(self) -> None:
        data = {"model": "m:x", "context": ModelContext(), "tools": [add]}
        assert InferenceInput.model_validate(data, strict=True).tools == (add,)


def _google(city: str, days: int = 1) -> str:
    """Forecast the weather.

    Uses the national service.

    Args:
        city: the city to forecast,
            by its English name.
        days: how many days ahead.

    Returns:
        one line per day.
    """
    return city * days


def _numpy(city: str, days: int = 1) -> str:
    """Forecast the weather.

    Uses the national service.

    Parameters
    ----------
    city : str
        the city to forecast,
        by its English name.
    days : int
        how many days ahead.

    Returns
    -------
    str
        one line per day.
    """
    return city * days


def _sphinx(city: str, days: int = 1) -> str:
    """Forecast the weather.

    Uses the national service.

    :param city: the city to forecast,
        by its English name.
    :param days: how many days ahead.
    :returns: one line per day.
    """
    return city * days


def _dice(
    n: Annotated[int, Field(ge=1, le=5, description="How many dice (1 to 5).")],
    sides: int = 6,
) -> int:
    """Roll dice.

    Args:
        n: overridden by the Field's own description.
        sides: faces per die.
    """
    return n * sides


def _admonished(path: str) -> str:
    """Read a file.

    Args:
        path: where the file is.

    Returns:
        its text.

    Raises:
        FileNotFoundError: no file is there.

    Note:
        Paths are relative to the project.

    Warning:
        Binary files come back garbled.

    Example:
        read("notes.txt")
    """
    return path


def _numpy_admonished(path: str) -> str:
    """Read a file.

    Parameters
    ----------
    path : str
        where the file is.

    Notes
    -----
    Paths are relative to the project.

    Examples
    --------
    >>> read("notes.txt")
    'hello'
    """
    return path


def _typo(city: str, days: int = 1) -> str:
    """Forecast the weather.

    Args:
        citty: the city.
        days: how many days ahead.
        hours: how many hours.
    """
    return city * days


class TestDocstrings:
    @pytest.mark.parametrize(
        "function",
        [
            pytest.param(_google, id="google"),
            pytest.param(_numpy, id="numpy"),
            pytest.param(_sphinx, id="sphinx"),
        ],
    )
    def test_parameter_descriptions(self, function: Any) -> None:
        """Each style's parameter section describes the parameters, not the tool."""
        t = Tool.from_function(function)
        properties = t.definition.parameters["properties"]
        assert properties["city"]["description"] == (
            "the city to forecast,\nby its English name."
        )
        assert properties["days"]["description"] == "how many days ahead."
        assert t.definition.description == (
            "Forecast the weather.\n\nUses the national service.\n\n"
            "Returns: one line per day."
        )

    def test_only_the_parameters_section_leaves_the_description(self) -> None:
        """Admonitions, examples and `Raises` stay in the description (as written:
        `Title: text`); only `Args` goes, into the parameter descriptions."""
        t = Tool.from_function(_admonished)
        assert t.definition.description == (
            "Read a file.\n\n"
            "Returns: its text.\n\n"
            "Raises: FileNotFoundError: no file is there.\n\n"
            "Note: Paths are relative to the project.\n\n"
            "Warning: Binary files come back garbled.\n\n"
            'Example: read("notes.txt")'
        )
        path = t.definition.parameters["properties"]["path"]
        assert path["description"] == "where the file is."

    def test_numpy_notes_and_examples_stay(self) -> None:
        """NumPy `Notes` and `Examples` (a doctest, indented under its title) stay."""
        t = Tool.from_function(_numpy_admonished)
        assert t.definition.description == (
            "Read a file.\n\n"
            "Notes: Paths are relative to the project.\n\n"
            "Examples:\n"
            '    >>> read("notes.txt")\n'
            "    'hello'"
        )

    def test_a_described_name_that_is_no_parameter_is_refused(self) -> None:
        """A typo in the docstring's `Args` is a `ConfigurationError` naming it."""
        with pytest.raises(
            ConfigurationError,
            match=r"tool '_typo': the docstring describes 'citty', 'hours', which "
            r"are not parameters of the function \(its parameters: city, days\)",
        ):
            Tool.from_function(_typo)

    def test_a_field_description_wins_over_the_docstring(self) -> None:
        """`Field(description=...)` is kept; the docstring describes the rest."""
        properties = Tool.from_function(_dice).definition.parameters["properties"]
        assert properties["n"]["description"] == "How many dice (1 to 5)."
        assert properties["sides"]["description"] == "faces per die."

    def test_a_docstring_without_sections_is_the_description(self) -> None:
        """A docstring with no sections is kept whole, and describes no parameter."""
        assert scale.definition.description == "Scale a point.\n\nThe label is ignored."
        assert "description" not in scale.definition.parameters["properties"]["factor"]

    def test_one_line_docstrings_do_not_import_griffe(self) -> None:
        """griffe is imported only for a docstring with sections (it costs ~45 ms)."""
        code = (
            "import sys, agentfsm\n"
            "@agentfsm.tool\n"
            "def add(a: int, b: int) -> int:\n"
            "    'Add two integers.'\n"
            "    return a + b\n"
            "assert 'griffe' not in sys.modules, 'griffe was imported'\n"
            "from tests.test_tools import _google\n"
            "agentfsm.Tool.from_function(_google)\n"
            "assert 'griffe' in sys.modules\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=Path(__file__).resolve().parent.parent,
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr


class TestAnnotatedConstraints:
    def test_constraints_reach_the_schema(self) -> None:
        """`Annotated[int, Field(ge=1, le=5)]` bounds the parameter in the schema."""
        n = Tool.from_function(_dice).definition.parameters["properties"]["n"]
        assert (n["minimum"], n["maximum"], n["type"]) == (1, 5, "integer")
        assert Tool.from_function(_dice).definition.parameters["required"] == ["n"]

    @pytest.mark.parametrize("n", [0, 6], ids=["below", "above"])
    def test_values_out_of_bounds_are_rejected(self, n: int) -> None:
        """A value outside the `Field`'s bounds fails validation, naming the field."""
        with pytest.raises(ToolArgumentsError, match=r"n: Input should be"):
            Tool.from_function(_dice).validate_arguments({"n": n})

    def test_values_in_bounds_pass(self) -> None:
        assert Tool.from_function(_dice).validate_arguments({"n": 5}) == {
            "n": 5,
            "sides": 6,
        }


class TestUnannotated:
    def test_an_unannotated_parameter_is_rejected_by_name(self) -> None:
        """A parameter without a type fails when the tool is defined, naming it."""

        def f(city: str, days) -> str:  # type: ignore[no-untyped-def]
            return str(city)

        with pytest.raises(
            ConfigurationError,
            match="tool 'f': parameter 'days' has no type annotation",
        ):
            tool(f)

    def test_any_is_accepted(self) -> None:
        """`Any` says "anything" explicitly."""

        def f(value: Any) -> str:
            return str(value)

        assert tool(f).validate_arguments({"value": [1]}) == {"value": [1]}


class _Opaque:
    """Something JSON cannot hold."""


class TestUnserializable:
    async def test_invoke_reports_the_value_not_a_raise(self) -> None:
        """A return value JSON cannot hold is a `ToolError` saying exactly that."""

        async def give() -> object:
            return _Opaque()

        with pytest.raises(ToolError) as info:
            await Tool.from_function(give).invoke("{}")
        message = str(info.value)
        assert "tool 'give' returned a value that cannot be serialized" in message
        assert "(_Opaque)" in message
        assert "raised" not in message

    async def test_the_loop_writes_that_as_the_output(self) -> None:
        """In a loop the call's error output says the value could not be serialized."""

        @tool
        def opaque() -> object:
            """Return something opaque."""
            return _Opaque()

        provider = ScriptedProvider([calls(call("opaque")), text("done")])
        with anyio.fail_after(10):
            async with Runtime(providers={"scripted": provider}) as runtime:
                loop_id = runtime.run_loop(
                    "a",
                    "go",
                    InferenceInput(
                        model="scripted:t", context=ModelContext(), tools=[opaque]
                    ),
                )
                await runtime.wait(loop_id)
        [output] = [
            i
            for i in provider.requests[-1].context.items
            if isinstance(i, FunctionCallOutputItem)
        ]
        assert output.is_error
        assert output.output.startswith(
            "tool 'opaque' returned a value that cannot be serialized to JSON (_Opaque)"
        )


async def test_a_call_knows_its_idempotency_key() -> None:
    """Made from the loop, the request, the position, the tool and the canonical
    arguments: two equal calls of one batch have two keys; the model's call
    ids (here equal) play no part."""
    from agentfsm import InferenceInput, ModelContext, Runtime, current_call
    from agentfsm._keys import idempotency_key
    from agentfsm.testing import ScriptedProvider, call, calls, text

    keys: list[str] = []

    @tool
    async def charge(amount: int) -> str:
        """Charge."""
        keys.append(current_call().idempotency_key)
        return "ok"

    provider = ScriptedProvider(
        [
            calls(
                call("charge", call_id="same", amount=5),
                call("charge", call_id="same", amount=5),
            ),
            text("done"),
        ]
    )
    async with Runtime(providers={"scripted": provider}) as runtime:
        loop_id = runtime.run_loop(
            "agent",
            "charge twice",
            InferenceInput(model="scripted:m", context=ModelContext(), tools=[charge]),
        )
        await runtime.wait(loop_id)
    assert sorted(keys) == sorted(
        idempotency_key(loop_id, 1, n, "charge", '{ "amount" : 5 }') for n in (0, 1)
    )
    assert len(set(keys)) == 2


class Doubled(BaseModel):
    n: int


def validate_doubled(arguments: Any) -> dict[str, Any]:
    """A definition tool's own validation, as pydantic raises it."""
    if isinstance(arguments, str):
        return Doubled.model_validate_json(arguments).model_dump()
    return Doubled.model_validate(arguments).model_dump()


async def double(**arguments: Any) -> str:
    await anyio.lowlevel.checkpoint()
    return str(arguments["n"] * 2)


DOUBLE = ToolDefinition(
    name="double", description="Double n.", parameters={"type": "object"}
)


async def run_one(offered: Tool, **arguments: Any) -> tuple[Any, str]:
    """A loop calling `offered` once: its result and the call's output."""
    provider = ScriptedProvider([calls(call(offered.name, **arguments)), text("ok")])
    async with Runtime(providers={"scripted": provider}) as runtime:
        request = InferenceInput(
            model="scripted:m", context=ModelContext(), tools=[offered]
        )
        result = await runtime.wait(runtime.run_loop("agent", "go", request))
        context = request.context.items
    [output] = [i for i in context if isinstance(i, FunctionCallOutputItem)]
    return result, output.output


class TestFromDefinition:
    """A tool with no Python signature: the definition is what the model sees."""

    async def test_it_runs_with_the_validated_arguments(self) -> None:
        made = Tool.from_definition(DOUBLE, double, validate=validate_doubled)
        assert (made.name, made.definition) == ("double", DOUBLE)
        assert (made.is_async, made.suspends, made.run_in_thread) == (True, True, False)
        result, output = await run_one(made, n=4)
        assert (result.outcome, output) == (Outcome.answered, "8")

    async def test_its_validation_errors_name_the_tool_even_with_a_rule(self) -> None:
        """A pydantic error from `validate` is the tool's arguments error: an
        error output, also where an approval rule reads the arguments."""
        for rule in (False, lambda arguments: arguments["n"] > 10):
            made = Tool.from_definition(
                DOUBLE, double, validate=validate_doubled, needs_approval=rule
            )
            with pytest.raises(ToolArgumentsError, match=r"tool 'double': n:"):
                made.validate_arguments('{"n": "x"}')
            assert made.requires_approval('{"n": "x"}') is False
            result, output = await run_one(made, n="x")
            assert result.outcome is Outcome.answered
            assert "invalid arguments for tool 'double'" in output

    async def test_without_validate_any_json_object_is_taken(self) -> None:
        made = Tool.from_definition(DOUBLE, double)
        assert made.validate_arguments('{"n": 2, "extra": true}') == {
            "n": 2,
            "extra": True,
        }
        for bad, why in (
            ("[1]", r"expected a JSON object, got \[1\]"),
            ("{", "not JSON"),
        ):
            with pytest.raises(ToolArgumentsError, match=f"tool 'double'.*{why}"):
                made.validate_arguments(bad)

    def test_what_cannot_make_one_is_refused_by_name(self) -> None:
        def sync(**arguments: Any) -> str:
            return ""

        with pytest.raises(ConfigurationError, match=r"'double'.*coroutine function"):
            Tool.from_definition(DOUBLE, sync)  # type: ignore[arg-type]
        with pytest.raises(
            ConfigurationError, match="must be a ToolDefinition, got dict"
        ):
            Tool(double, definition={"name": "double"})  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="come from the definition"):
            Tool(double, definition=DOUBLE, name="other")
        with pytest.raises(ConfigurationError, match=r"'double'.*execution_mode"):
            Tool.from_definition(DOUBLE, double, execution_mode="both")  # type: ignore[arg-type]

    async def test_a_subclass_overriding_invoke_runs_itself(self) -> None:
        class Canned(Tool):
            async def invoke(self, arguments: str | Mapping[str, Any]) -> ToolResult:
                return ToolResult(output=f"canned for {arguments}")

        made = Canned(double, definition=DOUBLE)
        result, output = await run_one(made, n=1)
        assert (result.outcome, output) == (Outcome.answered, 'canned for {"n":1}')
