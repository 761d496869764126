"""`agentfsm loops STORE`: a durable store's loops, read without touching the
store; and what it stands on, `SQLiteStore(read_only=True)` and `loops()`.

The stores are made by real runtimes on scripted providers: a loop that
answered after a tool call, one paused for approval as its runtime exited, and
one running in a live runtime (its owner and lease shown). The command runs in
this process (`agentfsm.cli.main`), in a worker thread where a test's own event
loop is running (the command runs one of its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

from agentfsm import (
    LoopStatus,
    Outcome,
    Pause,
    PendingTransition,
    Runtime,
    TokenUsage,
    Trigger,
    tool,
)
from agentfsm.cli import main
from agentfsm.exceptions import ConfigurationError
from agentfsm.store import MemoryStore, SQLiteStore, StoredLoopSummary, StoreError
from agentfsm.store._base import LoopStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import request, wait_until


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool(needs_approval=True)
async def pay(amount: int) -> str:
    """Pay an amount."""
    return f"paid {amount}"


def counter_ids() -> Callable[[], str]:
    ids = iter(range(1, 100))
    return lambda: f"loop-{next(ids)}"


def providers(**more: ScriptedProvider) -> dict[str, ScriptedProvider]:
    """`answers:` adds 2 and 3, then answers; `pays:` asks to pay 5."""
    return {
        "answers": ScriptedProvider(
            [
                calls(
                    call("add", call_id="c1", a=2, b=3),
                    usage=TokenUsage(input_tokens=20, output_tokens=5),
                ),
                text("5", usage=TokenUsage(input_tokens=30, output_tokens=6)),
            ]
        ),
        "pays": ScriptedProvider([calls(call("pay", call_id="c1", amount=5))]),
        **more,
    }


async def fill(store: LoopStore) -> None:
    """loop-1 (calculator) answers after a call of `add`; loop-2 (payer) is
    paused for approval of `pay` when its runtime exits."""
    async with Runtime(providers=providers(), store=store, ids=counter_ids()) as rt:
        done = rt.run_loop("calculator", "2+3?", request(add, model="answers:m"))
        await rt.wait(done)
        paused = rt.run_loop("payer", "pay 5", request(pay, model="pays:m"))
        await wait_until(lambda: rt.get(paused).status is LoopStatus.paused)


@pytest.fixture(autouse=True)
def _logs_off_stdout(log_output: list[Any]) -> None:
    """The runtimes these tests start log through structlog, whose default
    prints to stdout, where the command's output is read: their lines are
    captured instead (`log_output`), whenever they come."""


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """A SQLite store holding loop-1 (done) and loop-2 (paused)."""
    path = tmp_path / "loops.db"
    anyio.run(fill, SQLiteStore(path))
    return path


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> dict[str, list[str]]:
    """The table's rows by loop id, cut into cells (two spaces or more apart)."""
    return {
        cells[0]: cells
        for line in out.splitlines()[1:-1]
        for cells in [re.split(r" {2,}", line.strip())]
    }


AGE = re.compile(r"\d+s|\d+m(\d+s)?")


