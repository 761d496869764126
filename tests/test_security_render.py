"""Untrusted text reaches the terminal, the diagrams and the HTML report made safe.

Model output, tool names, arguments and outputs, error texts, and the ids and
pause reasons an event log holds may carry escape sequences (an OSC 52
clipboard write, a screen clear, a `\\r` that forges a line), bidirectional
overrides, NUL, lone surrogates, mermaid directives and markup: `agentfsm run`
and `agentfsm inspect` show them as visible escapes, `agentfsm diagram` writes
SVG that parses and mermaid without their directives, and `inspect --html`
writes its page.
"""

from __future__ import annotations

import argparse
import io
import re
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from agentfsm import (
    FunctionCallItem,
    FunctionProvider,
    InferenceInput,
    InferenceOutput,
    Pause,
    PendingTransition,
    Runtime,
    Trigger,
    tool,
)
from agentfsm.cli import main
from agentfsm.cli import run as run_command
from agentfsm.cli.run import _request, _summary, _watch
from agentfsm.diagrams import (
    LoopPath,
    render_dot,
    render_path_mermaid,
    render_paths_mermaid,
    render_svg,
)
from agentfsm.eventlog import EventLogWriter, read_events
from agentfsm.events import AgentEvent
from agentfsm.providers import OutputCompleted, StreamEvent, TextDelta
from agentfsm.results import LoopStatus, PathStep
from agentfsm.states import LoopState
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.timeline import build_timeline, find_loop, render_html
from tests.helpers import needs_dot, request

EVIL = (
    "\x1b]52;c;aGk=\x07"  # OSC 52: puts "hi" on the clipboard
    "\rforged line"
    "\x1b[2J"  # clears the screen
    "\u202e"  # right-to-left override
    "\x00\x9b"  # NUL, C1 CSI
    " %%{init: {'theme': 'dark'}}%% </script> &#0; end note"
)
LONG = EVIL + "r" * 20_000
"""A pause reason over graphviz's 16 KB string limit."""
SURROGATE = "\udcff"
SHOWN = "\\x1b]52;c;aGk=\\x07"
"""How the OSC 52 sequence reads once made visible."""

TERMINAL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
    "\ud800-\udfff]"
)
"""What a terminal acts on: C0 but tab and newline, DEL, C1, bidi, surrogates."""
NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
"""What XML 1.0 forbids."""
DOT_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"', re.DOTALL)
SVG = "{http://www.w3.org/2000/svg}"


def assert_terminal_safe(shown: str) -> None:
    found = TERMINAL.search(shown)
    assert found is None, f"raw {found.group()!r} at {found.start()}: {shown!r}"


@tool
async def echo(said: str) -> str:
    """Say `said` back."""
    return said


def run_args(*argv: str) -> argparse.Namespace:
    """The parsed arguments of `agentfsm run ...`."""
    parser = argparse.ArgumentParser()
    run_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


# ---------------------------------------------------------------------- run


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "no-stream"])
async def test_run_shows_untrusted_text_visibly(streaming: bool) -> None:
    """Tool names, arguments, outputs and the answer are shown with every
    control character as its escape."""
    unescaped = FunctionCallItem(
        call_id="raw", name="echo", arguments='{"said": "' + EVIL + '"}'
    )
    provider = ScriptedProvider(
        [
            calls(unescaped, call("echo", said=EVIL), call("nope" + EVIL, x=1)),
            text("answer " + EVIL + SURROGATE),
        ]
    )
    args = run_args("hi", "--model", "s:m", "--stream" if streaming else "--no-stream")
    out = io.StringIO()
    async with Runtime(providers={"s": provider}) as runtime:
        result = await _watch(runtime, args, _request(args, [echo]), out)
    assert result.outcome == "answered"
    shown = out.getvalue()
    assert_terminal_safe(shown)
    lines = shown.splitlines()
    assert any(line.startswith(f'  call echo({{"said": "{SHOWN}') for line in lines)
    assert any(line.startswith(f"  echo -> {SHOWN}") for line in lines)
    assert any(line.startswith(f"  nope{SHOWN}") for line in lines)
    assert any(line.startswith(f"model: answer {SHOWN}") for line in lines)


class SplitStream:
    """Streams an answer cut inside its escape sequences."""

    CHUNKS = ("ok \x1b", "]52;c;aGk=", "\x07 \x1b[", "2J done")

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        return text("".join(self.CHUNKS))

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        async def deltas() -> AsyncIterator[StreamEvent]:
            for chunk in self.CHUNKS:
                yield TextDelta(text=chunk)
            yield OutputCompleted(output=text("".join(self.CHUNKS)))

        yield deltas()


async def test_run_shows_an_escape_split_across_chunks_visibly() -> None:
    """Each streamed chunk is shown on its own, its half of a sequence inert."""
    args = run_args("hi", "--model", "s:m")
    out = io.StringIO()
    async with Runtime(providers={"s": SplitStream()}) as runtime:
        result = await _watch(runtime, args, _request(args, []), out)
    assert result.outcome == "answered"
    assert_terminal_safe(out.getvalue())
    assert f"model: ok {SHOWN} \\x1b[2J done" in out.getvalue().splitlines()


