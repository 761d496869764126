"""The event log writes every event the bus publishes and reads them back unchanged."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import anyio
import pytest

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    LoopResult,
    Outcome,
    Pause,
    PendingTransition,
    Runtime,
    Trigger,
)
from agentfsm.eventlog import EventLogWriter, read_events
from agentfsm.events import AgentEvent, LoopIdle, LoopStarted
from agentfsm.exceptions import EventLogError, LoopStateError
from agentfsm.providers.function import FunctionProvider
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from tests.helpers import request


def tool_script() -> ScriptedProvider:
    return ScriptedProvider([calls(call("add", a=2, b=3)), text("2 + 3 = 5")])


def by_loop(events: list[AgentEvent]) -> dict[str, list[int]]:
    seqs: dict[str, list[int]] = defaultdict(list)
    for event in events:
        seqs[event.loop_id].append(event.seq)
    return seqs


def pause_tools(pending: PendingTransition) -> Pause | None:
    return Pause("approval needed") if pending.trigger is Trigger.call_tools else None


async def never_answers(request: InferenceInput) -> InferenceOutput:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


def idle_outcomes(events: list[AgentEvent]) -> dict[str, Outcome]:
    return {e.loop_id: e.outcome for e in events if isinstance(e, LoopIdle)}


async def test_log_reads_back_the_events_the_bus_published(tmp_path: Path) -> None:
    """Each line is one event; reading the file gives the same pydantic events."""
    log = tmp_path / "events.jsonl"
    async with Runtime(providers={"scripted": tool_script()}, event_log=log) as runtime:
        recorder = EventRecorder(runtime.bus)
        loop_id = runtime.run_loop("agent", "2+3?", request(streaming=True))
        await runtime.wait(loop_id)
    recorder.close()
    read = list(read_events(log))
    assert read == recorder.events
    assert len(log.read_text(encoding="utf-8").splitlines()) == len(read)
    assert read[0] == LoopStarted.model_validate(read[0].model_dump())
    assert [e.seq for e in read] == list(range(1, len(read) + 1))
    assert "inference.stream" in {e.type for e in read}


async def test_200_concurrent_loops_read_back_complete_and_in_order(
    tmp_path: Path,
) -> None:
    """200 loops at once: every loop's events are in the log, seq 1..n without holes."""
    log = tmp_path / "events.jsonl"
    async with Runtime(providers={"scripted": tool_script()}, event_log=log) as runtime:
        loop_ids = [
            runtime.run_loop(f"agent-{i}", "2+3?", request()) for i in range(200)
        ]
    events = list(read_events(log))
    seqs = by_loop(events)
    assert set(seqs) == set(loop_ids)
    for loop_id in loop_ids:
        assert seqs[loop_id] == list(range(1, len(seqs[loop_id]) + 1)), loop_id
    assert {len(s) for s in seqs.values()} == {len(seqs[loop_ids[0]])}
    assert set(idle_outcomes(events).values()) == {Outcome.answered}
    assert len(events) == runtime.bus.statistics().published
    assert runtime.bus.statistics().dropped == 0


async def test_tiny_buffer_drops_nothing(tmp_path: Path) -> None:
    """With a one-event buffer the loops wait for the writer; no event is dropped."""
    log = tmp_path / "events.jsonl"
    runtime = Runtime(providers={"scripted": tool_script()})
    async with EventLogWriter(runtime.bus, log, buffer=1) as writer, runtime:
        for i in range(20):
            runtime.run_loop(f"agent-{i}", "2+3?", request(streaming=True))
    stats = runtime.bus.statistics()
    events = list(read_events(log))
    assert stats.dropped == 0
    assert len(events) == stats.published == writer.written
    assert len(by_loop(events)) == 20
    for seqs in by_loop(events).values():
        assert seqs == list(range(1, len(seqs) + 1))


async def test_loops_cancelled_at_exit_are_logged(tmp_path: Path) -> None:
    """A loop still paused when the runtime exits is cancelled; its end is in the log."""
    log = tmp_path / "events.jsonl"
    async with Runtime(providers={"scripted": tool_script()}, event_log=log) as runtime:
        paused = runtime.run_loop("agent", "2+3?", request(), pause_tools)
        done = runtime.run_loop("agent", "2+3?", request())
    events = list(read_events(log))
    assert idle_outcomes(events) == {
        paused: Outcome.cancelled,
        done: Outcome.answered,
    }
    assert "loop.paused" in [e.type for e in events if e.loop_id == paused]


