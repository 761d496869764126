"""Fault injection: each kind of user code raising, returning garbage, or
sleeping forever (issue 12, "keep it fixed").

One table of cases, one test body. Each case runs a loop whose user code
misbehaves next to a healthy loop in the same runtime, and checks that the bad
loop ends in `idle` with the expected outcome and a message naming what went
wrong, that the healthy loop still answers, and that every function call in
either context has exactly one output.

What the cases pin, by kind of user code:

- provider, interception handler, model wrapper, `stop_when`, `finish_turn`,
  structured-output validation: an exception fails the loop (its type and
  text are the loop's error, even when `str()` raises); a value of the wrong
  type fails it with a message naming the kind of code and the type.
- tool (sync and async) and tool wrapper: an exception becomes the call's
  error output and the loop goes on to answer; an odd value is JSON, or an
  error output when it cannot be.
- anything that awaits (a provider, an async handler, wrapper, tool or
  `finish_turn`, a sync tool in its worker thread) and never returns is ended
  by the loop's `deadline` (`failed`, `LoopTimeout`) or by `Runtime.cancel`
  (`cancelled`). Sync user code that runs in the loop's thread (a sync
  handler or provider, `stop_when`, a validator) and blocks forever cannot be
  ended by anything: it holds the event loop. That is a limit of running code
  in-thread, not a case here.
- `BaseException`s that are not cancellation (`KeyboardInterrupt`,
  `SystemExit`, a class of the user's) are not the loop's to absorb: they
  mean "stop the program". They leave the runtime (in an exception group, as
  any task's do), after the loop that raised them ended `failed` naming them
  and every other loop ended `cancelled`: no loop is left without an outcome.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

import anyio
import pytest
from pydantic import BaseModel, field_validator

from agentfsm import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    LoopStatus,
    ModelContext,
    ModelRequest,
    Outcome,
    PendingTransition,
    Runtime,
    Tool,
    ToolCall,
    ToolResult,
    Trigger,
)
from agentfsm.events import LoopIdle
from agentfsm.inference import ModelWrapper
from agentfsm.interception import InterceptionHandler
from agentfsm.providers import ModelNext, Provider
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from agentfsm.tools import ToolNext
from tests.helpers import request, wait_until


class Unprintable(Exception):
    """An exception whose `str()` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class Falsy:
    """A value whose truth cannot be told (`bool()` raises)."""

    def __bool__(self) -> bool:
        raise ValueError("no truth value")


class Sleeper:
    """User code that never returns, saying when it started to wait."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        """Set once the test is over: a worker thread cannot be killed."""

    async def forever(self) -> NoReturn:
        self.started.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    def block(self) -> None:
        self.started.set()
        self.release.wait()


ANSWER = '{"x": 1}'
"""The bad loop's answer (JSON, so a structured output can validate it)."""


class Answer(BaseModel):
    x: int


@dataclass(frozen=True)
class Setup:
    """The misbehaving user code of one case; the rest is a loop that calls
    tool `t` once (call `c1`) and then answers."""

    provider: Provider | None = None
    handler: InterceptionHandler | None = None
    tool: Tool | None = None
    options: dict[str, Any] = field(default_factory=dict)
    structured_output: type[BaseModel] | None = None


def fine_t(x: int) -> int:
    """A tool that works."""
    return x


def script() -> ScriptedProvider:
    return ScriptedProvider([calls(call("t", call_id="c1", x=1)), text(ANSWER)])


# ----------------------------------------------------------------- user code


def raising(exc: BaseException) -> Callable[..., NoReturn]:
    def raise_(*_: Any) -> NoReturn:
        raise exc

    return raise_


def returning(value: object) -> Callable[..., Any]:
    def return_(*_: Any) -> Any:
        return value

    return return_


def provider(fn: Callable[[InferenceInput], Any]) -> Setup:
    return Setup(provider=FunctionProvider(fn))


def sleeping_provider(s: Sleeper) -> Setup:
    async def answer(_: InferenceInput) -> InferenceOutput:
        await s.forever()

    return provider(answer)