async def test_run_shows_a_failure_visibly(capsys: pytest.CaptureFixture[str]) -> None:
    """An error a provider raised, quoting the server, is shown visibly, in the
    display and in the summary."""

    async def fail(request: InferenceInput) -> InferenceOutput:
        raise RuntimeError("the server said " + EVIL)

    args = run_args("hi", "--model", "s:m", "--no-stream")
    out = io.StringIO()
    async with Runtime(providers={"s": FunctionProvider(fail)}) as runtime:
        result = await _watch(runtime, args, _request(args, []), out)
    assert result.outcome == "failed"
    assert _summary(result) == 1
    err = capsys.readouterr().err
    for shown in (out.getvalue(), err):
        assert_terminal_safe(shown)
        assert f"the server said {SHOWN}" in shown


# ---------------------------------------------------------------------- a log


def pause_with(reason: str) -> Callable[[PendingTransition], Pause | None]:
    """A handler pausing before every tool batch for `reason`."""

    def handler(pending: PendingTransition) -> Pause | None:
        return Pause(reason) if pending.trigger is Trigger.call_tools else None

    return handler


async def record(log: Path) -> tuple[str, str]:
    """Two loops: one answers after its tool calls, one is paused for a 20 KB
    reason when the log closes."""
    script = ScriptedProvider(
        [
            calls(call("echo", said=EVIL), call("nope" + EVIL, x=1)),
            text("answer " + EVIL),
        ]
    )
    async with Runtime(providers={"scripted": script}) as runtime:
        async with EventLogWriter(runtime.bus, log):
            answered = runtime.run_loop("agent", "question " + EVIL, request(echo))
            paused = runtime.run_loop("agent", "q", request(echo), pause_with(LONG))
            await runtime.wait(answered)
            await anyio.wait_all_tasks_blocked()
        runtime.cancel(paused)
    return answered, paused


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log whose loop and agent ids, question, tool calls, answer and pause
    reason are all untrusted text."""
    folder = tmp_path_factory.mktemp("render")
    raw, log = folder / "raw.jsonl", folder / "events.jsonl"
    answered, paused = anyio.run(record, raw)
    names = {answered: f"answered-{EVIL}", paused: f"paused-{EVIL}"}
    lines = [
        event.model_copy(
            update={"loop_id": names[event.loop_id], "agent_id": f"agent {EVIL}"}
        ).model_dump_json()
        for event in read_events(raw)
    ]
    log.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return log


def inspect(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["inspect", *args])
    out, err = capsys.readouterr()
    return code, out, err


def path_of(log: Path, part: str) -> LoopPath:
    events = list(read_events(log))
    return LoopPath.from_events(events, find_loop(events, part))


# ---------------------------------------------------------------------- inspect


@pytest.mark.parametrize(
    "which",
    [[], ["--loop", "answered-"], ["--loop", "paused-"]],
    ids=["table", "answered", "paused"],
)
def test_inspect_shows_untrusted_text_visibly(
    log: Path, which: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The table and each timeline show ids, names and texts visibly."""
    code, out, err = inspect(capsys, str(log), *which)
    assert (code, err) == (0, "")
    assert_terminal_safe(out)
    assert f"agent {SHOWN}" in out


