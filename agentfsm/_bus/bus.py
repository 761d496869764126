"""The in-process event bus.

Each subscriber has its own bounded buffer, so a slow, stuck or failing
subscriber never stalls a loop or another subscriber: when its buffer is full,
further events for it are dropped and counted, and it sees the hole as a gap in
`seq`. A subscriber that asks for `backpressure=True` is never dropped from;
instead a loop publishing to its full buffer waits for room, unless the loop
is cancelled: a cancel never waits on a subscriber, and the events the
cancelled loop still holds go into the buffer past its capacity. Publishers
waiting for room wait in line: each slot that frees is given to the first in
line, and wakes that publisher only (a publisher cancelled in line passes a
slot it was given on to the next).

Publishing with no subscribers costs one attribute check: a loop's emitter
(`agentfsm._bus.emitter`) looks at `EventBus.listening` before it even builds
an event.
"""

from __future__ import annotations

import fnmatch
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, NamedTuple, Self

import anyio

from agentfsm.exceptions import BusClosed, BusFull, ConfigurationError

if TYPE_CHECKING:
    from agentfsm.events import AgentEvent

__all__ = ("BusStatistics", "EventBus", "Subscription", "SubscriptionStatistics")


class BusStatistics(NamedTuple):
    """Counters of one bus."""

    subscribers: int
    published: int
    """Events published (whether or not anyone wanted them)."""
    delivered: int
    """Events put into subscriber buffers."""
    dropped: int
    """Events dropped because a subscriber's buffer was full."""


class SubscriptionStatistics(NamedTuple):
    """Counters of one subscription."""

    delivered: int
    dropped: int
    buffered: int
    """Events waiting in the buffer."""


class _Waiter:
    """A publisher in line for a slot in a full backpressure buffer."""

    __slots__ = ("granted", "left", "woken")

    def __init__(self, woken: anyio.Event) -> None:
        self.woken = woken
        self.granted = False
        """Whether a slot was given to it (it is out of the line then)."""
        self.left = False
        """Whether it was cancelled in line (the line skips it: no O(n) removal)."""


