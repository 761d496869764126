"""The event bus: fan-out, filters, bounded buffers, backpressure, closing, statistics."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from agentfsm import (
    InferenceInput,
    InferenceOutput,
    Outcome,
    Proceed,
    Runtime,
    tool,
)
from agentfsm._bus import BusStatistics, EventBus, Subscription, SubscriptionStatistics
from agentfsm.events import (
    AgentEvent,
    FunctionCallCompleted,
    FunctionCallStarted,
    LoopTransition,
    ModelAnswer,
)
from agentfsm.exceptions import BusClosed, BusFull, ConfigurationError
from agentfsm.messages import (
    FunctionCallItem,
    FunctionCallOutputItem,
    ModelMessageItem,
)
from agentfsm.states import LoopState, Trigger
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from tests.helpers import add, pause_tools, request, wait_until

_CALL = FunctionCallItem(call_id="c1", name="add", arguments='{"a":1,"b":2}')


def transition(seq: int, loop_id: str = "L1") -> LoopTransition:
    """A `loop.transition` event of `loop_id` with sequence number `seq`."""
    return LoopTransition(
        event_id=f"{loop_id}:{seq}",
        loop_id=loop_id,
        agent_id="agent",
        seq=seq,
        state=LoopState.context_update,
        source=LoopState.idle,
        trigger=Trigger.start,
        dest=LoopState.context_update,
    )


def started(seq: int, loop_id: str = "L1") -> FunctionCallStarted:
    return FunctionCallStarted(
        event_id=f"{loop_id}:{seq}",
        loop_id=loop_id,
        agent_id="agent",
        seq=seq,
        state=LoopState.function_call,
        call=_CALL,
    )


def completed(seq: int, loop_id: str = "L1") -> FunctionCallCompleted:
    return FunctionCallCompleted(
        event_id=f"{loop_id}:{seq}",
        loop_id=loop_id,
        agent_id="agent",
        seq=seq,
        state=LoopState.function_call,
        call=_CALL,
        output=FunctionCallOutputItem(call_id="c1", output="3"),
        duration=0.01,
    )


def answer(seq: int, loop_id: str = "L1") -> ModelAnswer:
    return ModelAnswer(
        event_id=f"{loop_id}:{seq}",
        loop_id=loop_id,
        agent_id="agent",
        seq=seq,
        state=LoopState.model_message,
        message=ModelMessageItem(content="3"),
    )


def drain(sub: Subscription) -> list[AgentEvent]:
    """Everything buffered in `sub`, without waiting."""
    out: list[AgentEvent] = []
    while True:
        try:
            out.append(sub.receive_nowait())
        except anyio.WouldBlock:
            return out


def seqs(events: list[AgentEvent]) -> list[int]:
    return [e.seq for e in events]


class TestFanOut:
    def test_every_subscriber_gets_every_event(self) -> None:
        """Each subscriber receives every matching event, in publication order."""
        bus = EventBus()
        subs = [bus.subscribe() for _ in range(3)]
        for seq in range(1, 6):
            bus.publish_nowait(transition(seq))
        for sub in subs:
            assert seqs(drain(sub)) == [1, 2, 3, 4, 5]
        bus.close()

    def test_same_object_delivered(self) -> None:
        """Subscribers receive the published event itself (events are frozen)."""
        bus = EventBus()
        a, b = bus.subscribe(), bus.subscribe()
        event = transition(1)
        bus.publish_nowait(event)
        assert drain(a) == [event]
        assert drain(b)[0] is event
        bus.close()

    def test_no_subscribers(self) -> None:
        """Publishing with no subscribers delivers nothing and counts the event."""
        bus = EventBus()
        bus.publish_nowait(transition(1))
        assert bus.statistics() == BusStatistics(
            subscribers=0, published=1, delivered=0, dropped=0
        )

    async def test_async_iteration(self) -> None:
        """`async for` yields events as they are published."""
        bus = EventBus()
        received: list[int] = []

        async def consume(sub: Subscription) -> None:
            with sub:
                async for event in sub:
                    received.append(event.seq)
                    if event.seq == 3:
                        return

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume, bus.subscribe())
                await anyio.wait_all_tasks_blocked()
                for seq in (1, 2, 3):
                    await bus.publish(transition(seq))
                    await anyio.wait_all_tasks_blocked()
                    assert received == list(range(1, seq + 1))
        assert bus.statistics().subscribers == 0


class TestFilters:
    def test_type_pattern(self) -> None:
        """`function_call.*` receives only function call events."""
        bus = EventBus()
        calls_sub = bus.subscribe("function_call.*")
        everything = bus.subscribe("*")
        for event in (transition(1), started(2), completed(3), answer(4)):
            bus.publish_nowait(event)
        assert [e.type for e in drain(calls_sub)] == [
            "function_call.started",
            "function_call.completed",
        ]
        assert seqs(drain(everything)) == [1, 2, 3, 4]
        bus.close()

    def test_several_patterns(self) -> None:
        """A list of patterns receives events matching any of them."""
        bus = EventBus()
        sub = bus.subscribe(["model.answer", "loop.transition"])
        for event in (transition(1), started(2), completed(3), answer(4)):
            bus.publish_nowait(event)
        assert seqs(drain(sub)) == [1, 4]
        bus.close()

    def test_loop_id(self) -> None:
        """A loop subscription receives only that loop's events; a global one gets all."""
        bus = EventBus()
        only_a = bus.subscribe(loop_id="A")
        only_b_answers = bus.subscribe("model.answer", loop_id="B")
        everything = bus.subscribe()
        for event in (
            transition(1, "A"),
            transition(1, "B"),
            answer(2, "B"),
            answer(2, "A"),
        ):
            bus.publish_nowait(event)
        assert [(e.loop_id, e.seq) for e in drain(only_a)] == [("A", 1), ("A", 2)]
        assert [(e.loop_id, e.type) for e in drain(only_b_answers)] == [
            ("B", "model.answer")
        ]
        assert len(drain(everything)) == 4
        bus.close()

    @pytest.mark.parametrize(
        "types",
        [
            pytest.param("nope", id="unknown-type"),
            pytest.param("functioncall.*", id="typo-pattern"),
            pytest.param(["model.answer", "model.answers"], id="one-bad-of-two"),
        ],
    )
    def test_pattern_matching_nothing(self, types: str | list[str]) -> None:
        """A pattern that matches no event type is a configuration error."""
        bus = EventBus()
        with pytest.raises(ConfigurationError, match="match no event type"):
            bus.subscribe(types)
        assert bus.statistics().subscribers == 0

    def test_no_pattern(self) -> None:
        """An empty list of patterns is a configuration error."""
        with pytest.raises(ConfigurationError, match="at least one"):
            EventBus().subscribe([])

    def test_buffer_must_be_positive(self) -> None:
        """A buffer of zero events is a configuration error."""
        with pytest.raises(ConfigurationError, match="buffer must be at least 1"):
            EventBus().subscribe(buffer=0)


