"""`agentfsm inspect` and `agentfsm.timeline`: the loops of a log, one loop's timeline."""

from __future__ import annotations

import os
import random
import re
import tempfile
import threading
import xml.etree.ElementTree as ET
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import pytest

from agentfsm import (
    AgentEventAdapter,
    LoopState,
    LoopStatus,
    Runtime,
    TokenUsage,
    tool,
)
from agentfsm.cli import main
from agentfsm.cli._stored import read_report, stored_html
from agentfsm.diagrams import LoopPath, render_path_mermaid
from agentfsm.eventlog import EventLogWriter, read_events
from agentfsm.events import FunctionCallCompleted, LoopStarted
from agentfsm.exceptions import EventLogError
from agentfsm.store import SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.timeline import (
    build_timeline,
    find_loop,
    format_table,
    short_ids,
    summarize,
)
from tests.helpers import (
    needs_dot,
    pause_tools,
    request,
    stream_after_tools,
    wait_until,
)

SVG = "{http://www.w3.org/2000/svg}"

TABLE = """\
LOOP    AGENT       OUTCOME    TURNS  TOOLS  TOKENS    TIME  QUESTION          ANSWER
loop-1  calculator  answered       2      1      61  0.230s  What is 2 + 3?    2 + 3 = <5>
loop-2  reviewer    cancelled      1      0      25  0.090s  Add <b>1</b> & 1  -
2 loops
"""

TIMELINE = """\
loop loop-1
  agent     calculator
  outcome   answered
  totals    2 model requests, 1 tool call, 61 tokens (50 in, 11 out)
  started   2025-01-01 12:00:00.010+00:00, lasted 0.230s
  path      idle -> context_update -> inference -> function_call -> inference_streaming -> model_message -> idle

time in state
  idle                   2x     0.020s
  context_update         1x     0.020s
  inference              1x     0.030s
  inference_streaming    1x     0.080s
  function_call          1x     0.040s
  model_message          1x     0.030s

timeline
    +0.000s  started      "What is 2 + 3?" on scripted:test
    +0.010s  intercepted  idle --start--> context_update: proceed [handler 0]
    +0.020s  transition   #1 idle --start--> context_update  [0.020s in idle]
    +0.030s  intercepted  context_update --infer--> inference: proceed [handler 0]
    +0.040s  transition   #2 context_update --infer--> inference  [0.020s in context_update]
    +0.050s  inference    scripted:test; calls add({"a":2,"b":3}); 20 in + 5 out tokens
    +0.060s  intercepted  inference --call_tools--> function_call: proceed [handler 0]
    +0.070s  transition   #3 inference --call_tools--> function_call  [0.030s in inference]
    +0.090s  tool         add({"a":2,"b":3}) -> 5  [0.004s]
    +0.100s  intercepted  function_call --infer--> inference: rewrite to inference_streaming; payload request to scripted:test [handler 0]
    +0.110s  transition   #4 function_call --infer_streaming--> inference_streaming (rewritten from inference)  [0.040s in function_call]
    +0.170s  inference    scripted:test (streamed, 5 chunks); message "2 + 3 = <5>"; 30 in + 6 out tokens
    +0.180s  intercepted  inference_streaming --answer--> model_message: proceed [handler 0]
    +0.190s  transition   #5 inference_streaming --answer--> model_message  [0.080s in inference_streaming]
    +0.200s  answer       "2 + 3 = <5>"
    +0.210s  intercepted  model_message --finish--> idle: proceed [handler 0]
    +0.220s  transition   #6 model_message --finish--> idle  [0.030s in model_message]
    +0.230s  idle         answered

answer
  2 + 3 = <5>
"""

PAUSED_ROWS = (
    (
        "    +0.060s  intercepted  inference --call_tools--> function_call: pause "
        "(approval required) [handler 0]"
    ),
    (
        "    +0.070s  paused       before inference --call_tools--> function_call: "
        "approval required"
    ),
    "    +0.080s  transition   #3 inference --cancel--> idle  [0.040s in inference]",
    "    +0.090s  idle         cancelled (the runtime closed while the loop was paused)",
)


