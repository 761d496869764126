"""Loops run in reused worker tasks, each loop in a copy of its starter's context."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from contextvars import ContextVar, copy_context
from typing import Any, cast

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest

from agentfsm import (
    InferenceInput,
    LoopStatus,
    ModelContext,
    Outcome,
    Pause,
    PendingTransition,
    Proceed,
    Runtime,
    Tool,
    Trigger,
    tool,
)
from agentfsm._loop import Loop
from agentfsm._runtime.backend import Primitives
from agentfsm._runtime.workers import MAX_IDLE, Worker, WorkerPool
from agentfsm.extensions import Extension, LoopExtension, LoopInfo
from agentfsm.inference import InferenceOutput, ModelNext, ModelRequest
from agentfsm.providers import Provider
from agentfsm.store import MemoryStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.tools import ToolCall, ToolNext, ToolResult
from tests.helpers import pause_tools, request

request_id: ContextVar[str] = ContextVar("request_id", default="none")


def one_call(name: str) -> ScriptedProvider:
    """Each loop calls `name` once, then answers (every loop has its own cursor)."""
    return ScriptedProvider([calls(call(name)), text("done")])


def worker_tasks() -> list[anyio.TaskInfo]:
    return [t for t in anyio.get_running_tasks() if t.name == "agentfsm-worker"]


async def test_a_loop_sees_the_context_of_whoever_started_it() -> None:
    """Each loop sees the caller's context variables as they were at `run_loop`,
    even when one worker runs them one after the other."""
    seen: list[str] = []

    @tool
    async def whoami() -> str:
        """Read the request id."""
        seen.append(request_id.get())
        return "ok"

    async with Runtime(providers={"scripted": one_call("whoami")}) as runtime:
        for rid in ("a", "b", "c"):
            request_id.set(rid)
            result = await runtime.wait(
                runtime.run_loop("agent", "go", request(whoami))
            )
            assert result.outcome is Outcome.answered
    assert seen == ["a", "b", "c"]


async def test_what_a_loop_sets_stays_with_the_loop() -> None:
    """A variable a tool sets is neither seen by the caller nor by the next loop."""
    seen: list[str] = []

    @tool
    async def mark() -> str:
        """Set the request id."""
        seen.append(request_id.get())
        request_id.set("set by the tool")
        return "ok"

    request_id.set("caller")
    async with Runtime(providers={"scripted": one_call("mark")}) as runtime:
        for _ in range(2):
            await runtime.wait(runtime.run_loop("agent", "go", request(mark)))
            assert request_id.get() == "caller"
    assert seen == ["caller", "caller"]


async def test_a_resumed_loop_runs_in_the_context_of_whoever_resumed_it() -> None:
    seen: list[str] = []

    @tool
    async def whoami() -> str:
        """Read the request id."""
        seen.append(request_id.get())
        return "ok"

    def pause_at_start(pending: PendingTransition) -> Pause | Proceed:
        return Pause("hold") if pending.trigger is Trigger.start else Proceed()

    async with Runtime(providers={"scripted": one_call("whoami")}) as runtime:
        request_id.set("starter")
        loop_id = runtime.run_loop("agent", "go", request(whoami), pause_at_start)
        await anyio.wait_all_tasks_blocked()
        request_id.set("resumer")
        runtime.resume(loop_id, Proceed())
        await runtime.wait(loop_id)
    assert seen == ["resumer"]


async def test_workers_are_reused_and_a_cancelled_loops_worker_is_not() -> None:
    tasks: list[int] = []
    started = anyio.Event()
    block = [False]

    @tool
    async def where() -> str:
        """Record the task (and wait forever while `block` is set)."""
        tasks.append(anyio.get_current_task().id)
        if block[0]:
            started.set()
            await anyio.sleep_forever()
        return "ok"

    async with Runtime(providers={"scripted": one_call("where")}) as runtime:
        for _ in range(2):
            await runtime.wait(runtime.run_loop("agent", "go", request(where)))
        block[0] = True
        waiting = runtime.run_loop("agent", "go", request(where))
        await started.wait()
        block[0] = False
        runtime.cancel(waiting)
        assert (await runtime.wait(waiting)).outcome is Outcome.cancelled
        await anyio.wait_all_tasks_blocked()
        # Its task was cancelled: it ended with its loop instead of going idle.
        assert worker_tasks() == []
        await runtime.wait(runtime.run_loop("agent", "go", request(where)))
        await anyio.wait_all_tasks_blocked()
        assert len(worker_tasks()) == 1  # a new worker ran the last loop
    first, second, cancelled, _ = tasks
    assert first == second == cancelled  # one worker ran the three loops in turn


async def test_idle_workers_are_capped_and_end_with_the_runtime() -> None:
    @tool
    async def pause_once() -> str:
        """Yield once, so that every loop is in flight at the same time."""
        await anyio.lowlevel.checkpoint()
        return "ok"

    loops = MAX_IDLE * 3
    async with Runtime(providers={"scripted": one_call("pause_once")}) as runtime:
        ids = [
            runtime.run_loop("agent", "go", request(pause_once)) for _ in range(loops)
        ]
        await anyio.lowlevel.checkpoint()
        assert len(worker_tasks()) == loops  # one worker per loop in flight
        for loop_id in ids:
            assert (await runtime.wait(loop_id)).outcome is Outcome.answered
        await anyio.wait_all_tasks_blocked()
        assert len(worker_tasks()) == MAX_IDLE  # the others ended
    assert worker_tasks() == []  # leaving the runtime ends the idle ones


@tool
async def answer() -> str:
    """Answer."""
    return "ok"


def start_watched(
    runtime: Runtime, offered: Tool | None = None, *handlers: Any, **options: Any
) -> tuple[str, weakref.ref[ModelContext]]:
    """Start a loop on a context only the loop holds (made in this frame, not the
    test's: pydantic keeps the namespace of a frame that defines a model)."""
    context = ModelContext()
    tools = [answer if offered is None else offered]
    request_ = InferenceInput(model="scripted:test", context=context, tools=tools)
    loop_id = runtime.run_loop("agent", "go", request_, *handlers, **options)
    return loop_id, weakref.ref(context)


async def passthrough(request: ModelRequest, next_: ModelNext) -> InferenceOutput:
    return await next_(request)


async def test_a_loop_with_model_wrappers_is_freed_without_the_cycle_collector() -> (
    None
):
    """The loop's chain of model wrappers ends in the loop's own method (a
    cycle, loop -> chain -> loop): it is dropped when the loop ends."""
    provider = ScriptedProvider([calls(call("answer")), text("done")], record=False)
    gc.disable()
    try:
        async with Runtime(
            providers={"scripted": provider}, keep_finished=0
        ) as runtime:
            loop_id, alive = start_watched(runtime, model_wrappers=[passthrough])
            assert (await runtime.wait(loop_id)).outcome is Outcome.answered
            await anyio.wait_all_tasks_blocked()
            assert alive() is None
    finally:
        gc.enable()


class Everything(LoopExtension):
    """A part with every layer and hook, holding the loop's view."""

    def __init__(self, info: LoopInfo) -> None:
        self.info = info

    def provider(self, provider: Provider, /) -> Provider:
        return provider

    async def call_tool(self, call: ToolCall, next_: ToolNext, /) -> ToolResult:
        return await next_(call)

    def start_run(self, start: Callable[[], None], /) -> None:
        start()

    def committed(self) -> None:
        assert self.info.last_step is not None

    def run_ended(self) -> None:
        pass

    def loop_ended(self) -> None:
        pass


class EveryLoop(Extension):
    def open(self, loop: LoopInfo, /) -> LoopExtension:
        return Everything(loop)


class ToolLayerOnly(LoopExtension):
    """A part with one layer, holding the loop's view: it has no hook to be
    told the loop ended, and must be let go of all the same."""

    def __init__(self, info: LoopInfo) -> None:
        self.info = info

    async def call_tool(self, call: ToolCall, next_: ToolNext, /) -> ToolResult:
        return await next_(call)


class ToolLayerLoop(Extension):
    def open(self, loop: LoopInfo, /) -> LoopExtension:
        return ToolLayerOnly(loop)


@pytest.mark.parametrize("extension", [EveryLoop, ToolLayerLoop])
@pytest.mark.parametrize("path", ["ended", "cancelled-paused", "stored", "handed-over"])
async def test_a_loop_with_extensions_is_freed_without_the_cycle_collector(
    extension: type[Extension], path: str
) -> None:
    """A part holds the loop's view (loop -> part -> view -> loop): the loop
    lets go of its parts once no hook is left to call, however it leaves the
    runtime (ended in its run, ended while paused, left paused in its store
    by the runtime's exit, handed over)."""
    provider = ScriptedProvider([calls(call("answer")), text("done")], record=False)
    gc.collect()
    gc.disable()
    try:
        async with Runtime(
            providers={"scripted": provider},
            keep_finished=0,
            extensions=[extension()],
            store=MemoryStore() if path == "stored" else None,
        ) as runtime:
            handlers = [] if path == "ended" else [pause_tools]
            loop_id, alive = start_watched(runtime, None, *handlers)
            if path != "ended":
                while runtime.get(loop_id).status is not LoopStatus.paused:
                    await anyio.lowlevel.checkpoint()
            if path == "cancelled-paused":
                runtime.cancel(loop_id)
            if path == "handed-over":
                runtime.hand_over(loop_id)
            elif path != "stored":
                await runtime.wait(loop_id)
            await anyio.wait_all_tasks_blocked()
            if path != "stored":
                assert alive() is None
        assert alive() is None
    finally:
        gc.enable()


async def test_an_idle_worker_keeps_no_finished_loop_alive() -> None:
    provider = ScriptedProvider([calls(call("answer")), text("done")], record=False)
    async with Runtime(providers={"scripted": provider}, keep_finished=0) as runtime:
        loop_id, alive = start_watched(runtime)
        await runtime.wait(loop_id)
        await anyio.wait_all_tasks_blocked()
        assert len(worker_tasks()) == 1  # idle, kept for the next loop
        gc.collect()
        assert alive() is None


@tool
async def hang() -> str:
    """Wait until cancelled."""
    await anyio.sleep_forever()
    return "never"


async def test_a_cancelled_loop_is_freed_without_the_cycle_collector() -> None:
    """The task handle of a worker whose loop was cancelled keeps the worker's
    frame (the cancellation's traceback): nothing in it may keep the loop."""
    provider = ScriptedProvider([calls(call("hang")), text("done")], record=False)
    gc.disable()
    try:
        async with Runtime(
            providers={"scripted": provider}, keep_finished=0
        ) as runtime:
            loop_id, alive = start_watched(runtime, hang)
            await anyio.wait_all_tasks_blocked()
            runtime.cancel(loop_id)
            assert (await runtime.wait(loop_id)).outcome is Outcome.cancelled
            await anyio.wait_all_tasks_blocked()
            assert worker_tasks() == []
            assert alive() is None
    finally:
        gc.enable()


async def test_a_loop_handed_to_a_worker_ending_with_the_runtime_still_ends() -> None:
    """A loop started just as an outer cancellation reaches the runtime (its idle
    worker is being cancelled) still runs and ends in `idle` (answered here: it
    never waits, so the cancellation never reaches it)."""

    runtime = Runtime(providers={"scripted": one_call("answer")})
    with anyio.CancelScope() as outer:
        async with runtime:
            await runtime.wait(runtime.run_loop("agent", "go", request(answer)))
            outer.cancel()
            late = runtime.run_loop(
                "agent", "go", request(answer)
            )  # to the idle worker
            await anyio.sleep_forever()
    with anyio.fail_after(5):
        result = await runtime.wait(late)
    assert result.outcome in (Outcome.answered, Outcome.cancelled)
    assert result.states[-1] == "idle"


async def test_a_coroutine_a_tools_thread_runs_sees_the_threads_context() -> None:
    """`from_thread.run` from a tool's worker thread runs in the thread's context:
    it sees what the thread set, and what it sets stays out of the loop."""
    seen: list[str] = []

    async def in_event_loop() -> None:
        seen.append(request_id.get())
        request_id.set("set by the coroutine")

    def in_thread() -> None:
        request_id.set("thread")
        anyio.from_thread.run(in_event_loop)

    @tool
    async def hop() -> str:
        """Call back into the event loop from a thread."""
        request_id.set("tool")
        await anyio.to_thread.run_sync(in_thread)
        seen.append(request_id.get())
        return "ok"

    async with Runtime(providers={"scripted": one_call("hop")}) as runtime:
        await runtime.wait(runtime.run_loop("agent", "go", request(hop)))
    assert seen == ["thread", "tool"]


def test_a_worker_cancelled_before_its_task_handle_exists_is_cancelled_then() -> None:
    """Defensive (anyio returns from `start_soon` before the task runs): were a
    worker's first step run inside `start_soon`, before the worker has its task
    handle, a cancel then would be carried out once the handle is there."""
    handles: list[Any] = []
    workers: list[Worker] = []

    def start(work: Any, worker: Worker) -> Any:
        work(worker).close()  # the step itself is not the point here
        worker.cancel()  # no handle yet
        workers.append(worker)
        handles.append(_Handle())
        return handles[-1]

    pool = WorkerPool(
        start, Primitives(anyio.CancelScope, anyio.Event), lambda loop: None
    )
    pool._launch(cast("Loop", object()), copy_context())
    assert [h.cancelled for h in handles] == [True]
    assert workers[0].handle is handles[0]


class _Handle:
    cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


@tool
async def checkpoint_once() -> str:
    """Wait once (so that the call's deadline timer is armed)."""
    await anyio.lowlevel.checkpoint()
    return "ok"


@tool
def in_a_thread() -> str:
    """A sync tool: it runs in a worker thread, under its deadline timer."""
    return "ok"


@pytest.mark.parametrize(
    "offered", [checkpoint_once, in_a_thread], ids=["async", "sync"]
)
async def test_a_finished_loop_is_freed_though_its_tool_timers_are_pending(
    offered: Tool,
) -> None:
    """Each tool call runs under a 60 s deadline timer. On asyncio a cancelled
    timer stays in the event loop's heap, with a copy of the context it was
    armed in, until it would have fired, whenever an earlier timer is pending
    (another task sleeping, here): nothing in that context may keep the loop.
    Freed without the cycle collector, as soon as the loop ended."""
    name = offered.name
    provider = ScriptedProvider(
        [calls(call(name), call(name)), text("done")], record=False
    )
    gc.disable()
    try:
        async with (
            Runtime(providers={"scripted": provider}, keep_finished=0) as runtime,
            anyio.create_task_group() as others,
        ):
            others.start_soon(anyio.sleep, 30)  # an earlier timer, pending
            loop_id, alive = start_watched(runtime, offered)
            assert (await runtime.wait(loop_id)).outcome is Outcome.answered
            await anyio.wait_all_tasks_blocked()
            assert alive() is None
            others.cancel_scope.cancel()
    finally:
        gc.enable()
