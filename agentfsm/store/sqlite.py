"""`SQLiteStore`: the embedded durable store (stdlib `sqlite3`, one file).

One connection in WAL mode, used from one thread of the store's own
(`_thread.StoreThread`, from `open` to `close`), so it runs on asyncio and trio
alike and never blocks the event loop. Every write is one transaction: one
statement, or `BEGIN IMMEDIATE` ... `COMMIT`. A cancelled caller cannot
abandon a write: the thread runs it to the end, and the cancellation is
delivered after it.

`durability="normal"` (`synchronous=NORMAL`): a commit survives the process
crashing; a power loss may lose the last commits (never corrupt the file).
`durability="strict"` (`synchronous=FULL`): every commit is fsynced. Measured
here: ~0.1-0.25 ms per commit normal, ~4 ms strict.

Several processes may share the file (SQLite locks it); leases keep them from
running one loop twice.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from json.encoder import encode_basestring
from typing import Any, Final, Literal, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict

from agentfsm._keys import number_text
from agentfsm._models import json_of
from agentfsm.events import AgentEvent, AgentEventAdapter
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
from ._rows import (
    Paths,
    path_of,
    prefix_length,
    record_of,
    record_text,
    shared_text,
    steps_text,
)
from ._thread import StoreThread

__all__ = ("SQLiteStore",)

_T = TypeVar("_T")

_LAYOUT = 4
"""The layout this store writes (`PRAGMA user_version`). Layout 1 (agentfsm
before the commit log) kept a table per kind of row; layout 2 kept the ledger
in a table of its own; layout 3 found a loop's rows by an index on their loop
id. None is read."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS loops (
    loop_id TEXT PRIMARY KEY,
    number INTEGER NOT NULL,
    agent_id TEXT NOT NULL,
    status TEXT NOT NULL,
    owner TEXT,
    lease_until REAL NOT NULL DEFAULT 0,
    updated REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS loops_unfinished ON loops (owner) WHERE status != 'done';
