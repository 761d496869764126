"""`PostgresStore` against a real server (tests/postgres_server.py): what only a
store shared by several processes must do. The behaviours every store shares
run on it through `store_factory` in tests/test_durable.py.

- Two runtimes, and two processes, never run one loop: the lease is taken
  under the row's lock, so of two racing for a loop one waits, then sees it.
- A cancelled caller cannot abandon a write; a broken connection is replaced.
- The layout is created at open (by one of several openers), and a layout
  written by newer code is refused.

`python -m tests.test_store_postgres BACKEND CONNINFO SCHEMA` is the child
process of `TestTwoProcesses`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import pytest

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    ModelContext,
    Outcome,
    Runtime,
    UserMessage,
    tool,
)
from agentfsm.exceptions import ConfigurationError
from agentfsm.record import LoopRecord
from agentfsm.store import (
    Lease,
    LeaseLostError,
    LoopLockedError,
    LoopStore,
    MemoryStore,
    StoreError,
    StoreSchemaError,
)
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import wait_until
from tests.postgres_server import PostgresServer, free_port
from tests.store_helpers import commit_of

psycopg = pytest.importorskip("psycopg", reason="pip install 'agentfsm[postgres]'")

from agentfsm.store.postgres import PostgresStore

ROOT = Path(__file__).resolve().parents[1]

GATE: dict[str, anyio.Event] = {}
"""`charge` and `mark` wait on GATE["block"] when it is set."""
RAN: list[str] = []


@tool
async def charge(amount: int) -> str:
    """Charge a card."""
    RAN.append(f"charge {amount}")
    if "block" in GATE:
        await GATE["block"].wait()
    return f"charged {amount}"


@tool(on_crash="retry")
async def mark(tag: str) -> str:
    """Append `tag` and this process's id to the file $MARK_LOG."""
    async with await anyio.open_file(os.environ["MARK_LOG"], "a") as log:
        await log.write(f"{tag} {os.getpid()}\n")
    RAN.append(f"mark {tag}")
    if "block" in GATE:
        await GATE["block"].wait()
    return f"marked {tag}"


@pytest.fixture(autouse=True)
def _clean() -> None:
    GATE.clear()
    RAN.clear()


@pytest.fixture
def conninfo(postgres_server: PostgresServer) -> str:
    return postgres_server.conninfo()


@pytest.fixture
def schema() -> str:
    """A schema of the test's own: its tables are new."""
    return f"t_{uuid.uuid4().hex}"


def mark_the_message(request: InferenceInput) -> InferenceOutput:
    """Call `mark` with the loop's message as the tag."""
    (message,) = request.context.items
    assert isinstance(message, UserMessage)
    return calls(call("mark", tag=str(message.content)))


def request_with(*tools: Any) -> InferenceInput:
    return InferenceInput(model="scripted:m", context=ModelContext(), tools=list(tools))


async def sql(conninfo: str, statement: str, *params: Any) -> list[tuple[Any, ...]]:
    """Run one statement on a connection of its own (autocommit)."""

    def run() -> list[tuple[Any, ...]]:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            cur = conn.execute(statement, params)
            return cur.fetchall() if cur.description is not None else []

    return await anyio.to_thread.run_sync(run)


def store_threads(store: PostgresStore) -> list[threading.Thread]:
    """The store's thread, while it runs (by its name)."""
    name = f"agentfsm-postgres {store.where}"
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


async def a_finished_loop(store: LoopStore) -> LoopRecord:
    """A loop's record, committed by a runtime that has exited."""
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("hi")])}, store=store
    ) as runtime:
        loop_id = runtime.run_loop("agent", "hi", request_with())
        await runtime.wait(loop_id)
    async with store:
        stored = await store.load(loop_id)
    assert stored is not None
    return stored.record


@tool(needs_approval=True)
async def pay(amount: int) -> str:
    """Pay an amount."""
    return f"paid {amount}"


