"""A torn line (a writer killed mid-line) costs that line, never the whole log."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.typing import EventDict

from agentfsm import Runtime
from agentfsm.cli import main
from agentfsm.eventlog import read_events
from agentfsm.events import AgentEvent
from agentfsm.exceptions import EventLogError
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import request


async def run_once(log: Path) -> str:
    script = ScriptedProvider([calls(call("add", a=2, b=3)), text("2 + 3 = 5")])
    async with Runtime(providers={"scripted": script}, event_log=log) as runtime:
        loop_id = runtime.run_loop("agent", "2+3?", request())
        await runtime.wait(loop_id)
    return loop_id


def tear(log: Path, event: AgentEvent) -> None:
    """Append the start of `event` and no newline, as a kill -9 mid-write does."""
    with log.open("ab") as f:
        f.write(event.model_dump_json().encode()[:40])


def skipped(log_output: list[EventDict]) -> list[tuple[str, int]]:
    return [
        (entry["path"], entry["line"])
        for entry in log_output
        if entry["event"] == "event_log_line_skipped"
    ]


async def test_a_run_after_a_torn_tail_reads_back_whole(
    tmp_path: Path, log_output: list[EventDict]
) -> None:
    """A run killed mid-line, then a run appending: both runs' events read
    back, and the warning names the torn line."""
    log = tmp_path / "events.jsonl"
    first_loop = await run_once(log)
    first = list(read_events(log))
    tear(log, first[-1])
    second_loop = await run_once(log)

    events = list(read_events(log))

    assert events[: len(first)] == first
    second = events[len(first) :]
    assert {e.loop_id for e in second} == {second_loop} != {first_loop}
    assert [e.seq for e in second] == list(range(1, len(second) + 1))
    torn_line = len(first) + 1
    assert skipped(log_output) == [(str(log), torn_line)]


async def torn_between_two_runs(log: Path) -> tuple[int, str]:
    """A run, a torn line, a second run: the torn line's number and the second
    run's loop id."""
    await run_once(log)
    first = list(read_events(log))
    tear(log, first[0])
    return len(first) + 1, await run_once(log)


@pytest.mark.parametrize(
    ("command", "shown"),
    [("inspect", "2 loops"), ("diagram", "stateDiagram")],
)
async def test_the_cli_says_what_it_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, shown: str
) -> None:
    """`agentfsm inspect` and `agentfsm diagram --events` read past the torn
    line and name it on stderr."""
    log = tmp_path / "events.jsonl"
    torn, second_loop = await torn_between_two_runs(log)
    capsys.readouterr()
    args = (
        ["inspect", str(log)]
        if command == "inspect"
        else ["diagram", "--events", str(log), "--loop", second_loop]
    )

    assert main(args) == 0

    out, err = capsys.readouterr()
    assert shown in out
    assert err == (
        f"agentfsm {command}: skipped line {torn} of {log}: "
        "not valid JSON, torn by a writer killed mid-line\n"
    )


async def test_an_event_glued_to_a_torn_line_is_read(
    tmp_path: Path, log_output: list[EventDict]
) -> None:
    """A log whose next run appended on the torn line itself (as writers that
    did not end it did) loses only the torn part."""
    log = tmp_path / "events.jsonl"
    await run_once(log)
    events = list(read_events(log))
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join([*lines[:3], lines[3][:25], *lines[3:]]))

    assert list(read_events(log)) == events
    assert skipped(log_output) == [(str(log), 4)]


def test_on_skip_gets_the_line_numbers_instead_of_the_warning(
    tmp_path: Path, log_output: list[EventDict]
) -> None:
    """`on_skip` is called with each torn line's number, and nothing is logged."""
    log = tmp_path / "events.jsonl"
    log.write_bytes(b'{"event_id":"x\n\n{"event_id":"y\n[1, \xc3')
    lines: list[int] = []
    assert list(read_events(log, on_skip=lines.append)) == []
    assert lines == [1, 3, 4]
    assert skipped(log_output) == []


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(b'{"type": "loop.nonsense"}\n', id="wrong-event"),
        pytest.param(b"[1, 2]\n", id="not-an-object"),
        pytest.param(b'{"type": "loop.nonsense"}', id="last-line-no-newline"),
    ],
)
def test_json_that_is_not_an_event_still_raises(tmp_path: Path, line: bytes) -> None:
    """Only lines that are not JSON count as torn: JSON of the wrong shape is
    an EventLogError naming the line, wherever it is."""
    log = tmp_path / "events.jsonl"
    log.write_bytes(b'{"event_id":"x\n' + line)
    with pytest.raises(EventLogError, match=r"events.jsonl, line 2: not an agentfsm"):
        list(read_events(log, on_skip=lambda number: None))


async def test_the_writer_ends_a_torn_line_before_appending(tmp_path: Path) -> None:
    """The next run's first event starts a line of its own."""
    log = tmp_path / "events.jsonl"
    log.write_bytes(b'{"event_id":"torn')
    await run_once(log)
    lines = log.read_bytes().splitlines()
    assert lines[0] == b'{"event_id":"torn'
    assert all(line.startswith(b'{"event_id":"') for line in lines[1:])
    assert len(list(read_events(log, on_skip=lambda number: None))) == len(lines) - 1
