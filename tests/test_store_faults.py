"""Store faults: a durable loop whose store fails under it stops in its process
("detached": `loop.detached`, and `wait` and `get` raise `LoopDetachedError`
naming the store and the cause), writes nothing more, and is taken up again
from its last good commit.

Each fault is made for real, during a tool call of the loop (held by a gate):

1. another connection holds SQLite's write lock past `busy_timeout`;
2. the disk is full (a tmpfs this test mounts), or read-only at open;
3. the database file is deleted, or replaced by another file;
4. one loop's stored rows are damaged, among several paused loops;
5. the file is not an agentfsm store (another program's, empty, text, another
   `application_id`);
6. (not a fault) the files a store creates are its owner's only (0600);
7. PostgreSQL drops the store's connection, or restarts;
8. the runtime holding a lease is SIGKILLed, SIGSTOPped, or lives in another
   PID namespace (subprocesses: tests/durable_owner_child.py).

What each asserts beside the clear error is that nothing is lost: the loop
ends `answered` in the store after a recovery, its context well-formed (every
call has one output), no call the ledger held as done ran again, and what
`wait` reported never disagrees with what the store holds.

The loop of most tests (`model`): `add` (call c1), then `gated` (c2, tagged
with the loop's message: `GATES[tag]` makes its fault and holds it), then the
answer "done". `gated` is `on_crash="retry"`: taken up, a loop whose `gated`
call was in flight runs it again, without asking.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
from structlog.typing import EventDict

from agentfsm import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    InferenceOutput,
    LoopResult,
    LoopStatus,
    ModelContext,
    Outcome,
    Proceed,
    Runtime,
    UserMessage,
    current_call,
    tool,
)
from agentfsm.events import LoopDetached
from agentfsm.exceptions import LoopDetachedError
from agentfsm.messages import ContextItem
from agentfsm.providers.function import FunctionProvider
from agentfsm.store import LoopStore, SQLiteStore, StoreError, StoreSchemaError
from agentfsm.testing import EventRecorder, call, calls, text
from tests import durable_owner_child as owner_child
from tests.helpers import assert_one_output_per_call, wait_until
from tests.postgres_server import PostgresServer, a_server

ROOT = Path(__file__).resolve().parents[1]

RAN: list[str] = []
"""`<loop id> <call id>` for each run of a tool's body (of this process)."""


class Gate:
    """What `gated` does in its first run for one tag: the test's fault (in
    the tool), then, if it `holds`, wait until the test releases it."""

    def __init__(
        self, fault: Callable[[], Awaitable[None]] | None = None, *, holds: bool = True
    ) -> None:
        self.fault = fault
        self.holds = holds
        self.entered = anyio.Event()
        self.release = anyio.Event()

    async def run(self) -> None:
        if self.fault is not None:
            await self.fault()
        self.entered.set()
        if self.holds:
            await self.release.wait()

    async def reached(self) -> None:
        with anyio.fail_after(10):
            await self.entered.wait()


GATES: dict[str, Gate] = {}
SIZE: dict[str, int] = {}
"""How many bytes of padding `gated`'s output for a tag carries."""


@pytest.fixture(autouse=True)
def _clean() -> None:
    RAN.clear()
    GATES.clear()
    SIZE.clear()


def ran() -> None:
    running = current_call()
    RAN.append(f"{running.loop_id} {running.call_id}")


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    ran()
    return a + b


@tool(on_crash="retry")
async def gated(tag: str) -> str:
    """Whatever the test set for `tag` (once: a run after a recovery is not
    held), then an output of `SIZE[tag]` bytes more."""
    ran()
    gate = GATES.pop(tag, None)
    if gate is not None:
        await gate.run()
    return f"{tag} done" + "x" * SIZE.get(tag, 0)


@tool(needs_approval=True)
async def pay(amount: int) -> str:
    """Pay an amount (approved first)."""
    ran()
    return f"paid {amount}"


TOOLS = [add, gated, pay]


def model(request: InferenceInput) -> InferenceOutput:
    """A loop's script, from its message and the outputs its context holds
    (so any runtime goes on with any loop): `add` (c1), then `gated` tagged
    with the message (c2), or `pay` (c2) for a message `pay ...`; then the
    answer."""
    items = request.context.items
    first = items[0]
    assert isinstance(first, UserMessage)
    message = str(first.content)
    outputs = sum(isinstance(i, FunctionCallOutputItem) for i in items)
    if outputs == 0:
        return calls(call("add", call_id="c1", a=1, b=2))
    if outputs == 1:
        if message.startswith("pay"):
            return calls(call("pay", call_id="c2", amount=5))
        return calls(call("gated", call_id="c2", tag=message))
    return text("done")


def runtime_on(store: LoopStore) -> Runtime:
    return Runtime(
        providers={"faults": FunctionProvider(model)}, store=store, tools=TOOLS
    )


def start(runtime: Runtime, message: str = "t") -> str:
    return runtime.run_loop(
        "agent",
        message,
        InferenceInput(model="faults:m", context=ModelContext(), tools=TOOLS),
    )


