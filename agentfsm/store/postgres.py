"""`PostgresStore`: durable loops in a PostgreSQL database that several
processes share (`pip install 'agentfsm[postgres]'`, psycopg 3).

psycopg's `AsyncConnection` runs on asyncio only, so the store uses psycopg's
sync API in a thread of its own (see `_sql`), and runs on asyncio and trio
alike: one connection, its calls in the order they come. One connection, not a
pool, because the store's callers rely on the order in which they issue
operations (`release`, when a runtime exits, must land after every commit of
its loops). Concurrency between runtimes is the server's: each process has its
own connection.

A commit is one statement, a call of the store's `commit_log` function (one
round trip, one transaction): it locks the loop's row (`FOR UPDATE`), checks the
fence (owner and epoch, the loop not ended), writes the row's new status if it
changed, the log row and the events. So of two runtimes writing one loop, one
waits for the other's transaction and then sees its epoch. A lease's time is
the server's clock (runtimes on hosts whose clocks differ agree on when it
expires). A runtime's presence is a session advisory lock: the server drops
it when the runtime's connection ends, so another process can tell that a
lease's owner is gone.

The tables live in one PostgreSQL schema (`schema="agentfsm"` by default;
another name keeps several stores in one database apart), created at open if
missing, with a `schema_version` table checked at open: a layout written by
other code is refused (`StoreSchemaError`). How durable a commit is follows the
server's `synchronous_commit` (on by default); `options='-c
synchronous_commit=off'` in the conninfo trades the last commits of a server
crash for speed, as SQLite's `durability="normal"` does.

A request stored in the decision inbox (`submit_request`) is announced
with `NOTIFY agentfsm_requests, '<loop id>'` as its transaction commits; a
runtime watching the store (`Runtime(requests=True)`) listens on a connection
of its own (`request_notices`), so a request from another process wakes it at
once (its poll stays, should the listening connection break).

A connection that breaks (the server restarted) is dropped, and the next
operation opens a new one; the operation that met the break raises
`StoreError` (it is not retried: its transaction may or may not have
committed).

Messages name the server by its host, port, database and schema, never by
its password: neither the conninfo's nor what a malformed URI puts where libpq
reads a host, port or database (`_secrets`); an error connecting chains none
of psycopg's, which keep the connection's parameters.

PostgreSQL's `text` cannot hold a NUL. What a loop's rows hold is JSON (a NUL
is `\\u0000` there) and large strings are `bytea`; the ids a column holds as
they are (a loop's, an agent's, a shared context's) are escaped when they
hold one (`_key`), so a store of either kind holds the same loops.
"""

from __future__ import annotations

import os
import re
import select
import threading
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager, nullcontext
from typing import Any, Final
from urllib.parse import unquote

import anyio
import anyio.to_thread

from agentfsm._arguments import (
    ArgumentTypeError,
    ArgumentValueError,
    check,
    seconds,
)

from ._base import LoopIdTakenError, RequestNotices, StoreError, StoreSchemaError
from ._outline import chunks
from ._sql import LOG_COLUMNS, Dialect, LogRow, SQLStore

try:
    import psycopg
    import psycopg.errors
    from psycopg.conninfo import conninfo_to_dict
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "agentfsm.store.postgres needs psycopg 3: pip install 'agentfsm[postgres]'"
    ) from exc

__all__ = ("PostgresStore",)

_Conn = psycopg.Connection[Any]

_LAYOUT: Final = 3
"""The layout this store writes (its `schema_version` table). Layouts 1 and 2
(agentfsm before fenced leases) are not read."""

_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")

