"""The runtime's side of the decision inbox: applying the store's requests to
the loops this runtime holds (`Runtime(requests=True)`).

A request (`agentfsm.store.LoopRequest`) is stored by a process that does not
hold the loop (`agentfsm ui`, a script). The `Watcher` reads the store's
pending requests every `interval` seconds, at once when poked
(`Runtime.poke_requests`, `recover`) or when the store announces one
(`Requests.request_notices`: PostgreSQL's `LISTEN`), and applies each whose
loop this runtime holds live:

- resume: if the loop is paused at the request's `seq`, `Runtime.resume` with
  its decision and `by`; the commit that stores the decision (before it takes
  effect) marks the request applied in its transaction. A loop not paused
  there (running, paused again, ending) refuses it, saying where it is.
- cancel: `Runtime.cancel` with its reason; the loop's next commit with a
  record (its end, mostly: any such commit's record holds the cancel asked,
  which a recovered loop honours) marks it applied.
- fork: any watching runtime with the recording's tools and callables
  starts the fork (`agentfsm.replay.inbox`: its id derived from the
  request, so the store takes one such loop only), whose first commit marks
  it applied; one without them leaves it pending.

So a request is applied once: the store marks it only in a commit that lands,
and only a loop's lease holder can land one; a crash before it leaves the
request pending (and the loop as it was), for whichever runtime takes the
loop up. A request for a loop this runtime does not hold is left alone (another
may hold it; none may: it stays pending); one for a loop this runtime ended is
refused. What the watcher fails at (the store unreachable) is logged, and
tried again at the next interval: it never stops a loop or the runtime.

At each read it also syncs the runtime's breakpoints with those the store
keeps (`agentfsm.store.SharedBreakpoints`, set from `agentfsm ui`, say):
`Breakpoints.sync` sets the new ones and unsets the removed, one read of the
active ones (a few rows), before the requests are applied (a resume asked
after a breakpoint was set meets it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import anyio

from agentfsm._errors import error_text
from agentfsm._logging import get_logger
from agentfsm._loop.snapshot import stored_decision
from agentfsm.exceptions import AgentFSMError
from agentfsm.interception import Decision, Proceed, Rewrite
from agentfsm.messages import ImageBlock, TextBlock, UserMessage
from agentfsm.results import LoopStatus
from agentfsm.store import SharedBreakpoints

if TYPE_CHECKING:
    from agentfsm._loop.loop import Loop
    from agentfsm.breakpoints import Breakpoints
    from agentfsm.record import DecisionRecord
    from agentfsm.store import LoopRequest, Requests

    from .keeper import Keeper
    from .writer import Durable

__all__ = ("Hooks", "Refused", "Watcher")

_log = get_logger()

_A = TypeVar("_A")


@dataclass(frozen=True, slots=True)
class Hooks:
    """What the watcher asks of its runtime."""

    live: Callable[[str], Loop | None]
    """The runtime's running or paused loop of an id (None: not one)."""
    ended: Callable[[str], bool]
    """Whether the runtime ended the loop of an id (and keeps its result)."""
    resume: Callable[[str, Decision, str], None]
    """`Runtime.resume(loop_id, decision, by=...)`."""
    cancel: Callable[[str, str | None], None]
    """`Runtime.cancel(loop_id, reason)`."""
    closing: Callable[[], bool]
    """Whether the runtime is closing (it applies nothing more)."""
    breakpoints: Breakpoints | None = None
    """The runtime's breakpoints, synced with the store's (None: not)."""
    fork: Callable[[LoopRequest], Awaitable[tuple[str, Durable] | None]] | None = None
    """Starts a fork request's loop, its journal carrying the request
    (`agentfsm.replay.inbox.apply_fork`); None: not this runtime's to apply.
    Raises `Refused`. None (the field): forks are left pending."""


class Refused(Exception):
    """A request that can never be applied: its note is the message."""