def handler(fn: Callable[[], Any]) -> Setup:
    """A handler misbehaving before the tool batch (the calls are not in the
    context yet) and proceeding elsewhere."""

    async def handle(pending: PendingTransition) -> Any:
        if pending.trigger is Trigger.call_tools:
            result = fn()
            return (await result) if hasattr(result, "__await__") else result
        return None

    return Setup(handler=handle)


def model_wrapper(fn: Callable[[], Any]) -> Setup:
    async def wrap(request: ModelRequest, next_: ModelNext) -> InferenceOutput:
        result = fn()
        return (await result) if hasattr(result, "__await__") else result  # type: ignore[no-any-return]

    wrappers: list[ModelWrapper] = [wrap]
    return Setup(options={"model_wrappers": wrappers})


def tool_wrapper(fn: Callable[[], Any]) -> Setup:
    async def wrap(tool_call: ToolCall, next_: ToolNext) -> ToolResult:
        result = fn()
        return (await result) if hasattr(result, "__await__") else result  # type: ignore[no-any-return]

    return Setup(options={"tool_wrappers": [wrap]})


def async_tool(fn: Callable[[], Any]) -> Setup:
    async def t(x: int) -> Any:
        """A tool that misbehaves."""
        result = fn()
        return (await result) if hasattr(result, "__await__") else result

    return Setup(tool=Tool(t))


def sync_tool(fn: Callable[[], Any]) -> Setup:
    def t(x: int) -> Any:
        """A tool that misbehaves (run in a worker thread)."""
        return fn()

    return Setup(tool=Tool(t))


def stop_when(fn: Callable[[object], Any]) -> Setup:
    return Setup(options={"stop_when": [fn]})


def finish_turn(fn: Callable[[], Any]) -> Setup:
    def finish(_: object) -> Any:
        return fn()

    return Setup(options={"finish_turn": finish})


def validator(exc: Exception) -> Setup:
    class Checked(BaseModel):
        x: int

        @field_validator("x")
        @classmethod
        def check(cls, value: int) -> int:
            raise exc

    return Setup(structured_output=Checked, options={"structured_output_retries": 0})


# ----------------------------------------------------------------- the table

Ending = Literal["", "deadline", "cancel"]


@dataclass(frozen=True)
class Case:
    make: Callable[[Sleeper], Setup]
    outcome: Outcome
    says: str = ""
    """In the loop's error message (failed), or in call `c1`'s output (answered)."""
    error: str | None = None
    """The loop's error type (failed)."""
    ending: Ending = ""


def boom() -> ValueError:
    return ValueError("boom")


UNPRINTABLE = "<Unprintable whose str() raised RuntimeError>"
DEADLINE = "the loop ran past its deadline of 0.05s"