_TABLES = """
CREATE SEQUENCE IF NOT EXISTS {s}.loop_numbers;
CREATE TABLE IF NOT EXISTS {s}.loops (
    loop_id text PRIMARY KEY,
    number bigint NOT NULL,
    agent_id text NOT NULL,
    status text NOT NULL,
    owner text,
    epoch bigint NOT NULL,
    lease_until double precision NOT NULL DEFAULT 0,
    updated double precision NOT NULL
);
CREATE INDEX IF NOT EXISTS loops_unfinished ON {s}.loops (owner)
    WHERE status <> 'done';
CREATE TABLE IF NOT EXISTS {s}.log (
    id bigint PRIMARY KEY,
    loop_id text NOT NULL,
    seq bigint,
    record text,
    earlier text,
    first_seq bigint,
    changes text,
    request integer,
    ledger text,
    path_from integer,
    path text,
    shared text,
    decisions text,
    outlined integer
);
CREATE TABLE IF NOT EXISTS {s}.events (
    loop_id text NOT NULL,
    seq bigint NOT NULL,
    event text NOT NULL,
    outlined integer,
    PRIMARY KEY (loop_id, seq)
);
CREATE TABLE IF NOT EXISTS {s}.blobs (
    digest text PRIMARY KEY,
    data bytea NOT NULL
);
CREATE TABLE IF NOT EXISTS {s}.contexts (
    context_id text NOT NULL,
    position integer NOT NULL,
    item text NOT NULL,
    digest text NOT NULL,
    PRIMARY KEY (context_id, position)
);
-- A commit in one statement (see agentfsm.store._sql): NULL when written,
-- else (and nothing is written) 'taken' (a new loop's id is another loop's),
-- 'fenced' (the lease is not the caller's, or the loop ended), 'missing'.
CREATE OR REPLACE FUNCTION {s}.commit_log(
    p_loop text, p_agent text, p_owner text, p_epoch bigint, p_new boolean,
    p_status text, p_ttl float8, p_seq bigint, p_record text, p_earlier text,
    p_first_seq bigint, p_changes text, p_request integer, p_ledger text,
    p_path_from integer, p_path text, p_shared text, p_decisions text,
    p_outlined integer, p_event_seqs bigint[], p_events text[]
) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    h_owner text;
    h_epoch bigint;
    h_status text;
    n bigint;
    now_ double precision := extract(epoch from clock_timestamp());
BEGIN
    IF p_new THEN
        INSERT INTO {s}.loops (loop_id, number, agent_id, status, owner, epoch,
            lease_until, updated)
        VALUES (p_loop, nextval('{s}.loop_numbers'), p_agent, p_status, p_owner, 1,
            now_ + p_ttl, now_)
        ON CONFLICT (loop_id) DO NOTHING;
        IF NOT FOUND THEN
            RETURN 'taken';
        END IF;
    ELSE
        -- The row's lock, until the transaction ends: every writer of this
        -- loop waits here, then sees this one's epoch.
        SELECT owner, epoch, status INTO h_owner, h_epoch, h_status
        FROM {s}.loops WHERE loop_id = p_loop FOR UPDATE;
        IF NOT FOUND THEN
            RETURN 'missing';
        END IF;
        IF h_status = 'done' OR h_owner IS DISTINCT FROM p_owner
            OR h_epoch <> p_epoch THEN
            RETURN 'fenced';
        END IF;
        IF p_status IS NOT NULL AND p_status <> h_status THEN
            UPDATE {s}.loops SET status = p_status, lease_until = now_ + p_ttl,
                updated = now_
            WHERE loop_id = p_loop;
        END IF;
    END IF;
    SELECT number INTO n FROM {s}.loops WHERE loop_id = p_loop;
    INSERT INTO {s}.log (id, loop_id, seq, record, earlier, first_seq, changes,
        request, ledger, path_from, path, shared, decisions, outlined)
    VALUES (coalesce((SELECT id FROM {s}.log WHERE id BETWEEN n << 32
            AND (n << 32) + 4294967295 ORDER BY id DESC LIMIT 1) + 1, n << 32),
        p_loop, p_seq, p_record, p_earlier, p_first_seq, p_changes, p_request,
        p_ledger, p_path_from, p_path, p_shared, p_decisions, p_outlined);
    IF p_events IS NOT NULL THEN
        INSERT INTO {s}.events (loop_id, seq, event, outlined)
        SELECT p_loop, e.seq, e.event, p_outlined
        FROM unnest(p_event_seqs, p_events) AS e(seq, event);
    END IF;
    RETURN NULL;
END
$$;
CREATE TABLE IF NOT EXISTS {s}.schema_version (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    version integer NOT NULL
);
"""