class Watcher:
    """Applies the store's requests to the runtime's loops (see the module)."""

    def __init__(
        self, keeper: Keeper, store: Requests, interval: float, hooks: Hooks
    ) -> None:
        self.keeper = keeper
        self.store = store
        self.interval = interval
        self.hooks = hooks
        self._breaks = store if isinstance(store, SharedBreakpoints) else None
        """The store, if it keeps breakpoints (`agentfsm.store.SharedBreakpoints`)."""
        self._wake = anyio.Event()
        self._applying: dict[int, tuple[str, Durable]] = {}
        """Requests applied here whose commit has not marked them yet, with the
        loop's journal that carries them: not applied again while it does."""

    def poke(self) -> None:
        """Read the store's requests now, not at the next interval."""
        self._wake.set()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Watch the store until the runtime exits (a service of the runtime)."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._serve, name="agentfsm-requests")
            tg.start_soon(self._listen, name="agentfsm-request-notices")
            try:
                yield
            finally:
                tg.cancel_scope.cancel()

    async def _serve(self) -> None:
        while True:
            with anyio.move_on_after(self.interval):
                await self._wake.wait()
            self._wake = anyio.Event()
            try:
                await self.poll()
            except Exception as exc:  # noqa: BLE001 - logged; the next poll may work
                _log.error("requests_poll_failed", error=_why(exc))

    async def _listen(self) -> None:
        """Poke the watcher at each notice the store gives; a listening that
        fails is logged and begun again after an interval (the poll goes on
        meanwhile). Nothing for a store that gives no notices."""
        while True:
            notices = self.store.request_notices()
            if notices is None:
                return
            try:
                async with notices as wait:
                    self.poke()  # what was submitted before this listened
                    while True:
                        await wait()
                        self.poke()
            except Exception as exc:  # noqa: BLE001 - logged; the poll goes on
                _log.error("requests_listen_failed", error=_why(exc))
            await anyio.sleep(self.interval)

    async def poll(self) -> None:
        """Read the pending requests once and apply those of this runtime's
        loops (see the module)."""
        await self._sync_breakpoints()
        pending = await self.store.pending_requests()
        held = self.keeper.held
        for request_id, (loop_id, durable) in list(self._applying.items()):
            # Marked, or its journal is gone (the commit never landed: the loop
            # stopped here): either way, not this journal's any more.
            if held.get(loop_id) is not durable:
                del self._applying[request_id]
        waiting = {r.id for r in pending}
        for request_id in [i for i in self._applying if i not in waiting]:
            del self._applying[request_id]
        for request in pending:
            if self.hooks.closing():
                return
            if request.id not in self._applying:
                await self._apply(request)

    async def _sync_breakpoints(self) -> None:
        """Set the store's breakpoints here, unset the removed ones (a store
        that keeps none: nothing). A read that fails is logged: the requests
        are applied all the same, and the next poll reads them again."""
        breakpoints, store = self.hooks.breakpoints, self._breaks
        if breakpoints is None or store is None:
            return
        try:
            stored = await store.breakpoints()
        except Exception as exc:  # noqa: BLE001 - logged; the next poll may work
            _log.error("breakpoints_sync_failed", error=_why(exc))
            return
        breakpoints.sync(stored)

    async def _apply(self, request: LoopRequest) -> None:
        if request.kind == "fork":
            await self._fork(request)
            return
        loop_id = request.loop_id
        loop = self.hooks.live(loop_id)
        durable = self.keeper.held.get(loop_id)
        if loop is None or durable is None or loop.detached:
            if loop is None and self.hooks.ended(loop_id):
                await self._refuse(request, f"loop {loop_id} has ended")
            return  # not this runtime's: another may hold it
        if loop.status is LoopStatus.done:
            return  # its end is being written: refused at the next poll
        if request.kind == "cancel":
            await self._act(request, durable, self.hooks.cancel, request.reason)
            return
        paused = loop.paused
        if loop.status is not LoopStatus.paused or paused is None:
            await self._refuse(
                request,
                f"loop {loop_id} is {loop.status}, not paused at seq {request.seq}",
            )
            return
        if paused.pending.seq != request.seq:
            await self._refuse(
                request,
                f"loop {loop_id} is paused at seq {paused.pending.seq}, not at seq "
                f"{request.seq} (the request answers another pause)",
            )
            return
        try:
            decision = self._decision(loop, request.decision)
        except Exception as exc:  # noqa: BLE001 - the request's, refused
            await self._refuse(request, f"its decision cannot be applied: {_why(exc)}")
            return
        await self._act(
            request, durable, lambda i, d: self.hooks.resume(i, d, request.by), decision
        )

    async def _act(
        self,
        request: LoopRequest,
        durable: Durable,
        act: Callable[[str, _A], None],
        argument: _A,
    ) -> None:
        """Apply the request (`act`, the runtime's call), its id carried by the
        loop's journal first: the commits the call leads to, made after it,
        mark it applied. A call the runtime refuses refuses the request."""
        durable.carry(request.id)
        self._applying[request.id] = (request.loop_id, durable)
        try:
            act(request.loop_id, argument)
        except AgentFSMError as exc:
            durable.requests.remove(request.id)
            del self._applying[request.id]
            await self._refuse(request, _why(exc))
            return
        _log.info(
            "request_applied",
            loop_id=request.loop_id,
            request=request.id,
            kind=request.kind,
            by=request.by,
        )

    async def _fork(self, request: LoopRequest) -> None:
        """Start the fork a request asks for, if this runtime can (see
        `Hooks.fork`); refuse one that can never work."""
        start = self.hooks.fork
        if start is None:
            return
        try:
            started = await start(request)
        except Refused as exc:
            await self._refuse(request, str(exc))
            return
        if started is None:
            return
        self._applying[request.id] = started
        _log.info(
            "request_applied",
            loop_id=request.loop_id,
            request=request.id,
            kind=request.kind,
            by=request.by,
            fork=started[0],
        )

    def _decision(self, loop: Loop, data: DecisionRecord | None) -> Decision:
        """A request's decision as the loop takes it (as a stored record's is
        rebuilt: `_loop.snapshot`)."""
        if data is None:
            return Proceed()
        bindings = self.keeper.bindings
        decision = stored_decision(loop.snapshot(), loop.input.context, bindings, data)
        return _with_paused_images(loop, decision)

    async def _refuse(self, request: LoopRequest, note: str) -> None:
        _log.info(
            "request_refused", loop_id=request.loop_id, request=request.id, note=note
        )
        try:
            await self.store.refuse_request(request.id, note)
        except Exception as exc:  # noqa: BLE001 - logged; refused again next poll
            _log.error("request_refuse_failed", request=request.id, error=_why(exc))


