"""Continue-as-new: a long loop goes on in a new run of its workflow.

A workflow's history has a limit (the server terminates a workflow past it,
and its result is lost), and a loop adds ~12 events per one-call turn, while
`max_turns` allows 10,000 and follow-ups keep a loop going. When the server
suggests it (`workflow.info().is_continue_as_new_suggested()`), a run hands
its loop to the next run of the same workflow id, with the loop's record (the
`LoopRecord` a durable store keeps), its context's items and where the context
store stood (`wire.Carried`, in the next run's `StartLoop.carried`). The loop
goes on with the same `loop_id`, its queues, its totals and its pause; clients
see nothing: `LoopClient`'s handles name the workflow id alone, so signals,
updates and queries reach the latest run, and `wait` follows the chain.

Where a run hands its loop over (a turn boundary, where nothing is in flight
and nothing runs twice):

- a running loop, inside its provider (`Boundary`), as a model request is
  about to become an inference activity: the transition into `inference` is
  committed and published, the request is not sent. The next run rebuilds
  the loop in `inference` and sends it; no event is published twice (only the
  model wrappers, which run around the provider, run again, as they do for a
  retried request). The first request of a run is always sent, so each run
  makes progress; so is a request the loop retries (its attempts are counted
  in the run that began them).
- a paused loop, as it is: the next run keeps it paused, and the resume or
  approve a client sends reaches it there.

Before it hands the loop over, the run lets the updates it accepted finish
(`workflow.all_handlers_finished`) and the subscribers receive every event
published so far. A signal that arrives meanwhile is handled by this run (the
server refuses a continue-as-new while new events wait, and the workflow task
runs again with them): a queued message is in the record.

What goes: the loop's record and its context's items, inline when they fit
in one payload (`wire.MAX_PAYLOAD`); else the items the context store was
sent go by reference (`Carried.base`, as a request's do), and the next run
reads them back (the `carried` activity) before it takes the loop up. The
next run builds the loop's handlers and options again from the same agent,
and `Runtime.adopt` binds the record's callables to them by position, so two
that share a name (closures of one factory) each stay themselves.

When even that does not fit (the items added since the loop's last request
are over a payload), the loop goes on in this run: the run says so once in
the workflow's log, and tries again after the loop's next model request.
"""

from __future__ import annotations

import asyncio  # noqa: TID251 - workflow code runs on asyncio only
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final

import anyio
from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

from agentfsm.exceptions import LoopStateError, ProviderError
from agentfsm.options import LoopOptions
from agentfsm.record import callable_name
from agentfsm.results import LoopStatus
from agentfsm.tools import ToolCall, ToolNext, ToolResult

from ._calls import run_activity
from ._wire import (
    CONTEXT_MISSING,
    MAX_PAYLOAD,
    Carried,
    CarriedArgs,
    CarriedPage,
    StartLoop,
    chain_digest,
    dump,
    payload_size,
)

if TYPE_CHECKING:
    from agentfsm._bus import Subscription
    from agentfsm._runtime.runtime import Runtime
    from agentfsm.inference import (
        ImageSupport,
        InferenceInput,
        InferenceOutput,
        StreamEvent,
    )
    from agentfsm.messages import ContextItem
    from agentfsm.record import LoopRecord
    from agentfsm.results import LoopResult

    from ._agent import TemporalAgent
    from ._calls import ActivityProvider

__all__ = ("Boundary", "Carry")


class _Refused(Exception):
    """What this run would carry cannot go (`Carry._check`)."""


_MOVED: Final = re.compile(r"agentfsm\.temporal\._(\w+:.*)")
_CARRIED_TOOL_LAYER: Final = "agentfsm._temporal.calls:ToolActivities"


async def _passed_through(call: ToolCall, next_: ToolNext) -> ToolResult:
    """Stands for the tool activities a run carried as a tool wrapper."""
    return await next_(call)