class Subscription:
    """One subscriber's buffer of events; iterate it with `async for`.

    Use it as a context manager so it is closed (and unsubscribed) on exit:

    ```python
    with runtime.bus.subscribe("model.answer") as answers:
        async for event in answers:
            ...
    ```
    """

    __slots__ = (
        "_buffer",
        "_bus",
        "_closed",
        "_every",
        "_reserved",
        "_waiter",
        "_waiters",
        "backpressure",
        "capacity",
        "delivered",
        "dropped",
        "loop_id",
        "patterns",
    )

    def __init__(
        self,
        bus: EventBus,
        patterns: tuple[str, ...],
        loop_id: str | None,
        capacity: int,
        backpressure: bool,
    ) -> None:
        self._bus = bus
        self.patterns = patterns
        self.loop_id = loop_id
        self.capacity = capacity
        self.backpressure = backpressure
        self.delivered = 0
        self.dropped = 0
        self._buffer: deque[AgentEvent] = deque()
        self._waiter: anyio.Event | None = None
        self._reserved = 0
        """Slots taken by publishers that have not delivered into them yet
        (a backpressure buffer is full at `len(_buffer) + _reserved`)."""
        self._waiters: deque[_Waiter] = deque()
        """Publishers waiting for a slot, first come first served (never one
        while a slot is free: each slot that frees goes to the first)."""
        self._closed = False
        self._every = "*" in patterns
        """Whether it takes every type (a loop's stream: checked per event)."""

    def matches(self, event_type: str) -> bool:
        """Whether this subscription's type patterns cover `event_type`."""
        return self._every or any(
            fnmatch.fnmatchcase(event_type, p) for p in self.patterns
        )

    async def _take_slot(self) -> bool:
        """Take a slot for one event, waiting in line while the buffer is full;
        return whether one was taken (a closed subscription gives none)."""
        if self._closed:
            return False
        if len(self._buffer) + self._reserved < self.capacity:
            self._reserved += 1
            return True
        waiter = _Waiter(self._bus._event())
        self._waiters.append(waiter)
        try:
            await waiter.woken.wait()
        except BaseException:
            if waiter.granted:
                self._give_back()  # to the next in line: no wake-up is lost
            else:
                waiter.left = True
            raise
        return waiter.granted

    def _give_back(self) -> None:
        """Return a slot taken and not used (its publisher was cancelled)."""
        self._reserved -= 1
        if self._waiters:
            self._grant()

    def _grant(self) -> None:
        """Give each free slot to the first publisher in line, waking it alone."""
        waiters = self._waiters
        while waiters and len(self._buffer) + self._reserved < self.capacity:
            waiter = waiters.popleft()
            if waiter.left:
                continue
            waiter.granted = True
            self._reserved += 1
            waiter.woken.set()

    def receive_nowait(self) -> AgentEvent:
        """The next buffered event.

        Raises:
            anyio.WouldBlock: the buffer is empty.
            anyio.EndOfStream: the subscription is closed and drained.
        """
        if self._buffer:
            event = self._buffer.popleft()
            if self._waiters:
                self._grant()
            return event
        if self._closed:
            raise anyio.EndOfStream
        raise anyio.WouldBlock

    async def receive(self) -> AgentEvent:
        """The next event, waiting for one if needed.

        Raises:
            anyio.EndOfStream: the subscription is closed and drained.
        """
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise anyio.EndOfStream from None

    async def receive_batch(self, limit: int) -> list[AgentEvent]:
        """The next event, waiting for one if needed, and those buffered after
        it, `limit` at most (what a writer takes for one write).

        Raises:
            anyio.EndOfStream: the subscription is closed and drained.
        """
        batch = [await self.receive()]
        while len(batch) < limit:
            try:
                batch.append(self.receive_nowait())
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
        return batch

    def drain(self) -> list[AgentEvent]:
        """Take every buffered event at once (a durable loop's journal takes
        its loop's events into each commit)."""
        events = list(self._buffer)
        self._buffer.clear()
        if self._waiters:
            self._grant()
        return events

    def buffered(self) -> list[AgentEvent]:
        """The buffered events, left in the buffer."""
        return list(self._buffer)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> AgentEvent:
        # No checkpoint when an event is ready: a consumer drains its buffer in
        # one go, and publishers cannot add to it meanwhile.
        buffer = self._buffer
        while not buffer:
            if self._closed:
                raise StopAsyncIteration
            waiter = self._waiter = self._bus._event()
            await waiter.wait()
        event = buffer.popleft()
        if self._waiters:
            self._grant()
        return event

    def close(self) -> None:
        """Unsubscribe; events already buffered can still be received."""
        if self._closed:
            return
        self._closed = True
        self._bus._remove(self)
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None
        for waiter in self._waiters:  # each goes on, with no slot
            waiter.woken.set()
        self._waiters.clear()

    @property
    def closed(self) -> bool:
        """Whether the subscription was closed."""
        return self._closed

    def statistics(self) -> SubscriptionStatistics:
        """This subscription's counters."""
        return SubscriptionStatistics(self.delivered, self.dropped, len(self._buffer))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class EventBus:
    """Fans events out to subscribers, each with its own bounded buffer."""

    __slots__ = (
        "_by_loop",
        "_closed",
        "_event",
        "_global",
        "_routes",
        "backpressure",
        "delivered",
        "dropped",
        "listening",
        "published",
    )

    def __init__(self) -> None:
        self._global: list[Subscription] = []
        self._by_loop: dict[str, list[Subscription]] = {}
        self._routes: dict[str, tuple[Subscription, ...]] = {}
        self._closed = False
        self._event: Callable[[], anyio.Event] = anyio.Event
        """What wakes waiting subscribers (see `use_backend`)."""
        self.backpressure = False
        """Whether any subscriber asked for backpressure (publishers must `await`)."""
        self.listening = False
        """Whether there is any subscriber (loops build no event while there is none)."""
        self.published = 0
        self.delivered = 0
        self.dropped = 0

    def use_backend(self, event: Callable[[], anyio.Event]) -> None:
        """Wake subscribers with `event`, the running backend's `anyio.Event` class
        (the runtime finds it once; `anyio.Event()` looks the backend up each time)."""
        self._event = event

    def subscribe(
        self,
        types: str | Sequence[str] = "*",
        *,
        loop_id: str | None = None,
        buffer: int = 10_000,
        backpressure: bool = False,
    ) -> Subscription:
        """Subscribe to events whose type matches a pattern (`"*"`, `"function_call.*"`).

        Args:
            types: one glob pattern or several.
            loop_id: only events of this loop.
            buffer: how many events may wait in the buffer.
            backpressure: make publishers wait for room instead of dropping
                events. A cancel never waits: the events a cancelled loop still
                holds for a full subscriber go into its buffer past `buffer`
                (none is dropped; the loop does not wait for the subscriber).
        """
        if self._closed:
            raise BusClosed("the bus is closed")
        if buffer < 1:
            raise ConfigurationError(f"buffer must be at least 1, got {buffer}")
        patterns = (types,) if isinstance(types, str) else tuple(types)
        if not patterns:
            raise ConfigurationError("subscribe to at least one type pattern")
        from agentfsm.events import (
            EVENT_TYPES,  # the event classes, once someone subscribes
        )

        unknown = [p for p in patterns if not fnmatch.filter(EVENT_TYPES, p)]
        if unknown:
            raise ConfigurationError(
                f"patterns {unknown} match no event type (types: {', '.join(EVENT_TYPES)})"
            )
        sub = Subscription(self, patterns, loop_id, buffer, backpressure)
        if loop_id is None:
            self._global.append(sub)
        else:
            self._by_loop.setdefault(loop_id, []).append(sub)
        self._changed(sub, added=True)
        return sub

    def _remove(self, sub: Subscription) -> None:
        if sub.loop_id is None:
            self._global.remove(sub)
        else:
            subs = self._by_loop[sub.loop_id]
            subs.remove(sub)
            if not subs:
                del self._by_loop[sub.loop_id]
        self._changed(sub, added=False)

    def _changed(self, sub: Subscription, *, added: bool) -> None:
        """Update what publishers check after `sub` was added or removed: in
        O(1) for a loop's own subscription, which comes and goes with each loop
        started with `stream=True` (the routes hold global subscriptions only)."""
        if sub.loop_id is None:
            self._routes.clear()
        self.listening = bool(self._global or self._by_loop)
        if added:
            self.backpressure = self.backpressure or sub.backpressure
        elif sub.backpressure:
            self.backpressure = any(s.backpressure for s in self._subscriptions())

    def _subscriptions(self) -> Iterable[Subscription]:
        yield from self._global
        for subs in self._by_loop.values():
            yield from subs

    def _route(self, event_type: str) -> tuple[Subscription, ...]:
        route = self._routes[event_type] = tuple(
            s for s in self._global if s.matches(event_type)
        )
        return route

    def wants(self, event_type: str, loop_id: str) -> bool:
        """Whether any subscriber would receive an event of this type and loop."""
        return bool(self.targets(event_type, loop_id))

    def targets(self, event_type: str, loop_id: str) -> Sequence[Subscription]:
        """The subscriptions an event of this type and loop goes to (often none)."""
        route = self._routes.get(event_type)
        if route is None:
            route = self._route(event_type)
        own = self._by_loop.get(loop_id)
        if own is None:
            return route
        return [*route, *(sub for sub in own if sub.matches(event_type))]

    def publish_nowait(self, event: AgentEvent) -> None:
        """Deliver an event to every matching subscriber without waiting.

        Raises:
            BusFull: a backpressure subscriber's buffer is full (nothing was delivered).
        """
        targets = self.targets(event.type, event.loop_id)
        if self.backpressure and not self.has_room(targets):
            full = next(s for s in targets if not self.has_room((s,)))
            raise BusFull(f"subscriber to {full.patterns} is full")
        self._deliver(event, targets)

    async def publish(self, event: AgentEvent) -> None:
        """Deliver an event, waiting for room in backpressure subscribers' buffers.

        Publishers waiting for room in a buffer get its slots in the order they
        came. A slot is kept for the event from the moment it is taken, so an
        event waiting for room in a second buffer still finds it in the first.
        """
        targets = self.targets(event.type, event.loop_id)
        if not self.backpressure:
            self._deliver(event, targets)
            return
        taken: list[Subscription] = []
        try:
            for sub in targets:
                if sub.backpressure and await sub._take_slot():
                    taken.append(sub)
        except BaseException:
            for sub in taken:
                sub._give_back()
            raise
        for sub in taken:
            sub._reserved -= 1  # the event goes into the slot it took
        self._deliver(event, targets)

    def has_room(self, targets: Iterable[Subscription]) -> bool:
        """Whether every backpressure subscriber among `targets` has room for one
        more (a slot taken by a publisher in line is not room)."""
        for sub in targets:
            if (
                sub.backpressure
                and len(sub._buffer) + sub._reserved >= sub.capacity
                and not sub._closed
            ):
                return False
        return True

    def _deliver(
        self,
        event: AgentEvent,
        targets: Iterable[Subscription],
        past_capacity: bool = False,
    ) -> None:
        """Put `event` in each target's buffer; a full one drops it, but with
        `past_capacity` a full backpressure subscriber takes it (for the events
        a cancelled loop still holds, `Emitter.deliver_held`: a cancel never
        waits on a subscriber)."""
        # One flat loop: this runs for every event a loop's outbox releases.
        self.published += 1
        for sub in targets:
            buffer = sub._buffer
            if sub._closed:
                continue  # closed while a publisher waited for room in it
            if len(buffer) < sub.capacity or (past_capacity and sub.backpressure):
                buffer.append(event)
                sub.delivered += 1
                self.delivered += 1
                waiter = sub._waiter
                if waiter is not None:
                    sub._waiter = None
                    waiter.set()
            else:
                sub.dropped += 1
                self.dropped += 1

    def statistics(self) -> BusStatistics:
        """The bus's counters."""
        subscribers = len(self._global) + sum(len(s) for s in self._by_loop.values())
        return BusStatistics(subscribers, self.published, self.delivered, self.dropped)

    def close(self) -> None:
        """Close every subscription (their iterations end once drained)."""
        self._closed = True
        for sub in list(self._subscriptions()):
            sub.close()