_REQUESTS = """
CREATE TABLE IF NOT EXISTS {s}.requests (
    id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    loop_id text NOT NULL,
    kind text NOT NULL,
    decision text,
    seq bigint,
    asker text NOT NULL,
    reason text,
    created double precision NOT NULL,
    status text NOT NULL,
    resolved double precision,
    note text
);
CREATE INDEX IF NOT EXISTS requests_status ON {s}.requests (status, id);
CREATE INDEX IF NOT EXISTS requests_loop ON {s}.requests (loop_id, id);
"""
"""The decision inbox (`Requests`): made with a new store, and added to one of
this layout made before it at its first writable open."""

_BREAKPOINTS = """
CREATE TABLE IF NOT EXISTS {s}.breakpoints (
    id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    loop_id text,
    agent_id text,
    state text,
    asker text NOT NULL,
    created double precision NOT NULL,
    removed double precision,
    remover text
);
CREATE INDEX IF NOT EXISTS breakpoints_active ON {s}.breakpoints (id)
    WHERE removed IS NULL;
"""
"""Stored breakpoints (`SharedBreakpoints`): made, as the requests are, with a
new store or at the first writable open of one made before them. A change is
announced on the requests' channel (a notice only wakes a watcher, which
reads both)."""

_CHANNEL: Final = "agentfsm_requests"
"""The channel a stored request is announced on (`NOTIFY`, its payload the
loop's id), for the runtimes that watch the store (`request_notices`)."""
_PAYLOAD_LIMIT: Final = 4000
"""Bytes of a loop id a notice carries at most (PostgreSQL takes 8000): a
longer id is announced with an empty payload (a notice only wakes a watcher)."""

_COMMIT: Final = (
    "SELECT commit_log(:loop, :agent, :owner, :epoch, :new, :status, :ttl, :seq,"
    " :record, :earlier, :first_seq, :changes, :request, :ledger, :path_from,"
    " :path, :shared, :decisions, :outlined, :event_seqs::bigint[],"
    " :events::text[])"
)

_DIALECT: Final = Dialect(
    now="extract(epoch from clock_timestamp())",
    param=lambda name: f"%({name})s",
)


