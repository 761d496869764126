"""The crash storm: waves of durable loops with side-effecting tools in a child
process (tests/durable_storm_child.py), SIGKILLed at random moments, round
after round, the recovering process killed too, until a last recovering
process runs to the end undisturbed. On SQLite and PostgreSQL, each with and
without events, on asyncio and trio, for several seeds.

A storm of R rounds: round 0 starts a wave of loops and is killed; rounds 1
to R-1 recover the store (`Runtime.recover()`, operator decisions for the
pauses), start a wave more and are killed; round R recovers and runs to the
end. Only the moment of each kill is random (`random.Random`, seeded per
parametrization, see `KILLS`), counted from the child's `go` (after its
start-up and a warm-up loop of each script on a store of its own): in
`recover()` or a wave's first commits, while the first pauses are resolved
and the batches they resume run, or anywhere later (mid-tool, mid-request,
between a commit and the next). What is asserted never depends on when a
kill landed: each check compares what the child logged (fsynced before it
went on) with what the store held at the kills (read by the store's own API
in this process, between rounds, while no child runs). A bug may show in one
run and not the next (the kills land elsewhere); a violation reported is
never one of timing.

The invariants, checked after every kill (each message names the seed, the
round, the loop and the call or request):

1. no call the ledger held as `done` at a kill runs again; a call runs twice
   only if its tool is `on_crash="retry"` and in two processes (a
   default-policy tool never twice: the operator answers an uncertain call
   whose side effect happened, and runs only one that did not); a call runs
   only once its intent is in the ledger;
2. no model request whose output the store held at a kill is sent again
   (nor twice by one process);
3. each decision is asked once: a pause (approval: the loop and its batch;
   uncertain outcome: the loop, the call and its ledger attempt) is not
   asked again once a decision given for it was stored (the store's record
   of the loop, at the kill after the decision, is past the seq the loop
   had when it was asked: the resume's commit landed);
4. with `events=True`, each loop's stored events are seqs 1..n, no hole;
5. every outcome the child reported equals the stored record's (done).

And at the end: every loop ends `answered` in the store after its whole
script, each call in its stored context has one output (the tool's, or the
denial for a denied approval), a denied call never ran and every other one
did, and (events) a finished loop's stored events end with its `loop.idle`.
All violations of a storm are collected and reported together.

The suite runs a short storm (4 killed rounds of 8 new loops each, 2 seeds
per store and backend). Longer ones, by environment variable:

- `AGENTFSM_STORM_ROUNDS`: killed rounds per storm (default 4);
- `AGENTFSM_STORM_SEEDS`: seeds per store and backend (default 2: 1 and 2);
- `AGENTFSM_STORM_WAVE`: new loops each killed round starts (default 8).

    AGENTFSM_STORM_ROUNDS=30 AGENTFSM_STORM_SEEDS=10 \\
        .venv/bin/python -m pytest tests/test_durable_storm.py
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentfsm.messages import ContextItem, FunctionCallItem, FunctionCallOutputItem
from agentfsm.store import CallRecord, EventArchive
from tests.durable_storm_child import (
    SCRIPTS,
    TOOL_POLICY,
    denied,
    open_store,
    output_of,
    script_of,
)

pytestmark = pytest.mark.e2e

CHILD = Path(__file__).with_name("durable_storm_child.py")
ROOT = CHILD.parent.parent

ROUNDS = int(os.environ.get("AGENTFSM_STORM_ROUNDS", "4"))
SEEDS = int(os.environ.get("AGENTFSM_STORM_SEEDS", "2"))
WAVE = int(os.environ.get("AGENTFSM_STORM_WAVE", "8"))

KILLS = (
    ("early", 0.25, 0.0, 0.03),
    ("pauses", 0.35, 0.03, 0.15),
    ("late", 0.40, 0.15, 0.45),
)
"""Where a kill lands, in seconds after the child's `go`: (name, chance,
from, to). Early: `recover()` and a wave's first commits; pauses: the
operator's first decisions and the batches they resume; late: anywhere in
the rest of a wave's run (a wave takes ~0.3 s undisturbed)."""
MAX_REQUESTS = max(len(s.steps) for s in SCRIPTS) + 1
"""The request numbers read from the store (one past the longest script)."""

# ------------------------------------------------------------ what happened

Line = dict[str, Any]


