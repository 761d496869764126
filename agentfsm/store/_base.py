"""What a durable store keeps, and the interface every store implements.

A store holds, per loop:

- the loop's record (`agentfsm.record.LoopRecord`) at each committed transition,
  the latest one and every earlier one by its `seq` (for fork);
- the context items, append-only, by position: a commit writes only the items
  added since the last one (and the one slot an edited answer replaced), so a
  commit costs the same whatever the context's size;
- each model request's output, by request number (a recovered loop never sends
  a request whose output was recorded);
- the tool-call ledger: an intent before each call starts and its output when
  it ends, keyed by the call's idempotency key;
- a lease: which runtime owns the loop, until when.

Every method is a coroutine; a store is entered (`async with`) by the runtime
that uses it. A write is one transaction: all of it lands, or none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict

from agentfsm.events import AgentEvent
from agentfsm.exceptions import AgentFSMError, ConfigurationError
from agentfsm.inference import InferenceOutput
from agentfsm.messages import ContextItem, FunctionCallOutputItem
from agentfsm.record import LoopRecord

__all__ = (
    "CallRecord",
    "Commit",
    "LoopIdTakenError",
    "LoopLockedError",
    "LoopStore",
    "StoreError",
    "StoreSchemaError",
    "StoreStatistics",
    "StoredLoop",
)


class StoreError(AgentFSMError):
    """A durable store could not be read or written."""


class StoreSchemaError(StoreError):
    """The store was written by another version of agentfsm's store layout."""


class LoopIdTakenError(StoreError):
    """A new loop's id is a loop's the store holds already (an id source,
    `Runtime(ids=...)`, gave it again): the new loop fails, and the store's
    loop is left as it was."""

    def __init__(self, loop_id: str) -> None:
        super().__init__(
            f"loop id {loop_id!r} is a loop's the store holds already: loop ids "
            "must be unique across runtimes and restarts (an id source, "
            "Runtime(ids=...), gave it again)"
        )
        self.loop_id = loop_id


class LoopLockedError(StoreError):
    """Another runtime holds the loop's lease: two runtimes never run one loop."""

    def __init__(self, loop_id: str, owner: str) -> None:
        super().__init__(
            f"loop {loop_id} is owned by another runtime ({owner}); it runs there "
            "until that runtime exits or its lease expires"
        )
        self.loop_id = loop_id
        self.owner = owner


class CallRecord(BaseModel):
    """One tool call in the ledger."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str
    """The idempotency key (`agentfsm.current_call().idempotency_key`)."""
    loop_id: str
    request: int
    """The model request whose output asked for the call (1 is the first)."""
    position: int
    """The call's position in that output's batch."""
    tool: str
    call_id: str
    status: Literal["started", "done", "uncertain"]
    """`started`: the intent is recorded and no output (in flight, or the process
    died during the call). `uncertain`: a recovery paused the loop over it, and
    the decision that resumes it says what happens. `done`: the output is recorded."""
    attempt: int = 1
    output: FunctionCallOutputItem | None = None
    terminate: bool = False
    """Whether the tool asked to end the loop (`ToolResult(terminate=True)`)."""


@dataclass(frozen=True, slots=True)
class Commit:
    """What one committed transition writes, in one transaction."""

    record: LoopRecord
    first: int
    """The position of the first item of `items` in the loop's context."""
    items: Sequence[ContextItem] = ()
    """The items added to the context since the last commit."""
    replaced: Mapping[int, ContextItem] | None = None
    """Earlier items that changed (an answer a handler rewrote), by position."""
    inference: tuple[int, InferenceOutput] | None = None
    """A model request's output not written yet: (request number, output)."""
    truncate: bool = False
    """Drop the stored items from `first` on before writing `items` (the
    context shrank: someone edited it)."""
    earlier: Sequence[LoopRecord] = ()
    """Records of earlier transitions not written yet (into states with no
    side effects: `context_update`, `model_message`), oldest first."""
    intents: Sequence[CallRecord] = ()
    """Ledger intents of the calls the transition into `function_call` starts."""
    ended: Sequence[tuple[str, FunctionCallOutputItem, bool]] = ()
    """Calls ended since the last write: (key, output, terminate)."""
    new: bool = False
    """The first commit of a loop `run_loop` made: the store holds no loop of
    its id (else it refuses the commit: `LoopIdTakenError`)."""

    @property
    def builds_on(self) -> bool:
        """Whether a later commit of the loop depends on this one having landed
        (it carries context items, records or ledger rows a later one does not
        write again); a commit of the record alone (a message queued for a
        paused loop) does not."""
        return bool(
            self.items
            or self.replaced
            or self.truncate
            or self.inference
            or self.earlier
            or self.intents
            or self.ended
        )