def _with_paused_images(loop: Loop, decision: Decision) -> Decision:
    """A rewrite of the paused message whose images are references (`agentfsm
    ui` stores no copy of their bytes) with the paused message's own blocks.

    Raises:
        ValueError: a reference to no image of the paused message.
    """
    payload = getattr(decision, "payload", None)
    paused = loop.paused
    if not isinstance(payload, UserMessage) or paused is None:
        return decision
    if not any(b.is_reference for b in payload.images):
        return decision
    held = paused.pending.payload
    own = {b.digest: b for b in held.images} if isinstance(held, UserMessage) else {}
    blocks: list[TextBlock | ImageBlock] = []
    assert not isinstance(payload.content, str)  # it holds images
    for block in payload.content:
        if isinstance(block, ImageBlock) and block.is_reference:
            found = own.get(block.digest)
            if found is None:
                raise ValueError(f"{block.reference} is no image of the paused message")
            block = found
        blocks.append(block)
    assert isinstance(decision, Rewrite)
    return decision.model_copy(update={"payload": UserMessage(content=blocks)})


def _why(exc: Exception) -> str:
    """An error for a log line or a note: its text, its type when that is not
    the store's or the library's own."""
    text = error_text(exc)
    return text if isinstance(exc, AgentFSMError) else f"{type(exc).__name__}: {text}"