CREATE TABLE IF NOT EXISTS log (
    id INTEGER PRIMARY KEY,
    loop_id TEXT NOT NULL,
    seq INTEGER,
    record TEXT,
    earlier TEXT,
    changes TEXT,
    request INTEGER,
    ledger TEXT,
    path_from INTEGER,
    path TEXT,
    shared TEXT
);
CREATE TABLE IF NOT EXISTS inferences (
    loop_id TEXT NOT NULL,
    request INTEGER NOT NULL,
    output TEXT NOT NULL,
    PRIMARY KEY (loop_id, request)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS contexts (
    context_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    item TEXT NOT NULL,
    digest TEXT NOT NULL,
    PRIMARY KEY (context_id, position)
);
CREATE TABLE IF NOT EXISTS events (
    loop_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    event TEXT NOT NULL,
    PRIMARY KEY (loop_id, seq)
);
"""
"""The commit log (`log`): one row per commit, whatever it carries: the
record, the records of the transitions written with it (`earlier`, a JSON
array), the path's steps since the row before (`path_from`, `path`), what the
records of the store's run share (`shared`, in the run's first row: see
`agentfsm.store._rows`), what the context and the model gave (`changes`: the
items added from position `first`, the slots replaced, a truncation, a model
output, whose request number is `request`), and the tool-call ledger's news
(`ledger`: see `_fold_ledger`). A ledger write outside a commit
(`begin_call`, `end_call`, `mark_uncertain`) is a row of its own, with no
record (`seq` and `record` NULL). The unfinished loops are indexed by owner
(`loops_unfinished`, `'done'` being `LoopStatus.done`'s value): a runtime's
lease renewal and `unfinished` read them, not every loop the file holds.

One row in one table is what makes a commit cheap: each table (and index) a
transaction touches is a page more to write to the WAL. So a commit is one
statement, its own transaction, unless the loop's row (`loops`: status and
lease) must change: it is written only when the loop's status changes or its
lease is taken. With the ledger in a table of its own (layout 2), the six
commits of the benchmark's run that carry intents or outputs were
transactions of three statements, touching three more b-trees: the worker
thread spent ~100 µs a run more (98 against 83 µs a trip, 7 trips a run,
bench/bench_durable.py's workload). For the same reason a loop's rows are
found by their ids, not an index: each loop has a number (`loops.number`,
given as its first row is written: one more than the greatest in the log),
and its rows are the ids from `number << 32` on, in the order they were
written. An index on the rows' loop ids (layout 3) was a b-tree more for
every commit to write (taken out, the store's SQL was 251 against 312 µs a
benchmark run; the ranges, A/B with the SQL inline: 791 against 820 µs a
run). A loop holds at most 2**32 rows (commits and ledger writes),
a file 2**31 loops. Tests: tests/test_durable.py (the ledger through every
store), tests/test_durable_crash.py."""

_ROWS: Final = 1 << 32
"""A loop's ids: from its `number << 32` on (see `_SCHEMA`)."""


def _next_id(first: str) -> str:
    """The id of a loop's next row, in SQL, from the SQL of its first
    (`number << 32`). (An aggregate, `max(id)`, under `coalesce` scans the
    loop's rows; `ORDER BY id DESC LIMIT 1` seeks the last: ~1 µs.)"""
    return (
        f"coalesce((SELECT id FROM log WHERE id BETWEEN {first} AND"
        f" {first} + {_ROWS - 1} ORDER BY id DESC LIMIT 1) + 1, {first})"
    )


_SPAN: Final = (
    "id BETWEEN (SELECT number << 32 FROM loops WHERE loop_id = ?1)"
    f" AND (SELECT (number << 32) + {_ROWS - 1} FROM loops WHERE loop_id = ?1)"
)
"""A condition on `log`: the rows of the loop `?1` (none if it has none)."""

_LOG_COLUMNS: Final = (
    "loop_id, seq, record, earlier, changes, request, ledger, path_from, path, shared"
)
_APPEND: Final = (
    f"INSERT INTO log (id, {_LOG_COLUMNS})"
    f" SELECT {_next_id('(l.number << 32)')}, ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10"
    " FROM loops AS l WHERE l.loop_id = ?1"
)
"""A commit's row (the loop's row written already)."""
_APPEND_OWNED: Final = f"{_APPEND} AND l.owner = ?11"
"""A commit's row, written only if the runtime holds the loop (one statement:
its own transaction)."""
_NEW_LOOP: Final = (
    "INSERT INTO loops (loop_id, number, agent_id, status, owner, lease_until,"
    " updated) VALUES (?, (SELECT coalesce(max(id) >> 32, 0) + 1 FROM log),"
    " ?, ?, ?, ?, ?)"
)
"""A new loop's row. Its number is one more than the greatest in the log (its
last id's)."""
_NEW_STATUS: Final = (
    "UPDATE loops SET status = ?, lease_until = ?, updated = ?"
    " WHERE loop_id = ? AND owner = ?"
)
"""The loop's row, with a new status, while the runtime holds the loop."""
_TAKE: Final = (
    f"{_NEW_LOOP} ON CONFLICT (loop_id) DO UPDATE SET status = excluded.status,"
    " owner = excluded.owner, lease_until = excluded.lease_until,"
    " updated = excluded.updated"
    " WHERE loops.owner IS NULL OR loops.owner = excluded.owner"
    " OR loops.lease_until <= excluded.updated"
)
"""The loop's row, written as the runtime takes its lease (a recovered or
resumed loop's): one statement, which changes nothing while another runtime
holds a live lease on it (an update leaves its number as it was)."""
_APPEND_LEDGER = (
    f"INSERT INTO log (id, loop_id, ledger) SELECT {_next_id('(l.number << 32)')},"
    " ?1, ?2 FROM loops AS l WHERE l.loop_id = ?1"
)
"""A ledger write of its own (nothing if the loop is not in the store)."""


class _Changes(BaseModel):
    """A commit's `changes` column."""

    model_config = ConfigDict(defer_build=True)

    first: int
    truncate: bool
    items: list[ContextItem]
    replaced: list[tuple[int, ContextItem]]
    inference: tuple[int, InferenceOutput] | None


# Every entry names its key as `_key_text` does: `begin_call` finds a key's
# rows by that text.


def _key_text(key: str) -> str:
    return encode_basestring(key)  # `json.dumps(key, ensure_ascii=False)`


def _intent_entry(call: CallRecord, kind: str = "intent") -> str:
    # `json.dumps([kind, key, request, position, tool, call_id, attempt],
    # ensure_ascii=False)`, joined from its parts: ~1.2 µs an entry less (3 a
    # benchmark run); tests/internals/test_sqlite_log.py checks it is the same.
    return (
        f"[{encode_basestring(kind)}, {encode_basestring(call.key)}, "
        f"{number_text(call.request)}, {number_text(call.position)}, "
        f"{encode_basestring(call.tool)}, {encode_basestring(call.call_id)}, "
        f"{number_text(call.attempt)}]"
    )


def _done_entry(key: str, output: FunctionCallOutputItem, terminate: bool) -> str:
    return f'["done",{_key_text(key)},{json_of(output)},{_BOOL[terminate]}]'


_BOOL: Final = {False: "false", True: "true"}


def _fold_ledger(loop_id: str, texts: Iterable[str]) -> dict[str, CallRecord]:
    """The ledger of a loop: its `ledger` column's JSON arrays, in log order,
    folded into each call's entry by key. The entries:

    - `["intent", key, request, position, tool, call_id, attempt]`: a call a
      commit starts; kept only if the key is new (a commit of a recovered loop
      may name a call the ledger knows);
    - `["begun", ...the same]`: `begin_call`'s call, or new attempt of a known
      one (status `started`, its `attempt`; the rest of its entry is kept);
    - `["done", key, output, terminate]`: its output;
    - `["uncertain", key]`: a recovery paused the loop over it.
    """
    calls: dict[str, CallRecord] = {}
    for text in texts:
        for entry in json.loads(text):
            kind, key = entry[0], entry[1]
            known = calls.get(key)
            if kind == "intent" or kind == "begun":
                _, _, request, position, tool, call_id, attempt = entry
                if known is not None:
                    if kind == "begun":  # a new attempt: the rest is as it was
                        calls[key] = known.model_copy(
                            update={"status": "started", "attempt": attempt}
                        )
                    continue
                calls[key] = CallRecord(
                    key=key,
                    loop_id=loop_id,
                    request=request,
                    position=position,
                    tool=tool,
                    call_id=call_id,
                    status="started",
                    attempt=attempt,
                )
                continue
            if known is None:
                continue  # (no intent: nothing to update, as an UPDATE would do)
            if kind == "done":
                calls[key] = known.model_copy(
                    update={
                        "status": "done",
                        "output": FunctionCallOutputItem.model_validate(entry[2]),
                        "terminate": bool(entry[3]),
                    }
                )
            elif kind == "uncertain":
                calls[key] = known.model_copy(update={"status": "uncertain"})
            else:
                raise StoreError(f"unknown ledger entry {kind!r} of loop {loop_id}")
    return calls


_LEDGER_ROWS: Final = (
    f"SELECT ledger FROM log WHERE {_SPAN} AND ledger IS NOT NULL ORDER BY id"
)


class _NotOwned(Exception):
    """The loop's row does not name this runtime: the lease must be taken."""


class SQLiteStore(LoopStore):
    """Durable loops in one SQLite file.

    Args:
        path: the database file (created if missing).
        durability: `"normal"` (the default) or `"strict"` (fsync every commit).
        events: keep the events the runtime's loops publish, for
            `Runtime.watch` to resume a stream from a seq (written in batches
            by a task of the runtime; it costs what a subscriber to every
            event costs, and the writes).
        lease_ttl: seconds a runtime's lease on a loop lasts unless renewed.
        busy_timeout: seconds to wait for another process's write lock.

    Raises:
        StoreSchemaError: (at open) the file was written by a newer agentfsm.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        durability: Literal["normal", "strict"] = "normal",
        events: bool = False,
        lease_ttl: float = 30.0,
        busy_timeout: float = 10.0,
    ) -> None:
        if durability not in ("normal", "strict"):
            raise ConfigurationError(
                f"durability must be 'normal' or 'strict', got {durability!r}"
            )
        if not isinstance(path, str | os.PathLike):
            raise ConfigurationError(
                f"path must be a str or a path, got {type(path).__name__}"
            )
        self.path = os.fspath(path)
        self.durability = durability
        self.keeps_events = events
        self.lease_ttl = checked_lease_ttl(lease_ttl)
        self._busy_timeout = busy_timeout
        self._db: sqlite3.Connection | None = None
        self._thread = StoreThread(f"agentfsm-sqlite {self.path}")
        self._commits = 0
        self._bytes = 0
        self._statuses: dict[str, str] = {}
        """The status each loop's row holds, as this store last wrote it (a
        commit that keeps it writes only its log row). Used in the worker
        thread only; forgotten when a lease changes hands."""
        self._paths = Paths()

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(commits=self._commits, bytes_written=self._bytes)

    # ------------------------------------------------------------ connection

    async def open(self) -> None:
        if self._db is not None:
            return
        self._statuses.clear()  # (another process may have written meanwhile)
        self._paths.clear()
        await self._thread.open(self, self._connect_once, lambda: self._db is not None)

    def _connect_once(self) -> None:
        """Connect (in the store's thread), unless an `open` before did."""
        if self._db is None:
            self._db = self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(
            self.path,
            check_same_thread=False,  # used from one worker thread at a time
            isolation_level=None,  # transactions are explicit
            timeout=self._busy_timeout,
        )
        try:
            (version,) = db.execute("PRAGMA user_version").fetchone()
            if version > _LAYOUT:
                raise StoreSchemaError(
                    f"{self.path} was written by a newer agentfsm (store layout "
                    f"{version}; this one reads up to {_LAYOUT}): upgrade "
                    "agentfsm to open it"
                )
            if 0 < version < _LAYOUT:
                raise StoreSchemaError(
                    f"{self.path} was written by an earlier agentfsm (store layout "
                    f"{version}; this one reads layout {_LAYOUT} only): finish its "
                    "loops with that version, or give this one a new file"
                )
            db.execute("PRAGMA journal_mode=WAL")
            sync = "FULL" if self.durability == "strict" else "NORMAL"
            db.execute(f"PRAGMA synchronous={sync}")
            # IF NOT EXISTS throughout: two processes may create it at once,
            # and a file of this layout gains the tables it lacks.
            db.executescript(_SCHEMA)
            if version < _LAYOUT:
                db.execute(f"PRAGMA user_version={_LAYOUT}")
        except BaseException:
            db.close()
            raise
        return db

    async def close(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            try:
                with anyio.CancelScope(shield=True):
                    await self._run(db.close, db)
            finally:
                self._thread.stop()  # after the calls given it so far

    async def _run(
        self, fn: Callable[[], _T], db: sqlite3.Connection | None = None
    ) -> _T:
        if (db or self._db) is None or not self._thread.running:
            raise StoreError(f"the store {self.path} is not open")
        return await self._thread.run(fn)

    def _read(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run `fn`, reads of several statements, in one read transaction (in
        the store's thread): they see one state of the file, whatever another
        process commits meanwhile."""
        db = self._conn
        db.execute("BEGIN")
        try:
            result = fn(db)
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    @property
    def _conn(self) -> sqlite3.Connection:
        db = self._db
        if db is None:
            raise StoreError(f"the store {self.path} is not open")
        return db

    def _write(
        self, fn: Callable[[sqlite3.Connection], int], *, transaction: bool = True
    ) -> None:
        """Run `fn` in one transaction (in the store's thread); it returns the
        bytes it wrote. `transaction=False`: `fn` is one statement, a
        transaction of its own."""
        db = self._conn
        if not transaction:
            written = fn(db)
            self._commits += 1
            self._bytes += written
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            written = fn(db)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        self._commits += 1
        self._bytes += written

    # ------------------------------------------------------------------ loops

    async def commit(self, commit: Commit, owner: str) -> None:
        await self._run(partial(self._commit_in_thread, commit, owner))

    async def commit_many(
        self, commits: Sequence[tuple[Commit, str]]
    ) -> list[Exception | None]:
        # One trip to the store's thread for all of them, a transaction each.
        return await self._run(
            partial(commits_in_turn, commits, self._commit_in_thread)
        )

    def _commit_in_thread(self, commit: Commit, owner: str) -> None:
        """Write one commit, in the store's thread (its JSON is made here too,
        off the event loop): one statement when the loop's row need not
        change (most commits), else a transaction."""
        record = commit.record
        loop_id = record.loop_id
        status = record.status.value
        # This store wrote the loop's last rows (its run, see `_rows`), and the
        # loop's row holds this status already: the commit is its log row.
        run = loop_id in self._paths
        row, written = self._log_row(commit, run=run)
        if run and self._statuses.get(loop_id) == status:

            def append(db: sqlite3.Connection) -> int:
                # Only while this runtime holds the loop: nobody else wrote it.
                if db.execute(_APPEND_OWNED, (*row, owner)).rowcount:
                    return written
                raise _NotOwned  # the lease was given up, or taken: take it

            try:  # one statement: a transaction of its own
                self._write(append, transaction=False)
                self._paths.wrote(loop_id, record.path)
                return
            except _NotOwned:
                pass

        def write(db: sqlite3.Connection) -> int:
            nonlocal row, written
            now = time.time()
            lease = now + self.lease_ttl
            if commit.new:  # its row is new too: a loop of its id is refused
                try:
                    db.execute(
                        _NEW_LOOP,
                        (loop_id, record.agent_id, status, owner, lease, now),
                    )
                except sqlite3.IntegrityError:
                    raise LoopIdTakenError(loop_id) from None
            elif not (
                run
                and db.execute(
                    _NEW_STATUS, (status, lease, now, loop_id, owner)
                ).rowcount
            ):
                self._take(db, commit, owner, lease, now)
                if run:
                    # Another runtime took the loop since this store's last row
                    # (and may have written it): the row starts a run, holding
                    # it all.
                    row, written = self._log_row(commit, run=False)
            db.execute(_APPEND, row)  # (the loop's row is there: one row)
            return written

        self._write(write)
        if status == LoopStatus.done.value:
            self._forget(loop_id)  # it writes no more
        else:
            self._statuses[loop_id] = status
            self._paths.wrote(loop_id, record.path)

    def _take(
        self,
        db: sqlite3.Connection,
        commit: Commit,
        owner: str,
        lease: float,
        now: float,
    ) -> None:
        """Take the loop's lease and write its row (in a commit's transaction),
        unless another runtime holds a live lease on it."""
        record = commit.record
        loop_id = record.loop_id
        taken = db.execute(
            _TAKE,
            (loop_id, record.agent_id, record.status.value, owner, lease, now),
        ).rowcount
        if not taken:
            (holder,) = db.execute(
                "SELECT owner FROM loops WHERE loop_id = ?", (loop_id,)
            ).fetchone()
            raise LoopLockedError(loop_id, holder)

    def _forget(self, loop_id: str) -> None:
        """The loop's run ends here (see `_rows`)."""
        self._statuses.pop(loop_id, None)
        self._paths.pop(loop_id)

    def _log_row(self, commit: Commit, *, run: bool) -> tuple[tuple[object, ...], int]:
        """A commit's `log` row (see `_SCHEMA`), and its bytes: a row of the
        loop's run (`run`), or the first of a run (holding what a run shares,
        and the whole path). The JSON is joined from each part's own JSON, not
        made again."""
        record = commit.record
        path = record.path
        path_from = self._paths.start(record.loop_id, path) if run else 0
        shared = None if run else shared_text(record)
        text = record_text(record, len(path))
        earlier = (
            "["
            + ",".join(
                record_text(r, prefix_length(r.path, path)) for r in commit.earlier
            )
            + "]"
            if commit.earlier
            else None
        )
        steps = steps_text(path[path_from:])
        changes = None
        request = None
        inference = commit.inference
        if commit.items or commit.replaced or commit.truncate or inference:
            items = ",".join(map(json_of, commit.items))
            replaced = ",".join(
                f"[{at},{json_of(item)}]"
                for at, item in (commit.replaced or {}).items()
            )
            output = "null"
            if inference is not None:
                request = inference[0]
                output = f"[{request},{json_of(inference[1])}]"
            truncate = "true" if commit.truncate else "false"
            changes = (
                f'{{"first":{commit.first},"truncate":{truncate},"items":[{items}],'
                f'"replaced":[{replaced}],"inference":{output}}}'
            )
        ledger = None
        if commit.intents or commit.ended:
            ledger = (
                "["
                + ",".join(
                    [
                        *map(_intent_entry, commit.intents),
                        *(_done_entry(*ended) for ended in commit.ended),
                    ]
                )
                + "]"
            )
        written = len(text) + len(steps)
        for part in (earlier, changes, ledger, shared):
            if part is not None:
                written += len(part)
        row = (
            record.loop_id,
            record.seq,
            text,
            earlier,
            changes,
            request,
            ledger,
            path_from,
            steps,
            shared,
        )
        return row, written

    async def load(self, loop_id: str) -> StoredLoop | None:
        def read(db: sqlite3.Connection) -> StoredLoop | None:
            row = db.execute(
                "SELECT owner, lease_until FROM loops WHERE loop_id = ?", (loop_id,)
            ).fetchone()
            if row is None:
                return None
            owner, lease_until = row
            (last, text) = db.execute(
                f"SELECT id, record FROM log WHERE {_SPAN} AND record IS NOT NULL"
                " ORDER BY id DESC LIMIT 1",
                (loop_id,),
            ).fetchone()
            items: list[ContextItem] = []
            for (changes,) in db.execute(
                f"SELECT changes FROM log WHERE {_SPAN} AND changes IS NOT NULL"
                " ORDER BY id",
                (loop_id,),
            ):
                change = _Changes.model_validate_json(changes)
                first = change.first
                if change.truncate:
                    del items[first:]
                items[first : first + len(change.items)] = change.items
                for at, item in change.replaced:
                    items[at] = item
            return StoredLoop(
                self._stored_record(db, loop_id, last, json.loads(text)),
                items,
                owner if lease_until > time.time() else None,
            )

        return await self._run(lambda: self._read(read))

    async def record_at(self, loop_id: str, seq: int) -> LoopRecord | None:
        def read(db: sqlite3.Connection) -> LoopRecord | None:
            # The record of the greatest seq up to `seq`; of several of one
            # seq (a runtime wrote it again after another did), the last
            # written: a row's own record, or one a later commit carried.
            found: tuple[tuple[int, int], dict[str, Any]] | None = None
            row = db.execute(
                f"SELECT seq, id, record FROM log WHERE {_SPAN} AND seq <= ?2"
                " AND record IS NOT NULL ORDER BY seq DESC, id DESC LIMIT 1",
                (loop_id, seq),
            ).fetchone()
            if row is not None:
                found = ((row[0], row[1]), json.loads(row[2]))
            # The rows carrying records from before `seq` (their first, the
            # oldest, is): one, but for a loop two runtimes wrote.
            for row_id, earlier in db.execute(
                f"SELECT id, earlier FROM log WHERE {_SPAN} AND seq > ?2"
                " AND earlier IS NOT NULL AND json_extract(earlier, '$[0].seq') <= ?2",
                (loop_id, seq),
            ):
                for data in json.loads(earlier):
                    at = (data["seq"], row_id)
                    if data["seq"] <= seq and (found is None or at > found[0]):
                        found = (at, data)
            if found is None:
                return None
            return self._stored_record(db, loop_id, found[0][1], found[1])

        return await self._run(lambda: self._read(read))

    @staticmethod
    def _stored_record(
        db: sqlite3.Connection, loop_id: str, row_id: int, data: dict[str, Any]
    ) -> LoopRecord:
        """A record of the loop's log (`data`, its text's, from the row
        `row_id`), made whole: what its run shares, and its path from the
        steps of the rows up to its own (see `_rows`)."""
        shared = db.execute(
            f"SELECT shared FROM log WHERE {_SPAN} AND id <= ?2"
            " AND shared IS NOT NULL ORDER BY id DESC LIMIT 1",
            (loop_id, row_id),
        ).fetchone()
        if shared is None:
            raise StoreError(f"no row of loop {loop_id} holds what its records share")
        path = path_of(
            db.execute(
                f"SELECT path_from, path FROM log WHERE {_SPAN} AND id <= ?2"
                " AND path IS NOT NULL ORDER BY id",
                (loop_id, row_id),
            )
        )
        return record_of(data, json.loads(shared[0]), path)

    async def unfinished(self) -> list[str]:
        def read() -> list[str]:
            rows = self._conn.execute(
                "SELECT loop_id FROM loops INDEXED BY loops_unfinished"
                " WHERE status != 'done' ORDER BY loop_id",
            )
            return [loop_id for (loop_id,) in rows]

        return await self._run(read)

    async def record_inference(
        self, loop_id: str, request: int, output: InferenceOutput
    ) -> None:
        text = output.model_dump_json()

        def write(db: sqlite3.Connection) -> int:
            db.execute(
                "INSERT OR REPLACE INTO inferences (loop_id, request, output)"
                " VALUES (?, ?, ?)",
                (loop_id, request, text),
            )
            return len(text)

        await self._run(lambda: self._write(write))

    async def context(
        self, context_id: str
    ) -> tuple[list[ContextItem], list[str]] | None:
        def read() -> tuple[list[ContextItem], list[str]] | None:
            rows = self._conn.execute(
                "SELECT item, digest FROM contexts WHERE context_id = ?"
                " ORDER BY position",
                (context_id,),
            ).fetchall()
            if not rows:
                return None
            return (
                [ContextItemAdapter.validate_json(item) for item, _ in rows],
                [digest for _, digest in rows],
            )

        return await self._run(read)

    async def append_context(
        self,
        context_id: str,
        first: int,
        items: Sequence[ContextItem],
        digests: Sequence[str],
    ) -> None:
        rows = [
            (context_id, first + n, item.model_dump_json(), digest)
            for n, (item, digest) in enumerate(zip(items, digests, strict=True))
        ]

        def write(db: sqlite3.Connection) -> int:
            db.execute(
                "DELETE FROM contexts WHERE context_id = ? AND position >= ?",
                (context_id, first),
            )
            db.executemany(
                "INSERT INTO contexts (context_id, position, item, digest)"
                " VALUES (?, ?, ?, ?)",
                rows,
            )
            return sum(len(item) + len(digest) for _, _, item, digest in rows)

        await self._run(lambda: self._write(write))

    async def append_events(self, events: Sequence[AgentEvent]) -> None:
        rows = [(e.loop_id, e.seq, e.model_dump_json()) for e in events]

        def write(db: sqlite3.Connection) -> int:
            db.executemany(
                "INSERT OR REPLACE INTO events (loop_id, seq, event) VALUES (?, ?, ?)",
                rows,
            )
            return sum(len(text) for _, _, text in rows)

        await self._run(lambda: self._write(write))

    async def events(self, loop_id: str, after_seq: int = 0) -> list[AgentEvent]:
        def read() -> list[AgentEvent]:
            rows = self._conn.execute(
                "SELECT event FROM events WHERE loop_id = ? AND seq > ? ORDER BY seq",
                (loop_id, after_seq),
            )
            return [AgentEventAdapter.validate_json(text) for (text,) in rows]

        return await self._run(read)

    async def inference(self, loop_id: str, request: int) -> InferenceOutput | None:
        def read() -> InferenceOutput | None:
            db = self._conn
            row = db.execute(
                "SELECT output FROM inferences WHERE loop_id = ? AND request = ?",
                (loop_id, request),
            ).fetchone()
            if row is not None:
                return InferenceOutput.model_validate_json(row[0])
            row = db.execute(  # written with a commit
                f"SELECT changes FROM log WHERE {_SPAN} AND request = ?2"
                " ORDER BY id DESC LIMIT 1",
                (loop_id, request),
            ).fetchone()
            if row is None:
                return None
            recorded = _Changes.model_validate_json(row[0]).inference
            return None if recorded is None else recorded[1]

        return await self._run(read)

    # ----------------------------------------------------------------- ledger

    async def calls(self, loop_id: str, request: int) -> list[CallRecord]:
        def read() -> list[CallRecord]:
            rows = self._conn.execute(_LEDGER_ROWS, (loop_id,))
            ledger = _fold_ledger(loop_id, (text for (text,) in rows))
            return sorted(
                (c for c in ledger.values() if c.request == request),
                key=lambda c: c.position,
            )

        return await self._run(read)

    async def begin_call(self, call: CallRecord) -> CallRecord:
        result: list[CallRecord] = []

        def write(db: sqlite3.Connection) -> int:
            # The rows that name the key (a filter in SQL: a loop's ledger is
            # not parsed whole for each call).
            rows = db.execute(
                f"SELECT ledger FROM log WHERE {_SPAN} AND ledger IS NOT NULL"
                " AND instr(ledger, ?2) > 0 ORDER BY id",
                (call.loop_id, _key_text(call.key)),
            )
            known = _fold_ledger(call.loop_id, (t for (t,) in rows)).get(call.key)
            if known is not None and known.status == "done":
                result.append(known)
                return 0
            if known is not None:
                call_ = call.model_copy(
                    update={"status": "started", "attempt": known.attempt + 1}
                )
            else:
                call_ = call
            text = f"[{_intent_entry(call_, 'begun')}]"
            self._ledger_row(db, call.loop_id, text)
            result.append(call_)
            return len(text)

        await self._run(lambda: self._write(write))
        return result[0]

    async def end_call(
        self, loop_id: str, key: str, output: FunctionCallOutputItem, terminate: bool
    ) -> None:
        text = f"[{_done_entry(key, output, terminate)}]"
        await self._append_ledger(loop_id, text)

    async def mark_uncertain(self, loop_id: str, keys: Sequence[str]) -> None:
        text = json.dumps([["uncertain", key] for key in keys], ensure_ascii=False)
        await self._append_ledger(loop_id, text)

    async def _append_ledger(self, loop_id: str, text: str) -> None:
        def write(db: sqlite3.Connection) -> int:
            self._ledger_row(db, loop_id, text)
            return len(text)

        await self._run(lambda: self._write(write, transaction=False))

    def _ledger_row(self, db: sqlite3.Connection, loop_id: str, text: str) -> None:
        if not db.execute(_APPEND_LEDGER, (loop_id, text)).rowcount:
            raise StoreError(
                f"no loop {loop_id!r} in the store {self.path}: a loop's ledger "
                "is written once its first commit has landed"
            )

    # ----------------------------------------------------------------- leases

    async def acquire(
        self, loop_id: str, owner: str, *, replacing: str | None = None
    ) -> str | None:
        def write(db: sqlite3.Connection) -> int:
            now = time.time()
            self._forget(loop_id)  # another runtime may have written it
            row = db.execute(
                "SELECT owner, lease_until FROM loops WHERE loop_id = ?", (loop_id,)
            ).fetchone()
            if row is None:
                return 0  # nothing to own: the loop's first commit takes it
            if row[0] not in (None, owner, replacing) and row[1] > now:
                taken.append(row[0])
                return 0
            db.execute(
                "UPDATE loops SET owner = ?, lease_until = ? WHERE loop_id = ?",
                (owner, now + self.lease_ttl, loop_id),
            )
            return 0

        taken: list[str] = []
        await self._run(lambda: self._write(write))
        return taken[0] if taken else None

    async def renew(self, owner: str) -> None:
        def write(db: sqlite3.Connection) -> int:
            db.execute(
                # Unfinished loops only: a finished one needs no lease.
                "UPDATE loops SET lease_until = ? WHERE owner = ? AND status != 'done'",
                (time.time() + self.lease_ttl, owner),
            )
            return 0

        await self._run(lambda: self._write(write))

    async def release(self, owner: str, loop_ids: Sequence[str] | None = None) -> None:
        def write(db: sqlite3.Connection) -> int:
            if loop_ids is None:
                self._statuses.clear()
                self._paths.clear()
                db.execute(
                    "UPDATE loops SET owner = NULL, lease_until = 0 WHERE owner = ?",
                    (owner,),
                )
            else:
                for loop_id in loop_ids:
                    self._forget(loop_id)
                db.executemany(
                    "UPDATE loops SET owner = NULL, lease_until = 0"
                    " WHERE owner = ? AND loop_id = ?",
                    [(owner, loop_id) for loop_id in loop_ids],
                )
            return 0

        await self._run(lambda: self._write(write))