class Carry:
    """One run's side of continue-as-new: takes up a carried loop, and hands
    its loop to the next run at a turn boundary when the server suggests it.

    Args:
        start: the run's input (its `carried` loop, if any).
        agent: the loop's agent.
        provider: the run's inference activities (their context reference
            and request count go on from the carried ones).
    """

    def __init__(
        self, start: StartLoop, agent: TemporalAgent, provider: ActivityProvider
    ) -> None:
        self.start = start
        self.agent = agent
        self.activities = provider
        self.refused: int | None = None
        """`sent` when this run last could not hand its loop over: it tries
        again once the loop sent another request."""
        self._warned = False
        self.waiting = False
        """The loop waits at the boundary (in `Boundary`) for the hand-over."""
        self._release: anyio.Event | None = None
        self.sent = 0
        """Requests this run sent (its first is always sent: progress)."""
        self.retrying = False
        """The last request failed: the next is the loop's retry of it."""
        self._length = 0
        """The run's history length once it had its loop (`begin`)."""
        self._unkept = False
        """The queued messages' images could not be handed to the store."""

    def provider(self) -> Boundary:
        """The run's provider: the inference activities, behind the boundary."""
        return Boundary(self.activities, self)

    # ------------------------------------------------------------- take up

    async def begin(
        self,
        runtime: Runtime,
        handlers: Sequence[Any],
        options: dict[str, Any],
        run_loop: Callable[[], str],
    ) -> str:
        """Start the loop (`run_loop`), or take up the one the run before
        carried: rebuilt in `runtime`, publishing nothing as it arrives.

        Raises:
            ApplicationError: the items the run before carried by reference
                could not be read back (`CONTEXT_MISSING`).
        """
        carried = self.start.carried
        if carried is None:
            self._length = workflow.info().get_current_history_length()
            return run_loop()
        items = [*await self._fetch(carried), *carried.items]
        # What reading the items back added is not news to a paused loop (a
        # hand-over right after it would ping-pong): `_due` counts from here.
        self._length = workflow.info().get_current_history_length()
        # The context store holds what the run before sent: the next request
        # refers to it (the same item objects: `_ContextRef` compares them).
        sent = items[: carried.sent]
        digests: list[str] = []
        previous = ""
        for item in sent:
            previous = chain_digest(previous, item)
            digests.append(previous)
        if carried.base and digests[carried.base - 1] != carried.base_digest:
            raise ApplicationError(
                f"loop {carried.record.loop_id}: the context items read back "
                "from the context store are not those the run before carried",
                type=CONTEXT_MISSING,
                non_retryable=True,
            )
        given = LoopOptions.of(dict(options))  # type: ignore[arg-type]
        loop_id = runtime.adopt(
            carried.record,
            items,
            tools=self.agent.tools,
            handlers=self._by_name(handlers, given),
            # Built again from the same agent: bound by position.
            started_with=(tuple(handlers), given),
        )
        ref = self.activities.context
        ref.sent = sent
        ref.digests = digests
        self.activities.requests = carried.requests
        return loop_id

    async def _fetch(self, carried: Carried) -> list[ContextItem]:
        """The items the run before carried by reference (the context's first
        `base`), read back from the context store, a payload at a time."""
        items: list[ContextItem] = []
        loop_id = carried.record.loop_id
        while len(items) < carried.base:
            args = CarriedArgs(
                loop_id=loop_id,
                base=carried.base,
                base_digest=carried.base_digest,
                first=len(items),
            )
            try:
                raw = await run_activity(
                    workflow.start_activity(
                        f"agentfsm.{self.agent.name}.carried",
                        dump(args),
                        start_to_close_timeout=self.activities.timeout,
                        retry_policy=self.agent.model_retry,
                        summary=f"carried context, from item {len(items) + 1}",
                    )
                )
            except ActivityError as exc:
                raise ApplicationError(
                    f"loop {loop_id}: the context items the run before carried "
                    f"by reference could not be read back: {exc.cause or exc}",
                    type=CONTEXT_MISSING,
                    non_retryable=True,
                ) from exc
            page = CarriedPage.model_validate(raw).items
            if not page:
                raise ApplicationError(
                    f"loop {loop_id}: the context store gave no items from item "
                    f"{len(items) + 1} of the {carried.base} carried by reference",
                    type=CONTEXT_MISSING,
                    non_retryable=True,
                )
            items.extend(page)
        return items

    def _by_name(self, handlers: Sequence[Any], given: LoopOptions) -> dict[str, Any]:
        """The callables a record may name, by name: what `adopt` binds
        where the record does not name them in the run's order (and the
        structured output's schema, which is bound by name alone)."""
        found: list[Any] = [
            *handlers,
            *given.stop_when,
            *given.tool_wrappers,
            *given.model_wrappers,
        ]
        if given.finish_turn is not None:
            found.append(given.finish_turn)
        callables: dict[str, Any] = {}
        for value in found:
            name = callable_name(value)
            callables.setdefault(name, value)
            # What a run carried before `agentfsm._temporal` became the
            # package's private modules names this module's callables so.
            moved = _MOVED.match(name)
            if moved is not None:
                callables.setdefault(f"agentfsm._temporal.{moved[1]}", value)
        # Such a run listed its tool activities among the tool wrappers: they
        # are the workflow's extension's tool layer now, so nothing in its place.
        callables.setdefault(_CARRIED_TOOL_LAYER, _passed_through)
        callables.setdefault(callable_name(_passed_through), _passed_through)
        schema = self.agent.settings.get("structured_output")
        if isinstance(schema, type):
            callables[callable_name(schema)] = schema
        return callables

    # ------------------------------------------------------------ hand over

    async def wait(
        self, runtime: Runtime, loop_id: str, subscription: Subscription | None
    ) -> LoopResult:
        """The loop's result, as `runtime.wait` gives it; or, at a turn
        boundary once the server suggests it, the loop goes on in a new run
        (`workflow.continue_as_new` raises `ContinueAsNewError`)."""
        ended = asyncio.ensure_future(runtime.wait(loop_id))

        def settled() -> bool:
            # Updates accepted meanwhile have run, and the subscribers have
            # every event published so far (the drain is waiting for more).
            return workflow.all_handlers_finished() and (
                subscription is None or not subscription.statistics().buffered
            )

        while True:
            await workflow.wait_condition(
                lambda: ended.done() or self._due(runtime, loop_id)
            )
            if not ended.done():
                await workflow.wait_condition(lambda: ended.done() or settled())
            if ended.done():
                return ended.result()
            if self._due(runtime, loop_id):
                if await self._keep_queued():
                    continue  # activities ran: whether it is still due, anew
                self._hand_over(runtime, loop_id, ended)

    async def keep_images(self, items: Sequence[ContextItem]) -> bool:
        """Hand the context store the images of `items` and of the messages
        the loop has queued (a hand-over carries those in its record), so
        that what the next run is handed refers to them (`calls.Images`).
        Whether activities ran."""
        loop = self.activities.owner.loop
        queued: list[ContextItem] = []
        if loop is not None:
            queued.extend(loop.queued)
        return await self.activities.images.keep([*items, *queued])

    async def _keep_queued(self) -> bool:
        """`keep_images` of the queued messages, before a hand-over; whether
        activities ran (or failed: then they are not asked again this run,
        and the images go inline)."""
        if self._unkept:
            return False
        try:
            return await self.keep_images(())
        except ProviderError as exc:
            # A hand-over is not worth failing the loop for.
            self._unkept = True
            workflow.logger.warning(
                "agentfsm: loop %s hands its queued messages' images over inline: %s",
                self.start.loop_id,
                exc,
            )
            return True

    def _due(self, runtime: Runtime, loop_id: str) -> bool:
        """Whether the loop should go on in a new run now."""
        if (
            self.refused == self.sent
            or not workflow.info().is_continue_as_new_suggested()
        ):
            return False
        if self.waiting:
            return True
        # Paused: once this run has seen something (a paused loop's first
        # run after a hand-over waits for a signal, an update, a timer).
        return (
            runtime.get(loop_id).status is LoopStatus.paused
            and workflow.info().get_current_history_length() > self._length
        )

    def _hand_over(
        self, runtime: Runtime, loop_id: str, ended: asyncio.Future[Any]
    ) -> None:
        """Continue as new with the loop; or, if it cannot go, keep it here
        (until it sent another request) and let it go on."""
        carried: list[dict[str, Any]] = []
        try:
            runtime.hand_over(
                loop_id, check=lambda r, items: carried.append(self._check(r, items))
            )
        except (_Refused, LoopStateError) as exc:
            self.refused = self.sent
            if not self._warned:  # once a run: it may be refused at each turn
                self._warned = True
                workflow.logger.warning(
                    "agentfsm: loop %s does not continue as new for now (it "
                    "tries again after its next model request): %s",
                    loop_id,
                    exc,
                )
            if self._release is not None:
                self._release.set()  # the request goes out in this run
            return
        ended.cancel()  # the loop does not end here
        workflow.continue_as_new(carried[0])

    def _check(self, record: LoopRecord, items: list[ContextItem]) -> dict[str, Any]:
        """The next run's input, if it fits in a payload: the context inline,
        or else what the context store was sent by reference.

        Raises:
            _Refused: it does not fit either way.
        """
        # The deadline goes on the workflow's clock (`deadline_at`): its
        # wall-clock copy was read from the machine's.
        record = record.model_copy(update={"deadline_utc": None})
        ref = self.activities.context
        sent = 0
        limit = min(len(ref.sent), len(items))
        while sent < limit and items[sent] is ref.sent[sent]:
            sent += 1
        # The images the store holds go as references, as in a request.
        wire = self.activities.images.wire
        items = wire(items)
        record = record.model_copy(
            update={
                "steering": tuple(wire(record.steering)),
                "follow_ups": tuple(wire(record.follow_ups)),
            }
        )
        carried = Carried(
            record=record,
            items=tuple(items),
            sent=sent,
            requests=self.activities.requests,
        )
        data, size = self._input(carried)
        if size > MAX_PAYLOAD and sent:
            carried = carried.model_copy(
                update={
                    "base": sent,
                    "base_digest": ref.digests[sent - 1],
                    "items": tuple(items[sent:]),
                }
            )
            data, size = self._input(carried)
        if size > MAX_PAYLOAD:
            raise _Refused(
                f"what it would carry takes {size} bytes, over the "
                f"{MAX_PAYLOAD}-byte payload limit (its record, and the "
                f"{len(items) - sent} context items not sent to the model yet)"
            )
        return data

    def _input(self, carried: Carried) -> tuple[dict[str, Any], int]:
        """The next run's input carrying `carried`, and its size in bytes."""
        start = StartLoop(
            agent=self.start.agent,
            loop_id=self.start.loop_id,
            agent_id=self.start.agent_id,
            carried=carried,
        )
        data = dump(start)
        return data, payload_size(data)

    async def boundary(self) -> None:
        """Called as the loop's request is about to go out: wait here for the
        hand-over when it is due (the run's first request, and a retry, go)."""
        if self.sent == 0 or self.retrying or self.refused == self.sent:
            return
        if not workflow.info().is_continue_as_new_suggested():
            return
        self.waiting = True
        self._release = anyio.Event()
        try:
            await self._release.wait()  # released only when the run keeps the loop
        finally:
            self.waiting = False
            self._release = None


class Boundary:
    """The workflow's provider: the inference activities (`ActivityProvider`),
    behind the turn boundary where a run hands its loop to the next."""

    def __init__(self, inner: ActivityProvider, carry: Carry) -> None:
        self.inner = inner
        self.carry = carry

    def image_support(self, model: str) -> ImageSupport:
        """Where the agent's model takes images (`TemporalAgent.images`)."""
        return self.inner.image_support(model)

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        carry = self.carry
        # First: what a hand-over at the boundary carries refers to the images.
        await carry.keep_images(request.context.items)
        await carry.boundary()
        carry.sent += 1
        try:
            output = await self.inner.complete(request)
        except ProviderError:
            carry.retrying = True
            raise
        carry.retrying = False
        return output

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        carry = self.carry
        await carry.keep_images(request.context.items)
        await carry.boundary()
        carry.sent += 1
        try:
            async with self.inner.stream(request) as events:
                carry.retrying = False
                yield events
        except ProviderError:
            carry.retrying = True
            raise
