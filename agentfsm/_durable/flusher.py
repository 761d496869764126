"""The runtime's writer of commits: a queue, written in order, many per trip.

Every durable loop hands its commits to its runtime's `Flusher` (`submit`), and
waits for one to land (`wait`) only when what comes next needs it on disk (see
`Durable.committed`). Whoever waits while nothing is being written writes
everything queued, in one `LoopStore.commit_many`: one trip to the store's
worker thread, a transaction per commit. A commit nobody waits for is written
by the flusher's own task (`serve`, a service of the runtime), as soon as the
event loop has a moment: in a real run, while the model's request is in
flight.

What it saves, measured with bench/bench_durable.py (the benchmark workload: 8
commits a run): the loop waits for 3 of them (the intents, before each tool
call) and for its writes as it ends. A commit into `inference` is not waited
for (see `_durable.writer._AHEAD`): a zero-latency model answers before the
flusher's task has had a moment, so the commit shares its trip to the thread
with the next one waited for, the commit into `function_call` that follows or
the loop's end (`Durable.ending`): 4 trips a run instead of 8, ~90 us of a
thread hop each on the benchmark's machine (bench/PERFORMANCE.md, "Four
trips to the store's thread a run", has the figures and what came before).
Tests: tests/test_durable_flusher.py.

The queue is one runtime's, so commits land in the order they were submitted:
a loop's later commit never lands before an earlier one, and none lands after
one of its loop failed, in the same trip (`commit_many`) or a later one.
"""

from __future__ import annotations

from typing import Final

import anyio
import anyio.lowlevel

from agentfsm._errors import error_text
from agentfsm._logging import get_logger
from agentfsm.store import Commit, LoopStore, StoreError

__all__ = ("Flusher", "Ticket")


_log = get_logger()


class Ticket:
    """One commit in the queue; `error` once it failed."""

    __slots__ = ("commit", "error", "landed", "sent")

    def __init__(self, commit: Commit) -> None:
        self.commit: Final = commit
        self.sent = False
        """In a trip to the store (it may have landed)."""
        self.landed = False
        """Written (or failed: then `error` says why)."""
        self.error: Exception | None = None


class Flusher:
    """The queue of one runtime's commits to its store."""

    def __init__(self, store: LoopStore) -> None:
        self.store = store
        self._queue: list[Ticket] = []
        self._writing = False
        """A write is in progress."""
        self._written: anyio.Event | None = None
        """Set when the write in progress ends; made by the first task to wait
        for it (most trips have nobody else waiting: an event a trip cost ~1.4
        µs, 4 trips a benchmark run)."""
        self._wake = anyio.Event()
        """Set when a commit nobody waits for is queued (for `serve`)."""
        self._failed: dict[str, str] = {}
        """Loops a commit of which failed, and why: their later commits are
        not written (they would leave a gap), whichever trip they are in."""

    def forget(self, loop_id: str) -> None:
        """The loop is taken up again (recovered): its commits are written."""
        self._failed.pop(loop_id, None)

    def submit(self, commit: Commit, *, background: bool) -> Ticket:
        """Queue `commit`; `background`: nobody will wait for it soon (the
        flusher's task writes it)."""
        ticket = Ticket(commit)
        self._queue.append(ticket)
        if background:
            self._wake.set()
        return ticket

    async def wait(self, ticket: Ticket) -> None:
        """Return once `ticket` (and every commit queued before it) is written;
        write the queue if nothing is being written. A cancellation cannot
        abandon a write (it is delivered after it)."""
        while not ticket.landed:
            await self._turn()

    async def flush(self) -> None:
        """Write everything queued (the runtime exiting: before its leases go)."""
        while self._queue or self._writing:
            await self._turn()

    async def _turn(self) -> None:
        """Write the queue, or wait for the write in progress to end."""
        if not self._writing:
            await self._write()
            return
        written = self._written
        if written is None:
            written = self._written = anyio.Event()
        await written.wait()

    async def serve(self) -> None:
        """Write the commits nobody waits for (a task of the runtime's, until
        it exits). While a write is in progress it leaves the queue to the
        write's end, which wakes it again if anything is left."""
        self._wake = anyio.Event()  # of this run's event loop
        while True:
            if self._free():
                # An event-loop turn first: a loop that yielded between two
                # commits (the driver's fairness checkpoint, every ~10 ms)
                # comes to the next one it waits for and writes both in one
                # trip (0.13 trips a benchmark run, ~14 µs, were this task's).
                # A commit is written here only if it was queued for a whole
                # turn: this task's turn may come after a loop that never
                # yielded wrote it and queued the next. (trio runs a turn's
                # tasks in a random order: there, some of the time.)
                head = self._queue[0]
                await anyio.lowlevel.checkpoint()
                if self._free():
                    if self._queue[0] is not head:
                        continue  # written meanwhile; a turn for the next
                    await self._write()
            await self._wake.wait()
            self._wake = anyio.Event()

    def _free(self) -> bool:
        """Commits are queued, and none is being written."""
        return not self._writing and bool(self._queue)

    def _failed_commit(self, commit: Commit, error: Exception) -> None:
        loop_id = commit.loop_id
        _log.error(
            "store_write_failed",
            loop_id=loop_id,
            seq=None if commit.record is None else commit.record.seq,
            error=f"{type(error).__name__}: {error_text(error)}",
        )
        if commit.builds_on:
            self._failed.setdefault(loop_id, error_text(error))

    async def _write(self) -> None:
        queued, self._queue = self._queue, []
        failed = self._failed
        batch = []
        for ticket in queued:
            ticket.sent = True
            why = failed.get(ticket.commit.loop_id)
            if why is None:
                batch.append(ticket)
            else:  # after a failed one of its loop: not written
                ticket.error = StoreError(
                    f"not written: an earlier commit of the loop failed ({why})"
                )
                ticket.landed = True
        if not batch:
            return
        self._writing = True
        errors: list[Exception | None]
        try:
            with anyio.CancelScope(shield=True):
                errors = await self.store.commit_many([t.commit for t in batch])
        except Exception as exc:  # noqa: BLE001 - each commit's loop is told
            errors = [exc] * len(batch)
        except BaseException:
            errors = [StoreError("the write was interrupted")] * len(batch)
            raise
        finally:
            for ticket, error in zip(batch, errors, strict=True):
                ticket.error = error
                ticket.landed = True
                if error is not None:
                    self._failed_commit(ticket.commit, error)
            self._writing = False
            written, self._written = self._written, None
            if written is not None:
                written.set()
            if self._queue:
                self._wake.set()  # queued meanwhile: for `serve`, if nobody waits
