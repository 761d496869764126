"""Guards of the hot path's speed measures (bench/PERFORMANCE.md): each test fails
if its trick breaks a behaviour the fast path must keep. None of them times
anything."""

from __future__ import annotations
import __future__

import importlib
import subprocess
import sys
from collections.abc import Sequence
from functools import partial

import anyio
import pytest

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    ModelContext,
    ModelMessageItem,
    PendingTransition,
    ReasoningItem,
    Rewrite,
    Runtime,
    Trigger,
    tool,
)
from agentfsm._loop.states.inference import calls_and_message
from agentfsm._runtime.backend import (
    AsyncioEvent,
    TaskRunner,
    primitives,
    run_asyncio_tasks,
    run_tasks,
)
from agentfsm.interception import Decision
from agentfsm.messages import FunctionCallItem, FunctionCallOutputItem
from agentfsm.testing import ScriptedProvider, call, calls, text


def outputs_of(items: Sequence[object]) -> list[str]:
    return [i.output for i in items if isinstance(i, FunctionCallOutputItem)]


# ------------------------------------------------ the backend's classes found once


async def test_the_backend_classes_are_the_running_backends(anyio_backend: str) -> None:
    """`primitives()` finds the running backend's own classes, and they work
    there: a scope cancels, an event wakes its waiter."""
    found = primitives()
    assert type(found.cancel_scope()).__module__ == f"anyio._backends._{anyio_backend}"
    # On asyncio, the event is agentfsm's own (see `AsyncioEvent`).
    expected = AsyncioEvent if anyio_backend == "asyncio" else type(anyio.Event())
    assert found.event is expected
    with found.cancel_scope() as scope:
        scope.cancel()
        await anyio.sleep(10)
    assert scope.cancelled_caught
    event = found.event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(event.wait)
        await anyio.wait_all_tasks_blocked()
        event.set()
    assert event.is_set()


