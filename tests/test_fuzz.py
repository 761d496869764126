"""Fuzzing the public API with hypothesis (issue 12, "keep it fixed").

What is fuzzed: a model's function-call arguments (any text, any JSON),
interception plans (a decision at each transition, rewrites to any state with
any payload), resume decisions (garbage included), `LoopOptions` values,
`InferenceInput` fields, and user messages (`run_loop`, `steer`,
`follow_up`).

The property, every time: the call is refused at the API with an error naming
what was wrong (`ConfigurationError`, or pydantic's `ValidationError` naming
the field, for a model built by the caller), or the loop ends in `idle` with
an outcome. Never a hang (each example runs under `fail_after`), a crashed
runtime (an exception leaving `async with Runtime()`), or a lost loop (one
neither running, paused nor done; or done without an outcome, a `loop.idle`,
or an output for each of its function calls).

hypothesis and anyio: each property is a sync `@given` test that runs its
async body with `anyio.run(..., backend=...)`, parametrized by backend, so
hypothesis drives examples and each one gets a fresh event loop.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from agentfsm import (
    Abort,
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    LoopState,
    LoopStatus,
    ModelContext,
    ModelMessageItem,
    Pause,
    PendingTransition,
    Proceed,
    Rewrite,
    Runtime,
    ToolBatch,
    UserMessage,
)
from agentfsm.events import LoopIdle
from agentfsm.exceptions import ConfigurationError, LoopStateError, UnknownProvider
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import EventRecorder, calls, text
from tests.helpers import add, assert_one_output_per_call

T = TypeVar("T")

BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])
FUZZ = settings(
    # Modest, for `make test`; hunt longer with AGENTFSM_FUZZ_EXAMPLES=5000.
    max_examples=int(os.environ.get("AGENTFSM_FUZZ_EXAMPLES", "100")),
    deadline=None,  # an example's time varies with the machine's load
    suppress_health_check=[HealthCheck.too_slow],
)
TIMEOUT = 10
"""Seconds an example may take before it counts as a hang."""


# ------------------------------------------------------------------ helpers


CALL_IDS = itertools.count()
"""The model's call ids: never the same twice (`check_ended` pairs each call
with its output by id). Named by the context's size, a handler that rewrote
the request with another context made the model name two calls `c0`."""


def calling_then_answering(inference_input: InferenceInput) -> InferenceOutput:
    """Call `add` after a user message, answer after a tool's output: a loop
    that never runs out of script, whatever a handler makes it do."""
    items = inference_input.context.items
    if items and isinstance(items[-1], FunctionCallOutputItem):
        return text('{"x": 1}')
    call_id = f"c{next(CALL_IDS)}"
    return calls(FunctionCallItem(call_id=call_id, name="add", arguments="{}"))


async def checkpointed(inference_input: InferenceInput) -> InferenceOutput:
    """`calling_then_answering`, after a checkpoint (so timeouts can fire)."""
    await anyio.lowlevel.checkpoint()
    return calling_then_answering(inference_input)


async def wait_ended(runtime: Runtime, loop_id: str) -> None:
    """Wait for the loop (a lost loop never ends: `run`'s timeout catches it)."""
    await runtime.wait(loop_id)


def refused(
    call: Callable[[], T], *errors: type[Exception]
) -> tuple[T, None] | tuple[None, Exception]:
    """`call()`'s result, or the error (of these types) it raised."""
    try:
        return call(), None
    except errors as exc:
        return None, exc


def check_ended(
    runtime: Runtime,
    recorder: EventRecorder,
    loop_id: str,
    context: ModelContext,
    start: int = 0,
) -> None:
    """The loop is done with an outcome, published once, every call answered."""
    view = runtime.get(loop_id)
    assert view.status is LoopStatus.done
    assert view.outcome is not None
    event(f"outcome: {view.outcome}")
    idle = [e for e in recorder.events if isinstance(e, LoopIdle)]
    assert [e.outcome for e in idle if e.loop_id == loop_id] == [view.outcome]
    assert runtime.loops(status=LoopStatus.running) == []
    assert runtime.loops(status=LoopStatus.paused) == []
    # (A decision may hand the loop a batch whose calls share an id.)
    assert_one_output_per_call(context.items[start:], ids_repeat=True)


def run(backend: str, body: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        with anyio.fail_after(TIMEOUT):
            await body()

    anyio.run(bounded, backend=backend)


def request(**fields: Any) -> InferenceInput:
    values: dict[str, Any] = {
        "model": "fuzz:x",
        "context": ModelContext(),
        "tools": (add,),
    }
    return InferenceInput(**(values | fields))


PROVIDERS = {"fuzz": FunctionProvider(checkpointed)}

# --------------------------------------------------------------- strategies

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=10,
)
garbage = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.just(object()),
)
user_messages = st.builds(UserMessage, content=st.text(max_size=20))
model_messages = st.builds(ModelMessageItem, content=st.text(max_size=20))
states = st.sampled_from(LoopState)
payloads = st.one_of(
    st.none(),
    user_messages,
    st.lists(user_messages, max_size=2).map(tuple),
    model_messages,
    st.builds(request),
    st.builds(
        ToolBatch,
        calls=st.lists(
            st.builds(
                FunctionCallItem,
                call_id=st.sampled_from(["a", "b"]),
                name=st.sampled_from(["add", "nope"]),
                arguments=st.just("{}"),
            ),
            max_size=2,
            unique_by=lambda c: c.call_id,  # (a ToolBatch refuses a repeated id)
        ).map(tuple),
    ),
)
decisions = st.one_of(
    st.none(),
    st.builds(Proceed),
    st.builds(Rewrite, dest=st.none() | states, payload=payloads),
    # Bypassing validation: the loop must refuse a payload that cannot fit.
    st.builds(
        lambda dest, junk: Rewrite.model_construct(dest=dest, payload=junk),
        st.none() | states,
        garbage,
    ),
    st.builds(Pause, st.text(max_size=8)),
    st.builds(Abort, st.text(max_size=8)),
)


