"""Path diagrams: one loop's path drawn over the machine, in mermaid, DOT, SVG and PNG."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import anyio
import pytest

from agentfsm import (
    InferenceInput,
    LoopState,
    LoopStatus,
    Outcome,
    PathStep,
    PendingTransition,
    Rewrite,
    Runtime,
    Trigger,
)
from agentfsm._machine import TABLE
from agentfsm.diagrams import (
    LoopPath,
    dot_digest,
    render_dot,
    render_path_mermaid,
    render_png,
    render_svg,
)
from agentfsm.eventlog import read_events
from agentfsm.events import LoopStarted
from agentfsm.exceptions import EventLogError, GraphvizError
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from tests.helpers import needs_dot, pause_tools, request, stream_after_tools

ROOT = Path(__file__).resolve().parent.parent
COMMITTED_SVG = ROOT / "diagrams" / "agent_loop.svg"
SVG = "{http://www.w3.org/2000/svg}"
S, T = LoopState, Trigger

REWRITTEN = LoopPath(
    loop_id="loop-1",
    agent_id="agent",
    steps=(
        PathStep(S.idle, T.start, S.context_update),
        PathStep(S.context_update, T.infer, S.inference),
        PathStep(S.inference, T.call_tools, S.function_call),
        PathStep(
            S.function_call, T.infer_streaming, S.inference_streaming, S.inference
        ),
        PathStep(S.inference_streaming, T.call_tools, S.function_call),
        PathStep(S.function_call, T.infer, S.inference),
        PathStep(S.inference, T.answer, S.model_message),
        PathStep(S.model_message, T.finish, S.idle),
    ),
    rewritten=frozenset({3, 5}),
    status=LoopStatus.done,
    outcome=Outcome.answered,
)
"""Step 4 took another edge than proposed; step 6 kept its edge, a handler
changed its payload (known from `transition.intercepted` events only)."""

PAUSED = LoopPath(
    loop_id="loop-2",
    agent_id="agent",
    steps=(
        PathStep(S.idle, T.start, S.context_update),
        PathStep(S.context_update, T.infer, S.inference),
    ),
    state=S.inference,
    status=LoopStatus.paused,
    pending=PathStep(S.inference, T.call_tools, S.function_call),
    pause_reason="approval required: delete_file",
)

REWRITTEN_MERMAID = """\
---
title: "loop loop-1 (agent): answered"
---
stateDiagram-v2
  direction LR
  classDef visited fill:azure,color:black,stroke:blue
  classDef current fill:darksalmon,color:black,stroke:red,stroke-width:2px
  classDef paused fill:gold,color:black,stroke:darkorange,stroke-width:2px

  state "idle" as idle
  state "context_update" as context_update
  state "inference" as inference
  state "inference_streaming" as inference_streaming
  state "function_call" as function_call
  state "model_message" as model_message
  class idle current
  class context_update visited
  class inference visited
  class inference_streaming visited
  class function_call visited
  class model_message visited

  idle --> context_update: start (#1)
  context_update --> inference: infer (#2)
  context_update --> inference_streaming: infer_streaming
  context_update --> idle: abort | fail | cancel
  inference --> function_call: call_tools (#3)
  inference --> model_message: answer (#7)
  inference --> idle: abort | fail | cancel
  inference_streaming --> function_call: call_tools (#5)
  inference_streaming --> model_message: answer
  inference_streaming --> idle: abort | fail | cancel
  function_call --> inference: infer (#6 rewritten)
  function_call --> inference_streaming: infer_streaming (#4 rewritten from inference)
  function_call --> context_update: steer
  function_call --> idle: stop | abort | fail | cancel
  model_message --> context_update: follow_up
  model_message --> idle: finish (#8)
  model_message --> idle: abort | fail | cancel
  [*] --> idle
"""


REWRITTEN_DOT = """\
digraph agentfsm {
  graph [label="loop loop-1 (agent): answered", rankdir=TB, ranksep=0.8, nodesep=0.8, labelloc=t, fontname="Helvetica", fontsize=14];
  node [shape=box, style="rounded,filled", fillcolor=white, color=gray30, fontname="Helvetica", fontsize=12];
  edge [color=gray55, fontcolor=gray35, fontname="Helvetica", fontsize=10];

  __start__ [shape=point, width=0.12, color=black, fillcolor=black, label=""];
  idle [label="idle", fillcolor=azure, color=blue];
  context_update [label="context_update", fillcolor=azure, color=blue];
  inference [label="inference", fillcolor=azure, color=blue];
  inference_streaming [label="inference_streaming", fillcolor=azure, color=blue];
  function_call [label="function_call", fillcolor=azure, color=blue];
  model_message [label="model_message", fillcolor=azure, color=blue];
  idle_end [label="idle", fillcolor=darksalmon, color=red, penwidth=2, peripheries=2];
  __ended__ [shape=point, width=0.06, color=gray55, label=""];
  {rank=same; inference -> inference_streaming [style=invis]}
  {rank=same; function_call -> model_message [style=invis]}
  {rank=sink; idle_end}

  __start__ -> idle;
  idle -> context_update [label="start (#1)", color=blue, fontcolor=blue, penwidth=2];
  context_update -> inference [label="infer (#2)", color=blue, fontcolor=blue, penwidth=2];
  context_update -> inference_streaming [label="infer_streaming"];
  inference -> function_call [label="call_tools (#3)", color=blue, fontcolor=blue, penwidth=2];
  inference -> model_message [label="answer (#7)", color=blue, fontcolor=blue, penwidth=2];
  inference_streaming -> function_call [label="call_tools (#5)", color=blue, fontcolor=blue, penwidth=2];
  inference_streaming -> model_message [label="answer"];
  function_call -> inference [label="infer (#6 rewritten)", color=darkorange, fontcolor=darkorange, penwidth=2, constraint=false];
  function_call -> inference_streaming [label="infer_streaming (#4 rewritten from inference)", color=darkorange, fontcolor=darkorange, penwidth=2, constraint=false];
  function_call -> context_update [label="steer", constraint=false];
  function_call -> idle_end [label="stop"];
  model_message -> context_update [label="follow_up", constraint=false];
  model_message -> idle_end [label="finish (#8)", color=blue, fontcolor=blue, penwidth=2];
  context_update -> __ended__ [arrowhead=none, style=dashed, color=gray70];
  inference -> __ended__ [arrowhead=none, style=dashed, color=gray70];
  inference_streaming -> __ended__ [arrowhead=none, style=dashed, color=gray70];
  function_call -> __ended__ [arrowhead=none, style=dashed, color=gray70];
  model_message -> __ended__ [arrowhead=none, style=dashed, color=gray70];
  __ended__ -> idle_end [label="abort | fail | cancel"];
}
"""


PAUSED_MERMAID = """\
---
title: "loop loop-2 (agent): paused in inference"
---
stateDiagram-v2
  direction LR
  classDef visited fill:azure,color:black,stroke:blue
  classDef current fill:darksalmon,color:black,stroke:red,stroke-width:2px
  classDef paused fill:gold,color:black,stroke:darkorange,stroke-width:2px

  state "idle" as idle
  state "context_update" as context_update
  state "inference" as inference
  state "inference_streaming" as inference_streaming
  state "function_call" as function_call
  state "model_message" as model_message
  class idle visited
  class context_update visited
  class inference paused

  idle --> context_update: start (#1)
  context_update --> inference: infer (#2)
  context_update --> inference_streaming: infer_streaming
  context_update --> idle: abort | fail | cancel
  inference --> function_call: call_tools (pending)
  inference --> model_message: answer
  inference --> idle: abort | fail | cancel
  inference_streaming --> function_call: call_tools
  inference_streaming --> model_message: answer
  inference_streaming --> idle: abort | fail | cancel
  function_call --> inference: infer
  function_call --> inference_streaming: infer_streaming
  function_call --> context_update: steer
  function_call --> idle: stop | abort | fail | cancel
  model_message --> context_update: follow_up
  model_message --> idle: finish | abort | fail | cancel
  note right of inference
    paused before call_tools to function_call: approval required: delete_file
  end note
  [*] --> idle
"""


def started(loop_id: str) -> LoopStarted:
    return LoopStarted(
        event_id=f"{loop_id}:1",
        loop_id=loop_id,
        agent_id="agent",
        seq=1,
        state=S.idle,
        message=None,
        model="scripted:test",
        streaming=False,
    )


def cheaper_model(pending: PendingTransition) -> Rewrite | None:
    """Rewrite only the payload of the second request (its model)."""
    payload = pending.payload
    if pending.source is S.function_call and isinstance(payload, InferenceInput):
        return Rewrite(payload=payload.model_copy(update={"model": "scripted:mini"}))
    return None


def tool_script() -> ScriptedProvider:
    return ScriptedProvider([calls(call("add", a=2, b=3)), text("5")])


def dot_edges(dot: str) -> set[tuple[LoopState, Trigger, LoopState]]:
    """The `(source, trigger, dest)` edges DOT text draws (labels split on ` | `).

    `idle_end` is `idle` drawn where loops end; the error edges of the states
    linked to the `__ended__` junction are the junction's label, once per state.
    """
    found = set()
    joined = re.findall(r"^  (\w+) -> __ended__ \[", dot, re.MULTILINE)
    for source, dest, label in re.findall(
        r"^  (\w+) -> (\w+) \[label=\"([^\"]*)\"", dot, re.MULTILINE
    ):
        sources = joined if source == "__ended__" else [source]
        for trigger in label.split(" | "):
            name = trigger.split(" (")[0]
            for s in sources:
                end = "idle" if dest == "idle_end" else dest
                found.add((LoopState(s), Trigger(name), LoopState(end)))
    return found


def svg_nodes(svg: str) -> dict[str, ET.Element]:
    """The SVG's graph nodes by title (graphviz draws each as `<g class="node">`)."""
    root = ET.fromstring(svg)
    return {
        g.findtext(f"{SVG}title", ""): g
        for g in root.iter(f"{SVG}g")
        if g.get("class") == "node"
    }


class TestSnapshots:
    def test_rewritten_path_mermaid(self) -> None:
        """Visited states, step numbers per edge, both kinds of rewrite marked."""
        assert render_path_mermaid(REWRITTEN) == REWRITTEN_MERMAID

    def test_rewritten_path_dot(self) -> None:
        """The same path in DOT: taken edges blue, rewritten ones orange."""
        assert render_dot(REWRITTEN) == REWRITTEN_DOT

    def test_paused_path_mermaid(self) -> None:
        """A paused loop: its state is `paused`, the pending edge and a note say why."""
        assert render_path_mermaid(PAUSED) == PAUSED_MERMAID

    def test_paused_path_dot(self) -> None:
        """In DOT the pending edge is dashed and a note sits beside the paused state."""
        lines = render_dot(PAUSED).splitlines()
        assert (
            '  inference [label="inference", fillcolor=gold, color=darkorange, penwidth=2];'
            in lines
        )
        assert (
            '  inference -> function_call [label="call_tools (pending)", color=darkorange, '
            "fontcolor=darkorange, penwidth=2, style=dashed];" in lines
        )
        assert (
            '  __paused__ [label="paused before call_tools to function_call: approval '
            'required: delete_file", shape=note, style=filled, fillcolor=lightyellow, '
            "color=darkorange];" in lines
        )

    def test_machine_dot_draws_every_edge_of_the_table(self) -> None:
        """Without a loop, DOT draws the machine: every table edge, nothing highlighted."""
        dot = render_dot()
        assert dot_edges(dot) == {(s, t, d) for (s, t), d in TABLE.items()}
        assert "(#" not in dot
        for color in ("fillcolor=azure", "fillcolor=darksalmon", "fillcolor=gold"):
            assert color not in dot

    def test_machine_dot_layout(self) -> None:
        """Rows in loop order, `idle` drawn at the end too, error edges grouped once."""
        lines = render_dot().splitlines()
        assert "  {rank=same; inference -> inference_streaming [style=invis]}" in lines
        assert "  {rank=same; function_call -> model_message [style=invis]}" in lines
        assert "  {rank=sink; idle_end}" in lines
        assert '  idle_end [label="idle", peripheries=2];' in lines
        # One labelled error edge for the whole machine, not one per state.
        errors = [line for line in lines if "abort | fail | cancel" in line]
        assert errors == ['  __ended__ -> idle_end [label="abort | fail | cancel"];']
        back = [line for line in lines if "constraint=false" in line]
        assert {line.split(" [")[0].strip() for line in back} == {
            "function_call -> inference",
            "function_call -> inference_streaming",
            "function_call -> context_update",
            "model_message -> context_update",
        }

    def test_a_failed_loops_edge_is_drawn_on_its_own(self) -> None:
        """A taken error edge leads straight to the end; the others stay grouped."""
        failed = LoopPath(
            loop_id="x",
            agent_id="a",
            steps=(
                PathStep(S.idle, T.start, S.context_update),
                PathStep(S.context_update, T.infer, S.inference),
                PathStep(S.inference, T.fail, S.idle),
            ),
            status=LoopStatus.done,
            outcome=Outcome.failed,
        )
        lines = render_dot(failed).splitlines()
        assert (
            '  inference -> idle_end [label="fail (#3)", color=blue, fontcolor=blue, '
            "penwidth=2];" in lines
        )
        assert (
            "  inference -> __ended__ [arrowhead=none, style=dashed, color=gray70];"
            in (lines)
        )
        assert dot_edges(render_dot(failed)) == {
            (s, t, d) for (s, t), d in TABLE.items()
        }

    def test_path_dot_draws_every_edge_of_the_table(self) -> None:
        """A path diagram still draws the whole machine."""
        assert dot_edges(render_dot(REWRITTEN)) == {
            (s, t, d) for (s, t), d in TABLE.items()
        }

    def test_text_is_escaped(self) -> None:
        """Titles and reasons cannot break out of DOT strings or mermaid notes."""
        odd = LoopPath(
            loop_id="x",
            agent_id='a"b\\N',
            state=S.idle,
            status=LoopStatus.paused,
            pending=PathStep(S.idle, T.start, S.context_update),
            pause_reason="why?\nbecause; #1 <b>",
        )
        dot = render_dot(odd)
        assert 'label="loop x (a\\"b\\\\N): paused in idle"' in dot
        assert "why?\\nbecause; #1 <b>" in dot
        mermaid = render_path_mermaid(odd)
        assert (
            "    paused before start to context_update: why? because#59; #35;1 #60;b#62;"
            in (mermaid.splitlines())
        )
        assert 'title: "loop x (a#34;b\\\\N): paused in idle"' in mermaid


class TestFromLoops:
    async def test_live_paused_loop(self) -> None:
        """`runtime.get()` of a paused loop draws it waiting, with the reason."""
        async with Runtime(providers={"scripted": tool_script()}) as runtime:
            loop_id = runtime.run_loop("agent", "2+3?", request(), pause_tools)
            await anyio.wait_all_tasks_blocked()
            path = LoopPath.of(runtime.get(loop_id))
            mermaid = render_path_mermaid(runtime.get(loop_id))
        assert path.status is LoopStatus.paused
        assert path.state is S.inference
        assert path.pending == PathStep(S.inference, T.call_tools, S.function_call)
        assert (
            "  inference --> function_call: call_tools (pending)"
            in mermaid.splitlines()
        )
        assert "  class inference paused" in mermaid.splitlines()
        assert "    paused before call_tools to function_call: approval required" in (
            mermaid.splitlines()
        )

    async def test_events_give_the_path_the_runtime_reports(
        self, tmp_path: Path
    ) -> None:
        """An edge rewrite: the path rebuilt from the log equals the loop's result."""
        log = tmp_path / "events.jsonl"
        async with Runtime(
            providers={"scripted": tool_script()}, event_log=log
        ) as runtime:
            result = await runtime.wait(
                runtime.run_loop("agent", "2+3?", request(), stream_after_tools)
            )
        rebuilt = LoopPath.from_events(read_events(log))
        assert rebuilt.steps == result.path
        assert rebuilt.rewritten == frozenset({3}) == LoopPath.of(result).rewritten
        assert render_path_mermaid(rebuilt) == render_path_mermaid(result)
        assert render_dot(rebuilt) == render_dot(result)
        assert (
            "  function_call --> inference_streaming: infer_streaming "
            "(#4 rewritten from inference)" in render_path_mermaid(rebuilt).splitlines()
        )

    async def test_payload_rewrite_is_known_from_events(self) -> None:
        """A rewrite that keeps the edge (a model swap) shows up in the events' path."""
        providers = {"scripted": tool_script()}
        async with Runtime(providers=providers) as runtime:
            recorder = EventRecorder(runtime.bus)
            loop_id = runtime.run_loop("agent", "2+3?", request(), cheaper_model)
            result = await runtime.wait(loop_id)
        path = LoopPath.from_events(recorder.events, loop_id)
        assert path.rewritten == frozenset({3})
        assert LoopPath.of(result).rewritten == frozenset()
        assert "  function_call --> inference: infer (#4 rewritten)" in (
            render_path_mermaid(path).splitlines()
        )

    def test_events_of_no_or_several_loops(self) -> None:
        """Rebuilding needs the loop's events, and its id when there are several."""
        with pytest.raises(EventLogError, match="no loop 'nope'"):
            LoopPath.from_events([], "nope")
        with pytest.raises(EventLogError, match="the events hold no loop"):
            LoopPath.from_events([])
        events = [started("a"), started("b")]
        with pytest.raises(EventLogError, match="several loops"):
            LoopPath.from_events(events)
        assert LoopPath.from_events(events, "b").loop_id == "b"


@needs_dot
class TestGraphviz:
    def test_svg_has_every_visited_state(self) -> None:
        """The SVG parses; every visited state is a node, the current one highlighted."""
        svg = render_svg(REWRITTEN)
        nodes = svg_nodes(svg)
        assert set(REWRITTEN.visited) <= set(nodes)
        assert set(LoopState) <= set(nodes)
        fills = {
            name: {p.get("fill") for p in g.iter(f"{SVG}path")}
            for name, g in nodes.items()
        }
        assert "darksalmon" in fills["idle_end"]  # where the loop ended (2 borders)
        assert fills["idle"] == {"azure"}  # where it started
        assert fills["function_call"] == {"azure"}
        assert (
            f"<!-- agentfsm DOT sha256:{dot_digest(render_dot(REWRITTEN))} -->" in svg
        )

    def test_svg_of_a_paused_loop(self) -> None:
        """The paused state and the note are drawn."""
        nodes = svg_nodes(render_svg(PAUSED))
        assert {"inference", "__paused__"} <= set(nodes)
        assert {p.get("fill") for p in nodes["inference"].iter(f"{SVG}path")} == {
            "gold"
        }

    def test_png(self) -> None:
        """PNG comes back as PNG bytes."""
        assert render_png(PAUSED).startswith(b"\x89PNG\r\n\x1a\n")

    def test_bad_dot_is_a_clear_error(self) -> None:
        """When `dot` fails, the error carries its message."""
        from agentfsm.diagrams import run_graphviz

        with pytest.raises(GraphvizError, match="exited with"):
            run_graphviz("digraph {", "svg")


def test_missing_graphviz_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `dot`, SVG and PNG fail with an error naming `apt-get install graphviz`."""
    monkeypatch.setattr("agentfsm.diagrams.shutil.which", lambda name: None)
    for render in (render_svg, render_png):
        with pytest.raises(GraphvizError, match="apt-get install graphviz"):
            render(REWRITTEN)


def test_committed_svg_is_current() -> None:
    """`diagrams/agent_loop.svg` was drawn from today's `render_dot()` and shows the machine.

    Layouts differ between graphviz versions and fonts, so the SVG is not compared
    byte for byte: it records the SHA-256 of the DOT it was drawn from, which must
    equal today's DOT; and it must parse and hold every state and edge label.
    """
    svg = COMMITTED_SVG.read_text(encoding="utf-8")
    recorded = re.search(r"<!-- agentfsm DOT sha256:(\w+) -->", svg)
    assert recorded is not None
    assert recorded.group(1) == dot_digest(render_dot()), (
        "run `python -m agentfsm diagram --format svg -o diagrams/agent_loop.svg`"
    )
    assert set(LoopState) <= set(svg_nodes(svg))
    texts = {t.text for t in ET.fromstring(svg).iter(f"{SVG}text")}
    for trigger in Trigger:
        assert any(trigger in (t or "").split(" | ") for t in texts), trigger


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "agentfsm", "diagram", *args],
        capture_output=True,
        cwd=cwd,
        timeout=30,
        check=False,
    )


class TestCli:
    def test_machine_dot(self) -> None:
        """`diagram --format dot` prints the machine's DOT."""
        done = run_cli("--format", "dot")
        assert done.returncode == 0, done.stderr
        assert done.stdout.decode() == render_dot()

    async def test_loop_from_events(self, tmp_path: Path) -> None:
        """`--events FILE --loop PREFIX` draws that loop's path, in every format."""
        log = tmp_path / "events.jsonl"
        async with Runtime(
            providers={"scripted": tool_script()}, event_log=log
        ) as runtime:
            first = runtime.run_loop("agent", "2+3?", request(), stream_after_tools)
            runtime.run_loop("agent", "2+3?", request())
        path = LoopPath.from_events(read_events(log), first)
        done = run_cli("--events", str(log), "--loop", first[:-4])
        assert done.returncode == 0, done.stderr
        assert done.stdout.decode() == render_path_mermaid(path)
        done = run_cli("--events", str(log), "--loop", first, "--format", "dot")
        assert done.stdout.decode() == render_dot(path)
        if shutil.which("dot") is not None:
            target = tmp_path / "path.svg"
            done = run_cli(
                "--events",
                str(log),
                "--loop",
                first,
                "--format",
                "svg",
                "-o",
                str(target),
            )
            assert done.returncode == 0, done.stderr
            assert set(path.visited) <= set(
                svg_nodes(target.read_text(encoding="utf-8"))
            )
            target = tmp_path / "path.png"
            done = run_cli(
                "--events",
                str(log),
                "--loop",
                first,
                "--format",
                "png",
                "-o",
                str(target),
            )
            assert target.read_bytes().startswith(b"\x89PNG")
        done = run_cli("--events", str(log))
        assert done.returncode == 1
        assert b"the events hold 2 loops" in done.stderr
        assert b"with --loop ID" in done.stderr

    def test_usage_errors(self) -> None:
        """`--loop` without `--events`, `--markdown` with another format: exit 2."""
        done = run_cli("--loop", "x")
        assert done.returncode == 2
        assert b"--loop needs --events" in done.stderr
        done = run_cli("--markdown", "--format", "dot")
        assert done.returncode == 2

    async def test_unknown_loop(self, tmp_path: Path) -> None:
        """A loop id the log does not hold: exit 1 with the ids it does hold."""
        log = tmp_path / "events.jsonl"
        async with Runtime(
            providers={"scripted": tool_script()}, event_log=log
        ) as runtime:
            held = runtime.run_loop("agent", "2+3?", request())
        done = run_cli("--events", str(log), "--loop", "nope")
        assert done.returncode == 1
        assert b"no loop id contains 'nope'" in done.stderr
        assert held.encode() in done.stderr

    def test_an_empty_file_is_named_as_such(self, tmp_path: Path) -> None:
        """An empty file is neither a log nor a store: exit 1, saying so."""
        log = tmp_path / "events.jsonl"
        log.write_text("", encoding="utf-8")
        done = run_cli("--events", str(log), "--loop", "nope")
        assert done.returncode == 1
        assert b"is empty: neither an event log" in done.stderr
