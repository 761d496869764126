"""`MemoryStore`: a durable store that lives as long as its process.

Loops outlive the runtime that ran them (a paused loop can be resumed by a
later `Runtime(store=...)` in the same process), but not the process. It keeps
the models themselves (records and items are frozen), so nothing is
serialized: `bytes_written` stays 0. It fences writes as the SQL stores do.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Literal

from agentfsm._arguments import check, seconds
from agentfsm.events import AgentEvent
from agentfsm.inference import InferenceOutput
from agentfsm.interception import Abort, Proceed, Rewrite
from agentfsm.messages import ContextItem
from agentfsm.record import DecisionEntry, DecisionRecord, LoopRecord
from agentfsm.results import LoopStatus, PathStep
from agentfsm.states import LoopState

from ._base import (
    _PRESENT,
    CallRecord,
    Commit,
    EventArchive,
    Lease,
    LeaseLostError,
    LedgerFold,
    LoopIdTakenError,
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
    context_appended,
    ended_loop,
    loops_wanted,
    note_checked,
    request_checked,
    request_id_checked,
    requests_wanted,
    run_commits,
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

__all__ = ("MemoryStore",)


class _Entry:
    __slots__ = (
        "decisions",
        "epoch",
        "events",
        "inferences",
        "items",
        "latest",
        "lease_until",
        "ledger",
        "length",
        "owner",
        "path",
        "records",
        "updated",
    )

    def __init__(self, owner: str) -> None:
        self.records: dict[int, tuple[LoopRecord, int]] = {}
        """Each record (its path left empty) with its path's length, by seq."""
        self.latest: LoopRecord | None = None
        self.length = 0
        self.path: list[PathStep] = []
        self.items: list[ContextItem] = []
        self.owner: str | None = owner
        self.epoch = 1
        self.lease_until = 0.0
        self.ledger = LedgerFold()
        self.inferences: dict[int, InferenceOutput] = {}
        self.events: list[AgentEvent] = []
        self.decisions: list[DecisionEntry] = []
        self.updated = time.time()
        """When its status last changed (or a runtime took it)."""

    def whole(self, record: LoopRecord, length: int) -> LoopRecord:
        """A record as committed, with its path (the loop's, to its length)."""
        return record.model_copy(update={"path": tuple(self.path[:length])})

    @property
    def done(self) -> bool:
        return self.latest is not None and self.latest.status is LoopStatus.done


