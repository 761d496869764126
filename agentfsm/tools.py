"""Tools built from typed Python functions.

pydantic reads the function's signature: it gives the JSON schema the model
sees and validates the arguments the model wrote. Sync functions run in a
worker thread so they never block the event loop; async functions are awaited.
Every call has a timeout (`DEFAULT_TOOL_TIMEOUT` unless the tool sets its own).
Inside a call, `current_call()` says which call it is and whether it was
interrupted (see `ToolCallContext` for what happens to a sync tool then).

Example:
    ```python
    @tool
    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    add.definition.parameters  # {'type': 'object', 'properties': {...}, ...}
    ```
"""

import inspect
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar, Token
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Literal,
    Protocol,
    TypeAlias,
    TypedDict,
    Unpack,
    final,
    overload,
)

import anyio
import anyio.to_thread
from pydantic import (
    BaseModel,
    ConfigDict,
    InstanceOf,
    JsonValue,
    ValidationError,
)

from . import _models, _text
from ._arguments import seconds_or_none, timeout_or_none
from ._tool_schema import (
    FieldsValidator,
    arguments_model,
    awaits,
    docstring,
    fields_validator,
    json_object,
)
from .exceptions import (
    ConfigurationError,
    NoToolCallError,
    ToolArgumentsError,
    ToolCancelled,
)
from .messages import FunctionCallItem, ImageBlock

if TYPE_CHECKING:
    from .reconcile import ReconcileFunction

__all__ = (
    "DEFAULT_TOOL_TIMEOUT",
    "Tool",
    "ToolCall",
    "ToolCallContext",
    "ToolDefinition",
    "ToolFunction",
    "ToolNext",
    "ToolOptions",
    "ToolResult",
    "ToolWrapper",
    "current_call",
    "format_validation_error",
    "report_progress",
    "running_call",
    "tool",
)

DEFAULT_TOOL_TIMEOUT: Final = 60.0
"""Seconds a tool call may run unless its tool says otherwise."""

ToolFunction: TypeAlias = Callable[..., Any]
"""A sync or async function whose keyword arguments are the tool's parameters."""


class ToolDefinition(BaseModel):
    """What a provider sends to the model about a tool."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    name: str
    """The name the model calls the tool by."""
    description: str = ""
    """What the tool does, for the model."""
    parameters: dict[str, Any]
    """The JSON schema of the arguments object."""


def format_validation_error(error: ValidationError, root: str = "arguments") -> str:
    """One line per problem: `field: message (got value)`, a problem with the
    whole value named `root`."""
    problems = []
    for err in error.errors(include_url=False):
        where = ".".join(str(part) for part in err["loc"]) or root
        got = "" if err["type"] == "missing" else f" (got {err.get('input')!r})"
        problems.append(f"{where}: {err['msg']}{got}")
    return "; ".join(problems)


_RESULT_FIELDS: Final = {"output"}


class ToolResult(BaseModel):
    """What a tool call produced, as wrappers see and may change it.

    A tool function may return one to set `terminate` or `is_error` itself;
    any other return value becomes `ToolResult(output=<value as text>)`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    output: str
    """The output as text (JSON for non-string values)."""
    is_error: bool = False
    """Whether the call failed; the model sees the output as an error."""
    terminate: bool = False
    """Ask the loop to stop after this batch (it stops only if every call asks)."""
    images: tuple[ImageBlock, ...] = ()
    """Images beside the text (a tool may also return one `ImageBlock`, or a
    list of images and strs: its text a line each).
    A provider that takes none in a tool result is sent a line of text for
    each instead (`InferenceOutput.images_described`)."""

    if TYPE_CHECKING:
        # Images may be given as any sequence; validation makes them a tuple.
        def __init__(
            self,
            *,
            output: str,
            is_error: bool = False,
            terminate: bool = False,
            images: Sequence[ImageBlock] = (),
        ) -> None: ...

    @classmethod
    def of(cls, value: Any) -> "ToolResult":
        """A result holding `value` (text as is, anything else as JSON)."""
        if isinstance(value, ToolResult):
            return value
        text = _text.json_text(value)
        return _models.trusted(
            cls,
            {"output": text, "is_error": False, "terminate": False, "images": ()},
            _RESULT_FIELDS,
        )

    @classmethod
    def error(cls, message: str) -> "ToolResult":
        """An error result."""
        return cls(output=message, is_error=True)


