"""`MemoryStore`: a durable store that lives as long as its process.

Loops outlive the runtime that ran them (a paused loop can be resumed by a
later `Runtime(store=...)` in the same process), but not the process. It keeps
the models themselves (records and items are frozen), so nothing is
serialized: `bytes_written` stays 0.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from agentfsm.events import AgentEvent
from agentfsm.inference import InferenceOutput
from agentfsm.messages import ContextItem, FunctionCallOutputItem
from agentfsm.record import LoopRecord
from agentfsm.results import LoopStatus

from ._base import (
    CallRecord,
    Commit,
    LoopIdTakenError,
    LoopLockedError,
    LoopStore,
    StoredLoop,
    StoreStatistics,
    checked_lease_ttl,
)

__all__ = ("MemoryStore",)


class _Entry:
    __slots__ = ("items", "lease_until", "owner", "records")

    def __init__(self) -> None:
        self.records: dict[int, LoopRecord] = {}
        self.items: list[ContextItem] = []
        self.owner: str | None = None
        self.lease_until = 0.0


class MemoryStore(LoopStore):
    """A store in this process's memory (tests, and loops that must outlive one
    runtime but not the process)."""

    def __init__(self, *, events: bool = False, lease_ttl: float = 30.0) -> None:
        self.keeps_events = events
        self.lease_ttl = checked_lease_ttl(lease_ttl)
        self._events: dict[str, list[AgentEvent]] = {}
        self._contexts: dict[str, tuple[list[ContextItem], list[str]]] = {}
        self._loops: dict[str, _Entry] = {}
        self._latest: dict[str, LoopRecord] = {}
        self._inferences: dict[tuple[str, int], InferenceOutput] = {}
        self._calls: dict[str, CallRecord] = {}
        self._commits = 0

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(commits=self._commits, bytes_written=0)

    async def commit(self, commit: Commit, owner: str) -> None:
        record = commit.record
        entry = self._loops.get(record.loop_id)
        if commit.new and entry is not None:
            raise LoopIdTakenError(record.loop_id)
        if entry is None:
            entry = self._loops[record.loop_id] = _Entry()
        self._take(record.loop_id, entry, owner)
        items = entry.items
        del items[commit.first :]  # (only `truncate` leaves anything to drop)
        items.extend(commit.items)
        for at, item in (commit.replaced or {}).items():
            items[at] = item
        for earlier in commit.earlier:
            entry.records[earlier.seq] = earlier
        entry.records[record.seq] = record
        self._latest[record.loop_id] = record
        for intent in commit.intents:
            self._calls.setdefault(intent.key, intent)
        for key, out, terminate in commit.ended:
            self._end(key, out, terminate)
        if commit.inference is not None:
            number, output = commit.inference
            self._inferences[record.loop_id, number] = output
        self._commits += 1

    async def load(self, loop_id: str) -> StoredLoop | None:
        entry = self._loops.get(loop_id)
        if entry is None:
            return None
        owner = entry.owner if entry.lease_until > time.time() else None
        return StoredLoop(self._latest[loop_id], list(entry.items), owner)

    async def record_at(self, loop_id: str, seq: int) -> LoopRecord | None:
        entry = self._loops.get(loop_id)
        if entry is None:
            return None
        at = [s for s in entry.records if s <= seq]
        return entry.records[max(at)] if at else None

    async def unfinished(self) -> list[str]:
        return sorted(
            loop_id
            for loop_id, record in self._latest.items()
            if record.status is not LoopStatus.done
        )

    async def record_inference(
        self, loop_id: str, request: int, output: InferenceOutput
    ) -> None:
        self._inferences[loop_id, request] = output
        self._commits += 1

    async def append_events(self, events: Sequence[AgentEvent]) -> None:
        for event in events:
            self._events.setdefault(event.loop_id, []).append(event)
        self._commits += 1

    async def events(self, loop_id: str, after_seq: int = 0) -> list[AgentEvent]:
        return [e for e in self._events.get(loop_id, ()) if e.seq > after_seq]

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
        held_items, held_digests = self._contexts.setdefault(context_id, ([], []))
        del held_items[first:], held_digests[first:]
        held_items.extend(items)
        held_digests.extend(digests)
        self._commits += 1

    async def inference(self, loop_id: str, request: int) -> InferenceOutput | None:
        return self._inferences.get((loop_id, request))

    async def calls(self, loop_id: str, request: int) -> list[CallRecord]:
        return sorted(
            (
                c
                for c in self._calls.values()
                if c.loop_id == loop_id and c.request == request
            ),
            key=lambda c: c.position,
        )

    async def begin_call(self, call: CallRecord) -> CallRecord:
        known = self._calls.get(call.key)
        if known is not None and known.status == "done":
            return known
        if known is not None:
            call = call.model_copy(update={"attempt": known.attempt + 1})
        self._calls[call.key] = call
        self._commits += 1
        return call

    async def end_call(
        self, loop_id: str, key: str, output: FunctionCallOutputItem, terminate: bool
    ) -> None:
        self._end(key, output, terminate)
        self._commits += 1

    def _end(self, key: str, output: FunctionCallOutputItem, terminate: bool) -> None:
        known = self._calls[key]
        self._calls[key] = known.model_copy(
            update={"status": "done", "output": output, "terminate": terminate}
        )

    async def mark_uncertain(self, loop_id: str, keys: Sequence[str]) -> None:
        for key in keys:
            self._calls[key] = self._calls[key].model_copy(
                update={"status": "uncertain"}
            )
        self._commits += 1

    def _take(
        self, loop_id: str, entry: _Entry, owner: str, replacing: str | None = None
    ) -> None:
        now = time.time()
        if (
            entry.owner is not None
            and entry.owner not in (owner, replacing)
            and entry.lease_until > now
        ):
            raise LoopLockedError(loop_id, entry.owner)
        entry.owner = owner
        entry.lease_until = now + self.lease_ttl

    async def acquire(
        self, loop_id: str, owner: str, *, replacing: str | None = None
    ) -> str | None:
        entry = self._loops.get(loop_id)
        if entry is None:
            return None  # nothing to own: the loop's first commit takes it
        try:
            self._take(loop_id, entry, owner, replacing)
        except LoopLockedError as exc:
            return exc.owner
        return None

    async def renew(self, owner: str) -> None:
        until = time.time() + self.lease_ttl
        for loop_id, entry in self._loops.items():
            latest = self._latest.get(loop_id)
            if entry.owner == owner and (
                latest is None or latest.status is not LoopStatus.done
            ):
                entry.lease_until = until

    async def release(self, owner: str, loop_ids: Sequence[str] | None = None) -> None:
        for loop_id, entry in self._loops.items():
            if entry.owner == owner and (loop_ids is None or loop_id in loop_ids):
                entry.owner = None
                entry.lease_until = 0.0
