"""One durable loop's journal (`agentfsm._loop.journal.Journal`): what it has
written to its store, its lease, and its ledger.

Every durable loop holds a `Durable` (`loop.journal`; None for a loop without a
store). The driver calls it after each committed transition and each state,
as the loop ends, and as a run ends (paused, finished); the tool-call runner
calls it before a call starts and after it ended.

Writes are as few as the guarantees allow: a transition into a state with side
effects (`inference`, `function_call`) is written before the state runs, with
the records of the transitions since the last write, the intents of the calls
it starts, the decisions made and (a store that keeps them) the events
published since; a call's output is written when it ends, unless nothing but
the loop's own code runs before the next write (no handler, no
`finish_turn`, no other call of its batch left to end), in which case it goes
with that write.

Every write goes through the runtime's `Flusher`, in order, and carries the
loop's lease (`Lease`: owner and epoch). The loop waits for one to land before
a tool runs (the commit into `function_call`, with the intents), as it pauses,
before it ends, and before a ledger write of its own; not after a commit into
`inference` (`_AHEAD`), which goes to the store with the next write the loop
waits for, unless the flusher's task wrote it meanwhile, or it carries a
handler's decision (which lands before the request it shaped goes out).

A request of the store's decision inbox applied to the loop (a resume, a
cancel: `_durable.requests`) is carried by the loop's next commit with a
record (`carry`), which marks it applied in its transaction: the commit that
stores the resume's decision, or whose record holds the cancel asked.

The loop stops in this process (`Halted`) when a write fails or its lease is
stale (another runtime took the loop): at the next check, before anything
else happens. Before each side effect (a model request, a tool call that
starts after its batch's commit) the lease must be known to be this runtime's:
it is while the last renewal is fresh (`valid_until`, on this process's
clock), and is asked of the store otherwise (a runtime that stalled past its
lease finds out there, and starts nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Final

from agentfsm import _models
from agentfsm._errors import error_text
from agentfsm._loop.batch import plan_of
from agentfsm._loop.journal import Halted
from agentfsm._loop.snapshot import record_of
from agentfsm.exceptions import LoopIdTakenError, StoreError
from agentfsm.inference import InferenceOutput
from agentfsm.interception import ToolBatch
from agentfsm.messages import (
    ContextItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ModelMessageItem,
    UserMessage,
)
from agentfsm.record import DecisionEntry, LoopRecord
from agentfsm.results import LoopStatus
from agentfsm.states import LoopState
from agentfsm.store import LARGE, CallRecord, Commit, Lease, is_large

from .flusher import Flusher, Ticket

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from agentfsm._bus import Subscription
    from agentfsm._loop.batch import PlannedCall
    from agentfsm._loop.loop import Loop
    from agentfsm.events import AgentEvent

__all__ = ("LEASE_MARGIN", "Durable", "clock")


_FREE: Final = frozenset({LoopState.context_update, LoopState.model_message})
"""The states with no side effects outside the loop: a transition into one is
written with the next write, not on its own (a crash before it re-enters the
state from the record before). It halves a run's writes with the ledger's
merged into the commits (16 -> 8 for the benchmark workload)."""

_AHEAD: Final = frozenset({LoopState.inference, LoopState.inference_streaming})
"""The states whose commit is written without waiting for it: a model request
may be sent again after a crash (its output is recorded on the way out, with
the next commit), so the request goes out while its commit is being written. A
crash before it lands is a crash during the request. The commit carries the
outputs of the calls that ran before it: until it lands, a crash leaves them
in flight (their tools' `on_crash` policy decides), as a crash right after a
call ends does. With a real model the commit lands during the request (the
flusher writes it as the provider awaits), and the loop never waits a trip to
the store between its tools and its next request (a trip is ~4 ms with
`durability="strict"`)."""

LEASE_MARGIN: Final = 0.8
"""A lease is taken as this runtime's for this share of `lease_ttl` after the
renewal that extended it was sent: the rest covers clocks that drift apart
(another runtime judges the lease by its own, or the server's, clock)."""

_CALL_FIELDS: Final = set(CallRecord.model_fields)


def _lease_clock() -> Callable[[], float]:
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is None:
        return time.monotonic
    return partial(time.clock_gettime, boottime)


clock: Final = _lease_clock()
"""The clock a lease's freshness is judged by: it runs on while the process is
stopped (SIGSTOP) or its machine suspended (`CLOCK_BOOTTIME`, where there is
one), so a runtime that wakes up knows how long it slept."""


class Durable:
    """One loop's journal (see the module)."""

    __slots__ = (
        "answer",
        "by",
        "confirm",
        "decisions",
        "deferred",
        "ended",
        "events",
        "failed",
        "fencing_token",
        "flusher",
        "fresh",
        "inference",
        "large",
        "lease",
        "ledger",
        "ledger_of",
        "lost",
        "named",
        "new",
        "path_written",
        "presence",
        "requested",
        "requests",
        "stored",
        "tickets",
        "unfinished",
        "valid_until",
        "written",
    )

    def __init__(
        self,
        flusher: Flusher,
        lease: Lease,
        confirm: Callable[[Durable], Awaitable[None]],
        valid_until: float,
        *,
        written: int = 0,
        new: bool = False,
        events: Subscription | None = None,
    ) -> None:
        self.flusher = flusher
        self.lease = lease
        self.fencing_token: int | None = lease.epoch
        self.confirm = confirm
        """Ask the store whether the lease is still this runtime's (the
        keeper's); raises `Halted` if not."""
        self.valid_until = valid_until
        """Until when (on `clock`) the lease is surely this runtime's."""
        self.presence = flusher.store.presence_lapses
        """The store's `presence_lapses` when `valid_until` was set (a lapse
        since voids it)."""
        self.lost: StoreError | None = None
        """Why the lease was found stale (the lease renewal found it taken)."""
        self.new = new
        """The loop is `run_loop`'s, and has written nothing yet: its first
        commit says so (`Commit.new`: the store refuses it if the id is taken)."""
        self.named = False
        """Its caller named the new loop (`run_loop(loop_id=)`): another
        process may have started one of the same id, so its first commit
        lands before its first model request (a taken id fails the loop
        before it pays for one)."""
        self.stored = not new
        """Its first commit landed (or it was taken up from the store)."""
        self.written = written
        """How many context items the store holds (or will, once the commits
        queued have landed)."""
        self.path_written = 0
        """How many steps of the path this lease's commits carried."""
        self.answer: ContextItem | None = None
        """The item at `loop.answer_at` when last written (a handler may replace it)."""
        self.requested = 0
        """The model requests whose outputs were taken (see `take_state_output`)."""
        self.inference: tuple[int, InferenceOutput] | None = None
        """A model output to write with the next commit."""
        self.deferred: list[tuple[LoopRecord, int]] = []
        """Records of transitions into side-effect-free states, not written yet
        (with their paths' lengths)."""
        self.ended: list[CallRecord] = []
        """Ledger entries not written yet (calls ended)."""
        self.decisions: list[DecisionEntry] = []
        """Decisions not written yet."""
        self.by: str | None = None
        """Who made the last decision (settles the calls it answered or denied)."""
        self.requests: list[int] = []
        """Ids of the store's requests (`LoopRequest`) applied to the loop here
        and not written yet: the next commit with a record marks them applied
        (its record holds what they did: a resume's decision, a cancel asked)."""
        self.ledger: dict[str, CallRecord] = {}
        """The ledger of the loop's latest request, by key, as written (this
        runtime is its only writer while it holds the lease)."""
        self.ledger_of = 0
        """The request `ledger` is of."""
        self.fresh: dict[int, CallRecord] = {}
        """The intents written with the commit into `function_call`, by position
        in the batch (the calls start without another write)."""
        self.unfinished = 0
        """Calls of the current batch that run and have not ended."""
        self.tickets: list[Ticket] = []
        """Commits queued since the loop last waited for its writes."""
        self.failed: StoreError | None = None
        """Why a write of the loop failed (then it writes no more)."""
        self.events = events
        """The loop's events since the last commit (a store that keeps events)."""
        self.large = False
        """A string over `_outline.LARGE`, or an image's bytes, has entered the
        loop: its commits may carry it (its records may, for as long as it
        runs), and say so (`Commit.large`)."""

    # ------------------------------------------------------------ the journal

    def check(self) -> None:
        """Raise `Halted` if a write the loop did not wait for failed, or its
        lease was found stale; forget the writes that landed."""
        tickets = self.tickets
        while tickets and tickets[0].landed:  # they land in order
            ticket = tickets.pop(0)
            if ticket.error is not None and self.failed is None:
                self.failed = _store_error(ticket.error, self.flusher.store)
            if ticket.commit.new and ticket.error is None:
                self.stored = True
        if isinstance(self.failed, LoopIdTakenError):
            # Not a store's failure: the loop fails (it is not the store's: the
            # store's loop of its id is left as it was, and it writes nothing).
            raise self.failed
        if self.failed is not None:
            raise Halted(self.failed)
        if self.lost is not None:
            raise Halted(self.lost)

    async def write_commit(self, loop: Loop) -> None:
        state = loop.state
        if state in _FREE:
            self.deferred.append((record_of(loop, path=False), len(loop.path)))
        elif state in _AHEAD and not self.decisions and not (self.new and self.named):
            self._submit(loop, background=True)
            await self.act()  # the request goes out once the lease is known
        else:
            # Into `function_call`: the intents land before a tool runs; into
            # `inference` with a handler's decision: it lands before the
            # request it shaped goes out.
            await self.save(loop)

    async def take_state_output(self, loop: Loop) -> None:
        number = loop.model_requests
        if number == self.requested:
            return
        self.requested = number
        output = loop.output
        if output is None:
            return
        self.inference = (number, output)
        if not self.large:
            self.large = _large_output(output)
        if loop.handlers:
            # Written now, not with the next commit: the handlers decide about
            # it first, and may take a while (a crash meanwhile would send the
            # request, and pay for it, again).
            self._submit(loop, background=True, record=False)

    async def ending(self, loop: Loop) -> None:
        """Return once the writes the loop sent have landed (one that failed
        stops the loop, so that no outcome is told that the store does not
        have); those still queued go with its end's commit, in one trip (with
        a model that never awaits, the commit into `inference` before the
        answer: a trip less a run, ~100 us on the benchmark's machine). A new
        loop's first commit is waited for: a store that holds a loop of its id
        refuses it (`LoopIdTakenError`), and the loop fails."""
        tickets = self.tickets
        sent = None
        for ticket in reversed(tickets):  # sent in order: the queued ones last
            if ticket.sent:
                sent = ticket
                break
            if ticket.commit.new:
                await self.wait_landed()
                return
        if sent is not None:
            await self.flusher.wait(sent)
        self.check()

    async def save(self, loop: Loop) -> None:
        if isinstance(self.failed, LoopIdTakenError):
            return  # the loop is not the store's (see `check`)
        self._submit(loop, background=False)
        await self.wait_landed()
        if loop.status is LoopStatus.done and self.events is not None:
            self.events.close()  # its `loop.idle` is written: nothing follows

    def store_decision(self, entry: DecisionEntry) -> None:
        self.decisions.append(entry)
        self.by = entry.by or entry.handler
        if not self.large and entry.decision.payload is not None:
            self.large = is_large(entry.decision.payload)  # (an answer, say)

    def carry(self, request_id: int) -> None:
        """A request of the store was applied to the loop (resumed, cancelled):
        its next commit with a record marks it applied, in its transaction."""
        self.requests.append(request_id)

    def store_queued(self, loop: Loop) -> None:
        """A steering or follow-up message was queued for the paused loop: its
        record, which holds the queues, is written (nobody waits for it; a
        runtime that exits writes it first), so the message outlives the
        process like the pause.

        The commit carries the record alone (the pause's commit wrote the
        rest), so a later commit does not build on it: if it fails, the
        flusher logs it, and the next commit (the resume's) holds the queues
        too."""
        if (
            self.failed is not None
            or self.deferred
            or self.ended
            or self.inference
            or self.decisions
            or (self.events is not None and self.events.buffered())
        ):
            return  # writes no more, or has more to write than its record
        if len(loop.input.context.items) != self.written:
            return  # its context changed: the next commit writes it
        # The path's steps since the last commit that wrote them (all of it, a
        # run's first: a recovered loop's), again by the next commit, which
        # does not count on this one.
        path = loop.path
        if not self.large:
            self.large = is_large(loop.steering, loop.follow_ups)  # (an image)
        commit = Commit(
            loop.loop_id,
            self.lease,
            record_of(loop, path=False),
            len(path),
            path[self.path_written :],
            self.path_written,
            self.written,
            large=self.large,
        )
        self.flusher.submit(commit, background=True)

    def closing(self, loop: Loop) -> None:
        if self.failed is not None or self.lost is not None:
            return  # it writes no more
        if not self.ended and self.inference is None:
            return
        # The ledger's entries and the model's output alone: the context and
        # the record stay as the last commit left them (recovery goes on from
        # there, and finds these).
        commit = Commit(
            loop.loop_id,
            self.lease,
            None,
            len(loop.path),
            (),
            0,
            self.written,
            inference=self.inference,
            ledger=self.ended,
            large=self.large,
        )
        self.ended, self.inference = [], None
        self.flusher.submit(commit, background=True)

    async def begin_call(self, loop: Loop, planned: PlannedCall) -> CallRecord:
        fresh = self.fresh.pop(planned.position, None)
        if fresh is not None:
            return fresh  # written with the commit into `function_call`
        key = planned.key(loop)
        known = self.ledger.get(key)
        if known is not None and known.status == "done":
            return known  # it ran before: never again
        await self.wait_landed()
        await self.act()
        entry = self._started(loop, planned, key, known)
        ledger, self.ended = [*self.ended, entry], []
        self._submit(loop, background=False, record=False, ledger=ledger)
        await self.wait_landed()
        return entry

    async def end_call(
        self, loop: Loop, key: str, output: FunctionCallOutputItem, terminate: bool
    ) -> None:
        known = self.ledger[key]
        done = _entry(known, status="done", output=output, terminate=terminate)
        if len(output.output) > LARGE or output.images:
            self.large = True
        self.ledger[key] = done
        self.unfinished -= 1
        if (
            self.unfinished
            == 0  # the batch's last: no other call runs before the write
            and not loop.handlers
            and loop.options.finish_turn is None
            and loop.outbox is None
        ):
            self.ended.append(done)
        else:
            await self.wait_landed()
            ledger, self.ended = [*self.ended, done], []
            self._submit(loop, background=False, record=False, ledger=ledger)
            await self.wait_landed()

    # ------------------------------------------------------------------ lease

    async def act(self) -> None:
        """Return once the lease is known to be this runtime's (a side effect
        follows); raise `Halted` if it is not."""
        self.check()
        if (
            clock() < self.valid_until
            and self.flusher.store.presence_lapses == self.presence
        ):
            return
        await self.confirm(self)
        self.check()

    def renewed(self, lease: Lease, sent: float, ttl: float, lapses: int) -> None:
        """The store renewed the lease (the renewal was sent at `sent`, when
        the store's `presence_lapses` was `lapses`)."""
        if lease.epoch == self.lease.epoch:
            if lapses != self.presence:
                self.valid_until, self.presence = 0.0, lapses
            self.valid_until = max(self.valid_until, sent + ttl * LEASE_MARGIN)

    def lose(self, error: StoreError) -> None:
        """The lease is stale: the loop stops at its next check."""
        if self.lost is None:
            self.lost = error

    # ----------------------------------------------------------------- writes

    async def wait_landed(self) -> None:
        """Return once the loop's queued writes have landed.

        Raises:
            Halted: a write of the loop's failed (this one's, or an earlier
                one's: the loop has written nothing since).
            LoopIdTakenError: the loop's first write was refused: a loop of
                its id is the store's.
        """
        if self.failed is not None:
            self.check()
        if self.tickets:  # (the loop queues none while it waits)
            await self.flusher.wait(self.tickets[-1])
        self.check()

    def _submit(
        self,
        loop: Loop,
        *,
        background: bool,
        record: bool = True,
        ledger: list[CallRecord] | None = None,
    ) -> None:
        self.check()  # one the loop did not wait for may have failed
        items = loop.input.context.items
        first = self.written
        truncate = first > len(items)
        if truncate:
            first = 0  # the context shrank (someone edited it): write it whole
        replaced = None
        at = loop.answer_at
        if at is not None and at < first and items[at] is not self.answer:
            replaced = {at: items[at]}  # an answer a handler rewrote at `finish`
        path = loop.path
        length = len(path)
        path_from = self.path_written if record and length >= self.path_written else 0
        if ledger is None:
            ledger = (
                self._intents(loop) if loop.state is LoopState.function_call else []
            )
            if self.ended:
                ledger = [*self.ended, *ledger]
        if not self.large:
            self.large = _large(loop, items[first:]) or (
                replaced is not None and is_large(*replaced.values())
            )
        events: list[AgentEvent] = []
        if self.events is not None:
            events = self.events.drain()
            if record and loop.status is LoopStatus.done:
                idle = loop.idle_event()
                if idle is not None:
                    events.append(idle)
        carried: list[int] | tuple[()] = ()
        if record and self.requests:
            carried, self.requests = self.requests, []
        commit = Commit(
            loop.loop_id,
            self.lease,
            record_of(loop, path=False) if record else None,
            length,
            path[path_from:] if record else (),
            path_from,
            first,
            items[first:],
            replaced,
            self.inference,
            truncate,
            self.deferred,
            ledger,
            events,
            self.decisions,
            self.new,
            self.large,
            carried,
        )
        self.new = False
        self.inference = None
        self.deferred = []
        self.ended = []
        self.decisions = []
        if record:
            self.path_written = length
        self.tickets.append(self.flusher.submit(commit, background=background))
        self.written = len(items)
        if at is not None and at < len(items):
            self.answer = items[at]

    # ----------------------------------------------------------------- ledger

    def _intents(self, loop: Loop) -> list[CallRecord]:
        """The ledger entries of the commit into `function_call`: the intents of
        the calls it starts at once (`BatchPlan.starting`: any other call's
        intent is written when it starts: before, it has not, and an intent
        for it would make it uncertain after a crash), and what a decision
        said of the calls a recovery left uncertain: answered or denied (done,
        with their outputs), or to run again (`retry`, until they start)."""
        self.fresh = {}
        step = loop.step
        batch = step[1] if step is not None else None
        if not isinstance(batch, ToolBatch):
            return []
        if loop.model_requests != self.ledger_of:
            self.ledger, self.ledger_of = {}, loop.model_requests
        plan = plan_of(loop, batch)
        self.unfinished = sum(1 for c in plan.calls if c.runs)
        entries = []
        for planned in plan.calls:
            if planned.runs or not self.ledger:
                continue
            key = planned.key(loop)
            known = self.ledger.get(key)
            if known is not None and known.status != "done":
                output = FunctionCallOutputItem(
                    call_id=planned.call.call_id,
                    output=planned.output or "",
                    is_error=planned.is_error,
                )
                done = _entry(known, status="done", output=output, by=self.by)
                self.ledger[key] = done
                entries.append(done)
        starting = plan.starting()
        for planned in starting:
            key = planned.key(loop)
            known = self.ledger.get(key)
            if known is not None and known.status == "done":
                continue  # it ran before: `begin_call` gives its output
            entry = self._started(loop, planned, key, known)
            self.fresh[planned.position] = entry
            entries.append(entry)
        started = {planned.position for planned in starting}
        for planned in plan.calls:
            if not planned.runs or planned.position in started or not self.ledger:
                continue
            key = planned.key(loop)
            known = self.ledger.get(key)
            if known is not None and known.status == "uncertain":
                # A decision lets it run again, later in the batch: so the
                # ledger says, and a crash before it starts asks nobody again.
                retry = _entry(known, status="retry", by=self.by)
                self.ledger[key] = retry
                entries.append(retry)
        return entries

    def _started(
        self, loop: Loop, planned: PlannedCall, key: str, known: CallRecord | None
    ) -> CallRecord:
        """The ledger entry of a call about to start (a new attempt of one the
        ledger knows)."""
        # The loop's own valid values: built without validation (~1.5 µs a
        # call; tests/internals/test_trusted_models.py checks it equals the
        # validated one).
        entry = _models.trusted(
            CallRecord,
            {
                "key": key,
                "loop_id": loop.loop_id,
                "request": loop.model_requests,
                "position": planned.position,
                "tool": planned.call.name,
                "call_id": planned.call.call_id,
                "status": "started",
                "attempt": 1 if known is None else known.attempt + 1,
                "output": None,
                "terminate": False,
                "by": None,
            },
            _CALL_FIELDS,
        )
        self.ledger[key] = entry
        return entry

    def reconciled(self, entries: list[CallRecord]) -> None:
        """Recovery's ledger entries from tools' `reconcile` answers (`done`
        with the output found, `retry` to run again): the ledger holds them,
        and the write recovery waits for before the loop goes on stores them
        (`save` of the pause, or `write_ledger`)."""
        for entry in entries:
            self.ledger[entry.key] = entry
            self.ended.append(entry)
            output = entry.output
            if output is not None and (len(output.output) > LARGE or output.images):
                self.large = True

    async def write_ledger(self, loop: Loop) -> None:
        """Write the ledger's entries not written yet (and the loop's events),
        without a record, and return once they have landed.

        Raises:
            Halted: the write failed, or the lease is stale.
        """
        ledger, self.ended = self.ended, []
        self._submit(loop, background=False, record=False, ledger=ledger)
        await self.wait_landed()

    def mark_uncertain(self, keys: list[str]) -> None:
        """A recovery parked the loop over these calls: the ledger says so with
        the park's commit."""
        for key in keys:
            entry = _entry(self.ledger[key], status="uncertain")
            self.ledger[key] = entry
            self.ended.append(entry)


def _entry(known: CallRecord, **changes: Any) -> CallRecord:
    return known.model_copy(update=changes)


def _store_error(error: Exception, store: object) -> StoreError:
    """A write's error as a `StoreError` naming the store (a store of another
    library's may raise anything)."""
    if isinstance(error, StoreError):
        return error
    return StoreError(f"{store!r} failed: {type(error).__name__}: {error_text(error)}")


def _large_output(output: InferenceOutput) -> bool:
    """Whether a model output holds a string over `LARGE` (its items are the
    loop's context's to be: checked once, as the output is taken)."""
    for item in output.items:
        if type(item) is ModelMessageItem:
            if len(item.content) > LARGE:
                return True
        elif type(item) is FunctionCallItem:
            if len(item.arguments) > LARGE:
                return True
        elif is_large(item):
            return True
    return False


def _large(loop: Loop, items: Sequence[ContextItem]) -> bool:
    """Whether a commit's record, or its new items, hold a string over `LARGE`
    or an image that no check before found (model outputs and the tools'
    outputs are checked as they are taken: `take_state_output`, `end_call`): the
    user's messages, the instructions, queued messages, a structured answer,
    an output a decision or a handler gave."""
    for item in items:
        if type(item) is UserMessage:
            content = item.content
            if len(content) > LARGE if type(content) is str else is_large(content):
                return True
        elif type(item) is FunctionCallOutputItem and item.images:
            return True
    instructions = loop.input.context.instructions
    if instructions is not None and len(instructions) > LARGE:
        return True
    if loop.steering or loop.follow_ups or loop.parsed is not None:
        return is_large(loop.steering, loop.follow_ups, loop.parsed)
    return False