def script() -> ScriptedProvider:
    return ScriptedProvider(
        [
            calls(
                call("add", call_id="c1", a=2, b=3),
                usage=TokenUsage(input_tokens=20, output_tokens=5),
            ),
            text("2 + 3 = <5>", usage=TokenUsage(input_tokens=30, output_tokens=6)),
        ]
    )


async def record(log: Path) -> list[str]:
    """Two loops: one answers after a rewritten transition, one is paused until exit."""
    async with Runtime(providers={"scripted": script()}, event_log=log) as runtime:
        return [
            runtime.run_loop(
                "calculator", "What is 2 + 3?", request(), stream_after_tools
            ),
            runtime.run_loop("reviewer", "Add <b>1</b> & 1", request(), pause_tools),
        ]


def normalize(raw: Path, out: Path, loop_ids: list[str]) -> None:
    """The log with fixed ids (`loop-1`...), times (10 ms per event) and tool durations."""
    names = {loop_id: f"loop-{i + 1}" for i, loop_id in enumerate(loop_ids)}
    start = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
    lines = []
    for event in read_events(raw):
        name = names[event.loop_id]
        update: dict[str, object] = {
            "loop_id": name,
            "event_id": f"{name}:{event.seq}",
            "ts": start + timedelta(milliseconds=10 * event.seq),
        }
        if isinstance(event, FunctionCallCompleted):
            update["duration"] = 0.004
        lines.append(event.model_copy(update=update).model_dump_json())
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def recorded_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log written by a scripted run, made deterministic."""
    folder = tmp_path_factory.mktemp("inspect")
    raw, log = folder / "raw.jsonl", folder / "events.jsonl"
    loop_ids = anyio.run(record, raw)
    normalize(raw, log, loop_ids)
    return log


def inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_table(recorded_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`inspect FILE`: one line per loop: short id, agent, outcome, turns, calls,
    tokens, time, question and answer."""
    assert inspect(capsys, str(recorded_log)) == (0, TABLE, "")