CASES = {
    # provider
    "provider raises": Case(
        lambda s: provider(raising(boom())), Outcome.failed, "boom", "ValueError"
    ),
    "provider raises unprintable": Case(
        lambda s: provider(raising(Unprintable())),
        Outcome.failed,
        UNPRINTABLE,
        "Unprintable",
    ),
    "provider returns None": Case(
        lambda s: provider(returning(None)),
        Outcome.failed,
        "provider for 'bad:x' returned NoneType, not an InferenceOutput",
        "ProviderError",
    ),
    "provider returns a dict": Case(
        lambda s: provider(returning({"items": []})),
        Outcome.failed,
        "provider for 'bad:x' returned dict, not an InferenceOutput",
        "ProviderError",
    ),
    "provider sleeps, deadline": Case(
        sleeping_provider, Outcome.failed, DEADLINE, "LoopTimeout", "deadline"
    ),
    "provider sleeps, cancel": Case(
        sleeping_provider, Outcome.cancelled, ending="cancel"
    ),
    # interception handler
    "handler raises": Case(
        lambda s: handler(raising(boom())), Outcome.failed, "boom", "ValueError"
    ),
    "handler raises unprintable": Case(
        lambda s: handler(raising(Unprintable())),
        Outcome.failed,
        UNPRINTABLE,
        "Unprintable",
    ),
    "handler returns a str": Case(
        lambda s: handler(returning("proceed")),
        Outcome.failed,
        "interception handler returned 'proceed'; expected Proceed",
        "TypeError",
    ),
    "handler returns a dict": Case(
        lambda s: handler(returning({"decision": "abort"})),
        Outcome.failed,
        "interception handler returned {'decision': 'abort'}",
        "TypeError",
    ),
    "handler sleeps, deadline": Case(
        lambda s: handler(s.forever),
        Outcome.failed,
        DEADLINE,
        "LoopTimeout",
        "deadline",
    ),
    "handler sleeps, cancel": Case(
        lambda s: handler(s.forever), Outcome.cancelled, ending="cancel"
    ),
    # model wrapper
    "model wrapper raises": Case(
        lambda s: model_wrapper(raising(boom())), Outcome.failed, "boom", "ValueError"
    ),
    "model wrapper raises unprintable": Case(
        lambda s: model_wrapper(raising(Unprintable())),
        Outcome.failed,
        UNPRINTABLE,
        "Unprintable",
    ),
    "model wrapper returns None": Case(
        lambda s: model_wrapper(returning(None)),
        Outcome.failed,
        "the model wrappers returned NoneType, not an InferenceOutput",
    ),
    "model wrapper returns a dict": Case(
        lambda s: model_wrapper(returning({"items": []})),
        Outcome.failed,
        "the model wrappers returned dict, not an InferenceOutput",
    ),
    "model wrapper sleeps, deadline": Case(
        lambda s: model_wrapper(s.forever),
        Outcome.failed,
        DEADLINE,
        "LoopTimeout",
        "deadline",
    ),
    "model wrapper sleeps, cancel": Case(
        lambda s: model_wrapper(s.forever), Outcome.cancelled, ending="cancel"
    ),
    # tool wrapper: like the tool it wraps, a failure is the call's output
    "tool wrapper raises": Case(
        lambda s: tool_wrapper(raising(boom())),
        Outcome.answered,
        "raised ValueError: boom",
    ),
    "tool wrapper raises unprintable": Case(
        lambda s: tool_wrapper(raising(Unprintable())),
        Outcome.answered,
        f"raised Unprintable: {UNPRINTABLE}",
    ),
    "tool wrapper returns an object": Case(
        lambda s: tool_wrapper(returning(object())),
        Outcome.answered,
        "Unable to serialize unknown type: <class 'object'>",
    ),
    "tool wrapper sleeps, deadline": Case(
        lambda s: tool_wrapper(s.forever),
        Outcome.failed,
        DEADLINE,
        "LoopTimeout",
        "deadline",
    ),
    "tool wrapper sleeps, cancel": Case(
        lambda s: tool_wrapper(s.forever), Outcome.cancelled, ending="cancel"
    ),
    # async tool
    "async tool raises": Case(
        lambda s: async_tool(raising(boom())),
        Outcome.answered,
        "tool 't' raised ValueError: boom",
    ),
    "async tool raises unprintable": Case(
        lambda s: async_tool(raising(Unprintable())),
        Outcome.answered,
        f"tool 't' raised Unprintable: {UNPRINTABLE}",
    ),
    "async tool returns an object": Case(
        lambda s: async_tool(returning(object())),
        Outcome.answered,
        "tool 't' returned a value that cannot be serialized to JSON (object)",
    ),
    "async tool returns a dict": Case(
        lambda s: async_tool(returning({"a": [1, None]})),
        Outcome.answered,
        '{"a":[1,null]}',
    ),
    "async tool sleeps, deadline": Case(
        lambda s: async_tool(s.forever),
        Outcome.failed,
        DEADLINE,
        "LoopTimeout",
        "deadline",
    ),
    "async tool sleeps, cancel": Case(
        lambda s: async_tool(s.forever), Outcome.cancelled, ending="cancel"
    ),
    # sync tool (in a worker thread)
    "sync tool raises": Case(
        lambda s: sync_tool(raising(boom())),
        Outcome.answered,
        "tool 't' raised ValueError: boom",
    ),
    "sync tool raises unprintable": Case(
        lambda s: sync_tool(raising(Unprintable())),
        Outcome.answered,
        f"tool 't' raised Unprintable: {UNPRINTABLE}",
    ),
    "sync tool returns an object": Case(
        lambda s: sync_tool(returning(object())),
        Outcome.answered,
        "tool 't' returned a value that cannot be serialized to JSON (object)",
    ),
    "sync tool returns None": Case(
        lambda s: sync_tool(returning(None)), Outcome.answered, "null"
    ),
    "sync tool blocks, deadline": Case(
        lambda s: sync_tool(s.block),
        Outcome.failed,
        DEADLINE,
        "LoopTimeout",
        "deadline",
    ),
    "sync tool blocks, cancel": Case(
        lambda s: sync_tool(s.block), Outcome.cancelled, ending="cancel"
    ),
    # stop_when
    "stop_when raises": Case(
        lambda s: stop_when(raising(boom())), Outcome.failed, "boom", "ValueError"
    ),
    "stop_when raises unprintable": Case(
        lambda s: stop_when(raising(Unprintable())),
        Outcome.failed,
        UNPRINTABLE,
        "Unprintable",
    ),
    "stop_when returns what has no truth": Case(
        lambda s: stop_when(returning(Falsy())),
        Outcome.failed,
        "returned Falsy",
        "ConfigurationError",
    ),
    "stop_when returns a dict": Case(
        lambda s: stop_when(returning({"stop": True})),
        Outcome.failed,
        "returned dict",
        "ConfigurationError",
    ),
    # finish_turn
    "finish_turn raises": Case(
        lambda s: finish_turn(raising(boom())), Outcome.failed, "boom", "ValueError"
    ),
    "finish_turn raises unprintable": Case(
        lambda s: finish_turn(raising(Unprintable())),
        Outcome.failed,
        UNPRINTABLE,
        "Unprintable",
    ),
    # What a callback returns is not used (as for any callback): a value is ignored.
    "finish_turn returns a value": Case(
        lambda s: finish_turn(returning({"ok": False})), Outcome.answered, "1"
    ),
    "finish_turn sleeps, deadline": Case(
        lambda s: finish_turn(s.forever),
        Outcome.failed,
        DEADLINE,
        "LoopTimeout",
        "deadline",
    ),
    "finish_turn sleeps, cancel": Case(
        lambda s: finish_turn(s.forever), Outcome.cancelled, ending="cancel"
    ),
    # structured-output validation: a ValueError is an invalid answer (retried,
    # here not at all); any other exception is a bug in the validator.
    "validator says invalid": Case(
        lambda s: validator(ValueError("x is odd")),
        Outcome.failed,
        "the answer did not match the structured output after 1 attempts",
        "StructuredOutputError",
    ),
    "validator raises": Case(
        lambda s: validator(RuntimeError("boom")),
        Outcome.failed,
        "boom",
        "RuntimeError",
    ),
    "validator raises unprintable": Case(
        lambda s: validator(Unprintable()),
        Outcome.failed,
        UNPRINTABLE,
        "Unprintable",
    ),
}