async def finished(runtime: Runtime, loop_id: str) -> LoopResult:
    with anyio.fail_after(20):
        return await runtime.wait(loop_id)


async def detached_at(runtime: Runtime, gate: Gate) -> tuple[str, LoopDetachedError]:
    """Start a loop, let it reach the tool's gate, and see it detached there
    (see `detached`): its id and the error."""
    recorder = EventRecorder(runtime.bus)
    loop_id = start(runtime)
    await gate.reached()
    return loop_id, await detached(runtime, recorder, loop_id)


async def detached(
    runtime: Runtime, recorder: EventRecorder, loop_id: str
) -> LoopDetachedError:
    """The loop stopped here without ending: `wait` and `get` say why, with
    the store's error; `loop.detached` was published once, `loop.idle` not."""
    with anyio.fail_after(20), pytest.raises(LoopDetachedError) as caught:
        await runtime.wait(loop_id)
    error = caught.value
    with pytest.raises(LoopDetachedError) as again:
        runtime.get(loop_id)
    assert str(again.value) == str(error)
    assert error.loop_id == loop_id
    assert isinstance(error.cause, StoreError), error
    assert str(error.cause) in str(error)
    events = recorder.of_loop(loop_id)
    (event,) = [e for e in events if isinstance(e, LoopDetached)]
    assert event.reason == error.reason
    assert event.error_type == type(error.cause).__name__
    assert "loop.idle" not in [e.type for e in events]
    return error


async def held_unfinished(store: LoopStore, loop_id: str) -> set[str]:
    """What the store holds of a loop `wait` did not see end: unfinished
    (never ended, as `wait` said); returns the calls its ledger holds done."""
    async with store:
        stored = await store.load(loop_id)
        ledger = await store.calls(loop_id)
    assert stored is not None
    assert stored.record.status is not LoopStatus.done
    assert stored.record.outcome is None
    assert_one_output_per_call_or_in_flight(stored.items)
    return {c.call_id for c in ledger if c.status == "done"}


def assert_one_output_per_call_or_in_flight(items: Sequence[ContextItem]) -> None:
    """At most one output per call, none without its call."""
    called = Counter(i.call_id for i in items if isinstance(i, FunctionCallItem))
    answered = Counter(
        i.call_id for i in items if isinstance(i, FunctionCallOutputItem)
    )
    assert all(n == 1 for n in called.values()), called
    assert all(called[c] == 1 and n == 1 for c, n in answered.items()), items


async def recovered_elsewhere(store: LoopStore, loop_id: str) -> LoopResult:
    """A new runtime on `store` takes the loop up (its `gated` call was in
    flight: it runs again) and runs it to its end."""
    async with runtime_on(store) as runtime:
        report = await runtime.recover()
        assert report.running == [loop_id], report
        assert (report.paused, report.failed, report.locked) == ([], {}, {})
        return await finished(runtime, loop_id)


async def assert_answered(
    store: LoopStore, loop_id: str, result: LoopResult, done_before: set[str]
) -> None:
    """The loop ended `answered`, in the store as `wait` said; its context is
    well-formed; its ledger holds every call done; a call the ledger held
    done before the fault ran once."""
    async with store:
        stored = await store.load(loop_id)
        ledger = await store.calls(loop_id)
    assert result.outcome is Outcome.answered, result
    assert stored is not None
    record = stored.record
    assert (record.status, record.outcome) == (LoopStatus.done, Outcome.answered)
    assert (record.answer, record.path) == (result.answer, result.path)
    assert result.answer is not None
    assert result.answer.content == "done"
    assert_one_output_per_call(stored.items)
    called = [i.call_id for i in stored.items if isinstance(i, FunctionCallItem)]
    assert [c.call_id for c in ledger] == called
    assert {c.status for c in ledger} == {"done"}
    runs = Counter(RAN)
    for call_id in done_before:
        assert runs[f"{loop_id} {call_id}"] == 1, (call_id, RAN)
    assert runs[f"{loop_id} c1"] == 1  # `add` ended before every fault


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


# --------------------------------------------------------------- 1. busy


@pytest.mark.parametrize("where", ["this runtime", "a new runtime"])
async def test_a_write_lock_held_past_busy_timeout_detaches_the_loop(
    tmp_path: Path, where: str
) -> None:
    """Another connection holds the write lock (`BEGIN IMMEDIATE`) while the
    loop's tool runs: the commit that carries the tool's output waits
    `busy_timeout` (0.2 s) and fails; the loop is detached, naming the file
    and the lock; released, the loop is taken up (by the same runtime, or a
    new one) and ends answered."""
    path = tmp_path / "loops.db"
    gate = GATES["t"] = Gate()
    async with runtime_on(SQLiteStore(path, busy_timeout=0.2)) as runtime:
        recorder = EventRecorder(runtime.bus)
        loop_id = start(runtime)
        await gate.reached()
        blocker = sqlite3.connect(path, isolation_level=None)
        try:
            blocker.execute("BEGIN IMMEDIATE")
            gate.release.set()
            error = await detached(runtime, recorder, loop_id)
        finally:
            if blocker.in_transaction:
                blocker.execute("ROLLBACK")
            blocker.close()
        message = str(error)
        assert f"{path}: database is locked" in message
        assert "held its write lock for longer than busy_timeout (0.2s)" in message
        done_before = await held_unfinished(SQLiteStore(path), loop_id)
        assert done_before == {"c1"}
        if where == "this runtime":
            report = await runtime.recover()
            assert report.running == [loop_id], report
            result = await finished(runtime, loop_id)
    if where == "a new runtime":
        result = await recovered_elsewhere(SQLiteStore(path), loop_id)
    await assert_answered(SQLiteStore(path), loop_id, result, done_before)
    assert Counter(RAN)[f"{loop_id} c2"] == 2  # in flight at the fault: again


