"""A cancel at every state and at every place a loop can wait.

Each point gets a loop to wait somewhere (a handler at each trigger, paused at
each trigger, the provider, a retry's backoff, model and tool wrappers, a
stream's opening and its middle, sequential and parallel tools, a sync tool's
thread, `finish_turn`, a stalled backpressure subscriber, ...), then cancels it,
by `Runtime.cancel` or by cancelling a scope around the runtime. Whatever the
point, the loop ends `cancelled` in `idle`, every function call in the context
has exactly one output, its events end with the cancel, and it leaves no task
and no loop object behind.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

import anyio
import anyio.from_thread
import pytest

from agentfsm import (
    FunctionProvider,
    InferenceInput,
    InferenceOutput,
    LoopStatus,
    ModelContext,
    ModelRequest,
    Outcome,
    Pause,
    PendingTransition,
    Runtime,
    Subscription,
    Tool,
    ToolCall,
    ToolResult,
    Trigger,
    TurnSnapshot,
    current_call,
    current_loop_id,
    current_runtime,
    tool,
)
from agentfsm.events import AgentEvent, LoopIdle, LoopTransition
from agentfsm.exceptions import ProviderError
from agentfsm.inference import StreamEvent, TextDelta
from agentfsm.interception import Decision
from agentfsm.messages import ContextItem
from agentfsm.providers import ModelNext, Provider
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from agentfsm.tools import ToolNext
from tests.helpers import add, assert_one_output_per_call

REASON = "cancelled at this point"

# ---------------------------------------------------------------- the points


class Blocker:
    """Where a point waits: `block` marks the place reached and waits there
    until cancelled."""

    def __init__(self) -> None:
        self.reached = anyio.Event()

    async def block(self) -> NoReturn:
        self.reached.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


@dataclass
class Setup:
    """A loop that will wait at the point."""

    provider: Provider
    tools: tuple[Tool, ...] = ()
    handlers: list[Callable[[PendingTransition], Any]] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    streaming: bool = False
    follow_up: bool = False
    """Queue a follow-up as soon as the loop is started."""
    stalled: bool = False
    """Subscribe a backpressure subscriber that never reads (buffer 1)."""
    paused: bool = False
    """The point is reached once the loop is paused (not when `block` runs)."""
    thread: threading.Event | None = None
    """Set by a tool's thread once it has returned (the thread runs on after
    the cancel, until it sees it)."""


@tool
def steer_me() -> str:
    """Queue steering for the loop running this tool (so `steer` comes next)."""
    loop_id = current_loop_id()
    assert loop_id is not None
    current_runtime().steer(loop_id, "and also this")
    return "steered"


@tool
def finish_up() -> ToolResult:
    """End the loop (`stop` comes next)."""
    return ToolResult(output="done", terminate=True)


def reaching(trigger: Trigger) -> Setup:
    """A loop whose run takes `trigger`."""
    script: list[InferenceOutput] = [text("an answer")]
    setup = Setup(ScriptedProvider(script, record=False))
    if trigger is Trigger.infer_streaming:
        setup.streaming = True
    elif trigger is Trigger.call_tools:
        setup.provider = ScriptedProvider(
            [calls(call("add", a=1, b=2)), *script], record=False
        )
        setup.tools = (add,)
    elif trigger is Trigger.steer:
        setup.provider = ScriptedProvider(
            [calls(call("steer_me")), *script], record=False
        )
        setup.tools = (steer_me,)
    elif trigger is Trigger.stop:
        setup.provider = ScriptedProvider([calls(call("finish_up"))], record=False)
        setup.tools = (finish_up,)
    elif trigger is Trigger.follow_up:
        setup.provider = ScriptedProvider(
            [*script, text("another answer")], record=False
        )
        setup.follow_up = True
    return setup


INTERCEPTED = [
    Trigger.start,
    Trigger.infer,
    Trigger.infer_streaming,
    Trigger.call_tools,
    Trigger.answer,
    Trigger.steer,
    Trigger.stop,
    Trigger.follow_up,
    Trigger.finish,
]
"""Every trigger a handler sees (the error edges are not intercepted)."""


def handler_waiting_at(trigger: Trigger) -> Callable[[Blocker], Setup]:
    def setup(blocker: Blocker) -> Setup:
        async def handler(pending: PendingTransition) -> Decision | None:
            if pending.trigger is trigger:
                await blocker.block()
            return None

        built = reaching(trigger)
        built.handlers.append(handler)
        return built

    return setup


def paused_at(trigger: Trigger) -> Callable[[Blocker], Setup]:
    def setup(blocker: Blocker) -> Setup:
        def hold(pending: PendingTransition) -> Decision | None:
            return Pause("hold") if pending.trigger is trigger else None

        built = reaching(trigger)
        built.handlers.append(hold)
        built.paused = True
        return built

    return setup


class WaitingProvider:
    """A provider that waits, in `complete`, opening its stream, or mid-stream."""

    def __init__(self, blocker: Blocker, where: str) -> None:
        self.blocker = blocker
        self.where = where

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        await self.blocker.block()

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        if self.where == "open":
            await self.blocker.block()
        yield self._chunks()

    async def _chunks(self) -> AsyncIterator[StreamEvent]:
        yield TextDelta(text="half an ")
        await self.blocker.block()


def provider_waiting(where: str, **options: Any) -> Callable[[Blocker], Setup]:
    def setup(blocker: Blocker) -> Setup:
        streaming = where != "complete"
        return Setup(
            WaitingProvider(blocker, where), streaming=streaming, options=options
        )

    return setup


def in_retry_backoff(blocker: Blocker) -> Setup:
    async def busy(request: InferenceInput) -> InferenceOutput:
        blocker.reached.set()
        raise ProviderError("overloaded", retryable=True)

    # The loop sleeps 5 s before its retry: the cancel comes during the sleep.
    return Setup(FunctionProvider(busy), options={"retry_backoff": 5.0})


def model_wrapper_waiting(after_next: bool) -> Callable[[Blocker], Setup]:
    def setup(blocker: Blocker) -> Setup:
        async def wrapper(request_: ModelRequest, next_: ModelNext) -> InferenceOutput:
            if after_next:
                await next_(request_)
            await blocker.block()

        return Setup(
            ScriptedProvider([text("x")], record=False),
            options={"model_wrappers": [wrapper]},
        )

    return setup


def tools_waiting(mode: str, calls_done: int) -> Callable[[Blocker], Setup]:
    """Two calls of a tool; the first `calls_done` return, the others wait."""

    def setup(blocker: Blocker) -> Setup:
        made = 0

        @tool
        async def work(n: int) -> int:
            """Return n, or wait."""
            nonlocal made
            made += 1
            if made > calls_done:
                await blocker.block()
            return n

        script = [calls(call("work", n=1), call("work", n=2)), text("x")]
        return Setup(
            ScriptedProvider(script, record=False),
            tools=(work,),
            options={"tool_execution": mode},
        )

    return setup


def sync_tool_waiting(mode: str) -> Callable[[Blocker], Setup]:
    """Sync tools in threads, waiting for the interruption as they should."""

    def setup(blocker: Blocker) -> Setup:
        threads = 2 if mode == "parallel" else 1
        lock = threading.Lock()
        waiting = returned = 0
        all_returned = threading.Event()

        @tool
        def export(n: int) -> int:
            """Wait until interrupted (5 s at most)."""
            nonlocal waiting, returned
            running = current_call()
            try:
                with lock:
                    waiting += 1
                    last = waiting == threads
                if last:
                    anyio.from_thread.run_sync(blocker.reached.set)
                running.wait_cancelled(5)
                return n
            finally:
                with lock:
                    returned += 1
                    if returned == threads:
                        all_returned.set()

        script = [calls(call("export", n=1), call("export", n=2)), text("x")]
        return Setup(
            ScriptedProvider(script, record=False),
            tools=(export,),
            options={"tool_execution": mode},
            thread=all_returned,
        )

    return setup


def tool_wrapper_waiting(blocker: Blocker) -> Setup:
    async def wrapper(call_: ToolCall, next_: ToolNext) -> ToolResult:
        await blocker.block()

    script = [calls(call("add", a=1, b=2)), text("x")]
    return Setup(
        ScriptedProvider(script, record=False),
        tools=(add,),
        options={"tool_wrappers": [wrapper]},
    )


def finish_turn_waiting(blocker: Blocker) -> Setup:
    async def finish_turn(turn: TurnSnapshot) -> None:
        await blocker.block()

    script = [calls(call("add", a=1, b=2)), text("x")]
    return Setup(
        ScriptedProvider(script, record=False),
        tools=(add,),
        options={"finish_turn": finish_turn},
    )


def awaiting_approval(blocker: Blocker) -> Setup:
    @tool(needs_approval=True)
    def pay(amount: int) -> str:
        """Pay (a person approves first)."""
        return "paid"

    script = [calls(call("pay", amount=3), call("add", a=1, b=2)), text("x")]
    return Setup(ScriptedProvider(script, record=False), tools=(pay, add), paused=True)


def held_by_a_stalled_subscriber(blocker: Blocker) -> Setup:
    script = [calls(call("add", a=1, b=2)), text("x")]
    return Setup(ScriptedProvider(script, record=False), tools=(add,), stalled=True)


def paused_with_the_pause_held(blocker: Blocker) -> Setup:
    """Paused, while its worker still waits to publish `loop.paused`."""
    built = paused_at(Trigger.call_tools)(blocker)
    built.stalled = True
    return built


POINTS: list[Any] = [
    *(
        pytest.param(handler_waiting_at(t), id=f"handler-at-{t.value}")
        for t in INTERCEPTED
    ),
    *(pytest.param(paused_at(t), id=f"paused-at-{t.value}") for t in INTERCEPTED),
    pytest.param(provider_waiting("complete"), id="provider"),
    pytest.param(
        provider_waiting("complete", deadline=60, inference_timeout=30),
        id="provider-under-deadline-and-timeout",
    ),
    pytest.param(in_retry_backoff, id="retry-backoff"),
    pytest.param(model_wrapper_waiting(after_next=False), id="model-wrapper-before"),
    pytest.param(model_wrapper_waiting(after_next=True), id="model-wrapper-after"),
    pytest.param(provider_waiting("open"), id="stream-open"),
    pytest.param(provider_waiting("mid"), id="mid-stream"),
    pytest.param(tools_waiting("sequential", 0), id="sequential-tools-first"),
    pytest.param(tools_waiting("sequential", 1), id="sequential-tools-second"),
    pytest.param(tools_waiting("parallel", 0), id="parallel-tools-all"),
    pytest.param(tools_waiting("parallel", 1), id="parallel-tools-one-done"),
    pytest.param(sync_tool_waiting("sequential"), id="sync-tool-thread"),
    pytest.param(sync_tool_waiting("parallel"), id="sync-tool-threads-parallel"),
    pytest.param(tool_wrapper_waiting, id="tool-wrapper"),
    pytest.param(finish_turn_waiting, id="finish-turn"),
    pytest.param(awaiting_approval, id="awaiting-approval"),
    pytest.param(held_by_a_stalled_subscriber, id="stalled-subscriber"),
    pytest.param(paused_with_the_pause_held, id="paused-its-pause-held"),
]

# ---------------------------------------------------------------- the test


def start(
    runtime: Runtime, setup: Setup
) -> tuple[str, list[ContextItem], weakref.ref[ModelContext]]:
    """Start the loop on a context only the loop holds (made here, not in the
    test's frame); return its id, the context's items (the list, which does not
    hold the context) and a weak reference to the context: alive while the
    loop is."""
    context = ModelContext()
    inference_input = InferenceInput(
        model="p:x", context=context, tools=setup.tools, streaming=setup.streaming
    )
    loop_id = runtime.run_loop(
        "agent", "go", inference_input, setup.handlers, **setup.options
    )
    if setup.follow_up:
        runtime.follow_up(loop_id, "and then?")
    return loop_id, context.items, weakref.ref(context)


async def reach(
    runtime: Runtime,
    loop_id: str,
    setup: Setup,
    blocker: Blocker,
    stalled: Subscription | None,
) -> list[AgentEvent]:
    """Wait until the loop waits at the point; return what the stalled
    subscriber read meanwhile (a paused loop's, until the loop paused: its
    `loop.paused` is then held for the subscriber, which stops reading)."""
    read: list[AgentEvent] = []
    with anyio.fail_after(5):
        if setup.paused:
            while runtime.get(loop_id).status is not LoopStatus.paused:
                if stalled is None:
                    await anyio.wait_all_tasks_blocked()
                else:
                    read.append(await stalled.receive())
        elif not setup.stalled:
            await blocker.reached.wait()
        await anyio.wait_all_tasks_blocked()
    view = runtime.get(loop_id)
    assert view.status is not LoopStatus.done, "the loop ended before the cancel"
    if setup.stalled:
        assert view.path, "the loop did not start"
    return read


def freed(watched: weakref.ref[ModelContext]) -> bool:
    """Whether the loop is gone, the cycle collector run first: a cancellation
    through a task group (parallel tools) leaves exception groups whose
    tracebacks hold the tasks' frames in cycles, in anyio and trio themselves.
    A loop freed without the collector is pinned by tests/internals/test_workers.py."""
    gc.collect()
    return watched() is None


def task_ids() -> set[int]:
    return {t.id for t in anyio.get_running_tasks()}


@pytest.mark.parametrize(
    "how", ["cancel", "outer"], ids=["Runtime.cancel", "outer-scope"]
)
@pytest.mark.parametrize("point", POINTS)
async def test_a_cancel_here_ends_the_loop_cleanly(
    point: Callable[[Blocker], Setup], how: str, request: pytest.FixtureRequest
) -> None:
    blocker = Blocker()
    setup = point(blocker)
    runtime = Runtime(providers={"p": setup.provider})
    before_runtime = task_ids()
    with anyio.fail_after(10):
        with anyio.CancelScope() as outer:
            async with runtime:
                recorder = EventRecorder(runtime.bus)
                stalled = (
                    runtime.bus.subscribe(buffer=1, backpressure=True)
                    if setup.stalled
                    else None
                )
                await anyio.wait_all_tasks_blocked()
                before = task_ids()
                loop_id, items, watched = start(runtime, setup)
                read = await reach(runtime, loop_id, setup, blocker, stalled)
                if how == "outer":
                    outer.cancel()
                    await anyio.sleep_forever()
                runtime.cancel(loop_id, REASON)
                result = await runtime.wait(loop_id)
                await _threads_returned(setup)
                await anyio.wait_all_tasks_blocked()
                # Freed once it ended, the runtime still running: nothing (a
                # task, a timer, the bus, a worker) keeps it.
                assert freed(watched), "the loop object was left behind"
                assert runtime.loops(status=LoopStatus.running) == []
                assert runtime.loops(status=LoopStatus.paused) == []
                left = [t.name for t in anyio.get_running_tasks() if t.id not in before]
                # At most the worker that ended the loop, idle for the next one.
                assert left in ([], ["agentfsm-worker"]), f"tasks left: {left}"
        assert outer.cancelled_caught == (how == "outer")
    result = await runtime.wait(loop_id)
    await _threads_returned(setup)
    assert task_ids() == before_runtime
    assert freed(watched), "the loop object was left behind"

    assert result.outcome is Outcome.cancelled
    if how == "cancel":
        assert result.reason == REASON
    # A loop cancelled before its first edge (held at `start`) has no path.
    assert bool(result.path) != ("-at-start" in request.node.callspec.id)
    if result.path:
        last = result.path[-1]
        assert (last.trigger, last.dest.value) == (Trigger.cancel, "idle")
    assert_one_output_per_call(items)
    events = recorder.of_loop(loop_id)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert isinstance(events[-1], LoopIdle)
    assert events[-1].outcome is Outcome.cancelled
    if result.path:
        assert isinstance(events[-2], LoopTransition)
        assert events[-2].trigger is Trigger.cancel
    if stalled is not None:  # it never read: it holds every event, in order
        held = [stalled.receive_nowait() for _ in range(stalled.statistics().buffered)]
        assert [e.seq for e in read + held] == [e.seq for e in events]


async def _threads_returned(setup: Setup) -> None:
    """Wait for the tool threads of the point to return (they saw the cancel)."""
    if setup.thread is not None:
        assert await anyio.to_thread.run_sync(setup.thread.wait, 5)