def outputs_per_call(context: ModelContext) -> dict[str, int]:
    """How many outputs each function call of a context has (outputs without a
    call are counted under their id too, as calls that are missing)."""
    items = context.items
    counts = Counter(i.call_id for i in items if isinstance(i, FunctionCallOutputItem))
    called = [i.call_id for i in items if isinstance(i, FunctionCallItem)]
    return {call_id: counts[call_id] for call_id in {*called, *counts}} | {
        f"{call_id} (no call)": 1 for call_id in counts if call_id not in called
    }


def output_of(context: ModelContext, call_id: str) -> str:
    for item in context.items:
        if isinstance(item, FunctionCallOutputItem) and item.call_id == call_id:
            return item.output
    raise AssertionError(f"no output for {call_id}")


@pytest.mark.parametrize("case", [pytest.param(c, id=k) for k, c in CASES.items()])
async def test_misbehaving_user_code_ends_only_its_own_loop(case: Case) -> None:
    sleeper = Sleeper()
    setup = case.make(sleeper)
    options = dict(setup.options)
    if case.ending == "deadline":
        options["deadline"] = 0.05
    bad_input = InferenceInput(
        model="bad:x",
        context=ModelContext(),
        tools=(setup.tool or Tool(fine_t, name="t"),),
        structured_output=setup.structured_output,
    )
    good_input = request(model="ok:x")
    healthy = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    providers = {"bad": setup.provider or script(), "ok": healthy}
    try:
        with anyio.fail_after(10):
            async with Runtime(providers=providers) as runtime:
                recorder = EventRecorder(runtime.bus, "loop.idle")
                bad = runtime.run_loop(
                    "agent", "go", bad_input, setup.handler, **options
                )
                good = runtime.run_loop("agent", "go", good_input)
                if case.ending == "cancel":
                    await wait_until(sleeper.started.is_set)
                    runtime.cancel(bad, "enough")
                result = await runtime.wait(bad)
                fine = await runtime.wait(good)
    finally:
        sleeper.release.set()
    assert result.outcome is case.outcome, result.error
    if case.outcome is Outcome.failed:
        assert result.error is not None
        assert case.says in result.error.message
        if case.error is not None:
            assert result.error.type == case.error
    elif case.outcome is Outcome.answered:
        assert case.says in output_of(bad_input.context, "c1")
    else:
        assert result.reason == "enough"
    assert fine.outcome is Outcome.answered
    assert runtime.get(bad).status is LoopStatus.done
    idle = [e for e in recorder.events if isinstance(e, LoopIdle)]
    assert sorted(e.loop_id for e in idle) == sorted([bad, good])
    for context in (bad_input.context, good_input.context):
        assert set(outputs_per_call(context).values()) <= {1}, context.items