class MemoryStore(LoopStore, EventArchive, SharedContexts, Requests, SharedBreakpoints):
    """A store in this process's memory (tests, and loops that must outlive one
    runtime but not the process)."""

    def __init__(self, *, events: bool = False, lease_ttl: float = 30.0) -> None:
        check("events", events, bool)
        self.keeps_events = events
        self.lease_ttl = seconds("lease_ttl", lease_ttl, positive=True)
        self._contexts: dict[str, tuple[list[ContextItem], list[str]]] = {}
        self._loops: dict[str, _Entry] = {}
        self._commits = 0
        self._requests: dict[int, LoopRequest] = {}
        """Every request, by id (ids in the order given)."""
        self._breaks: dict[int, StoredBreak] = {}
        """Every stored breakpoint, removed ones too, by id (in the order set)."""

    def __repr__(self) -> str:
        return f"MemoryStore(at {id(self):#x})"

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(commits=self._commits, bytes_written=0)

    # ------------------------------------------------------------- commit log

    async def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        return await run_commits(commits, self._write)

    async def _write(self, commit: Commit) -> None:
        entry = self._fenced(commit)
        for request_id in commit.requests:  # (checked before anything is written)
            request = self._requests.get(request_id)
            if request is not None and request.status == "refused":
                raise withdrawn(repr(self), request_id)
        record = commit.record
        items = entry.items
        del items[commit.first :]  # (only `truncate` leaves anything to drop)
        items.extend(commit.items)
        for at, item in (commit.replaced or {}).items():
            items[at] = item
        for earlier, length in commit.earlier:
            entry.records[earlier.seq] = (earlier, length)
        if record is not None:
            del entry.path[commit.path_from :]
            entry.path.extend(commit.steps)
            entry.records[record.seq] = (record, commit.path_length)
            latest = entry.latest
            if latest is not None and latest.status is not record.status:
                entry.updated = time.time()
            entry.latest, entry.length = record, commit.path_length
        for call in commit.ledger:
            entry.ledger.add(call)
        if commit.inference is not None:
            number, output = commit.inference
            entry.inferences[number] = output
        if self.keeps_events:
            entry.events.extend(commit.events)
        entry.decisions.extend(commit.decisions)
        if commit.requests:
            self._applied(commit.loop_id, commit.requests)
        entry.lease_until = time.time() + self.lease_ttl
        self._commits += 1

    def _applied(self, loop_id: str, ids: Sequence[int]) -> None:
        """Mark the loop's pending requests of `ids` applied (with the commit
        that applies them)."""
        now = datetime.now(UTC)
        for request_id in ids:
            request = self._requests.get(request_id)
            if (
                request is not None
                # A fork's request is its source's, applied by the fork's.
                and (request.loop_id == loop_id or request.kind == "fork")
                and request.status == "pending"
            ):
                self._requests[request_id] = request.model_copy(
                    update={"status": "applied", "resolved_at": now}
                )

    def _fenced(self, commit: Commit) -> _Entry:
        """The loop's entry, if `commit` may write it (see `Commit.lease`)."""
        loop_id, lease = commit.loop_id, commit.lease
        entry = self._loops.get(loop_id)
        if commit.new:
            if entry is not None:
                raise LoopIdTakenError(loop_id)
            entry = self._loops[loop_id] = _Entry(lease.owner)
            return entry
        if entry is None:
            raise StoreError(f"{self!r} holds no loop {loop_id!r}")
        if entry.done:
            raise LeaseLostError(loop_id, lease.owner, "the loop has ended")
        if entry.owner != lease.owner or entry.epoch != lease.epoch:
            raise LeaseLostError(
                loop_id,
                lease.owner,
                f"{entry.owner or 'nobody'} holds it (epoch {entry.epoch}, this "
                f"runtime's {lease.epoch})",
            )
        return entry

    async def load(self, loop_id: str) -> StoredLoop | None:
        entry = self._loops.get(loop_id)
        if entry is None or entry.latest is None:
            return None
        owner = entry.owner if entry.lease_until > time.time() else None
        last_event = entry.events[-1].seq if entry.events else 0
        record = entry.whole(entry.latest, entry.length)
        return StoredLoop(record, list(entry.items), owner, entry.epoch, last_event)

    async def record_at(self, loop_id: str, seq: int) -> LoopRecord | None:
        entry = self._loops.get(loop_id)
        if entry is None:
            return None
        at = [s for s in entry.records if s <= seq]
        return entry.whole(*entry.records[max(at)]) if at else None

    async def unfinished(self) -> list[str]:
        return sorted(
            loop_id
            for loop_id, entry in self._loops.items()
            if entry.latest is not None and not entry.done
        )

    async def loops(
        self,
        *,
        status: str | None = None,
        agent_id: str | None = None,
        loop_id: str | None = None,
        unreadable: list[UnreadableLoop] | None = None,
    ) -> list[StoredLoopSummary]:
        """The store's loops, oldest first (see `SQLiteStore.loops`; a memory
        store holds no data it cannot read, so `unreadable` stays empty)."""
        wanted = loops_wanted(status, agent_id)
        if loop_id is not None:
            check("loop_id", loop_id, str)
        now = time.time()
        return [
            StoredLoopSummary.of(
                entry.latest,
                owner=entry.owner,
                lease_until=entry.lease_until,
                lease_live=entry.lease_until > now,
                status_since=entry.updated,
            )
            for key, entry in self._loops.items()
            if entry.latest is not None
            and (wanted is None or entry.latest.status is wanted)
            and (agent_id is None or entry.latest.agent_id == agent_id)
            and (loop_id is None or key == loop_id)
        ]

    async def loop_ids(self) -> list[str]:
        """The ids of the store's loops, oldest first (see `SQLiteStore.loop_ids`)."""
        return [key for key, entry in self._loops.items() if entry.latest is not None]

    async def inference(self, loop_id: str, request: int) -> InferenceOutput | None:
        entry = self._loops.get(loop_id)
        return None if entry is None else entry.inferences.get(request)

    # ----------------------------------------------------------------- ledger

    async def calls(self, loop_id: str, request: int | None = None) -> list[CallRecord]:
        entry = self._loops.get(loop_id)
        return [] if entry is None else entry.ledger.of(request)

    async def decisions(self, loop_id: str) -> list[DecisionEntry]:
        entry = self._loops.get(loop_id)
        return [] if entry is None else list(entry.decisions)

    # ----------------------------------------------------------------- events

    async def events(self, loop_id: str, after_seq: int = 0) -> list[AgentEvent]:
        if not self.keeps_events:
            raise StoreError(f"{self!r} keeps no events (make it with events=True)")
        entry = self._loops.get(loop_id)
        return [] if entry is None else [e for e in entry.events if e.seq > after_seq]

    # ------------------------------------------------------- shared contexts

    async def context(
        self, context_id: str
    ) -> tuple[list[ContextItem], list[str]] | None:
        held = self._contexts.get(context_id)
        return None if held is None else (list(held[0]), list(held[1]))

    async def append_context(
        self,
        context_id: str,
        first: int,
        items: Sequence[ContextItem],
        digests: Sequence[str],
    ) -> None:
        items = context_appended(context_id, first, items, digests)
        held_items, held_digests = self._contexts.setdefault(context_id, ([], []))
        del held_items[first:], held_digests[first:]
        held_items.extend(items)
        held_digests.extend(digests)
        self._commits += 1

    # ----------------------------------------------------------------- leases

    async def acquire(
        self, loop_id: str, owner: str, *, replacing: str | None = None
    ) -> Lease:
        entry = self._loops.get(loop_id)
        if entry is None or entry.latest is None:
            raise StoreError(f"{self!r} holds no loop {loop_id!r}")
        if entry.done:
            raise StoreError(f"loop {loop_id} has ended: it is never taken again")
        if (
            entry.owner is not None
            and entry.owner not in (owner, replacing)
            and entry.lease_until > time.time()
        ):
            raise LoopLockedError(loop_id, entry.owner)
        entry.owner = owner
        entry.epoch += 1
        entry.updated = time.time()
        entry.lease_until = entry.updated + self.lease_ttl
        self._commits += 1
        return Lease(owner, entry.epoch)

    async def renew(
        self, owner: str, loop_ids: Sequence[str] | None = None
    ) -> dict[str, int]:
        until = time.time() + self.lease_ttl
        renewed = {}
        for loop_id in self._loops if loop_ids is None else loop_ids:
            entry = self._loops.get(loop_id)
            if entry is not None and entry.owner == owner and not entry.done:
                entry.lease_until = until
                renewed[loop_id] = entry.epoch
        return renewed

    async def release(
        self,
        owner: str,
        loop_ids: Sequence[str] | None = None,
        *,
        epochs: Mapping[str, int] | None = None,
    ) -> None:
        for loop_id in list(self._loops) if loop_ids is None else loop_ids:
            entry = self._loops.get(loop_id)
            epoch = None if epochs is None else epochs.get(loop_id)
            if (
                entry is not None
                and entry.owner == owner
                and (epoch is None or entry.epoch == epoch)
            ):
                entry.owner = None
                entry.lease_until = 0.0

    async def alive(self, owner: str) -> bool | None:
        # Every runtime that ever wrote here ran in this process: one that
        # holds no presence now has exited (or was dropped without exiting).
        return owner in _PRESENT

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
        entry = self._loops.get(new.loop_id)
        if entry is None or entry.latest is None:
            raise unknown_loop(repr(self), new.loop_id)
        if entry.done and new.kind != "fork":
            raise ended_loop(new.loop_id)
        request = LoopRequest(
            id=len(self._requests) + 1,
            loop_id=new.loop_id,
            kind=new.kind,
            decision=new.decision,
            seq=new.seq,
            by=new.by,
            reason=new.reason,
            created_at=datetime.now(UTC),
            model=new.model,
        )
        self._requests[request.id] = request
        return request

    async def requests(
        self,
        loop_id: str | None = None,
        *,
        status: Literal["pending", "applied", "refused"] | None = None,
    ) -> list[LoopRequest]:
        requests_wanted(loop_id, status)
        return [
            r
            for r in self._requests.values()
            if (loop_id is None or r.loop_id == loop_id)
            and (status is None or r.status == status)
        ]

    async def pending_requests(self, after_id: int = 0) -> list[LoopRequest]:
        after_id = request_id_checked("after_id", after_id)
        return [
            r
            for r in self._requests.values()
            if r.status == "pending" and r.id > after_id
        ]

    async def refuse_request(self, request_id: int, note: str) -> bool:
        request_id = request_id_checked("request_id", request_id)
        note = note_checked(note)
        request = self._requests.get(request_id)
        if request is None or request.status != "pending":
            return False
        self._requests[request_id] = request.model_copy(
            update={"status": "refused", "resolved_at": datetime.now(UTC), "note": note}
        )
        return True

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
        if new.loop_id is not None:
            entry = self._loops.get(new.loop_id)
            if entry is None or entry.latest is None:
                raise unknown_loop(repr(self), new.loop_id)
            if entry.done:
                raise ended_loop_break(new.loop_id)
        stored = StoredBreak(
            id=len(self._breaks) + 1,
            loop_id=new.loop_id,
            agent_id=new.agent_id,
            state=new.state,
            by=new.by,
            created_at=datetime.now(UTC),
        )
        self._breaks[stored.id] = stored
        return stored

    async def remove_breakpoint(
        self, breakpoint_id: int, *, by: str
    ) -> StoredBreak | None:
        breakpoint_id = request_id_checked("breakpoint_id", breakpoint_id)
        by = by_checked(by, "removes it")
        found = self._breaks.get(breakpoint_id)
        if found is None or found.removed_at is not None:
            return None
        removed = found.model_copy(
            update={"removed_at": datetime.now(UTC), "removed_by": by}
        )
        self._breaks[breakpoint_id] = removed
        return removed

    async def breakpoints(
        self, loop_id: str | None = None, agent_id: str | None = None
    ) -> list[StoredBreak]:
        breaks_wanted(loop_id, agent_id)
        every = loop_id is None and agent_id is None
        return [
            b
            for b in self._breaks.values()
            if b.removed_at is None
            and (
                every
                or (loop_id is not None and b.loop_id == loop_id)
                or (agent_id is not None and b.agent_id == agent_id)
            )
        ]
