"""The driver: take a loop's steps until it ends in `idle` or pauses.

Each turn of `drive`:

1. a cancel requested since the last transition ends the loop (`cancel`);
2. the handlers decide about the step (`intercept`): proceed, rewrite, pause
   (the driver returns; `Runtime.resume` hands the loop to a worker again,
   which continues from the same step) or abort;
3. `commit` takes the edge: the path, the state, `loop.transition`, and the
   commit hook (the point at which the loop's record is complete);
4. the destination state runs and returns the next step; or, at `idle`, `end`
   decides how the loop ended;
5. every 8 transitions, the driver yields to the event loop if it is due
   (`_YIELD_MASK`).

`end` is the one place an outcome is decided: from the edge the loop took to
`idle` and that edge's reason, never from flags set earlier.
"""

from __future__ import annotations

from time import monotonic
from typing import TYPE_CHECKING, Final

import anyio
from anyio.lowlevel import checkpoint

from agentfsm._errors import cancelled_from_outside, error_text
from agentfsm._logging import bind_loop_ids
from agentfsm._machine import TABLE
from agentfsm.exceptions import LoopAborted, LoopTimeout
from agentfsm.interception import TransitionPayload
from agentfsm.messages import ModelMessageItem
from agentfsm.results import ErrorInfo, LoopStatus, PathStep
from agentfsm.states import LoopState, Outcome, Trigger

from .intercept import intercept
from .journal import Halted
from .loop import _current_loop
from .states import STATES
from .steps import _S, _T, Step

if TYPE_CHECKING:
    from agentfsm.exceptions import StoreError

    from .journal import Journal
    from .loop import Loop

__all__ = ("end", "end_paused", "expire_paused", "halt", "run")

_tuple_new = tuple.__new__

_EDGES: Final[dict[LoopState, dict[Trigger, PathStep]]] = {s: {} for s in LoopState}
"""The machine (`TABLE`) by source, then trigger: the `PathStep` of each edge,
whose destination the driver takes and which every loop's path shares. Two
lookups of members whose hashes are cached, where a tuple of the edge made
and hashed per transition cost ~650 instructions more (`make
bench-instructions`); a step is an immutable tuple, and a path of shared
steps leaves the garbage collector ten objects fewer to walk per loop in
flight or kept for `wait`."""
for (_source, _trigger), _dest in TABLE.items():
    _EDGES[_source][_trigger] = _tuple_new(PathStep, (_source, _trigger, _dest, None))
del _source, _trigger, _dest

_REWRITTEN: dict[tuple[LoopState, Trigger, LoopState, LoopState | None], PathStep] = {}
"""The `PathStep`s of the edges `_EDGES` does not hold as they were taken (a
handler rewrote the destination), made once each."""

# Module constants: an enum member looked up on its class costs ~900
# instructions more (tests/internals/test_names.py checks they mirror the enums).
_DONE: Final = LoopStatus.done
_ANSWERED: Final = Outcome.answered
_STOPPED: Final = Outcome.stopped

_YIELD_MASK: Final = 7
_YIELD_AFTER: Final = 0.01
"""Every 8 transitions (`len(path) & 7 == 0`) the driver yields to the event loop
if no loop has in the last 10 ms, so a loop whose provider, handlers and tools
never await holds the process ~10 ms at most, and its deadline (a cancel scope)
and a cancel from another task get their chance. A checkpoint at every 8th
transition cost ~35,000 instructions per benchmark run (+6%: it is a whole
event-loop iteration on asyncio); the clock read costs ~150. One clock for all
loops: any loop that spins yields within 10 ms of the last yield. (Under
callgrind a benchmark run takes ~50x its time, past 10 ms: the checkpoint then
comes once a run, ~10,000 instructions of `make bench-instructions`' figure,
~36,000 with a subscriber, that a native run pays once per 10 ms.)"""

_last_yield = 0.0

_OUTCOMES: Final = {
    _T.stop: Outcome.stopped,
    _T.abort: Outcome.aborted,
    _T.fail: Outcome.failed,
    _T.cancel: Outcome.cancelled,
}
"""The outcome of each edge into `idle` but `finish` (answered, or stopped when
it carries a reason)."""