# ---------------------------------------------------------- tool arguments


@BACKENDS
@FUZZ
@given(
    arguments=st.lists(
        st.one_of(st.text(max_size=30), json_values.map(lambda v: to_json(v).decode())),
        min_size=1,
        max_size=3,
    ),
    names=st.lists(st.sampled_from(["add", "nope", ""]), min_size=3, max_size=3),
)
def test_any_function_call_arguments_get_an_output(
    backend: str, arguments: list[str], names: list[str]
) -> None:
    """Whatever arguments (and names) the model sends, each call gets one
    output and the loop answers."""
    batch = calls(
        *(
            FunctionCallItem(call_id=f"c{i}", name=name, arguments=args)
            for i, (args, name) in enumerate(zip(arguments, names, strict=False))
        )
    )

    def model(inference_input: InferenceInput) -> InferenceOutput:
        last = inference_input.context.items[-1]
        return text("done") if isinstance(last, FunctionCallOutputItem) else batch

    async def body() -> None:
        inference_input = request(model="args:x")
        async with Runtime(providers={"args": FunctionProvider(model)}) as runtime:
            recorder = EventRecorder(runtime.bus, "loop.idle")
            loop_id = runtime.run_loop(
                "agent", "go", inference_input, tool_execution="parallel"
            )
            result = await runtime.wait(loop_id)
            assert result.outcome.value == "answered", result.error
        check_ended(runtime, recorder, loop_id, inference_input.context)
        outputs = [
            i for i in inference_input.context.items if i.type == "function_call_output"
        ]
        assert len(outputs) == len(batch.items)

    run(backend, body)


# ------------------------------------------ interception plans and resumes

CANCEL = "<cancel instead of resuming>"
resume_decisions = st.one_of(
    decisions,
    garbage,
    st.sampled_from(["yes", "proceed", {"kind": "proceed"}, CANCEL]),
)


