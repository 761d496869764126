"""The runtime's side of a durable store: adopting new loops, leases, recovery.

`Runtime(store=...)` holds one `Keeper`. It gives each new loop a journal
(`Durable`, `adopt`), writes their commits (`Flusher`), holds the runtime's
presence in the store and keeps its leases alive while it runs (a service of
the runtime, entered before its loops and left after them), and takes up the
store's unfinished loops (`recover`).

Leases are fenced (see `agentfsm.store`): a renewal that finds a loop's lease
gone (another runtime took it) tells the loop's journal, which stops the loop
at its next step. A lease whose owner is certainly dead (the store can tell:
`LoopStore.alive`) is taken before it expires; one whose owner may be alive
is waited out.

Recovery, by the state a loop's last commit left it in (each state module
says how: `_loop.states.RECOVER`):

- paused: it stays paused (in memory, holding no task) until `resume`;
- not started, `context_update`, `model_message`: it runs that state again
  (they have no side effects outside the loop);
- `inference`: the request's output, if recorded, is used, else it is sent;
- `function_call`: each call the ledger holds as done gives its recorded
  output; a call in flight (started, no output) of a tool with
  `on_crash="retry"` runs again with the same key; one whose tool has a
  `reconcile` function is asked about first (`reconciling`: its answer is
  stored before the loop goes on); otherwise the loop pauses before
  `function_call`, naming the calls whose outcome is uncertain.

A loop that cannot be taken up (its data unreadable, a tool this runtime was
not given) is reported in `Recovery.failed` with its id and the cause, and
recovery goes on with the others.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import anyio

from agentfsm._errors import error_text
from agentfsm._logging import get_logger
from agentfsm._loop.journal import Halted
from agentfsm._loop.snapshot import Bindings, RecoveryError, restore
from agentfsm._loop.states import RECOVER
from agentfsm._loop.steps import Found
from agentfsm.events import LoopIdle
from agentfsm.exceptions import LeaseLostError, LoopLockedError, StoreError
from agentfsm.results import ErrorInfo, LoopStatus, PathStep
from agentfsm.states import LoopState, Outcome, Trigger
from agentfsm.store import Commit, Lease, LoopStore, StoredLoop, is_large
from agentfsm.tools import Tool

from .flusher import Flusher
from .reconciling import reconcile_calls
from .writer import LEASE_MARGIN, Durable, clock

if TYPE_CHECKING:
    from agentfsm._bus import EventBus
    from agentfsm._loop.loop import Loop
    from agentfsm.events import AgentEvent, ReconciledCall
    from agentfsm.inference import InferenceInput
    from agentfsm.options import LoopOptions

__all__ = ("Keeper", "Recovery")

_INFERENCE = (LoopState.inference, LoopState.inference_streaming)


@dataclass
class Recovery:
    """What `Runtime.recover` did with the store's unfinished loops."""

    running: list[str] = field(default_factory=list)
    """Loops that go on from their last committed transition."""
    paused: list[str] = field(default_factory=list)
    """Loops that stay paused (waiting for `resume`), the ones paused over calls
    whose outcome is uncertain included."""
    failed: dict[str, str] = field(default_factory=dict)
    """Loops that could not be taken up here, and why: a missing or changed
    tool (the loop is ended `failed` in the store), or stored data that cannot
    be read (the loop is left as it is)."""
    locked: dict[str, str] = field(default_factory=dict)
    """Loops another live runtime owns: loop id -> owner."""

    @property
    def recovered(self) -> list[str]:
        return [*self.running, *self.paused]