def test_timeline(recorded_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--loop ID`: transitions with times, time per state, tools, decisions, answer."""
    assert inspect(capsys, str(recorded_log), "--loop", "loop-1") == (0, TIMELINE, "")


def test_timeline_of_a_loop_paused_until_exit(
    recorded_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The pause decision, the pause and the cancellation at exit are in the timeline."""
    code, out, _ = inspect(capsys, str(recorded_log), "--loop", "loop-2")
    assert code == 0
    lines = out.splitlines()
    assert '    +0.000s  started      "Add <b>1</b> & 1" on scripted:test' in lines
    for row in PAUSED_ROWS:
        assert row in lines
    assert "answer" not in lines


def test_long_values_are_shortened(
    recorded_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--width N` cuts long values to N characters, with an ellipsis."""
    code, out, _ = inspect(
        capsys, str(recorded_log), "--loop", "loop-1", "--width", "12"
    )
    assert code == 0
    assert (
        '    +0.050s  inference    scripted:test; calls add({"a":2,…; 20 in + 5 out tokens'
        in (out.splitlines())
    )


def test_ambiguous_or_unknown_loop(
    recorded_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prefix matching several loops, or none, is an error listing the loops."""
    code, out, err = inspect(capsys, str(recorded_log), "--loop", "loop")
    assert (code, out) == (1, "")
    assert (
        "2 loops have 'loop' in their id; say which one by its short id "
        "(the end of its id): loop-1, loop-2" in err
    )
    code, _, err = inspect(capsys, str(recorded_log), "--loop", "zzz")
    assert code == 1
    assert "no loop id contains 'zzz' (loops: loop-1, loop-2)" in err


UUID7_IDS = [
    "01a22b54-a012-7000-b4d5-31bce8e74e50",
    "01a22b54-a012-7001-8991-8534ed9d1542",
    "01a22b54-a013-7000-8002-77aae8e74e50",  # the first id's last 8, by chance
]


def test_a_loop_found_by_any_unique_part_of_its_id() -> None:
    """Ids made in the same second share their start; any unique part finds a loop."""
    events = [started(i) for i in UUID7_IDS]
    with pytest.raises(
        EventLogError,
        match=r"3 loops have '01a22b54' in their id; say which one by its short "
        r"id \(the end of its id\): ce8e74e50, ed9d1542, ae8e74e50",
    ):
        find_loop(events, "01a22b54")
    assert find_loop(events, "9d1542") == UUID7_IDS[1]  # an end
    assert find_loop(events, "8991-85") == UUID7_IDS[1]  # a middle
    assert find_loop(events, "a013") == UUID7_IDS[2]
    with pytest.raises(EventLogError, match="2 loops have 'e8e74e50'"):
        find_loop(events, "e8e74e50")


def test_short_ids_are_unique_ends() -> None:
    """A short id is the shortest end (8 characters at least) no other id contains."""
    assert short_ids(UUID7_IDS) == {
        UUID7_IDS[0]: "ce8e74e50",  # "e8e74e50" would find the third id too
        UUID7_IDS[1]: "ed9d1542",
        UUID7_IDS[2]: "ae8e74e50",
    }
    for loop_id, short in short_ids(UUID7_IDS).items():
        assert find_loop([started(i) for i in UUID7_IDS], short) == loop_id


def test_short_ids_of_thousands_of_ids_are_unique_and_minimal() -> None:
    """Each short id is held by its id alone, and one character less would be
    held by another id too (ids of two letters share long stretches)."""
    rng = random.Random(15)
    ids = ["".join(rng.choice("ab") for _ in range(20)) for _ in range(2500)]
    ids += ["abba", ids[0][3:15]]  # shorter than a short id; inside another id
    shorts = short_ids(ids)
    holders: Counter[str] = Counter()  # in how many ids each substring occurs
    for loop_id in set(ids):
        holders.update({loop_id[a:b] for a in range(20) for b in range(a + 1, 21)})
    assert list(shorts) == list(dict.fromkeys(ids))
    assert len(set(shorts.values())) == len(shorts)
    assert len({len(s) for s in shorts.values()}) > 5  # (12 to 20 characters)
    for loop_id, short in shorts.items():
        assert loop_id.endswith(short)
        if short != loop_id:
            assert holders[short] == 1, (loop_id, short)
        if len(short) > min(8, len(loop_id)):
            assert holders[loop_id[-len(short) + 1 :]] > 1, (loop_id, short)
    assert shorts["abba"] == "abba"
    assert shorts[ids[0][3:15]] == ids[0][3:15]  # (every end of it is in ids[0])


def test_the_table_shows_short_ids_that_select_the_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each short id the table shows is accepted by `--loop`."""
    log = tmp_path / "events.jsonl"
    log.write_text(
        "".join(
            AgentEventAdapter.dump_json(started(i)).decode() + "\n" for i in UUID7_IDS
        ),
        encoding="utf-8",
    )
    code, out, _ = inspect(capsys, str(log))
    assert code == 0
    shorts = [line.split()[0] for line in out.splitlines()[1:-1]]
    assert shorts == ["ce8e74e50", "ed9d1542", "ae8e74e50"]
    for short, loop_id in zip(shorts, UUID7_IDS, strict=True):
        code, out, _ = inspect(capsys, str(log), "--loop", short)
        assert (code, out.splitlines()[0]) == (0, f"loop {loop_id}")


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log that does not exist: exit 1 and the OS error."""
    code, _, err = inspect(capsys, str(tmp_path / "nope.jsonl"))
    assert code == 1
    assert "No such file or directory" in err


def test_find_loop_by_unique_prefix() -> None:
    """The full id or a unique start of it picks the loop; `None` the only one."""
    events = [started(i) for i in ("0197-aaa", "0197-abb", "0198-ccc")]
    assert find_loop(events, "0197-ab") == "0197-abb"
    assert find_loop(events, "0198") == "0198-ccc"
    assert find_loop(events, "0197-aaa") == "0197-aaa"
    with pytest.raises(EventLogError, match="say which one"):
        find_loop(events)
    assert find_loop(events[:1]) == "0197-aaa"


def started(loop_id: str) -> LoopStarted:
    return LoopStarted(
        event_id=f"{loop_id}:1",
        loop_id=loop_id,
        agent_id="agent",
        seq=1,
        state=LoopState.idle,
        message=None,
        model="scripted:test",
        streaming=False,
    )


@needs_dot
def test_html_page(
    recorded_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--html`: one page with the SVG path inline and the timeline, text escaped."""
    page_file = tmp_path / "loop.html"
    code, out, _ = inspect(
        capsys, str(recorded_log), "--loop", "loop-2", "--html", str(page_file)
    )
    assert (code, out) == (0, f"wrote {page_file} (loop loop-2)\n")
    page = page_file.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<svg") == 1
    assert "<?xml" not in page
    svg = page[page.index("<svg") : page.index("</svg>") + len("</svg>")]
    titles = {
        g.findtext(f"{SVG}title")
        for g in ET.fromstring(svg).iter(f"{SVG}g")
        if g.get("class") == "node"
    }
    assert {"idle", "context_update", "inference"} <= titles
    assert "&quot;Add &lt;b&gt;1&lt;/b&gt; &amp; 1&quot;" in page
    assert "<b>1</b>" not in page
    assert "cancelled (the runtime closed while the loop was paused)" in page


async def test_a_log_closed_while_a_loop_is_paused(tmp_path: Path) -> None:
    """A log that ends with a loop paused: the table, timeline and diagram say so."""
    log = tmp_path / "events.jsonl"
    async with Runtime(providers={"scripted": script()}) as runtime:
        async with EventLogWriter(runtime.bus, log):
            loop_id = runtime.run_loop("reviewer", "2+3?", request(), pause_tools)
            await anyio.wait_all_tasks_blocked()
        runtime.cancel(loop_id)
    events = list(read_events(log))
    [summary] = summarize(events)
    assert (summary.status, summary.outcome, summary.model_requests) == (
        LoopStatus.paused,
        None,
        1,
    )
    assert summary.usage == TokenUsage(input_tokens=20, output_tokens=5)
    assert " (paused) " in format_table([summary])
    timeline = build_timeline(events, loop_id)
    assert timeline.path.status is LoopStatus.paused
    assert [(t.state, t.visits) for t in timeline.states] == [
        (LoopState.idle, 1),
        (LoopState.context_update, 1),
        (LoopState.inference, 1),
    ]
    assert "  inference --> function_call: call_tools (pending)" in (
        render_path_mermaid(timeline.path).splitlines()
    )


# ------------------------------------------------------------------ stores


@tool(needs_approval=True)
async def pay(amount: int) -> str:
    """Pay an amount."""
    return f"paid {amount}"


async def fill_store(store: SQLiteStore) -> None:
    """loop-1 (calculator) answers 2 + 3 after a call of `add`; loop-2 (payer)
    is paused for approval of `pay` when its runtime exits."""
    ids = iter(range(1, 10))
    pays = ScriptedProvider([calls(call("pay", call_id="p1", amount=5))])
    async with Runtime(
        providers={"scripted": script(), "pays": pays},
        store=store,
        ids=lambda: f"loop-{next(ids)}",
    ) as runtime:
        await runtime.wait(runtime.run_loop("calculator", "What is 2 + 3?", request()))
        paused = runtime.run_loop("payer", "pay 5", request(pay, model="pays:m"))
        await wait_until(lambda: runtime.get(paused).status is LoopStatus.paused)


@pytest.fixture(params=[False, True], ids=["records", "events"])
def store_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A SQLite store of loop-1 and loop-2, made to keep events or not."""
    path = tmp_path / "loops.db"
    anyio.run(fill_store, SQLiteStore(path, events=request.param))
    return path


class TestStore:
    def test_table(self, store_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
        """`inspect STORE`: the store's loops, as `agentfsm loops` lists them."""
        code, out, err = inspect(capsys, str(store_file))
        assert (code, err) == (0, "")
        assert without_ages(out) == without_ages(inspect_loops(capsys, store_file))
        lines = out.splitlines()
        assert lines[0].split()[:4] == ["LOOP", "AGENT", "STATUS", "STATE"]
        assert lines[1].split()[:7] == [
            "loop-1",
            "calculator",
            "done",
            "idle",
            "2",
            "1",
            "61",
        ]
        assert lines[-1] == "2 loops (1 paused, 1 done)"

    def test_a_paused_loop(
        self, store_file: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`--loop`: a paused loop's pause, the calls it waits on, its path, and
        its story: the timeline where the store kept events, else its
        records' model requests and decisions."""
        code, out, err = inspect(capsys, str(store_file), "--loop", "loop-2")
        assert (code, err) == (0, "")
        lines = out.splitlines()
        assert lines[0] == "loop loop-2"
        assert "  path      idle -> context_update -> inference" in lines
        if "timeline" in lines:  # events kept
            assert any(
                re.fullmatch(r' +\+\d\.\d{3}s  started      "pay 5" on pays:m', line)
                for line in lines
            )
            assert any(
                "paused       before inference --call_tools--> function_call: "
                "approval required: pay" in line
                for line in lines
            )
            assert lines[-2:] == [
                "in the store",
                "  paused in inference: approval required: pay; calls: pay",
            ]
        else:
            assert (
                "  waits on  inference --call_tools--> function_call: "
                "approval required: pay"
            ) in lines
            assert "  calls     pay" in lines
            assert "  no timeline: the store kept no events of this loop" in out
            assert lines[lines.index("model requests") + 1] == (
                '  #1 calls pay({"amount":5}); usage unknown'
            )
            [decision] = [
                line for line in lines[lines.index("decisions") + 1 :] if line
            ]
            assert decision.endswith(
                "inference --call_tools--> function_call: pause (approval "
                "required: pay) [handler agentfsm._loop.intercept:approval_gate]"
            )

    def test_a_finished_loop(
        self, store_file: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A loop that answered: its totals, tool call and answer."""
        code, out, _ = inspect(capsys, str(store_file), "--loop", "loop-1")
        assert code == 0
        lines = out.splitlines()
        assert "answer" in lines
        assert lines[lines.index("answer") + 1] == "  2 + 3 = <5>"
        if "timeline" in lines:
            assert (
                "  totals    2 model requests, 1 tool call, 61 tokens (50 in, 11 out)"
                in lines
            )
            assert any('tool         add({"a":2,"b":3}) -> 5' in line for line in lines)
        else:
            assert (
                "  totals    2 model requests, 1 tool call, 61 tokens (50 in, 11 out)"
                in lines
            )
            assert "  outcome   answered" in lines
            assert '  add({"a":2,"b":3}) [c1]: done -> 5' in lines
            assert lines[lines.index("steps") + 1 :][:2] == [
                "  #1 idle --start--> context_update",
                "  #2 context_update --infer--> inference",
            ]

    def test_which_loop(
        self, store_file: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`--html` without `--loop` needs the store to hold one loop; an
        unknown or ambiguous id lists the loops."""
        code, out, err = inspect(capsys, str(store_file), "--html", "x.html")
        assert (code, out) == (1, "")
        assert (
            f"{store_file} holds 2 loops (loop-1, loop-2); say which one (--loop ID)"
            in err
        )
        code, _, err = inspect(capsys, str(store_file), "--loop", "loop-")
        assert code == 1
        assert "2 loops have 'loop-' in their id" in err
        code, _, err = inspect(capsys, str(store_file), "--loop", "zzz")
        assert code == 1
        assert "no loop id contains 'zzz' (loops: loop-1, loop-2)" in err


def without_ages(table: str) -> list[list[str]]:
    """A loops table's rows cut into cells, without the two age columns
    (STARTED, SINCE): two reads a second apart may differ there, and in the
    columns' widths."""
    return [
        cells[:7] + cells[9:]
        for line in table.splitlines()
        for cells in [re.split(r" {2,}", line.strip())]
    ]


def inspect_loops(capsys: pytest.CaptureFixture[str], path: Path) -> str:
    """What `agentfsm loops` prints for the store (its ages may differ by a
    second from `inspect`'s: the store was read twice)."""
    assert main(["loops", str(path)]) == 0
    return capsys.readouterr()[0]


async def test_the_page_of_a_stored_loop_without_events(tmp_path: Path) -> None:
    """The page from a store's records: summary, the path diagram given, the
    steps, model requests, tool calls and answer, every value escaped."""
    path = tmp_path / "loops.db"
    await fill_store(SQLiteStore(path))
    async with SQLiteStore(path, read_only=True) as store:
        [summary] = await store.loops(status="done")
        report = await read_report(store, summary)
    assert report is not None
    svg = '<?xml version="1.0"?>\n<svg id="path"></svg>'
    page = stored_html(report, svg, datetime.now(UTC))
    assert page.startswith("<!DOCTYPE html>")
    assert '<figure>\n<svg id="path"></svg>\n</figure>' in page
    assert "<?xml" not in page
    for title in ("Steps", "Model requests", "Tool calls", "Answer"):
        assert f"<h2>{title}</h2>" in page
    assert "<pre>2 + 3 = &lt;5&gt;</pre>" in page
    assert "add({&quot;a&quot;:2,&quot;b&quot;:3}) [c1]: done -&gt; 5" in page
    drawn = LoopPath.of(report.record)
    assert drawn.steps == report.record.path
    assert (drawn.loop_id, drawn.state, drawn.status, drawn.outcome) == (
        report.record.loop_id,
        report.record.state,
        report.record.status,
        report.record.outcome,
    )


# --------------------------------------------------- neither a log nor a store

NEITHER = (
    "neither an event log (JSON lines, Runtime(event_log=...)) nor a store "
    "(a SQLite file, or a postgresql:// URL)"
)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        pytest.param(b"", "is empty", id="empty"),
        pytest.param(b"\x89PNG\r\n\x1a\n" + bytes(64), "is a PNG image", id="png"),
        pytest.param(
            random.Random(3).randbytes(512),
            "is binary data (not UTF-8 text)",
            id="random-bytes",
        ),
        pytest.param(
            b'hello\nworld, torn {"event_id\n',
            "holds no agentfsm event: none of its 2 lines is JSON, so it is",
            id="text",
        ),
    ],
)
def test_a_file_neither_a_log_nor_a_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, says: str
) -> None:
    """Exit 1, and an error saying what the file is not; never "0 loops"."""
    path = tmp_path / "thing"
    path.write_bytes(content)
    code, out, err = inspect(capsys, str(path))
    assert (code, out) == (1, "")
    assert err.startswith(f"agentfsm inspect: error: {path} {says}")
    assert NEITHER in err
    assert "torn by a writer" not in err


def test_a_log_with_a_torn_line_is_still_read(
    recorded_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log whose last line a killed writer cut: its events, and the cut
    line named on stderr."""
    torn = tmp_path / "torn.jsonl"
    torn.write_bytes(recorded_log.read_bytes() + b'{"event_id":"loop-1:99","lo')
    code, out, err = inspect(capsys, str(torn))
    assert (code, out) == (0, TABLE)
    lines = len(recorded_log.read_bytes().splitlines()) + 1
    assert f"skipped line {lines} of {torn}: not valid JSON, torn by a writer" in err


@needs_dot
def test_html_page_of_a_stored_loop(
    store_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inspect STORE --loop ID --html`: the page, its path diagram drawn."""
    page_file = tmp_path / "loop.html"
    code, out, _ = inspect(
        capsys, str(store_file), "--loop", "loop-2", "--html", str(page_file)
    )
    assert (code, out) == (0, f"wrote {page_file} (loop loop-2)\n")
    page = page_file.read_text(encoding="utf-8")
    assert page.count("<svg") == 1
    assert "approval required: pay" in page
    assert page_file.stat().st_mode & 0o777 == 0o600


def test_a_log_from_a_pipe_is_read_whole(
    recorded_log: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`cat events.jsonl | agentfsm inspect /dev/stdin`: a stream is read
    once, so what told it is a log is not lost (the table is a file's); the
    copy it is read from is removed after."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    data = recorded_log.read_bytes()
    assert len(data) > 4096  # more than the first bytes looked at
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)

    def feed() -> None:
        with open(pipe, "wb") as writer:
            writer.write(data)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        assert inspect(capsys, str(pipe)) == (0, TABLE, "")
    finally:
        feeder.join()
    assert list(scratch.iterdir()) == []
