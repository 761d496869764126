"""Runtime(clock=, ids=): the time and the loop ids a runtime stamps come from it."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agentfsm import ConfigurationError, Outcome, Runtime, UserMessage
from agentfsm.events import AgentEvent
from agentfsm.results import LoopResult
from agentfsm.store import SQLiteStore
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from tests.helpers import request

START = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)

# One script for every run: the call ids are part of the outputs, so both runs
# must be served the same objects.
SCRIPT = [calls(call("add", a=1, b=2)), calls(call("add", a=3, b=4)), text("10")]


def fixed_clock() -> Callable[[], datetime]:
    """A clock that advances one second per reading, from START."""
    ticks = itertools.count()
    return lambda: START + timedelta(seconds=next(ticks))


def counter_ids() -> Callable[[], str]:
    numbers = itertools.count(1)
    return lambda: f"loop-{next(numbers)}"


async def run_twice(
    clock: Callable[[], datetime], ids: Callable[[], str]
) -> tuple[list[AgentEvent], list[LoopResult]]:
    async with Runtime(
        providers={"scripted": ScriptedProvider(SCRIPT)}, clock=clock, ids=ids
    ) as runtime:
        recorder = EventRecorder(runtime.bus)
        results = []
        for _ in range(2):
            loop_id = runtime.run_loop("agent", "add things", request())
            results.append(await runtime.wait(loop_id))
        recorder.close()
    return recorder.events, results


def without_durations(events: list[AgentEvent]) -> list[str]:
    # A tool call's `duration` is measured (a monotonic clock), not read from
    # the wall clock: the one value a clock cannot fix.
    return [
        e.model_dump_json(
            exclude={"duration"} if e.type.startswith("function") else None
        )
        for e in events
    ]


async def test_a_fixed_clock_and_counter_ids_make_every_event_repeat() -> None:
    """Two runtimes given the same sources publish the same events, byte for byte."""
    first, first_results = await run_twice(fixed_clock(), counter_ids())
    second, second_results = await run_twice(fixed_clock(), counter_ids())
    assert without_durations(first) == without_durations(second)
    assert first_results == second_results
    assert [r.loop_id for r in first_results] == ["loop-1", "loop-2"]
    assert {e.event_id for e in first if e.seq == 1} == {"loop-1:1", "loop-2:1"}


async def test_timestamps_come_from_the_clock() -> None:
    """Every event's ts, and a loop's started_at and ended_at, are the clock's readings."""
    events, results = await run_twice(fixed_clock(), counter_ids())
    stamps = [e.ts for e in events]
    # One reading for started_at, then one per event built, then ended_at
    # (between the last transition and loop.idle), loop after loop.
    assert results[0].started_at == START
    assert stamps[0] == START + timedelta(seconds=1)
    assert stamps == sorted(stamps)
    assert len(set(stamps)) == len(stamps)
    first_idle = next(e for e in events if e.type == "loop.idle")
    assert results[0].ended_at == first_idle.ts - timedelta(seconds=1)
    assert results[1].started_at > first_idle.ts


async def test_the_defaults_are_utc_now_and_uuid7() -> None:
    """Without sources: aware UTC timestamps and UUIDv7 loop ids, sorted by creation."""
    before = datetime.now(UTC)
    async with Runtime(providers={"scripted": ScriptedProvider([text("hi")])}) as rt:
        recorder = EventRecorder(rt.bus)
        ids = [rt.run_loop(f"a{i}", "hi", request()) for i in range(3)]
        results = [await rt.wait(i) for i in ids]
    assert all(
        re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-", i[:19]) for i in ids
    )
    assert sorted(ids) == ids
    assert all(before <= e.ts <= datetime.now(UTC) for e in recorder.events)
    assert all(r.started_at.tzinfo is not None for r in results)


def test_a_loop_id_is_a_uuids_text() -> None:
    """`uuid7` writes its 128 bits as `uuid.UUID` does (8-4-4-4-12, lower
    case): a version 7 UUID of the RFC's variant, its time the clock's."""
    import time
    import uuid

    from agentfsm._runtime.ids import uuid7

    before = time.time_ns() // 1_000_000
    ids = [uuid7() for _ in range(500)]
    for loop_id in ids:
        made = uuid.UUID(loop_id)
        assert str(made) == loop_id
        assert (made.version, made.variant) == (7, uuid.RFC_4122)
        assert before <= made.int >> 80 <= time.time_ns() // 1_000_000 + 1
    assert sorted(ids) == ids
    assert len({i[19:] for i in ids}) == len(ids)  # the random bits vary


