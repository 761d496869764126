"""Loops run in reused worker tasks, each loop in a copy of its starter's context."""

from __future__ import annotations

from contextvars import ContextVar

import anyio
import anyio.lowlevel

from agentfsm import (
    Outcome,
    Pause,
    PendingTransition,
    Proceed,
    Runtime,
    Trigger,
    tool,
)
from agentfsm._workers import MAX_IDLE
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import request

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
        await runtime.wait(runtime.run_loop("agent", "go", request(where)))
    first, second, cancelled, after = tasks
    assert first == second == cancelled  # one worker ran the three loops in turn
    assert after != cancelled  # its scope was cancelled: it ended with its loop


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