@BACKENDS
@FUZZ
@given(
    plan=st.lists(decisions, max_size=12),
    resumes=st.lists(resume_decisions, max_size=6),
    streaming=st.booleans(),
)
# Found once each: requests rewritten with another context (the model saw an
# empty one twice, and named two calls alike); a resume handing the loop a
# batch of two calls of one id. Each call gets one output.
@example(
    plan=[None, Rewrite(payload=request()), None, Rewrite(payload=request())],
    resumes=[],
    streaming=False,
)
@example(
    plan=[None, None, Pause("")],
    resumes=[
        # (Built past the validators, which refuse a batch repeating an id.)
        Rewrite.model_construct(
            payload=ToolBatch.model_construct(
                calls=(
                    FunctionCallItem(call_id="a", name="add", arguments="{}"),
                    FunctionCallItem(call_id="a", name="add", arguments="{}"),
                ),
                denied={},
                outputs={},
                awaiting_approval=(),
            )
        )
    ],
    streaming=False,
)
def test_any_interception_plan_and_resume_ends_the_loop(
    backend: str, plan: list[Any], resumes: list[Any], streaming: bool
) -> None:
    """Handlers deciding anything at any transition, and resumes with anything,
    end the loop with an outcome; a refused resume leaves it paused."""
    decisions_left = iter(plan)

    def handler(pending: PendingTransition) -> Any:
        return next(decisions_left, None)

    async def body() -> None:
        inference_input = request(streaming=streaming)
        async with Runtime(providers=PROVIDERS) as runtime:
            recorder = EventRecorder(runtime.bus, "loop.idle")
            loop_id = runtime.run_loop(
                "agent", "go", inference_input, handler, max_turns=4
            )
            # Subscribed before the loop's first step (no await since run_loop).
            ends = runtime.bus.subscribe(("loop.paused", "loop.idle"), loop_id=loop_id)
            resume_left = iter(resumes)
            async for event in ends:
                if event.type == "loop.idle":
                    break
                while True:  # paused: resume it, with garbage first if drawn
                    decision = next(resume_left, None)
                    if decision == CANCEL:
                        runtime.cancel(loop_id, "fuzz")
                        break
                    if decision is None or isinstance(
                        decision, Proceed | Rewrite | Pause | Abort
                    ):
                        runtime.resume(loop_id, decision)
                        break
                    with pytest.raises(ConfigurationError, match="resume\\(\\) takes"):
                        runtime.resume(loop_id, decision)
                    assert runtime.get(loop_id).status is LoopStatus.paused
        check_ended(runtime, recorder, loop_id, inference_input.context)

    run(backend, body)


# ------------------------------------------------------------ option values


def a_condition(view: object) -> bool:
    return False


async def a_model_wrapper(request: Any, next_: Any) -> Any:
    return await next_(request)


async def a_tool_wrapper(call: Any, next_: Any) -> Any:
    return await next_(call)


def a_finish_turn(snapshot: object) -> None:
    return None


Drawn = tuple[dict[str, Any], str | None, bool]
"""Values, the field given a bad value (if any), and whether it is surely bad
(a value known to be wrong, not garbage that may happen to be valid)."""


@st.composite
def with_one_bad(
    draw: st.DrawFn,
    valid: dict[str, st.SearchStrategy[Any]],
    bad: dict[str, tuple[Any, ...]],
) -> Drawn:
    """Valid values for some fields, and maybe a bad value or garbage for one.
    (With every field at risk, nearly every example would be refused and no
    loop would run.)"""
    values = draw(st.fixed_dictionaries({}, optional=valid))
    kind = draw(st.sampled_from(["valid", "bad", "garbage"]))
    if kind == "valid":
        return values, None, False
    name = draw(st.sampled_from(sorted(bad)))
    if kind == "bad" or name == "model":  # a random model could name a real provider
        values[name] = draw(st.sampled_from(bad[name]))
        return values, name, True
    values[name] = draw(garbage)
    return values, name, False