def owner_name() -> str:
    """This runtime's name in leases: host, process, and a random part (a name
    only; whether its runtime lives is the store's to tell)."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"


class Keeper:
    """A runtime's store, the bindings of its loops' callables, its leases."""

    def __init__(
        self,
        store: LoopStore,
        bus: EventBus,
        tools: Iterable[Tool | Callable[..., Any]],
        handlers: Mapping[str, Any] | Iterable[Any],
    ) -> None:
        self.store = store
        self.bus = bus
        self.bindings = Bindings(tools, handlers)
        self.owner = owner_name()
        self.flusher = Flusher(store)
        """The queue of the loops' commits (`_durable.flusher`)."""
        self.held: dict[str, Durable] = {}
        """The journals of this runtime's loops (running or paused), by loop id."""
        self.unreleased: dict[str, int | None] = {}
        """Loops that stopped here whose lease the store failed to give up,
        with the lease's epoch: given up again at each renewal (and never
        renewed), unless taken again since."""
        self.on_lost: Callable[[str, LeaseLostError], None] | None = None
        """Told when a renewal finds a loop's lease taken (the runtime stops a
        paused loop at once: it holds no task to find out)."""
        self.log = get_logger().bind(owner=self.owner)

    @property
    def ttl(self) -> float:
        return self.store.lease_ttl

    def _journal(
        self, loop: Loop, lease: Lease, *, written: int = 0, new: bool = False
    ) -> Durable:
        events = None
        if self.store.keeps_events:
            # Unbounded: the commits take its events as they are written.
            events = self.bus.subscribe("*", loop_id=loop.loop_id, buffer=2**62)
        durable = Durable(
            self.flusher,
            lease,
            self._confirm,
            clock() + self.ttl * LEASE_MARGIN,
            written=written,
            new=new,
            events=events,
        )
        loop.attach_journal(durable)
        self.held[loop.loop_id] = durable
        # Taken again: the old lease's release, if it is still to be retried,
        # would free this one (it names the old epoch, but not every store
        # has one to compare).
        self.unreleased.pop(loop.loop_id, None)
        return durable

    def adopt(self, loop: Loop, *, named: bool = False) -> None:
        """Make a new loop durable (its first commit makes it in the store, with
        the lease's first epoch); `named`: its caller chose its id, and its
        first commit lands before its first model request (`Durable.named`)."""
        durable = self._journal(loop, Lease(self.owner, 1), new=True)
        durable.named = named
        self.bindings.learn(loop)

    def forget(self, loop_id: str) -> int | None:
        """The loop ended, or stopped here: its journal is no longer this
        runtime's. Returns its lease's epoch (None: it held none here)."""
        durable = self.held.pop(loop_id, None)
        if durable is None:
            return None
        if durable.events is not None:
            durable.events.close()
        return durable.lease.epoch

    def pending_events(self, loop_id: str) -> list[AgentEvent]:
        """A loop's events not in its store yet (queued to be written, or not
        taken into a commit yet)."""
        durable = self.held.get(loop_id)
        if durable is None:
            return []
        events = [e for t in durable.tickets for e in t.commit.events]
        if durable.events is not None:
            events.extend(durable.events.buffered())
        return events

    async def release(self, loop_id: str, epoch: int | None = None) -> None:
        """Give up the loop's lease (of `epoch`, when known: never a lease
        taken since) for whoever takes it up (a loop that stopped here); a
        store that cannot is logged, and asked again at the next renewal (the
        lease, never renewed, expires meanwhile)."""
        epochs = None if epoch is None else {loop_id: epoch}
        try:
            await self.store.release(self.owner, [loop_id], epochs=epochs)
        except Exception as exc:  # noqa: BLE001 - logged; the lease expires
            if loop_id not in self.held:  # (unless taken again meanwhile)
                self.unreleased[loop_id] = epoch
            self.log.error("lease_release_failed", loop_id=loop_id, error=str(exc))
        else:
            self.unreleased.pop(loop_id, None)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Hold the runtime's presence, write the commits nobody waits for, and
        renew its leases, until the runtime exits; then write what is left and
        give the leases up (paused loops stay in the store for any runtime to
        resume)."""
        store = self.store
        await store.hold_presence(self.owner)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.flusher.serve, name="agentfsm-store-writer")
                tg.start_soon(self._renew, name="agentfsm-leases")
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.flusher.flush()  # (its failures are its commits')
                try:
                    await store.release(self.owner)
                except Exception as exc:  # noqa: BLE001 - logged: the leases expire
                    self.log.error("lease_release_failed", error=error_text(exc))
                finally:
                    await store.drop_presence(self.owner)

    async def _renew(self) -> None:
        while True:
            await anyio.sleep(self.ttl / 3)
            for loop_id, epoch in list(self.unreleased.items()):
                if self.unreleased.get(loop_id, -1) == epoch:  # (not taken since)
                    await self.release(loop_id, epoch)
            try:
                await self.renew()
            except Exception as exc:  # noqa: BLE001 - logged; the next try may work
                self.log.error("lease_renewal_failed", error=error_text(exc))

    async def renew(self, loop_ids: list[str] | None = None) -> None:
        """Renew the leases of this runtime's loops (those of `loop_ids`): only
        of the loops it holds, not of any other the store says it owns (one
        that stopped here, say); a loop whose lease is gone stops (at its next
        step, or at once if it is paused: `on_lost`)."""
        held = {
            loop_id: durable
            for loop_id, durable in self.held.items()
            if (loop_ids is None or loop_id in loop_ids) and durable.stored
        }
        sent, lapses = clock(), self.store.presence_lapses
        renewed = await self.store.renew(self.owner, list(held))
        for loop_id, durable in held.items():
            epoch = renewed.get(loop_id)
            if epoch == durable.lease.epoch:
                durable.renewed(durable.lease, sent, self.ttl, lapses)
            elif loop_id in self.held:
                lost = LeaseLostError(
                    loop_id,
                    self.owner,
                    "another runtime took it, or it ended"
                    if epoch is None
                    else f"another runtime took it (epoch {epoch})",
                )
                durable.lose(lost)
                if self.on_lost is not None:
                    self.on_lost(loop_id, lost)

    async def _confirm(self, durable: Durable) -> None:
        """Ask the store whether a loop's lease is still this runtime's (its last
        renewal is old: this runtime may have stalled); the journal stops the
        loop if not."""
        loop_id = next((k for k, d in self.held.items() if d is durable), None)
        if loop_id is None:
            return
        if not durable.stored:
            # Its first commit has not landed: nobody else can hold it yet.
            await durable.wait_landed()
        try:
            await self.renew([loop_id])
        except Exception as exc:  # the loop stops here, told why
            error = (
                exc
                if isinstance(exc, StoreError)
                else StoreError(
                    f"{self.store!r}: the loop's lease could not be confirmed "
                    f"({type(exc).__name__}: {error_text(exc)})"
                )
            )
            raise Halted(error) from exc

    # --------------------------------------------------------------- recovery

    async def recover(
        self,
        live: Mapping[str, Loop],
        make: Callable[[InferenceInput, tuple[Any, ...], LoopOptions], Loop],
        start: Callable[[Loop], None],
    ) -> Recovery:
        """Take up every unfinished loop this runtime can own; `start` hands a
        loop that goes on to a worker (paused ones are only kept)."""
        report = Recovery()
        for loop_id in await self.store.unfinished():
            if loop_id in live:
                continue
            try:
                await self._recover(loop_id, make, start, report)
            except LoopLockedError as exc:
                report.locked[loop_id] = exc.owner
            except Exception as exc:  # noqa: BLE001 - one loop's, reported
                # Its data cannot be read, the store failed for it, or it cannot
                # be rebuilt: reported, and recovery goes on with the others.
                why = error_text(exc)
                if not isinstance(exc, StoreError):  # (a store's names the store)
                    why = f"{self.store!r}: {type(exc).__name__}: {why}"
                self.log.error("loop_not_recovered", loop_id=loop_id, error=why)
                report.failed[loop_id] = why
                await self.release(loop_id, self.forget(loop_id))
        return report

    async def _take(self, loop_id: str) -> Lease | None:
        """The loop's lease, with a new epoch: at once if it is free or expired,
        or its owner is certainly dead; None if the loop has ended meanwhile
        (its owner finished it since `unfinished` listed it).

        Raises:
            LoopLockedError: a live runtime (or one that may be) holds it.
        """
        store = self.store
        try:
            try:
                return await store.acquire(loop_id, self.owner)
            except LoopLockedError as exc:
                if await store.alive(exc.owner) is not False:
                    raise
                return await store.acquire(loop_id, self.owner, replacing=exc.owner)
        except LoopLockedError:
            raise
        except StoreError:
            stored = await store.load(loop_id)
            if stored is not None and stored.record.status is LoopStatus.done:
                return None
            raise

    async def _recover(
        self,
        loop_id: str,
        make: Callable[[InferenceInput, tuple[Any, ...], LoopOptions], Loop],
        start: Callable[[Loop], None],
        report: Recovery,
    ) -> None:
        store = self.store
        lease = await self._take(loop_id)
        if lease is None:
            return  # finished by its owner meanwhile
        taken = clock()
        stored = await store.load(loop_id)
        if stored is None:
            # Listed unfinished, its lease just taken, and no record: a loop
            # row whose log the store cannot find (damaged), not an end.
            await self.release(loop_id, lease.epoch)
            raise StoreError(
                f"{store!r}: the store lists loop {loop_id} as unfinished but "
                "holds no record of it (its rows are damaged or gone)"
            )
        if stored.record.status is LoopStatus.done:
            await self.release(loop_id, lease.epoch)
            return  # finished by its owner meanwhile
        try:
            loop = restore(stored.record, stored.items, self.bindings, make)
        except RecoveryError as exc:
            await self._fail(stored, lease, exc)
            report.failed[loop_id] = str(exc)
            return
        loop.events_after(stored.last_event)  # (events past its record)
        self.flusher.forget(loop_id)  # a failed write here before: anew
        durable = self._journal(loop, lease, written=len(stored.items))
        durable.valid_until = taken + self.ttl * LEASE_MARGIN
        durable.requested = loop.model_requests
        durable.large = is_large(*stored.items)  # (its records may hold them)
        if loop.answer_at is not None and loop.answer_at < len(stored.items):
            durable.answer = stored.items[loop.answer_at]
        ledger = {c.key: c for c in await store.calls(loop_id, loop.model_requests)}
        durable.ledger, durable.ledger_of = ledger, loop.model_requests
        uncertain: list[str] = []
        reconciled: tuple[ReconciledCall, ...] = ()
        recover = RECOVER.get(loop.state)
        if loop.status is LoopStatus.running and recover is not None:
            output, notes = None, None
            if loop.state in _INFERENCE:
                output = await store.inference(loop_id, loop.model_requests + 1)
            elif loop.state is LoopState.function_call:
                found = await reconcile_calls(loop, ledger)
                if found is not None:
                    reconciled, notes = tuple(found.calls), found.notes
                    durable.reconciled(found.entries)  # (`ledger` holds them)
            uncertain = recover(loop, Found(output, ledger, notes))
        if uncertain:
            durable.mark_uncertain(uncertain)
        if reconciled:
            # Published first, so that a store keeping events stores it with
            # the answers it reports: the audit of what was reconciled, how.
            self._recovered(loop, durable, uncertain, reconciled)
        if uncertain or durable.ended:
            try:
                if loop.status is LoopStatus.paused:
                    await durable.save(loop)  # the pause, and the ledger saying why
                else:
                    await durable.write_ledger(loop)  # answers, before they act
            except Halted as exc:
                raise exc.error from exc
        if not reconciled:
            self._recovered(loop, durable, uncertain, reconciled)
        self.log.info(
            "loop_recovered", loop_id=loop_id, state=loop.state, status=loop.status
        )
        if loop.status is LoopStatus.paused:
            report.paused.append(loop_id)
        else:
            report.running.append(loop_id)
        start(loop)

    def _recovered(
        self,
        loop: Loop,
        durable: Durable,
        uncertain: list[str],
        reconciled: tuple[ReconciledCall, ...],
    ) -> None:
        """Publish `loop.recovered` (and log what reconcile functions answered)."""
        calls = tuple(durable.ledger[key].call_id for key in uncertain)
        for call in reconciled:
            self.log.info(
                "call_reconciled",
                loop_id=loop.loop_id,
                call_id=call.call_id,
                tool=call.tool,
                answer=call.answer,
                error=call.error,
            )
        loop.emit(
            "loop.recovered",
            status="paused" if loop.status is LoopStatus.paused else "running",
            uncertain_calls=calls,
            reconciled=reconciled,
        )

    async def _fail(
        self, stored: StoredLoop, lease: Lease, error: RecoveryError
    ) -> None:
        """End a loop that cannot be rebuilt here as failed, in the store."""
        record = stored.record
        message = error_text(error)
        self.log.error("loop_not_recovered", loop_id=record.loop_id, error=message)
        path = (*record.path, PathStep(record.state, Trigger.fail, LoopState.idle))
        ended = record.model_copy(
            update={
                "state": LoopState.idle,
                "status": LoopStatus.done,
                "path": (),
                "pending": None,
                "pause": None,
                "outcome": Outcome.failed,
                "reason": message,
                "error": ErrorInfo(type=type(error).__name__, message=message),
                "ended_at": datetime.now(UTC),
            }
        )
        events: list[AgentEvent] = []
        if self.store.keeps_events:  # its end, for whoever watches it
            seq = max(record.seq, stored.last_event) + 1
            events.append(
                LoopIdle(
                    event_id=f"{record.loop_id}:{seq}",
                    loop_id=record.loop_id,
                    agent_id=record.agent_id,
                    seq=seq,
                    state=LoopState.idle,
                    outcome=Outcome.failed,
                    reason=message,
                    usage=record.usage,
                    model_requests=record.model_requests,
                    tool_calls=record.tool_calls,
                )
            )
        await self.store.commit(
            Commit(
                record.loop_id,
                lease,
                ended,
                len(path),
                path,
                0,
                len(stored.items),
                events=events,
                large=is_large(ended),  # (its queued messages may hold one)
            )
        )
        for event in events:
            self.bus.publish_nowait(event)