# ------------------------------------------------ BaseException, not cancellation


class Halt(BaseException):
    """A BaseException of the user's own (as some libraries use for control flow)."""


@pytest.mark.parametrize("source", ["provider", "tool", "handler"])
async def test_a_base_exception_stops_the_runtime_but_every_loop_ends(
    source: str,
) -> None:
    """It leaves the runtime; the loop that raised it ends `failed` naming it,
    the others `cancelled`, and every call has its output."""
    exc = Halt
    sleeper = Sleeper()
    setup = {
        "provider": lambda: provider(raising(exc())),
        "tool": lambda: async_tool(raising(exc())),
        "handler": lambda: handler(raising(exc())),
    }[source]()
    bad_input = InferenceInput(
        model="bad:x",
        context=ModelContext(),
        tools=(setup.tool or Tool(fine_t, name="t"),),
    )
    waiting = FunctionProvider(lambda _: sleeper.forever())
    runtime = Runtime(providers={"bad": setup.provider or script(), "wait": waiting})
    recorder = EventRecorder(runtime.bus, "loop.idle")
    ids: dict[str, str] = {}

    async def run() -> None:
        async with runtime:
            ids["other"] = runtime.run_loop("agent", "go", request(model="wait:x"))
            await wait_until(sleeper.started.is_set)
            ids["bad"] = runtime.run_loop("agent", "go", bad_input, setup.handler)
            await runtime.wait(ids["bad"])

    with anyio.fail_after(10), pytest.raises(BaseExceptionGroup) as caught:
        await run()
    bad, other = ids["bad"], ids["other"]
    assert caught.group_contains(exc)
    ended = {e.loop_id: e for e in recorder.events if isinstance(e, LoopIdle)}
    assert ended[bad].outcome is Outcome.failed
    assert (runtime.get(bad).status, runtime.get(other).status) == (
        LoopStatus.done,
        LoopStatus.done,
    )
    result = await runtime.wait(bad)
    assert result.error is not None
    assert exc.__name__ in (result.error.type, result.error.message)
    assert ended[other].outcome is Outcome.cancelled
    assert set(outputs_per_call(bad_input.context).values()) <= {1}