async def test_error_leaving_the_runtime_still_logs_every_loop(tmp_path: Path) -> None:
    """An error cancels the running loops; their final events reach the log."""
    log = tmp_path / "events.jsonl"
    providers = {"scripted": FunctionProvider(never_answers)}
    loop_ids: list[str] = []

    async def fail_while_loops_run() -> None:
        async with Runtime(providers=providers, event_log=log) as runtime:
            loop_ids.extend(
                runtime.run_loop("agent", "hi", request()) for _ in range(5)
            )
            await anyio.wait_all_tasks_blocked()
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await fail_while_loops_run()
    outcomes = idle_outcomes(list(read_events(log)))
    assert outcomes == dict.fromkeys(loop_ids, Outcome.cancelled)


async def test_cancelled_scope_around_the_runtime_still_logs(tmp_path: Path) -> None:
    """Cancelling a scope around the runtime: the writer drains before it stops."""
    log = tmp_path / "events.jsonl"
    providers = {"scripted": FunctionProvider(never_answers)}
    with anyio.CancelScope() as scope:
        async with Runtime(providers=providers, event_log=log) as runtime:
            loop_id = runtime.run_loop("agent", "hi", request())
            await anyio.wait_all_tasks_blocked()
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert idle_outcomes(list(read_events(log))) == {loop_id: Outcome.cancelled}


async def test_log_is_appended_to(tmp_path: Path) -> None:
    """A second runtime on the same file adds its loops after the first's."""
    log = tmp_path / "events.jsonl"
    loop_ids = []
    for _ in range(2):
        async with Runtime(
            providers={"scripted": tool_script()}, event_log=log
        ) as runtime:
            loop_ids.append(runtime.run_loop("agent", "2+3?", request()))
    assert list(by_loop(list(read_events(log)))) == loop_ids


async def test_failed_write_is_reported_and_never_blocks_loops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that fails stops recording, loops go on, and exiting raises."""

    def disk_full(self: EventLogWriter, batch: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(EventLogWriter, "_write", disk_full)
    log = tmp_path / "events.jsonl"
    results: list[LoopResult] = []

    async def run_three() -> None:
        async with Runtime(
            providers={"scripted": tool_script()}, event_log=log
        ) as runtime:
            loop_ids = [runtime.run_loop("a", "2+3?", request()) for _ in range(3)]
            results.extend([await runtime.wait(loop_id) for loop_id in loop_ids])

    with pytest.raises(EventLogError, match="No space left on device") as caught:
        await run_three()
    assert isinstance(caught.value.__cause__, OSError)
    assert [r.outcome for r in results] == [Outcome.answered] * 3


async def test_unwritable_path_fails_on_enter(tmp_path: Path) -> None:
    """A log in a missing directory fails at `async with`, leaving no subscriber."""
    runtime = Runtime(event_log=tmp_path / "missing" / "events.jsonl")
    with pytest.raises(FileNotFoundError):
        async with runtime:
            pass  # pragma: no cover
    assert runtime.bus.statistics().subscribers == 0


def test_reader_names_the_bad_line(tmp_path: Path) -> None:
    """A line that is not an event raises EventLogError naming the file and line."""
    log = tmp_path / "events.jsonl"
    log.write_text('\n{"type": "loop.nonsense"}\n', encoding="utf-8")
    with pytest.raises(EventLogError, match=r"events.jsonl, line 2: not an agentfsm"):
        list(read_events(log))


async def test_reader_skips_a_torn_last_line(tmp_path: Path) -> None:
    """A last line cut off mid-write (no newline) is skipped; the rest reads back."""
    log = tmp_path / "events.jsonl"
    async with Runtime(providers={"scripted": tool_script()}, event_log=log) as runtime:
        runtime.run_loop("agent", "2+3?", request())
    whole = list(read_events(log))
    with log.open("ab") as f:
        f.write(whole[0].model_dump_json().encode()[:40])
    assert list(read_events(log)) == whole


async def test_writer_can_be_entered_once(tmp_path: Path) -> None:
    """Entering a writer twice is a clear error."""
    runtime = Runtime()
    writer = EventLogWriter(runtime.bus, tmp_path / "events.jsonl")
    async with writer:
        with pytest.raises(LoopStateError, match="entered only once"):
            await writer.__aenter__()