@dataclass
class Logs:
    """The child processes' logs (tests/durable_storm_child.py), all rounds."""

    loops: list[Line]
    effects: list[Line]
    requests: list[Line]
    decisions: list[Line]
    results: list[Line]

    @classmethod
    def read(cls, where: Path) -> Logs:
        return cls(*(_lines(where / f"{f.name}.jsonl") for f in fields(cls)))

    def of(self, name: str, round_: int) -> list[Line]:
        lines: list[Line] = getattr(self, name)
        return [line for line in lines if line["round"] == round_]


def _lines(path: Path) -> list[Line]:
    if not path.exists():
        return []
    text = path.read_text()
    assert not text or text.endswith("\n"), f"{path} ends with a torn line"
    return [json.loads(line) for line in text.splitlines()]


@dataclass(frozen=True)
class Stored:
    """A loop as the store held it at a kill."""

    status: str
    state: str
    outcome: str | None
    seq: int
    model_requests: int
    items: tuple[ContextItem, ...]
    ledger: dict[str, CallRecord]
    """Its ledger entries by key (of requests 1 to MAX_REQUESTS)."""


@dataclass(frozen=True)
class Snapshot:
    """The store after a round: the loops it held, what it recorded."""

    loops: dict[str, Stored]
    recorded: frozenset[tuple[str, int]]
    """(loop, request number) of each model output recorded, of any loop
    started (held by the store or not)."""
    events: dict[str, list[tuple[int, str]]] | None
    """(seq, type) of each loop's stored events, with `events=True`."""


async def read_store(config: dict[str, Any], loop_ids: Iterable[str]) -> Snapshot:
    """Read everything the checks need through the store's own API."""
    loops: dict[str, Stored] = {}
    recorded: set[tuple[str, int]] = set()
    events: dict[str, list[tuple[int, str]]] | None = None
    if config["kind"].endswith("-events"):
        events = {}
    async with open_store(config) as store:
        for loop_id in loop_ids:
            for n in range(1, MAX_REQUESTS + 1):
                if await store.inference(loop_id, n) is not None:
                    recorded.add((loop_id, n))
            if events is not None:
                assert isinstance(store, EventArchive)  # made with events=True
                events[loop_id] = [(e.seq, e.type) for e in await store.events(loop_id)]
            stored = await store.load(loop_id)
            if stored is None:
                continue
            ledger = {}
            for n in range(1, MAX_REQUESTS + 1):
                ledger.update({c.key: c for c in await store.calls(loop_id, n)})
            record = stored.record
            loops[loop_id] = Stored(
                status=record.status.value,
                state=record.state.value,
                outcome=None if record.outcome is None else record.outcome.value,
                seq=record.seq,
                model_requests=record.model_requests,
                items=tuple(stored.items),
                ledger=ledger,
            )
    return Snapshot(loops, frozenset(recorded), events)


# --------------------------------------------------------------- the checks