async def run(loop: Loop) -> None:
    """The loop's run in its worker: drive until idle or paused; never raises
    but cancellation.

    A cancel never waits on a subscriber: a loop ending by a cancel delivers
    the events it holds for a full backpressure subscriber past its capacity
    (`deliver_held`) instead of waiting for room, so a subscriber that never
    reads holds neither the loop's worker nor the runtime's exit.

    A durable loop's journal may stop it here (`Halted`: a write failed, or
    another runtime took it): it ends nothing and is detached (`halt`). So is
    a durable loop the runtime closes while it runs: its store keeps it, for
    `recover`, as of its last commit.
    """
    # Each run is in its own copy of the starter's context (see `_runtime.workers`),
    # so binding needs no reset.
    _current_loop.set(loop.loop_id)
    bind_loop_ids(loop.loop_id, loop.agent_id)
    journal = loop.journal
    # `Runtime.cancel` cancels the task of the worker running the loop; the
    # cancellation arrives here like the runtime closing does.
    try:
        if journal is not None and loop.resumed is not None:
            # The decision is stored before it takes effect: a loop recovered
            # after this never asks for it again.
            await journal.save(loop)
        if loop.options.deadline is None:
            await drive(loop)
        else:
            await _drive_until_deadline(loop)
        if loop.status is not _DONE:
            _cancelled(loop)  # cancelled as it paused, with no checkpoint between
    except Halted as exc:
        halt(loop, error_text(exc.error), exc.error)
        return
    except anyio.get_cancelled_exc_class() as exc:
        if not cancelled_from_outside():
            # Not a cancel of the loop: code it ran (a provider, a handler)
            # raised one of its own, which fails the loop like any error.
            _failed(loop, exc)
        elif loop.detached:
            # Handed over (`Runtime.hand_over`): it goes on in another
            # runtime, so its task ending here is not its end.
            raise
        elif journal is not None and not loop.cancel_requested:
            # The runtime closing: not the loop's end. The store keeps its
            # last transition, and `recover` goes on from it.
            journal.closing(loop)
            halt(loop, "the runtime closed while the loop ran", None)
            raise
        else:
            # Cancelled (by `Runtime.cancel`, or the runtime closing): end the
            # loop as cancelled, then let the cancellation go on. A cancel
            # never waits on a subscriber: what the loop holds is delivered
            # past capacity.
            end(loop, _T.cancel, reason=_cancel_reason(loop, "runtime closed"))
            loop.deliver_held()
            await _stored_end(loop)
            raise
    except LoopAborted as exc:
        end(loop, _T.abort, reason=exc.reason)
    except Exception as exc:  # noqa: BLE001 - any error fails the loop, never the runtime
        _failed(loop, exc)
    except BaseException as exc:
        # KeyboardInterrupt, SystemExit or another BaseException from user
        # code: not the loop's to absorb (it means "stop"), so it goes on into
        # the runtime, which cancels the other loops; this loop still ends,
        # failed, naming it, so no loop is left without an outcome (and, as
        # for a cancel, without waiting on a subscriber).
        end(loop, _T.fail, reason=error_text(exc), error=exc)
        loop.deliver_held()
        await _stored_end(loop)
        raise
    if journal is not None:
        with anyio.CancelScope(shield=True):
            stored = await _saved(loop, journal)  # paused, or ended
            if stored and loop.status is not _DONE and _cancelled(loop):
                # Cancelled while its pause was being saved (the cancel only
                # cancelled this worker, and nothing here checkpoints): it ends
                # now, or it would stay paused with nobody to end it.
                stored = await _saved(loop, journal)
        if not stored:
            return
        if loop.status is _DONE:
            _announce_end(loop)
    if loop.outbox is None:
        return
    if loop.outcome is Outcome.cancelled:
        loop.deliver_held()
        return
    # Ended otherwise, or paused: the held events wait for room (backpressure),
    # unless a cancel comes meanwhile (`Runtime.cancel` of the paused loop, the
    # runtime closing).
    try:
        await loop.flush()
    except anyio.get_cancelled_exc_class():
        if loop.status is not _DONE and journal is None:
            # Paused, its pause still being published (a durable loop stays
            # paused in its store).
            reason = "the runtime closed while the loop was paused"
            end(loop, _T.cancel, reason=_cancel_reason(loop, reason))
        loop.deliver_held()
        raise


def _failed(loop: Loop, exc: BaseException) -> None:
    """End the loop as failed by `exc`, an error of code it ran."""
    loop.log.warning(
        "loop_failed",
        state=loop.state,
        error=f"{type(exc).__name__}: {error_text(exc)}",
    )
    end(loop, _T.fail, reason=error_text(exc), error=exc)


async def _stored_end(loop: Loop) -> None:
    """A durable loop's end: stored, then announced (`end` announces that of a
    loop without a store at once); nothing without a store."""
    journal = loop.journal
    if journal is None:
        return
    with anyio.CancelScope(shield=True):
        stored = await _saved(loop, journal)
    if stored:
        _announce_end(loop)


