"""`SQLiteStore`: the embedded durable store (stdlib `sqlite3`, one file).

One connection in WAL mode, in a thread of the store's own (see `_sql`). A
commit is one statement when the loop's row need not change (most commits: an
`INSERT ... SELECT` guarded by the fence), else `BEGIN IMMEDIATE` ... `COMMIT`.
A cancelled caller cannot abandon a write: the thread runs it to the end, and
the cancellation is delivered after it.

`durability="normal"` (`synchronous=NORMAL`): a commit survives the process
crashing; a power loss may lose the last commits (never corrupt the file).
`durability="strict"` (`synchronous=FULL`): every commit is fsynced. Measured
here: ~0.1-0.25 ms per commit normal, ~4 ms strict.

Several processes may share the file (SQLite locks it); leases keep them from
running one loop twice. A runtime's presence is a byte-range lock on a file
beside the database (`<path>-owners`): the kernel drops it when the process
dies, so another process can tell at once that a lease's owner is gone (and
take the lease before it expires), whatever the PID namespace.

The file is created readable by its owner only (0600, or `file_mode`; SQLite
gives its `-wal` and `-shm` files the same mode), marked as an agentfsm store
(`PRAGMA application_id`), and checked at open: a file of another program, or
of another layout, is refused without being changed. A file deleted or
replaced while the store is open is noticed at the next write.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Final, Literal

from agentfsm._arguments import check, file_mode_of, one_of, seconds

from ._base import (
    _PRESENT,
    Lease,
    Leases,
    LoopIdTakenError,
    StoreError,
    StoreSchemaError,
)
from ._outline import chunks
from ._sql import LOG_COLUMNS, Dialect, LogRow, SQLStore, next_id

__all__ = ("SQLiteStore",)

_LAYOUT: Final = 5
"""The layout this store writes (`PRAGMA user_version`). Layouts 1-4 (agentfsm
before fenced leases) are not read."""

_APPLICATION_ID: Final = 0x61667331  # "afs1"
"""`PRAGMA application_id` of an agentfsm store (layouts 5 on)."""

_SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS loops (
    loop_id TEXT PRIMARY KEY,
    number INTEGER NOT NULL,
    agent_id TEXT NOT NULL,
    status TEXT NOT NULL,
    owner TEXT,
    epoch INTEGER NOT NULL,
    lease_until REAL NOT NULL DEFAULT 0,
    updated REAL NOT NULL
) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS loops_unfinished ON loops (owner) WHERE status <> 'done'",
    """CREATE TABLE IF NOT EXISTS log (
    id INTEGER PRIMARY KEY,
    loop_id TEXT NOT NULL,
    seq INTEGER,
    record TEXT,
    earlier TEXT,
    first_seq INTEGER,
    changes TEXT,
    request INTEGER,
    ledger TEXT,
    path_from INTEGER,
    path TEXT,
    shared TEXT,
    decisions TEXT,
    outlined INTEGER
)""",
    """CREATE TABLE IF NOT EXISTS contexts (
    context_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    item TEXT NOT NULL,
    digest TEXT NOT NULL,
    PRIMARY KEY (context_id, position)
)""",
    """CREATE TABLE IF NOT EXISTS events (
    loop_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    event TEXT NOT NULL,
    outlined INTEGER,
    PRIMARY KEY (loop_id, seq)
)""",
    """CREATE TABLE IF NOT EXISTS blobs (
    digest TEXT PRIMARY KEY,
    data BLOB NOT NULL
)""",
)
"""The tables (see `_sql`). One row in one table is what makes a commit cheap:
each table (and index) a transaction touches is a page more to write to the
WAL. So a commit is one statement, its own transaction, unless the loop's row
(status, lease) must change, and a loop's rows are found by their ids, not
an index (a b-tree more for every commit to write); bench/PERFORMANCE.md, "A
loop's rows are a range of ids", has the figures. The unfinished loops are indexed by owner (`loops_unfinished`,
`'done'` being `LoopStatus.done`'s value): a lease renewal and `unfinished`
read them, not every loop the file holds."""

_REQUESTS: Final = (
    """CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    loop_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    decision TEXT,
    seq INTEGER,
    asker TEXT NOT NULL,
    reason TEXT,
    created REAL NOT NULL,
    status TEXT NOT NULL,
    resolved REAL,
    note TEXT
)""",
    "CREATE INDEX IF NOT EXISTS requests_status ON requests (status, id)",
    "CREATE INDEX IF NOT EXISTS requests_loop ON requests (loop_id, id)",
)
"""The decision inbox (`Requests`): made with a new store, and added to one
of this layout made before it at its first writable open. Its ids are the
rowid, never reused (no row is deleted): a later request has a greater id."""

_BREAKPOINTS: Final = (
    """CREATE TABLE IF NOT EXISTS breakpoints (
    id INTEGER PRIMARY KEY,
    loop_id TEXT,
    agent_id TEXT,
    state TEXT,
    asker TEXT NOT NULL,
    created REAL NOT NULL,
    removed REAL,
    remover TEXT
)""",
    "CREATE INDEX IF NOT EXISTS breakpoints_active ON breakpoints (id) WHERE removed IS NULL",
)
"""Stored breakpoints (`SharedBreakpoints`): made, as the requests are, with a
new store or at the first writable open of one made before them. A removed
one keeps its row (who removed it, when); the active ones are indexed apart,
so a watching runtime's read of them skips the removed."""