@dataclass
class Checks:
    """What a storm logged and the store held at each kill; each `check_*`
    gives the violations of one invariant in one round (messages)."""

    name: str
    logs: Logs
    snapshots: list[Snapshot]

    def at(self, round_: int) -> str:
        return f"{self.name} round={round_}"

    # 1. no done call re-run; a call runs twice only if retried by policy.
    def check_effects(self, r: int) -> Iterator[str]:
        before = self.snapshots[r - 1] if r > 0 else None
        now = self.snapshots[r]
        seen: dict[str, list[Line]] = {}
        for line in self.logs.effects:
            if line["round"] > r:
                break
            key, loop = line["key"], line["loop"]
            earlier = seen.setdefault(key, [])
            call = f"loop={loop} call={line['call_id']} ({line['tool']}) key={key[:16]}"
            if line["round"] == r:
                done = before is not None and _status(before, loop, key) == "done"
                rounds = [e["round"] for e in earlier] + [r]
                if done:
                    yield (
                        f"[1] {self.at(r)} {call}: ran again although the ledger "
                        f"held it done at the kill of round {r - 1} "
                        f"(executions in rounds {rounds})"
                    )
                elif earlier and TOOL_POLICY[line["tool"]] == "pause":
                    yield (
                        f"[1] {self.at(r)} {call}: a default-policy (pause) tool "
                        f"ran twice (executions in rounds {rounds}; "
                        f"{self._decisions_about(loop, line['call_id'])})"
                    )
                elif earlier and earlier[-1]["round"] == r:
                    yield (
                        f"[1] {self.at(r)} {call}: ran twice in one process "
                        f"(executions in rounds {rounds})"
                    )
                if _status(now, loop, key) is None:
                    yield (
                        f"[1] {self.at(r)} {call}: ran, and the store held no "
                        f"ledger entry for it at the kill after"
                    )
            earlier.append(line)

    def _decisions_about(self, loop: str, call_id: str) -> str:
        given = [
            f"round {d['round']}: {d['kind']} "
            f"{'answered' if call_id in d['answered'] else 'proceed'}"
            for d in self.logs.decisions
            if d["type"] == "given" and d["loop"] == loop and call_id in d["calls"]
        ]
        return "decisions given: " + ("; ".join(given) or "none")

    # 2. no recorded model output re-requested.
    def check_requests(self, r: int) -> Iterator[str]:
        before = self.snapshots[r - 1] if r > 0 else None
        served: set[tuple[str, int]] = set()
        for line in self.logs.of("requests", r):
            request = (line["loop"], line["n"])
            where = f"[2] {self.at(r)} loop={line['loop']} request={line['n']}"
            if before is not None and request in before.recorded:
                yield (
                    f"{where}: sent again although the store held its output at "
                    f"the kill of round {r - 1} (its record then: "
                    f"{_describe(before.loops.get(line['loop']))})"
                )
            if request in served:
                yield f"{where}: sent twice by one process"
            served.add(request)

    # 3. each decision asked once.
    def check_decisions(self, r: int) -> Iterator[str]:
        given: list[Line] = []
        for line in self.logs.decisions:
            if line["round"] > r:
                break
            if line["type"] == "given":
                given.append(line)
                continue
            if line["round"] != r:
                continue
            asked = _questions(line)
            for decision in given:
                again = asked & _questions(decision)
                if decision["loop"] != line["loop"] or not again:
                    continue
                what = ", ".join(sorted(" ".join(map(str, q[1:])) for q in again))
                where = f"[3] {self.at(r)} loop={line['loop']} {line['kind']} [{what}]"
                if decision["round"] == r:
                    yield f"{where}: asked twice by one process"
                    break
                at = self.snapshots[decision["round"]].loops.get(line["loop"])
                if at is not None and (at.status == "done" or at.seq > decision["seq"]):
                    yield (
                        f"{where}: asked again, though the decision given in round "
                        f"{decision['round']} ({_decided(decision)}) was stored "
                        f"(the store's record at that round's kill has seq "
                        f"{at.seq} > {decision['seq']}, the seq when it was asked); "
                        f"batch {line['calls']}; at the kill before: "
                        f"{_describe(self.snapshots[r - 1].loops.get(line['loop']))}"
                    )
                    break

    # 4. events without holes.
    def check_events(self, r: int) -> Iterator[str]:
        now = self.snapshots[r].events
        if now is None:
            return
        before = self.snapshots[r - 1].events if r > 0 else None
        for loop, events in now.items():
            missing = _holes([seq for seq, _ in events])
            if before is not None:
                missing -= _holes([seq for seq, _ in before.get(loop, [])])
            if missing:
                yield (
                    f"[4] {self.at(r)} loop={loop}: stored events miss seqs "
                    f"{_ranges(missing)} (stored: {_ranges({s for s, _ in events})})"
                )

    # 5. the store agrees with every reported outcome.
    def check_results(self, r: int) -> Iterator[str]:
        now = self.snapshots[r]
        for line in self.logs.of("results", r):
            loop = line["loop"]
            stored = now.loops.get(loop)
            held = "nothing" if stored is None else f"{stored.status}/{stored.outcome}"
            if stored is None or (stored.status, stored.outcome) != (
                "done",
                line["outcome"],
            ):
                yield (
                    f"[5] {self.at(r)} loop={loop}: reported {line['outcome']!r} "
                    f"(error: {line.get('error')}), the store holds {held}"
                )

    def check_final(self, r: int) -> Iterator[str]:
        """Every wave's loops finished as their scripts say (see the module)."""
        now = self.snapshots[r]
        before = self.snapshots[r - 1]
        latest: dict[int, str] = {}
        for line in self.logs.loops:
            latest[line["index"]] = line["loop"]
        reported = {line["loop"] for line in self.logs.of("results", r)}
        ran: dict[tuple[str, str], int] = {}
        for line in self.logs.effects:
            call = (line["loop"], line["call_id"])
            ran[call] = ran.get(call, 0) + 1
        for index, loop in sorted(latest.items()):
            where = f"[5] {self.at(r)} loop={loop} (final)"
            stored = now.loops.get(loop)
            if stored is None:
                yield f"{where}: not in the store"
                continue
            held = before.loops.get(loop)
            if loop not in reported and (held is None or held.status != "done"):
                yield f"{where}: the last process reported no outcome"
            steps = script_of(index).steps
            if (stored.status, stored.outcome, stored.model_requests) != (
                "done",
                "answered",
                len(steps),
            ):
                yield (
                    f"{where}: ended {stored.status}/{stored.outcome} after "
                    f"{stored.model_requests} requests, not done/answered after "
                    f"{len(steps)}"
                )
            yield from self._final_context(r, where, loop, stored, ran)
            if now.events is not None and stored.status == "done":
                events = now.events.get(loop, [])
                if not events or events[-1][1] != "loop.idle":
                    last = events[-1] if events else None
                    yield (
                        f"[4] {self.at(r)} loop={loop} (final): its stored events "
                        f"end with {last}, not its loop.idle"
                    )

    def _final_context(
        self,
        r: int,
        where: str,
        loop: str,
        stored: Stored,
        ran: dict[tuple[str, str], int],
    ) -> Iterator[str]:
        outputs: dict[str, list[FunctionCallOutputItem]] = {}
        for item in stored.items:
            if isinstance(item, FunctionCallOutputItem):
                outputs.setdefault(item.call_id, []).append(item)
        for item in stored.items:
            if not isinstance(item, FunctionCallItem):
                continue
            got = outputs.get(item.call_id, [])
            executions = ran.get((loop, item.call_id), 0)
            call = f"call={item.call_id} ({item.name})"
            if len(got) != 1:
                yield f"{where} {call}: {len(got)} outputs in the stored context"
                continue
            if item.name == "approve_step" and denied(loop, item.call_id):
                if not got[0].is_error or executions:
                    yield (
                        f"[1] {self.at(r)} loop={loop} {call}: denied, yet its "
                        f"output is {got[0].output!r} and it ran {executions} times"
                    )
            elif got[0].output != output_of(item.name, item.call_id) or not executions:
                yield (
                    f"[1] {self.at(r)} loop={loop} {call}: its stored output is "
                    f"{got[0].output!r} and it ran {executions} times"
                )


