"""The peer benchmark runs the same workload and floor as bench/bench_loop.py.

`make bench-peers` compares agentfsm with other frameworks, each peer script in
its own venv building its scripted model from `bench/peers/harness.py`. These
checks keep harness.py's script and answer identical to the ones
agentfsm is measured on (bench_loop.py, which imports its floor from harness.py),
and every peer script on that script.
They run in a subprocess: bench_loop.py configures structlog globally.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "bench" / "peers"

CHECK = """
import json, sys
sys.path[:0] = ["bench", "bench/peers"]
import bench_loop, harness

steps = bench_loop.scripted_provider().script
calls = [[(c.name, json.loads(c.arguments)) for c in s.function_calls] for s in steps]
assert calls[:-1] == [[step] for step in harness.SCRIPT], calls
assert calls[-1] == [] and steps[-1].message.content == harness.ANSWER, steps[-1]
assert bench_loop.bare_loop is harness.bare_loop  # one floor, measured by both
print("same workload")
"""


def test_harness_matches_bench_loop() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHECK],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "same workload"


def test_every_peer_plays_the_harness_script() -> None:
    peers = sorted(PEERS.glob("peer_*.py"))
    assert {p.stem for p in peers} >= {
        "peer_agentfsm",
        "peer_burr",
        "peer_langgraph",
        "peer_openai_agents",
        "peer_pydantic_ai",
    }
    for path in peers:
        source = path.read_text(encoding="utf-8")
        if path.stem == "peer_agentfsm":
            assert "bench_loop.scripted_provider()" in source
        else:
            # The model's reply comes from the shared script, not a copy of it.
            assert "script_step(" in source, path.name
            assert "ANSWER" in source, path.name
        assert "main(" in source, path.name


def test_readme_table_is_the_last_full_run() -> None:
    """README.md's performance block is what `make bench-peers` writes from peers.json."""
    code = (
        "import json, sys\n"
        "sys.path[:0] = ['bench/peers']\n"
        "import run\n"
        "data = json.load(open('bench/peers.json'))\n"
        "sys.stdout.write(run.readme_block(data['rows'], run.CONCURRENT, data['machine']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    begin = "<!-- bench-peers:begin (written by `make bench-peers`) -->\n"
    block = readme[
        readme.index(begin) + len(begin) : readme.index("<!-- bench-peers:end")
    ]
    assert block == out.stdout