def test_inspect_error_quotes_the_log_visibly(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown loop: the error lists the log's loop ids, visibly."""
    code, out, err = inspect(capsys, str(log), "--loop", "nowhere")
    assert (code, out) == (1, "")
    assert_terminal_safe(err)
    assert f"answered-{SHOWN}" in err


def test_html_report_holds_no_raw_injection(log: Path) -> None:
    """The page is drawn from a loop with a NUL, a lone surrogate and markup in
    its ids and texts: it encodes, holds no character XML forbids, and its
    markup is text."""
    events: list[AgentEvent] = [
        event.model_copy(update={"agent_id": event.agent_id + SURROGATE})
        for event in read_events(log)
    ]
    timeline = build_timeline(events, find_loop(events, "answered-"), width=400)
    page = render_html(timeline, f'<svg xmlns="{SVG[1:-1]}"/>')
    page.encode("utf-8")
    assert NOT_XML.search(page) is None
    assert_terminal_safe(page)
    assert "</script>" not in page
    assert "&lt;/script&gt;" in page


@needs_dot
def test_inspect_html_of_a_loop_paused_for_20_kb_of_reasons(
    log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--html` writes the page of a loop whose agent id holds a NUL and whose
    pause reason is 20 KB; its SVG parses."""
    page_file = tmp_path / "loop.html"
    code, out, err = inspect(
        capsys, str(log), "--loop", "paused-", "--html", str(page_file)
    )
    assert (code, err) == (0, "")
    assert_terminal_safe(out)
    page = page_file.read_text(encoding="utf-8")
    assert NOT_XML.search(page) is None
    assert "</script>" not in page
    svg = page[page.index("<svg") : page.index("</svg>") + len("</svg>")]
    assert any(
        (t.text or "").startswith("paused before call_tools")
        for t in ET.fromstring(svg).iter(f"{SVG}text")
    )


# ---------------------------------------------------------------------- diagrams


@needs_dot
def test_diagram_svg_parses(log: Path, tmp_path: Path) -> None:
    """`diagram --format svg` of a loop with control characters in its ids and
    a 20 KB pause reason writes SVG that parses."""
    target = tmp_path / "path.svg"
    argv = ["--events", str(log), "--loop", "paused-", "--format", "svg"]
    assert main(["diagram", *argv, "-o", str(target)]) == 0
    root = ET.parse(target).getroot()
    assert {"inference", "__paused__"} <= {
        g.findtext(f"{SVG}title") for g in root.iter(f"{SVG}g")
    }


@pytest.mark.parametrize("which", ["answered-", "paused-"])
def test_dot_is_valid_for_graphviz(log: Path, which: str) -> None:
    """The DOT text graphviz draws from: each string under its 16 KB limit, no
    character XML forbids, no entity graphviz would decode into one."""
    dot = render_dot(path_of(log, which))
    assert NOT_XML.search(dot) is None
    assert_terminal_safe(dot)
    assert "&#" not in dot
    assert max(len(s) for s in DOT_STRING.findall(dot)) <= 300


def mermaid_safe(mermaid: str) -> None:
    """No directive, comment, markup or raw control character; quotes paired."""
    assert "%%" not in mermaid
    assert "<" not in mermaid
    assert_terminal_safe(mermaid)
    for line in mermaid.splitlines():
        assert line.count('"') in (0, 2), line


def test_diagram_mermaid_holds_no_directive(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`diagram --events` in mermaid: the title and the pause note are labels,
    the note one bounded line that `end note` in its text does not close."""
    assert main(["diagram", "--events", str(log), "--loop", "paused-"]) == 0
    mermaid = capsys.readouterr().out
    mermaid_safe(mermaid)
    lines = mermaid.splitlines()
    start = lines.index("  note right of inference")
    assert lines[start + 2] == "  end note"
    assert len(lines[start + 1]) <= 400
    assert mermaid.lower().count("end note") == 1


def test_paths_mermaid_names_are_labels(log: Path) -> None:
    """Loops drawn side by side: each name stays inside its quotes."""
    path = path_of(log, "answered-")
    mermaid = render_paths_mermaid([path, path], titles=[EVIL, LONG])
    mermaid_safe(mermaid)
    heads = [line for line in mermaid.splitlines() if line.startswith("  state ")]
    assert len(heads) == 2
    assert all(re.fullmatch(r'  state "[^"]*" as loop\d \{', h) for h in heads)


def paused_path(reason: str, agent_id: str) -> LoopPath:
    return LoopPath(
        loop_id="loop",
        agent_id=agent_id,
        steps=(PathStep(LoopState.idle, Trigger.start, LoopState.context_update),),
        state=LoopState.context_update,
        status=LoopStatus.paused,
        pending=PathStep(LoopState.context_update, Trigger.infer, LoopState.inference),
        pause_reason=reason,
    )


def test_a_live_loop_with_a_lone_surrogate_is_drawn() -> None:
    """A live loop's text is not from a log and may hold a lone surrogate:
    mermaid and DOT encode, and say where it was."""
    path = paused_path(EVIL + SURROGATE, "agent" + SURROGATE)
    mermaid = render_path_mermaid(path)
    mermaid.encode("utf-8")
    mermaid_safe(mermaid)
    assert "end#32;note\\udcff" in mermaid
    dot = render_dot(path)
    dot.encode("utf-8")
    assert NOT_XML.search(dot) is None


@needs_dot
def test_svg_of_a_live_loop_parses() -> None:
    """The SVG of a loop with a lone surrogate, U+FFFF and entities parses."""
    path = paused_path(EVIL + SURROGATE + "\uffff &#x1b;", "agent\x00")
    texts = [t.text or "" for t in ET.fromstring(render_svg(path)).iter(f"{SVG}text")]
    assert "loop loop (agent\\x00): paused in context_update" in texts


def test_a_log_line_quoting_a_server_is_printable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What agentfsm logs to a terminal (a tool an MCP server named) shows its
    control characters escaped, from a program that has not configured
    structlog (the CLI's configuration is covered by its own test)."""
    import structlog

    from agentfsm._logging import get_logger

    configured, saved = structlog.is_configured(), structlog.get_config()
    structlog.reset_defaults()
    try:
        get_logger().warning("refused", tool="\x1b]52;c;aGkh\x07")  # no quoting
    finally:
        if configured:
            structlog.configure(**saved)
    err = capsys.readouterr().err
    assert "\x1b]52" not in err
    assert "\x07" not in err
    assert "x1b]52;c;aGkh" in err