class PostgresStore(SQLStore[_Conn]):
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
            environment variables. Its password is never in a message or
            the store's `repr`.
        schema: the PostgreSQL schema holding the store's tables (created if
            missing): lowercase letters, digits and `_`.
        events: keep the events the runtime's loops publish (see `SQLiteStore`).
        lease_ttl: seconds a runtime's lease on a loop lasts unless renewed.
        connect_timeout: seconds to wait for a connection.
        read_only: open an existing store to read it only (`loops`, `load`,
            `events`, ...; what `agentfsm loops` does): its session is
            read-only (`default_transaction_read_only`), so it creates no
            schema nor table, and every write, lease and presence is refused
            (`StoreError`).

    Raises:
        ConfigurationError: (at once) an argument is not usable.
        StoreSchemaError: (at open) the schema was written by other code.
        StoreError: (at open and after) the server could not be reached, or
            failed an operation.
    """

    dialect = _DIALECT

    def __init__(
        self,
        conninfo: str = "",
        *,
        schema: str = "agentfsm",
        events: bool = False,
        lease_ttl: float = 30.0,
        connect_timeout: float = 10.0,
        read_only: bool = False,
    ) -> None:
        if not isinstance(conninfo, str):  # (not quoted: it may hold a password)
            raise ArgumentTypeError(
                f"conninfo must be a str, got {type(conninfo).__name__}"
            )
        params = _parsed(conninfo)
        _check_schema(schema)
        check("events", events, bool)
        check("read_only", read_only, bool)
        lease_ttl = seconds("lease_ttl", lease_ttl, positive=True)
        connect_timeout = seconds("connect_timeout", connect_timeout, positive=True)
        self._conninfo = conninfo
        self._secrets = _secrets(conninfo, params)
        """What no message may show (see `_redacted`)."""
        self.schema = schema
        self.where = self._redacted(_describe(params, schema))
        self._connect_timeout = max(1, round(connect_timeout))  # libpq: whole seconds
        self._namespace = zlib.crc32(f"agentfsm:{schema}".encode()) & 0x7FFFFFFF
        """The first key of this store's presence locks (the slot the second)."""
        super().__init__(
            events=events,
            lease_ttl=lease_ttl,
            thread_name=f"agentfsm-postgres {self.where}",
            read_only=read_only,
        )

    # ------------------------------------------------------------ connection

    def _open_connection(self) -> _Conn:
        try:
            return psycopg.connect(
                self._conninfo,
                autocommit=True,  # transactions are explicit (`conn.transaction()`)
                connect_timeout=self._connect_timeout,
            )
        except psycopg.Error as exc:
            message = self._redacted(str(exc)).strip()
            if "timeout expired" in message:
                message += (
                    f" (no answer within connect_timeout, {self._connect_timeout}s:"
                    " is the server up, and is this its address and port?)"
                )
            error = StoreError(f"cannot connect to {self.where}: {message}")
        # Raised out of the handler, unchained: the driver's error holds the
        # connection's parameters, password included (its `pgconn`).
        raise error

    def _redacted(self, text: str) -> str:
        """`text` (a message naming the server) without the conninfo's secrets."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _connect(self) -> _Conn:
        conn = self._open_connection()
        try:
            if self.read_only:
                conn.execute("SET default_transaction_read_only = on")
                self._check_layout_read_only(conn)
            else:
                self._check_layout(conn)
            conn.execute(f'SET search_path TO "{self.schema}"')
        except psycopg.Error as exc:
            conn.close()
            raise StoreError(
                f"cannot open the store {self.where}: {self._redacted(str(exc))}"
            ) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _check_layout(self, conn: _Conn) -> None:
        s = f'"{self.schema}"'
        with conn.transaction():
            # Two processes opening a new database at once: one creates the
            # tables while the other waits here, then finds them.
            conn.execute(
                "SELECT pg_advisory_xact_lock(hashtext(%s))",
                (f"agentfsm.store:{self.schema}",),
            )
            version = self._version(conn)
            self._layout_readable(version)
            if version is not None and not self._holds_table(conn, "requests"):
                conn.execute(_REQUESTS.format(s=s))  # (a store made before them)
            if version is None:
                row = conn.execute(
                    "SELECT string_agg(table_name, ', ' ORDER BY table_name)"
                    " FROM information_schema.tables WHERE table_schema = %s",
                    (self.schema,),
                ).fetchone()
                if row is not None and row[0]:
                    raise StoreSchemaError(
                        f"{self.where} is not an agentfsm store (its schema holds "
                        f"the tables {row[0]}): it is left as it was"
                    )
                conn.execute(f"CREATE SCHEMA IF NOT EXISTS {s}")
                conn.execute(_TABLES.format(s=s))
                conn.execute(_REQUESTS.format(s=s))
                conn.execute(
                    f"INSERT INTO {s}.schema_version (version) VALUES (%s)",
                    (_LAYOUT,),
                )
            if not self._holds_table(conn, "breakpoints"):
                conn.execute(_BREAKPOINTS.format(s=s))  # (also a store made before)

    def _check_layout_read_only(self, conn: _Conn) -> None:
        """Refuse a schema that holds no agentfsm store of this layout (a
        read-only store creates none)."""
        version = self._version(conn)
        self._layout_readable(version)
        if version is None:
            raise StoreSchemaError(
                f"{self.where} holds no agentfsm store (no schema_version table "
                f"in schema {self.schema})"
            )
        self._has_requests = self._holds_table(conn, "requests")
        self._has_breakpoints = self._holds_table(conn, "breakpoints")

    def _holds_table(self, conn: _Conn, name: str) -> bool:
        """Whether the schema holds the table `name` (one added later)."""
        row = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL", (f'"{self.schema}".{name}',)
        ).fetchone()
        return bool(row is not None and row[0])

    def _layout_readable(self, version: int | None) -> None:
        """Refuse a store of a layout this version does not read (the one
        check of readers and writers; None: no store yet)."""
        if version is not None and version > _LAYOUT:
            raise StoreSchemaError(
                f"{self.where} was written by a newer agentfsm (store layout "
                f"{version}; this one reads up to {_LAYOUT}): upgrade "
                "agentfsm to open it"
            )
        if version is not None and version < _LAYOUT:
            raise StoreSchemaError(
                f"{self.where} was written by an earlier agentfsm (store "
                f"layout {version}; this one reads layout {_LAYOUT} only): "
                "finish its loops with that version, or give this one another "
                "schema"
            )

    def _version(self, conn: _Conn) -> int | None:
        s = f'"{self.schema}"'
        row = conn.execute(
            "SELECT to_regclass(%s) IS NOT NULL", (f"{s}.schema_version",)
        ).fetchone()
        if row is None or not row[0]:
            return None
        row = conn.execute(f"SELECT version FROM {s}.schema_version").fetchone()
        return None if row is None else int(row[0])

    def _disconnect(self, conn: _Conn) -> None:
        conn.close()

    def _live(self) -> _Conn:
        """The connection (in the store's thread): a new one if the last
        operation met a broken one (and raised), holding this store's
        presence locks again."""
        conn = self._conn
        if conn is None:
            raise StoreError(f"the store {self.where} is not open")
        if conn.broken or conn.closed:
            conn.close()
            conn = self._conn = self._connect()
            for slot in self._held:
                self._lock_slot(conn, slot)
            if self._held:
                self.presence_lapses += 1
        return conn

    _driver_error = psycopg.Error

    def _failure(self, exc: Exception) -> StoreError:
        return StoreError(f"{self.where}: {self._redacted(str(exc))}")

    # ------------------------------------------------------------- statements

    def _execute(self, conn: _Conn, sql: str, params: Mapping[str, Any] = {}) -> Any:
        if any(_escaped(params.get(name)) for name in _ID_PARAMS):
            params = {k: _key(v) if k in _ID_PARAMS else v for k, v in params.items()}
        return conn.execute(sql, params)

    def _key_of(self, value: Any) -> str:
        return _key_read(str(value))

    def _key_of_agent(self, agent_id: str) -> str:
        return str(_key(agent_id))

    @contextmanager
    def _transaction(self, conn: _Conn) -> Iterator[None]:
        with conn.transaction():
            yield

    @contextmanager
    def _snapshot(self, conn: _Conn) -> Iterator[None]:
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            yield

    def _write_commit(self, conn: _Conn, row: LogRow, run_status: str | None) -> None:
        commit = row.commit
        lease = commit.lease
        values = {
            **dict(zip(LOG_COLUMNS, row.values, strict=True)),
            "loop": _key(commit.loop_id),
            "agent": _key(commit.record.agent_id if commit.record is not None else ""),
            "owner": lease.owner,
            "epoch": lease.epoch,
            "new": commit.new,
            # The status changes, or the row may hold another: written if so.
            "status": row.status if row.status != run_status else None,
            "ttl": self.lease_ttl,
            "event_seqs": [seq for seq, _ in row.events] if row.events else None,
            "events": [text for _, text in row.events] if row.events else None,
        }
        try:
            # A commit's large strings (see `_outline`) are written first, in
            # its transaction (refused, it takes them back); the requests it
            # applies are marked after it, in its transaction too.
            many = row.blobs or commit.requests
            with conn.transaction() if many else nullcontext():
                for digest, text, _ in row.blobs:
                    conn.execute(
                        "INSERT INTO blobs (digest, data) VALUES (%s, %s)"
                        " ON CONFLICT (digest) DO NOTHING",
                        (digest, b"".join(chunks(text))),
                    )
                returned = conn.execute(self.q(_COMMIT), values).fetchone()
                result = None if returned is None else returned[0]
                if result is not None and row.blobs:
                    raise _Refused(result)
                if result is None and commit.requests:
                    self._applied(conn, commit)
        except _Refused as refused:
            result = refused.result
        if result is None:
            return
        if result == "taken":
            raise LoopIdTakenError(commit.loop_id)
        raise self._fence(conn, commit)

    # --------------------------------------------------------------- requests

    def _announce_request(self, conn: _Conn, loop_id: str) -> None:
        # Sent as the request's transaction commits (not if it rolls back).
        payload = str(_key(loop_id))
        if len(payload.encode()) > _PAYLOAD_LIMIT:
            payload = ""
        conn.execute("SELECT pg_notify(%s, %s)", (_CHANNEL, payload))

    def request_notices(self) -> RequestNotices:
        """`LISTEN agentfsm_requests` on a connection of its own: entered, a
        function that returns once a request was stored (by any process; a
        store of another schema of the database too: a notice only wakes).

        Raises:
            StoreError: (entering, or waiting) the server could not be
                reached, or the connection broke.
        """
        return self._notices()

    @asynccontextmanager
    async def _notices(self) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        if self.read_only:
            raise StoreError(
                f"{self.where}: the store was opened with read_only=True: it "
                "watches no requests"
            )
        listener = await anyio.to_thread.run_sync(self._listener)
        try:
            yield listener.wait
        finally:
            listener.close()

    def _listener(self) -> _Listener:
        conn = self._open_connection()
        try:
            conn.execute(f"LISTEN {_CHANNEL}")
        except psycopg.Error as exc:
            conn.close()
            raise self._failure(exc) from None
        except BaseException:
            conn.close()
            raise
        return _Listener(conn, self._failure)

    # --------------------------------------------------------------- presence

    def _lock_slot(self, conn: _Conn, slot: int) -> None:
        # Tried, not waited for: a live process holding the slot (another
        # owner's name hashed to it) says "alive" for this one too.
        conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (self._namespace, slot))

    def _unlock_slot(self, conn: _Conn, slot: int) -> None:
        if not conn.broken and not conn.closed:
            conn.execute("SELECT pg_advisory_unlock(%s, %s)", (self._namespace, slot))

    def _slot_free(self, conn: _Conn, slot: int) -> bool | None:
        row = conn.execute(
            "SELECT pg_try_advisory_lock(%s, %s)", (self._namespace, slot)
        ).fetchone()
        if row is None or not row[0]:
            return False
        conn.execute("SELECT pg_advisory_unlock(%s, %s)", (self._namespace, slot))
        return True


class _Listener:
    """A connection listening for requests' notices, waited on in a thread of
    anyio's; `close` wakes a waiting thread at once (a byte on a pipe), which
    then closes the connection itself (a connection is never closed under a
    thread using it)."""

    def __init__(self, conn: _Conn, failure: Callable[[Exception], StoreError]):
        self.conn = conn
        self.failure = failure
        self.wake_r, self.wake_w = os.pipe()
        self.lock = threading.Lock()
        self.busy = False
        self.closing = False

    async def wait(self) -> None:
        """Return once a notice arrives (abandoned when cancelled: `close`
        wakes the thread)."""
        await anyio.to_thread.run_sync(self._block, abandon_on_cancel=True)

    def _block(self) -> None:
        with self.lock:
            closed = self.closing
            self.busy = not closed
        if closed:
            return
        try:
            pgconn = self.conn.pgconn
            while True:
                try:
                    socket = pgconn.socket
                except psycopg.Error as exc:
                    raise self.failure(exc) from None
                readable, _, _ = select.select([socket, self.wake_r], [], [])
                if self.wake_r in readable:
                    return
                try:
                    pgconn.consume_input()
                except psycopg.Error as exc:
                    raise self.failure(exc) from None
                heard = False
                while pgconn.notifies() is not None:
                    heard = True
                if heard:
                    return
        finally:
            with self.lock:
                self.busy = False
                close = self.closing
            if close:
                self._close()

    def close(self) -> None:
        with self.lock:
            self.closing = True
            if self.busy:
                os.write(self.wake_w, b"x")  # the waiting thread closes it
                return
        self._close()

    def _close(self) -> None:
        self.conn.close()
        os.close(self.wake_r)
        os.close(self.wake_w)


class _Refused(Exception):
    """The commit function refused a commit (`result` says why)."""

    def __init__(self, result: str) -> None:
        super().__init__(result)
        self.result = result


def _check_schema(schema: object) -> None:
    # (Interpolated into the SQL, quoted: so only a plain lowercase name.)
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        error = ArgumentValueError if isinstance(schema, str) else ArgumentTypeError
        raise error(
            "schema must be a lowercase PostgreSQL name ([a-z_][a-z0-9_]*, at most "
            f"63 characters), got {schema!r}"
        )


_ID_PARAMS: Final = ("loop", "id")
"""The parameters of `SQLStore`'s statements that name a loop or a shared
context (`id` is a row's number elsewhere: `_key` leaves it as it is)."""
_ESCAPED: Final = "\x01"
"""How an id stored escaped starts (see `_key`)."""
_TO_ESCAPE: Final = re.compile("[%\x00]")
_TO_UNESCAPE: Final = re.compile("%(?:25|00)")


def _escaped(value: object) -> bool:
    """Whether `value` is an id `_key` changes."""
    return isinstance(value, str) and ("\x00" in value or value.startswith(_ESCAPED))


def _key(value: Any) -> Any:
    """An id (a loop's, an agent's, a shared context's) as a text column holds
    it, which it could not with a NUL in it: itself, unless it holds a NUL or
    starts with `_ESCAPED`; then `_ESCAPED` and the id with `%` and NUL
    percent-encoded (injective: any other id is kept as it is). A value that
    is not such a str is returned as it is."""
    if not _escaped(value):
        return value
    return _ESCAPED + _TO_ESCAPE.sub(_escape, value)


def _escape(match: re.Match[str]) -> str:
    return "%25" if match[0] == "%" else "%00"


def _key_read(text: str) -> str:
    """An id as `_key` stored it, as it was given."""
    if not text.startswith(_ESCAPED):
        return text
    return _TO_UNESCAPE.sub(_unescape, text[1:])


def _unescape(match: re.Match[str]) -> str:
    return "%" if match[0] == "%25" else "\x00"


def _parsed(conninfo: str) -> dict[str, Any]:
    """The conninfo's parameters.

    Raises:
        ArgumentValueError: it is not a connection string or URI (the message
            neither quotes it nor chains libpq's, which may: a password).
    """
    try:
        return conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        pass
    raise ArgumentValueError(
        "conninfo is not a libpq connection string or URI (see "
        "https://www.postgresql.org/docs/current/libpq-connect.html)"
    )


_URI: Final = re.compile(r"postgres(?:ql)?://", re.IGNORECASE)
_PORTS: Final = re.compile(r"[0-9,]*")
_SECRET_PARAMS: Final = ("password", "sslpassword", "oauth_client_secret")
_SHORTEST_PIECE: Final = 3
"""A fragment of a password shorter than this is not redacted (it would blank
out common words of a message, and gives little away)."""


def _secrets(conninfo: str, params: Mapping[str, Any]) -> tuple[str, ...]:
    """What no message may show, longest first: the passwords; and what a
    malformed URI may put where libpq reads a host, port or database (its
    userinfo after the user's name when it holds an unencoded `/`, a port
    that is not a number), with its pieces around `/` and `@`."""
    found = {str(params.get(name) or "") for name in _SECRET_PARAMS}
    pieces: set[str] = set()
    port = str(params.get("port") or "")
    if not _PORTS.fullmatch(port):
        found.add(port)
        pieces.update(port.split(","))
    uri = _URI.match(conninfo)
    if uri is not None:
        head = conninfo[uri.end() :].split("?", 1)[0]
        _, colon, password = head[: max(head.rfind("@"), 0)].partition(":")
        if colon:
            for text in (password, unquote(password)):
                found.add(text)
                pieces.update(re.split("[/@]", text))
    found.update(p for p in pieces if len(p) >= _SHORTEST_PIECE)
    found.discard("")
    return tuple(sorted(found, key=len, reverse=True))


def _describe(params: dict[str, Any], schema: str) -> str:
    """Where the store is, for messages (before `_redacted`)."""
    host = params.get("host") or params.get("hostaddr") or "localhost"
    port = params.get("port")
    dbname = params.get("dbname") or params.get("user") or "(default database)"
    at = f"{host}:{port}" if port else str(host)
    return f"postgresql {at}/{dbname} schema {schema}"