class TestWants:
    def test_nobody(self) -> None:
        """With no subscribers nothing is wanted."""
        assert not EventBus().wants("loop.transition", "L1")

    def test_by_type(self) -> None:
        """A global subscription wants its types for every loop, and no other type."""
        bus = EventBus()
        sub = bus.subscribe("function_call.*")
        assert bus.wants("function_call.completed", "any-loop")
        assert not bus.wants("model.answer", "any-loop")
        sub.close()
        assert not bus.wants("function_call.completed", "any-loop")

    def test_by_loop(self) -> None:
        """A loop subscription makes that loop's events wanted, not other loops'."""
        bus = EventBus()
        with bus.subscribe("model.answer", loop_id="A"):
            assert bus.wants("model.answer", "A")
            assert not bus.wants("model.answer", "B")
        assert not bus.wants("model.answer", "A")

    def test_loop_subscriptions_coming_and_going(self) -> None:
        """A loop's own subscription, added and closed (as each streamed loop's
        is), keeps the global routes and the flags publishers check right."""
        bus = EventBus()
        answers = bus.subscribe("model.*")
        assert bus.wants("model.answer", "B")  # (the route is cached now)
        own = bus.subscribe(loop_id="A", backpressure=True)
        assert (bus.listening, bus.backpressure) == (True, True)
        assert bus.wants("loop.idle", "A")
        assert not bus.wants("loop.idle", "B")
        assert bus.wants("model.answer", "B")
        plain = bus.subscribe(loop_id="C")
        own.close()
        assert (bus.listening, bus.backpressure) == (True, False)
        assert not bus.wants("loop.idle", "A")
        answers.close()
        assert (bus.listening, bus.statistics().subscribers) == (True, 1)  # C's
        plain.close()
        assert (bus.listening, bus.statistics().subscribers) == (False, 0)
        with bus.subscribe("loop.idle"):  # a global one after: routes made again
            assert bus.wants("loop.idle", "D")
            assert not bus.wants("model.answer", "D")

    def test_new_subscription_seen(self) -> None:
        """A type asked about before anyone subscribed is wanted once someone does."""
        bus = EventBus()
        assert not bus.wants("model.answer", "A")
        with bus.subscribe("model.*"):
            assert bus.wants("model.answer", "A")


