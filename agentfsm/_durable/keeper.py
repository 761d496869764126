"""The runtime's side of a durable store: adopting new loops, leases, recovery.

`Runtime(store=...)` holds one `Keeper`. It gives each new loop a `Durable`
(`adopt`), writes their commits (`Flusher`) and keeps the runtime's leases
alive while it runs (a service of the runtime, entered before its loops and
left after them), and rebuilds the store's unfinished loops (`recover`).

Recovery, by the state a loop's last commit left it in:

- paused: it stays paused (in memory, holding no task) until `resume`;
- not started, `context_update`, `model_message`: it runs that state again
  (they have no side effects outside the loop);
- `inference`: the request's output, if recorded, is used, else it is sent;
- `function_call`: each call the ledger holds as done gives its recorded
  output; a call in flight (intent, no output) of a tool with
  `on_crash="retry"` runs again with the same key; otherwise the loop pauses
  before `function_call`, naming the calls whose outcome is uncertain.
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
from agentfsm._loop.intercept import park, pending_of
from agentfsm._loop.turn import tool_index
from agentfsm.interception import ToolBatch
from agentfsm.results import ErrorInfo, LoopStatus, PathStep
from agentfsm.states import LoopState, Outcome, Trigger
from agentfsm.store._base import CallRecord, Commit, LoopStore, StoredLoop
from agentfsm.tools import Tool

from .events import EventKeeper
from .flusher import Flusher
from .restore import Bindings, RecoveryError, restore
from .writer import Durable, call_key

if TYPE_CHECKING:
    from agentfsm._loop.loop import Loop
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
    """Loops that could not be rebuilt here (a missing or changed tool, say),
    ended `failed` in the store with that error."""
    locked: dict[str, str] = field(default_factory=dict)
    """Loops another live runtime owns: loop id -> owner."""

    @property
    def recovered(self) -> list[str]:
        return [*self.running, *self.paused]


def owner_name() -> str:
    """This runtime's name in leases: host, process, and a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"


def is_dead(owner: str) -> bool:
    """Whether a lease's owner is a runtime of this host whose process is gone
    (its lease need not be waited out)."""
    parts = owner.rsplit(":", 2)  # see `owner_name`
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return False  # this process: another runtime of it, alive
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's
    return False