async def _saved(loop: Loop, journal: Journal) -> bool:
    """Store the loop as its run left it (paused, or ended); whether it landed
    (if not, the loop is detached: `halt`)."""
    try:
        await journal.save(loop)
    except Halted as exc:
        halt(loop, error_text(exc.error), exc.error)
        return False
    return True


def _announce_end(loop: Loop) -> None:
    """A durable loop's end is stored: publish its `loop.idle`, then wake whoever
    waits (they find it ended in the store too)."""
    loop.release_idle()
    wake(loop)


def halt(loop: Loop, reason: str, error: StoreError | None) -> None:
    """The loop stops in this process without ending (see `run`): it writes
    nothing more, publishes `loop.detached`, and is no longer the runtime's.
    Its store keeps it as of its last commit."""
    loop.detached = True
    loop.log.error("loop_detached", state=loop.state, reason=reason)
    loop.emit(
        "loop.detached",
        reason=reason,
        error_type=None if error is None else type(error).__name__,
    )
    loop.deliver_held()
    loop.model_chain = None  # (a cycle: see `end`)
    if loop.on_halt is not None:
        loop.on_halt(loop, reason, error)


def _cancel_reason(loop: Loop, otherwise: str) -> str:
    if loop.cancel_requested:
        return loop.cancel_reason or "cancelled"
    return otherwise


def _cancelled(loop: Loop) -> bool:
    """End the loop as cancelled if a cancel was requested (by anyone, the
    loop's own tool or a handler included); return whether it was."""
    if not loop.cancel_requested:
        return False
    end(loop, _T.cancel, reason=loop.cancel_reason or "cancelled")
    return True


async def _drive_until_deadline(loop: Loop) -> None:
    """`drive` under the loop's deadline (pauses count: it is set on the first run)."""
    deadline = loop.options.deadline
    assert deadline is not None
    if loop.deadline_at is None:
        loop.deadline_at = anyio.current_time() + deadline
    with anyio.CancelScope(deadline=loop.deadline_at) as scope:
        await drive(loop)
    if scope.cancelled_caught:
        raise LoopTimeout(f"the loop ran past its deadline of {deadline:g}s")


async def drive(loop: Loop) -> None:
    """Take steps until the loop ends or pauses (a loop recovered from a store
    with no pending step first runs the state it had entered)."""
    step = loop.pending
    journal = loop.journal
    if step is None:
        assert loop.step is not None
        if journal is None:
            step = await STATES[loop.state](loop, loop.step[1])
        else:
            await journal.act()  # its side effects follow no commit: the lease first
            step = await STATES[loop.state](loop, loop.step[1])
            await journal.take_state_output(loop)
    loop.pending = None
    idle = _S.idle  # a local: compared at every transition
    while True:
        if loop.cancel_requested and _cancelled(loop):  # the flag first: no call
            return
        if journal is not None:
            journal.check()  # a write it did not wait for failed: it stops now
        source = loop.state
        edge = _EDGES[source][step[0]]
        dest = edge[2]
        # Read at each step, not once: breakpoints set while the loop runs
        # give it a handler (`agentfsm.breakpoints`), from its next transition.
        if loop.handlers or loop.resumed is not None:
            decided = await intercept(loop, source, step, dest)
            if decided is None:
                return  # paused: `loop.pending` holds the step
            step, dest, rewritten_from = decided
            edge = path_step(source, step[0], dest, rewritten_from)
            if loop.cancel_requested and _cancelled(loop):  # by a handler: not taken
                return
        if journal is not None and dest is idle:
            # Its writes land before it ends, or go with its end (`ending`).
            # (The journal tested first: the state first cost a loop without a
            # store ~2,400 instructions a benchmark run, `make
            # bench-instructions`.)
            await journal.ending(loop)
        commit(loop, edge, step)
        if dest is idle:
            end(loop, *step)
            return
        if journal is None:
            step = await STATES[dest](loop, step[1])
        else:
            await journal.write_commit(loop)  # before the state's side effects
            step = await STATES[dest](loop, step[1])
            await journal.take_state_output(loop)
        if loop.outbox is not None:
            await loop.flush()
        if not len(loop.path) & _YIELD_MASK:
            await _yield_if_due()


async def _yield_if_due() -> None:
    global _last_yield
    now = monotonic()
    if now - _last_yield > _YIELD_AFTER:
        _last_yield = now
        await checkpoint()


def commit(loop: Loop, edge: PathStep, step: Step) -> None:
    """Take the edge (`path_step`): record it in the path, enter its
    destination, publish it."""
    loop.path.append(edge)
    loop.state = dest = edge[2]
    loop.step = step
    loop.emit_transition(edge[0], step[0], dest, edge[3])
    if loop.on_commit is not None:
        loop.on_commit(loop)


