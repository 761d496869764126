"""What the UI reads of a store, as JSON data for its pages.

The pages draw, the server reads: every figure, row and drawing a page shows
is computed here, from the same functions `agentfsm loops` and `agentfsm
inspect` use (`StoredLoopSummary`, `build_timeline`, `path_graph`), so that
the UI and the command line never tell two stories. Everything read is the
store's text, untrusted: it leaves here as JSON strings, which the pages put
into the document as text, never as markup.

Images leave by reference (`messages.REFERENCE`: digest, media type, size,
no bytes): a page asks for an image's bytes by its digest (`image`), once,
when it shows it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from pydantic import BaseModel

from agentfsm._paths import LoopPath
from agentfsm.diagrams import path_graph
from agentfsm.events import AgentEvent
from agentfsm.messages import REFERENCE, ImageBlock
from agentfsm.results import LoopStatus
from agentfsm.store import LoopRequest, SQLStore, StoredLoopSummary, UnreadableLoop
from agentfsm.timeline import build_timeline

from ._actions import Actions, offered
from ._forks import fork_data

__all__ = ("LoopPage", "StoreSource")

_WIDTH: Final = 160
"""How much of a long value (arguments, outputs) a timeline row quotes; the
context and the ledger show them whole."""


def _now() -> datetime:
    return datetime.now(UTC)


def summary_data(loop: StoredLoopSummary) -> dict[str, Any]:
    return loop.model_dump(mode="json")


def data_of(model: BaseModel) -> dict[str, Any]:
    """A model as a page reads it: JSON data, its images by reference."""
    return model.model_dump(mode="json", context=REFERENCE)


@dataclass(slots=True)
class LoopPage:
    """What one loop's page shows, and the marks a later read compares to
    tell whether anything changed (`seq`: the last kept event's; `version`:
    the record's seq and status, its owner, its lease's expiry and whether
    that lease was live: a lease taken, given up or lapsed writes no record)."""

    data: dict[str, Any]
    seq: int
    version: tuple[Any, ...]
    items: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    lease_due: float | None = None
    """When the lease shown live lapses (seconds since the epoch), which
    nothing written says: a stream reads the loop again then."""


class StoreSource:
    """The UI's reads of one durable store (a SQLite or PostgreSQL store that
    keeps events), its loops' requests among them (read through `actions`,
    which knows where they are written)."""

    def __init__(self, store: SQLStore[Any], actions: Actions) -> None:
        self.store = store
        self.actions = actions

    async def loops(
        self, status: str | None = None, agent: str | None = None
    ) -> dict[str, Any]:
        """The loops list: each loop's summary (newest first), the counts per
        status over all loops, the agents known, and the loops that cannot
        be read (each with why)."""
        unreadable: list[UnreadableLoop] = []
        every = await self.store.loops(unreadable=unreadable)
        counts = Counter(str(loop.status) for loop in every)
        agents = sorted({loop.agent_id for loop in every})
        shown = [
            loop
            for loop in reversed(every)
            if (status is None or loop.status == status)
            and (agent is None or loop.agent_id == agent)
        ]
        return {
            "now": _now().isoformat(),
            "counts": {s.value: counts.get(s.value, 0) for s in LoopStatus},
            "agents": agents,
            "loops": [summary_data(loop) for loop in shown],
            "unreadable": [u.model_dump(mode="json") for u in unreadable],
            "breakpoints": len(await self.actions.reader().breakpoints()),
        }

    async def loop(
        self, loop_id: str, *, after: int = 0, items: int = 0
    ) -> LoopPage | None:
        """One loop's page: its summary, its path drawn as data, its ledger,
        its decisions, the context items from `items` on and the timeline
        rows past seq `after` (a page that has the earlier ones asks for the
        rest only). None: the store holds no such loop."""
        summaries = await self.store.loops(loop_id=loop_id)
        stored = await self.store.load(loop_id)
        if not summaries or stored is None:
            return None
        summary = summaries[0]
        record = stored.record
        if items > len(stored.items):
            items = 0  # the context shrank (someone edited it): send it whole
        events = await self.store.events(loop_id) if self.store.keeps_events else []
        rows = _rows(events, loop_id, after)
        calls = await self.store.calls(loop_id)
        decisions = await self.store.decisions(loop_id)
        requests = await self.actions.requests(loop_id)
        breaks = await self.actions.reader().breakpoints(loop_id, summary.agent_id)
        data = {
            "now": _now().isoformat(),
            "summary": summary_data(summary),
            "graph": path_graph(LoopPath.of(record)),
            "pause": None if record.pause is None else data_of(record.pause),
            "answer": None if record.answer is None else record.answer.content,
            "error": None
            if record.error is None
            else record.error.model_dump(mode="json"),
            "steering": [data_of(m)["content"] for m in record.steering],
            "follow_ups": [data_of(m)["content"] for m in record.follow_ups],
            "ledger": [data_of(c) for c in calls],
            "decisions": [data_of(d) for d in decisions],
            "requests": [data_of(r) for r in requests],
            "fork": await fork_data(
                self.store, loop_id, events, requests, enabled=self.actions.enabled
            ),
            "breakpoints": [b.model_dump(mode="json") for b in breaks],
            "actions": offered(record, calls) if self.actions.enabled else None,
            "user": self.actions.user,
            "items_from": items,
            "items": [data_of(i) for i in stored.items[items:]],
            "rows": rows,
            "events_kept": self.store.keeps_events,
        }
        last = events[-1].seq if events else 0
        until = summary.lease_until
        return LoopPage(
            data=data,
            seq=last,
            version=(
                record.seq,
                str(record.status),
                summary.owner,
                until,
                summary.lease_live,
                _requests_mark(requests),
                tuple(b.id for b in breaks),
            ),
            items=len(stored.items),
            rows=rows,
            lease_due=until.timestamp() if until and summary.lease_live else None,
        )

    async def image(self, loop_id: str, digest: str) -> ImageBlock | None:
        """The image of digest `digest` (`sha256:<hex>`) that the loop's data
        holds, bytes and all: in its context, its ledger, its record, its
        requests or its events. None: the store holds no such loop, or the
        loop no such image (a page asks only for what the loop shows)."""
        stored = await self.store.load(loop_id)
        if stored is None:
            return None
        # The likeliest places first; the events, the most to read, last.
        found = (
            _image_in((stored.items, stored.record), digest)
            or _image_in(await self.store.calls(loop_id), digest)
            or _image_in(await self.actions.requests(loop_id), digest)
        )
        if found is None and self.store.keeps_events:
            found = _image_in(await self.store.events(loop_id), digest)
        return found

    async def mark(self, loop_id: str | None = None) -> tuple[Any, ...]:
        """The store's cheap change mark (`SQLStore.change_mark`), a loop's
        requests' ids and statuses (a request submitted or refused writes no
        commit) and the active breakpoints' ids: a stream reads a page whole
        only when it moved. `()`: the store holds no such loop."""
        mark = await self.store.change_mark(loop_id)
        if not mark:
            return mark
        # A breakpoint set or removed writes no commit either.
        breaks = tuple(b.id for b in await self.actions.reader().breakpoints())
        if loop_id is None:
            return (*mark, breaks)
        return (*mark, _requests_mark(await self.actions.requests(loop_id)), breaks)


def _image_in(value: Any, digest: str) -> ImageBlock | None:
    """The first image block with bytes of digest `digest` anywhere in
    `value` (models, their fields, sequences and mappings of them)."""
    stack = [value]
    while stack:
        one = stack.pop()
        if isinstance(one, ImageBlock):
            if one.digest == digest and one.data is not None:
                return one
        elif isinstance(one, BaseModel):
            stack.extend(one.__dict__.values())
        elif isinstance(one, list | tuple):
            stack.extend(one)
        elif isinstance(one, dict):
            stack.extend(one.values())
    return None


def _requests_mark(requests: list[LoopRequest]) -> tuple[tuple[int, str], ...]:
    return tuple((r.id, r.status) for r in requests)


def _rows(events: list[AgentEvent], loop_id: str, after: int) -> list[dict[str, Any]]:
    """The timeline rows (as `agentfsm inspect` prints them) past seq `after`,
    each with the event's data for the page to show in full on demand."""
    if not events:
        return []
    timeline = build_timeline(events, loop_id, width=_WIDTH)
    by_seq = {e.seq: e for e in events}
    rows = []
    for row in timeline.rows:
        if row.seq <= after:
            continue
        event = by_seq.get(row.seq)
        rows.append(
            {
                "seq": row.seq,
                "elapsed": row.elapsed,
                "kind": row.kind,
                "text": row.text,
                "images": [data_of(image) for image in row.images],
                "event": None if event is None else data_of(event),
            }
        )
    return rows