class Keeper:
    """A runtime's store, the bindings of its loops' callables, its leases."""

    def __init__(
        self,
        store: LoopStore,
        tools: Iterable[Tool | Callable[..., Any]],
        handlers: Mapping[str, Any] | Iterable[Any],
    ) -> None:
        self.store = store
        self.bindings = Bindings(tools, handlers)
        self.events: EventKeeper | None = None
        """The writer of the loops' events, when the store keeps them (set when
        the runtime is entered: it subscribes to the runtime's bus)."""
        self.owner = owner_name()
        self.flusher = Flusher(store, self.owner)
        """The queue of the loops' commits (`_durable.flusher`)."""
        self.log = get_logger().bind(owner=self.owner)

    def adopt(self, loop: Loop) -> None:
        """Make a new loop durable."""
        loop.durable = Durable(self.flusher, new=True)
        self.bindings.learn(loop)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Write the commits nobody waits for, and renew this runtime's leases,
        until the runtime exits; then write what is left and give the leases
        up (paused loops stay in the store for any runtime to resume)."""
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
                try:
                    await self.flusher.flush()
                finally:
                    await self.store.release(self.owner)

    async def _renew(self) -> None:
        while True:
            await anyio.sleep(self.store.lease_ttl / 3)
            try:
                await self.store.renew(self.owner)
            except Exception as exc:  # noqa: BLE001 - logged; the next try may work
                self.log.error("lease_renewal_failed", error=error_text(exc))

    # --------------------------------------------------------------- recovery

    async def recover(
        self,
        live: Mapping[str, Loop],
        make: Callable[[InferenceInput, tuple[Any, ...], LoopOptions], Loop],
        start: Callable[[Loop], None],
    ) -> Recovery:
        """Rebuild every unfinished loop this runtime can own; `start` hands a
        loop that goes on to a worker (paused ones are only kept)."""
        report = Recovery()
        for loop_id in await self.store.unfinished():
            if loop_id in live:
                continue
            taken = await self.store.acquire(loop_id, self.owner)
            if taken is not None and is_dead(taken):
                taken = await self.store.acquire(loop_id, self.owner, replacing=taken)
            if taken is not None:
                report.locked[loop_id] = taken
                continue
            stored = await self.store.load(loop_id)
            if stored is None or stored.record.status is LoopStatus.done:
                continue  # finished by its owner meanwhile
            try:
                loop = restore(stored, self.bindings, make)
            except RecoveryError as exc:
                await self._fail(stored, exc)
                report.failed[loop_id] = str(exc)
                continue
            self.flusher.forget(loop_id)  # a failed write here before: anew
            durable = loop.durable = Durable(self.flusher, len(stored.items))
            if loop.answer_at is not None and loop.answer_at < len(stored.items):
                durable.answer = stored.items[loop.answer_at]
            ledger = {
                c.key: c for c in await self.store.calls(loop_id, loop.model_requests)
            }
            durable.ledgered = frozenset(ledger)
            uncertain: tuple[str, ...] = ()
            if loop.status is LoopStatus.running:
                if loop.state in _INFERENCE:
                    durable.recorded = await self.store.inference(
                        loop_id, loop.model_requests + 1
                    )
                elif loop.state is LoopState.function_call:
                    uncertain = await self._uncertain(loop, ledger)
            loop.emit(
                "loop.recovered",
                status="paused" if loop.status is LoopStatus.paused else "running",
                uncertain_calls=uncertain,
            )
            self.log.info(
                "loop_recovered", loop_id=loop_id, state=loop.state, status=loop.status
            )
            if loop.status is LoopStatus.paused:
                report.paused.append(loop_id)
            else:
                report.running.append(loop_id)
            start(loop)
        return report

    async def _uncertain(
        self, loop: Loop, ledger: dict[str, CallRecord]
    ) -> tuple[str, ...]:
        """Pause a loop recovered in `function_call` over its calls in flight
        whose tools may not run twice; their call ids."""
        step = loop.step
        assert step is not None
        batch = step[1]
        if not isinstance(batch, ToolBatch):
            return ()
        tools = tool_index(loop)
        doubtful = []
        for position, call in enumerate(batch.calls):
            key = call_key(loop, position, call)
            entry = ledger.get(key)
            if entry is None or entry.status == "done":
                continue
            tool = tools.get(call.name)
            if tool is not None and tool.on_crash == "retry":
                continue  # idempotent: it runs again, with the same key
            doubtful.append((key, call))
        if not doubtful:
            return ()
        # Back to just before `function_call`, paused: the handlers decided
        # about this batch already, so the decision resuming it is the last.
        entered = loop.path.pop()
        loop.state = entered.source
        names = ", ".join(f"{c.call_id} ({c.name})" for _, c in doubtful)
        reason = (
            f"uncertain tool outcome: the process stopped with {names} started "
            "and no output recorded (each may or may not have run); "
            "resume with Proceed to run them again, or a Rewrite whose ToolBatch "
            "answers them (ToolBatch.answer) or denies them (ToolBatch.deny)"
        )
        park(
            loop,
            (entered.trigger, batch, None),
            pending_of(loop, entered.source, entered.trigger, entered.dest, batch),
            len(loop.handlers),
            reason,
            entered.dest,
        )
        await self.store.mark_uncertain(loop.loop_id, [key for key, _ in doubtful])
        assert loop.durable is not None
        await loop.durable.save(loop)
        return tuple(c.call_id for _, c in doubtful)

    async def _fail(self, stored: StoredLoop, error: RecoveryError) -> None:
        """End a loop that cannot be rebuilt here as failed, in the store."""
        record = stored.record
        message = error_text(error)
        self.log.error("loop_not_recovered", loop_id=record.loop_id, error=message)
        ended = record.model_copy(
            update={
                "state": LoopState.idle,
                "status": LoopStatus.done,
                "path": (
                    *record.path,
                    PathStep(record.state, Trigger.fail, LoopState.idle),
                ),
                "pending": None,
                "pause": None,
                "outcome": Outcome.failed,
                "reason": message,
                "error": ErrorInfo(type=type(error).__name__, message=message),
                "ended_at": datetime.now(UTC),
            }
        )
        await self.store.commit(Commit(ended, len(stored.items)), self.owner)
        await self.store.release(self.owner, [record.loop_id])
