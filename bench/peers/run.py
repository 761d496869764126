"""agentfsm side by side with its peers: one invocation, one table (`make bench-peers`).

Runs `peer_<name>.py` for agentfsm and each peer, each with the python of its
own virtual environment under `bench/.venvs/<name>` (made by `make bench-peers`
from `requirements-<name>.txt`; agentfsm's has only its core dependencies), one
after the other, and collects their JSON figures. Each process also measures the
bare asyncio loop, and each subject's ratio is taken against the bare loop of
its own process: machine speed drifts between processes by up to ~1.7x.

Prints one table; writes `bench/peers.json`, the chart `bench/peers.png` (with
matplotlib from `bench/.venvs/plot`) and the table into README.md's Performance
section (between the `bench-peers` markers). The last line is
`agentfsm_vs_floor=<x> fastest_peer_vs_agentfsm=<y>`, where x is agentfsm's
µs/run over its bare loop's and y is the fastest peer's ratio to its bare loop
over agentfsm's (the fastest peer's µs/run over agentfsm's, drift-corrected).
Both are for agentfsm as the peers and the bare loop run, with nobody
subscribed to its bus; the line before it, `agentfsm_with_subscriber_vs_floor`,
is the same runs with one subscriber receiving all 23 events of every run.

`--quick` runs a smoke version (fewer rounds, 200 in flight); `--only a,b`
runs a subset; `--no-readme` leaves README.md alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

HERE: Final = Path(__file__).resolve().parent
BENCH: Final = HERE.parent
ROOT: Final = BENCH.parent
VENVS: Final = BENCH / ".venvs"

SUBJECTS: Final = (
    "agentfsm",
    "agentfsm_observed",
    "burr",
    "openai_agents",
    "pydantic_ai",
    "langgraph",
)
RUN_AS: Final = {"agentfsm_observed": ("agentfsm", ["--subscriber"])}
"""Subjects run by another subject's script and venv, with extra arguments."""
OBSERVED: Final = "agentfsm (one subscriber)"
MODEL_CALLS: Final = 4
CONCURRENT: Final = 2_000
BEGIN: Final = "<!-- bench-peers:begin (written by `make bench-peers`) -->"
END: Final = "<!-- bench-peers:end -->"

# issue 6's targets for agentfsm
MAX_RATIO: Final = 10.0
MAX_CONCURRENT_RATIO: Final = 1.3
MAX_KB: Final = 15.0
MAX_IMPORT_MS: Final = 150.0


def venv_python(name: str) -> Path:
    return VENVS / name / "bin" / "python"