async def an_open_loop(store: LoopStore) -> LoopRecord:
    """A loop's record, paused by a runtime that has exited (no lease)."""
    provider = ScriptedProvider([calls(call("pay", amount=5))])
    async with Runtime(providers={"scripted": provider}, store=store) as runtime:
        loop_id = runtime.run_loop("agent", "pay", request_with(pay))
        await wait_until(lambda: runtime.get(loop_id).status.value == "paused")
    async with store:
        stored = await store.load(loop_id)
    assert stored is not None
    return stored.record


class TestLeases:
    async def test_two_runtimes_never_run_one_loop(
        self, conninfo: str, schema: str
    ) -> None:
        GATE["block"] = anyio.Event()
        async with Runtime(
            providers={
                "scripted": ScriptedProvider(
                    [calls(call("charge", amount=5)), text("done")]
                )
            },
            store=PostgresStore(conninfo, schema=schema),
        ) as first:
            loop_id = first.run_loop("agent", "charge", request_with(charge))
            await wait_until(lambda: "charge 5" in RAN)
            second_store = PostgresStore(conninfo, schema=schema)
            async with Runtime(store=second_store, tools=[charge]) as second:
                report = await second.recover()
                assert second.loops() == []
                stored = await second_store.load(loop_id)
                assert stored is not None
                assert stored.owner == first._keeper.owner  # type: ignore[union-attr]
                intruder = Lease("intruder", stored.epoch)
                with pytest.raises(LeaseLostError, match=loop_id):
                    await second_store.commit(commit_of(stored.record, intruder))
            assert list(report.locked) == [loop_id]
            GATE["block"].set()
            result = await first.wait(loop_id)
        assert result.outcome is Outcome.answered
        assert RAN == ["charge 5"]

    async def test_of_many_racing_for_a_loop_exactly_one_takes_it(
        self, conninfo: str, schema: str
    ) -> None:
        """Eight stores (eight connections) acquire one free loop at once: one
        takes it (epoch 2), the others find it taken."""
        record = await an_open_loop(PostgresStore(conninfo, schema=schema))
        stores = [PostgresStore(conninfo, schema=schema) for _ in range(8)]
        answers: dict[str, Lease | str] = {}

        async def take(n: int, store: PostgresStore) -> None:
            async with store:
                try:
                    answers[f"owner{n}"] = await store.acquire(
                        record.loop_id, f"owner{n}"
                    )
                except LoopLockedError as exc:
                    answers[f"owner{n}"] = exc.owner

        async with anyio.create_task_group() as tg:
            for n, store in enumerate(stores):
                tg.start_soon(take, n, store)
        winners = [o for o, got in answers.items() if isinstance(got, Lease)]
        assert len(winners) == 1, answers
        assert answers[winners[0]] == Lease(winners[0], 2)
        assert {got for got in answers.values() if isinstance(got, str)} == {winners[0]}

    async def test_an_expired_lease_can_be_taken_and_its_old_owner_cannot_write(
        self, conninfo: str, schema: str
    ) -> None:
        store = PostgresStore(conninfo, schema=schema)
        record = await an_open_loop(store)
        async with store, PostgresStore(conninfo, schema=schema) as other:
            mine = await store.acquire(record.loop_id, "a")
            with pytest.raises(LoopLockedError, match=r"\(a\)"):
                await other.acquire(record.loop_id, "b")
            # The lease ran out (by the server's clock, which dates leases).
            await sql(
                conninfo,
                f"UPDATE {schema}.loops SET lease_until ="
                " extract(epoch from clock_timestamp()) - 1",
            )
            loaded = await other.load(record.loop_id)
            assert loaded is not None
            assert loaded.owner is None
            theirs = await other.acquire(record.loop_id, "b")
            assert theirs.epoch == mine.epoch + 1
            with pytest.raises(LeaseLostError, match="b holds it"):
                await store.commit(commit_of(record, mine))
            await other.release("b")
            with pytest.raises(LeaseLostError, match="nobody holds it"):
                await store.commit(commit_of(record, mine))
            loaded = await other.load(record.loop_id)
        assert loaded is not None
        assert (loaded.owner, loaded.epoch) == (None, theirs.epoch)