seconds = st.floats(min_value=1e-3, max_value=0.02)
valid_options: dict[str, st.SearchStrategy[Any]] = {
    "max_turns": st.integers(min_value=1, max_value=10_000),
    "stop_when": st.lists(st.just(a_condition), max_size=2),
    "tool_execution": st.sampled_from(["sequential", "parallel"]),
    "max_tool_concurrency": st.integers(min_value=1, max_value=4),
    "tool_wrappers": st.lists(st.just(a_tool_wrapper), max_size=2),
    "model_wrappers": st.lists(st.just(a_model_wrapper), max_size=2),
    "steering_mode": st.sampled_from(["all", "one-at-a-time"]),
    "follow_up_mode": st.sampled_from(["all", "one-at-a-time"]),
    "inference_timeout": st.none() | seconds,
    "deadline": st.none() | seconds,
    "max_retries": st.integers(min_value=0, max_value=3),
    "retry_backoff": st.just(0) | seconds,
    "structured_output_retries": st.integers(min_value=0, max_value=3),
    "finish_turn": st.sampled_from([None, a_finish_turn]),
}
NOT_SECONDS = (math.nan, math.inf, -math.inf, -1.0, 0, "1", True)
bad_options: dict[str, tuple[Any, ...]] = {
    "max_turns": (0, -1, 10_001, 2.5, "3", True),
    "stop_when": ([None], [1], "abc", a_condition),
    "tool_execution": ("threads", None),
    "max_tool_concurrency": (0, -5, 1.5, False),
    "tool_wrappers": ([None], a_tool_wrapper, [a_tool_wrapper, 1]),
    "model_wrappers": ([None], a_model_wrapper, {"a": 1}),
    "steering_mode": ("some", None),
    "follow_up_mode": ("some", None),
    "inference_timeout": NOT_SECONDS,
    "deadline": NOT_SECONDS,
    "max_retries": (-1, 1.0, "2"),
    "retry_backoff": (math.nan, math.inf, -1.0, "1", True, None),
    "structured_output_retries": (-1, 0.5),
    "finish_turn": (1, "f"),
    "max_turn": (3,),  # typos: unknown options
    "timeout": (1.0,),
}


@BACKENDS
@FUZZ
@given(drawn=with_one_bad(valid_options, bad_options))
def test_any_option_values_are_refused_by_name_or_run(
    backend: str, drawn: Drawn
) -> None:
    """Options are refused at `run_loop`, naming the option that is wrong, or
    the loop ends; valid options are never refused, bad ones always."""
    options, bad, surely = drawn

    async def body() -> None:
        inference_input = request()
        async with Runtime(providers=PROVIDERS) as runtime:
            recorder = EventRecorder(runtime.bus, "loop.idle")
            loop_id, error = refused(
                lambda: runtime.run_loop("agent", "go", inference_input, **options),
                ConfigurationError,
            )
            if loop_id is None:
                event("refused")
                assert bad is not None, error
                assert bad in str(error)
                assert runtime.loops() == []
                return
            assert not surely, f"{bad}={options.get(bad or '')!r} was taken"
            await wait_ended(runtime, loop_id)
        check_ended(runtime, recorder, loop_id, inference_input.context)

    run(backend, body)


# --------------------------------------------------------- InferenceInput


class Answer(BaseModel):
    x: int


valid_fields: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["fuzz:x", "fuzz:other"]),
    "max_output_tokens": st.none() | st.integers(min_value=1),
    "reasoning_effort": st.none() | st.text(max_size=6),
    "tools": st.sampled_from([(), (add,)]),
    "tool_choice": st.none() | st.sampled_from(["auto", "required", "none", "add"]),
    "reset_tool_choice": st.sampled_from([None, "auto", "none"]),
    "temperature": st.none() | st.floats(min_value=0, max_value=2),
    "top_p": st.none() | st.floats(min_value=1e-6, max_value=1),
    "seed": st.none() | st.integers(),
    "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=2).map(tuple),
    "parallel_tool_calls": st.none() | st.booleans(),
    "streaming": st.booleans(),
    "structured_output": st.sampled_from(
        [None, Answer, {"type": "object", "properties": {"x": {"type": "integer"}}}]
    ),
}
bad_fields: dict[str, tuple[Any, ...]] = {
    "model": (None, 3, "", "fuzz", "nope:x", ":x"),
    "max_output_tokens": (0, -1, "many"),
    "reasoning_effort": (3, ["high"]),
    "tools": ((add, add), [None], "add"),
    "tool_choice": (3, ["auto"]),
    "reset_tool_choice": ("required", "add"),
    "temperature": (-0.1, 2.5, math.nan, "hot"),
    "top_p": (0, 1.5, math.nan),
    "seed": (1.5, "s"),
    "stop_sequences": ([1], [""], None),
    "parallel_tool_calls": ("maybe", 2),  # "yes" is a bool to pydantic
    "streaming": ("maybe", None),
    "structured_output": ({"type": "nonsense"}, {"properties": 5}, int, "schema"),
    "contxt": (ModelContext(),),  # a typo: an unknown field
}