def run_subject(name: str, quick: bool) -> dict[str, Any]:
    script, extra = RUN_AS.get(name, (name, []))
    python = venv_python(script)
    if not python.exists():
        sys.exit(f"{python} is missing: run `make bench-peers` (it creates the venvs)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [str(python), str(HERE / f"peer_{script}.py"), "--json", str(out), *extra]
        if quick:
            cmd.append("--quick")
        start = time.monotonic()
        subprocess.run(cmd, check=True, cwd=ROOT)
        figures: dict[str, Any] = json.loads(out.read_text())
    figures["wall_s"] = time.monotonic() - start
    return figures


def rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Table rows: the bare loop (agentfsm's process), agentfsm, then peers by speed."""
    out = []
    for f in results:
        out.append(
            {
                "name": f["name"],
                "version": f["version"],
                "us": f["us_per_run"],
                "ratio": f["us_per_run"] / f["bare_us_per_run"],
                "cus": f["concurrent_us_per_run"],
                "cratio": f["concurrent_us_per_run"] / f["bare_concurrent_us_per_run"],
                "over_seq": f["concurrent_over_sequential"],
                "kb": f["kb_per_run_in_flight"],
                "import_ms": f["import_ms"],
                "reference_imports": f.get("reference_imports"),
                "reference_import_ms": f.get("reference_import_ms"),
            }
        )
    fsm = next((f for f in results if f["name"] == "agentfsm"), results[0])
    bare = {
        "name": "bare asyncio loop",
        "version": "",
        "us": fsm["bare_us_per_run"],
        "ratio": 1.0,
        "cus": fsm["bare_concurrent_us_per_run"],
        "cratio": 1.0,
        "over_seq": fsm["bare_concurrent_over_sequential"],
        "kb": fsm["bare_kb_per_run_in_flight"],
        "import_ms": None,
    }
    order = {"agentfsm": 0, OBSERVED: 1}
    out.sort(key=lambda r: (order.get(r["name"], 2), r["ratio"]))
    return [bare, *out]


def table(table_rows: list[dict[str, Any]], in_flight: int) -> str:
    head = (
        "| runtime | µs/run | µs/model step | x bare | "
        f"µs/run, {in_flight:,} in flight | x bare | in flight / sequential | "
        "KB/run in flight | import ms |\n"
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|\n"
    )
    lines = []
    for r in table_rows:
        name = f"{r['name']} {r['version']}".strip()
        imp = "-" if r["import_ms"] is None else f"{r['import_ms']:.0f}"
        lines.append(
            f"| {name} | {r['us']:,.1f} | {r['us'] / MODEL_CALLS:,.1f} | "
            f"{r['ratio']:,.1f} | {r['cus']:,.1f} | {r['cratio']:,.1f} | "
            f"{r['over_seq']:.2f} | {r['kb']:.1f} | {imp} |"
        )
    return head + "\n".join(lines) + "\n"


def readme_table(table_rows: list[dict[str, Any]], in_flight: int) -> str:
    """The short table README.md shows (the full one is printed, and in peers.json)."""
    head = (
        f"| runtime | µs/run | x bare | µs/run, {in_flight:,} in flight | "
        "KB/run in flight | import ms |\n"
        "|---|--:|--:|--:|--:|--:|\n"
    )
    lines = []
    for r in table_rows:
        name = f"{r['name']} {r['version']}".strip()
        imp = "-" if r["import_ms"] is None else f"{r['import_ms']:.0f}"
        lines.append(
            f"| {name} | {r['us']:,.1f} | {r['ratio']:,.1f} | {r['cus']:,.1f} | "
            f"{r['kb']:.1f} | {imp} |"
        )
    return head + "\n".join(lines) + "\n"


def readme_block(table_rows: list[dict[str, Any]], in_flight: int, machine: str) -> str:
    """What `make bench-peers` writes between README.md's markers."""
    return f"{readme_table(table_rows, in_flight)}\n{machine}.\n"


def targets(fsm: dict[str, Any], observed: dict[str, Any] | None) -> list[str]:
    def mark(ok: bool) -> str:
        return "met" if ok else "MISSED"

    def in_flight(row: dict[str, Any]) -> float:
        return float(row["over_seq"])

    ratio, concurrent = fsm["ratio"], in_flight(fsm)
    kb, ms = fsm["kb"], fsm["import_ms"]
    lines = [
        f"target: agentfsm <= {MAX_RATIO:g}x the bare loop, run as the peers are "
        f"(nobody subscribed, so no event built): {ratio:.1f}x, "
        + mark(ratio <= MAX_RATIO),
        f"target: {CONCURRENT:,} in flight <= {MAX_CONCURRENT_RATIO}x sequential "
        f"per run: {concurrent:.2f}x, " + mark(concurrent <= MAX_CONCURRENT_RATIO),
        f"target: <= {MAX_KB:g} KB per run in flight: {kb:.1f} KB, "
        + mark(kb <= MAX_KB),
        f"target: import agentfsm <= {MAX_IMPORT_MS:g} ms (core dependencies only): "
        f"{ms:.0f} ms, "
        + mark(ms <= MAX_IMPORT_MS)
        + (
            f" (import {', '.join(fsm['reference_imports'])} alone: "
            f"{fsm['reference_import_ms']:.0f} ms, timed alternately with it)"
            if fsm.get("reference_import_ms")
            else ""
        ),
    ]
    if observed is not None:
        lines.append(
            "with one subscriber receiving all 23 events of every run: "
            f"{observed['ratio']:.1f}x the bare loop, "
            f"{in_flight(observed):.2f}x in flight / sequential, "
            f"{observed['kb']:.1f} KB per run in flight"
        )
    return lines


def update_readme(text: str) -> None:
    readme = ROOT / "README.md"
    content = readme.read_text(encoding="utf-8")
    start, end = content.find(BEGIN), content.find(END)
    if start < 0 or end < start:
        print(f"README.md has no {BEGIN!r} ... {END!r} block: not updated")
        return
    content = content[: start + len(BEGIN)] + "\n" + text + content[end:]
    readme.write_text(content, encoding="utf-8")


def plot(data: Path, png: Path) -> None:
    python = venv_python("plot")
    if not python.exists():
        print(f"{python} is missing: no chart")
        return
    subprocess.run(
        [str(python), str(HERE / "plot.py"), str(data), str(png)], check=True
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--only", help="comma-separated subset of " + ",".join(SUBJECTS)
    )
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(SUBJECTS)
    if "agentfsm" not in names:
        names.insert(0, "agentfsm")
    start = time.monotonic()
    results = [run_subject(name, args.quick) for name in names]
    in_flight = 200 if args.quick else CONCURRENT
    table_rows = rows(results)
    text = table(table_rows, in_flight)
    fsm = next(r for r in table_rows if r["name"] == "agentfsm")
    observed = next((r for r in table_rows if r["name"] == OBSERVED), None)
    peers = [
        r
        for r in table_rows
        if r["name"] not in ("agentfsm", OBSERVED, "bare asyncio loop")
    ]
    fastest = min(peers, key=lambda r: r["ratio"]) if peers else None
    machine = (
        f"python {results[0]['python']}, 2-core VM; median of "
        f"{3 if args.quick else 7} sequential rounds and "
        f"{1 if args.quick else '5-15'} rounds of {in_flight:,} in flight; "
        "ratios against the bare loop "
        "measured in the same process; in flight / sequential is the median "
        "ratio of each round in flight to a sequential round just before it"
    )
    print()
    print(text)
    print(machine)
    for line in targets(fsm, observed):
        print(line)
    full = not args.quick and not args.only
    data = BENCH / "peers.json"
    if full:
        data.write_text(
            json.dumps(
                {"machine": machine, "rows": table_rows, "raw": results}, indent=1
            )
            + "\n"
        )
        plot(data, BENCH / "peers.png")
        if not args.no_readme:
            update_readme(readme_block(table_rows, in_flight, machine))
    print(f"total {time.monotonic() - start:.0f} s")
    y = fastest["ratio"] / fsm["ratio"] if fastest else float("nan")
    if observed is not None:
        print(f"agentfsm_with_subscriber_vs_floor={observed['ratio']:.1f}")
    print(f"agentfsm_vs_floor={fsm['ratio']:.1f} fastest_peer_vs_agentfsm={y:.1f}")


if __name__ == "__main__":
    main()