class TestAsyncioEvent:
    """`AsyncioEvent` behaves as anyio's event on asyncio (which holds an
    `asyncio.Event`): the runtime's loops, workers and subscribers wait on it."""

    pytestmark = pytest.mark.parametrize("anyio_backend", ["asyncio"])

    @staticmethod
    async def waiter(event: AsyncioEvent, woken: list[str], name: str) -> None:
        await event.wait()
        woken.append(name)

    async def test_set_wakes_every_waiter_once(self) -> None:
        event = AsyncioEvent()
        woken: list[str] = []
        async with anyio.create_task_group() as tg:
            for name in "abc":
                tg.start_soon(self.waiter, event, woken, name)
            await anyio.wait_all_tasks_blocked()
            assert event.statistics().tasks_waiting == 3
            assert not event.is_set()
            event.set()
            event.set()  # a second set changes nothing
        assert sorted(woken) == ["a", "b", "c"]
        assert event.is_set()
        assert event.statistics().tasks_waiting == 0

    async def test_a_cancelled_waiter_leaves_the_others_waiting(self) -> None:
        event = AsyncioEvent()
        woken: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.waiter, event, woken, "stays")
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as inner:
                    inner.start_soon(self.waiter, event, woken, "cancelled")
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()
            assert scope.cancelled_caught
            await anyio.wait_all_tasks_blocked()
            assert event.statistics().tasks_waiting == 1
            event.set()
        assert woken == ["stays"]

    async def test_waiting_on_a_set_event_is_a_checkpoint(self) -> None:
        """As anyio's: a cancelled scope stops there, and other tasks run."""
        event = AsyncioEvent()
        event.set()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await event.wait()
            pytest.fail("the wait was no checkpoint")  # pragma: no cover
        ran: list[bool] = []

        async def other() -> None:
            ran.append(True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await event.wait()
            assert ran == [True]

    async def test_a_waiter_cancelled_after_the_set_leaves(self) -> None:
        """A waiter cancelled after the set leaves the line too."""
        event = AsyncioEvent()
        async with anyio.create_task_group() as tg:
            tg.start_soon(event.wait)
            await anyio.wait_all_tasks_blocked()
            event.set()
            tg.cancel_scope.cancel()  # the waiter's future is done: no harm
        assert event.statistics().tasks_waiting == 0


async def test_a_loops_tool_deadline_and_wait_use_the_runtimes_classes() -> None:
    """A tool that waits past its timeout is ended by the scope the runtime's
    class makes, and `wait` wakes through its event class, on either backend."""

    @tool(timeout=0.01)
    async def slow() -> str:
        """Wait too long."""
        await anyio.sleep(10)
        return "never"

    script = ScriptedProvider([calls(call("slow")), text("done")])
    with anyio.fail_after(10):
        async with Runtime(providers={"scripted": script}) as runtime:
            # The classes found once are the running backend's own.
            assert runtime._primitives.cancel_scope is type(anyio.CancelScope())
            assert runtime._primitives.event is primitives().event
            request = InferenceInput(
                model="scripted:x", context=ModelContext(), tools=[slow]
            )
            result = await runtime.wait(runtime.run_loop("a", "go", request))
    assert result.answer is not None
    assert result.answer.content == "done"
    [output] = outputs_of(request.context.items)
    assert "timed out" in output


# ---------------------------------------------------- a parallel batch's tasks


@pytest.fixture(params=["anyio", "asyncio"])
async def runner(request: pytest.FixtureRequest, anyio_backend: str) -> TaskRunner:
    """A task runner: anyio's group (every backend), asyncio's own tasks."""
    if request.param == "anyio":
        return run_tasks
    if anyio_backend != "asyncio":
        pytest.skip("asyncio's tasks run on asyncio only")
    return partial(run_asyncio_tasks, type(anyio.CancelScope()))


async def test_the_runtime_runs_a_batchs_tasks_with_its_backends_runner(
    anyio_backend: str,
) -> None:
    runner = primitives().run_tasks
    if anyio_backend == "asyncio":
        assert isinstance(runner, partial)
        assert runner.func is run_asyncio_tasks
        assert runner.args == (type(anyio.CancelScope()),)
    else:
        assert runner is run_tasks


class TestTaskRunners:
    """`run_tasks` and `run_asyncio_tasks` behave alike: what a parallel batch
    relies on (`tool_call.run_parallel`)."""

    async def test_the_first_error_cancels_the_others_and_is_raised_as_it_is(
        self, runner: TaskRunner
    ) -> None:
        started: list[int] = []
        cancelled: list[int] = []
        all_started = anyio.Event()

        async def task() -> None:
            number = len(started)
            started.append(number)
            if len(started) == 3:
                all_started.set()
            if number == 1:
                await all_started.wait()
                raise ValueError("the second task failed")
            try:
                await anyio.sleep_forever()
            finally:
                cancelled.append(number)

        with anyio.fail_after(5), pytest.raises(ValueError, match="second task"):
            await runner(3, task, "tasks")
        assert sorted(started) == [0, 1, 2]
        assert sorted(cancelled) == [0, 2]

    async def test_a_shield_inside_a_task_holds_through_a_cancel_of_the_caller(
        self, runner: TaskRunner
    ) -> None:
        entered: list[int] = []
        cleaned: list[int] = []
        all_in = anyio.Event()
        release = anyio.Event()

        async def task() -> None:
            with anyio.CancelScope(shield=True):
                entered.append(1)
                if len(entered) == 3:
                    all_in.set()
                await release.wait()  # a task.cancel() would break in here
                cleaned.append(1)
            await anyio.sleep_forever()

        async def caller(scope: anyio.CancelScope) -> None:
            with scope:
                await runner(3, task, "tasks")

        scope = anyio.CancelScope()
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(caller, scope)
                await all_in.wait()
                scope.cancel()
                await anyio.wait_all_tasks_blocked()
                assert cleaned == []  # still inside their shields
                release.set()
        assert cleaned == [1, 1, 1]
        assert scope.cancelled_caught

    async def test_tasks_cancelled_before_their_first_step_run_nothing(
        self, runner: TaskRunner
    ) -> None:
        ran: list[int] = []

        async def task() -> None:
            await anyio.lowlevel.checkpoint_if_cancelled()
            ran.append(1)

        with anyio.CancelScope() as scope:
            scope.cancel()
            await runner(3, task, "tasks")
        assert scope.cancelled_caught
        assert ran == []

    async def test_a_task_sees_the_callers_deadline(self, runner: TaskRunner) -> None:
        seen: list[float] = []

        async def task() -> None:
            seen.append(anyio.current_effective_deadline())

        with anyio.move_on_after(60):
            deadline = anyio.current_effective_deadline()
            await runner(2, task, "tasks")
        assert seen == [deadline, deadline]


# --------------------------------------------------- the tool index's rebuilding


async def test_a_request_rewritten_with_other_tools_runs_the_new_ones() -> None:
    """The tool index is rebuilt when a request's tools are another object: a
    handler that swaps the tools of the second request (same name, another
    function) gets the new function run, not the one the first turn indexed."""

    @tool(name="pick")
    async def first() -> str:
        """The first version."""
        return "first"

    @tool(name="pick")
    async def second() -> str:
        """The second version."""
        return "second"

    def swap_tools(pending: PendingTransition) -> Decision | None:
        request = pending.payload
        if pending.trigger is Trigger.infer and pending.model_requests == 1:
            assert isinstance(request, InferenceInput)
            return Rewrite(payload=request.model_copy(update={"tools": (second,)}))
        return None

    script = ScriptedProvider([calls(call("pick")), calls(call("pick")), text("done")])
    async with Runtime(providers={"scripted": script}) as runtime:
        request = InferenceInput(
            model="scripted:x", context=ModelContext(), tools=[first]
        )
        result = await runtime.wait(runtime.run_loop("a", "go", request, swap_tools))
    assert result.tool_calls == 2
    assert outputs_of(request.context.items) == ["first", "second"]


# ------------------------------------- an output's calls and message in one pass


def test_calls_and_message_equal_the_outputs_properties() -> None:
    """`calls_and_message` gives what `function_calls` and `message` give: the
    calls in order, the last message, whatever else the output holds."""
    first = ModelMessageItem(content="thinking aloud")
    last = ModelMessageItem(content="the answer")
    one, two = call("a", call_id="c1"), call("b", call_id="c2")
    outputs = [
        InferenceOutput(items=(ReasoningItem(content="r"), one, first, two, last)),
        InferenceOutput(items=(first,)),
        InferenceOutput(items=(one, two)),
        InferenceOutput(items=()),
    ]
    for output in outputs:
        assert calls_and_message(output) == (output.function_calls, output.message)


async def test_an_output_with_several_messages_answers_with_the_last() -> None:
    """The loop answers with an output's last message, and runs its calls in
    the model's order."""
    say = ModelMessageItem(content="first")
    script = ScriptedProvider(
        [
            InferenceOutput(
                items=(
                    say,
                    FunctionCallItem(call_id="c1", name="echo", arguments='{"x": 1}'),
                    FunctionCallItem(call_id="c2", name="echo", arguments='{"x": 2}'),
                )
            ),
            InferenceOutput(items=(say, ModelMessageItem(content="last"))),
        ]
    )

    @tool
    async def echo(x: int) -> int:
        """Echo."""
        return x

    async with Runtime(providers={"scripted": script}) as runtime:
        request = InferenceInput(
            model="scripted:x", context=ModelContext(), tools=[echo]
        )
        result = await runtime.wait(runtime.run_loop("a", "go", request))
    assert result.answer is not None
    assert result.answer.content == "last"
    assert outputs_of(request.context.items) == ["1", "2"]


# ------------------------------------------------------------------ import time

LAZY_MODULES = (
    "structlog",
    "agentfsm.events",
    "agentfsm.eventlog",
    "anyio.from_thread",
    "jsonschema",
    "griffe",
)
"""What `import agentfsm` leaves unimported (bench/PERFORMANCE.md, Import time)."""


def test_import_agentfsm_leaves_the_lazy_modules_unimported() -> None:
    """A fresh interpreter's `import agentfsm` imports none of the modules that
    are loaded on first use (structlog on the first log line, and the others)."""
    code = (
        "import sys, agentfsm\n"
        f"print(sorted(m for m in {LAZY_MODULES!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "name",
    [
        "events",
        "inference",
        "interception",
        "messages",
        "options",
        "record",
        "results",
        "tools",
    ],
)
def test_model_modules_evaluate_annotations_when_the_class_is_made(name: str) -> None:
    """The modules that define models do not postpone their annotations: with
    `from __future__ import annotations`, pydantic compiles every string
    annotation (~15 ms of the import)."""
    module = importlib.import_module(f"agentfsm.{name}")
    assert vars(module).get("annotations") is not __future__.annotations