async def run_commits(
    commits: Sequence[tuple[Commit, str]],
    write: Callable[[Commit, str], Awaitable[None]],
) -> list[Exception | None]:
    """`LoopStore.commit_many` by `write` (one commit at a time, awaited)."""
    turns = _Turns()
    for commit, owner in commits:
        if turns.runs(commit):
            try:
                await write(commit, owner)
            except Exception as exc:  # noqa: BLE001 - handed to its loop
                turns.failed(commit, exc)
    return turns.errors


def commits_in_turn(
    commits: Sequence[tuple[Commit, str]], write: Callable[[Commit, str], None]
) -> list[Exception | None]:
    """`LoopStore.commit_many` in a SQL store's worker thread: `write` (one
    commit's transaction) for each in turn."""
    turns = _Turns()
    for commit, owner in commits:
        if turns.runs(commit):
            try:
                write(commit, owner)
            except Exception as exc:  # noqa: BLE001 - handed to its loop
                turns.failed(commit, exc)
    return turns.errors


class _Turns:
    """The errors of a trip's commits, and which are not written: one after a
    failed one of its loop that `builds_on` (it would leave a gap) fails with
    the same error."""

    __slots__ = ("_failed", "errors")

    def __init__(self) -> None:
        self.errors: list[Exception | None] = []
        self._failed: dict[str, Exception] = {}

    def runs(self, commit: Commit) -> bool:
        error = self._failed.get(commit.record.loop_id)
        self.errors.append(error)
        return error is None

    def failed(self, commit: Commit, error: Exception) -> None:
        self.errors[-1] = error
        if commit.builds_on:
            self._failed[commit.record.loop_id] = error


def checked_lease_ttl(lease_ttl: object) -> float:
    """`lease_ttl` as a store keeps it (a positive number of seconds).

    Raises:
        ConfigurationError: it is not one.
    """
    if (
        isinstance(lease_ttl, bool)
        or not isinstance(lease_ttl, int | float)
        or lease_ttl <= 0
    ):
        raise ConfigurationError(
            f"lease_ttl must be a positive number of seconds, got {lease_ttl!r}"
        )
    return float(lease_ttl)


@dataclass(frozen=True, slots=True)
class StoredLoop:
    """A loop as the store holds it: its latest record and its context."""

    record: LoopRecord
    items: list[ContextItem]
    owner: str | None
    """The runtime holding its lease (None: nobody, or an expired lease)."""


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """What a store has written since it was opened."""

    commits: int
    """Write transactions: transitions, ledger entries, leases."""
    bytes_written: int
    """Bytes of row data (JSON text) written."""