class TestBoundedBuffer:
    def test_full_subscriber_drops_others_get_all(self) -> None:
        """A full subscriber drops events (counted, seen as a seq gap); others get all."""
        bus = EventBus()
        slow = bus.subscribe(buffer=2)
        fast = bus.subscribe()
        for seq in (1, 2, 3):
            bus.publish_nowait(transition(seq))
        assert slow.statistics() == SubscriptionStatistics(
            delivered=2, dropped=1, buffered=2
        )
        assert seqs(drain(slow)) == [1, 2]
        for seq in (4, 5):
            bus.publish_nowait(transition(seq))
        received = seqs(drain(slow))
        assert received == [4, 5]  # 3 is missing: a gap between 2 and 4
        assert slow.statistics() == SubscriptionStatistics(
            delivered=4, dropped=1, buffered=0
        )
        assert seqs(drain(fast)) == [1, 2, 3, 4, 5]
        assert fast.statistics() == SubscriptionStatistics(
            delivered=5, dropped=0, buffered=0
        )
        assert bus.statistics() == BusStatistics(
            subscribers=2, published=5, delivered=9, dropped=1
        )
        bus.close()

    async def test_publish_does_not_wait_for_full_subscriber(self) -> None:
        """`publish` returns at once when a non-backpressure subscriber is full."""
        bus = EventBus()
        stuck = bus.subscribe(buffer=1)
        with anyio.fail_after(5):
            for seq in range(1, 101):
                await bus.publish(transition(seq))
        assert stuck.statistics() == SubscriptionStatistics(1, 99, 1)
        bus.close()