# ------------------------------------------------------- 2. disk full, ro


@dataclass
class Tmpfs:
    """A tmpfs this test mounted (unmounted at its end)."""

    path: Path

    def remount(self, options: str) -> None:
        subprocess.run(
            ["mount", "-o", f"remount,{options}", str(self.path)],
            check=True,
            capture_output=True,
        )


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    """A 1 MiB tmpfs (root only: skipped where mounting is not permitted)."""
    point = tmp_path / "tmpfs"
    point.mkdir()
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mount/umount are not installed")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here: {(done.stderr or done.stdout).strip()}"
        )
    try:
        yield Tmpfs(point)
    finally:
        # Lazily if it is busy: a file of it still open in this process (the
        # `-owners` file a runtime leaves open, for one).
        umount = subprocess.run(
            ["umount", str(point)], capture_output=True, check=False
        )
        if umount.returncode != 0:
            subprocess.run(["umount", "-l", str(point)], check=True)


async def test_a_full_disk_detaches_the_loop_and_more_room_recovers_it(
    tmpfs: Tmpfs,
) -> None:
    """The tool's output (2 MiB) does not fit on the 1 MiB filesystem: its
    commit fails "database or disk is full", naming the file; the
    filesystem grown, a new runtime takes the loop up and it ends answered."""
    path = tmpfs.path / "loops.db"
    SIZE["t"] = 2 << 20
    gate = GATES["t"] = Gate(holds=False)
    async with runtime_on(SQLiteStore(path)) as runtime:
        loop_id, error = await detached_at(runtime, gate)
        assert f"{path}: database or disk is full" in str(error)
        assert "no space is left on the file's disk" in str(error)
        tmpfs.remount("size=64m")
        done_before = await held_unfinished(SQLiteStore(path), loop_id)
        assert done_before == {"c1"}
    result = await recovered_elsewhere(SQLiteStore(path), loop_id)
    await assert_answered(SQLiteStore(path), loop_id, result, done_before)
    assert Counter(RAN)[f"{loop_id} c2"] == 2


async def test_a_read_only_filesystem_is_refused_at_open_naming_it(
    tmpfs: Tmpfs, tmp_path: Path
) -> None:
    """A store (a loop paused in it) on a filesystem remounted read-only: its
    open fails, naming the file and saying it is read-only, and changes
    nothing; a new file there cannot be created. Writable again, the store
    opens and the paused loop goes on to its end.

    The store is made elsewhere and copied in: a runtime that used a store
    keeps its `-owners` file open after it exits (see
    `test_a_runtime_that_exited_holds_none_of_its_store_s_files_open`), and
    the kernel refuses to remount read-only a filesystem with a file open for
    writing. For that reason too, read-only *mid-run* cannot be made here:
    the store's database, -wal and -shm are open for writing while it runs
    (`mount point is busy`)."""
    made = tmp_path / "made" / "loops.db"
    made.parent.mkdir()
    async with runtime_on(SQLiteStore(made)) as runtime:
        loop_id = start(runtime, "pay 5")
        await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
    path = tmpfs.path / "loops.db"
    shutil.copyfile(made, path)
    before, files = digest(path), siblings(path)
    tmpfs.remount("ro")
    try:
        with pytest.raises(StoreError) as caught:
            async with runtime_on(SQLiteStore(path)):
                pass
        with pytest.raises(StoreError) as new:
            async with runtime_on(SQLiteStore(tmpfs.path / "new.db")):
                pass
    finally:
        tmpfs.remount("rw")
    assert (digest(path), siblings(path)) == (before, files)
    assert str(tmpfs.path / "new.db") in str(new.value)
    assert "Read-only file system" in str(new.value)
    assert str(path) in str(caught.value)
    assert "read-only" in str(caught.value), caught.value
    async with runtime_on(SQLiteStore(path)) as runtime:
        report = await runtime.recover()
        assert report.paused == [loop_id]
        runtime.resume(loop_id, Proceed())
        result = await finished(runtime, loop_id)
    await assert_answered(SQLiteStore(path), loop_id, result, {"c1"})


# ---------------------------------------------------- 3. deleted, replaced