class ToolOptions(TypedDict, total=False):
    """Options of `Tool`, `Tool.from_function` and `@tool`."""

    name: str | None
    description: str | None
    timeout: float | None
    run_in_thread: bool
    needs_approval: bool | Callable[[dict[str, Any]], bool]
    execution_mode: Literal["parallel", "sequential"]
    on_crash: Literal["pause", "retry"]
    reconcile: "ReconcileFunction | None"


class Tool:
    """A tool the model can call: a function, its schema and how to run it.

    Build one with `@tool` or `Tool.from_function`; `Tool.invoke` validates the
    model's JSON arguments and runs the function.

    Args:
        function: a sync or async function with every parameter annotated; its
            docstring describes the tool and (Google, NumPy or Sphinx style)
            its parameters.
        name: the name the model sees (default: the function's name).
        description: what the model reads about the tool (default: the docstring,
            without its parameters section, which describes the parameters; its
            other sections, `Returns`, `Raises`, `Note`, `Example`, ..., stay).
        timeout: seconds a call may run (`None`: no limit).
        run_in_thread: run a sync function in a worker thread (turn off only for
            functions that never block).
        needs_approval: `True`, or a function of the arguments; a batch with such
            a call pauses the loop until `Runtime.resume`.
        execution_mode: `"sequential"` makes any batch containing this tool run
            one call at a time, even when the loop runs tools in parallel.
        on_crash: what a durable loop recovered after a crash does with a call
            of this tool that was in flight (started, no output recorded):
            `"pause"` (the default) pauses the loop, naming the call, for a
            handler or a person to decide; `"retry"` (idempotent tools) runs it
            again with the same `idempotency_key`.
        reconcile: `fn(idempotency_key, arguments)`, sync or async, asked by a
            durable loop's recovery about a call of this tool in flight at a
            crash, before the loop would pause over it: it answers
            `Reconciled.ran(output)`, `Reconciled.not_run()` or None (unknown:
            the loop pauses). Only with `on_crash="pause"`. See
            `agentfsm.reconcile`.
        definition: for a function with no signature to read (an MCP
            server's tool, a stand-in): the name, description and schema the
            model sees; `function` must then be a coroutine function, called
            with the arguments `validate` returns (see `Tool.from_definition`).
        validate: with `definition`: the model's arguments to keyword
            arguments (by default any JSON object, as it is).

    Raises:
        ConfigurationError: the function cannot be a tool (a parameter without
            an annotation, `*args`, ...), or its docstring describes a
            parameter it does not have (a typo in `Args:`, say); `reconcile`
            is not a function of two positional arguments, or is given with
            `on_crash="retry"`.
    """

    __slots__ = (
        "_args_model",
        "_fields",
        "_parameters",
        "_validator",
        "definition",
        "execution_mode",
        "function",
        "is_async",
        "name",
        "needs_approval",
        "on_crash",
        "reconcile",
        "run_in_thread",
        "suspends",
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
        needs_approval: bool | Callable[[dict[str, Any]], bool] = False,
        execution_mode: Literal["parallel", "sequential"] = "parallel",
        on_crash: Literal["pause", "retry"] = "pause",
        reconcile: "ReconcileFunction | None" = None,
        definition: ToolDefinition | None = None,
        validate: Callable[[str | Mapping[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        if definition is not None:
            _check_definition(definition, name, description)
            name = definition.name
        name = name or function.__name__
        if on_crash not in ("pause", "retry"):
            raise ConfigurationError(
                f"tool {name!r}: on_crash must be 'pause' or 'retry', got {on_crash!r}"
            )
        if reconcile is not None:
            _check_reconcile(name, reconcile, on_crash)
        timeout_or_none("timeout", timeout)  # NaN would fail every call
        if execution_mode not in ("parallel", "sequential"):
            raise ConfigurationError(
                f"tool {name!r}: execution_mode must be 'parallel' or "
                f"'sequential', got {execution_mode!r}"
            )
        self.function = function
        self.name = name
        self.timeout = timeout
        self.needs_approval = needs_approval
        self.execution_mode = execution_mode
        self.on_crash = on_crash
        self.reconcile = reconcile
        self.is_async = inspect.iscoroutinefunction(function)
        """The function is a coroutine function (awaited, never in a thread)."""
        self.suspends = self.is_async and awaits(function)
        """An async function with an `await` in it: only such a call can be
        interrupted, so only its deadline needs a timer."""
        self.run_in_thread = run_in_thread and definition is None
        self._validator = validate
        self._parameters: tuple[str, ...] | None = None
        self._args_model: type[BaseModel] | None = None
        self._fields: FieldsValidator | None = None
        """Validates the arguments against `_args_model`'s fields (on first use)."""
        if definition is not None:
            if not self.is_async:
                raise ConfigurationError(
                    f"tool {name!r}: a tool from a definition runs a coroutine "
                    f"function, got {function!r}"
                )
            self.definition = definition
            return
        summary, descriptions = docstring(function)
        args_model = self._args_model = arguments_model(function, name, descriptions)
        fields = args_model.model_fields
        names = tuple(field.alias or name for name, field in fields.items())
        # The parameter names, when some field is not named after its parameter.
        self._parameters = None if names == tuple(fields) else names
        schema = args_model.model_json_schema()
        schema.pop("title", None)
        self.definition = ToolDefinition(
            name=name,
            description=description if description is not None else summary,
            parameters=schema,
        )

    @classmethod
    def from_definition(
        cls,
        definition: ToolDefinition,
        function: Callable[..., Awaitable[Any]],
        *,
        validate: Callable[[str | Mapping[str, Any]], dict[str, Any]] | None = None,
        timeout: float | None = DEFAULT_TOOL_TIMEOUT,
        needs_approval: bool | Callable[[dict[str, Any]], bool] = False,
        execution_mode: Literal["parallel", "sequential"] = "parallel",
        on_crash: Literal["pause", "retry"] = "pause",
    ) -> "Tool":
        """A tool with no Python signature to read (an MCP server's, a
        stand-in for one recorded or run elsewhere): `definition` is what the
        model sees, and `function`, a coroutine function, is called with the
        arguments `validate` returns as keywords. (A subclass passes
        `definition=` and `validate=` to `Tool.__init__`.)

        Args:
            definition: the name, description and JSON schema of the arguments.
            function: `async def fn(**arguments)`; returns what a tool returns.
            validate: turns the model's arguments (JSON text or decoded) into
                keyword arguments, raising `ToolArgumentsError` naming what is
                wrong; by default any JSON object is taken as it is.
            timeout, needs_approval, execution_mode, on_crash: as for `Tool`.

        Raises:
            ConfigurationError: `function` is no coroutine function, or an
                option is out of range.
        """
        return cls(
            function,
            definition=definition,
            validate=validate,
            timeout=timeout,
            needs_approval=needs_approval,
            execution_mode=execution_mode,
            on_crash=on_crash,
        )

    @classmethod
    def from_function(
        cls, function: ToolFunction, **options: Unpack[ToolOptions]
    ) -> "Tool":
        """Build a tool from a typed function (its docstring is the description)."""
        return cls(function, **options)

    def requires_approval(self, arguments: str | Mapping[str, Any]) -> bool:
        """Whether a call with these arguments needs approval (invalid ones never do:
        they fail validation without running)."""
        rule = self.needs_approval
        if not callable(rule):
            return bool(rule)
        try:
            kwargs = self.validate_arguments(arguments)
        except ToolArgumentsError:
            return False
        return bool(rule(kwargs))

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    def validate_arguments(self, arguments: str | Mapping[str, Any]) -> dict[str, Any]:
        """Validate the model's arguments (a JSON object, as text or decoded).

        Raises:
            ToolArgumentsError: naming each field that is wrong and why.
        """
        if self._args_model is None:  # a tool from a definition
            if self._validator is None:
                return json_object(self.name, arguments)
            try:
                return self._validator(arguments)
            except ToolArgumentsError:
                raise
            except ValidationError as exc:
                raise ToolArgumentsError(
                    f"invalid arguments for tool {self.name!r}: "
                    f"{format_validation_error(exc)}",
                    tool=self.name,
                ) from exc
            except (ValueError, TypeError, KeyError) as exc:
                raise ToolArgumentsError(
                    f"invalid arguments for tool {self.name!r}: {exc}", tool=self.name
                ) from exc
        fields = self._fields
        if fields is None:
            fields = self._fields = fields_validator(self._args_model)
        try:
            if isinstance(arguments, str):
                values: dict[str, Any] = fields.validate_json(arguments or "{}")[0]
            else:
                values = fields.validate_python(arguments)[0]
        except ValidationError as exc:
            raise ToolArgumentsError(
                f"invalid arguments for tool {self.name!r}: "
                f"{format_validation_error(exc)}",
                tool=self.name,
            ) from exc
        if self._parameters is None:
            return values  # each field is named after its parameter
        return dict(zip(self._parameters, values.values(), strict=True))

    async def invoke(self, arguments: str | Mapping[str, Any]) -> ToolResult:
        """Validate the arguments, run the function and return its result.

        A subclass may run calls its own way by overriding this (a loop then
        calls it in place of the function, without the timeout).

        Raises:
            ToolArgumentsError: the arguments did not validate.
            ToolTimeout: the call ran past `timeout`.
            Exception: whatever the function raised.
        """
        from agentfsm._loop.tool_run import run_function

        return ToolResult.of(await run_function(self, arguments, anyio.CancelScope))


def _check_definition(
    definition: object, name: str | None, description: str | None
) -> None:
    """Refuse a `definition` that is none, or given with what it holds."""
    if not isinstance(definition, ToolDefinition):
        raise ConfigurationError(
            f"definition must be a ToolDefinition, got {type(definition).__name__}"
        )
    if name is not None or description is not None:
        raise ConfigurationError(
            f"tool {definition.name!r}: name and description come from the "
            "definition; give them there, not beside it"
        )


def _check_reconcile(name: str, reconcile: "ReconcileFunction", on_crash: str) -> None:
    """Refuse a `reconcile` that recovery could not call as
    `fn(idempotency_key, arguments)`, naming the tool."""
    if on_crash != "pause":
        raise ConfigurationError(
            f"tool {name!r}: reconcile is asked only about calls that would pause "
            f"the loop (on_crash='pause'); with on_crash={on_crash!r} a call in "
            "flight at a crash runs again without asking"
        )
    if not callable(reconcile):
        raise ConfigurationError(
            f"tool {name!r}: reconcile must be a function "
            f"fn(idempotency_key, arguments), got {type(reconcile).__name__}"
        )
    try:
        signature = inspect.signature(reconcile)
    except (TypeError, ValueError):
        return  # (a builtin without a signature: called as given)
    try:
        signature.bind("key", {})
    except TypeError as exc:
        raise ConfigurationError(
            f"tool {name!r}: reconcile must take two positional arguments "
            f"(idempotency_key, arguments); "
            f"{getattr(reconcile, '__qualname__', type(reconcile).__name__)}"
            f"{signature} cannot: {exc}"
        ) from exc


@overload
def tool(function: ToolFunction, /) -> Tool: ...


@overload
def tool(**options: Unpack[ToolOptions]) -> Callable[[ToolFunction], Tool]: ...


def tool(
    function: ToolFunction | None = None, /, **options: Unpack[ToolOptions]
) -> Tool | Callable[[ToolFunction], Tool]:
    """Turn a typed function into a `Tool` (as `@tool` or `@tool(timeout=5)`)."""

    def wrap(fn: ToolFunction) -> Tool:
        return Tool(fn, **options)

    return wrap if function is None else wrap(function)


# ------------------------------------------------------------ the running call


class _Publisher(Protocol):
    """What publishes a call's progress (the loop; `tools` does not import it)."""

    def emit(self, event_type: Any, /, **fields: Any) -> bool | None:
        """Publish; False when the progress was refused."""
        ...


_cancel_lock: Final = threading.Lock()
"""Orders a call's interruption and a thread starting to wait for it (rare
paths both: the lock is never taken by a call that ends normally)."""


@final
class ToolCallContext:
    """The tool call running in this context: `current_call()` returns it.

    A tool function (sync or async; a sync one in its worker thread too) and
    whatever it calls can ask which call it is, report progress, and see
    whether the call was interrupted. The loop makes one per call.

    **When a call is interrupted** (its loop is cancelled, the runtime closes,
    or the call runs past its timeout), the loop does not wait for the tool:

    1. the call is reported at once, as an error output in the context
       (`function_call.completed` is published), and the loop goes on (to its
       end, for a cancel);
    2. an async tool is cancelled at its next `await`, as anything in anyio is;
    3. a sync tool's thread cannot be killed: it runs on until the function
       returns. What it returns or raises then is dropped (the reported output
       stays), and so are its progress reports; but its side effects happen,
       late, unless it cooperates: it checks `cancelled` (or calls
       `raise_if_cancelled()`) between steps, and sleeps with
       `wait_cancelled(seconds)` rather than `time.sleep`.

    ```python
    @tool
    def copy_files(paths: list[str]) -> str:
        "Copy the files, one by one."
        call = current_call()
        for path in paths:
            call.raise_if_cancelled()  # stop between files once interrupted
            copy(path)
        return "copied"
    ```
    """

    __slots__ = (
        "_arguments",
        "_cancelled",
        "_key",
        "_publisher",
        "_thread",
        "_waiter",
        "agent_id",
        "call_id",
        "fencing_token",
        "loop_id",
        "position",
        "request",
        "tool_name",
    )

    def __init__(
        self,
        loop_id: str,
        agent_id: str,
        call_id: str,
        tool_name: str,
        request: int = 0,
        position: int = 0,
        arguments: str = "",
        key: str | None = None,
        fencing_token: int | None = None,
    ) -> None:
        self.loop_id = loop_id
        """The loop that made the call."""
        self.agent_id = agent_id
        """The agent the loop runs for."""
        self.call_id = call_id
        """The call's id (its `FunctionCallItem.call_id`)."""
        self.tool_name = tool_name
        """The name of the tool called."""
        self.request = request
        """The number of the model request that asked for the call (1 is the first)."""
        self.position = position
        """The call's position in that request's batch of calls."""
        self.fencing_token = fencing_token
        """The epoch of the runtime's lease on a durable loop (None without a
        store): it grows each time another runtime takes the loop. Pass it,
        with the idempotency key, to a system that can refuse a write whose
        token is older than one it has seen, so that a runtime that stalled
        past its lease cannot act after the loop moved on."""
        self._arguments = arguments
        self._key = key
        self._cancelled = False
        self._waiter: threading.Event | None = None
        self._publisher: _Publisher | None = None
        """The loop, while the call runs (then None: a context copy outliving
        the call, a pending timer's or a thread's, keeps no loop alive)."""
        self._thread = 0
        """The event loop's thread (progress from another one hops to it)."""

    def __repr__(self) -> str:
        return (
            f"ToolCallContext(call_id={self.call_id!r}, tool_name={self.tool_name!r}, "
            f"loop_id={self.loop_id!r}, cancelled={self._cancelled})"
        )

    @property
    def idempotency_key(self) -> str:
        """A key naming this call of this loop, the same if the call runs again
        after a crash (`@tool(on_crash="retry")`, or a person's decision): pass
        it to an API that deduplicates by key (an `Idempotency-Key` header),
        so a call that ran before the crash does not take effect twice. Made
        from the loop id, the request number, the position, the tool's name
        and the canonical arguments; never from the model's call id."""
        if self._key is None:
            from agentfsm._keys import idempotency_key

            self._key = idempotency_key(
                self.loop_id,
                self.request,
                self.position,
                self.tool_name,
                self._arguments,
            )
        return self._key

    @property
    def cancelled(self) -> bool:
        """Whether the loop stopped waiting for the call before it returned (the
        loop was cancelled, the call ran past its timeout, or a wrapper gave up
        on it): from then on, whatever the function does is too late. Safe to
        read from any thread."""
        return self._cancelled

    def raise_if_cancelled(self) -> None:
        """Raise `ToolCancelled` if the call was interrupted (see `cancelled`).

        Raises:
            ToolCancelled: the call was interrupted.
        """
        if self._cancelled:
            raise ToolCancelled(
                f"tool call {self.call_id} ({self.tool_name!r}) was interrupted: "
                "its output was already reported, and what it does now is dropped",
                tool=self.tool_name,
            )

    def wait_cancelled(self, timeout: float | None = None) -> bool:
        """Block the calling thread until the call is interrupted, or for
        `timeout` seconds; return whether it was interrupted.

        For sync tools in their worker thread: sleep with it instead of
        `time.sleep`, so that an interruption ends the sleep at once.

        Raises:
            ConfigurationError: called from the event loop's thread (it would
                block every loop, and the interruption could never come; an
                async tool awaits instead, and is cancelled there); or
                `timeout` is no finite number of seconds >= 0 (nor None).
        """
        seconds_or_none("timeout", timeout)
        if threading.get_ident() == self._thread:
            raise ConfigurationError(
                "wait_cancelled() blocks its thread: call it from a sync tool "
                "run in a worker thread, not from the event loop's thread"
            )
        with _cancel_lock:
            if self._cancelled:
                return True
            waiter = self._waiter
            if waiter is None:
                waiter = self._waiter = threading.Event()
        return waiter.wait(timeout)

    def activate(
        self, publisher: "_Publisher | None"
    ) -> "Token[ToolCallContext | None]":
        """Make this the running call of the current context (`current_call()`),
        its progress going to `publisher` from any thread; returns the token
        for `deactivate`. For what runs a tool outside a loop's own calls
        (Temporal's activities): a loop does this for each call it makes."""
        self._publisher = publisher
        self._thread = threading.get_ident()
        return _current_call.set(self)

    def deactivate(
        self, token: "Token[ToolCallContext | None]", *, returned: bool
    ) -> None:
        """The call ended: progress is dropped from now on and, unless the
        function `returned` (cancelled, timed out, given up on), it is told it
        was interrupted (`cancelled`). The context's running call is reset."""
        # Copies of this context outlive the call (the cancelled deadline timer
        # asyncio keeps until it would have fired, a thread running on): they
        # must not keep the loop alive through the publisher.
        self._publisher = None
        if not returned:
            self._interrupt()
        _current_call.reset(token)

    def _interrupt(self) -> None:
        """The loop stopped waiting for the call (see `cancelled`)."""
        with _cancel_lock:
            self._cancelled = True
            waiter = self._waiter
        if waiter is not None:
            waiter.set()

    def _report(self, progress: JsonValue) -> bool:
        """Publish progress while the call runs; return whether it was taken."""
        if self._publisher is None:
            return False  # the call has ended (checked before a thread hop, too)
        if threading.get_ident() != self._thread:
            import anyio.from_thread  # only tools in worker threads need it

            return anyio.from_thread.run_sync(self._report, progress)
        taken = self._publisher.emit(
            "function_call.progress", call_id=self.call_id, progress=progress
        )
        return taken is not False


_current_call: ContextVar[ToolCallContext | None] = ContextVar(
    "agentfsm_tool_call", default=None
)


def current_call() -> ToolCallContext:
    """The tool call running in this context (sync or async tool, any thread).

    Raises:
        NoToolCallError: not inside a tool call a loop made.
    """
    call = _current_call.get()
    if call is None:
        raise NoToolCallError(
            "current_call() is only available inside a tool call a loop made "
            "(in the tool function, or what it calls)"
        )
    return call


def running_call() -> ToolCallContext | None:
    """The tool call running in this context, or None (`current_call()`
    without the error: for wrappers and integrations that may run outside one)."""
    return _current_call.get()


def report_progress(progress: JsonValue) -> bool:
    """Report progress from inside a running tool (sync or async, any thread).

    The loop publishes it as `function_call.progress`. Returns whether it was
    taken: outside a tool call, or after the call finished, it is dropped; on
    Temporal, progress that is not JSON or is over 64 KiB is refused.
    """
    call = _current_call.get()
    return call is not None and call._report(progress)


# --------------------------------------------------------------------- wrappers


class ToolCall(BaseModel):
    """One tool call as tool wrappers see it."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", arbitrary_types_allowed=True, defer_build=True
    )

    call: FunctionCallItem
    """The call as the model (or an interception handler) wrote it."""
    tool: InstanceOf[Tool] | None
    """The tool it names, or `None` when the request offers no such tool."""
    arguments: str
    """The arguments that will be validated and passed (JSON object text)."""
    loop_id: str
    agent_id: str

    def with_arguments(self, arguments: Mapping[str, Any] | str) -> "ToolCall":
        """This call with other arguments."""
        return self.model_copy(update={"arguments": _text.json_text(arguments)})


ToolNext: TypeAlias = Callable[[ToolCall], Awaitable[ToolResult]]
"""Runs the rest of the chain (the inner wrappers, then the tool)."""

ToolWrapper: TypeAlias = Callable[[ToolCall, ToolNext], Awaitable[ToolResult]]
"""`async def wrapper(call, next) -> ToolResult` around each tool call.

Wrappers run in registration order, the first outermost. A wrapper may change
the arguments (`await next(call.with_arguments(...))`), deny the call (return
`ToolResult.error("denied: ...")` without calling `next`), answer without
running the tool, change fields of the result (`result.model_copy(update=...)`),
time or retry it. A wrapper that raises turns the call into an error output.
"""

_models.read_fields_fast(globals())