class TestBackpressure:
    async def test_publish_waits_for_room(self) -> None:
        """`publish` waits while a backpressure subscriber's buffer is full."""
        bus = EventBus()
        careful = bus.subscribe(buffer=1, backpressure=True)
        other = bus.subscribe()
        assert bus.backpressure
        await bus.publish(transition(1))
        done: list[int] = []

        async def publish(seq: int) -> None:
            await bus.publish(transition(seq))
            done.append(seq)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(publish, 2)
                await anyio.wait_all_tasks_blocked()
                assert done == []
                assert seqs(drain(other)) == [1]  # nothing delivered while waiting
                assert careful.receive_nowait().seq == 1
                await anyio.wait_all_tasks_blocked()
                assert done == [2]
        assert seqs(drain(careful)) == [2]
        assert seqs(drain(other)) == [2]
        assert careful.statistics().dropped == 0
        assert bus.statistics().dropped == 0
        bus.close()

    def test_publish_nowait_raises_bus_full(self) -> None:
        """`publish_nowait` raises `BusFull` and delivers to nobody."""
        bus = EventBus()
        careful = bus.subscribe(buffer=1, backpressure=True)
        other = bus.subscribe()
        bus.publish_nowait(transition(1))
        with pytest.raises(BusFull):
            bus.publish_nowait(transition(2))
        assert seqs(drain(other)) == [1]
        assert careful.statistics() == SubscriptionStatistics(1, 0, 1)
        assert bus.statistics().published == 1
        bus.close()

    def test_backpressure_flag_follows_subscriptions(self) -> None:
        """The bus asks publishers to await only while a backpressure subscriber exists."""
        bus = EventBus()
        flags = [bus.backpressure]
        plain = bus.subscribe()
        flags.append(bus.backpressure)
        careful = bus.subscribe(backpressure=True)
        flags.append(bus.backpressure)
        careful.close()
        flags.append(bus.backpressure)
        plain.close()
        assert flags == [False, False, True, False]

    async def test_closing_releases_waiting_publisher(self) -> None:
        """Closing a full backpressure subscription lets a waiting publisher go on."""
        bus = EventBus()
        careful = bus.subscribe(buffer=1, backpressure=True)
        other = bus.subscribe()
        await bus.publish(transition(1))
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(bus.publish, transition(2))
                await anyio.wait_all_tasks_blocked()
                careful.close()
        assert seqs(drain(other)) == [1, 2]
        bus.close()

    async def test_closed_while_waited_for_counts_no_drop(self) -> None:
        """An event a publisher waited to give a since-closed subscriber is not dropped."""
        bus = EventBus()
        careful = bus.subscribe(buffer=1, backpressure=True)
        await bus.publish(transition(1))
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(bus.publish, transition(2))
                await anyio.wait_all_tasks_blocked()
                careful.close()
        assert careful.statistics() == SubscriptionStatistics(1, 0, 1)
        assert bus.statistics().dropped == 0


class TestClosing:
    async def test_close_ends_async_for(self) -> None:
        """Closing a subscription ends its `async for` after the buffered events."""
        bus = EventBus()
        sub = bus.subscribe()
        received: list[int] = []
        ended = anyio.Event()

        async def consume() -> None:
            async for event in sub:
                received.append(event.seq)
            ended.set()

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await anyio.wait_all_tasks_blocked()
                bus.publish_nowait(transition(1))
                bus.publish_nowait(transition(2))
                sub.close()
                await ended.wait()
        assert received == [1, 2]
        assert sub.closed

    def test_closed_subscription_gets_nothing_more(self) -> None:
        """After close a subscription is unsubscribed and receives no new events."""
        bus = EventBus()
        sub = bus.subscribe()
        bus.publish_nowait(transition(1))
        sub.close()
        sub.close()  # closing twice is harmless
        bus.publish_nowait(transition(2))
        assert sub.receive_nowait().seq == 1
        with pytest.raises(anyio.EndOfStream):
            sub.receive_nowait()
        assert bus.statistics().subscribers == 0

    async def test_bus_close_ends_all(self) -> None:
        """`bus.close()` ends every subscriber's iteration and refuses new subscribers."""
        bus = EventBus()
        subs = [bus.subscribe(), bus.subscribe("model.*"), bus.subscribe(loop_id="L1")]
        ended: list[int] = []

        async def consume(index: int, sub: Subscription) -> None:
            async for _ in sub:
                pass
            ended.append(index)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                for index, sub in enumerate(subs):
                    tg.start_soon(consume, index, sub)
                await anyio.wait_all_tasks_blocked()
                assert ended == []
                bus.close()
        assert sorted(ended) == [0, 1, 2]
        assert all(sub.closed for sub in subs)
        assert bus.statistics().subscribers == 0
        with pytest.raises(BusClosed):
            bus.subscribe()

    async def test_context_manager_closes(self) -> None:
        """Leaving the `with` block closes the subscription."""
        bus = EventBus()
        with bus.subscribe() as sub:
            assert bus.statistics().subscribers == 1
        assert sub.closed
        assert bus.statistics().subscribers == 0


