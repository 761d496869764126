"""The events a durable runtime's loops publish, kept in its store (a store
made with `events=True`), and a stream of one loop's events that resumes from
a seq (`Runtime.watch`).

`EventKeeper` is a service of the runtime (entered before its loops, left
after them): a backpressure subscription to every event, written in batches
by a task of its own, so that no event is lost and a loop waits for the store
only when the writer is a full buffer behind. `watch` subscribes to the loop
first, then waits until the keeper has written everything published before
that, then reads the store: the stored events and the live ones overlap (the
seq tells them apart) and leave no gap.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final

import anyio

from agentfsm._errors import error_text
from agentfsm._logging import get_logger

if TYPE_CHECKING:
    from agentfsm._bus import EventBus, Subscription
    from agentfsm.events import AgentEvent
    from agentfsm.store._base import LoopStore

__all__ = ("EventKeeper",)

_BATCH: Final = 512


class EventKeeper:
    """Writes every event of a bus to a store."""

    def __init__(self, bus: EventBus, store: LoopStore) -> None:
        self.bus = bus
        self.store = store
        self.written = 0
        """Events taken from the subscription and written (or given up on)."""
        self._subscription: Subscription | None = None
        self._progress = anyio.Event()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        subscription = self._subscription = self.bus.subscribe(
            "*", buffer=10_000, backpressure=True
        )
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._run, subscription, name="agentfsm-store-events")
                try:
                    yield
                finally:
                    subscription.close()  # the writer drains what is left, then ends
        finally:
            self._subscription = None
            self._progress.set()

    async def _run(self, subscription: Subscription) -> None:
        with anyio.CancelScope(shield=True):  # drained to the end, never cut
            while True:
                try:
                    batch = await subscription.receive_batch(_BATCH)
                except anyio.EndOfStream:
                    return
                await self._write(batch)

    async def _write(self, batch: list[AgentEvent]) -> None:
        try:
            await self.store.append_events(batch)
        except Exception as exc:  # noqa: BLE001 - logged; the loops go on
            get_logger().error(
                "store_events_failed", events=len(batch), error=error_text(exc)
            )
        self.written += len(batch)
        progress, self._progress = self._progress, anyio.Event()
        progress.set()

    async def caught_up(self) -> None:
        """Wait until every event published so far is written."""
        subscription = self._subscription
        if subscription is None:
            return
        target = subscription.statistics().delivered
        while self.written < target and self._subscription is not None:
            await self._progress.wait()


async def watch(
    bus: EventBus, store: LoopStore, keeper: EventKeeper, loop_id: str, after_seq: int
) -> AsyncGenerator[AgentEvent]:
    """The loop's events after `after_seq`: the stored ones, then the live ones,
    without a gap or a repeat, until its `loop.idle`."""
    with bus.subscribe("*", loop_id=loop_id, buffer=10_000, backpressure=True) as live:
        await keeper.caught_up()
        last = after_seq
        for event in await store.events(loop_id, after_seq):
            yield event
            last = event.seq
            if event.type == "loop.idle":
                return
        async for event in live:
            if event.seq <= last:
                continue  # stored already
            yield event
            last = event.seq
            if event.type == "loop.idle":
                return