async def test_a_database_deleted_mid_run_detaches_the_loop(tmp_path: Path) -> None:
    """The tool deletes the database file: the next write notices, the loop
    is detached saying so, and nothing the runtime did after the deletion
    counts as stored: `wait` reports no end, and a store opened at the path
    (while the runtime still runs, and after) holds nothing of the loop and
    works."""
    path = tmp_path / "loops.db"

    async def delete() -> None:
        path.unlink()

    gate = GATES["t"] = Gate(delete, holds=False)
    async with runtime_on(SQLiteStore(path)) as runtime:
        loop_id, error = await detached_at(runtime, gate)
        assert f"{path}: the database file was deleted or replaced" in str(error)
        await a_fresh_store_at(path, loop_id)
    await a_fresh_store_at(path, loop_id)
    assert Counter(RAN)[f"{loop_id} c2"] == 1


async def a_fresh_store_at(path: Path, loop_id: str) -> None:
    """A store opened at `path` knows no loop `loop_id`, and runs a new loop
    to its end."""
    async with runtime_on(SQLiteStore(path)) as runtime:
        report = await runtime.recover()
        assert loop_id not in report.recovered
        assert loop_id not in report.failed
        new = start(runtime, "fresh")
        assert (await finished(runtime, new)).outcome is Outcome.answered
    async with SQLiteStore(path) as store:
        assert await store.load(loop_id) is None


async def test_a_database_replaced_mid_run_is_left_as_it_was_put(
    tmp_path: Path,
) -> None:
    """The tool replaces the database file with another agentfsm store (one
    loop of its own, ended): the loop is detached saying so, and nothing the
    first store wrote reaches the file put in its place: after the runtime
    exits, a store opened on it holds what it held (its own loop, answered;
    not this loop), and the file is unchanged."""
    path = tmp_path / "loops.db"
    other = tmp_path / "other.db"
    async with runtime_on(SQLiteStore(other)) as runtime:
        theirs = start(runtime, "theirs")
        assert (await finished(runtime, theirs)).outcome is Outcome.answered
    put: list[str] = []

    async def replace() -> None:
        os.replace(other, path)
        put.append(digest(path))

    gate = GATES["t"] = Gate(replace, holds=False)
    async with runtime_on(SQLiteStore(path)) as runtime:
        loop_id, error = await detached_at(runtime, gate)
        assert f"{path}: the database file was deleted or replaced" in str(error)
    assert digest(path) == put[0]  # the old runtime wrote nothing into it
    async with SQLiteStore(path) as store:
        held = {
            "unfinished": await store.unfinished(),
            "theirs": await outcome_of(store, theirs),
            "this loop": await outcome_of(store, loop_id),
        }
    assert held == {"unfinished": [], "theirs": "answered", "this loop": None}


async def outcome_of(store: LoopStore, loop_id: str) -> str | None:
    """How the store holds a loop: its outcome, or its status (None: not)."""
    stored = await store.load(loop_id)
    if stored is None:
        return None
    record = stored.record
    return record.status.value if record.outcome is None else record.outcome.value


# ------------------------------------------------------ 4. a damaged loop

USER_ITEM = UserMessage(content="x").model_dump_json()