class TestRefused:
    @pytest.mark.parametrize(
        ("kwargs", "named"),
        [
            pytest.param({"clock": "now"}, "clock must be a callable", id="clock"),
            pytest.param({"ids": 7}, "ids must be a callable", id="ids"),
        ],
    )
    def test_a_source_that_is_not_callable(
        self, kwargs: dict[str, object], named: str
    ) -> None:
        """A clock or id source that cannot be called is refused by the constructor."""
        with pytest.raises(ConfigurationError, match=named):
            Runtime(**kwargs)  # type: ignore[arg-type]

    async def test_a_naive_clock_is_refused_at_run_loop(self) -> None:
        """A clock giving naive datetimes fails run_loop, naming what it returned."""
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hi")])},
            clock=lambda: datetime(2030, 1, 1),
        ) as runtime:
            with pytest.raises(ConfigurationError, match="timezone-aware"):
                runtime.run_loop("agent", "hi", request())
            assert runtime.loops() == []

    @pytest.mark.parametrize(
        ("ids", "named"),
        [
            pytest.param(lambda: "same", "already has", id="repeated"),
            pytest.param(lambda: "", "non-empty str", id="empty"),
            pytest.param(lambda: 42, "non-empty str", id="not-a-str"),
        ],
    )
    async def test_bad_ids_are_refused_at_run_loop(
        self, ids: Callable[[], object], named: str
    ) -> None:
        """An id source repeating an id the runtime holds, or giving no str, fails
        run_loop; the loops already started are untouched."""
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hi")])},
            ids=ids,  # type: ignore[arg-type]
        ) as runtime:
            first = None
            if named == "already has":
                first = runtime.run_loop("agent", UserMessage(content="hi"), request())
            with pytest.raises(ConfigurationError, match=named):
                runtime.run_loop("agent", "hi", request())
            if first is not None:
                assert (await runtime.wait(first)).answer is not None


class TestGivenLoopId:
    """`run_loop(loop_id=)`: a caller names its loop."""

    async def test_the_loop_has_the_id_given(self) -> None:
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hi")])}, ids=counter_ids()
        ) as runtime:
            assert runtime.run_loop("agent", "hi", request(), loop_id="mine") == "mine"
            result = await runtime.wait("mine")
            assert (result.loop_id, result.answer is not None) == ("mine", True)
            assert runtime.loops() == ["mine"]

    @pytest.mark.parametrize(
        ("loop_id", "named"),
        [
            pytest.param("", "non-empty str", id="empty"),
            pytest.param(7, "non-empty str", id="not-a-str"),
            pytest.param("a\ud800", "lone surrogate", id="surrogate"),
            pytest.param("taken", "already has", id="taken"),
        ],
    )
    async def test_a_bad_or_taken_id_is_refused(
        self, loop_id: object, named: str
    ) -> None:
        """Refused before the loop exists, naming the id; the loop holding a
        taken id goes on untouched."""
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hi"), text("hi")])}
        ) as runtime:
            runtime.run_loop("agent", "hi", request(), loop_id="taken")
            with pytest.raises(ConfigurationError, match=named) as raised:
                runtime.run_loop("agent", "hi", request(), loop_id=loop_id)  # type: ignore[arg-type]
            assert "loop_id=" in str(raised.value)
            assert runtime.loops() == ["taken"]
            assert (await runtime.wait("taken")).answer is not None

    async def test_a_durable_store_refuses_a_second_loop_of_an_id(
        self, tmp_path: Path
    ) -> None:
        """Two runtimes on one store starting a loop of the same id: the
        second loop fails with LoopIdTakenError at its first commit, which a
        named loop waits for before it asks its model; the store keeps the
        first loop as it was."""
        path = tmp_path / "loops.db"
        provider = ScriptedProvider([text("first")])
        async with Runtime(
            providers={"scripted": provider}, store=SQLiteStore(path)
        ) as runtime:
            runtime.run_loop("agent", "hi", request(), loop_id="once")
            assert (await runtime.wait("once")).answer is not None
        second = ScriptedProvider([text("second")])
        async with Runtime(
            providers={"scripted": second}, store=SQLiteStore(path)
        ) as runtime:
            runtime.run_loop("agent", "hi", request(), loop_id="once")
            result = await runtime.wait("once")
            assert result.outcome is Outcome.failed
            assert result.error is not None
            assert result.error.type == "LoopIdTakenError"
            assert second.requests == []
        async with SQLiteStore(path) as store:
            stored = await store.load("once")
            assert stored is not None
            assert stored.record.outcome is Outcome.answered