_COLUMNS: Final = ", ".join(LOG_COLUMNS)
_N: Final = len(LOG_COLUMNS)
_APPEND: Final = f"INSERT INTO log (id, {_COLUMNS}) VALUES (?, {', '.join('?' * _N)})"
"""A commit's row (the loop's row checked or written already): its id, then
its values by position."""
_APPEND_FENCED: Final = (
    f"INSERT INTO log (id, {_COLUMNS}) SELECT ?{_N + 3}, "
    + ", ".join(f"?{i}" for i in range(1, _N + 1))
    + f" FROM loops WHERE loop_id = ?1 AND owner = ?{_N + 1}"
    f" AND epoch = ?{_N + 2} AND status <> 'done'"
)
"""A commit's row, written only while the fence holds (one statement: its own
transaction): its values by position (`?1`, the first, is the loop's id),
the owner and the epoch, its id. It reads `loops` only: an `INSERT` that
reads the table it writes goes through a table of its own first, which held
a 100 MB row twice more (a row id from the loop's last row, `next_id`,
made it so)."""
_NEXT_ID: Final = f"SELECT {next_id('number')} FROM loops WHERE loop_id = ?"
"""The id of the loop's next row (read once a lease, then counted)."""
_NEW_NUMBER: Final = "SELECT coalesce(max(id) >> 32, 0) + 1 FROM log"
"""A new loop's number: one more than the greatest in the log."""
_NEW_LOOP: Final = (
    "INSERT INTO loops (loop_id, number, agent_id, status, owner, epoch,"
    " lease_until, updated) VALUES (?, ?, ?, ?, ?, 1, ?, ?)"
)
_NEW_STATUS: Final = (
    "UPDATE loops SET status = ?, lease_until = ?, updated = ?"
    " WHERE loop_id = ? AND owner = ? AND epoch = ? AND status <> 'done'"
)
_HELD: Final = (
    "SELECT 1 FROM loops WHERE loop_id = ? AND owner = ? AND epoch = ?"
    " AND status <> 'done'"
)
_EVENT: Final = "INSERT INTO events (loop_id, seq, event, outlined) VALUES (?, ?, ?, ?)"
_BLOB: Final = "INSERT OR IGNORE INTO blobs (digest, data) VALUES (?, zeroblob(?))"

_DIALECT: Final = Dialect(
    now=":now",
    param=lambda name: f":{name}",
)

_HINTS: Final = {
    "database is locked": "another connection held its write lock for longer "
    "than busy_timeout",
    "database table is locked": "another connection held its write lock",
    "disk I/O error": "the disk failed, or the file was moved or deleted",
    "database or disk is full": "no space is left on the file's disk",
    "attempt to write a readonly database": "the file, its directory or its "
    "filesystem is read-only",
    "file is not a database": "it is not a SQLite database",
    "database disk image is malformed": "the file is damaged",
    "unable to open database file": "the file or its directory cannot be opened",
}


