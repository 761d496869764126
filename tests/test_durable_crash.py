"""The crash matrix: a durable loop's process SIGKILLed at every write it makes
to its store and in the middle of each tool call; a new process recovers it.

The workload is the benchmark's (4 model requests, 3 tool calls: `step_a`
twice, `on_crash="retry"`, and `step_b` once, the default "pause"), each call
appending a line to a side-effect file (tests/durable_crash_child.py). For
every crash point, the loop ends `answered` with the context of a run that
did not crash; every call that completed ran exactly once; the call in flight
followed its tool's policy: `step_a` ran again, `step_b` paused the loop and
was resolved by its operator (answered from the side effect, or run when it
had not happened).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

CHILD = Path(__file__).with_name("durable_crash_child.py")
ROOT = CHILD.parent.parent

# The writes of one run: 8 commits (into `inference` 4 times, into
# `function_call` 3 times with the call's intent, and the end; the other
# transitions' records and the calls' outputs go with them); each call's
# middle; and each request after a call, the commit with the call's output
# still queued (the model does not wait for it).
POINTS = [
    *(f"commit:{n}" for n in range(1, 9)),
    *(f"mid_tool:{n}" for n in range(1, 4)),
    *(f"ask:{n}" for n in range(2, 5)),
]
CALLS = ["a 1", "b 2", "a 3"]  # what each call's side effect writes


def child(backend: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENTFSM_BACKEND": backend}
    return subprocess.run(
        [sys.executable, str(CHILD), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def crash_and_recover(backend: str, point: str, where: Path) -> dict[str, Any]:
    where.mkdir()
    db, side = str(where / "loops.db"), str(where / "side-effects")
    ran = child(backend, "run", db, side, point)
    assert ran.returncode == -signal.SIGKILL, (point, ran.stderr[-2000:])
    loop_id = ran.stdout.split()[0]
    recovered = child(backend, "recover", db, side, loop_id)
    assert recovered.returncode == 0, (point, recovered.stderr[-2000:])
    result: dict[str, Any] = json.loads(recovered.stdout.splitlines()[-1])
    result["side_effects"] = Path(side).read_text().splitlines()
    return result


def in_flight(point: str) -> int | None:
    """The call that ran and has no output in the store at `point`, if any:
    killed in its middle, or as the request after it was made."""
    kind, _, at = point.partition(":")
    if kind == "mid_tool":
        return int(at)
    if kind == "ask":
        return int(at) - 1
    return None


def expected_effects(point: str) -> list[str]:
    """Each call once; a `step_a` call in flight at the crash (its side effect
    made, its output not in the store) twice: its policy is to retry."""
    effects = []
    for n, line in enumerate(CALLS, 1):
        effects.append(line)
        if n == in_flight(point) and line.startswith("a"):
            effects.append(line)
    return effects


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_every_crash_point_recovers_to_the_same_end(
    backend: str, tmp_path: Path
) -> None:
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    db, side = str(reference_dir / "loops.db"), str(reference_dir / "side")
    ran = child(backend, "run", db, side)
    assert ran.returncode == 0, ran.stderr[-2000:]
    reference = child(backend, "recover", db, side, ran.stdout.split()[0])
    assert reference.returncode == 0, reference.stderr[-2000:]
    expected = json.loads(reference.stdout.splitlines()[-1])
    assert expected["outcome"] == "answered"
    assert Path(side).read_text().splitlines() == CALLS

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(
            zip(
                POINTS,
                pool.map(
                    lambda p: crash_and_recover(
                        backend, p, tmp_path / p.replace(":", "-")
                    ),
                    POINTS,
                ),
                strict=True,
            )
        )
    for point, result in results.items():
        assert (result["outcome"], result["status"]) == ("answered", "done"), point
        assert result["items"] == expected["items"], point
        assert result["side_effects"] == expected_effects(point), point
        # Killed with `step_b` in flight, or right after the commit holding
        # its intent (it had not started: the operator found no side effect and
        # ran it), the loop paused, naming the call.
        paused = result["report"]["paused"]
        if in_flight(point) == 2 or point == "commit:4":
            assert (len(paused), result["uncertain"]) == (1, ["c2"]), point
        else:
            assert paused == [], point