@BACKENDS
@FUZZ
@given(drawn=with_one_bad(valid_fields, bad_fields))
# A class that is no pydantic model was taken, and failed the loop on its answer.
@example(drawn=({"structured_output": int}, "structured_output", True))
def test_any_inference_input_is_refused_by_field_or_runs(
    backend: str, drawn: Drawn
) -> None:
    """An `InferenceInput` is refused naming the wrong field (valid ones never
    are, bad ones always; a model string no provider serves is refused by
    `run_loop`, naming it), or the loop it starts ends."""
    fields, bad, surely = drawn
    made, error = refused(lambda: request(**fields), ValidationError)
    if made is None:
        event("refused")
        assert isinstance(error, ValidationError)
        assert {str(e["loc"][0]) for e in error.errors() if e["loc"]} == {bad}, error
        return
    inference_input = made

    async def body() -> None:
        async with Runtime(providers=PROVIDERS) as runtime:
            recorder = EventRecorder(runtime.bus, "loop.idle")
            loop_id, error = refused(
                lambda: runtime.run_loop(
                    "agent", "go", inference_input, structured_output_retries=0
                ),
                ConfigurationError,
                UnknownProvider,
            )
            if loop_id is None:
                event("refused by run_loop")
                assert bad == "model", error
                assert repr(inference_input.model) in str(error)
                return
            assert not surely, f"{bad}={fields.get(bad or '')!r} was taken"
            await wait_ended(runtime, loop_id)
        check_ended(runtime, recorder, loop_id, inference_input.context)

    run(backend, body)


# ----------------------------------------------------------- user messages

messages = st.one_of(
    st.text(max_size=20), user_messages, st.none(), garbage, st.builds(request)
)


@BACKENDS
@FUZZ
@given(
    first=messages,
    context=st.lists(
        st.sampled_from(
            [
                UserMessage(content="earlier"),
                ModelMessageItem(content="said"),
                FunctionCallItem(call_id="old", name="add", arguments="{}"),
            ]
        ),
        max_size=3,
    ),
    queued=st.lists(st.tuples(st.booleans(), messages), max_size=4),
)
def test_any_user_message_is_refused_by_name_or_enters_the_loop(
    backend: str, first: Any, context: list[Any], queued: list[tuple[bool, Any]]
) -> None:
    """`run_loop`, `steer` and `follow_up` refuse what is not a message by
    name; what they take ends up in a loop that ends."""

    async def body() -> None:
        inference_input = request(context=ModelContext(items=list(context)))
        async with Runtime(providers=PROVIDERS) as runtime:
            recorder = EventRecorder(runtime.bus, "loop.idle")
            loop_id, error = refused(
                lambda: runtime.run_loop("agent", first, inference_input),
                ConfigurationError,
            )
            if loop_id is None:
                event("refused")
                assert "message" in str(error)
                assert runtime.loops() == []
                return
            for follow_up, message in queued:
                queue = runtime.follow_up if follow_up else runtime.steer
                _, error = refused(
                    lambda: queue(loop_id, message),  # noqa: B023 - called at once
                    ConfigurationError,
                    LoopStateError,
                )
                if isinstance(error, LoopStateError):
                    assert runtime.get(loop_id).status is LoopStatus.done
                elif error is not None:
                    event("refused a queued message")
                    assert not isinstance(message, str | UserMessage)
                    assert f"{queue.__name__}() takes a str" in str(error)
                await anyio.lowlevel.checkpoint()
            await wait_ended(runtime, loop_id)
        # The caller's items may hold a call without an output: requests are
        # repaired (see `_loop.repair`), the caller's items are left as given.
        check_ended(runtime, recorder, loop_id, inference_input.context, len(context))

    run(backend, body)