class TestTwoProcesses:
    async def test_two_processes_recovering_at_once_run_each_loop_once(
        self,
        conninfo: str,
        schema: str,
        tmp_path: Path,
        anyio_backend: str,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """Six loops died in a tool call (`on_crash="retry"`); two processes
        recover the store at the same moment. Each loop's call runs again in
        exactly one of them, and the two reports split the loops."""
        log = tmp_path / "marks.log"
        monkeypatch.setenv("MARK_LOG", str(log))
        GATE["block"] = anyio.Event()
        tags = [f"loop{n}" for n in range(6)]
        with anyio.CancelScope() as scope:
            async with Runtime(
                providers={"scripted": ScriptedProvider([mark_the_message])},
                store=PostgresStore(conninfo, schema=schema),
            ) as dying:
                ids = [dying.run_loop("agent", tag, request_with(mark)) for tag in tags]
                await wait_until(lambda: len(RAN) == 6)
                scope.cancel()  # the process "dies" with every loop in `mark`
        seeded = log.read_text().splitlines()
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-m", "tests.test_store_postgres"]
        args = [anyio_backend, conninfo, schema]
        children = [
            await anyio.open_process([*command, *args], env=env, cwd=ROOT)
            for _ in range(2)
        ]
        reports = []
        try:
            with anyio.fail_after(30):
                for child in children:
                    assert await read_line(child) == "ready"
                for child in children:  # as close together as two writes get
                    assert child.stdin is not None
                    await child.stdin.send(b"go\n")
                for child in children:
                    reports.append(json.loads(await read_line(child)))
                    assert await child.wait() == 0
        finally:
            for child in children:
                if child.returncode is None:
                    child.kill()
                await child.aclose()
        reran = log.read_text().splitlines()[len(seeded) :]
        assert sorted(line.split()[0] for line in reran) == tags  # each once
        running = [set(report["running"]) for report in reports]
        assert running[0].isdisjoint(running[1])
        assert running[0] | running[1] == set(ids)
        assert all(
            report["outcomes"] == ["answered"] * len(report["running"])
            for report in reports
        )


async def read_line(process: anyio.abc.Process) -> str:
    """The next line the child prints."""
    assert process.stdout is not None
    line = b""
    while not line.endswith(b"\n"):
        line += await process.stdout.receive(1)
    return line.decode().strip()


class TestWrites:
    async def test_a_cancelled_commit_still_lands(
        self, conninfo: str, schema: str
    ) -> None:
        """The commit waits on a row lock another connection holds; its caller
        is cancelled meanwhile: the write goes on once the lock is free, and
        the caller sees its cancellation after it."""
        store = PostgresStore(conninfo, schema=schema)
        record = await an_open_loop(store)
        later = record.model_copy(update={"seq": record.seq + 1})
        blocker = await anyio.to_thread.run_sync(psycopg.connect, conninfo)
        try:
            async with store:
                lease = await store.acquire(record.loop_id, "me")
                await anyio.to_thread.run_sync(
                    blocker.execute,
                    f"SELECT 1 FROM {schema}.loops WHERE loop_id = %s FOR UPDATE",
                    (record.loop_id,),
                )
                scope = anyio.CancelScope()

                returned: list[bool] = []

                async def write() -> None:
                    with scope:
                        await store.commit(commit_of(later, lease))
                        returned.append(True)
                        await anyio.lowlevel.checkpoint()  # the cancel, now

                async with anyio.create_task_group() as tg:
                    tg.start_soon(write)
                    await wait_for_a_lock_wait(conninfo)
                    scope.cancel()
                    await anyio.to_thread.run_sync(blocker.rollback)
                assert returned == [True]  # the write ran to its end
                assert scope.cancelled_caught  # and the cancel came after it
                stored = await store.load(record.loop_id)
        finally:
            await anyio.to_thread.run_sync(blocker.close)
        assert stored is not None
        assert stored.record.seq == record.seq + 1

    async def test_a_broken_connection_is_replaced(
        self, conninfo: str, schema: str
    ) -> None:
        store = PostgresStore(conninfo, schema=schema)
        async with store:
            assert await store.unfinished() == []
            await sql(
                conninfo,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend'",
            )
            with pytest.raises(StoreError, match=r"postgresql 127\.0\.0\.1:\d+/"):
                await store.unfinished()
            assert await store.unfinished() == []  # on a new connection

    async def test_a_broken_connection_fails_one_commit_of_a_trip_not_all(
        self, conninfo: str, schema: str
    ) -> None:
        """`commit_many` after the server dropped the connection: the first
        commit meets it (and fails), the next ones go on a new one."""
        records = [await a_finished_loop(MemoryStore()) for _ in range(3)]
        store = PostgresStore(conninfo, schema=schema)
        async with store:
            assert await store.unfinished() == []  # connected
            await sql(
                conninfo,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend'",
            )
            errors = await store.commit_many(
                [commit_of(record, Lease("me", 1), new=True) for record in records]
            )
            assert isinstance(errors[0], StoreError)
            assert errors[1:] == [None, None]
            for record in records[1:]:
                stored = await store.load(record.loop_id)
                assert stored is not None
                assert stored.record.seq == record.seq

    async def test_statistics_count_transactions_and_bytes(
        self, conninfo: str, schema: str
    ) -> None:
        store = PostgresStore(conninfo, schema=schema)
        record = await a_finished_loop(store)
        committed = store.statistics()
        assert committed.commits >= 3  # the transitions, the lease's release
        assert committed.bytes_written > len(record.model_dump_json())
        again = record.model_copy(update={"loop_id": "again"})
        async with store:
            await store.commit(commit_of(again, Lease("me", 1), new=True))
        after = store.statistics()
        assert after.commits == committed.commits + 1
        # What the commit wrote: its log row (the first of its lease: it holds
        # what the lease's records share, and the whole path).
        ((row, shared),) = await sql(
            conninfo,
            f"SELECT length(record) + length(path), length(shared)"
            f" FROM {schema}.log ORDER BY id DESC LIMIT 1",
        )
        assert after.bytes_written == committed.bytes_written + row + shared
        # Less than the record whole: what every record of the run shares
        # is apart, and a path step in one row only.
        assert row < len(record.model_dump_json())


async def wait_for_a_lock_wait(conninfo: str) -> None:
    """Until a backend of the test database waits for a lock."""
    with anyio.fail_after(10):
        while True:  # (the server's state: polled)
            if await sql(
                conninfo,
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock'",
            ):
                return
            await anyio.sleep(0.01)


class TestLayout:
    async def test_several_openers_of_a_new_database_create_it_once(
        self, conninfo: str, schema: str
    ) -> None:
        stores = [PostgresStore(conninfo, schema=schema) for _ in range(4)]
        async with anyio.create_task_group() as tg:
            for store in stores:
                tg.start_soon(store.open)
        for store in stores:
            assert await store.unfinished() == []
            await store.close()
        tables = await sql(
            conninfo,
            "SELECT table_name FROM information_schema.tables"
            " WHERE table_schema = %s ORDER BY table_name",
            schema,
        )
        assert [name for (name,) in tables] == [
            "blobs",
            "breakpoints",
            "contexts",
            "events",
            "log",
            "loops",
            "requests",
            "schema_version",
        ]

    async def test_a_layout_written_by_newer_code_is_refused(
        self, conninfo: str, schema: str
    ) -> None:
        async with PostgresStore(conninfo, schema=schema):
            pass
        await sql(conninfo, f"UPDATE {schema}.schema_version SET version = 99")
        with pytest.raises(StoreSchemaError, match=r"newer agentfsm \(store layout 99"):
            async with Runtime(store=PostgresStore(conninfo, schema=schema)):
                pass

    async def test_a_layout_written_by_earlier_code_is_refused(
        self, conninfo: str, schema: str
    ) -> None:
        """Layout 2 had no fenced leases: this version does not read it (nor
        add its tables to it)."""
        async with PostgresStore(conninfo, schema=schema):
            pass
        await sql(conninfo, f"UPDATE {schema}.schema_version SET version = 2")
        with pytest.raises(
            StoreSchemaError, match=r"earlier agentfsm \(store layout 2"
        ):
            async with Runtime(store=PostgresStore(conninfo, schema=schema)):
                pass

    async def test_an_unreachable_server_is_named(self) -> None:
        port = free_port()  # nothing listens there
        store = PostgresStore(f"host=127.0.0.1 port={port} dbname=loops user=me")
        with pytest.raises(StoreError, match=f"127.0.0.1:{port}/loops"):
            await store.open()
        # Its thread ended with the failed open (none is left behind).
        await wait_until(lambda: not store_threads(store))

    async def test_the_store_runs_in_a_thread_of_its_own(
        self, conninfo: str, schema: str
    ) -> None:
        store = PostgresStore(conninfo, schema=schema)
        async with store:
            (ours,) = store_threads(store)
            assert await store.load("nobody") is None
        ours.join(5)
        assert not ours.is_alive()
        with pytest.raises(StoreError, match="is not open"):
            await store.load("nobody")
        async with store:  # opened again: a new thread
            assert await store.load("nobody") is None
            assert len(store_threads(store)) == 1

    def test_bad_arguments_are_refused_by_name(self) -> None:
        with pytest.raises(ConfigurationError, match="conninfo must be a str"):
            PostgresStore(5)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="conninfo is not a libpq"):
            PostgresStore("host=a port")
        with pytest.raises(ConfigurationError, match="schema must be a lowercase"):
            PostgresStore("", schema='x"; DROP TABLE loops; --')
        with pytest.raises(ConfigurationError, match="lease_ttl must be a positive"):
            PostgresStore("", lease_ttl=0)
        with pytest.raises(ConfigurationError, match="connect_timeout must be"):
            PostgresStore("", connect_timeout="soon")  # type: ignore[arg-type]

    def test_the_password_is_never_in_messages(self) -> None:
        store = PostgresStore("postgresql://me:s3cret@db.internal:5433/loops")
        assert (
            repr(store)
            == "PostgresStore(postgresql db.internal:5433/loops schema agentfsm)"
        )
        assert "s3cret" not in repr(store)


# ------------------------------------------------------------- the child process


async def _child(conninfo: str, schema: str) -> None:
    """Recover the store when told to ("go" on stdin); print what it did."""
    provider = ScriptedProvider([text("done")])  # each loop's next request
    async with Runtime(
        providers={"scripted": provider},
        store=PostgresStore(conninfo, schema=schema),
        tools=[mark],
    ) as runtime:
        print("ready", flush=True)  # noqa: T201 - read by the test
        await anyio.to_thread.run_sync(sys.stdin.readline)
        report = await runtime.recover()
        outcomes = [(await runtime.wait(i)).outcome.value for i in report.running]
    done = {
        "running": report.running,
        "locked": list(report.locked),
        "outcomes": outcomes,
    }
    print(json.dumps(done), flush=True)  # noqa: T201


if __name__ == "__main__":
    backend, conninfo_arg, schema_arg = sys.argv[1:4]
    anyio.run(_child, conninfo_arg, schema_arg, backend=backend)