class SQLiteStore(SQLStore[sqlite3.Connection]):
    """Durable loops in one SQLite file.

    Args:
        path: the database file (created if missing, with `file_mode`).
        durability: `"normal"` (the default) or `"strict"` (fsync every commit).
        events: keep the events the runtime's loops publish, for
            `Runtime.watch` to resume a stream from a seq (each commit writes
            the events published since the one before).
        lease_ttl: seconds a runtime's lease on a loop lasts unless renewed.
        busy_timeout: seconds to wait for another process's write lock.
        file_mode: the permissions of the files it creates (less the umask):
            the database, which SQLite's `-wal` and `-shm` files copy, and
            `<path>-owners`. Readable by their owner only by default, since
            the store holds prompts and tool outputs; `0o660` shares them with
            a group. Existing files keep their own.
        read_only: open an existing store to read it only (`loops`, `load`,
            `events`, ... ; what `agentfsm loops` does): the file is opened
            read-only, so it is never created, changed or checkpointed, and
            every write, lease and presence is refused (`StoreError`). SQLite
            may leave empty `-wal` and `-shm` files beside a file no other
            process has open, as any reader of a WAL database does.

    Raises:
        StoreSchemaError: (at open) the file is not an agentfsm store, or one
            of another layout.
        StoreError: (at open and after) the file cannot be read or written;
            the message names it and the cause.
    """

    dialect = _DIALECT

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        durability: Literal["normal", "strict"] = "normal",
        events: bool = False,
        lease_ttl: float = 30.0,
        busy_timeout: float = 10.0,
        file_mode: int = 0o600,
        read_only: bool = False,
    ) -> None:
        check("path", path, str | os.PathLike, "a str or a path")
        one_of("durability", durability, ("normal", "strict"))
        check("events", events, bool)
        check("read_only", read_only, bool)
        lease_ttl = seconds("lease_ttl", lease_ttl, positive=True)
        self.path = os.fspath(path)
        self.where = self.path
        self.durability = durability
        self._busy_timeout = seconds("busy_timeout", busy_timeout)
        self.file_mode = file_mode_of(file_mode)
        self._identity: tuple[int, int] | None = None
        self._moved: StoreError | None = None
        """Why the store writes no more: its file was deleted or replaced."""
        self._ids: dict[str, tuple[Lease, int]] = {}
        """The id of each loop's next row (the lease writing it, the id),
        counted while this store writes it. Used in the store's thread only."""
        super().__init__(
            events=events,
            lease_ttl=lease_ttl,
            thread_name=f"agentfsm-sqlite {self.path}",
            read_only=read_only,
        )

    # ------------------------------------------------------------ connection

    def _connect(self) -> sqlite3.Connection:
        if self.read_only:
            return self._connect_read_only()
        self._check_path()
        # Created here, not by SQLite (which would make it 0644 less the
        # umask): SQLite gives the `-wal` and `-shm` files the database's mode.
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, self.file_mode)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot create the file ({exc})") from exc
        else:
            os.close(fd)
        db = sqlite3.connect(
            self.path,
            check_same_thread=False,  # used from the store's thread only
            isolation_level=None,  # transactions are explicit
            timeout=self._busy_timeout,
        )
        try:
            self._check_layout(db)
            db.execute("PRAGMA journal_mode=WAL")
            sync = "FULL" if self.durability == "strict" else "NORMAL"
            db.execute(f"PRAGMA synchronous={sync}")
            stat = os.stat(self.path)
            self._identity = (stat.st_dev, stat.st_ino)
        except BaseException:
            db.close()
            raise
        return db

    def _connect_read_only(self) -> sqlite3.Connection:
        """A connection that cannot write (SQLite's `mode=ro`: nor create the
        file, nor checkpoint its WAL at close), the layout checked."""
        self._check_path()
        if not os.path.exists(self.path):
            raise StoreError(
                f"{self.path}: no such file (a read-only store is not created)"
            )
        uri = "file:" + urllib.parse.quote(os.path.abspath(self.path)) + "?mode=ro"
        db = sqlite3.connect(
            uri,
            uri=True,
            check_same_thread=False,  # used from the store's thread only
            isolation_level=None,
            timeout=self._busy_timeout,
        )
        try:
            try:
                db.execute("BEGIN")  # one state of the file for the three reads
                try:
                    if not self._judge_layout(*self._layout_of(db)):
                        raise StoreSchemaError(
                            f"{self.path} holds no agentfsm store (an empty SQLite "
                            "database; a read-only store is not made)"
                        )
                    self._has_requests = _holds_table(db, "requests")
                    self._has_breakpoints = _holds_table(db, "breakpoints")
                finally:
                    db.execute("ROLLBACK")
            except sqlite3.OperationalError as exc:
                raise self._unreadable_here(exc) from None
            stat = os.stat(self.path)
            self._identity = (stat.st_dev, stat.st_ino)
        except BaseException:
            db.close()
            raise
        return db

    def _check_path(self) -> None:
        """Refuse a path that cannot be a store's file: a directory."""
        if os.path.isdir(self.path):
            raise StoreError(
                f"{self.path} is a directory: give the store's file (e.g. "
                f"{os.path.join(self.path, 'loops.db')})"
            )

    def _unreadable_here(self, exc: sqlite3.OperationalError) -> Exception:
        """Why a read-only connection could not read the file: SQLite makes a
        WAL store's `-shm` file beside it even to read it, which a reader
        cannot do in a directory it may not write."""
        folder = os.path.dirname(os.path.abspath(self.path))
        shm = f"{self.path}-shm"
        if not os.path.exists(shm) and not os.access(folder, os.W_OK):
            return StoreError(
                f"{self.path}: cannot be read: SQLite needs to create {shm} "
                f"to read a store, and this user cannot write to {folder}: "
                "read it as a user who can (the writer's), or copy the store's "
                f"files ({os.path.basename(self.path)} and its -wal, if any) "
                "to a directory this user can write"
            )
        return self._failure(exc)

    def _layout_readable(self, version: int) -> None:
        """Refuse an agentfsm store of a layout this version does not read."""
        if version > _LAYOUT:
            raise StoreSchemaError(
                f"{self.path} was written by a newer agentfsm (store layout "
                f"{version}; this one reads up to {_LAYOUT}): upgrade "
                "agentfsm to open it"
            )
        if version < _LAYOUT:
            raise StoreSchemaError(
                f"{self.path} was written by an earlier agentfsm (store "
                f"layout {version}; this one reads layout {_LAYOUT} only): "
                "finish its loops with that version, or give this one a "
                "new file"
            )

    def _layout_of(self, db: sqlite3.Connection) -> tuple[int, int, list[str]]:
        """The file's SQLite application id, user version and objects.

        Raises:
            StoreSchemaError: the file is not a SQLite database.
        """
        try:
            (app,) = db.execute("PRAGMA application_id").fetchone()
            (version,) = db.execute("PRAGMA user_version").fetchone()
            # Every object, not tables only: a file of views is another's too.
            tables = sorted(
                f"{name}" if kind == "table" else f"{name} ({kind})"
                for kind, name in db.execute("SELECT type, name FROM sqlite_master")
            )
        except sqlite3.DatabaseError as exc:
            raise self._not_sqlite(exc) from None
        return app, version, tables

    def _not_sqlite(self, exc: sqlite3.DatabaseError) -> Exception:
        """What to raise for `exc`, raised opening the file: a file that is no
        SQLite database is refused as such, any other error stays itself."""
        if "file is not a database" not in str(exc):
            return exc
        return StoreSchemaError(
            f"{self.path} is not a SQLite database, so not an agentfsm store: "
            "it is left as it was"
        )

    def _judge_layout(self, app: int, version: int, tables: list[str]) -> bool:
        """Whether the file holds an agentfsm store of this layout (True) or
        nothing (False: a store may be made in it); the one check of readers
        and writers.

        Raises:
            StoreSchemaError: it holds another's data, or a store of a layout
                this version does not read.
        """
        earlier = app == 0 and 0 < version < _LAYOUT and "loops" in tables
        if app == _APPLICATION_ID or earlier:
            self._layout_readable(version)
            return True
        if tables or app or version:
            raise StoreSchemaError(
                f"{self.path} is not an agentfsm store (SQLite application_id "
                f"{app}, user_version {version}, objects: "
                f"{', '.join(tables) or 'none'}): it is left as it was"
            )
        return False

    def _check_layout(self, db: sqlite3.Connection) -> None:
        """Refuse a file that is not an agentfsm store of this layout; make a
        new (empty) one one. In a write transaction: two processes opening a
        new file at once make it once, and neither sees it half made."""
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.DatabaseError as exc:
            raise self._not_sqlite(exc) from None
        try:
            if not self._judge_layout(*self._layout_of(db)):
                for statement in _SCHEMA:
                    db.execute(statement)
                db.execute(f"PRAGMA application_id={_APPLICATION_ID}")
                db.execute(f"PRAGMA user_version={_LAYOUT}")
            # A store made before the inbox (or the breakpoints) gets them.
            for statement in (*_REQUESTS, *_BREAKPOINTS):
                db.execute(statement)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _disconnect(self, conn: sqlite3.Connection) -> None:
        conn.close()

    _driver_error = sqlite3.Error

    def _failure(self, exc: Exception) -> StoreError:
        message = str(exc)
        hint = next((h for m, h in _HINTS.items() if message.startswith(m)), None)
        if hint is not None and "busy_timeout" in hint:
            hint += f" ({self._busy_timeout:g}s)"
        if _read_only(self.path):
            hint = "the file's filesystem is read-only"
        if self.read_only and message.startswith("attempt to write"):
            hint = "the store was opened with read_only=True"
        detail = f"{message} ({hint})" if hint else message
        return StoreError(f"{self.path}: {detail}")

    def _live(self) -> sqlite3.Connection:
        """The connection, while its file is the one it opened (checked at every
        operation: ~1 µs a trip)."""
        conn = super()._live()
        if self._moved is not None:
            raise self._moved
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            stat = None
        if stat is not None and (stat.st_dev, stat.st_ino) == self._identity:
            return conn
        # Deleted or replaced: SQLite would go on writing the old file (every
        # commit lost), and leave its WAL at the path, where the next
        # connection would apply it to whatever file is there now. So the
        # store writes nothing more, and empties that WAL first.
        self._moved = StoreError(
            f"{self.path}: the database file was deleted or replaced since the "
            "store opened it: nothing more is written to it"
        )
        with contextlib.suppress(sqlite3.Error):
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        raise self._moved

    # ------------------------------------------------------------- statements

    def _execute(
        self, conn: sqlite3.Connection, sql: str, params: Mapping[str, Any] = {}
    ) -> sqlite3.Cursor:
        return conn.execute(sql, params)

    def _transaction(self, conn: sqlite3.Connection) -> AbstractContextManager[None]:
        return _within(conn, "BEGIN IMMEDIATE")

    def _snapshot(self, conn: sqlite3.Connection) -> AbstractContextManager[None]:
        return _within(conn, "BEGIN")

    # ---------------------------------------------------------------- commits

    def _commit_conn(self) -> sqlite3.Connection:
        # The trip's `_live` checked the file (a `stat` a trip, not a commit).
        conn = self._conn
        if conn is None:
            raise StoreError(f"the store {self.where} is not open")
        if self._moved is not None:
            raise self._moved
        return conn

    def _write_commit(
        self, conn: sqlite3.Connection, row: LogRow, run_status: str | None
    ) -> None:
        commit = row.commit
        lease = commit.lease
        loop_id = commit.loop_id
        values = row.values
        fence = (lease.owner, lease.epoch)
        known = self._ids.get(loop_id)
        row_id = (
            known[1]
            if known is not None and (known[0] is lease or known[0] == lease)
            else None
        )
        if (
            not commit.new
            and row_id is not None
            and run_status is not None
            and row.status in (None, run_status)
            and not row.events
            and not row.blobs
            and not commit.requests
        ):
            # The loop's row holds this status already: the commit is its log
            # row, one statement, which lands only while the fence holds.
            if not conn.execute(_APPEND_FENCED, (*values, *fence, row_id)).rowcount:
                raise self._fence(conn, commit)
            self._ids[loop_id] = (lease, row_id + 1)
            return
        now = time.time()
        try:
            with self._transaction(conn):
                if commit.new:
                    agent = commit.record.agent_id if commit.record else ""
                    (number,) = conn.execute(_NEW_NUMBER).fetchone()
                    new = (loop_id, number, agent, row.status, lease.owner)
                    try:
                        conn.execute(_NEW_LOOP, (*new, now + self.lease_ttl, now))
                    except sqlite3.IntegrityError:
                        raise LoopIdTakenError(loop_id) from None
                    row_id = number << 32
                elif row.status is not None:
                    lease_until = now + self.lease_ttl
                    status = (row.status, lease_until, now, loop_id, *fence)
                    if not conn.execute(_NEW_STATUS, status).rowcount:
                        raise _Fenced
                elif conn.execute(_HELD, (loop_id, *fence)).fetchone() is None:
                    raise _Fenced
                if row_id is None:
                    (row_id,) = conn.execute(_NEXT_ID, (loop_id,)).fetchone()
                for digest, text, size in row.blobs:
                    written = conn.execute(_BLOB, (digest, size))
                    if written.rowcount:  # (the same text is one blob)
                        _write_out(conn, written.lastrowid, text)
                conn.execute(_APPEND, (row_id, *values))
                if row.events:
                    outlined = values[-1]
                    conn.executemany(
                        _EVENT,
                        [(loop_id, seq, text, outlined) for seq, text in row.events],
                    )
                if commit.requests:
                    self._applied(conn, commit)
        except _Fenced:
            raise self._fence(conn, commit) from None
        self._ids[loop_id] = (lease, row_id + 1)

    def _forget(self, loop_id: str) -> None:
        super()._forget(loop_id)
        self._ids.pop(loop_id, None)

    def _forget_all(self) -> None:
        super()._forget_all()
        self._ids.clear()

    # --------------------------------------------------------------- presence

    def _owners(self) -> _OwnersFile:
        return _owners_file(self.path, self.file_mode)

    # The presence file's locks are taken in the caller's thread (a lock tried,
    # never waited for, on a local file), not the store's: they hold whatever
    # the database file went through (deleted, replaced).

    def _lock_slot(self, conn: sqlite3.Connection, slot: int) -> None:
        self._owners().hold(slot)

    def _unlock_slot(self, conn: sqlite3.Connection, slot: int) -> None:
        self._owners().drop(slot)

    def _slot_free(self, conn: sqlite3.Connection, slot: int) -> bool | None:
        return self._owners().free(slot)

    async def hold_presence(self, owner: str) -> None:
        self._refuse_presence()  # (before `<path>-owners` is created)
        self._owners().hold(self._presence_slot(owner))
        await Leases.hold_presence(self, owner)

    async def drop_presence(self, owner: str) -> None:
        await Leases.drop_presence(self, owner)
        self._owners().drop(self._presence_slot(owner))

    async def alive(self, owner: str) -> bool | None:
        if owner in _PRESENT:
            return True
        host = owner.rsplit(":", 2)[0]
        if host != socket.gethostname():
            return None  # another host: its locks may not reach this one
        free = self._owners().free(self._presence_slot(owner))
        return None if free is None else not free

    async def renew(
        self, owner: str, loop_ids: Sequence[str] | None = None
    ) -> dict[str, int]:
        self._owners().refresh()  # (a presence file deleted meanwhile)
        return await super().renew(owner, loop_ids)