DAMAGES = {
    "a record that is not JSON": (
        "UPDATE log SET record = '{\"path\": 3,' WHERE id = (SELECT max(id) FROM"
        " log WHERE loop_id = :loop AND record IS NOT NULL)"
    ),
    "a changes value that is not JSON": (
        "UPDATE log SET changes = 'not json' WHERE id = (SELECT min(id) FROM log"
        " WHERE loop_id = :loop AND changes IS NOT NULL)"
    ),
    "a changes value replacing a slot the context lacks": (
        'UPDATE log SET changes = \'{"first": 0, "truncate": false, "items": [],'
        f' "replaced": [[99, {USER_ITEM}]], "inference": null}}\''
        " WHERE id = (SELECT min(id) FROM log WHERE loop_id = :loop"
        " AND changes IS NOT NULL)"
    ),
    "a ledger entry too short": (
        'UPDATE log SET ledger = \'[["done", "k"]]\' WHERE loop_id = :loop'
        " AND ledger IS NOT NULL"
    ),
    "a ledger entry that is an object": (
        'UPDATE log SET ledger = \'[{"status": "done"}]\' WHERE loop_id = :loop'
        " AND ledger IS NOT NULL"
    ),
    "a ledger entry of no known status": (
        'UPDATE log SET ledger = \'[["lost", "k", 1, 0, "add", "c1", 1, null,'
        " false, null]]' WHERE loop_id = :loop AND ledger IS NOT NULL"
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
async def test_a_damaged_loop_is_reported_and_the_others_recovered(
    tmp_path: Path, damage: str
) -> None:
    """Three loops paused for approval (after a call each); the middle one's
    rows damaged with plain SQL. `recover()` reports it in `failed`, naming
    it, the file and the cause, leaves its rows as they are (and its lease
    free: a second `recover()` reports it again), and takes up the other two,
    which go on to their ends."""
    path = tmp_path / "loops.db"
    async with runtime_on(SQLiteStore(path)) as runtime:
        loops = [start(runtime, f"pay {n}") for n in range(3)]
        await wait_until(
            lambda: all(runtime.get(i).status is LoopStatus.paused for i in loops)
        )
    damaged = loops[1]
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute(DAMAGES[damage], {"loop": damaged})
        assert db.total_changes >= 1
    rows = log_rows(path, damaged)
    async with runtime_on(SQLiteStore(path)) as runtime:
        report = await runtime.recover()
        assert list(report.failed) == [damaged], report
        cause = report.failed[damaged]
        assert damaged in cause
        assert str(path) in cause
        assert "cannot be read" in cause
        assert report.paused == [loops[0], loops[2]]
        assert (report.running, report.locked) == ([], {})
        for loop_id in report.paused:
            runtime.resume(loop_id, Proceed())
        results = [await finished(runtime, loop_id) for loop_id in report.paused]
        again = await runtime.recover()
        assert list(again.failed) == [damaged]
        assert (again.recovered, again.locked) == ([], {})
    for loop_id, result in zip(report.paused, results, strict=True):
        await assert_answered(SQLiteStore(path), loop_id, result, {"c1"})
        assert Counter(RAN)[f"{loop_id} c2"] == 1
    assert log_rows(path, damaged) == rows


def log_rows(path: Path, loop_id: str) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = db.execute(
            "SELECT * FROM log WHERE loop_id = ? ORDER BY id", (loop_id,)
        ).fetchall()
        (status,) = db.execute(
            "SELECT status FROM loops WHERE loop_id = ?", (loop_id,)
        ).fetchone()
    return [*rows, status]


# ------------------------------------------------------- 5. foreign files


def another_program_s(path: Path, *, wal: bool = False, view: bool = False) -> None:
    db = sqlite3.connect(path)
    with db:
        if wal:
            db.execute("PRAGMA journal_mode=WAL")
        if view:
            db.execute("CREATE VIEW answer AS SELECT 42 AS value")
        else:
            db.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
            db.executemany(
                "INSERT INTO customers (name) VALUES (?)", [("ada",), ("alan",)]
            )
    db.close()


def another_application_s(path: Path) -> None:
    db = sqlite3.connect(path)
    with db:
        db.execute("PRAGMA application_id=1234")
    db.close()


FOREIGN: dict[str, Callable[[Path], object]] = {
    "another program's database": another_program_s,
    "another program's database in WAL mode": lambda p: another_program_s(p, wal=True),
    "another program's database of views only": lambda p: another_program_s(
        p, view=True
    ),
    "a database of another application_id": another_application_s,
    "a short text file": lambda p: p.write_text("hello\n"),
    "a text file": lambda p: p.write_text("notes\n" * 1000),
}


@pytest.mark.parametrize("kind", list(FOREIGN))
async def test_a_foreign_file_is_refused_and_left_as_it_was(
    tmp_path: Path, kind: str
) -> None:
    """A file that is not an agentfsm store is refused at open
    (`StoreSchemaError`, naming it), byte for byte unchanged, and nothing is
    left beside it (no -wal, -shm, -journal or -owners)."""
    path = tmp_path / "theirs.db"
    FOREIGN[kind](path)
    before, files = digest(path), siblings(path)
    with pytest.raises(StoreSchemaError) as caught:
        async with runtime_on(SQLiteStore(path)):
            pass
    assert str(path) in str(caught.value)
    assert (digest(path), siblings(path)) == (before, files)


async def test_an_empty_file_becomes_a_store(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.touch()
    async with runtime_on(SQLiteStore(path)) as runtime:
        loop_id = start(runtime)
        result = await finished(runtime, loop_id)
    await assert_answered(SQLiteStore(path), loop_id, result, set())


# ------------------------------------------------------------ 6. modes


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask 022", "umask 000"])
async def test_a_store_s_files_are_its_owner_s_only(tmp_path: Path, umask: int) -> None:
    """The database, its -wal and -shm, and the -owners lock file are created
    0600, whatever the umask."""
    path = tmp_path / "loops.db"
    names = ("loops.db", "loops.db-wal", "loops.db-shm", "loops.db-owners")
    gate = GATES["t"] = Gate()
    previous = os.umask(umask)
    try:
        async with runtime_on(SQLiteStore(path)) as runtime:
            loop_id = start(runtime)
            await gate.reached()
            modes = {n: oct((tmp_path / n).stat().st_mode & 0o777) for n in names}
            gate.release.set()
            result = await finished(runtime, loop_id)
    finally:
        os.umask(previous)
    assert modes == dict.fromkeys(names, oct(0o600))
    left = [n for n in names if (tmp_path / n).exists()]
    assert {n: oct((tmp_path / n).stat().st_mode & 0o777) for n in left} == (
        dict.fromkeys(left, oct(0o600))
    )
    await assert_answered(SQLiteStore(path), loop_id, result, set())


def open_files(prefix: Path) -> list[str]:
    """The files this process has open whose path starts with `prefix`."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile (the listing's own)
        if target.startswith(str(prefix)):
            found.append(target)
    return sorted(found)


async def test_a_runtime_that_exited_holds_none_of_its_store_s_files_open(
    tmp_path: Path,
) -> None:
    """Once its runtime has exited (and closed its store), the process holds
    none of the store's files open: not the database, its -wal and -shm, nor
    the `-owners` lock file (a descriptor of it kept for the process's life
    leaks one per store file, keeps its filesystem from being unmounted or
    remounted read-only, and, once the file is removed, takes this process's
    later presence locks on a file nobody else can see: see
    `test_a_live_owner_s_lease_is_waited_out_after_its_lock_file_was_removed`)."""
    path = tmp_path / "loops.db"
    async with runtime_on(SQLiteStore(path)) as runtime:
        assert await finished(runtime, start(runtime)) is not None
    assert open_files(path) == []


# -------------------------------------------------------- 7. PostgreSQL

PASSWORD = "pw-" + uuid.uuid4().hex
"""Given in every conninfo below (the test server trusts 127.0.0.1: libpq
sends it only if asked, but the store has it): never in a message."""


def pg_conninfo(server: PostgresServer, app: str) -> str:
    return f"{server.conninfo()} password={PASSWORD} application_name={app}"


async def pg_sql(conninfo: str, statement: str, *params: Any) -> list[Any]:
    import psycopg

    def run() -> list[Any]:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            cur = conn.execute(statement, params)
            return cur.fetchall() if cur.description is not None else []

    return await anyio.to_thread.run_sync(run)


async def backends(server: PostgresServer, app: str) -> list[int]:
    """The pids of the server's backends of the application `app`."""
    rows = await pg_sql(
        server.conninfo(),
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
        app,
    )
    return [int(pid) for (pid,) in rows]


def assert_no_password(error: BaseException, logs: list[EventDict]) -> None:
    assert PASSWORD not in str(error)
    assert PASSWORD not in repr(error.__dict__)
    assert PASSWORD not in repr(logs)


@pytest.mark.parametrize(
    "fault",
    [
        "connection terminated",
        # (A server of its own, started and restarted: subprocesses.)
        pytest.param("server restarted", marks=pytest.mark.e2e),
    ],
)
async def test_postgres_losing_the_connection_detaches_the_loop(
    request: pytest.FixtureRequest, log_output: list[EventDict], fault: str
) -> None:
    """From the loop's tool, the server ends the store's connection
    (`pg_terminate_backend`), or restarts (`pg_ctl restart`, a server of this
    module's own): the next write fails, the loop is detached with an error
    naming the server (never the password); the same runtime then takes it
    up on a new connection, and it ends answered."""
    pytest.importorskip("psycopg", reason="pip install 'agentfsm[postgres]'")
    from agentfsm.store.postgres import PostgresStore

    server: PostgresServer = request.getfixturevalue(
        "postgres_server" if fault == "connection terminated" else "private_postgres"
    )
    app = f"faults-{uuid.uuid4().hex[:12]}"
    schema = f"t_{uuid.uuid4().hex}"
    conninfo = pg_conninfo(server, app)

    def store() -> PostgresStore:
        return PostgresStore(conninfo, schema=schema)

    first: list[int] = []

    async def terminate() -> None:
        first.extend(await backends(server, app))
        assert len(first) == 1, first
        await pg_sql(
            server.conninfo(), "SELECT pg_terminate_backend(%s, 10000)", first[0]
        )

    async def restart() -> None:
        first.extend(await backends(server, app))
        await anyio.to_thread.run_sync(restart_server, server)

    gate = GATES["t"] = Gate(
        terminate if fault == "connection terminated" else restart, holds=False
    )
    async with runtime_on(store()) as runtime:
        loop_id, error = await detached_at(runtime, gate)
        where = f"postgresql 127.0.0.1:{server.port}/agentfsm_test schema {schema}"
        assert str(error.cause).startswith(where), error
        done_before = await held_unfinished(store(), loop_id)
        assert done_before == {"c1"}
        report = await runtime.recover()
        assert report.running == [loop_id], report
        result = await finished(runtime, loop_id)
        now = await backends(server, app)
        assert now
        assert not set(now) & set(first)  # a new connection
    assert_no_password(error, log_output)
    await assert_answered(store(), loop_id, result, done_before)


@pytest.fixture(scope="module")
def private_postgres() -> Iterator[PostgresServer]:
    """A server of this module's own, to restart (the session's is shared)."""
    yield from a_server()


def restart_server(server: PostgresServer) -> None:
    """Stop the server and start it again, on the same port and with the same
    settings (`-w`: it is up when this returns)."""
    server._run(
        "pg_ctl",
        "restart",
        "-m",
        "fast",
        "-w",
        "-t",
        "60",
        "-D",
        str(server.data),
        "-l",
        str(server.log),
    )


# ----------------------------------------------------------- 8. liveness

CHILD_MODULE = "tests.durable_owner_child"


@dataclass
class Child:
    """A child process holding a loop in its tool."""

    process: subprocess.Popen[bytes]
    stderr: Path
    loop_id: str = ""

    @property
    def pid(self) -> int:
        return self.process.pid

    def line(self, timeout: float = 30) -> str:
        """Its next line on stdout (blocking: run it in a thread)."""
        stdout = self.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout
        data = b""
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([stdout], [], [], left)[0]:
                raise AssertionError(f"no line from the child: {self.errors()}")
            chunk = os.read(stdout.fileno(), 1)
            if not chunk:
                raise AssertionError(f"the child exited: {self.errors()}")
            data += chunk
        return data.decode().strip()

    async def next_line(self) -> str:
        return await anyio.to_thread.run_sync(self.line)

    def errors(self) -> str:
        return self.stderr.read_text()[-3000:] if self.stderr.exists() else ""

    def tell(self, line: str) -> None:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(line.encode() + b"\n")
        stdin.flush()

    def end(self) -> None:
        """Make sure it is gone (and reaped)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


def spawn(config: dict[str, Any], where: Path, *, namespace: bool = False) -> Child:
    command = [sys.executable, "-m", CHILD_MODULE, json.dumps(config)]
    if namespace:
        command = [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child=SIGKILL",
            *command,
        ]
    stderr = where / f"child-{uuid.uuid4().hex[:8]}.err"
    with stderr.open("wb") as errors:
        process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            start_new_session=True,  # its own group: `end` kills all of it
        )
    return Child(process, stderr)


def state_of(pid: int) -> str | None:
    """A process's state letter (`Z`: its main thread ended, not reaped), None
    if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # (being reaped: ESRCH)
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def dead(pid: int) -> bool:
    """Whether every thread of the process has exited (it may not be reaped:
    a zombie). Its main thread turns zombie while the others may still be
    exiting, holding the files they share (and their locks): the zombie must
    be its only thread left."""
    state = state_of(pid)
    if state is None:
        return True
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z" and threads == [str(pid)]


def children_of(pid: int) -> list[int]:
    """The pids of a process's children."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


async def until(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll `predicate` until it holds (10 s at most)."""
    with anyio.move_on_after(10) as scope:
        while not await predicate():  # noqa: ASYNC110 - another process's state
            await anyio.sleep(0.005)
    if scope.cancelled_caught:
        raise AssertionError(f"not within 10 s: {what}")


def namespaces_work() -> str | None:
    """Why `unshare --pid` cannot be used here (None: it can)."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return f"unshare --pid --fork --mount-proc fails here: {done.stderr.strip()}"
    return None


@dataclass
class Owned:
    """The store a child runs its loop on, as the test sees it."""

    kind: str
    config: dict[str, Any]
    server: PostgresServer | None
    app: str

    def store(self) -> LoopStore:
        return owner_child.open_store(self.config)

    async def connection_gone(self, pids: list[int]) -> bool:
        """(PostgreSQL) the child's backends (`pids`) have ended, and hold no
        lock (its presence: an advisory lock) any more."""
        assert self.server is not None
        if await backends(self.server, self.app):
            return False
        rows = await pg_sql(
            self.server.conninfo(),
            "SELECT count(*) FROM pg_locks WHERE pid = ANY(%s)",
            pids,
        )
        return bool(rows[0][0] == 0)


def make_owned(
    kind: str, tmp_path: Path, backend: str, server: PostgresServer | None = None
) -> Owned:
    effects = tmp_path / "effects"
    owner_child.STATE.update(effects=str(effects), holds=False)
    app = f"owner-{uuid.uuid4().hex[:12]}"
    config: dict[str, Any] = {"kind": kind, "backend": backend, "effects": str(effects)}
    if server is not None:
        config["conninfo"] = f"{server.conninfo()} application_name={app}"
        config["schema"] = f"t_{uuid.uuid4().hex}"
    else:
        config["path"] = str(tmp_path / "loops.db")
    return Owned(kind, config, server, app)


@pytest.fixture(params=["sqlite", "postgres"])
def owned(request: pytest.FixtureRequest, tmp_path: Path, anyio_backend: str) -> Owned:
    server = None
    if request.param == "postgres":
        server = request.getfixturevalue("postgres_server")
    return make_owned(request.param, tmp_path, anyio_backend, server)


def effects_of(owned: Owned) -> list[str]:
    path = Path(owned.config["effects"])
    return path.read_text().splitlines() if path.exists() else []


def owner_runtime(store: LoopStore) -> Runtime:
    return Runtime(
        providers={"owner": FunctionProvider(owner_child.model)},
        store=store,
        tools=[owner_child.hold],
    )


async def child_in_tool(owned: Owned, tmp_path: Path, *, namespace: bool) -> Child:
    child = spawn(owned.config, tmp_path, namespace=namespace)
    word, _, loop_id = (await child.next_line()).partition(" ")
    assert word == "in-tool", child.errors()
    child.loop_id = loop_id
    return child


async def assert_ended_once(owned: Owned, loop_id: str, runs: int) -> None:
    """The loop ended answered, its one call done after `runs` runs (in any
    process), and no runtime finds it unfinished."""
    async with owned.store() as store:
        stored = await store.load(loop_id)
        (entry,) = await store.calls(loop_id)
        assert await store.unfinished() == []
    assert stored is not None
    assert (stored.record.status, stored.record.outcome) == (
        LoopStatus.done,
        Outcome.answered,
    )
    assert_one_output_per_call(stored.items)
    assert (entry.status, entry.attempt) == ("done", runs)
    assert len(effects_of(owned)) == runs


@pytest.mark.e2e
async def test_a_killed_owner_s_lease_is_taken_at_once(
    owned: Owned, tmp_path: Path
) -> None:
    """The child holding the loop's lease (60 s) is SIGKILLed in its tool:
    before it is reaped (SQLite: a zombie; PostgreSQL: once the server has
    ended its connection), a new runtime's `recover()` takes the loop at once
    (not `locked`): its call in flight runs again, and it ends answered."""
    await killed_and_taken(owned, tmp_path, namespace=False)


@pytest.mark.e2e
async def test_a_killed_owner_in_another_pid_namespace_is_taken_at_once(
    tmp_path: Path, anyio_backend: str
) -> None:
    """The same, the child in a PID namespace of its own (SQLite: its pid
    there, 1, is a live process's here; its lock on `-owners` is what tells)."""
    if (why := namespaces_work()) is not None:
        pytest.skip(why)
    owned = make_owned("sqlite", tmp_path, anyio_backend)
    await killed_and_taken(owned, tmp_path, namespace=True)


async def killed_and_taken(owned: Owned, tmp_path: Path, *, namespace: bool) -> None:
    child = await child_in_tool(owned, tmp_path, namespace=namespace)
    try:
        victim = child.pid
        if namespace:  # the namespace's first process: unshare's child
            (victim,) = children_of(child.pid)
        if owned.server is not None:
            pids = await backends(owned.server, owned.app)
            assert pids
        os.kill(victim, signal.SIGKILL)

        async def gone() -> bool:
            return dead(victim)

        await until(gone, "the child died")
        if owned.server is not None:

            async def ended() -> bool:
                return await owned.connection_gone(pids)

            await until(ended, "the server ended its connection")
        elif not namespace:
            assert state_of(victim) == "Z"  # not reaped: its lease is taken anyway
        async with owner_runtime(owned.store()) as runtime:
            report = await runtime.recover()
            assert report.running == [child.loop_id], report
            assert (report.paused, report.locked, report.failed) == ([], {}, {})
            result = await finished(runtime, child.loop_id)
        assert result.outcome is Outcome.answered
    finally:
        child.end()
    await assert_ended_once(owned, child.loop_id, runs=2)


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["stopped", "in another pid ns"])
async def test_a_live_owner_s_lease_is_waited_out(
    owned: Owned, tmp_path: Path, how: str
) -> None:
    """The child holding the loop's lease is alive: SIGSTOPped, or running in
    another PID namespace. A new runtime's `recover()` reports the loop
    `locked` by the child's runtime and runs nothing; the child, continued
    and let go, ends the loop answered, once."""
    namespace = how == "in another pid ns"
    if namespace and (why := namespaces_work()) is not None:
        pytest.skip(why)
    child = await child_in_tool(owned, tmp_path, namespace=namespace)
    try:
        if how == "stopped":
            os.kill(child.pid, signal.SIGSTOP)

            async def stopped() -> bool:
                return state_of(child.pid) == "T"

            await until(stopped, "the child stopped")
        async with owner_runtime(owned.store()) as runtime:
            report = await runtime.recover()
            assert list(report.locked) == [child.loop_id], report
            assert (report.recovered, report.failed) == ([], {})
            holder = report.locked[child.loop_id]
            host, pid, _ = holder.rsplit(":", 2)
            assert host == socket.gethostname()
            if namespace:
                assert int(pid) != child.pid  # its pid in its own namespace
            else:
                assert int(pid) == child.pid
        if how == "stopped":
            os.kill(child.pid, signal.SIGCONT)
        child.tell("go")
        assert await child.next_line() == "ended answered", child.errors()
        assert await anyio.to_thread.run_sync(child.process.wait) == 0
    finally:
        child.end()
    await assert_ended_once(owned, child.loop_id, runs=1)


@pytest.mark.e2e
async def test_a_live_owner_s_lease_is_waited_out_after_its_lock_file_was_removed(
    tmp_path: Path, anyio_backend: str
) -> None:
    """The child ran a runtime on the SQLite store and exited it; then the
    store's `-owners` file was removed (a clean-up of lock files, a reset of
    the store's files); the child's next runtime holds the loop in its tool.
    It is alive: another process's `recover()` reports the loop `locked` and
    runs nothing (taking it would run the call in flight a second time,
    beside the first)."""
    owned = make_owned("sqlite", tmp_path, anyio_backend)
    owned.config["reopen"] = True
    child = await child_in_tool(owned, tmp_path, namespace=False)
    try:
        async with owner_runtime(owned.store()) as runtime:
            report = await runtime.recover()
            assert list(report.locked) == [child.loop_id], report
            assert (report.recovered, report.failed) == ([], {})
        child.tell("go")
        assert await child.next_line() == "ended answered", child.errors()
        assert await anyio.to_thread.run_sync(child.process.wait) == 0
    finally:
        child.end()
    await assert_ended_once(owned, child.loop_id, runs=1)