def test_statistics() -> None:
    """Bus statistics count subscribers, published, delivered and dropped events."""
    bus = EventBus()
    a = bus.subscribe("model.answer")
    b = bus.subscribe(loop_id="L1", buffer=1)
    assert bus.statistics() == BusStatistics(2, 0, 0, 0)
    bus.publish_nowait(transition(1))  # b only
    bus.publish_nowait(answer(2))  # a, and b is full
    bus.publish_nowait(answer(1, "L2"))  # a only
    assert bus.statistics() == BusStatistics(
        subscribers=2, published=3, delivered=3, dropped=1
    )
    assert a.statistics() == SubscriptionStatistics(delivered=2, dropped=0, buffered=2)
    assert b.statistics() == SubscriptionStatistics(delivered=1, dropped=1, buffered=1)
    a.close()
    assert bus.statistics().subscribers == 1
    bus.close()


def _ask_for_sum(req: InferenceInput) -> InferenceOutput:
    first = req.context.items[0]
    assert first.type == "user_message"
    n = int(first.text)
    return calls(call("add", a=n, b=n))


def _answer_with_output(req: InferenceInput) -> InferenceOutput:
    last = req.context.items[-1]
    assert last.type == "function_call_output"
    return text(f"sum={last.output}")


async def consume_and_fail(sub: Subscription) -> None:
    with sub:
        async for _ in sub:
            raise RuntimeError("consumer bug")


async def test_stuck_and_failing_subscribers_do_not_stop_loops() -> None:
    """A never-reading subscriber and a crashing consumer leave every loop to finish."""
    provider = ScriptedProvider([_ask_for_sum, _answer_with_output])
    count = 40
    with anyio.fail_after(30):
        async with Runtime(providers={"scripted": provider}) as runtime:
            stuck = runtime.bus.subscribe(buffer=2)
            with pytest.RaisesGroup(
                pytest.RaisesExc(RuntimeError, match="consumer bug")
            ):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume_and_fail, runtime.bus.subscribe(buffer=1))
                    loop_ids = [
                        runtime.run_loop(f"agent-{n % 3}", str(n), request(add))
                        for n in range(count)
                    ]
            results = [await runtime.wait(loop_id) for loop_id in loop_ids]
            assert stuck.statistics().delivered == 2
            assert stuck.statistics().dropped > 0
            stats = runtime.bus.statistics()
            assert stats.subscribers == 1  # the failed consumer unsubscribed
            stuck.close()
    assert [r.outcome for r in results] == ["answered"] * count
    assert [r.answer.content if r.answer else None for r in results] == [
        f"sum={2 * n}" for n in range(count)
    ]
    assert stats.dropped >= stuck.statistics().dropped


async def test_backpressure_subscriber_misses_nothing_in_a_run() -> None:
    """A slow backpressure subscriber gets every event of every loop, none dropped."""
    provider = ScriptedProvider([_ask_for_sum, _answer_with_output])
    seen: dict[str, list[AgentEvent]] = {}
    with anyio.fail_after(30):
        async with Runtime(providers={"scripted": provider}) as runtime:

            async def consume(sub: Subscription) -> None:
                with sub:
                    async for event in sub:
                        seen.setdefault(event.loop_id, []).append(event)
                        await anyio.lowlevel.checkpoint()

            careful = runtime.bus.subscribe(buffer=1, backpressure=True)
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume, careful)
                loop_ids = [
                    runtime.run_loop("agent", str(n), request(add)) for n in range(10)
                ]
                results = [await runtime.wait(loop_id) for loop_id in loop_ids]
                await anyio.wait_all_tasks_blocked()
                careful.close()
    assert [r.answer.content if r.answer else None for r in results] == [
        f"sum={2 * n}" for n in range(10)
    ]
    assert careful.statistics().dropped == 0
    for loop_id in loop_ids:
        events = seen[loop_id]
        assert seqs(events) == list(range(1, len(events) + 1))
        assert (events[0].type, events[-1].type) == ("loop.started", "loop.idle")


