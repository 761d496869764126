"""Every `examples/*.py` runs to completion as a script and prints what it shows."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVERS = frozenset({"mcp_calc_server"})
"""Scripts other examples start (an MCP server serves on stdin until it closes)."""
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.stem not in SERVERS)

KEY_LINES: dict[str, tuple[str, ...]] = {
    "approve_tools": (
        "delete_file -> error: the call was denied: delete_file is not allowed here",
        "loop paused in inference, before call_tools -> function_call: needs approval",
        "ran: read_file(notes.txt), delete_file(notes.txt)",
    ),
    "demo": (
        "answer (streamed): Lisbon is at 18 C today",
        (
            "path: idle -> context_update -> inference_streaming -> function_call"
            " -> inference_streaming -> model_message -> idle"
        ),
        "tokens: 149 in + 40 out = 189 total",
    ),
    "inspect_rewrite": (
        "exchange-agent  answered",
        (
            "  function_call --> inference_streaming: infer_streaming"
            " (#4 rewritten from inference)"
        ),
        (
            "#4 function_call --infer_streaming--> inference_streaming"
            " (rewritten from inference)"
        ),
        'convert({"amount":120,"currency":"USD"}) -> 129.60 USD',
    ),
    "mcp_server_tools": (
        "tools: calc_add (Add two integers.), calc_multiply (Multiply two integers.)",
        '  calc_multiply({"a":6,"b":7}) -> 42',
        "paused: approval required: calc_divide; approved",
        '  calc_divide({"a":1,"b":0}) error Error executing tool divide: cannot divide',
        "session closed; 2 calls in the last loop",
    ),
    "otel_logfire": (
        "  invoke_agent trip-planner",
        "    execute_tool weather",
        "      weather service Lisbon",
        "paused: approval required: book_train",
        "approve the booking",
        "  invoke_agent trip-planner",
        "    execute_tool book_train",
        "answer: Lisbon is sunny (18 C): I booked you the train from Porto.",
    ),
    "situation_processor": (
        "answer from billing-agent: Status: paid in full on the 3rd.",
        "all 3 agents answered",
    ),
    "tenant_counts": (
        "internal-smoke-test: answered, 1 tool calls",
        "tenant acme: 3 tool calls, 40 tokens",
        "tenant globex: 1 tool calls, 20 tokens",
    ),
    "swap_model": (
        "big   served request 1 (big:large)",
        "cheap served request 2 (cheap:mini)",
        "cheap served request 3 (cheap:mini)",
    ),
}
"""Text each example must print (each within one line); a new example adds its own."""

NEEDS: dict[str, str] = {"otel_logfire": "logfire"}
"""Examples that need a package no extra of agentfsm installs."""


def test_examples_found() -> None:
    """The glob finds the examples (a wrong path would make the test below vacuous)."""
    assert {path.stem for path in EXAMPLES} >= set(KEY_LINES)


@pytest.mark.parametrize("path", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_example_runs(path: Path) -> None:
    """The example exits 0, writes nothing to stderr and prints its key lines."""
    needed = NEEDS.get(path.stem)
    if needed is not None and importlib.util.find_spec(needed) is None:
        pytest.skip(f"examples/{path.name} needs {needed}: pip install {needed}")
    proc = subprocess.run(
        [sys.executable, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert proc.returncode == 0, f"{path.name} failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stderr == ""
    expected = KEY_LINES.get(path.stem)
    assert expected, f"add the key lines of examples/{path.name} to KEY_LINES"
    lines = proc.stdout.splitlines()
    for key in expected:
        assert any(key in line for line in lines), (
            f"{path.name} did not print {key!r}; it printed:\n{proc.stdout}"
        )