def _status(snapshot: Snapshot, loop: str, key: str) -> str | None:
    stored = snapshot.loops.get(loop)
    entry = None if stored is None else stored.ledger.get(key)
    return None if entry is None else entry.status


def _describe(stored: Stored | None) -> str:
    """A loop's record and ledger, in short, for a message."""
    if stored is None:
        return "not in the store"
    calls = ", ".join(
        f"{c.request}/{c.call_id}={c.status}#{c.attempt}"
        for c in sorted(stored.ledger.values(), key=lambda c: (c.request, c.position))
    )
    return (
        f"{stored.status} in {stored.state} seq={stored.seq} "
        f"requests={stored.model_requests}; ledger: {calls or 'empty'}"
    )


def _questions(line: Line) -> set[tuple[Any, ...]]:
    """What a pause asks: approval of a batch, or whether each uncertain call
    (at its ledger attempt) ran."""
    if line["kind"] == "approval":
        return {("approval", *line["calls"])}
    return {("uncertain", c, f"attempt {a}") for c, a in line["uncertain"].items()}


def _decided(line: Line) -> str:
    if line["answered"]:
        return f"answered {sorted(line['answered'])}"
    if line["denied"]:
        return f"denied {line['denied']}"
    return "proceed"


def _holes(seqs: list[int]) -> set[int]:
    return set(range(1, max(seqs, default=0) + 1)) - set(seqs)


