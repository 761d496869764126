"""`PostgresStore`: durable loops in a PostgreSQL database that several
processes share (`pip install 'agentfsm[postgres]'`, psycopg 3).

psycopg's `AsyncConnection` runs on asyncio only, so the store uses psycopg's
sync API in a thread of its own (`_thread.StoreThread`, from `open` to
`close`, as the SQLite store does), and runs on asyncio and trio alike: one
connection, used from that thread only, its calls in the order they come. One
connection, not a pool, because
the store's callers rely on the order in which they issue operations: the
runtime wakes `wait()` before the loop's last save has landed, and a `load`
issued after it must still see that save; `release`, when a runtime exits,
must land after every commit of its loops. A pool runs them side by side, in
any order (a `load` read the record before the final one). With one
connection, operations apply in the order they were issued. Concurrency
between runtimes is the server's: each process has its own connection.

Every write is one transaction. A cancelled caller cannot abandon a write: the
thread runs it to the end (commit or rollback), and the cancellation is
delivered after it.

Two runtimes never run one loop. A lease is a row's `owner` and `lease_until`,
dated by the server's clock (runtimes on hosts whose clocks differ agree on
when it expires). A commit is one statement, a call of the store's
`commit_loop` function (one round trip, one transaction): it takes or renews
the lease in the upsert of the loop's row (`INSERT ... ON CONFLICT DO UPDATE
... WHERE` the lease is free, expired or ours), which holds the row's lock
until the transaction ends, and writes nothing else when the lease is
another's. `acquire` takes it under `SELECT ... FOR UPDATE`. So of two
runtimes racing for one loop, one waits for the other's transaction and then
sees its lease. The other writes are single statements too (autocommit, no
BEGIN/COMMIT round trips), except `acquire` (a transaction of two). Measured here (a ~4 KB
record, a local server): ~0.25 ms per commit with `synchronous_commit=off`,
~0.4 ms with the server's defaults (fsync on); the SQLite store's is ~0.12 ms.

The tables live in one PostgreSQL schema (`schema="agentfsm"` by default;
another name keeps several stores in one database apart), created at open if
missing, with a `schema_version` table checked at open: a layout written by
newer code is refused (`StoreSchemaError`). How durable a commit is follows
the server's `synchronous_commit` (on by default: a committed transition
survives the server crashing); `options='-c synchronous_commit=off'` in the
conninfo trades the last commits of a server crash for speed, as SQLite's
`durability="normal"` does.

A connection that breaks (the server restarted) is dropped, and the next
operation opens a new one; the operation that met the break raises
`StoreError` (it is not retried: its transaction may or may not have
committed).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, Final, TypeVar

import anyio

from agentfsm.exceptions import ConfigurationError
from agentfsm.inference import InferenceOutput
from agentfsm.messages import ContextItem, ContextItemAdapter, FunctionCallOutputItem
from agentfsm.record import LoopRecord
from agentfsm.results import LoopStatus

from ._base import (
    CallRecord,
    Commit,
    LoopIdTakenError,
    LoopLockedError,
    LoopStore,
    StoredLoop,
    StoreError,
    StoreSchemaError,
    StoreStatistics,
    checked_lease_ttl,
    commits_in_turn,
)
from ._rows import Paths, path_of, record_of, shared_text
from ._thread import StoreThread

try:
    import psycopg
    import psycopg.errors
    from psycopg.conninfo import conninfo_to_dict
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "agentfsm.store.postgres needs psycopg 3: pip install 'agentfsm[postgres]'"
    ) from exc

__all__ = ("PostgresStore",)

_T = TypeVar("_T")
_Conn = psycopg.Connection[Any]

_LAYOUT: Final = 2
"""The layout this store writes (its `schema_version` table). Layout 1 kept
each record whole, its path too; it is not read."""

_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")

_TABLES = """
CREATE TABLE IF NOT EXISTS {s}.loops (
    loop_id text PRIMARY KEY,
    agent_id text NOT NULL,
    status text NOT NULL,
    state text NOT NULL,
    seq bigint NOT NULL,
    owner text,
    lease_until timestamptz,
    updated timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS loops_unfinished ON {s}.loops (loop_id)
    WHERE status <> 'done';
CREATE INDEX IF NOT EXISTS loops_owner ON {s}.loops (owner)
    WHERE owner IS NOT NULL;
-- Each record once, as it was written (a recovered loop's record of a seq
-- written before is a later row): its text holds its path's length, its row
-- the path's steps since the loop's row before it, and (the first row of a
-- run) what the run's records share (see agentfsm.store._rows).
CREATE TABLE IF NOT EXISTS {s}.records (
    id bigserial PRIMARY KEY,
    loop_id text NOT NULL,
    seq bigint NOT NULL,
    record text NOT NULL,
    path_from integer NOT NULL,
    path text NOT NULL,
    shared text
);
CREATE INDEX IF NOT EXISTS records_loop ON {s}.records (loop_id, seq, id);
CREATE TABLE IF NOT EXISTS {s}.items (
    loop_id text NOT NULL,
    position integer NOT NULL,
    item text NOT NULL,
    PRIMARY KEY (loop_id, position)
);
CREATE TABLE IF NOT EXISTS {s}.inferences (
    loop_id text NOT NULL,
    request integer NOT NULL,
    output text NOT NULL,
    PRIMARY KEY (loop_id, request)
);
CREATE TABLE IF NOT EXISTS {s}.calls (
    key text PRIMARY KEY,
    loop_id text NOT NULL,
    request integer NOT NULL,
    position integer NOT NULL,
    tool text NOT NULL,
    call_id text NOT NULL,
    status text NOT NULL,
    attempt integer NOT NULL,
    output text,
    terminate boolean NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS calls_request ON {s}.calls (loop_id, request);
CREATE TABLE IF NOT EXISTS {s}.contexts (
    context_id text NOT NULL,
    position integer NOT NULL,
    item text NOT NULL,
    digest text NOT NULL,
    PRIMARY KEY (context_id, position)
);
-- A commit in one statement (one round trip; a statement is one transaction):
-- the lease check, the loop's row, its record, the context's new items, a
-- recorded model output. Returns NULL when written, else (and writes nothing)
-- 'held:' and the lease's holder, 'stale:' when the rows continue the
-- caller's run (p_shared NULL) and another runtime took the loop since, or
-- 'taken:' when a new loop's id (p_new) is a loop's the store holds.
CREATE OR REPLACE FUNCTION {s}.commit_loop(
    p_loop_id text, p_agent_id text, p_status text, p_state text, p_seq bigint,
    p_owner text, p_ttl float8, p_shared text, p_record text, p_path_from integer,
    p_path text, p_first integer, p_items text[],
    p_replaced_at integer[], p_replaced text[], p_request integer, p_output text,
    p_earlier_seq bigint[], p_earlier text[], p_earlier_path_from integer[],
    p_earlier_path text[],
    p_intent_key text[], p_intent_request integer[], p_intent_position integer[],
    p_intent_tool text[], p_intent_call text[],
    p_ended_key text[], p_ended_output text[], p_ended_terminate boolean[],
    p_new boolean
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    holder text;
BEGIN
    IF p_new AND EXISTS (SELECT 1 FROM {s}.loops WHERE loop_id = p_loop_id) THEN
        RETURN 'taken:';  -- a new loop's id is another loop's
    END IF;
    IF p_shared IS NULL THEN
        -- The rows continue the caller's run: only if no other runtime took
        -- the loop since (the row lock, until the transaction ends, keeps any
        -- from taking it now).
        SELECT owner INTO holder FROM {s}.loops WHERE loop_id = p_loop_id FOR UPDATE;
        IF NOT FOUND OR holder IS DISTINCT FROM p_owner THEN
            RETURN 'stale:';
        END IF;
    END IF;
    -- The upsert takes the row's lock (until the transaction ends): every
    -- writer of this loop waits here, then sees this one's lease.
    INSERT INTO {s}.loops AS l (loop_id, agent_id, status, state, seq, owner,
        lease_until, updated)
    VALUES (p_loop_id, p_agent_id, p_status, p_state, p_seq, p_owner,
        clock_timestamp() + p_ttl * interval '1 second', clock_timestamp())
    ON CONFLICT (loop_id) DO UPDATE SET status = EXCLUDED.status,
        state = EXCLUDED.state, seq = EXCLUDED.seq, owner = EXCLUDED.owner,
        lease_until = EXCLUDED.lease_until, updated = EXCLUDED.updated
    WHERE l.owner IS NULL OR l.owner = EXCLUDED.owner
        OR l.lease_until <= clock_timestamp();
    IF NOT FOUND THEN
        SELECT owner INTO holder FROM {s}.loops WHERE loop_id = p_loop_id;
        RETURN 'held:' || coalesce(holder, '?');
    END IF;
    -- The records of the transitions since the last write, then this one's,
    -- in this order (each row's path steps follow the row before); the first
    -- holds what a run shares, if this one starts a run.
    FOR i IN 1 .. coalesce(array_length(p_earlier, 1), 0) LOOP
        INSERT INTO {s}.records (loop_id, seq, record, path_from, path, shared)
        VALUES (p_loop_id, p_earlier_seq[i], p_earlier[i], p_earlier_path_from[i],
            p_earlier_path[i], CASE WHEN i = 1 THEN p_shared END);
        p_shared := NULL;
    END LOOP;
    INSERT INTO {s}.records (loop_id, seq, record, path_from, path, shared)
    VALUES (p_loop_id, p_seq, p_record, p_path_from, p_path, p_shared);
    -- The ledger: intents of the calls this transition starts, outputs of the
    -- calls ended since the last write.
    INSERT INTO {s}.calls (key, loop_id, request, position, tool, call_id, status,
        attempt, output, terminate)
    SELECT c.key, p_loop_id, c.request, c.position, c.tool, c.call_id, 'started', 1,
        NULL, false
    FROM unnest(p_intent_key, p_intent_request, p_intent_position, p_intent_tool,
        p_intent_call) AS c(key, request, position, tool, call_id)
    ON CONFLICT (key) DO NOTHING;
    UPDATE {s}.calls AS c SET status = 'done', output = e.output,
        terminate = e.terminate
    FROM unnest(p_ended_key, p_ended_output, p_ended_terminate)
        AS e(key, output, terminate)
    WHERE c.key = e.key;
    -- A loop recovered from an earlier commit writes its tail again.
    DELETE FROM {s}.items WHERE loop_id = p_loop_id AND position >= p_first;
    INSERT INTO {s}.items (loop_id, position, item)
    SELECT p_loop_id, p_first + n - 1, item
    FROM unnest(p_items) WITH ORDINALITY AS t(item, n);
    UPDATE {s}.items AS i SET item = r.item
    FROM unnest(p_replaced_at, p_replaced) AS r(at, item)
    WHERE i.loop_id = p_loop_id AND i.position = r.at;
    IF p_request IS NOT NULL THEN
        INSERT INTO {s}.inferences (loop_id, request, output)
        VALUES (p_loop_id, p_request, p_output)
        ON CONFLICT (loop_id, request) DO UPDATE SET output = EXCLUDED.output;
    END IF;
    RETURN NULL;
END
$$;
CREATE TABLE IF NOT EXISTS {s}.schema_version (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    version integer NOT NULL
);
"""

_RETRIED = (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected)
"""Errors after which a transaction is run again: it was rolled back whole."""


CALL_COLUMNS: Final = (
    "key, loop_id, request, position, tool, call_id, status, attempt, output, terminate"
)
"""The `calls` table's columns, in the order `call_of_row` reads."""


def intent_bytes(intents: Sequence[CallRecord]) -> int:
    """What the store counts as written for ledger intents."""
    return sum(len(c.key) + len(c.tool) + len(c.call_id) for c in intents)


def call_of_row(row: Sequence[Any]) -> CallRecord:
    """A `calls` row (`CALL_COLUMNS`; output is JSON
    or NULL)."""
    key, loop_id, request, position, tool, call_id, status, attempt, out, term = row
    return CallRecord(
        key=key,
        loop_id=loop_id,
        request=request,
        position=position,
        tool=tool,
        call_id=call_id,
        status=status,
        attempt=attempt,
        output=None if out is None else FunctionCallOutputItem.model_validate_json(out),
        terminate=bool(term),
    )


class PostgresStore(LoopStore):
    """Durable loops in a PostgreSQL database, shared by several processes.

    ```python
    from agentfsm.store.postgres import PostgresStore

    store = PostgresStore("host=db.internal dbname=app user=agents")
    async with Runtime(store=store, tools=[charge]) as runtime:
        await runtime.recover()  # the loops no live runtime owns
    ```

    Args:
        conninfo: a libpq connection string or URI (`"host=... dbname=..."`,
            `"postgresql://user@host/db"`); empty: libpq's defaults and `PG*`
            environment variables.
        schema: the PostgreSQL schema holding the store's tables (created if
            missing): lowercase letters, digits and `_`.
        lease_ttl: seconds a runtime's lease on a loop lasts unless renewed.
        connect_timeout: seconds to wait for a connection.

    Raises:
        ConfigurationError: (at once) an argument is not usable.
        StoreSchemaError: (at open) the schema was written by a newer agentfsm.
        StoreError: (at open and after) the server could not be reached, or
            failed an operation.
    """

    def __init__(
        self,
        conninfo: str = "",
        *,
        schema: str = "agentfsm",
        lease_ttl: float = 30.0,
        connect_timeout: float = 10.0,
    ) -> None:
        if not isinstance(conninfo, str):
            raise ConfigurationError(
                f"conninfo must be a str, got {type(conninfo).__name__}"
            )
        try:
            params = conninfo_to_dict(conninfo)
        except psycopg.ProgrammingError as exc:
            raise ConfigurationError(
                f"conninfo is not a connection string: {exc}"
            ) from None
        _check_schema(schema)
        _check_positive("connect_timeout", connect_timeout)
        self.conninfo = conninfo
        self.schema = schema
        self.lease_ttl = checked_lease_ttl(lease_ttl)
        self._connect_timeout = max(1, round(connect_timeout))  # libpq: whole seconds
        self._where = _describe(params, schema)
        self._sql = _Statements(f'"{schema}"')
        self._conn: _Conn | None = None
        self._thread = StoreThread(f"agentfsm-postgres {self._where}")
        self._opened: object | None = None
        """Set while the store is open (a new object at each `open`)."""
        self._counted = threading.Lock()
        self._paths = Paths()
        """What this store wrote of each loop in its run (see `_rows`); used
        in the store's thread only."""
        self._commits = 0
        self._bytes = 0

    def statistics(self) -> StoreStatistics:
        with self._counted:
            return StoreStatistics(commits=self._commits, bytes_written=self._bytes)

    def __repr__(self) -> str:
        return f"PostgresStore({self._where})"

    # ------------------------------------------------------------ connection

    async def open(self) -> None:
        if self._opened is not None:
            return
        self._paths.clear()  # (another process may have written meanwhile)
        await self._thread.open(
            self, self._connect_once, lambda: self._conn is not None
        )
        if self._opened is None:
            self._opened = object()

    def _connect_once(self) -> None:
        """Connect (in the store's thread), unless an `open` before did."""
        if self._conn is None:
            self._conn = self._first_connection()

    def _connect(self) -> _Conn:
        try:
            return psycopg.connect(
                self.conninfo,
                autocommit=True,  # transactions are explicit (`conn.transaction()`)
                connect_timeout=self._connect_timeout,
            )
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to {self._where}: {exc}") from exc

    def _first_connection(self) -> _Conn:
        conn = self._connect()
        try:
            self._check_layout(conn)
        except psycopg.Error as exc:
            conn.close()
            raise StoreError(f"cannot open the store {self._where}: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _check_layout(self, conn: _Conn) -> None:
        with conn.transaction():
            version = self._version(conn)
            if version is None:
                # Two processes opening a new database at once: one creates the
                # tables while the other waits here, then finds them.
                conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtext(%s))",
                    (f"agentfsm.store:{self.schema}",),
                )
                version = self._version(conn)
            if version is not None and version > _LAYOUT:
                raise StoreSchemaError(
                    f"{self._where} was written by a newer agentfsm (store layout "
                    f"{version}; this one reads up to {_LAYOUT}): upgrade "
                    "agentfsm to open it"
                )
            if version is not None and version < _LAYOUT:
                raise StoreSchemaError(
                    f"{self._where} was written by an earlier agentfsm (store "
                    f"layout {version}; this one reads layout {_LAYOUT} only): "
                    "finish its loops with that version, or give this one another "
                    "schema"
                )
            if version is None:
                s = self._sql.s
                conn.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
                conn.execute(_TABLES.format(s=s))
                conn.execute(
                    f"INSERT INTO {s}.schema_version (version) VALUES (%s)"
                    " ON CONFLICT (only_row) DO UPDATE SET version = EXCLUDED.version",
                    (_LAYOUT,),
                )

    def _version(self, conn: _Conn) -> int | None:
        row = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL", (f"{self._sql.s}.schema_version",)
        ).fetchone()
        if row is None or not row[0]:
            return None
        row = conn.execute(
            f"SELECT version FROM {self._sql.s}.schema_version"
        ).fetchone()
        return None if row is None else int(row[0])

    async def close(self) -> None:
        opened, self._opened = self._opened, None
        if opened is None:
            return

        def close() -> None:
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

        # After the operations given the thread before it.
        try:
            with anyio.CancelScope(shield=True):
                await self._thread.run(close)
        finally:
            self._thread.stop()

    async def _run(self, fn: Callable[[_Conn], _T]) -> _T:
        """Run `fn` on the connection, in the store's thread."""
        opened = self._opened
        if opened is None:
            raise StoreError(f"the store {self._where} is not open")

        def work() -> _T:
            if self._opened is not opened:  # closed while this one waited
                raise StoreError(f"the store {self._where} is not open")
            conn = self._live()
            try:
                return fn(conn)
            except psycopg.Error as exc:
                raise StoreError(f"{self._where}: {exc}") from exc

        return await self._thread.run(work)

    def _write(
        self,
        conn: _Conn,
        fn: Callable[[_Conn], tuple[_T, int]],
        *,
        atomic: bool = False,
        retries: int = 3,
    ) -> _T:
        """Run `fn`, a write (in the store's thread); it returns its result and
        the bytes it wrote. A write of one statement is one transaction as it
        is (the connection is in autocommit: no BEGIN and COMMIT round trips);
        one of several runs in a transaction (`atomic`). A deadlock or a
        serialization failure rolled it back whole: it runs again."""
        for attempt in range(retries + 1):
            try:
                with conn.transaction() if atomic else nullcontext():
                    result, written = fn(conn)
            except _RETRIED:
                if attempt == retries:
                    raise
                continue
            with self._counted:
                self._commits += 1
                self._bytes += written
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _live(self) -> _Conn:
        """The connection (in the store's thread): a new one if the last
        operation met a broken one (and raised)."""
        conn = self._conn
        if conn is None or conn.broken or conn.closed:
            if conn is not None:
                conn.close()
            conn = self._conn = self._connect()
        return conn

    # ------------------------------------------------------------------ loops

    async def commit(self, commit: Commit, owner: str) -> None:
        await self._run(lambda _: self._commit_in_thread(commit, owner))

    async def commit_many(
        self, commits: Sequence[tuple[Commit, str]]
    ) -> list[Exception | None]:
        # One trip to the store's thread for all of them, a transaction each
        # (on a new connection after one that broke: one loop's failure is not
        # the others').
        return await self._run(
            lambda _: commits_in_turn(commits, self._commit_in_thread)
        )

    def _commit_in_thread(self, commit: Commit, owner: str) -> None:
        """Write one commit, in the store's thread (its JSON is made here too,
        off the event loop)."""
        try:
            self._write(self._live(), self._commit_write(commit, owner))
        except psycopg.Error as exc:
            raise StoreError(f"{self._where}: {exc}") from exc

    def _commit_write(
        self, commit: Commit, owner: str
    ) -> Callable[[_Conn], tuple[None, int]]:
        """The transaction's body of `commit`."""
        record = commit.record
        loop_id = record.loop_id
        records = [*commit.earlier, record]
        items = [item.model_dump_json() for item in commit.items]
        replaced = [
            (item.model_dump_json(), at) for at, item in (commit.replaced or {}).items()
        ]
        inference = (
            None
            if commit.inference is None
            else (commit.inference[0], commit.inference[1].model_dump_json())
        )
        sql = self._sql
        intents = commit.intents
        ended = [(key, out.model_dump_json(), term) for key, out, term in commit.ended]
        written = (
            sum(map(len, items))
            + sum(len(i) for i, _ in replaced)
            + sum(len(out) for _, out, _ in ended)
            + intent_bytes(intents)
            + (0 if inference is None else len(inference[1]))
        )

        def write(conn: _Conn) -> tuple[None, int]:
            # The rows continue this store's run of the loop (see `_rows`),
            # unless the store has none, or another runtime took the loop since.
            run = loop_id in self._paths
            while True:
                rows = self._paths.rows(loop_id, records, run=run)
                shared = None if run else shared_text(record)
                (text, path_from, path) = rows[-1]
                returned = conn.execute(
                    sql.commit_loop,
                    (
                        loop_id,
                        record.agent_id,
                        record.status.value,
                        record.state.value,
                        record.seq,
                        owner,
                        self.lease_ttl,
                        shared,
                        text,
                        path_from,
                        path,
                        commit.first,
                        items,
                        [at for _, at in replaced],
                        [item for item, _ in replaced],
                        *(inference or (None, None)),
                        [r.seq for r in commit.earlier],
                        [body for body, _, _ in rows[:-1]],
                        [start for _, start, _ in rows[:-1]],
                        [steps for _, _, steps in rows[:-1]],
                        [c.key for c in intents],
                        [c.request for c in intents],
                        [c.position for c in intents],
                        [c.tool for c in intents],
                        [c.call_id for c in intents],
                        [key for key, _, _ in ended],
                        [out for _, out, _ in ended],
                        [term for _, _, term in ended],
                        commit.new,
                    ),
                ).fetchone()
                result = None if returned is None else returned[0]
                if result is None:
                    break
                if result == "stale:" and run:
                    run = False  # (nothing was written)
                    continue
                if result == "taken:":
                    raise LoopIdTakenError(loop_id)
                raise LoopLockedError(loop_id, result.removeprefix("held:"))
            if record.status is LoopStatus.done:
                self._paths.pop(loop_id)  # it writes no more
            else:
                self._paths.wrote(loop_id, record.path)
            return None, written + len(shared or "") + sum(
                len(body) + len(steps) for body, _, steps in rows
            )

        return write

    async def load(self, loop_id: str) -> StoredLoop | None:
        def read(conn: _Conn) -> StoredLoop | None:
            # One statement: the record and the items of one snapshot (and the
            # path's steps, of rows written before it: they never change).
            row = conn.execute(self._sql.load, (loop_id,)).fetchone()
            if row is None:
                return None
            row_id, text, owner, items = row
            return StoredLoop(
                self._record(conn, loop_id, row_id, text),
                [ContextItemAdapter.validate_json(item) for item in items],
                owner,
            )

        return await self._run(read)

    async def record_at(self, loop_id: str, seq: int) -> LoopRecord | None:
        def read(conn: _Conn) -> LoopRecord | None:
            row = conn.execute(self._sql.record_at, (loop_id, seq)).fetchone()
            if row is None:
                return None
            return self._record(conn, loop_id, *row)

        return await self._run(read)

    def _record(self, conn: _Conn, loop_id: str, row_id: int, text: str) -> LoopRecord:
        """The record of the row `row_id` (`text`), made whole: what its run
        shares, and its path from the steps of its rows up to this one."""
        shared = conn.execute(self._sql.shared, (loop_id, row_id)).fetchone()
        if shared is None:
            raise StoreError(f"no row of loop {loop_id} holds what its records share")
        path = path_of(conn.execute(self._sql.path, (loop_id, row_id)))
        return record_of(json.loads(text), json.loads(shared[0]), path)

    async def unfinished(self) -> list[str]:
        def read(conn: _Conn) -> list[str]:
            rows = conn.execute(self._sql.unfinished, (LoopStatus.done.value,))
            return [str(loop_id) for (loop_id,) in rows]

        return await self._run(read)

    async def record_inference(
        self, loop_id: str, request: int, output: InferenceOutput
    ) -> None:
        text = output.model_dump_json()

        def write(conn: _Conn) -> tuple[None, int]:
            conn.execute(self._sql.put_inference, (loop_id, request, text))
            return None, len(text)

        await self._run(lambda conn: self._write(conn, write))

    async def context(
        self, context_id: str
    ) -> tuple[list[ContextItem], list[str]] | None:
        s = self._sql.s

        def read(conn: _Conn) -> tuple[list[ContextItem], list[str]] | None:
            rows = conn.execute(
                f"SELECT item, digest FROM {s}.contexts WHERE context_id = %s"
                " ORDER BY position",
                (context_id,),
            ).fetchall()
            if not rows:
                return None
            return (
                [ContextItemAdapter.validate_json(item) for item, _ in rows],
                [str(digest) for _, digest in rows],
            )

        return await self._run(read)

    async def append_context(
        self,
        context_id: str,
        first: int,
        items: Sequence[ContextItem],
        digests: Sequence[str],
    ) -> None:
        s = self._sql.s
        texts = [item.model_dump_json() for item in items]

        def write(conn: _Conn) -> tuple[None, int]:
            conn.execute(
                f"DELETE FROM {s}.contexts WHERE context_id = %s AND position >= %s",
                (context_id, first),
            )
            conn.execute(
                f"INSERT INTO {s}.contexts (context_id, position, item, digest)"
                " SELECT %s, %s + n - 1, t.item, t.digest"
                " FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY"
                " AS t(item, digest, n)",
                (context_id, first, texts, list(digests)),
            )
            return None, sum(map(len, texts)) + sum(map(len, digests))

        await self._run(lambda conn: self._write(conn, write, atomic=True))

    async def inference(self, loop_id: str, request: int) -> InferenceOutput | None:
        def read(conn: _Conn) -> InferenceOutput | None:
            row = conn.execute(self._sql.inference, (loop_id, request)).fetchone()
            return None if row is None else InferenceOutput.model_validate_json(row[0])

        return await self._run(read)

    # ----------------------------------------------------------------- ledger

    async def calls(self, loop_id: str, request: int) -> list[CallRecord]:
        def read(conn: _Conn) -> list[CallRecord]:
            rows = conn.execute(self._sql.calls, (loop_id, request))
            return [call_of_row(row) for row in rows]

        return await self._run(read)

    async def begin_call(self, call: CallRecord) -> CallRecord:
        sql = self._sql

        def write(conn: _Conn) -> tuple[CallRecord, int]:
            row = conn.execute(
                sql.begin_call,
                (
                    call.key,
                    call.loop_id,
                    call.request,
                    call.position,
                    call.tool,
                    call.call_id,
                    call.attempt,
                ),
            ).fetchone()
            if row is None:  # done already: what the ledger holds, unchanged
                known = conn.execute(sql.call, (call.key,)).fetchone()
                assert known is not None  # (the conflict was on this key)
                return call_of_row(known), 0
            attempt, inserted = row
            if inserted:
                return call, intent_bytes([call])
            return call.model_copy(update={"status": "started", "attempt": attempt}), 0

        return await self._run(lambda conn: self._write(conn, write))

    async def end_call(
        self, loop_id: str, key: str, output: FunctionCallOutputItem, terminate: bool
    ) -> None:
        text = output.model_dump_json()

        def write(conn: _Conn) -> tuple[None, int]:
            conn.execute(self._sql.end_call, (text, terminate, key))
            return None, len(text)

        await self._run(lambda conn: self._write(conn, write))

    async def mark_uncertain(self, loop_id: str, keys: Sequence[str]) -> None:
        def write(conn: _Conn) -> tuple[None, int]:
            conn.execute(self._sql.mark_uncertain, (list(keys),))
            return None, 0

        await self._run(lambda conn: self._write(conn, write))

    # ----------------------------------------------------------------- leases

    async def acquire(
        self, loop_id: str, owner: str, *, replacing: str | None = None
    ) -> str | None:
        sql = self._sql

        def write(conn: _Conn) -> tuple[str | None, int]:
            self._forget(loop_id)  # another runtime may have written it
            row = conn.execute(sql.lock_loop, (loop_id,)).fetchone()
            if row is None:
                return None, 0  # nothing to own: the loop's first commit takes it
            holder, live = row
            if holder not in (None, owner, replacing) and live:
                return str(holder), 0
            conn.execute(sql.take_lease, (owner, self.lease_ttl, loop_id))
            return None, 0

        return await self._run(lambda conn: self._write(conn, write, atomic=True))

    def _forget(self, loop_id: str) -> None:
        """What this store wrote of the loop's rows may not be what they hold."""
        self._paths.pop(loop_id)

    async def renew(self, owner: str) -> None:
        def write(conn: _Conn) -> tuple[None, int]:
            conn.execute(self._sql.renew, (self.lease_ttl, owner))
            return None, 0

        await self._run(lambda conn: self._write(conn, write))

    async def release(self, owner: str, loop_ids: Sequence[str] | None = None) -> None:
        def write(conn: _Conn) -> tuple[None, int]:
            if loop_ids is None:
                self._paths.clear()
                conn.execute(self._sql.release_all, (owner,))
            else:
                for loop_id in loop_ids:
                    self._forget(loop_id)
                conn.execute(self._sql.release, (owner, list(loop_ids)))
            return None, 0

        await self._run(lambda conn: self._write(conn, write))


class _Statements:
    """The store's SQL, its schema's name in place (built once per store, so
    psycopg prepares each statement once per connection)."""

    def __init__(self, s: str) -> None:
        self.s = s
        now = "clock_timestamp()"
        lease = f"{now} + %s * interval '1 second'"
        self.commit_loop = (
            f"SELECT {s}.commit_loop(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s,"
            " %s::text[], %s::integer[], %s::text[], %s, %s,"
            " %s::bigint[], %s::text[], %s::integer[], %s::text[],"
            " %s::text[], %s::integer[], %s::integer[], %s::text[], %s::text[],"
            " %s::text[], %s::text[], %s::boolean[], %s)"
        )
        self.put_inference = (
            f"INSERT INTO {s}.inferences (loop_id, request, output) VALUES (%s, %s, %s)"
            " ON CONFLICT (loop_id, request) DO UPDATE SET output = EXCLUDED.output"
        )
        self.load = (
            "SELECT r.id, r.record,"
            f" CASE WHEN l.lease_until > {now} THEN l.owner END,"
            f" ARRAY(SELECT i.item FROM {s}.items i WHERE i.loop_id = l.loop_id"
            " ORDER BY i.position)"
            f" FROM {s}.loops l JOIN {s}.records r"
            " ON r.loop_id = l.loop_id AND r.seq = l.seq WHERE l.loop_id = %s"
            " ORDER BY r.id DESC LIMIT 1"
        )
        self.record_at = (
            f"SELECT id, record FROM {s}.records WHERE loop_id = %s AND seq <= %s"
            " ORDER BY seq DESC, id DESC LIMIT 1"
        )
        self.shared = (
            f"SELECT shared FROM {s}.records WHERE loop_id = %s AND id <= %s"
            " AND shared IS NOT NULL ORDER BY id DESC LIMIT 1"
        )
        self.path = (
            f"SELECT path_from, path FROM {s}.records WHERE loop_id = %s AND id <= %s"
            " ORDER BY id"
        )
        self.unfinished = (
            f"SELECT loop_id FROM {s}.loops WHERE status <> %s ORDER BY loop_id"
        )
        self.inference = (
            f"SELECT output FROM {s}.inferences WHERE loop_id = %s AND request = %s"
        )
        self.calls = (
            f"SELECT {CALL_COLUMNS} FROM {s}.calls"
            " WHERE loop_id = %s AND request = %s ORDER BY position"
        )
        self.call = f"SELECT {CALL_COLUMNS} FROM {s}.calls WHERE key = %s"
        self.begin_call = (
            f"INSERT INTO {s}.calls AS c ({CALL_COLUMNS})"
            " VALUES (%s, %s, %s, %s, %s, %s, 'started', %s, NULL, false)"
            # A key in the ledger and not done: a new attempt.
            " ON CONFLICT (key) DO UPDATE SET status = 'started', attempt = c.attempt + 1"
            " WHERE c.status <> 'done'"
            # xmax is 0 on a row this statement inserted (not on one it updated).
            " RETURNING c.attempt, c.xmax = 0"
        )
        self.end_call = (
            f"UPDATE {s}.calls SET status = 'done', output = %s, terminate = %s"
            " WHERE key = %s"
        )
        self.mark_uncertain = (
            f"UPDATE {s}.calls SET status = 'uncertain' WHERE key = ANY(%s::text[])"
        )
        self.lock_loop = (
            f"SELECT owner, lease_until > {now} FROM {s}.loops WHERE loop_id = %s"
            " FOR UPDATE"
        )
        self.take_lease = (
            f"UPDATE {s}.loops SET owner = %s, lease_until = {lease} WHERE loop_id = %s"
        )
        self.renew = (  # unfinished loops only: a finished one needs no lease
            f"UPDATE {s}.loops SET lease_until = {lease}"
            " WHERE owner = %s AND status <> 'done'"
        )
        self.release_all = (
            f"UPDATE {s}.loops SET owner = NULL, lease_until = NULL WHERE owner = %s"
        )
        self.release = (
            f"UPDATE {s}.loops SET owner = NULL, lease_until = NULL"
            " WHERE owner = %s AND loop_id = ANY(%s::text[])"
        )


def _check_schema(schema: object) -> None:
    # (Interpolated into the SQL, quoted: so only a plain lowercase name.)
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigurationError(
            "schema must be a lowercase PostgreSQL name ([a-z_][a-z0-9_]*, at most "
            f"63 characters), got {schema!r}"
        )


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigurationError(f"{name} must be a positive number, got {value!r}")


def _describe(params: dict[str, Any], schema: str) -> str:
    """Where the store is, for messages (never the password)."""
    host = params.get("host") or params.get("hostaddr") or "localhost"
    port = params.get("port")
    dbname = params.get("dbname") or params.get("user") or "(default database)"
    at = f"{host}:{port}" if port else str(host)
    return f"postgresql {at}/{dbname} schema {schema}"
