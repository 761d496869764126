"""A loop's events as a stream that resumes from a seq (`Runtime.watch`), from a
store that keeps them.

A durable loop's journal writes the events its loop published since its last
commit with each commit (`Durable._submit`), so the events a store keeps
never have a hole: they end at the loop's last commit, and a loop taken up
again numbers its events on past them. `watch` subscribes to the loop first,
then takes the events not in the store yet (queued in a commit, or not taken
into one yet), then reads the store: every event published before it
subscribed is in one or the other, and the live ones follow. They overlap (the
seq tells them apart), and leave no gap.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentfsm._bus import EventBus
    from agentfsm.events import AgentEvent
    from agentfsm.store import EventArchive

    from .keeper import Keeper

__all__ = ("watch",)

_ENDS = frozenset({"loop.idle", "loop.detached"})


async def watch(
    bus: EventBus, store: EventArchive, keeper: Keeper, loop_id: str, after_seq: int
) -> AsyncGenerator[AgentEvent]:
    """The loop's events after `after_seq`: the stored ones, then the live ones,
    without a gap or a repeat, until its `loop.idle` (or `loop.detached`)."""
    with bus.subscribe("*", loop_id=loop_id, buffer=10_000, backpressure=True) as live:
        pending = keeper.pending_events(loop_id)
        known = {e.seq: e for e in await store.events(loop_id, after_seq)}
        for event in pending:
            if event.seq > after_seq:
                known.setdefault(event.seq, event)
        last = after_seq
        for seq in sorted(known):
            event = known[seq]
            yield event
            last = seq
            if event.type in _ENDS:
                return
        async for event in live:
            if event.seq <= last:
                continue  # stored already
            yield event
            last = event.seq
            if event.type in _ENDS:
                return