def _ranges(seqs: set[int]) -> str:
    parts: list[str] = []
    for seq in sorted(seqs):
        if parts and parts[-1].split("-")[-1] == str(seq - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{seq}"
        else:
            parts.append(str(seq))
    return ",".join(parts)


# ---------------------------------------------------------------- the storm


@dataclass
class Round:
    mode: str
    kill: str
    """Where it lands (see `KILLS`), or `none` (the last round)."""
    delay: float
    ended: str = ""
    """`killed`, or `finished` (it exited 0 before the kill)."""
    seconds: float = 0.0


@dataclass
class Storm:
    config: dict[str, Any]
    name: str
    rng: random.Random
    where: Path
    rounds: list[Round] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    violations: dict[str, None] = field(default_factory=dict)

    def run(self, killed: int) -> None:
        for r in range(killed + 1):
            last = r == killed
            if last:
                plan = Round("recover", "none", 0.0)
            else:
                plan = self.plan("start" if r == 0 else "recover")
            self.rounds.append(plan)
            self.child(r, plan, wave=0 if last else WAVE)
            self.check(r, last=last)

    def plan(self, mode: str) -> Round:
        """When to kill this round's child (the storm's only randomness)."""
        (kill, _, low, high) = self.rng.choices(KILLS, [k[1] for k in KILLS])[0]
        return Round(mode, kill, self.rng.uniform(low, high))

    def child(self, r: int, plan: Round, wave: int) -> None:
        config = {**self.config, "round": r, "first": r * WAVE, "wave": wave}
        stderr = self.where / f"stderr-{r}.txt"
        started = time.monotonic()
        with stderr.open("w") as errors:
            process = subprocess.Popen(
                [sys.executable, str(CHILD), plan.mode, json.dumps(config)],
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=subprocess.PIPE,
                stderr=errors,
                cwd=ROOT,
            )
        try:
            self._go(process, r, stderr)
            if plan.kill == "none":
                code = self._wait(process, r, stderr, timeout=120)
                assert code == 0, f"{self.name} round={r}: exit {code}\n{_tail(stderr)}"
                plan.ended = "finished"
            else:
                time.sleep(plan.delay)
                plan.ended = "finished" if process.poll() is not None else "killed"
                process.send_signal(signal.SIGKILL)
                code = self._wait(process, r, stderr, timeout=30)
                assert code in (0, -signal.SIGKILL), (
                    f"{self.name} round={r}: exit {code}\n{_tail(stderr)}"
                )
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            assert process.stdout is not None
            process.stdout.close()
        plan.seconds = time.monotonic() - started

    def _go(self, process: subprocess.Popen[bytes], r: int, stderr: Path) -> None:
        """Wait for the child's `go`."""
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 60)
        line = process.stdout.readline() if ready else b""
        assert line == b"go\n", (
            f"{self.name} round={r}: no `go` ({line!r})\n{_tail(stderr)}"
        )

    def _wait(
        self, process: subprocess.Popen[bytes], r: int, stderr: Path, timeout: float
    ) -> int:
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGUSR1)  # its threads' stacks, to stderr
            time.sleep(1)
            process.kill()
            process.wait()
            pytest.fail(f"{self.name} round={r}: hung\n{_tail(stderr, 20_000)}")

    def check(self, r: int, *, last: bool) -> None:
        logs = Logs.read(self.where)
        loop_ids = dict.fromkeys(line["loop"] for line in logs.loops)
        snapshot = anyio.run(read_store, self.config, loop_ids, backend="asyncio")
        self.snapshots.append(snapshot)
        checks = Checks(self.name, logs, self.snapshots)
        for found in (
            checks.check_effects(r),
            checks.check_requests(r),
            checks.check_decisions(r),
            checks.check_events(r),
            checks.check_results(r),
            checks.check_final(r) if last else iter(()),
        ):
            self.violations.update(dict.fromkeys(found))

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for violation in self.violations:
            counts[violation[:3]] = counts.get(violation[:3], 0) + 1
        rounds = "; ".join(
            f"{n}: {p.mode} kill={p.kill}@{p.delay * 1000:.0f}ms {p.ended} "
            f"{p.seconds:.1f}s"
            for n, p in enumerate(self.rounds)
        )
        return (
            f"{self.name}: {len(self.violations)} violations "
            f"{dict(sorted(counts.items()))}\nrounds: {rounds}\n"
            + "\n".join(self.violations)
        )


def _tail(path: Path, size: int = 3000) -> str:
    return path.read_text()[-size:] if path.exists() else ""


@pytest.mark.timeout(60 + 30 * ROUNDS)
@pytest.mark.parametrize("seed", range(1, SEEDS + 1))
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize(
    "kind", ["sqlite", "sqlite-events", "postgres", "postgres-events"]
)
def test_crash_storm(
    kind: str, backend: str, seed: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    config: dict[str, Any] = {"kind": kind, "backend": backend, "dir": str(tmp_path)}
    if kind.startswith("postgres"):
        server = request.getfixturevalue("postgres_server")
        config["conninfo"] = server.conninfo()
        config["schema"] = f"storm_{uuid.uuid4().hex}"
    else:
        config["path"] = str(tmp_path / "loops.db")
    name = f"seed={seed} store={kind} backend={backend}"
    storm = Storm(
        config, name, random.Random(f"storm {seed} {kind} {backend}"), tmp_path
    )
    storm.run(ROUNDS)
    assert not storm.violations, storm.summary()