def _holds_table(db: sqlite3.Connection, name: str) -> bool:
    """Whether the file holds the table `name` (one added to the layout
    later: `_REQUESTS`, `_BREAKPOINTS`)."""
    found = db.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
    ).fetchone()
    return found is not None


def _write_out(conn: sqlite3.Connection, rowid: int | None, text: str) -> None:
    """Write a large string into its blob's row (made its size, zeroed), a
    chunk at a time: never a copy of it whole (see `_outline`)."""
    assert rowid is not None
    with conn.blobopen("blobs", "data", rowid) as blob:
        for chunk in chunks(text):
            blob.write(chunk)


def _read_only(path: str) -> bool:
    """Whether the filesystem holding `path` is mounted read-only."""
    try:
        flags = os.statvfs(os.path.dirname(os.path.abspath(path))).f_flag
    except OSError:
        return False
    return bool(flags & os.ST_RDONLY)


class _Fenced(Exception):
    """The fence did not hold (the transaction is rolled back, then the store
    says why)."""


class _OwnersFile:
    """`<path>-owners`: a byte-range lock per live runtime (its slot), held by
    this process through one descriptor (a POSIX lock is the process's: closing
    any descriptor of the file would drop them all, and a lock of this process
    never conflicts with another of its own, so this process's slots are
    counted here and never tested).

    The descriptor is open while this process holds a slot (closed with the
    last), and is the file at the path whenever a slot is taken or tested: a
    file deleted (or replaced) meanwhile is opened again and this process's
    slots locked in it, or other processes, which see only the file at the
    path, would find this one's runtimes dead. The keeper's lease renewal
    checks it too (`refresh`), so a file deleted while slots are held is back
    within a third of a lease."""

    def __init__(self, path: str, mode: int) -> None:
        self.path = path
        self.mode = mode
        """The permissions the file is created with (the database's)."""
        self.fd: int | None = None
        self.held: dict[int, int] = {}
        self.lock = threading.Lock()  # (each store has its own thread)

    def _fd(self) -> int:
        """The descriptor of the file at the path, this process's slots locked."""
        fd = self.fd
        if fd is not None:
            try:
                stat = os.stat(self.path)
            except FileNotFoundError:
                stat = None
            mine = os.fstat(fd)
            if stat is not None and (stat.st_dev, stat.st_ino) == (
                mine.st_dev,
                mine.st_ino,
            ):
                return fd
            os.close(fd)  # another file now: this process's locks move to it
        fd = self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, self.mode)
        for slot in self.held:
            self._lock(fd, slot)
        return fd

    def _lock(self, fd: int, slot: int) -> None:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise StoreError(f"{self.path}: cannot lock ({exc})") from exc
            # Another live process holds the slot (the hash of another owner's
            # name): it still says "alive" for this one.

    def hold(self, slot: int) -> None:
        with self.lock:
            held = self.held.get(slot, 0)
            fd = self._fd()
            if not held:
                self._lock(fd, slot)
            self.held[slot] = held + 1

    def drop(self, slot: int) -> None:
        with self.lock:
            held = self.held.get(slot, 0) - 1
            if held > 0:
                self.held[slot] = held
                return
            self.held.pop(slot, None)
            fd = self.fd
            if fd is None:
                return
            if self.held:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, slot)
            else:
                os.close(fd)  # (the last: its locks go with it)
                self.fd = None

    def free(self, slot: int) -> bool | None:
        with self.lock:
            if slot in self.held:
                return None  # this process holds it: it cannot tell for another
            fd = self._fd()
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    return False
                raise StoreError(f"{self.path}: cannot test a lock ({exc})") from exc
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, slot)
            if not self.held:
                os.close(fd)
                self.fd = None
            return True

    def refresh(self) -> None:
        """Lock this process's slots in the file at the path, if it changed."""
        with self.lock:
            if self.held:
                self._fd()


_OWNERS: dict[str, _OwnersFile] = {}
_OWNERS_LOCK = threading.Lock()


def _owners_file(path: str, mode: int) -> _OwnersFile:
    """This process's `_OwnersFile` for the database at `path` (one per file,
    whatever number of stores opened it; created with the first's `mode`)."""
    key = os.path.realpath(path) + "-owners"
    with _OWNERS_LOCK:
        owners = _OWNERS.get(key)
        if owners is None:
            owners = _OWNERS[key] = _OwnersFile(key, mode)
        return owners


@contextmanager
def _within(conn: sqlite3.Connection, begin: str) -> Iterator[None]:
    """A transaction begun by `begin`, committed unless the body raises."""
    conn.execute(begin)
    try:
        yield
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
