"""One durable loop's side of the store: what it has written, and the ledger.

Every durable loop holds a `Durable` (`loop.durable`; None for a loop without
a store). The driver awaits `committed` after each committed transition and
`save` when a run ends (paused, finished); the inference state hands it the
model's output (`recorded` on the way in, after a recovery; `inference` on the
way out); the tool calls go through `begin_call` / `end_call` (the ledger).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from agentfsm import _models
from agentfsm._keys import idempotency_key
from agentfsm._loop.tool_call import parallel
from agentfsm._loop.turn import tool_index
from agentfsm.inference import InferenceOutput
from agentfsm.interception import ToolBatch
from agentfsm.messages import ContextItem, FunctionCallItem, FunctionCallOutputItem
from agentfsm.record import LoopRecord
from agentfsm.states import LoopState
from agentfsm.store._base import CallRecord, Commit, LoopStore

from .flusher import Flusher, Ticket

if TYPE_CHECKING:
    from agentfsm._loop.loop import Loop

__all__ = ("Durable",)


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


_INTENT_FIELDS: Final = {
    "key",
    "loop_id",
    "request",
    "position",
    "tool",
    "call_id",
    "status",
}
"""The fields an intent's `CallRecord` is given (the others keep their defaults)."""


def call_key(loop: Loop, position: int, call: FunctionCallItem) -> str:
    """The idempotency key of the `position`-th call of the loop's latest
    model request."""
    return idempotency_key(
        loop.loop_id, loop.model_requests, position, call.name, call.arguments
    )


