"""The committed diagram is current, and the command line draws the whole machine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from agentfsm._machine import TABLE
from agentfsm.diagrams import render_markdown, render_mermaid
from agentfsm.states import LoopState, Trigger

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "diagrams" / "agent_loop.md"
EDGE = re.compile(r"^\s*(\w+) --> (\w+): (.+)$")


def run_cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "agentfsm", "diagram", *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=30,
    )
    assert done.stderr == ""
    return done.stdout


def edges(mermaid: str) -> set[tuple[LoopState, Trigger, LoopState]]:
    """The `(source, trigger, dest)` edges a mermaid text draws (`a | b` labels split)."""
    found: set[tuple[LoopState, Trigger, LoopState]] = set()
    for line in mermaid.splitlines():
        match = EDGE.match(line)
        if match:
            source, dest, label = match.groups()
            for trigger in label.split(" | "):
                found.add((LoopState(source), Trigger(trigger), LoopState(dest)))
    return found


def test_committed_diagram_is_current() -> None:
    """`diagrams/agent_loop.md` equals `render_markdown()`; regenerate it if not."""
    assert COMMITTED.read_text(encoding="utf-8") == render_markdown(), (
        "run `python -m agentfsm diagram --markdown -o diagrams/agent_loop.md`"
    )


def test_markdown_wraps_mermaid() -> None:
    """The markdown page holds the mermaid text in a mermaid code block."""
    assert f"```mermaid\n{render_mermaid()}```\n" in render_markdown()


def test_render_is_deterministic() -> None:
    """Drawing twice gives the same text."""
    assert render_mermaid() == render_mermaid()


def test_mermaid_draws_every_edge_of_the_table() -> None:
    """The drawn edges are exactly the compiled table's edges."""
    drawn = edges(render_mermaid())
    assert drawn == {(s, t, d) for (s, t), d in TABLE.items()}


def test_cli_prints_state_diagram() -> None:
    """`python -m agentfsm diagram` prints a stateDiagram-v2 with every state and edge."""
    out = run_cli()
    lines = out.splitlines()
    assert "stateDiagram-v2" in lines
    assert "  [*] --> idle" in lines
    assert "  context_update --> inference: infer" in lines
    assert "  idle --> context_update: start" in lines
    for state in LoopState:
        assert f'  state "{state}" as {state}' in lines
    assert edges(out) == {(s, t, d) for (s, t), d in TABLE.items()}
    assert out == render_mermaid()


def test_cli_markdown_to_file(tmp_path: Path) -> None:
    """`diagram --markdown -o FILE` writes the committed page and prints nothing."""
    target = tmp_path / "loop.md"
    assert run_cli("--markdown", "-o", str(target)) == ""
    assert target.read_text(encoding="utf-8") == COMMITTED.read_text(encoding="utf-8")


def test_the_machine_has_no_active_state() -> None:
    """The machine diagram styles no state as active (transitions marks its model's)."""
    mermaid = render_mermaid()
    assert "s_active\n" not in mermaid.replace("classDef s_active", "")
    assert "  Class idle s_default" in mermaid.splitlines()