def path_step(
    source: LoopState,
    trigger: Trigger,
    dest: LoopState,
    rewritten_from: LoopState | None = None,
) -> PathStep:
    """The shared `PathStep` of an edge: the machine's own (`_EDGES`), or one
    a handler rewrote, made once (`_REWRITTEN`)."""
    if rewritten_from is None:
        made = _EDGES[source].get(trigger)
        if made is not None and made[2] is dest:
            return made
    edge = (source, trigger, dest, rewritten_from)
    made = _REWRITTEN.get(edge)
    if made is None:
        made = _REWRITTEN[edge] = _tuple_new(PathStep, edge)
    return made


def end(
    loop: Loop,
    trigger: Trigger,
    payload: TransitionPayload = None,
    reason: str | None = None,
    error: BaseException | None = None,
) -> None:
    """How a loop ends: its outcome, from the edge it took to `idle` and that
    edge's reason. An `abort`, `fail` or `cancel` edge is taken here."""
    if loop.status is _DONE:
        return
    if error is not None:
        loop.error = ErrorInfo(type=type(error).__name__, message=error_text(error))
        loop.emit("loop.failed", error_type=loop.error.type, message=loop.error.message)
    if loop.state is not _S.idle:
        commit(
            loop, path_step(loop.state, trigger, _S.idle), (trigger, payload, reason)
        )
    if trigger is _T.finish:
        # The payload of `finish` is a ModelMessageItem: the state made it, or a
        # rewrite was checked to give one (`intercept.payload_problem`).
        # An answer the loop ends with: the published one, one a handler
        # rewrote, or (answering, not stopping) one a handler took although
        # it failed validation. A stopping `finish` never publishes the
        # state's own unvalidated message.
        if payload is not loop.answer and (
            reason is None or payload is not loop.message
        ):
            _settle_answer(loop, payload)  # type: ignore[arg-type]
        outcome = _ANSWERED if reason is None else _STOPPED
    else:
        outcome = _OUTCOMES[trigger]
        if trigger is _T.stop and reason is None:
            reason = "intercepted"  # a handler chose the edge
    loop.outcome = outcome
    loop.reason = reason
    loop.status = _DONE
    loop.ended_at = loop.clock()
    loop.paused = loop.pending = None
    loop.output = None
    # The model wrappers' chain ends in the loop's own method (a cycle: loop ->
    # chain -> loop); dropped, the ended loop is freed without the collector.
    loop.model_chain = None
    # A durable loop's `loop.idle` is held until its end is stored (`run`):
    # whoever it tells, and whoever `wait`s, then finds it ended in the store
    # too (an end the store could not take detaches the loop instead).
    loop.emit_idle(
        outcome,
        reason,
        loop.answer,
        loop.usage,
        loop.model_requests,
        loop.tool_calls,
        loop.journal is not None,
    )
    loop.log_info("loop_idle", outcome=outcome, reason=reason)
    if loop.journal is None:
        wake(loop)


def wake(loop: Loop) -> None:
    """The loop has ended: wake whoever waits, hand its result to the runtime."""
    if loop.done is not None:
        loop.done.set()
    loop.on_end(loop)


def _settle_answer(loop: Loop, message: ModelMessageItem) -> None:
    """The answer the loop ends with at `finish`: published already, or rewritten
    by a handler, or taken by one although it failed validation. The context,
    the result and a `model.answer` carry a new one."""
    if loop.answer is not None and message == loop.answer:
        return  # the caller saw it is not the published one; it may be equal
    written = loop.message
    items = loop.input.context.items
    at = loop.answer_at
    if (
        message is not written
        and at is not None
        and at < len(items)
        and items[at] is written
    ):
        items[at] = message
    loop.answer = message
    loop.parsed = None  # a message settled here was never parsed as valid
    loop.emit_answer(message, None)


async def end_paused(loop: Loop, reason: str) -> None:
    """End a paused loop as cancelled, without a task (the runtime is closing)."""
    loop.cancel_requested = True
    loop.cancel_reason = reason
    end(loop, _T.cancel, reason=reason)
    loop.deliver_held()  # a cancel never waits on a subscriber (see `run`)


async def expire_paused(loop: Loop) -> None:
    """End a paused loop whose deadline passed: it fails with `LoopTimeout`
    (the deadline counts pauses; see `Runtime`'s deadline timers)."""
    deadline = loop.options.deadline
    assert deadline is not None
    error = LoopTimeout(f"the loop ran past its deadline of {deadline:g}s (paused)")
    end(loop, _T.fail, reason=error_text(error), error=error)
    await _stored_end(loop)
    try:
        await loop.flush()
    except anyio.get_cancelled_exc_class():
        loop.deliver_held()  # the runtime closing: lose none, wait no more
        raise