class Durable:
    """What one loop has written to its store, and its ledger calls.

    Writes are as few as the guarantees allow: a transition into a state with
    side effects (`inference`, `function_call`) is written before the state
    runs, with the records of the transitions since the last write and the
    intents of the calls it starts; a call's output is written when it ends,
    unless nothing but the loop's own code runs before the next write (no
    handler, no `finish_turn`, no other call of its batch left to end), in
    which case it goes with that write.

    Every write goes through the runtime's `Flusher`, in order. The loop waits
    for one to land before a tool runs (the commit into `function_call`, with
    the intents), as it pauses, before it ends, and before a ledger write of
    its own; not after a commit into `inference` (`_AHEAD`), which goes to the
    store with the next write the loop waits for, unless the flusher's task
    wrote it meanwhile. A write that
    failed fails the loop at its next write or wait, and the loop writes
    nothing more (what follows it would leave a gap): the store keeps its
    last commit.
    """

    __slots__ = (
        "answer",
        "deferred",
        "ended",
        "failed",
        "flusher",
        "fresh",
        "inference",
        "ledgered",
        "new",
        "recorded",
        "store",
        "tickets",
        "unfinished",
        "written",
    )

    def __init__(
        self, flusher: Flusher, written: int = 0, *, new: bool = False
    ) -> None:
        self.flusher = flusher
        self.new = new
        """The loop is `run_loop`'s, and has written nothing yet: its first
        commit says so (`Commit.new`: the store refuses it if the id is taken)."""
        self.store: LoopStore = flusher.store
        self.written = written
        """How many context items the store holds (or will, once the commits
        queued have landed)."""
        self.answer: ContextItem | None = None
        """The item at `loop.answer_at` when last written (a handler may replace it)."""
        self.inference: tuple[int, InferenceOutput] | None = None
        """A model output to write with the next commit."""
        self.recorded: InferenceOutput | None = None
        """The output of the request a recovered loop was making, if recorded."""
        self.deferred: list[LoopRecord] = []
        """Records of transitions into side-effect-free states, not written yet."""
        self.ended: list[tuple[str, FunctionCallOutputItem, bool]] = []
        """Calls ended, their outputs not written yet."""
        self.ledgered: frozenset[str] = frozenset()
        """Keys of the calls of its latest request the ledger held when the
        loop was recovered: a call among them may have run (a batch parked
        over its calls in flight runs again on its resume, and its done calls
        must not): no intent is written for it with the commit into
        `function_call`, and `begin_call` asks the ledger."""
        self.fresh: dict[int, tuple[FunctionCallItem, CallRecord]] = {}
        """The intents this process wrote with the commit into `function_call`,
        by position in the batch (their ledger entries are known: new)."""
        self.unfinished = 0
        """Calls of the current batch that have not ended (started or not)."""
        self.tickets: list[Ticket] = []
        """Commits queued since the loop last waited for its writes."""
        self.failed: Exception | None = None
        """Why a write of the loop failed (then it writes no more)."""

    async def committed(self, loop: Loop) -> None:
        """A transition was committed: write it (waiting for it to land, or not:
        see `_AHEAD`), or keep it for the next write when the state it entered
        has no side effects."""
        state = loop.state
        if state in _FREE:
            self.deferred.append(loop.snapshot())
        elif state in _AHEAD:
            self._submit(loop, background=True)
        else:  # into `function_call`: the intents land before a tool runs
            await self.save(loop)

    def check(self) -> None:
        """Raise what a write the loop did not wait for raised, if one did (the
        loop fails, before it goes on, pauses or ends); forget the ones that
        landed."""
        tickets = self.tickets
        while tickets and tickets[0].landed:  # they land in order
            ticket = tickets.pop(0)
            if ticket.error is not None and self.failed is None:
                self.failed = ticket.error
        if self.failed is not None:
            raise self.failed

    async def save(self, loop: Loop) -> None:
        """Write the loop's record, the records kept since the last write, what
        its context gained, and the ledger's news; return once it landed."""
        self._submit(loop, background=False)
        await self.landed()

    async def landed(self) -> None:
        """Return once the loop's queued writes have landed.

        Raises:
            Exception: what a write of the loop's raised (this one's, or an
                earlier one's: the loop has written nothing since).
        """
        if self.failed is not None:
            raise self.failed
        if self.tickets:  # (the loop queues none while it waits)
            await self.flusher.wait(self.tickets[-1])
            self.check()

    async def ending(self) -> None:
        """The loop is about to end: return once the writes it sent have
        landed (one that failed fails the loop, so that no outcome is told that
        the store does not have); those still queued go with its end's commit,
        in one trip (with a model that never awaits, the commit into
        `inference` before the answer: a trip less a run, ~100 us on the
        benchmark's machine). If one of those fails, the end is not written
        either, and the loop keeps its outcome, as when its end's own write
        fails (logged, `store_write_failed`). But a new loop's first commit
        is waited for: a store that holds a loop of its id refuses it
        (`LoopIdTakenError`), and the loop fails."""
        tickets = self.tickets
        sent = None
        for ticket in reversed(tickets):  # sent in order: the queued ones last
            if ticket.sent:
                sent = ticket
                break
            if ticket.commit.new:
                await self.landed()
                return
        if sent is not None:
            await self.flusher.wait(sent)
        self.check()

    def queued(self, loop: Loop) -> None:
        """A steering or follow-up message was queued for the paused loop: its
        record, which holds the queues, is written (nobody waits for it; a
        runtime that exits writes it first), so the message outlives the
        process like the pause.

        The commit carries the record alone (the pause's commit wrote the
        rest), so a later commit does not build on it: if it fails, the
        flusher logs it, and the next commit (the resume's) holds the queues
        too."""
        if self.failed is not None or self.deferred or self.ended or self.inference:
            return  # writes no more, or has more to write than its record
        if len(loop.input.context.items) != self.written:
            return  # its context changed: the next commit writes it
        commit = Commit(loop.snapshot(), self.written)
        self.flusher.submit(commit, background=True)

    def _submit(self, loop: Loop, *, background: bool) -> None:
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
        commit = Commit(
            loop.snapshot(),
            first,
            items[first:],
            replaced,
            self.inference,
            truncate,
            self.deferred,
            self._intents(loop) if loop.state is LoopState.function_call else (),
            self.ended,
            self.new,
        )
        self.new = False
        self.inference = None
        self.deferred = []
        self.ended = []
        self.tickets.append(self.flusher.submit(commit, background=background))
        self.written = len(items)
        if at is not None and at < len(items):
            self.answer = items[at]

    async def write_inference(self, loop: Loop) -> None:
        """Write the output now, not with the next commit: the loop's handlers
        decide about it first, and may take a while (a crash meanwhile would
        send the request, and pay for it, again)."""
        if self.inference is not None:
            self.check()
            number, output = self.inference
            # Not after the loop's queued commit (its transition into
            # `inference`): recovery uses a recorded output only in that
            # state, so the order they land in does not matter.
            await self.store.record_inference(loop.loop_id, number, output)
            self.inference = None

    # ----------------------------------------------------------------- ledger

    def _intents(self, loop: Loop) -> list[CallRecord]:
        """The intents of the calls the commit into `function_call` starts at
        once: all of a batch run in parallel when none waits for a free slot
        (`max_tool_concurrency`), else none; the first of one run in sequence.
        Any other call's intent is written when it starts: before, it has not,
        and an intent for it would make it uncertain after a crash."""
        self.fresh = {}
        step = loop.step
        batch = step[1] if step is not None else None
        if not isinstance(batch, ToolBatch) or loop.output is None:
            return []
        if loop.output.finish_reason == "length":
            return []  # truncated: no call runs
        tools = tool_index(loop)
        runs = [
            (position, call)
            for position, call in enumerate(batch.calls)
            if call.call_id not in batch.denied
            and call.call_id not in batch.outputs
            and (call.name in tools or loop.tool_chain is not None)
        ]
        if parallel(loop, batch, tools):
            if len(runs) > loop.options.max_tool_concurrency:
                return []  # some wait for a slot, in no set order
        else:
            runs = runs[:1]
        for position, call in runs:
            key = call_key(loop, position, call)
            if key not in self.ledgered:
                self.fresh[position] = (call, self._intent(loop, key, position, call))
        return [intent for _, intent in self.fresh.values()]

    def _intent(
        self, loop: Loop, key: str, position: int, call: FunctionCallItem
    ) -> CallRecord:
        # The loop's own valid values: built without validation (~1.5 µs a
        # call; tests/internals/test_trusted_models.py checks it equals the
        # validated one).
        return _models.trusted(
            CallRecord,
            {
                "key": key,
                "loop_id": loop.loop_id,
                "request": loop.model_requests,
                "position": position,
                "tool": call.name,
                "call_id": call.call_id,
                "status": "started",
                "attempt": 1,
                "output": None,
                "terminate": False,
            },
            _INTENT_FIELDS,
        )

    async def begin_call(
        self, loop: Loop, position: int, call: FunctionCallItem
    ) -> CallRecord:
        """Record the intent to run `call` (the `position`-th of its batch); the
        ledger's entry (`done` when the call ran already: its recorded output
        is the output; its `key` is the call's idempotency key)."""
        fresh = self.fresh.pop(position, None)
        if fresh is not None and fresh[0] is call:  # this batch's (see `_intents`)
            return fresh[1]  # written with the commit into `function_call`
        key = call_key(loop, position, call)
        await self.landed()
        if self.ended:  # a sequential batch's earlier call: its output first
            ended, self.ended = self.ended, []
            for done in ended:
                await self.store.end_call(loop.loop_id, *done)
        return await self.store.begin_call(self._intent(loop, key, position, call))

    async def end_call(
        self, loop: Loop, key: str, output: FunctionCallOutputItem, terminate: bool
    ) -> None:
        """Record a call's output: now, or with the next write when nothing but
        the loop's own code runs before it (see the class)."""
        if (
            self.unfinished
            == 1  # the batch's last: no other call runs before the write
            and not loop.handlers
            and loop.options.finish_turn is None
            and loop.outbox is None
        ):
            self.ended.append((key, output, terminate))
        else:
            await self.landed()
            await self.store.end_call(loop.loop_id, key, output, terminate)