async def test_a_subscriber_to_one_loop_gets_all_of_its_events_and_no_others() -> None:
    """On a running runtime, alone and beside a subscriber to every loop."""
    for beside_all in (False, True):
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("ok")])}
        ) as rt:
            everything = rt.bus.subscribe("*") if beside_all else None
            first = rt.run_loop("agent", "one", request())
            mine = rt.bus.subscribe("*", loop_id=first, buffer=1_000)
            await rt.wait(first)
            await rt.wait(rt.run_loop("agent", "two", request()))
            mine.close()
            got = [event async for event in mine]
            if everything is not None:
                everything.close()
        assert {e.loop_id for e in got} == {first}
        # Subscribed after loop.started: from the first transition to the end.
        assert [e.type for e in got][:1] == ["loop.transition"]
        assert got[-1].type == "loop.idle"
        assert [e.seq for e in got] == list(range(2, len(got) + 2))


async def test_a_streamed_loop_beside_others_leaves_their_events_to_the_rest() -> None:
    """While one loop is streamed (a subscription of its own), the others'
    events still reach the global subscribers, and none reaches its stream."""
    script = ScriptedProvider([text("hi")])
    async with Runtime(providers={"scripted": script}) as runtime:
        with runtime.bus.subscribe("loop.idle") as ends:
            streamed = runtime.run_loop("a", "go", request(), stream=True)
            others = [runtime.run_loop("a", "go", request()) for _ in range(3)]
            for loop_id in [streamed, *others]:
                await runtime.wait(loop_id)
            ended = {e.loop_id for e in ends.drain()}
        with anyio.fail_after(10), runtime.events(streamed) as events:
            own = [e async for e in events]
    assert ended == {streamed, *others}
    assert {e.loop_id for e in own} == {streamed}
    assert own[-1].type == "loop.idle"


async def test_a_late_subscriber_sees_seq_numbers_counted_from_the_start() -> None:
    """Events nobody received still took their numbers: a subscriber that joins
    a paused loop sees the seqs a subscriber from the start sees."""

    async def run(late: bool) -> list[tuple[str, int]]:
        provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        async with Runtime(providers={"scripted": provider}) as rt:
            recorder = None if late else EventRecorder(rt.bus)
            loop_id = rt.run_loop("agent", "hi", request(add), pause_tools)
            await wait_until(lambda: rt.get(loop_id).pending is not None)
            if late:
                recorder = EventRecorder(rt.bus)
            rt.resume(loop_id, Proceed())
            await rt.wait(loop_id)
        assert recorder is not None
        return [(e.type, e.seq) for e in recorder.events]

    from_start, joined = await run(late=False), await run(late=True)
    assert joined[0][0] == "loop.resumed"
    assert joined == from_start[-len(joined) :]