class TestTable:
    def test_every_loop_with_its_status_totals_and_detail(
        self, db: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A line per loop: id, agent, status, state, turns, tool calls,
        tokens, ages, and what the status says (outcome; pause reason and the
        calls it waits on)."""
        code, out, err = cli(capsys, "loops", str(db))
        assert (code, err) == (0, "")
        lines = out.splitlines()
        assert lines[0].split() == [
            "LOOP",
            "AGENT",
            "STATUS",
            "STATE",
            "TURNS",
            "TOOLS",
            "TOKENS",
            "STARTED",
            "SINCE",
            "DETAIL",
        ]
        assert lines[-1] == "2 loops (1 paused, 1 done)"
        found = rows(out)
        done, paused = found["loop-1"], found["loop-2"]
        assert done[1:7] == ["calculator", "done", "idle", "2", "1", "61"]
        assert done[-1] == "answered"
        assert paused[1:6] == ["payer", "paused", "inference", "1", "0"]
        assert paused[-1] == "approval required: pay; calls: pay"
        for cells in (done, paused):
            assert AGE.fullmatch(cells[7]), cells
            assert AGE.fullmatch(cells[8]), cells

    @pytest.mark.parametrize(
        ("filters", "listed", "total"),
        [
            pytest.param(
                ["--status", "paused"], ["loop-2"], "1 loop (1 paused)", id="paused"
            ),
            pytest.param(
                ["--status", "done"], ["loop-1"], "1 loop (1 done)", id="done"
            ),
            pytest.param(["--status", "running"], [], "0 loops", id="running"),
            pytest.param(
                ["--agent", "calculator"], ["loop-1"], "1 loop (1 done)", id="agent"
            ),
            pytest.param(
                ["--agent", "payer", "--status", "done"], [], "0 loops", id="both"
            ),
        ],
    )
    def test_filters(
        self,
        db: Path,
        capsys: pytest.CaptureFixture[str],
        filters: list[str],
        listed: list[str],
        total: str,
    ) -> None:
        """`--status` and `--agent` keep the loops that match both."""
        code, out, _ = cli(capsys, "loops", str(db), *filters)
        assert code == 0
        assert list(rows(out)) == listed
        assert out.splitlines()[-1] == total

    def test_a_bad_status_is_refused_by_the_parser(
        self, db: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`--status` takes running, paused or done."""
        with pytest.raises(SystemExit) as exc:
            main(["loops", str(db), "--status", "stuck"])
        assert exc.value.code == 2
        assert "invalid choice: 'stuck'" in capsys.readouterr().err


class TestJson:
    def test_one_document_a_list_of_the_loops(
        self, db: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`--json`: a list, each loop's summary with full ids, ISO times and
        ages in seconds; each validates as a `StoredLoopSummary`."""
        code, out, _ = cli(capsys, "loops", str(db), "--json")
        assert code == 0
        document = json.loads(out)
        assert isinstance(document, list)
        fields = set(StoredLoopSummary.model_fields)
        summaries = [
            StoredLoopSummary.model_validate(
                {k: v for k, v in d.items() if k in fields}
            )
            for d in document
        ]
        done, paused = summaries
        assert (done.loop_id, done.status, done.outcome) == (
            "loop-1",
            LoopStatus.done,
            Outcome.answered,
        )
        assert (done.model_requests, done.tool_calls) == (2, 1)
        assert done.usage.total_tokens == 61
        assert (document[0]["total_tokens"], document[0]["usage_status"]) == (
            61,
            "complete",
        )
        assert done.ended_at is not None
        assert done.started_at <= done.ended_at
        assert (paused.status, paused.pause_reason, paused.pending_calls) == (
            LoopStatus.paused,
            "approval required: pay",
            ("pay",),
        )
        # The runtime gave its leases up as it exited.
        assert (paused.owner, paused.lease_live) == (None, False)
        for data in document:
            assert set(data) == fields | {
                "age_seconds",
                "status_age_seconds",
                "total_tokens",
                "unreadable",
                "usage_status",
            }
            assert data["unreadable"] is None
            started = datetime.fromisoformat(data["started_at"])
            since_start = (datetime.now(UTC) - started).total_seconds()
            # (rounded to milliseconds: up to half of one past the exact age)
            assert 0 <= data["age_seconds"] <= since_start + 0.001
            assert data["status_age_seconds"] >= 0
            assert datetime.fromisoformat(data["started_at"]).tzinfo is not None

    def test_filtered_to_nothing_is_an_empty_list(
        self, db: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        code, out, _ = cli(capsys, "loops", str(db), "--json", "--status", "running")
        assert (code, json.loads(out)) == (0, [])


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_reading_changes_nothing(db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`loops` and `inspect` leave the store's file byte for byte as it was,
    and add no file but SQLite's empty WAL beside it."""
    before = files(db.parent)
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    for args in (
        ["loops", str(db)],
        ["loops", str(db), "--json"],
        ["inspect", str(db)],
        ["inspect", str(db), "--loop", "loop-2"],
    ):
        assert cli(capsys, *args)[0] == 0
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    after = files(db.parent)
    assert set(before) <= set(after)  # nothing removed either
    for name, data in after.items():
        if name not in before:
            assert name in (f"{db.name}-wal", f"{db.name}-shm"), name
            if name.endswith("-wal"):
                assert data == b""
        else:
            assert data == before[name], name


async def test_a_running_loop_shows_its_owner_and_lease(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A loop a live runtime runs: its owner (this host and process) and how
    long its lease has left; reading took no lease (the loop goes on and
    ends)."""
    started, release = anyio.Event(), anyio.Event()

    @tool(name="hold")
    async def hold() -> str:
        """Wait until the test lets go."""
        started.set()
        await release.wait()
        return "held"

    path = tmp_path / "loops.db"
    holds = ScriptedProvider([calls(call("hold", call_id="c1")), text("let go")])
    async with Runtime(
        providers=providers(holds=holds), store=SQLiteStore(path), ids=counter_ids()
    ) as runtime:
        loop_id = runtime.run_loop("holder", "hold", request(hold, model="holds:m"))
        with anyio.fail_after(10):
            await started.wait()
        code = await anyio.to_thread.run_sync(main, ["loops", str(path)])
        out, _ = capsys.readouterr()
        code_json = await anyio.to_thread.run_sync(main, ["loops", str(path), "--json"])
        document = json.loads(capsys.readouterr()[0])
        release.set()
        with anyio.fail_after(10):
            result = await runtime.wait(loop_id)
        args = ["loops", str(path), "--json"]
        assert await anyio.to_thread.run_sync(main, args) == 0
        [ended] = json.loads(capsys.readouterr()[0])
    assert (code, code_json) == (0, 0)
    cells = rows(out)["loop-1"]
    assert cells[1:4] == ["holder", "running", "function_call"]
    owner = f"{socket.gethostname()}:{os.getpid()}:"
    assert re.fullmatch(rf"owner {re.escape(owner)}\S+, lease \d+s left", cells[-1]), (
        cells
    )
    [summary] = document
    assert summary["owner"].startswith(owner)
    assert summary["lease_live"] is True
    assert datetime.fromisoformat(summary["lease_until"]) > datetime.now(UTC)
    assert result.outcome is Outcome.answered  # its runtime kept its lease
    # An ended loop holds no lease, though its runtime lives on.
    assert (ended["status"], ended["lease_until"], ended["lease_live"]) == (
        "done",
        None,
        False,
    )


async def test_stored_text_reaches_the_terminal_printable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An agent id and a pause reason holding terminal escapes and newlines
    are printed escaped, each on its line."""

    def gate(pending: PendingTransition) -> Pause | None:
        if pending.trigger is Trigger.call_tools:
            return Pause("wait\x1b]0;pwned\x07\nfor \u202eme")
        return None

    path = tmp_path / "loops.db"
    async with Runtime(providers=providers(), store=SQLiteStore(path)) as runtime:
        loop_id = runtime.run_loop(
            "evil\x1b[2J", "2+3?", request(add, model="answers:m"), gate
        )
        await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
    code = await anyio.to_thread.run_sync(main, ["loops", str(path)])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "\x1b" not in out
    assert "\u202e" not in out
    assert "\x07" not in out
    [line] = out.splitlines()[1:-1]
    assert "evil\\x1b[2J" in line
    assert "wait\\x1b]0;pwned\\x07 for \\u202eme; calls: add" in line


class TestErrors:
    def test_a_missing_file_is_not_created(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        missing = tmp_path / "nope.db"
        code, out, err = cli(capsys, "loops", str(missing))
        assert (code, out) == (1, "")
        assert f"{missing}: no such file" in err
        assert list(tmp_path.iterdir()) == []

    @pytest.mark.parametrize(
        ("content", "says"),
        [
            pytest.param(
                b"\x89PNG\r\n\x1a\n" + bytes(200), "is not a SQLite database", id="png"
            ),
            pytest.param(b'{"event_id":"x"}\n', "is not a SQLite database", id="log"),
        ],
    )
    def test_a_file_that_is_no_store(
        self,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        content: bytes,
        says: str,
    ) -> None:
        """Exit 1, naming the file and what it is not; the file is unchanged."""
        path = tmp_path / "thing"
        path.write_bytes(content)
        code, out, err = cli(capsys, "loops", str(path))
        assert (code, out) == (1, "")
        assert f"agentfsm loops: error: {path} {says}" in err
        assert path.read_bytes() == content

    def test_another_program_s_sqlite_file(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        import sqlite3

        path = tmp_path / "other.db"
        with sqlite3.connect(path) as other:
            other.execute("CREATE TABLE notes (text)")
        other.close()
        code, _, err = cli(capsys, "loops", str(path))
        assert code == 1
        assert f"{path} is not an agentfsm store (SQLite application_id 0" in err


class TestReadOnlyStore:
    async def test_it_refuses_to_be_a_runtime_s_store(self, db: Path) -> None:
        """A runtime on a read-only store fails at once, saying why, and makes
        no presence file beside it."""
        owners = db.parent / f"{db.name}-owners"
        owners.unlink()  # (the runtime that made the store left it)
        with pytest.raises(StoreError, match="opened with read_only=True"):
            async with Runtime(store=SQLiteStore(db, read_only=True)):
                pass
        assert not owners.exists()

    async def test_it_refuses_writes_and_leases(self, db: Path) -> None:
        async with SQLiteStore(db, read_only=True) as store:
            with pytest.raises(StoreError, match=r"read_only=True"):
                await store.acquire("loop-2", "someone")
            assert [s.loop_id for s in await store.loops()] == ["loop-1", "loop-2"]
            loaded = await store.load("loop-2")
            assert loaded is not None
            assert loaded.record.status is LoopStatus.paused

    async def test_bad_filters(self, db: Path) -> None:
        async with SQLiteStore(db, read_only=True) as store:
            with pytest.raises(ConfigurationError, match="status must be one of"):
                await store.loops(status="stuck")
            with pytest.raises(ConfigurationError, match="agent_id must be a str"):
                await store.loops(agent_id=3)  # type: ignore[arg-type]


async def test_a_memory_store_lists_its_loops_too() -> None:
    """`MemoryStore.loops` gives the summaries the SQL stores give."""
    store = MemoryStore()
    await fill(store)
    done, paused = await store.loops()
    assert (done.loop_id, done.outcome, done.usage.total_tokens) == (
        "loop-1",
        Outcome.answered,
        61,
    )
    assert (paused.pending_calls, paused.status_since is not None) == (("pay",), True)
    assert [s.loop_id for s in await store.loops(status="paused")] == ["loop-2"]
    assert await store.loops(agent_id="nobody") == []


@pytest.fixture
def postgres_url(request: pytest.FixtureRequest) -> tuple[str, str]:
    """A PostgreSQL URL of the session's server, and a schema of this test's."""
    server: Any = request.getfixturevalue("postgres_server")
    url = f"postgresql://agentfsm@127.0.0.1:{server.port}/agentfsm_test"
    return url, f"t_{uuid.uuid4().hex}"


@pytest.mark.e2e
async def test_a_postgres_store_by_its_url(
    postgres_url: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`loops postgresql://...`: the same table and JSON as for SQLite; a
    schema holding no store is an error, and is not created."""
    from agentfsm.store.postgres import PostgresStore

    url, schema = postgres_url
    await fill(PostgresStore(url, schema=schema))
    code = await anyio.to_thread.run_sync(main, ["loops", url, "--schema", schema])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    found = rows(out)
    assert found["loop-1"][1:7] == ["calculator", "done", "idle", "2", "1", "61"]
    assert found["loop-2"][-1] == "approval required: pay; calls: pay"
    args = ["loops", url, "--schema", schema, "--json", "--status", "paused"]
    assert await anyio.to_thread.run_sync(main, args) == 0
    [paused] = json.loads(capsys.readouterr()[0])
    assert (paused["loop_id"], paused["pending_calls"]) == ("loop-2", ["pay"])
    empty = f"t_{uuid.uuid4().hex}"
    code = await anyio.to_thread.run_sync(main, ["loops", url, "--schema", empty])
    assert code == 1
    assert f"holds no agentfsm store (no schema_version table in schema {empty})" in (
        capsys.readouterr().err
    )
    with pytest.raises(StoreError, match="holds no agentfsm store"):
        async with PostgresStore(url, schema=empty, read_only=True):
            pass


# ------------------------------------------------------- issue 27, review fixes


def spoil(db: Path, loop_id: str) -> None:
    """Make the latest record of `loop_id` data no agentfsm wrote."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        (row,) = conn.execute(
            "SELECT max(id) FROM log WHERE record IS NOT NULL AND id BETWEEN"
            " (SELECT number << 32 FROM loops WHERE loop_id = ?)"
            " AND (SELECT (number << 32) + 4294967295 FROM loops WHERE loop_id = ?)",
            (loop_id, loop_id),
        ).fetchone()
        conn.execute("UPDATE log SET record = ? WHERE id = ?", ('{"garbage":1}', row))


class TestUnreadableLoop:
    def test_listed_as_unreadable_the_others_all_the_same(
        self, db: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        spoil(db, "loop-1")
        code, out, err = cli(capsys, "loops", str(db))
        assert (code, err) == (0, "")
        found = rows(out)
        assert found["loop-2"][2] == "paused"
        assert found["loop-1"][1:9] == ["-"] * 8
        assert found["loop-1"][9].startswith(
            "unreadable: the stored data of loop loop-1 cannot be read (KeyError"
        )
        assert out.splitlines()[-1] == "2 loops (1 paused, 1 unreadable)"
        code, out, _ = cli(capsys, "loops", str(db), "--json")
        unreadable = [d for d in json.loads(out) if d["unreadable"] is not None]
        assert [d["loop_id"] for d in unreadable] == ["loop-1"]
        assert set(unreadable[0]) == {"loop_id", "unreadable"}

    def test_inspect_of_a_healthy_loop_reads_that_loop_only(
        self, db: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        spoil(db, "loop-1")
        code, out, err = cli(capsys, "inspect", str(db), "--loop", "loop-2")
        assert (code, err) == (0, "")
        assert "paused in inference" in out
        code, _, err = cli(capsys, "inspect", str(db), "--loop", "loop-1")
        assert code == 1
        assert "the stored data of loop loop-1 cannot be read" in err

    async def test_the_store_raises_without_a_list_to_fill(self, db: Path) -> None:
        spoil(db, "loop-1")
        async with SQLiteStore(db, read_only=True) as store:
            with pytest.raises(StoreError, match="loop loop-1 cannot be read"):
                await store.loops()
            assert await store.loop_ids() == ["loop-1", "loop-2"]
            [only] = await store.loops(loop_id="loop-2")
            assert only.status is LoopStatus.paused


class TestMessages:
    def test_a_directory(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        code, _, err = cli(capsys, "loops", str(tmp_path))
        assert code == 1
        assert f"{tmp_path} is a directory: give the store's file" in err

    def test_an_earlier_layout_says_so_as_a_writer_does(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        import sqlite3

        path = tmp_path / "old.db"
        with contextlib.closing(sqlite3.connect(path)) as conn, conn:
            conn.execute("CREATE TABLE loops (loop_id TEXT)")
            conn.execute("PRAGMA user_version = 3")
        code, _, err = cli(capsys, "loops", str(path))
        assert code == 1
        assert f"{path} was written by an earlier agentfsm (store layout 3" in err
        with pytest.raises(
            StoreError, match="written by an earlier agentfsm"
        ) as caught:
            anyio.run(SQLiteStore(path).__aenter__)
        assert str(caught.value) in err

    @pytest.mark.skipif(os.geteuid() == 0, reason="root writes any directory")
    def test_a_directory_this_user_cannot_write(
        self, db: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        for extra in ("-wal", "-shm"):
            db.with_name(db.name + extra).unlink(missing_ok=True)
        db.parent.chmod(0o555)
        try:
            code, _, err = cli(capsys, "loops", str(db))
        finally:
            db.parent.chmod(0o755)
        assert code == 1
        assert f"SQLite needs to create {db}-shm" in err
        assert "read_only=True" not in err

    def test_a_diagram_of_a_stored_loop(
        self, db: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        code, out, err = cli(capsys, "diagram", "--events", str(db), "--loop", "loop-1")
        assert (code, err) == (0, "")
        assert 'title: "loop loop-1 (calculator): answered"' in out
        assert "inference --> function_call: call_tools (#3)" in out


async def test_no_read_is_held_between_listings(db: Path) -> None:
    """Between two listings the reader holds nothing: a writer's checkpoint
    empties the WAL (what a reader in a read transaction prevents)."""
    import sqlite3

    async with SQLiteStore(db, read_only=True) as store:
        await store.loops()
        with contextlib.closing(sqlite3.connect(db)) as writer:
            writer.execute("PRAGMA user_version")  # (opened in WAL mode)
            with writer:
                writer.execute("UPDATE loops SET updated = updated")
            busy, _, _ = writer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        assert busy == 0
        assert db.with_name(db.name + "-wal").stat().st_size == 0
        await store.loops()


async def test_an_unresponsive_postgres_server_times_out_clearly() -> None:
    """A server that accepts and never answers: the connect times out with a
    message saying what to check, and no password."""
    pytest.importorskip("psycopg")
    from agentfsm.store.postgres import PostgresStore

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        store = PostgresStore(
            f"postgresql://u:secret@127.0.0.1:{port}/db",
            connect_timeout=1,
            read_only=True,
        )
        with pytest.raises(StoreError) as caught:
            async with store:
                pass
    message = str(caught.value)
    assert "no answer within connect_timeout, 1s" in message
    assert "secret" not in message
