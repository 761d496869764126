"""The event log under every way out of `async with Runtime(event_log=...)`
(issue 12, "keep it fixed"): a normal exit, an exception raised in the block,
the task running the block cancelled from outside; a full disk (`/dev/full`)
and a stalled one.

Complete means: the file holds exactly the events the bus published, in the
order it published them, each loop's numbered 1..n without holes and ending
with its one `loop.idle`. A torn last line is `tests/test_eventlog_torn.py`.

A disk that fails never fails or holds the loops: they end as they would have,
and the runtime's exit reports what was not written (an `EventLogError` naming
the file, how many events were written and which loops' were not; a warning
instead when a cancellation or the caller's own error leaves the block, which
must not be replaced).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
from structlog.typing import EventDict

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    Outcome,
    Pause,
    PendingTransition,
    Runtime,
    Trigger,
    tool,
)
from agentfsm.eventlog import EventLogWriter, read_events
from agentfsm.events import AgentEvent, LoopIdle
from agentfsm.exceptions import EventLogError
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from tests.helpers import request, wait_until

Exit = Literal["normal", "exception", "outer cancel"]


class Boom(Exception):
    pass


def pause_tools(pending: PendingTransition) -> Pause | None:
    return Pause("approval needed") if pending.trigger is Trigger.call_tools else None


async def never_answers(_: InferenceInput) -> InferenceOutput:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


@tool
async def wait_forever() -> str:
    """A tool that never returns."""
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


def providers() -> dict[str, Any]:
    script = [calls(call("add", a=1, b=2)), text("3")]
    stuck_tool = [calls(call("wait_forever", call_id="w"))]
    return {
        "scripted": ScriptedProvider(script),
        "stuck": FunctionProvider(never_answers),
        "tool": ScriptedProvider(stuck_tool),
    }


def start_loops(runtime: Runtime, exit: Exit) -> dict[str, Outcome]:
    """Loops in each situation a loop can be in at exit; their outcomes."""
    loops = {
        runtime.run_loop("a", "2+1?", request()): Outcome.answered,
        runtime.run_loop("a", "2+1?", request(streaming=True)): Outcome.answered,
        runtime.run_loop("a", "2+1?", request(), pause_tools): Outcome.cancelled,
    }
    if exit != "normal":  # a normal exit waits for running loops: these never end
        loops[runtime.run_loop("a", "hi", request(model="stuck:x"))] = Outcome.cancelled
        loops[runtime.run_loop("a", "hi", request(wait_forever, model="tool:x"))] = (
            Outcome.cancelled
        )
    return loops


async def leave(
    exit: Exit, body: Callable[[anyio.Event], Coroutine[Any, Any, None]]
) -> None:
    """Run `body` (which enters the runtime, sets the event once its loops are
    where they should be, and then returns unless the exit is normal), and
    leave it the way `exit` says."""
    ready = anyio.Event()
    if exit == "outer cancel":
        async with anyio.create_task_group() as tg:
            tg.start_soon(body, ready)
            await ready.wait()
            tg.cancel_scope.cancel()  # the task running `async with Runtime`
    elif exit == "exception":
        with pytest.raises(Boom):
            await body(ready)
    else:
        await body(ready)


async def block_left(exit: Exit, ready: anyio.Event) -> None:
    """Inside the block: say it is ready, then leave as `exit` says."""
    ready.set()
    if exit == "exception":
        raise Boom
    if exit == "outer cancel":
        await anyio.sleep_forever()


def check_complete(log: Path, published: list[AgentEvent]) -> dict[str, Outcome]:
    """The log holds exactly what was published; each loop's events are
    numbered without holes and end with one `loop.idle`. Returns the outcomes."""
    events = list(read_events(log))
    assert events == published
    outcomes = {}
    for loop_id in dict.fromkeys(e.loop_id for e in events):
        mine = [e for e in events if e.loop_id == loop_id]
        assert [e.seq for e in mine] == list(range(1, len(mine) + 1))
        assert [e.type for e in mine].count("loop.idle") == 1
        last = mine[-1]
        assert isinstance(last, LoopIdle)
        outcomes[loop_id] = last.outcome
    return outcomes


@pytest.mark.parametrize("exit", ["normal", "exception", "outer cancel"])
async def test_the_log_is_complete_however_the_block_is_left(
    tmp_path: Path, exit: Exit
) -> None:
    log = tmp_path / "events.jsonl"
    runtime = Runtime(providers=providers(), event_log=log)
    recorder = EventRecorder(runtime.bus)
    expected: dict[str, Outcome] = {}

    async def body(ready: anyio.Event) -> None:
        async with runtime:
            expected.update(start_loops(runtime, exit))
            # Every loop where it should be: answered, paused, waiting in its
            # provider or its tool.
            started = (
                {"loop.paused"}
                if exit == "normal"
                else {
                    "loop.paused",
                    "function_call.started",
                }
            )
            await wait_until(lambda: started <= {e.type for e in recorder.events})
            await anyio.wait_all_tasks_blocked()
            await block_left(exit, ready)

    with anyio.fail_after(10):
        await leave(exit, body)
    recorder.close()
    assert check_complete(log, recorder.events) == expected
    # The stuck tool's call got its output, and the log has it.
    outputs = [
        e.output
        for e in recorder.events
        if e.type == "function_call.completed" and e.call.name == "wait_forever"
    ]
    assert [o.is_error for o in outputs] == ([] if exit == "normal" else [True])


# ------------------------------------------------------------------ full disk


async def run_three_on(
    log: str | Path, exit: Exit, results: dict[str, Outcome | None], ready: anyio.Event
) -> None:
    """Three loops answering; the block left as `exit` says once they ended."""
    async with Runtime(providers=providers(), event_log=log) as runtime:
        loop_ids = [runtime.run_loop("a", "2+1?", request()) for _ in range(3)]
        for loop_id in loop_ids:
            results[loop_id] = (await runtime.wait(loop_id)).outcome
        await block_left(exit, ready)


def incomplete(logs: list[EventDict]) -> EventDict:
    [warning] = [e for e in logs if e["event"] == "event_log_incomplete"]
    return warning


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
async def test_a_full_disk_fails_the_exit_saying_what_was_not_written(
    log_output: list[EventDict],
) -> None:
    """Writing to /dev/full (ENOSPC): loops answer, the exit raises
    EventLogError naming the file, what was written and which loops' events
    were not; the warnings say the same."""
    results: dict[str, Outcome | None] = {}
    with anyio.fail_after(10), pytest.raises(EventLogError) as caught:
        await leave(
            "normal", lambda ready: run_three_on("/dev/full", "normal", results, ready)
        )
    assert list(results.values()) == [Outcome.answered] * 3
    message = str(caught.value)
    assert message.startswith(
        "writing the event log /dev/full failed: OSError: [Errno 28] "
        "No space left on device; 0 events were written,"
    )
    for loop_id in results:
        assert f"{loop_id} from seq 1" in message
    assert isinstance(caught.value.__cause__, OSError)
    [failed] = [e for e in log_output if e["event"] == "event_log_failed"]
    assert (failed["path"], failed["written"]) == ("/dev/full", 0)
    warning = incomplete(log_output)
    assert warning["error"] == message
    assert warning["not_written"] > 0


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
@pytest.mark.parametrize("exit", ["exception", "outer cancel"])
async def test_a_full_disk_never_replaces_what_leaves_the_block(
    exit: Exit, log_output: list[EventDict]
) -> None:
    """The caller's own exception, or the cancellation, leaves the block as it
    is; what was not written is the warning."""
    results: dict[str, Outcome | None] = {}
    with anyio.fail_after(10):
        await leave(exit, lambda ready: run_three_on("/dev/full", exit, results, ready))
    assert list(results.values()) == [Outcome.answered] * 3
    assert incomplete(log_output)["path"] == "/dev/full"


async def test_a_disk_full_mid_batch_counts_the_lines_that_made_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_output: list[EventDict]
) -> None:
    """A write that stops part way (the disk filled up in a batch): the events
    whose whole line was written count as written, and read back; the torn
    line after them is skipped by the reader."""
    log = tmp_path / "events.jsonl"
    room = 3000  # bytes left on the "disk": a few events' lines (loop.started
    # carries the request, tools included: ~1 kB)

    class FillingFile:
        def __init__(self, file: Any) -> None:
            self.file = file

        def write(self, data: memoryview) -> int:
            left = room - self.file.tell()
            if left <= 0:
                raise OSError(28, "No space left on device")
            return int(self.file.write(bytes(data[:left])))

        def __getattr__(self, name: str) -> Any:
            return getattr(self.file, name)

    real_open = EventLogWriter.__aenter__

    async def enter(self: EventLogWriter) -> EventLogWriter:
        entered = await real_open(self)
        self._file = FillingFile(self._file)  # type: ignore[assignment]
        return entered

    monkeypatch.setattr(EventLogWriter, "__aenter__", enter)
    results: dict[str, Outcome | None] = {}
    with anyio.fail_after(10), pytest.raises(EventLogError) as caught:
        await leave("normal", lambda ready: run_three_on(log, "normal", results, ready))
    assert list(results.values()) == [Outcome.answered] * 3
    whole = list(read_events(log, on_skip=lambda line: None))
    assert len(whole) > 0
    assert f"; {len(whole)} events were written," in str(caught.value)
    assert incomplete(log_output)["written"] == len(whole)


# --------------------------------------------------------------- stalled disk


async def test_a_stalled_disk_holds_a_cancelled_exit_only_so_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_output: list[EventDict]
) -> None:
    """A write that never returns: once the runtime is cancelled, the writer
    gives up on it after `STALL_SECONDS`, the exit goes on, and the warning
    says what was not written."""
    release = threading.Event()

    def stalled(self: EventLogWriter, batch: object) -> None:
        release.wait()

    monkeypatch.setattr(EventLogWriter, "_write", stalled)
    monkeypatch.setattr(EventLogWriter, "STALL_SECONDS", 0.05)
    log = tmp_path / "events.jsonl"
    loop_ids: list[str] = []

    async def body(ready: anyio.Event) -> None:
        async with Runtime(providers=providers(), event_log=log) as runtime:
            loop_ids.append(runtime.run_loop("a", "hi", request(model="stuck:x")))
            await anyio.wait_all_tasks_blocked()
            await block_left("outer cancel", ready)

    try:
        with anyio.fail_after(10):
            await leave("outer cancel", body)
    finally:
        release.set()
    warning = incomplete(log_output)
    assert warning["written"] == 0
    assert warning["not_written"] >= 3  # started, ..., idle
    assert f"{loop_ids[0]} from seq 1" in warning["error"]
    assert "TimeoutError: a write took more than 0.05s" in warning["error"]