class TestBackpressureTiming:
    @pytest.mark.parametrize(("buffer", "late"), [(2, False), (1, True), (2, True)])
    async def test_an_event_reaches_a_backpressure_subscriber_as_it_is_published(
        self, buffer: int, late: bool
    ) -> None:
        """`function_call.started` reaches a backpressure subscriber while the
        tool still runs: the tool waits for the subscriber to have seen it (it
        arrived with `.completed`, after the tool, when events were held until
        the state's work ended)."""
        order: list[str] = []
        seen_start = anyio.Event()

        @tool
        async def slow(x: int) -> int:
            """Wait until the start of this call was observed."""
            order.append("tool running")
            with anyio.fail_after(5):
                await seen_start.wait()
            order.append("tool done")
            return x

        async def watch(subscription: Subscription) -> None:
            if late:  # the buffer fills before the subscriber reads (events held)
                await anyio.sleep(0.05)
            async for event in subscription:
                order.append(event.type)
                if event.type == "function_call.started":
                    seen_start.set()
                if event.type == "loop.idle":
                    return

        provider = ScriptedProvider([calls(call("slow", x=1)), text("done")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            subscription = runtime.bus.subscribe("*", backpressure=True, buffer=buffer)
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, subscription)
                result = await runtime.wait(
                    runtime.run_loop("agent", "go", request(slow))
                )
        assert result.outcome is Outcome.answered
        # The subscriber saw the start while the tool ran (before it was done).
        assert order.index("function_call.started") < order.index("tool done")
        assert order.index("tool done") < order.index("function_call.completed")
        assert order[-1] == "loop.idle"

    async def test_a_full_backpressure_subscriber_holds_the_loop_in_order(
        self,
    ) -> None:
        """With the subscriber's buffer full, later events are held (in order)
        and the loop waits for room: nothing is dropped or reordered."""
        provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            subscription = runtime.bus.subscribe(buffer=1, backpressure=True)
            loop_id = runtime.run_loop("agent", "go", request())
            received = []
            async for event in subscription:
                received.append(event)
                if event.type == "loop.idle":
                    break
            result = await runtime.wait(loop_id)
        assert [e.seq for e in received] == list(range(1, len(received) + 1))
        assert subscription.statistics().dropped == 0
        assert result.outcome is Outcome.answered


class TestHeldEvents:
    async def test_a_cancel_while_events_are_held_loses_none(self) -> None:
        """A loop cancelled while it waits for room in a full backpressure
        subscriber still delivers every event it published, in order."""
        provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            subscription = runtime.bus.subscribe(buffer=1, backpressure=True)
            loop_id = runtime.run_loop("agent", "go", request())
            await anyio.wait_all_tasks_blocked()  # the loop waits for room
            assert runtime.get(loop_id).path  # it ran, and holds events
            runtime.cancel(loop_id)
            received = []
            async for event in subscription:
                received.append(event)
                if event.type == "loop.idle":
                    break
            result = await runtime.wait(loop_id)
        assert result.outcome is Outcome.cancelled
        assert [e.seq for e in received] == list(range(1, len(received) + 1))

    async def test_held_events_keep_their_order_when_their_subscriber_leaves(
        self,
    ) -> None:
        """The backpressure subscriber leaves (a model wrapper closes it) while
        the loop holds an event for it: another subscriber still gets every
        event in order, the held one before those published after it."""
        from agentfsm import ModelRequest
        from agentfsm.providers import ModelNext

        provider = ScriptedProvider([text("3")])
        async with Runtime(providers={"scripted": provider}) as runtime:
            plain = runtime.bus.subscribe()
            careful = runtime.bus.subscribe(buffer=1, backpressure=True)

            async def close_careful(
                request_: ModelRequest, next_: ModelNext
            ) -> InferenceOutput:
                careful.close()  # `loop.transition` to inference is still held
                return await next_(request_)

            async def drain() -> None:
                async for _ in careful:
                    pass

            async with anyio.create_task_group() as tg:
                tg.start_soon(drain)
                loop_id = runtime.run_loop(
                    "agent", "go", request(), model_wrappers=[close_careful]
                )
                result = await runtime.wait(loop_id)
            seqs = []
            while plain.statistics().buffered:
                seqs.append(plain.receive_nowait().seq)
        assert result.outcome is Outcome.answered
        assert seqs == list(range(1, len(seqs) + 1))


@pytest.mark.anyio
@pytest.mark.parametrize("subscribed", ["loop.started", "loop.idle"])
async def test_loop_started_is_built_only_for_a_subscriber_of_it(
    monkeypatch: pytest.MonkeyPatch, subscribed: str
) -> None:
    """`loop.started` copies the request's items and describes its tools and
    options: a bus whose subscribers take other types only does not build it."""
    from agentfsm._bus import emitter
    from agentfsm._bus.started import started_fields as real

    built: list[str] = []

    def counted(*args: object, **kwargs: object) -> object:
        built.append("loop.started")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    # What the emitter calls (it imports `started_fields` once).
    monkeypatch.setattr(emitter, "_started_fields", counted)
    async with Runtime(providers={"scripted": ScriptedProvider([text("hi")])}) as rt:
        recorder = EventRecorder(rt.bus, subscribed)
        await rt.wait(rt.run_loop("agent", "hi", request()))
    assert [e.type for e in recorder.events] == [subscribed]
    assert built == (["loop.started"] if subscribed == "loop.started" else [])
