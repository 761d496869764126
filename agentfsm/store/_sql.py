"""`SQLStore`: what `SQLiteStore` and `PostgresStore` share, parametrized by a
small `Dialect` (how a statement names its parameters, the clock of leases,
how a new loop gets its number).

Both keep one connection, used from one thread of the store's own
(`_thread.StoreThread`, from `open` to `close`), so they run on asyncio and
trio alike and never block the event loop: its calls run one at a time, in the
order they come. Both keep the same tables:

- `loops`: a row per loop: its number (its `log` rows are the ids from
  `number << 32` on), agent, status, and its lease (owner, epoch, until when);
- `log`: a row per commit (see `_rows` for what a row holds and `LOG_COLUMNS`);
- `events`: the events of a store made with `events=True`, by (loop, seq);
- `contexts`: shared contexts (`agentfsm.temporal.StoreContexts`);
- `requests`: the decision inbox (`Requests`), a row per request, indexed by
  (status, id) for the watching runtimes' polls and by (loop, id). The text a
  caller gave (`by`, a reason, a note) is kept as JSON, where a NUL (which
  PostgreSQL's text cannot hold) is `\\u0000`. The table came after the
  layout's other tables: a store of the same layout made before it gets it at
  its first writable open (a read-only store without it holds no requests).

Every write is a `Commit`, fenced (see `agentfsm.store._base`): it lands only
while the loop's row names the commit's owner and epoch and the loop has not
ended. A commit is one row of `log` (and its events), and touches the loop's
row only when the loop's status changes: the dialect writes it (`_write_commit`)
in as few statements as it can (SQLite: one `INSERT ... SELECT` guarded by the
fence, most commits; PostgreSQL: one call of a function, one round trip). A
commit that applies requests (`Commit.requests`, rare) marks them in its
transaction too, with one statement more each.

What the rows hold is read back here, the same way for both: a loop's latest
record and its context (`load`), a record by seq (`record_at`), the model
outputs recorded, the ledger (the fold of the rows' entries), the decisions,
the events. Stored data that cannot be read raises `StoreError` naming the
store, the loop and the cause.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import zlib
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from json.encoder import encode_basestring
from typing import Any, ClassVar, Final, Generic, Literal, NoReturn, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticSerializationError

from agentfsm._arguments import check
from agentfsm._errors import error_text
from agentfsm._keys import number_text
from agentfsm._models import json_of, read_fields_fast
from agentfsm._text import encodable_data
from agentfsm.events import AgentEvent, AgentEventAdapter
from agentfsm.inference import InferenceOutput
from agentfsm.interception import Abort, Proceed, Rewrite
from agentfsm.messages import ContextItem, ContextItemAdapter, FunctionCallOutputItem
from agentfsm.record import DecisionEntry, DecisionRecord, LoopRecord
from agentfsm.results import LoopStatus
from agentfsm.states import LoopState

from ._base import (
    _PRESENT,
    CallRecord,
    Commit,
    EventArchive,
    Lease,
    LeaseLostError,
    LedgerFold,
    LoopLockedError,
    LoopRequest,
    LoopStore,
    Requests,
    SharedContexts,
    StoredLoop,
    StoredLoopSummary,
    StoreError,
    StoreStatistics,
    UnreadableLoop,
    by_checked,
    commits_in_turn,
    context_appended,
    ended_loop,
    loops_wanted,
    note_checked,
    request_checked,
    request_id_checked,
    requests_wanted,
    unknown_loop,
    withdrawn,
)
from ._breaks import (
    SharedBreakpoints,
    StoredBreak,
    break_checked,
    breaks_wanted,
    ended_loop_break,
)
from ._outline import Outline, inline
from ._rows import (
    ModelTexts,
    path_of,
    record_of,
    record_text,
    shared_text,
    steps_text,
)
from ._thread import StoreThread

__all__ = ("LOG_COLUMNS", "ROWS", "Dialect", "LogRow", "SQLStore")

_T = TypeVar("_T")
_C = TypeVar("_C")

ROWS: Final = 1 << 32
"""A loop's `log` ids: from its `number << 32` on. A loop holds at most 2**32
rows (commits), a store 2**31 loops."""

LOG_COLUMNS: Final = (
    "loop_id",
    "seq",
    "record",
    "earlier",
    "first_seq",
    "changes",
    "request",
    "ledger",
    "path_from",
    "path",
    "shared",
    "decisions",
    "outlined",
)
"""A `log` row's columns (beside its id): the record (NULL in a commit
without one), the records written with it (`earlier`, a JSON array, the seq
of its first in `first_seq`), what the context and the model gave
(`changes`: the items added from position `first`, the slots replaced, a
truncation, a model output, whose request number is `request`), the ledger's
entries (`ledger`, see `ledger_entry`), the path's steps since the row before
(`path_from`, `path`), what the records of the run share (`shared`, in the
run's first row: see `_rows`), the decisions made (`decisions`), and
whether its JSON refers to large strings written out of line (`outlined`:
see `_outline`)."""


@dataclass(frozen=True, slots=True)
class Dialect:
    """What differs between the SQL the two stores speak."""

    now: str
    """The lease clock, in SQL (SQLite: the `:now` parameter, this host's
    clock; PostgreSQL: the server's, so that hosts whose clocks differ agree
    on when a lease expires)."""
    param: Callable[[str], str]
    """A named parameter's placeholder (`:name`, `%(name)s`)."""

    def sql(self, text: str) -> str:
        """`text` with its `:name` parameters in this dialect and `{now}` its
        clock (written once per store, so a driver prepares it once)."""
        text = text.replace("{now}", self.now)
        return re.sub(r"(?<![:\w]):([a-z_]+)", lambda m: self.param(m[1]), text)


def next_id(number: str) -> str:
    """The id of a loop's next row, in SQL, from the SQL of its number. (An
    aggregate, `max(id)`, under `coalesce` scans the loop's rows; `ORDER BY id
    DESC LIMIT 1` seeks the last.)"""
    first = f"(({number}) << 32)"
    return (
        f"coalesce((SELECT id FROM log WHERE id BETWEEN {first} AND"
        f" {first} + {ROWS - 1} ORDER BY id DESC LIMIT 1) + 1, {first})"
    )


_SPAN: Final = (
    "id BETWEEN (SELECT number << 32 FROM loops WHERE loop_id = :loop)"
    f" AND (SELECT (number << 32) + {ROWS - 1} FROM loops WHERE loop_id = :loop)"
)
"""A condition on `log`: the rows of the loop `:loop` (none if it has none)."""


class _Changes(BaseModel):
    """A commit's `changes` column."""

    model_config = ConfigDict(defer_build=True)

    first: int
    items: list[ContextItem]
    truncate: bool = False
    replaced: list[tuple[int, ContextItem]] = []
    inference: tuple[int, InferenceOutput] | None = None


_BOOL: Final = {False: "false", True: "true"}

_DECODING: Final = (Exception,)
"""What reading a loop's stored data may raise when the data is damaged (not
JSON, not of the shape this store writes: an index out of range, a key
missing, a model that does not validate): named as such (`_unreadable`)."""


def ledger_entry(call: CallRecord, outline: Outline | None = None) -> str:
    """A ledger entry as a row keeps it: `[status, key, request, position,
    tool, call_id, attempt, output, terminate, by]`, joined from its parts'
    JSON (what `json.dumps` of the list gives, ensure_ascii off: checked by
    tests/internals/test_sqlite_log.py)."""
    if outline is not None:
        output_data = (
            None if call.output is None else call.output.model_dump(mode="json")
        )
        return outline.dumps(
            [
                call.status,
                call.key,
                call.request,
                call.position,
                call.tool,
                call.call_id,
                call.attempt,
                output_data,
                call.terminate,
                call.by,
            ]
        )
    output = "null" if call.output is None else json_of(call.output)
    by = "null" if call.by is None else encode_basestring(call.by)
    return (
        f"[{encode_basestring(call.status)}, {encode_basestring(call.key)}, "
        f"{number_text(call.request)}, {number_text(call.position)}, "
        f"{encode_basestring(call.tool)}, {encode_basestring(call.call_id)}, "
        f"{number_text(call.attempt)}, {output}, {_BOOL[call.terminate]}, {by}]"
    )


def fold_ledger(loop_id: str, rows: Iterable[Any]) -> LedgerFold:
    """The ledger of a loop: its rows' `ledger` arrays (JSON data), in log
    order; the last entry of a key is what the ledger holds for it."""
    fold = LedgerFold()
    for entries in rows:
        for entry in entries:
            status, key, request, position, tool, call_id, attempt = entry[:7]
            output, terminate, by = entry[7:10]
            fold.add(
                CallRecord(
                    key=key,
                    loop_id=loop_id,
                    request=request,
                    position=position,
                    tool=tool,
                    call_id=call_id,
                    status=status,
                    attempt=attempt,
                    output=None
                    if output is None
                    else FunctionCallOutputItem.model_validate(output),
                    terminate=terminate,
                    by=by,
                )
            )
    return fold


@dataclass(slots=True)
class LogRow:
    """A commit as the dialect writes it (see `LOG_COLUMNS`)."""

    commit: Commit
    values: tuple[Any, ...]
    """The `log` columns' values, in `LOG_COLUMNS`' order (a tuple: SQLite binds
    parameters by position for less than by name)."""
    status: str | None
    """The loop's new status when it changes (its row is written), else None."""
    events: list[tuple[int, str]]
    """`(seq, JSON)` of each event to keep."""
    written: int
    """Bytes of row data."""
    blobs: list[tuple[str, str, int]]
    """`(digest, text, bytes)` of the large strings the row refers to, to
    write first (see `_outline`)."""


_IMAGE_INLINE: Final = '"type":"image","data":"'
"""How an image block's JSON begins when it holds its bytes (`ImageBlock`'s
fields in order): inside a JSON string its quotes would be escaped, so only an
image block itself matches."""


def _holds_image(row: LogRow) -> bool:
    """Whether a row's JSON holds an image's bytes inline."""
    return any(type(v) is str and _IMAGE_INLINE in v for v in row.values) or any(
        _IMAGE_INLINE in text for _, text in row.events
    )


class SQLStore(
    LoopStore, EventArchive, SharedContexts, Requests, SharedBreakpoints, Generic[_C]
):
    """A store on one SQL connection (`_C`), in a thread of its own."""

    _has_breakpoints = True
    """Whether the store holds the `breakpoints` table (a read-only store of a
    file made before it may not: it holds none then). Set by the dialect as
    it connects."""

    dialect: Dialect
    where: str
    """The store, in messages: its file, or its server, database and schema."""

    def __init__(
        self,
        *,
        events: bool,
        lease_ttl: float,
        thread_name: str,
        read_only: bool = False,
    ) -> None:
        self.keeps_events = events
        self.lease_ttl = lease_ttl
        self.read_only = read_only
        """Opened to read only (`read_only=True`): it creates nothing, and
        refuses every write, leases and presence included."""
        self._conn: _C | None = None
        self._thread = StoreThread(thread_name)
        self._counted = threading.Lock()
        self._commits = 0
        self._bytes = 0
        self._statuses: dict[str, tuple[Lease, str]] = {}
        """The status each loop's row holds, as this store last wrote it in the
        lease of that epoch (a commit that keeps it writes only its log row).
        Used in the store's thread only."""
        self._outlined: dict[str, dict[int, tuple[str, str, int]]] = {}
        """The large strings each loop's run wrote out of line, by identity
        (`_outline.Outline`'s `known`). Used in the store's thread only."""
        self._blobs: dict[str, set[str]] = {}
        """The digests of the blobs each loop's run has written (its commits
        that landed): later commits refer to them without sending them again
        (`_outline.Outline`'s `written`). Used in the store's thread only."""
        self._texts = ModelTexts()
        """The JSON of models the records share (`_rows.ModelTexts`). Used in
        the store's thread only."""
        self._held: dict[int, int] = {}
        """The presence slots this store holds, with how many of this process's
        runtimes hold each (see `hold_presence`)."""
        self._sql: dict[str, str] = {}
        self._has_requests = True
        """Whether the store holds the `requests` table (a read-only store of a
        file made before it may not: it holds no requests then). Set by the
        dialect as it connects."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where})"

    def statistics(self) -> StoreStatistics:
        with self._counted:
            return StoreStatistics(commits=self._commits, bytes_written=self._bytes)

    def _count(self, written: int) -> None:
        with self._counted:
            self._commits += 1
            self._bytes += written

    def q(self, text: str) -> str:
        """A statement in the store's dialect (made once)."""
        sql = self._sql.get(text)
        if sql is None:
            sql = self._sql[text] = self.dialect.sql(text)
        return sql

    # ------------------------------------------------- what a dialect provides

    @abstractmethod
    def _connect(self) -> _C:
        """A new connection, the layout checked (created for a new store)."""

    @abstractmethod
    def _disconnect(self, conn: _C) -> None: ...

    @abstractmethod
    def _execute(self, conn: _C, sql: str, params: Mapping[str, Any] = ...) -> Any:
        """Run one statement; its cursor (rows, `rowcount`)."""

    @abstractmethod
    def _transaction(self, conn: _C) -> AbstractContextManager[object]:
        """A transaction that takes the store's write lock at once."""

    @abstractmethod
    def _write_commit(self, conn: _C, row: LogRow, run_status: str | None) -> None:
        """Write one commit (fenced: see `_fence`); `run_status` is the status
        the loop's row holds if this store wrote it last in the commit's
        lease, else None."""

    #: The driver's errors, which `_failure` names the store in.
    _driver_error: ClassVar[type[Exception]]

    @abstractmethod
    def _failure(self, exc: Exception) -> StoreError:
        """The driver's error as a `StoreError` naming the store."""

    def _key_of(self, value: Any) -> str:
        """A loop id as a `loop_id` column holds it, as its caller named it (a
        dialect may store ids its text type cannot hold escaped)."""
        return str(value)

    def _presence_slot(self, owner: str) -> int:
        """The slot of a runtime's presence (see `hold_presence`)."""
        return zlib.crc32(owner.encode()) & 0x3FFFFFFF

    @abstractmethod
    def _lock_slot(self, conn: _C, slot: int) -> None:
        """Hold `slot` until the connection ends or `_unlock_slot`."""

    @abstractmethod
    def _unlock_slot(self, conn: _C, slot: int) -> None: ...

    @abstractmethod
    def _slot_free(self, conn: _C, slot: int) -> bool | None:
        """Whether no process holds `slot` (taken and given back at once); None
        when it cannot tell."""

    # ------------------------------------------------------------ connection

    async def open(self) -> None:
        if self._conn is not None and self._thread.running:
            return
        self._forget_all()  # (another process may have written meanwhile)
        await self._thread.open(
            self, self._connect_once, lambda: self._conn is not None
        )

    def _connect_once(self) -> None:
        """Connect (in the store's thread), unless an `open` before did."""
        if self._conn is None:
            try:
                self._conn = self._connect()
            except self._driver_error as exc:
                raise self._failure(exc) from exc

    async def close(self) -> None:
        if not self._thread.running:
            return

        def close() -> None:
            conn, self._conn = self._conn, None
            self._held.clear()
            if conn is not None:
                self._disconnect(conn)

        try:
            with anyio.CancelScope(shield=True):
                await self._thread.run(close)
        finally:
            self._thread.stop()  # after the calls given it so far

    async def _run(self, fn: Callable[[_C], _T]) -> _T:
        """Run `fn` on the connection, in the store's thread; a driver's error
        becomes a `StoreError` naming the store."""
        if not self._thread.running:
            raise StoreError(f"the store {self.where} is not open")

        def work() -> _T:
            conn = self._live()
            try:
                return fn(conn)
            except self._driver_error as exc:
                raise self._failure(exc) from exc

        return await self._thread.run(work)

    def _commit_conn(self) -> _C:
        """The connection each commit of a trip uses (`_live`, which a dialect
        may have checked once for the trip)."""
        return self._live()

    def _live(self) -> _C:
        """The connection (in the store's thread)."""
        conn = self._conn
        if conn is None:
            raise StoreError(f"the store {self.where} is not open")
        return conn

    def _rows(self, conn: _C, sql: str, params: Mapping[str, Any]) -> list[Any]:
        return list(self._execute(conn, self.q(sql), params).fetchall())

    def _row(self, conn: _C, sql: str, params: Mapping[str, Any]) -> Any:
        return self._execute(conn, self.q(sql), params).fetchone()

    def _unreadable(self, loop_id: str, exc: Exception) -> NoReturn:
        """Raise what a read that failed raises: the store's or the driver's
        error as it is, any other (the stored data is not what this store
        writes) as a `StoreError` naming the loop."""
        if isinstance(exc, StoreError | self._driver_error):
            raise exc
        raise StoreError(
            f"{self.where}: the stored data of loop {loop_id} cannot be read "
            f"({type(exc).__name__}: {str(exc)[:300]})"
        ) from exc

    # ---------------------------------------------------------------- commits

    async def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        # One trip to the store's thread for all of them, a transaction each.
        return await self._run(lambda conn: commits_in_turn(commits, self._commit_one))

    def _commit_one(self, commit: Commit) -> None:
        """Write one commit, in the store's thread (its JSON is made here too,
        off the event loop)."""
        conn = self._commit_conn()
        loop_id, lease = commit.loop_id, commit.lease
        cached = self._statuses.get(loop_id)
        run_status = (
            cached[1]
            if cached is not None and (cached[0] is lease or cached[0] == lease)
            else None
        )
        try:
            try:
                row = self.log_row(commit)
            except PydanticSerializationError:
                # Text that did not enter through a loop (a model built without
                # validation): written as the loop would have escaped it.
                row = self.log_row(encodable_data(commit))
            self._write_commit(conn, row, run_status)
            if row.blobs:
                self._blobs.setdefault(loop_id, set()).update(
                    digest for digest, _, _ in row.blobs
                )
        except BaseException as exc:
            self._forget(loop_id)
            if isinstance(exc, self._driver_error):
                raise self._failure(exc) from exc
            if isinstance(exc, Exception) and not isinstance(exc, StoreError):
                # A value it cannot encode, say: named, as the driver's are.
                raise StoreError(
                    f"{self.where}: a commit of loop {loop_id} cannot be written "
                    f"({type(exc).__name__}: {error_text(exc)[:300]})"
                ) from exc
            raise
        self._count(row.written)
        if row.status == LoopStatus.done.value:
            self._forget(loop_id)  # it writes no more
        elif row.status is not None:
            self._statuses[loop_id] = (lease, row.status)

    def _forget(self, loop_id: str) -> None:
        """What this store knows of the loop's run (its status, what it wrote
        out of line): the run ended, or another may have written meanwhile."""
        self._statuses.pop(loop_id, None)
        self._outlined.pop(loop_id, None)
        self._blobs.pop(loop_id, None)

    def _forget_all(self) -> None:
        self._statuses.clear()
        self._outlined.clear()
        self._blobs.clear()

    def _fence(self, conn: _C, commit: Commit) -> StoreError:
        """Why the loop's row refused `commit` (its fence did not hold)."""
        loop_id, lease = commit.loop_id, commit.lease
        row = self._row(
            conn,
            "SELECT owner, epoch, status FROM loops WHERE loop_id = :loop",
            {"loop": loop_id},
        )
        if row is None:
            return StoreError(f"{self.where} holds no loop {loop_id!r}")
        owner, epoch, status = row
        if status == LoopStatus.done.value:
            return LeaseLostError(loop_id, lease.owner, "the loop has ended")
        return LeaseLostError(
            loop_id,
            lease.owner,
            f"{owner or 'nobody'} holds it (epoch {epoch}; this runtime's "
            f"{lease.epoch})",
        )

    def log_row(self, commit: Commit) -> LogRow:
        """A commit's `log` row (see `LOG_COLUMNS` and `_rows`). The JSON is
        joined from each part's own JSON; a `large` commit's through an
        `Outline` (its large strings out of line).

        A commit the journal did not mark large whose JSON holds an image's
        bytes all the same (carried somewhere no journal check looks) is made
        again as large: no row holds an image inline, whatever carried it. The
        test is one substring search of each text the row writes."""
        row = self._log_row(commit, commit.large)
        if not commit.large and _holds_image(row):
            row = self._log_row(commit, True)
        return row

    def _log_row(self, commit: Commit, large: bool) -> LogRow:
        record = commit.record
        loop_id = commit.loop_id
        outline = None
        enc: Callable[[Any], str] = json_of
        if large:
            outline = Outline(
                self._outlined.setdefault(loop_id, {}),
                self._blobs.get(loop_id, frozenset()),
            )
            enc = outline.text
        written = 0
        seq = text = steps = shared = path_from = None
        if record is not None:
            path_from = commit.path_from
            shared = None if path_from else shared_text(record, outline)
            text = record_text(record, commit.path_length, outline, self._texts)
            steps = steps_text(commit.steps)
            seq = record.seq
            written += len(text) + len(steps) + len(shared or "")
        earlier = first_seq = None
        if commit.earlier:
            earlier = (
                "["
                + ",".join(
                    record_text(r, length, outline, self._texts)
                    for r, length in commit.earlier
                )
                + "]"
            )
            first_seq = commit.earlier[0][0].seq
            written += len(earlier)
        changes = request = None
        inference = commit.inference
        if commit.items or commit.replaced or commit.truncate or inference:
            # (What is at its default is left out: `_Changes` fills it in.)
            parts = [
                f'{{"first":{commit.first},"items":[{",".join(map(enc, commit.items))}]'
            ]
            if commit.truncate:
                parts.append(',"truncate":true')
            if commit.replaced:
                replaced = ",".join(
                    f"[{at},{enc(item)}]" for at, item in commit.replaced.items()
                )
                parts.append(f',"replaced":[{replaced}]')
            if inference is not None:
                request = inference[0]
                # The record's `turn.output` is most often the same model output,
                # its JSON made just now (`ModelTexts`): not made twice.
                output = (
                    self._texts.text(inference[1])
                    if outline is None
                    else enc(inference[1])
                )
                parts.append(f',"inference":[{request},{output}]')
            parts.append("}")
            changes = "".join(parts)
            written += len(changes)
        ledger = None
        if commit.ledger:
            ledger = (
                "[" + ",".join(ledger_entry(c, outline) for c in commit.ledger) + "]"
            )
            written += len(ledger)
        decisions = None
        if commit.decisions:
            decisions = "[" + ",".join(map(enc, commit.decisions)) + "]"
            written += len(decisions)
        events = []
        if commit.events:
            events = [(e.seq, enc(e)) for e in commit.events]
            written += sum(len(t) for _, t in events)
        status = None
        if record is not None or commit.new:
            status = (
                record.status.value if record is not None else LoopStatus.running.value
            )
        blobs = []
        if outline is not None and outline.blobs:
            blobs = outline.blobs
            written += sum(size for _, _, size in blobs)
        values = (
            loop_id,
            seq,
            text,
            earlier,
            first_seq,
            changes,
            request,
            ledger,
            path_from,
            steps,
            shared,
            decisions,
            1 if outline is not None else None,
        )
        return LogRow(commit, values, status, events, written, blobs)

    # ------------------------------------------------------------------ reads

    async def load(self, loop_id: str) -> StoredLoop | None:
        def read(conn: _C) -> StoredLoop | None:
            row = self._row(
                conn,
                "SELECT owner, epoch, lease_until > {now} FROM loops"
                " WHERE loop_id = :loop",
                {"loop": loop_id, "now": time.time()},
            )
            if row is None:
                return None
            owner, epoch, live = row
            try:
                last = self._row(
                    conn,
                    f"SELECT id, record, outlined FROM log WHERE {_SPAN}"
                    " AND record IS NOT NULL ORDER BY id DESC LIMIT 1",
                    {"loop": loop_id},
                )
                if last is None:
                    return None  # (its first commit is being written)
                items = self._items(conn, loop_id)
                data = self._decoded(conn, last[1], last[2])
                record = self._record(conn, loop_id, last[0], data)
            except _DECODING as exc:
                self._unreadable(loop_id, exc)
            last_event = 0
            if self.keeps_events:
                found = self._row(
                    conn,
                    "SELECT max(seq) FROM events WHERE loop_id = :loop",
                    {"loop": loop_id},
                )
                last_event = int(found[0] or 0) if found is not None else 0
            return StoredLoop(
                record, items, owner if live else None, int(epoch), last_event
            )

        return await self._read(read)

    def _items(self, conn: _C, loop_id: str) -> list[ContextItem]:
        items: list[ContextItem] = []
        for changes, outlined in self._rows(
            conn,
            f"SELECT changes, outlined FROM log WHERE {_SPAN}"
            " AND changes IS NOT NULL ORDER BY id",
            {"loop": loop_id},
        ):
            change = self._changes(conn, changes, outlined)
            first = change.first
            if change.truncate:
                del items[first:]
            items[first : first + len(change.items)] = change.items
            for at, item in change.replaced:
                items[at] = item
        return items

    async def record_at(self, loop_id: str, seq: int) -> LoopRecord | None:
        def read(conn: _C) -> LoopRecord | None:
            # The record of the greatest seq up to `seq`; of several of one
            # seq (a runtime wrote it again after another did), the last
            # written: a row's own record, or one a later row carried.
            found: tuple[tuple[int, int], dict[str, Any]] | None = None
            params = {"loop": loop_id, "seq": seq}
            try:
                row = self._row(
                    conn,
                    f"SELECT seq, id, record, outlined FROM log WHERE {_SPAN}"
                    " AND seq <= :seq AND record IS NOT NULL"
                    " ORDER BY seq DESC, id DESC LIMIT 1",
                    params,
                )
                if row is not None:
                    found = ((row[0], row[1]), self._decoded(conn, row[2], row[3]))
                for row_id, earlier, outlined in self._rows(
                    conn,
                    f"SELECT id, earlier, outlined FROM log WHERE {_SPAN}"
                    " AND seq > :seq AND first_seq <= :seq",
                    params,
                ):
                    for data in self._decoded(conn, earlier, outlined):
                        at = (data["seq"], row_id)
                        if data["seq"] <= seq and (found is None or at > found[0]):
                            found = (at, data)
                if found is None:
                    return None
                return self._record(conn, loop_id, found[0][1], found[1])
            except _DECODING as exc:
                self._unreadable(loop_id, exc)

        return await self._read(read)

    async def loops(
        self,
        *,
        status: str | None = None,
        agent_id: str | None = None,
        loop_id: str | None = None,
        unreadable: list[UnreadableLoop] | None = None,
    ) -> list[StoredLoopSummary]:
        """The store's loops, oldest first, each as its latest record and its
        lease say (one read transaction: one state of the store, held only
        while the rows are read); only those of `status` (`"running"`,
        `"paused"`, `"done"`), of `agent_id` and the one `loop_id`, when
        given. A read only: what `agentfsm loops` shows.

        Args:
            status, agent_id, loop_id: the filters.
            unreadable: when given, each loop whose stored data cannot be read
                is added to it (its id and why), and the others are listed;
                else the first such loop fails the listing.

        Raises:
            ArgumentTypeError, ArgumentValueError: a filter that is not a
                status's name, or not a str.
            StoreError: a loop's stored data cannot be read (the message names
                the loop) and `unreadable` is None.
        """
        wanted = loops_wanted(status, agent_id)
        if loop_id is not None:
            check("loop_id", loop_id, str)
        where = []
        params: dict[str, Any] = {"now": time.time()}
        if wanted is not None:
            where.append("status = :status")
            params["status"] = wanted.value
        if agent_id is not None:
            where.append("agent_id = :agent")
            params["agent"] = self._key_of_agent(agent_id)
        if loop_id is not None:
            where.append("loop_id = :loop")
            params["loop"] = loop_id
        sql = (
            "SELECT loop_id, owner, lease_until, lease_until > {now}, updated"
            " FROM loops"
            + (f" WHERE {' AND '.join(where)}" if where else "")
            + " ORDER BY number"
        )

        def answers(conn: _C) -> bool:
            # A driver's error is one loop's (sqlite3 cannot decode text that
            # is not UTF-8) only while the connection still answers.
            try:
                self._row(conn, "SELECT 1", {})
            except self._driver_error:
                return False
            return True

        def read(conn: _C) -> list[StoredLoopSummary]:
            found = []
            for key, owner, until, live, updated in self._rows(conn, sql, params):
                loop_id = self._key_of(key)
                try:
                    record = self._latest(conn, loop_id)
                except (StoreError, self._driver_error) as exc:
                    stored = isinstance(exc, StoreError)
                    if unreadable is None or not (stored or answers(conn)):
                        raise
                    why = (
                        str(exc).removeprefix(f"{self.where}: ")
                        if stored
                        else f"the stored data of loop {loop_id} cannot be read "
                        f"({type(exc).__name__}: {str(exc)[:300]})"
                    )
                    unreadable.append(UnreadableLoop(loop_id=loop_id, reason=why))
                    continue
                if record is None:
                    continue  # (its first commit is being written)
                found.append(
                    StoredLoopSummary.of(
                        record,
                        owner=owner,
                        lease_until=float(until),
                        lease_live=bool(live),
                        status_since=float(updated),
                    )
                )
            return found

        return await self._read(read)

    async def loop_ids(self) -> list[str]:
        """The ids of the store's loops, oldest first: one cheap read, nothing
        decoded (to pick one loop before reading it)."""

        def read(conn: _C) -> list[str]:
            rows = self._rows(conn, "SELECT loop_id FROM loops ORDER BY number", {})
            return [self._key_of(key) for (key,) in rows]

        return await self._read(read)

    async def change_mark(self, loop_id: str | None = None) -> tuple[Any, ...]:
        """A cheap mark of what the store holds, of all its loops or of one:
        it differs once a commit, a new loop or a change of a loop's row
        (status, lease taken or given up) has landed. One read of a few
        indexed rows: what a watcher (`agentfsm ui`) asks before reading a
        loop whole. (A lease that lapses without a write leaves it as it is.)"""
        if loop_id is None:
            sql = (
                "SELECT (SELECT max(id) FROM log), (SELECT count(*) FROM loops),"
                " (SELECT sum(updated) FROM loops)"
            )
            params: dict[str, Any] = {}
        else:
            # Without kept events, the newest row of any loop stands in for
            # this loop's (its rows are found by id ranges, not an index).
            newest = (
                "(SELECT max(seq) FROM events WHERE loop_id = :loop)"
                if self.keeps_events
                else "(SELECT max(id) FROM log)"
            )
            sql = (
                f"SELECT {newest}, updated, epoch, owner FROM loops"
                " WHERE loop_id = :loop"
            )
            params = {"loop": loop_id}

        def read(conn: _C) -> tuple[Any, ...]:
            row = self._row(conn, sql, params)
            return () if row is None else tuple(row)

        return await self._read(read)

    def _key_of_agent(self, agent_id: str) -> str:
        """An agent id as the `agent_id` column holds it."""
        return agent_id

    def _latest(self, conn: _C, loop_id: str) -> LoopRecord | None:
        """The loop's latest record, its path left empty (not read: a summary
        needs none, and reading it reads every row of the loop)."""
        params = {"loop": loop_id}
        try:
            last = self._row(
                conn,
                f"SELECT record, outlined FROM log WHERE {_SPAN}"
                " AND record IS NOT NULL ORDER BY id DESC LIMIT 1",
                params,
            )
            shared = self._row(
                conn,
                f"SELECT shared, outlined FROM log WHERE {_SPAN}"
                " AND shared IS NOT NULL ORDER BY id DESC LIMIT 1",
                params,
            )
            if last is None or shared is None:
                return None
            data = self._decoded(conn, last[0], last[1])
            return record_of(data, self._decoded(conn, shared[0], shared[1]), [])
        except _DECODING as exc:
            self._unreadable(loop_id, exc)

    def _record(
        self, conn: _C, loop_id: str, row_id: int, data: dict[str, Any]
    ) -> LoopRecord:
        """A record of the loop's log (`data`, its text's, from the row
        `row_id`), made whole: what its run shares, and its path from the
        steps of the rows up to its own (see `_rows`)."""
        params = {"loop": loop_id, "id": row_id}
        shared = self._row(
            conn,
            f"SELECT shared, outlined FROM log WHERE {_SPAN} AND id <= :id"
            " AND shared IS NOT NULL ORDER BY id DESC LIMIT 1",
            params,
        )
        if shared is None:
            raise StoreError(
                f"{self.where}: no row of loop {loop_id} holds what its records share"
            )
        path = path_of(
            self._rows(
                conn,
                f"SELECT path_from, path FROM log WHERE {_SPAN} AND id <= :id"
                " AND path IS NOT NULL ORDER BY id",
                params,
            )
        )
        return record_of(data, self._decoded(conn, shared[0], shared[1]), path)

    async def unfinished(self) -> list[str]:
        def read(conn: _C) -> list[str]:
            rows = self._rows(
                conn,
                "SELECT loop_id FROM loops WHERE status <> 'done' ORDER BY loop_id",
                {},
            )
            return [self._key_of(loop_id) for (loop_id,) in rows]

        return await self._run(read)

    async def inference(self, loop_id: str, request: int) -> InferenceOutput | None:
        def read(conn: _C) -> InferenceOutput | None:
            row = self._row(
                conn,
                f"SELECT changes, outlined FROM log WHERE {_SPAN}"
                " AND request = :request ORDER BY id DESC LIMIT 1",
                {"loop": loop_id, "request": request},
            )
            if row is None:
                return None
            try:
                recorded = self._changes(conn, row[0], row[1]).inference
            except _DECODING as exc:
                self._unreadable(loop_id, exc)
            return None if recorded is None else recorded[1]

        return await self._run(read)

    async def calls(self, loop_id: str, request: int | None = None) -> list[CallRecord]:
        def read(conn: _C) -> list[CallRecord]:
            rows = self._rows(
                conn,
                f"SELECT ledger, outlined FROM log WHERE {_SPAN}"
                " AND ledger IS NOT NULL ORDER BY id",
                {"loop": loop_id},
            )
            try:
                entries = (self._decoded(conn, text, out) for text, out in rows)
                return fold_ledger(loop_id, entries).of(request)
            except _DECODING as exc:
                self._unreadable(loop_id, exc)

        return await self._read(read)

    async def decisions(self, loop_id: str) -> list[DecisionEntry]:
        def read(conn: _C) -> list[DecisionEntry]:
            rows = self._rows(
                conn,
                f"SELECT decisions, outlined FROM log WHERE {_SPAN}"
                " AND decisions IS NOT NULL ORDER BY id",
                {"loop": loop_id},
            )
            try:
                return [
                    DecisionEntry.model_validate(data)
                    for text, outlined in rows
                    for data in self._decoded(conn, text, outlined)
                ]
            except _DECODING as exc:
                self._unreadable(loop_id, exc)

        return await self._run(read)

    async def events(self, loop_id: str, after_seq: int = 0) -> list[AgentEvent]:
        if not self.keeps_events:
            raise StoreError(f"{self.where} keeps no events (make it with events=True)")

        def read(conn: _C) -> list[AgentEvent]:
            rows = self._rows(
                conn,
                "SELECT event, outlined FROM events WHERE loop_id = :loop"
                " AND seq > :after ORDER BY seq",
                {"loop": loop_id, "after": after_seq},
            )
            try:
                return [
                    AgentEventAdapter.validate_json(text)
                    if not outlined
                    else AgentEventAdapter.validate_python(
                        self._decoded(conn, text, outlined)
                    )
                    for text, outlined in rows
                ]
            except _DECODING as exc:
                self._unreadable(loop_id, exc)

        return await self._run(read)

    def _decoded(self, conn: _C, text: str, outlined: object) -> Any:
        """A row's JSON as data, its large strings read back (`_outline`)."""
        data = json.loads(text)
        if not outlined:
            return data
        return inline(data, lambda digest: self._blob(conn, digest))

    def _changes(self, conn: _C, text: str, outlined: object) -> _Changes:
        if not outlined:
            return _Changes.model_validate_json(text)
        return _Changes.model_validate(self._decoded(conn, text, outlined))

    def _blob(self, conn: _C, digest: str) -> str:
        """A large string (or an image's base64) written out of line (see
        `_outline`), checked against its digest.

        Raises:
            KeyError, ValueError: the store holds no such blob, or one whose
                bytes are not those of its digest (a damaged file or row).
        """
        row = self._row(
            conn, "SELECT data FROM blobs WHERE digest = :digest", {"digest": digest}
        )
        if row is None:
            raise KeyError(f"no blob {digest}")
        data = bytes(row[0])
        found = hashlib.sha256(data).hexdigest()
        if found != digest:
            raise ValueError(
                f"the blob {digest} is damaged: its {len(data):,} bytes hash to {found}"
            )
        return data.decode("utf-8", "surrogatepass")

    async def _read(self, fn: Callable[[_C], _T]) -> _T:
        """`fn`, reads of several statements, in one read transaction: they see
        one state of the store, whatever another process commits meanwhile."""

        def read(conn: _C) -> _T:
            with self._snapshot(conn):
                return fn(conn)

        return await self._run(read)

    @abstractmethod
    def _snapshot(self, conn: _C) -> AbstractContextManager[object]:
        """A read transaction."""

    # ------------------------------------------------------- shared contexts

    async def context(
        self, context_id: str
    ) -> tuple[list[ContextItem], list[str]] | None:
        def read(conn: _C) -> tuple[list[ContextItem], list[str]] | None:
            rows = self._rows(
                conn,
                "SELECT item, digest FROM contexts WHERE context_id = :id"
                " ORDER BY position",
                {"id": context_id},
            )
            if not rows:
                return None
            return (
                [ContextItemAdapter.validate_json(item) for item, _ in rows],
                [str(digest) for _, digest in rows],
            )

        return await self._read(read)

    async def append_context(
        self,
        context_id: str,
        first: int,
        items: Sequence[ContextItem],
        digests: Sequence[str],
    ) -> None:
        items = context_appended(context_id, first, items, digests)
        rows: list[dict[str, Any]] = [
            {"id": context_id, "position": first + n, "item": json_of(i), "digest": d}
            for n, (i, d) in enumerate(zip(items, digests, strict=True))
        ]

        def write(conn: _C) -> None:
            with self._transaction(conn):
                self._execute(
                    conn,
                    self.q(
                        "DELETE FROM contexts WHERE context_id = :id"
                        " AND position >= :first"
                    ),
                    {"id": context_id, "first": first},
                )
                for row in rows:
                    self._execute(
                        conn,
                        self.q(
                            "INSERT INTO contexts (context_id, position, item, digest)"
                            " VALUES (:id, :position, :item, :digest)"
                        ),
                        row,
                    )
            self._count(sum(len(r["item"]) + len(r["digest"]) for r in rows))

        await self._run(write)

    # ----------------------------------------------------------------- leases

    async def acquire(
        self, loop_id: str, owner: str, *, replacing: str | None = None
    ) -> Lease:
        def write(conn: _C) -> Lease:
            self._forget(loop_id)  # a new lease: a new run
            with self._transaction(conn):
                row = self._row(
                    conn,
                    "SELECT owner, epoch, status, lease_until > {now} FROM loops"
                    " WHERE loop_id = :loop",
                    {"loop": loop_id, "now": time.time()},
                )
                if row is None:
                    raise StoreError(f"{self.where} holds no loop {loop_id!r}")
                holder, epoch, status, live = row
                if status == LoopStatus.done.value:
                    raise StoreError(
                        f"loop {loop_id} has ended: it is never taken again"
                    )
                if holder not in (None, owner, replacing) and live:
                    raise LoopLockedError(loop_id, holder)
                # Only from the epoch read (another taker, between the read and
                # this write, makes it change nothing): one winner of a race.
                taken = self._execute(
                    conn,
                    self.q(
                        "UPDATE loops SET owner = :owner, epoch = :epoch + 1,"
                        " lease_until = {now} + :ttl, updated = {now}"
                        " WHERE loop_id = :loop AND epoch = :epoch"
                        " AND status <> 'done'"
                    ),
                    {
                        "owner": owner,
                        "epoch": int(epoch),
                        "ttl": self.lease_ttl,
                        "now": time.time(),
                        "loop": loop_id,
                    },
                ).rowcount
            if not taken:  # (another took it, or its owner ended it, meanwhile)
                row = self._row(
                    conn,
                    "SELECT owner, status FROM loops WHERE loop_id = :loop",
                    {"loop": loop_id},
                )
                if row is not None and row[1] == LoopStatus.done.value:
                    raise StoreError(
                        f"loop {loop_id} has ended: it is never taken again"
                    )
                raise LoopLockedError(loop_id, str(row[0] if row else None))
            self._count(0)
            return Lease(owner, int(epoch) + 1)

        return await self._run(write)

    async def renew(
        self, owner: str, loop_ids: Sequence[str] | None = None
    ) -> dict[str, int]:
        def write(conn: _C) -> dict[str, int]:
            params = {"owner": owner, "ttl": self.lease_ttl, "now": time.time()}
            renew = (
                "UPDATE loops SET lease_until = {now} + :ttl WHERE owner = :owner"
                " AND status <> 'done'"
            )
            renewed: dict[str, int] = {}
            if loop_ids is None:
                rows = self._rows(conn, f"{renew} RETURNING loop_id, epoch", params)
                renewed.update((self._key_of(loop), int(epoch)) for loop, epoch in rows)
            elif loop_ids:
                sql = f"{renew} AND loop_id = :loop RETURNING loop_id, epoch"
                with self._transaction(conn):  # (one write, however many loops)
                    for loop_id in loop_ids:
                        for loop, epoch in self._rows(
                            conn, sql, {**params, "loop": loop_id}
                        ):
                            renewed[self._key_of(loop)] = int(epoch)
            self._count(0)
            return renewed

        return await self._run(write)

    async def release(
        self,
        owner: str,
        loop_ids: Sequence[str] | None = None,
        *,
        epochs: Mapping[str, int] | None = None,
    ) -> None:
        def write(conn: _C) -> None:
            release = (
                "UPDATE loops SET owner = NULL, lease_until = 0 WHERE owner = :owner"
            )
            if loop_ids is None:
                self._forget_all()
                self._execute(conn, self.q(release), {"owner": owner})
            else:
                for loop_id in loop_ids:
                    self._forget(loop_id)
                    epoch = None if epochs is None else epochs.get(loop_id)
                    if epoch is None:
                        query = f"{release} AND loop_id = :loop"
                    else:  # not a lease taken again since
                        query = f"{release} AND loop_id = :loop AND epoch = :epoch"
                    self._execute(
                        conn,
                        self.q(query),
                        {"owner": owner, "loop": loop_id, "epoch": epoch},
                    )
            self._count(0)

        await self._run(write)

    # --------------------------------------------------------------- presence

    async def hold_presence(self, owner: str) -> None:
        """Hold `owner`'s slot (a lock only a live process holds: the file's
        byte-range lock, PostgreSQL's advisory lock), so another process can
        tell it is alive (`alive`); slots are a hash of the owner's name: two
        owners sharing one make a dead one look alive, never the reverse."""
        self._refuse_presence()
        slot = self._presence_slot(owner)

        def hold(conn: _C) -> None:
            held = self._held.get(slot, 0)
            if not held:
                self._lock_slot(conn, slot)
            self._held[slot] = held + 1

        await self._run(hold)
        await super().hold_presence(owner)

    def _refuse_presence(self) -> None:
        """Refuse a presence in a read-only store (it would write the lock's
        file or row)."""
        if self.read_only:
            raise StoreError(
                f"{self.where}: the store was opened with read_only=True: no "
                "runtime can hold its loops"
            )

    async def drop_presence(self, owner: str) -> None:
        await super().drop_presence(owner)
        slot = self._presence_slot(owner)

        def drop(conn: _C) -> None:
            held = self._held.get(slot, 0) - 1
            if held > 0:
                self._held[slot] = held
                return
            self._held.pop(slot, None)
            self._unlock_slot(conn, slot)

        if self._thread.running:
            await self._run(drop)

    async def alive(self, owner: str) -> bool | None:
        if owner in _PRESENT:
            return True
        slot = self._presence_slot(owner)

        def check(conn: _C) -> bool | None:
            if slot in self._held:
                return None  # a runtime of this process shares the slot: unknown
            free = self._slot_free(conn, slot)
            return None if free is None else not free

        return await self._run(check)

    # --------------------------------------------------------------- requests

    async def submit_request(
        self,
        loop_id: str,
        kind: Literal["resume", "cancel", "fork"],
        *,
        decision: DecisionRecord | Proceed | Rewrite | Abort | None = None,
        seq: int | None = None,
        by: str,
        reason: str | None = None,
        model: str | None = None,
    ) -> LoopRequest:
        new = request_checked(loop_id, kind, decision, seq, by, reason, model)
        self._refuse_read_only("takes no request")
        values = {
            "loop": new.loop_id,
            "kind": new.kind,
            # A fork's model goes in the decision column (a fork has no
            # decision): the table needs no new column.
            "decision": json.dumps({"model": new.model}, ensure_ascii=False)
            if new.kind == "fork"
            else None
            if new.decision is None
            else json_of(new.decision),
            "seq": new.seq,
            "asker": json.dumps(new.by, ensure_ascii=False),
            "reason": None
            if new.reason is None
            else json.dumps(new.reason, ensure_ascii=False),
            "now": time.time(),
        }
        insert = (
            "INSERT INTO requests (loop_id, kind, decision, seq, asker, reason,"
            " created, status) VALUES (:loop, :kind, :decision, :seq, :asker,"
            " :reason, {now}, 'pending') RETURNING id, created"
        )

        def write(conn: _C) -> LoopRequest:
            with self._transaction(conn):
                row = self._row(
                    conn,
                    "SELECT status FROM loops WHERE loop_id = :loop",
                    {"loop": new.loop_id},
                )
                if row is None:
                    raise unknown_loop(self.where, new.loop_id)
                if row[0] == LoopStatus.done.value and new.kind != "fork":
                    raise ended_loop(new.loop_id)
                request_id, created = self._row(conn, insert, values)
                self._announce_request(conn, new.loop_id)
            self._count(sum(len(v) for v in values.values() if isinstance(v, str)))
            return LoopRequest(
                id=int(request_id),
                loop_id=new.loop_id,
                kind=new.kind,
                decision=new.decision,
                seq=new.seq,
                by=new.by,
                reason=new.reason,
                created_at=datetime.fromtimestamp(float(created), UTC),
                model=new.model,
            )

        return await self._run(write)

    def _announce_request(self, conn: _C, loop_id: str) -> None:
        """Tell whoever listens that a request for the loop was stored (in the
        request's transaction; a dialect that can: PostgreSQL's NOTIFY)."""

    async def requests(
        self,
        loop_id: str | None = None,
        *,
        status: Literal["pending", "applied", "refused"] | None = None,
    ) -> list[LoopRequest]:
        requests_wanted(loop_id, status)
        where = []
        params: dict[str, Any] = {}
        if loop_id is not None:
            where.append("loop_id = :loop")
            params["loop"] = loop_id
        if status is not None:
            where.append("status = :status")
            params["status"] = status
        condition = f" WHERE {' AND '.join(where)}" if where else ""
        return await self._run(
            lambda conn: self._read_requests(conn, condition, params)
        )

    async def pending_requests(self, after_id: int = 0) -> list[LoopRequest]:
        """The pending requests (see `Requests`); one that cannot be read is
        not among them: it is refused, its note saying why (a store opened to
        read only leaves it pending), so that it stops no other loop's."""
        after_id = request_id_checked("after_id", after_id)
        condition = " WHERE status = 'pending' AND id > :after"
        found: list[LoopRequest] = []
        damaged: list[tuple[int, StoreError]] = []

        def read(conn: _C) -> None:
            for row in self._request_rows(conn, condition, {"after": after_id}):
                try:
                    found.append(self._request_of(row))
                except StoreError as exc:
                    damaged.append((int(row[0]), exc))

        await self._run(read)
        for request_id, error in damaged:
            if not self.read_only:
                await self.refuse_request(
                    request_id, f"the request cannot be read: {error_text(error)}"
                )
        return found

    def _read_requests(
        self, conn: _C, condition: str, params: Mapping[str, Any]
    ) -> list[LoopRequest]:
        rows = self._request_rows(conn, condition, params)
        return [self._request_of(row) for row in rows]

    def _request_rows(
        self, conn: _C, condition: str, params: Mapping[str, Any]
    ) -> list[Any]:
        if not self._has_requests:
            return []
        return self._rows(
            conn,
            "SELECT id, loop_id, kind, decision, seq, asker, reason, created,"
            f" status, resolved, note FROM requests{condition} ORDER BY id",
            params,
        )

    def _request_of(self, row: Sequence[Any]) -> LoopRequest:
        """A request from its row.

        Raises:
            StoreError: the row cannot be read (it names the request).
        """
        request_id, loop_id, kind, decision, seq, asker = row[:6]
        reason, created, status, resolved, note = row[6:]
        try:
            forking = kind == "fork" and decision is not None
            return LoopRequest(
                id=int(request_id),
                loop_id=self._key_of(loop_id),
                kind=kind,
                decision=None
                if decision is None or forking
                else DecisionRecord.model_validate_json(decision),
                model=json.loads(decision)["model"] if forking else None,
                seq=None if seq is None else int(seq),
                by=json.loads(asker),
                reason=None if reason is None else json.loads(reason),
                created_at=datetime.fromtimestamp(float(created), UTC),
                status=status,
                resolved_at=None
                if resolved is None
                else datetime.fromtimestamp(float(resolved), UTC),
                note=None if note is None else json.loads(note),
            )
        except _DECODING as exc:
            raise StoreError(
                f"{self.where}: request {request_id} cannot be read "
                f"({type(exc).__name__}: {str(exc)[:300]})"
            ) from exc

    async def refuse_request(self, request_id: int, note: str) -> bool:
        request_id = request_id_checked("request_id", request_id)
        text = json.dumps(note_checked(note), ensure_ascii=False)
        self._refuse_read_only("refuses no request")

        def write(conn: _C) -> bool:
            refused = self._execute(
                conn,
                self.q(
                    "UPDATE requests SET status = 'refused', resolved = {now},"
                    " note = :note WHERE id = :request AND status = 'pending'"
                ),
                {"request": request_id, "note": text, "now": time.time()},
            ).rowcount
            self._count(len(text))
            return bool(refused)

        return await self._run(write)

    def _applied(self, conn: _C, commit: Commit) -> None:
        """Mark the requests `commit` applies applied, in its transaction (those
        of its loop still pending).

        Raises:
            StoreError: one was refused since the loop read it (withdrawn):
                the commit that would apply it is not written.
        """
        sql = self.q(
            "UPDATE requests SET status = 'applied', resolved = {now}"
            # A fork's request is the source loop's, applied by the fork's
            # first commit.
            " WHERE id = :request AND (loop_id = :loop OR kind = 'fork')"
            " AND status = 'pending'"
        )
        now = time.time()
        for request_id in commit.requests:
            params = {"request": request_id, "loop": commit.loop_id, "now": now}
            if self._execute(conn, sql, params).rowcount:
                continue
            row = self._row(
                conn,
                "SELECT status FROM requests WHERE id = :request",
                {"request": request_id},
            )
            if row is not None and row[0] == "refused":
                raise withdrawn(self.where, request_id)

    # ------------------------------------------------------------ breakpoints

    async def add_breakpoint(
        self,
        *,
        loop_id: str | None = None,
        agent_id: str | None = None,
        state: LoopState | str | None = None,
        every: bool = False,
        by: str,
    ) -> StoredBreak:
        new = break_checked(loop_id, agent_id, state, every, by)
        self._refuse_read_only("sets no breakpoint")
        asker = json.dumps(new.by, ensure_ascii=False)
        values = {
            "loop": new.loop_id,
            "agent": None if new.agent_id is None else self._key_of_agent(new.agent_id),
            "state": None if new.state is None else new.state.value,
            "asker": asker,
            "now": time.time(),
        }
        insert = (
            "INSERT INTO breakpoints (loop_id, agent_id, state, asker, created)"
            " VALUES (:loop, :agent, :state, :asker, {now}) RETURNING id, created"
        )

        def write(conn: _C) -> StoredBreak:
            with self._transaction(conn):
                if new.loop_id is not None:
                    row = self._row(
                        conn,
                        "SELECT status FROM loops WHERE loop_id = :loop",
                        {"loop": new.loop_id},
                    )
                    if row is None:
                        raise unknown_loop(self.where, new.loop_id)
                    if row[0] == LoopStatus.done.value:
                        raise ended_loop_break(new.loop_id)
                break_id, created = self._row(conn, insert, values)
                # A notice only wakes the watching runtimes, which read both.
                self._announce_request(conn, new.loop_id or "")
            self._count(len(asker))
            return StoredBreak(
                id=int(break_id),
                loop_id=new.loop_id,
                agent_id=new.agent_id,
                state=new.state,
                by=new.by,
                created_at=datetime.fromtimestamp(float(created), UTC),
            )

        return await self._run(write)

    async def remove_breakpoint(
        self, breakpoint_id: int, *, by: str
    ) -> StoredBreak | None:
        breakpoint_id = request_id_checked("breakpoint_id", breakpoint_id)
        remover = json.dumps(by_checked(by, "removes it"), ensure_ascii=False)
        self._refuse_read_only("removes no breakpoint")
        update = (
            "UPDATE breakpoints SET removed = {now}, remover = :remover"
            " WHERE id = :id AND removed IS NULL RETURNING " + _BREAK_COLUMNS
        )

        def write(conn: _C) -> StoredBreak | None:
            if not self._has_breakpoints:
                return None
            with self._transaction(conn):
                row = self._row(
                    conn,
                    update,
                    {"id": breakpoint_id, "remover": remover, "now": time.time()},
                )
                if row is not None:
                    self._announce_request(conn, "")
            if row is None:
                return None
            self._count(len(remover))
            return self._break_of(row)

        return await self._run(write)

    async def breakpoints(
        self, loop_id: str | None = None, agent_id: str | None = None
    ) -> list[StoredBreak]:
        breaks_wanted(loop_id, agent_id)
        where = []
        params: dict[str, Any] = {}
        if loop_id is not None:
            where.append("loop_id = :loop")
            params["loop"] = loop_id
        if agent_id is not None:
            where.append("agent_id = :agent")
            params["agent"] = self._key_of_agent(agent_id)
        either = f" AND ({' OR '.join(where)})" if where else ""
        sql = (
            f"SELECT {_BREAK_COLUMNS} FROM breakpoints WHERE removed IS NULL"
            f"{either} ORDER BY id"
        )

        def read(conn: _C) -> list[StoredBreak]:
            if not self._has_breakpoints:
                return []
            return [self._break_of(row) for row in self._rows(conn, sql, params)]

        return await self._run(read)

    def _break_of(self, row: Sequence[Any]) -> StoredBreak:
        """A stored breakpoint from its row.

        Raises:
            StoreError: the row cannot be read (it names the breakpoint).
        """
        break_id, loop_id, agent_id, state, asker, created, removed, remover = row
        try:
            return StoredBreak(
                id=int(break_id),
                loop_id=None if loop_id is None else self._key_of(loop_id),
                agent_id=None if agent_id is None else self._key_of(agent_id),
                state=state,
                by=json.loads(asker),
                created_at=datetime.fromtimestamp(float(created), UTC),
                removed_at=None
                if removed is None
                else datetime.fromtimestamp(float(removed), UTC),
                removed_by=None if remover is None else json.loads(remover),
            )
        except _DECODING as exc:
            raise StoreError(
                f"{self.where}: breakpoint {break_id} cannot be read "
                f"({type(exc).__name__}: {str(exc)[:300]})"
            ) from exc

    def _refuse_read_only(self, what: str) -> None:
        """Raise `StoreError` if the store was opened to read only ("it `what`")."""
        if self.read_only:
            raise StoreError(
                f"{self.where}: the store was opened with read_only=True: it {what}"
            )


_BREAK_COLUMNS: Final = "id, loop_id, agent_id, state, asker, created, removed, remover"
"""A `breakpoints` row's columns, as `_break_of` reads them."""

read_fields_fast(globals())
