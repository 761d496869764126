"""The chart of `bench/peers.json`: `plot.py peers.json peers.png`.

Run by `run.py` with `bench/.venvs/plot/bin/python` (matplotlib is not one of
agentfsm's dependencies).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib as mpl

mpl.use("Agg")
import matplotlib.pyplot as plt


def main(data: Path, png: Path) -> None:
    doc = json.loads(data.read_text())
    rows = doc["rows"]
    names = [f"{r['name']} {r['version']}".strip() for r in rows]
    fig, (cpu, mem) = plt.subplots(
        1, 2, figsize=(11, 0.55 * len(rows) + 1.6), width_ratios=(2, 1), sharey=True
    )
    y = range(len(rows))
    h = 0.38
    seq = [r["us"] for r in rows]
    conc = [r["cus"] for r in rows]
    cpu.barh([i - h / 2 for i in y], seq, h, label="sequential", color="#4c72b0")
    cpu.barh([i + h / 2 for i in y], conc, h, label="2,000 in flight", color="#dd8452")
    for i, r in enumerate(rows):
        cpu.text(
            seq[i] * 1.08,
            i - h / 2,
            f"{seq[i]:,.0f} µs  ({r['ratio']:,.0f}x)",
            va="center",
            fontsize=8,
        )
    cpu.set_xscale("log")
    cpu.set_xlabel("CPU µs per run (log scale); (Nx) = ratio to the bare loop")
    cpu.set_xlim(right=max(conc + seq) * 8)
    cpu.legend(loc="upper right", fontsize=8)
    cpu.set_yticks(list(y), names)
    cpu.invert_yaxis()
    kb = [r["kb"] for r in rows]
    mem.barh(list(y), kb, 0.6, color="#55a868")
    for i, v in enumerate(kb):
        mem.text(v + max(kb) * 0.02, i, f"{v:.1f}", va="center", fontsize=8)
    mem.set_xlabel("KB per run in flight (tracemalloc peak / 2,000)")
    mem.set_xlim(right=max(kb) * 1.25)
    fig.suptitle(
        "One agent loop (4 model calls + 3 tool calls, scripted zero-latency model)",
        fontsize=10,
    )
    fig.text(0.01, 0.01, doc["machine"], fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
