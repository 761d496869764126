"""Publishers waiting for room in a full backpressure subscriber wait in line:
each slot that frees wakes the first in line, and only it."""

from __future__ import annotations

import types
from collections.abc import Coroutine, Generator
from datetime import UTC, datetime
from typing import Any

import anyio
import pytest

from agentfsm._bus import Emitter, EventBus, Subscription
from agentfsm.events import LoopTransition
from agentfsm.exceptions import BusFull
from agentfsm.states import LoopState, Trigger

LOOPS = 200
EVENTS = 3


class Publisher(Emitter):
    """What a loop is to the bus: it numbers, builds, holds and flushes its events."""

    def __init__(self, bus: EventBus, loop_id: str) -> None:
        Emitter.__init__(self, bus)
        self.loop_id = loop_id
        self.agent_id = "agent"
        self.state = LoopState.context_update
        self.clock = lambda: datetime(2025, 1, 1, tzinfo=UTC)
        self.resumed = 0
        """How many times its `flush` was resumed after waiting."""

    async def publish(self, events: int) -> None:
        """Publish `events` transitions (held while the subscriber is full), then
        flush them, as a loop does at its next checkpoint."""
        for _ in range(events):
            self.emit_transition(
                LoopState.idle, Trigger.start, LoopState.context_update, None
            )
        await counted(self.flush(), self)


@types.coroutine
def counted(coro: Coroutine[Any, Any, None], publisher: Publisher) -> Generator[Any]:
    """Await `coro`, counting each time it is resumed after it suspended: every
    wake-up, whether or not it finds a slot (whatever the backend or the bus)."""
    send: Any = coro.send
    value: Any = None
    while True:
        try:
            yielded = send(value)
        except StopIteration:
            return
        try:
            value = yield yielded
            send = coro.send
        except BaseException as exc:  # noqa: BLE001 - a cancellation, passed in
            send, value = coro.throw, exc
        publisher.resumed += 1


def transition(loop_id: str) -> LoopTransition:
    return LoopTransition(
        event_id=f"{loop_id}:1",
        loop_id=loop_id,
        agent_id="agent",
        seq=1,
        state=LoopState.context_update,
        source=LoopState.idle,
        trigger=Trigger.start,
        dest=LoopState.context_update,
    )


async def line_up(
    tg: anyio.abc.TaskGroup, bus: EventBus, events: int
) -> tuple[list[Publisher], list[anyio.CancelScope], list[str]]:
    """`LOOPS` publishers, each starting to wait for room only once the one
    before it waits (so their arrival order is known): the publishers, a
    cancel scope each, and the ids of those that finished."""
    publishers = [Publisher(bus, f"L{n:03}") for n in range(LOOPS)]
    scopes = [anyio.CancelScope() for _ in publishers]
    finished: list[str] = []

    async def run(publisher: Publisher, scope: anyio.CancelScope) -> None:
        with scope:
            await publisher.publish(events)
            finished.append(publisher.loop_id)

    for publisher, scope in zip(publishers, scopes, strict=True):
        tg.start_soon(run, publisher, scope)
        await anyio.wait_all_tasks_blocked()
    return publishers, scopes, finished


async def read_slowly(sub: Subscription) -> list[str]:
    """Take one event at a time, letting every woken publisher run in between,
    until none comes; the loop ids of the events, in order."""
    received: list[str] = []
    while True:
        await anyio.wait_all_tasks_blocked()
        try:
            event = sub.receive_nowait()
        except anyio.WouldBlock:
            return received
        received.append(event.loop_id)


def round_robin(loop_ids: list[str], events: int) -> list[str]:
    return [loop_id for _ in range(events) for loop_id in loop_ids]


def subscribe(bus: EventBus) -> Subscription:
    """A backpressure subscriber with a buffer of one, already full."""
    sub = bus.subscribe(buffer=1, backpressure=True)
    bus.publish_nowait(transition("first"))
    return sub


async def test_each_slot_wakes_the_first_in_line_only() -> None:
    """With a buffer of one, every publisher is resumed once per event (never
    without a slot), and they get their slots in the order they came."""
    bus = EventBus()
    sub = subscribe(bus)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            publishers, _, finished = await line_up(tg, bus, EVENTS)
            received = await read_slowly(sub)
            tg.cancel_scope.cancel()  # (none is left: the asserts say why if one is)
    ids = [p.loop_id for p in publishers]
    spurious = sum(p.resumed for p in publishers) - LOOPS * EVENTS
    assert spurious == 0
    assert [p.resumed for p in publishers] == [EVENTS] * LOOPS
    assert received[: LOOPS + 1] == ["first", *ids]  # first events: in arrival order
    assert received == ["first", *round_robin(ids, EVENTS)]
    assert finished == ids
    assert sub.statistics().dropped == 0