class LoopStore(ABC):
    """Where durable loops live (`Runtime(store=...)`).

    Implementations: `MemoryStore` (one process), `SQLiteStore` (the embedded
    default), `agentfsm.store.postgres.PostgresStore` (several processes).
    """

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self) -> None:  # noqa: B027 - optional for a store
        """Connect, create or check the layout."""

    async def close(self) -> None:  # noqa: B027 - optional for a store
        """Disconnect."""

    @abstractmethod
    def statistics(self) -> StoreStatistics: ...

    # ---------------------------------------------------------------- loops

    keeps_events: bool = False
    """Whether the store keeps the events its runtime's loops publish (then
    `events` reads them and `Runtime.watch` resumes a stream from a seq)."""

    lease_ttl: float = 30.0
    """Seconds a lease lasts unless renewed (a runtime renews its leases every
    third of it, and gives them up when it exits)."""

    @abstractmethod
    async def commit(self, commit: Commit, owner: str) -> None:
        """Write a committed transition: the record (latest, and kept by seq),
        the new items, and a recorded model output, atomically; `owner` takes
        or renews the loop's lease.

        Raises:
            LoopLockedError: another runtime holds the loop's lease (this one
                lost it: it was not renewed in time).
        """

    async def commit_many(
        self, commits: Sequence[tuple[Commit, str]]
    ) -> list[Exception | None]:
        """Write several commits (each with its owner), in order, each its own
        transaction; return what each raised (None: it landed). A commit after
        a failed one of the same loop is not written: it fails with the same
        error (it would leave a gap: it writes the items from where the failed
        one ended).

        The runtime's writer (`agentfsm._durable.flusher`) hands a store every
        commit waiting to be written at once; the SQL stores write them in one
        trip to their worker thread. This default writes them one by one.
        """
        return await run_commits(commits, self.commit)

    @abstractmethod
    async def load(self, loop_id: str) -> StoredLoop | None:
        """The loop's latest record and its context, or None."""

    @abstractmethod
    async def record_at(self, loop_id: str, seq: int) -> LoopRecord | None:
        """The loop's record as committed at `seq` (the latest at or before it)."""

    @abstractmethod
    async def unfinished(self) -> list[str]:
        """The ids of loops not done (running or paused when last written)."""

    @abstractmethod
    async def record_inference(
        self, loop_id: str, request: int, output: InferenceOutput
    ) -> None:
        """Write a model request's output ahead of the next commit (a loop whose
        handlers will decide about it first: they may take a while)."""

    @abstractmethod
    async def inference(self, loop_id: str, request: int) -> InferenceOutput | None:
        """The recorded output of the loop's `request`-th model request."""

    # ---------------------------------------------------------------- events

    async def append_events(self, events: Sequence[AgentEvent]) -> None:
        """Keep published events (a store with `keeps_events`)."""
        raise StoreError(f"{type(self).__name__} keeps no events")

    async def events(self, loop_id: str, after_seq: int = 0) -> list[AgentEvent]:
        """The loop's kept events with a seq above `after_seq`, in order."""
        raise StoreError(f"{type(self).__name__} keeps no events")

    async def loop_events(self, loop_id: str | None) -> list[AgentEvent]:
        """The loop's events, for `agentfsm.replay.replay` and `fork` (a store
        is a `ReplaySource` when it keeps events).

        Raises:
            ConfigurationError: no loop named, or none of its events kept.
        """
        if loop_id is None:
            raise ConfigurationError("a store holds many loops: name one (loop_id=...)")
        events = await self.events(loop_id)
        if not events:
            raise ConfigurationError(f"the store keeps no events of loop {loop_id}")
        return events

    # ------------------------------------------------------- shared contexts

    async def context(
        self, context_id: str
    ) -> tuple[list[ContextItem], list[str]] | None:
        """A context kept by `append_context`: its items and the digest kept
        with each (`agentfsm.temporal.StoreContexts` keeps a workflow's
        context here, for any worker to read)."""
        raise StoreError(f"{type(self).__name__} keeps no shared contexts")

    async def append_context(
        self,
        context_id: str,
        first: int,
        items: Sequence[ContextItem],
        digests: Sequence[str],
    ) -> None:
        """Write `items` (with their digests) from position `first` on, dropping
        what the context held from there: one transaction."""
        raise StoreError(f"{type(self).__name__} keeps no shared contexts")

    # ---------------------------------------------------------------- ledger

    @abstractmethod
    async def calls(self, loop_id: str, request: int) -> list[CallRecord]:
        """The ledger's entries for the calls of one model request."""

    @abstractmethod
    async def begin_call(self, call: CallRecord) -> CallRecord:
        """Record the intent to run a call (status `started`) and return it; if
        the key is in the ledger already, return what it holds unchanged, except
        a `started` or `uncertain` entry, which is taken as a new attempt.

        The runtime writes a loop's ledger once its first commit has landed; a
        store may refuse a ledger write for a loop it does not hold
        (`SQLiteStore` does, with a `StoreError` naming it)."""

    @abstractmethod
    async def end_call(
        self, loop_id: str, key: str, output: FunctionCallOutputItem, terminate: bool
    ) -> None:
        """Record the output of a call of the loop (status `done`)."""

    @abstractmethod
    async def mark_uncertain(self, loop_id: str, keys: Sequence[str]) -> None:
        """Mark the loop's in-flight calls `uncertain`: a recovery paused it."""

    # ---------------------------------------------------------------- leases

    @abstractmethod
    async def acquire(
        self, loop_id: str, owner: str, *, replacing: str | None = None
    ) -> str | None:
        """Take the loop's lease; None if taken (or renewed), else the owner
        holding it. `replacing` takes it from that owner even before its lease
        expires (an owner known to be dead: its process is gone)."""

    @abstractmethod
    async def renew(self, owner: str) -> None:
        """Extend every lease `owner` holds by `lease_ttl` from now."""

    @abstractmethod
    async def release(self, owner: str, loop_ids: Sequence[str] | None = None) -> None:
        """Give up the leases `owner` holds (all, or those of `loop_ids`)."""