@pytest.mark.parametrize("position", [0, LOOPS // 2, LOOPS - 1])
async def test_a_publisher_cancelled_in_line_holds_nobody_up(position: int) -> None:
    """A publisher cancelled while it waits in line gets nothing more in; the
    others all go on, in order, each resumed once per event."""
    bus = EventBus()
    sub = subscribe(bus)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            publishers, scopes, finished = await line_up(tg, bus, EVENTS)
            scopes[position].cancel()
            received = await read_slowly(sub)
            tg.cancel_scope.cancel()
    gone = publishers[position]
    others = [p for p in publishers if p is not gone]
    ids = [p.loop_id for p in others]
    assert received == ["first", *round_robin(ids, EVENTS)]
    assert finished == ids  # none is stuck
    assert [p.resumed for p in others] == [EVENTS] * (LOOPS - 1)
    assert gone.resumed == 1  # by its cancel
    assert gone.outbox is not None
    assert len(gone.outbox) == EVENTS  # held, for `deliver_held`


async def test_a_publisher_cancelled_as_its_slot_is_given_passes_it_on() -> None:
    """The first in line is cancelled in the same step as a slot is given to it:
    the slot goes on to the next (on asyncio the cancel wins and the publisher
    gives the slot back; on trio it was already woken and fills it, and the
    cancel stops it at its next wait). Nobody is stuck, the order holds."""
    bus = EventBus()
    sub = subscribe(bus)
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            publishers, scopes, finished = await line_up(tg, bus, EVENTS)
            assert sub.receive_nowait().loop_id == "first"  # the slot goes to L000...
            scopes[0].cancel()  # ...which is cancelled before it runs
            received = await read_slowly(sub)
            tg.cancel_scope.cancel()
    first, *others = publishers
    ids = [p.loop_id for p in others]
    assert [r for r in received if r != first.loop_id] == round_robin(ids, EVENTS)
    assert received.count(first.loop_id) <= 1
    assert finished == ids
    assert [p.resumed for p in others] == [EVENTS] * (LOOPS - 1)
    assert first.resumed <= 2
    assert sub.statistics().dropped == 0


async def test_a_slot_taken_is_kept_while_waiting_for_another_subscriber() -> None:
    """An event waiting for room in a second backpressure subscriber keeps the
    slot it took in the first: another publisher cannot fill it meanwhile (the
    event would be dropped from a subscriber that is never dropped from)."""
    bus = EventBus()
    every = bus.subscribe(buffer=1, backpressure=True)
    one_loop = bus.subscribe(loop_id="L1", buffer=1, backpressure=True)
    bus.publish_nowait(transition("L1"))  # fills both
    assert every.receive_nowait().loop_id == "L1"  # room in `every` only
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(bus.publish, transition("L1"))  # waits for `one_loop`
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(BusFull):
                bus.publish_nowait(transition("L2"))  # `every` only: its slot is taken
            tg.start_soon(bus.publish, transition("L2"))  # waits in line for it
            await anyio.wait_all_tasks_blocked()
            assert one_loop.receive_nowait().loop_id == "L1"
            await anyio.wait_all_tasks_blocked()
            assert every.receive_nowait().loop_id == "L1"
            await anyio.wait_all_tasks_blocked()
            assert every.receive_nowait().loop_id == "L2"
    assert every.statistics().dropped == one_loop.statistics().dropped == 0
    assert bus.statistics().dropped == 0


async def test_a_publisher_cancelled_waiting_for_a_second_subscriber_gives_back_its_slot() -> (
    None
):
    """The slot a cancelled publisher took in one subscriber, while it waited for
    room in another, goes to the next publisher in line for it."""
    bus = EventBus()
    every = bus.subscribe(buffer=1, backpressure=True)
    one_loop = bus.subscribe(loop_id="L1", buffer=1, backpressure=True)
    bus.publish_nowait(transition("L1"))  # fills both
    assert every.receive_nowait().loop_id == "L1"  # room in `every` only
    scope = anyio.CancelScope()

    async def publish_until_cancelled() -> None:
        with scope:
            await bus.publish(transition("L1"))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(publish_until_cancelled)  # takes `every`'s slot, waits
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(bus.publish, transition("L2"))  # in line for that slot
            await anyio.wait_all_tasks_blocked()
            assert every.statistics().buffered == 0
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            assert every.receive_nowait().loop_id == "L2"
    assert one_loop.statistics().buffered == 1  # the cancelled event went nowhere


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_task_cancelled_after_its_slot_was_given_passes_it_on() -> None:
    """On asyncio a task can be cancelled (`Task.cancel()`) after a slot was
    given to it and before it ran: the slot goes to the next in line, whom it
    wakes alone."""
    import asyncio  # noqa: TID251 - a native cancel, which anyio's scopes never make

    bus = EventBus()
    sub = subscribe(bus)
    publishers = [Publisher(bus, loop_id) for loop_id in ("A", "B", "C")]
    tasks = []
    for publisher in publishers:
        tasks.append(asyncio.get_running_loop().create_task(publisher.publish(1)))
        await anyio.wait_all_tasks_blocked()
    assert sub.receive_nowait().loop_id == "first"  # the slot goes to A...
    tasks[0].cancel()  # ...cancelled before it runs
    await anyio.wait_all_tasks_blocked()
    assert tasks[0].cancelled()
    assert sub.receive_nowait().loop_id == "B"
    assert [p.resumed for p in publishers] == [1, 1, 0]  # C was not woken for A's slot
    await anyio.wait_all_tasks_blocked()
    assert sub.receive_nowait().loop_id == "C"
    await asyncio.gather(*tasks[1:])
