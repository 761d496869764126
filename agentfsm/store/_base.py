"""What a durable store keeps, and the interfaces a store implements, one per
concern.

A store holds, per loop:

- the loop's record (`agentfsm.record.LoopRecord`) at each committed transition,
  the latest one and every earlier one by its `seq` (for fork);
- the context items, append-only, by position: a commit writes only the items
  added since the last one (and the one slot an edited answer replaced), so a
  commit costs the same whatever the context's size;
- each model request's output, by request number (a recovered loop never sends
  a request whose output was recorded);
- the tool-call ledger: an entry before each call starts and one when it ends
  (or when a decision settles it), keyed by the call's idempotency key;
- the decisions about its transitions (`DecisionEntry`: who, what, when);
- a lease: which runtime owns the loop, until when, and its epoch;
- the events its loops publish, for a store made to keep them.

Every write is a `Commit`, one transaction, and is *fenced*: it carries the
writer's `Lease` (owner and epoch) and is refused (`LeaseLostError`) unless
the loop's row still names that owner and epoch and the loop has not ended.
The epoch grows each time the loop is taken (`acquire`), so a runtime that
stalled past its lease and woke up can write nothing more once another runtime
took the loop, even after that one finished it; and an ended loop is never
taken again.

The interfaces, by concern: `CommitLog` (the writes and the records),
`Ledger` (the calls and the decisions), `Leases`, `EventArchive` (a store that
keeps events), `SharedContexts` (contexts kept for Temporal's workers),
`Requests` (the decision inbox: what people asked of loops, from another
process, for the runtime holding each loop to apply). `LoopStore` is what
`Runtime(store=...)` needs: the first three.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import TracebackType
from typing import Final, Literal, Self, TypeAlias

from pydantic import BaseModel, ConfigDict, ValidationError

from agentfsm._arguments import (
    ArgumentTypeError,
    ArgumentValueError,
    check,
    given,
    one_of,
)
from agentfsm._models import read_fields_fast
from agentfsm._text import encodable, encodable_data
from agentfsm.events import AgentEvent
from agentfsm.exceptions import (
    ConfigurationError,
    LeaseLostError,
    LoopDetachedError,
    LoopIdTakenError,
    LoopLockedError,
    LoopStateError,
    StoreError,
    StoreSchemaError,
    UnknownLoopError,
)
from agentfsm.inference import InferenceInput, InferenceOutput
from agentfsm.interception import Abort, Proceed, Rewrite, ToolBatch
from agentfsm.messages import (
    ContextItem,
    ContextItemAdapter,
    FunctionCallOutputItem,
    TokenUsage,
)
from agentfsm.record import (
    DecisionEntry,
    DecisionRecord,
    LoopRecord,
    MessagesRecord,
    PayloadRecord,
    RequestRecord,
)
from agentfsm.results import LoopStatus, PathStep
from agentfsm.states import LoopState, Outcome

__all__ = (
    "CallRecord",
    "Commit",
    "CommitLog",
    "EventArchive",
    "Lease",
    "LeaseLostError",
    "Leases",
    "Ledger",
    "LoopDetachedError",
    "LoopIdTakenError",
    "LoopLockedError",
    "LoopRequest",
    "LoopStore",
    "RequestNotices",
    "Requests",
    "SharedContexts",
    "StoreError",
    "StoreSchemaError",
    "StoreStatistics",
    "StoredLoop",
    "StoredLoopSummary",
    "UnreadableLoop",
)


@dataclass(frozen=True, slots=True)
class Lease:
    """A runtime's hold on one loop: the fencing token every write carries."""

    owner: str
    """The runtime holding it (`host:pid:random`, one per runtime)."""
    epoch: int
    """Grows each time the loop is taken (1 for a new loop's first commit):
    a write with an older epoch is refused. Tools read it as
    `current_call().fencing_token`, to pass to systems that can check it."""


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
    status: Literal["started", "done", "uncertain", "retry"]
    """`started`: the call was about to start, with no output recorded (in
    flight, or the process died during the call). `uncertain`: a recovery
    paused the loop over it, and the decision that resumes it says what
    happens. `retry`: that decision was to run it again, and it has not
    started since (a recovery then runs it, without asking again). `done`:
    its output is recorded (the tool's, or a decision's)."""
    attempt: int = 1
    """How many times it was started (0: settled by a decision, never run)."""
    output: FunctionCallOutputItem | None = None
    terminate: bool = False
    """Whether the tool asked to end the loop (`ToolResult(terminate=True)`)."""
    by: str | None = None
    """Who settled it, when a decision did (answered or denied it) rather than
    the tool: the decision's `by`, or the handler's name."""


class LoopRequest(BaseModel):
    """What a person asked of a loop, from any process (`agentfsm ui`, a
    script): stored by `Requests.submit_request`, applied once by the runtime
    that holds the loop (`Runtime(requests=True)`), in the transaction of the
    commit the action produced.

    Its text (`by`, `reason`, `note`, ids) is the store's as written:
    untrusted, to be made `printable` before it reaches a terminal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: int
    """Given by the store: a later request has a greater id."""
    loop_id: str
    kind: Literal["resume", "cancel", "fork"]
    """`resume`: answer the loop's pause (`Runtime.resume`); `cancel`: end the
    loop `cancelled` (`Runtime.cancel`); `fork`: start a new loop from the
    loop's first model request at or after `seq` (`agentfsm.replay.fork`), in
    any watching runtime that has its tools."""
    decision: DecisionRecord | None
    """A resume's decision (`proceed`, `rewrite` or `abort`, as data); None
    for a cancel, or a resume that proceeds."""
    seq: int | None
    """The seq of the pause a resume answers (`PendingTransition.seq`, a
    stored record's `pause.seq`): refused when the loop is not paused there
    (it moved on, or paused again); None for a cancel. A fork's: where it
    forks (the first model request at or after it)."""
    by: str
    """Who asked: the `DecisionEntry.by` of the decision it makes."""
    reason: str | None = None
    """A cancel's reason (the loop's result carries it); with a resume, the
    asker's words, kept with the request only."""
    created_at: datetime
    """When it was stored, on the store's clock."""
    status: Literal["pending", "applied", "refused"] = "pending"
    """`pending`: no runtime has applied it (none holds the loop, or none
    watches the store); `applied`: a commit of the loop took it, in the same
    transaction; `refused`: it cannot be applied (`note` says why)."""
    resolved_at: datetime | None = None
    """When it was applied or refused."""
    note: str | None = None
    """Why it was refused (`loop ... is paused at seq 9, not at seq 7`)."""
    model: str | None = None
    """A fork's model (None: the recorded one); None for other kinds."""


RequestNotices: TypeAlias = AbstractAsyncContextManager[Callable[[], Awaitable[None]]]
"""What `Requests.request_notices` gives: entered, a function that returns once
a request may have been submitted (from any process)."""


@dataclass(slots=True)
class Commit:
    """One write of one loop, in one transaction: a committed transition (its
    record, with what the loop gained since the last write), or news of the
    ledger, a model output or events alone (`record` None). Not changed once
    made. (Not a frozen dataclass: setting its 18 fields through
    `object.__setattr__` cost ~20,000 instructions a commit.)"""

    loop_id: str
    lease: Lease
    """Refused unless the loop's row holds this owner and epoch, and the loop
    has not ended (`new`: the row is made, with epoch 1)."""
    record: LoopRecord | None = None
    """The record of the transition committed; its `path` is left empty (a
    copy of the whole path at every commit would make a loop's cost grow with
    its length): `path_length` says how long it is, `steps` what is new."""
    path_length: int = 0
    steps: Sequence[PathStep] = ()
    """The loop's path from `path_from` on: the steps taken since the last
    commit with a record of the same lease (its whole path, `path_from` 0, in
    the first: what a lease's records share is written then too)."""
    path_from: int = 0
    first: int = 0
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
    earlier: Sequence[tuple[LoopRecord, int]] = ()
    """Records of earlier transitions not written yet (into states with no
    side effects: `context_update`, `model_message`), oldest first, each with
    its path's length (its path is left empty: it is the start of this
    commit's)."""
    ledger: Sequence[CallRecord] = ()
    """Ledger entries: each is what the ledger holds for its key from now on."""
    events: Sequence[AgentEvent] = ()
    """The loop's events since the last commit, in order (a store that keeps
    events)."""
    decisions: Sequence[DecisionEntry] = ()
    """Decisions made since the last commit, in order."""
    new: bool = False
    """The first commit of a loop `run_loop` made: the store holds no loop of
    its id (else it refuses the commit: `LoopIdTakenError`)."""
    large: bool = False
    """It may carry a string over 64 KiB or an image's bytes: a SQL store
    writes each such string, and each image, once, out of line
    (`store._outline`)."""
    requests: Sequence[int] = ()
    """Ids of the loop's requests (`LoopRequest`) this commit applies: marked
    `applied` in its transaction, those still pending (a commit refused marks
    none)."""

    @property
    def builds_on(self) -> bool:
        """Whether a later commit of the loop depends on this one having landed
        (it carries context items, records, ledger entries, events or
        decisions a later one does not write again); a commit of the record
        alone (a message queued for a paused loop) does not."""
        return bool(
            self.items
            or self.replaced
            or self.truncate
            or self.inference
            or self.earlier
            or self.ledger
            or self.events
            or self.decisions
            or self.new
        )


@dataclass(frozen=True, slots=True)
class StoredLoop:
    """A loop as the store holds it: its latest record and its context."""

    record: LoopRecord
    items: list[ContextItem]
    owner: str | None
    """The runtime holding its lease (None: nobody, or an expired lease)."""
    epoch: int = 0
    """Its lease's epoch (see `Lease`)."""
    last_event: int = 0
    """The seq of its last kept event (0: none kept): a loop taken up again
    numbers its events on from past it, and past its record's seq."""


class StoredLoopSummary(BaseModel):
    """One loop of a store, in a line (`SQLiteStore.loops`, what `agentfsm
    loops` lists): where it is, what it cost, why it waits, who runs it.

    Its text (ids, reasons, tool names) is the store's as written: untrusted,
    to be made `printable` before it reaches a terminal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    loop_id: str
    agent_id: str
    status: LoopStatus
    state: LoopState
    """The state of its latest committed transition."""
    outcome: Outcome | None = None
    """How it ended (None: not ended)."""
    reason: str | None = None
    """Why it ended so (a stop condition's verdict, a cancel's reason)."""
    error: str | None = None
    """A failed loop's error, as `type: message`."""
    model_requests: int
    tool_calls: int
    usage: TokenUsage
    started_at: datetime
    ended_at: datetime | None = None
    status_since: datetime | None = None
    """When its status last changed (it was started, paused, resumed, taken
    up by a runtime, ended), on the store's clock; None where the store does
    not say."""
    pause_reason: str | None = None
    """A paused loop's reason (the handler's, or a recovery's)."""
    pending_calls: tuple[str, ...] = ()
    """A paused loop's calls waiting for the decision, by tool name: those
    awaiting approval, else those of its batch neither denied nor answered."""
    owner: str | None = None
    """The runtime that last took its lease (`host:pid:random`; None: given
    up, as a runtime does at exit)."""
    lease_until: datetime | None = None
    """When that lease expires unless renewed (None: no lease, as for a loop
    that has ended)."""
    lease_live: bool = False
    """Whether the lease had not expired when the store was read (on the
    store's clock)."""

    @classmethod
    def of(
        cls,
        record: LoopRecord,
        *,
        owner: str | None,
        lease_until: float,
        lease_live: bool,
        status_since: float | None,
    ) -> StoredLoopSummary:
        """A loop's summary from its latest record (its path unused) and its
        lease (times as seconds since the epoch; `lease_until` 0: none)."""
        pause = record.pause
        pending: tuple[str, ...] = ()
        if pause is not None and isinstance(pause.payload, ToolBatch):
            batch = pause.payload
            waiting = set(batch.awaiting_approval) or {
                c.call_id
                for c in batch.calls
                if c.call_id not in batch.denied and c.call_id not in batch.outputs
            }
            pending = tuple(c.name for c in batch.calls if c.call_id in waiting)
        error = record.error
        if record.status is LoopStatus.done:
            lease_until, lease_live = 0, False  # (never taken again)
        return cls(
            loop_id=record.loop_id,
            agent_id=record.agent_id,
            status=record.status,
            state=record.state,
            outcome=record.outcome,
            reason=record.reason,
            error=None if error is None else f"{error.type}: {error.message}",
            model_requests=record.model_requests,
            tool_calls=record.tool_calls,
            usage=record.usage,
            started_at=record.started_at,
            ended_at=record.ended_at,
            status_since=_utc(status_since),
            pause_reason=None if pause is None else pause.reason,
            pending_calls=pending,
            owner=owner,
            lease_until=_utc(lease_until) if lease_until else None,
            lease_live=bool(owner is not None and lease_live),
        )


class UnreadableLoop(BaseModel):
    """A loop of a store whose stored data cannot be read (`loops(...,
    unreadable=[])` lists it here rather than failing the whole listing)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    loop_id: str
    reason: str
    """Why: the store's error (without the store's name), saying what could
    not be decoded."""


def _utc(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def loops_wanted(status: object, agent_id: object) -> LoopStatus | None:
    """`loops`' filters, checked: the status as a `LoopStatus`.

    Raises:
        ArgumentTypeError: `agent_id` not a str, `status` neither.
        ArgumentValueError: `status` not a status's name.
    """
    if agent_id is not None:
        check("agent_id", agent_id, str)
    if status is None:
        return None
    check("status", status, str)
    assert isinstance(status, str)
    try:
        return LoopStatus(status)
    except ValueError:
        names = ", ".join(s.value for s in LoopStatus)
        raise ArgumentValueError(
            f"status must be one of {names}, got {status!r}"
        ) from None


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """What a store has written since it was opened."""

    commits: int
    """Write transactions: commits, leases."""
    bytes_written: int
    """Bytes of row data (JSON text) written."""


async def run_commits(
    commits: Sequence[Commit], write: Callable[[Commit], Awaitable[None]]
) -> list[Exception | None]:
    """`CommitLog.commit_many` by `write` (one commit at a time, awaited)."""
    turns = _Turns()
    for commit in commits:
        if turns.runs(commit):
            try:
                await write(commit)
            except Exception as exc:  # noqa: BLE001 - handed to its loop
                turns.failed(commit, exc)
    return turns.errors


def commits_in_turn(
    commits: Sequence[Commit], write: Callable[[Commit], None]
) -> list[Exception | None]:
    """`CommitLog.commit_many` in a SQL store's thread: `write` (one commit's
    transaction) for each in turn."""
    turns = _Turns()
    for commit in commits:
        if turns.runs(commit):
            try:
                write(commit)
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
        error = self._failed.get(commit.loop_id)
        self.errors.append(error)
        return error is None

    def failed(self, commit: Commit, error: Exception) -> None:
        self.errors[-1] = error
        if commit.builds_on:
            self._failed[commit.loop_id] = error


_PRESENT: set[str] = set()
"""The owners (runtimes) of this process that hold their presence in a store:
alive, whatever a store's own check would say (a lock of this process's may
not conflict with another of its own)."""


class CommitLog(ABC):
    """A loop's writes, and its records read back."""

    keeps_events: bool = False
    """Whether the store keeps the events its runtime's loops publish (then it
    is an `EventArchive`, and `Runtime.watch` resumes a stream from a seq)."""

    @abstractmethod
    async def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        """Write several commits, in order, each its own transaction; return
        what each raised (None: it landed). A commit after a failed one of the
        same loop that `builds_on` is not written: it fails with the same
        error (it would leave a gap).

        The errors a commit may fail with: `LeaseLostError` (its lease is
        stale), `LoopIdTakenError` (a new loop's id is taken), `StoreError`
        (the store could not write it: the message says why)."""

    async def commit(self, commit: Commit) -> None:
        """Write one commit (see `commit_many`)."""
        (error,) = await self.commit_many([commit])
        if error is not None:
            raise error

    @abstractmethod
    async def load(self, loop_id: str) -> StoredLoop | None:
        """The loop's latest record and its context, or None.

        Raises:
            StoreError: the loop's stored data cannot be read (the message
                names the loop and the cause).
        """

    @abstractmethod
    async def record_at(self, loop_id: str, seq: int) -> LoopRecord | None:
        """The loop's record as committed at `seq` (the latest at or before it)."""

    @abstractmethod
    async def unfinished(self) -> list[str]:
        """The ids of loops not done (running or paused when last written)."""

    @abstractmethod
    async def inference(self, loop_id: str, request: int) -> InferenceOutput | None:
        """The recorded output of the loop's `request`-th model request."""


class Ledger(ABC):
    """The tool-call ledger and the decisions, read back (they are written with
    commits)."""

    @abstractmethod
    async def calls(self, loop_id: str, request: int | None = None) -> list[CallRecord]:
        """The ledger's entries for the calls of one model request (all the
        loop's, `request` None), in order."""

    @abstractmethod
    async def decisions(self, loop_id: str) -> list[DecisionEntry]:
        """The decisions about the loop's transitions, in the order made."""


class Leases(ABC):
    """Which runtime owns a loop: one at a time, fenced by epochs."""

    lease_ttl: float = 30.0
    """Seconds a lease lasts unless renewed (a runtime renews its leases every
    third of it, and gives them up when it exits)."""
    presence_lapses: int = 0
    """How many times this process's presence lapsed and was taken again (a
    PostgreSQL connection that broke: its locks went with it, and meanwhile
    another runtime may have judged this one dead and taken its loops). A
    lease renewed before a lapse is asked of the store again before the next
    side effect."""

    @abstractmethod
    async def acquire(
        self, loop_id: str, owner: str, *, replacing: str | None = None
    ) -> Lease:
        """Take the loop's lease, with a new epoch; `replacing` takes it from
        that owner before its lease expires (one known to be dead: `alive`).

        Raises:
            LoopLockedError: another runtime holds a live lease on it.
            StoreError: the store holds no such loop, or the loop has ended
                (an ended loop is never taken again).
        """

    @abstractmethod
    async def renew(
        self, owner: str, loop_ids: Sequence[str] | None = None
    ) -> dict[str, int]:
        """Extend the leases `owner` holds on unfinished loops (all, or those of
        `loop_ids`) by `lease_ttl` from now; return the loops renewed, with
        their epochs (a loop `owner` lost is not among them)."""

    @abstractmethod
    async def release(
        self,
        owner: str,
        loop_ids: Sequence[str] | None = None,
        *,
        epochs: Mapping[str, int] | None = None,
    ) -> None:
        """Give up the leases `owner` holds (all, or those of `loop_ids`); of a
        loop in `epochs`, only the lease of that epoch (one taken again since,
        by `owner` too, is left as it is)."""

    async def hold_presence(self, owner: str) -> None:
        """`owner` (a runtime) is alive until `drop_presence`: a store that can
        tell (`alive`) holds something only a live process can hold."""
        _PRESENT.add(owner)

    async def drop_presence(self, owner: str) -> None:
        _PRESENT.discard(owner)

    async def alive(self, owner: str) -> bool | None:
        """Whether `owner` is alive: True, False (certainly dead: its lease may
        be taken before it expires), or None (unknown: it is waited out)."""
        return True if owner in _PRESENT else None


class EventArchive(ABC):
    """The events a runtime's loops published (a store with `keeps_events`)."""

    @abstractmethod
    async def events(self, loop_id: str, after_seq: int = 0) -> list[AgentEvent]:
        """The loop's kept events with a seq above `after_seq`, in order (none
        is missing: they are written with the loop's commits).

        Raises:
            StoreError: the store was not made to keep events.
        """

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


class SharedContexts(ABC):
    """Contexts kept by id for any process to read (`agentfsm.temporal`'s
    `StoreContexts` keeps a workflow's context here, for any worker)."""

    @abstractmethod
    async def context(
        self, context_id: str
    ) -> tuple[list[ContextItem], list[str]] | None:
        """A context kept by `append_context`: its items and the digest kept
        with each."""

    @abstractmethod
    async def append_context(
        self,
        context_id: str,
        first: int,
        items: Sequence[ContextItem],
        digests: Sequence[str],
    ) -> None:
        """Write `items` (with their digests) from position `first` on, dropping
        what the context held from there: one transaction."""


def context_appended(
    context_id: object, first: object, items: object, digests: object
) -> list[ContextItem]:
    """What `append_context` writes, checked before anything is: the items
    validated again (one built without validation may hold anything, and a
    store must read back what it wrote), as many digests as items.

    Raises:
        ArgumentTypeError: an argument of another type (naming it).
        ArgumentValueError: `first` negative, or digests and items unpaired.
    """
    check("context_id", context_id, str)
    check("first", first, int)
    assert isinstance(first, int)
    if first < 0:
        raise ArgumentValueError(f"first must be >= 0, got {first}")
    for name, given_ in (("items", items), ("digests", digests)):
        if isinstance(given_, str | bytes) or not isinstance(given_, Sequence):
            raise ArgumentTypeError(f"{name} must be a list, got {given(given_)}")
    assert isinstance(items, Sequence)
    assert isinstance(digests, Sequence)
    if len(items) != len(digests):
        raise ArgumentValueError(
            f"append_context takes a digest for each item: {len(items)} items, "
            f"{len(digests)} digests"
        )
    for digest in digests:
        check("digests", digest, str, "a list of str")
    checked = []
    for item in items:
        if not isinstance(item, BaseModel):
            raise ArgumentTypeError(f"items must hold context items, got {given(item)}")
        try:
            data = item.model_dump(warnings=False)
            checked.append(ContextItemAdapter.validate_python(data))
        except ValidationError as exc:
            raise ArgumentTypeError(
                f"items holds an item that is not valid: {exc}"
            ) from None
    return checked


class Requests(ABC):
    """The decision inbox: requests to act on a loop, from any process.

    A person acts on a paused or running loop from a process that does not
    hold it (`agentfsm ui`, a script): the action is stored as a
    `LoopRequest`, pending; a runtime that holds the loop and watches the store
    (`Runtime(requests=True)`) applies it, and the commit the action produced
    marks it applied in its own transaction (`Commit.requests`), so it is
    applied once whatever crashes, and by the loop's lease holder only.

    ```python
    async with SQLiteStore("loops.db") as store:
        stored = await store.load(loop_id)
        batch = stored.record.pause.payload  # the calls awaiting approval
        await store.submit_request(
            loop_id,
            "resume",
            decision=Rewrite(payload=batch.deny("c2", "not this one")),
            seq=stored.record.pause.seq,
            by="alice",
        )
    ```
    """

    @abstractmethod
    async def submit_request(
        self,
        loop_id: str,
        kind: Literal["resume", "cancel", "fork"],
        *,
        decision: DecisionRecord | Proceed | Rewrite | Abort | None = None,
        seq: int | None = None,
        by: str,
        reason: str | None = None,
        model: str | None = None,
    ) -> LoopRequest:
        """Store a request, pending, for the runtime holding the loop to apply.

        Args:
            loop_id: the loop.
            kind: `"resume"` (answer its pause), `"cancel"`, or `"fork"`
                (a new loop from it at `seq`, with `model`: any watching
                runtime with its tools applies it; an ended loop takes it).
            decision: a resume's decision: `Proceed`, `Rewrite` (its payload
                a `ToolBatch` with calls denied, answered or approved, a user
                message, a model message) or `Abort`, or the same as a
                `DecisionRecord`; None proceeds. A cancel takes none.
            seq: the seq of the pause a resume answers (a stored record's
                `pause.seq`); required for a resume, none for a cancel.
            by: who asks (a non-empty str): the decision's `by` in the audit.
            reason: a cancel's reason; with a resume, kept with the request.
            model: a fork's model (None: the recorded one); only a fork's.

        Returns:
            The request as stored (its id, `created_at`).

        Raises:
            UnknownLoopError: the store holds no such loop.
            LoopStateError: the loop has ended (but for a fork).
            ArgumentTypeError, ArgumentValueError: an argument that does not
                fit (the message names it).
            StoreError: the store could not take it (read-only, say).
        """

    @abstractmethod
    async def requests(
        self,
        loop_id: str | None = None,
        *,
        status: Literal["pending", "applied", "refused"] | None = None,
    ) -> list[LoopRequest]:
        """The requests of one loop (all loops', `loop_id` None), of one
        `status` if given, oldest first."""

    @abstractmethod
    async def pending_requests(self, after_id: int = 0) -> list[LoopRequest]:
        """The pending requests with an id above `after_id`, oldest first: one
        indexed read (what a watching runtime asks at each poll)."""

    @abstractmethod
    async def refuse_request(self, request_id: int, note: str) -> bool:
        """Mark a pending request refused, saying why (`note`), and return True;
        a request not pending (applied or refused meanwhile, or unknown) is
        left as it is: False. A request refused after a runtime read it is
        withdrawn: the commit that would apply it fails (`withdrawn`), and the
        loop stays as its store held it."""

    def request_notices(self) -> RequestNotices | None:
        """A way to learn at once that a request was submitted, from any
        process (PostgreSQL: `LISTEN agentfsm_requests`); None (the default):
        the store has none, and a watching runtime polls alone."""
        return None


def withdrawn(where: str, request_id: int) -> StoreError:
    """The error of a commit that would apply request `request_id`, refused
    since the loop read it."""
    return StoreError(
        f"{where}: request {request_id} was refused (withdrawn) after this "
        "runtime read it: the commit applying it is not written, and the "
        "loop stays as its store holds it"
    )


_REQUEST_KINDS: Final = ("resume", "cancel", "fork")
_REQUEST_STATUSES: Final = ("pending", "applied", "refused")
_RESUMES: Final = ("proceed", "rewrite", "abort")


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request's fields as `submit_request` checked them, to store."""

    loop_id: str
    kind: Literal["resume", "cancel", "fork"]
    decision: DecisionRecord | None
    seq: int | None
    by: str
    reason: str | None
    model: str | None = None


_MAX_BY: Final = 256
"""The most characters of a request's `by`: a person's or a process's name."""


def by_checked(by: object, who: str) -> str:
    """A request's or a stored breakpoint's `by` (who `who`), checked and made
    `encodable`.

    Raises:
        ArgumentTypeError, ArgumentValueError: not a name (a non-empty str of
            at most `_MAX_BY` characters).
    """
    check("by", by, str)
    assert isinstance(by, str)
    if not by.strip():
        raise ArgumentValueError(f"by must name who {who} (a non-empty str), got ''")
    if len(by) > _MAX_BY:
        raise ArgumentValueError(
            f"by must be at most {_MAX_BY} characters (a name), got {len(by):,}"
        )
    return encodable(by)


def request_checked(
    loop_id: object,
    kind: object,
    decision: object,
    seq: object,
    by: object,
    reason: object,
    model: object = None,
) -> NewRequest:
    """`submit_request`'s arguments, checked, its decision as data, its text
    made `encodable` (before anything is stored).

    Raises:
        ArgumentTypeError, ArgumentValueError: an argument that does not fit.
    """
    check("loop_id", loop_id, str)
    one_of("kind", kind, _REQUEST_KINDS)
    check("reason", reason, str | None)
    check("seq", seq, int | None)
    check("model", model, str | None)
    assert isinstance(loop_id, str)
    assert isinstance(kind, str)
    assert reason is None or isinstance(reason, str)
    by = by_checked(by, "asks")
    if model is not None and kind != "fork":
        raise ArgumentValueError(f"only a fork request takes a model, not a {kind}")
    if kind == "fork":
        model = _fork_checked(decision, seq, model)
        record = None
    elif kind == "cancel":
        if decision is not None or seq is not None:
            raise ArgumentValueError(
                "a cancel request takes no decision and no seq (it cancels the "
                "loop wherever it is)"
            )
        record = None
    else:
        if seq is None:
            raise ArgumentValueError(
                "a resume request names the pause it answers: seq=<the pause's "
                "seq> (a stored record's pause.seq)"
            )
        assert isinstance(seq, int)
        if not 0 <= seq < 2**63:  # (a SQL store's integer column)
            raise ArgumentValueError(
                f"seq must be >= 0 and below 2**63 (a pause's seq), got {seq}"
            )
        record = _decision_data(decision)
    return NewRequest(
        loop_id,
        "resume" if kind == "resume" else "cancel" if kind == "cancel" else "fork",
        record,
        seq if isinstance(seq, int) else None,
        by,
        None if reason is None else encodable(reason),
        model if isinstance(model, str) else None,
    )


def _fork_checked(decision: object, seq: object, model: object) -> str | None:
    """A fork request's seq and model, checked; its model made `encodable`."""
    if decision is not None:
        raise ArgumentValueError("a fork request takes no decision")
    if not isinstance(seq, int) or not 0 <= seq < 2**63:
        raise ArgumentValueError(
            "a fork request names where it forks: seq=<a seq of the loop, >= 0> "
            f"(the first model request at or after it), got {seq!r}"
        )
    if model is None:
        return None
    assert isinstance(model, str)
    if not model.strip() or len(model) > _MAX_BY:
        raise ArgumentValueError(
            f"model must name a model (1 to {_MAX_BY} characters, e.g. "
            f"'openai:gpt-4.1'), got {model[:40]!r}"
        )
    return encodable(model)


def _decision_data(decision: object) -> DecisionRecord | None:
    """A resume's decision as data (validated again: a model built without
    validation may hold anything, and the runtime must read back what a store
    wrote)."""
    if decision is None:
        return None
    if isinstance(decision, Proceed):
        data = DecisionRecord(kind="proceed")
    elif isinstance(decision, Abort):
        data = DecisionRecord(kind="abort", reason=decision.reason)
    elif isinstance(decision, Rewrite):
        given_payload = decision.payload
        if isinstance(given_payload, InferenceInput):
            raise ArgumentValueError(_NO_MODEL_REQUEST)
        payload: PayloadRecord = (
            MessagesRecord(messages=given_payload)
            if isinstance(given_payload, tuple)
            else given_payload
        )
        # Checked below, as a record given as data is.
        data = DecisionRecord.model_construct(
            kind="rewrite", dest=decision.dest, payload=payload
        )
    elif isinstance(decision, DecisionRecord):
        data = decision
    else:
        raise ArgumentTypeError(
            "decision must be Proceed, Rewrite, Abort, a DecisionRecord or None, "
            f"got {given(decision)}"
        )
    if data.kind not in _RESUMES:
        raise ArgumentValueError(
            f"a resume request's decision is proceed, rewrite or abort, got {data.kind}"
        )
    try:
        checked = DecisionRecord.model_validate(
            encodable_data(data.model_dump(warnings=False))
        )
    except ValidationError as exc:
        raise ArgumentTypeError(f"decision is not valid: {exc}") from None
    if isinstance(checked.payload, RequestRecord):
        raise ArgumentValueError(_NO_MODEL_REQUEST)
    return checked


_NO_MODEL_REQUEST: Final = (
    "a request's decision cannot carry a model request (one is read against "
    "the loop's own context and tools): rewrite the calls or the messages instead"
)


def requests_wanted(loop_id: object, status: object) -> None:
    """`requests`' filters, checked.

    Raises:
        ArgumentTypeError, ArgumentValueError: a filter that does not fit.
    """
    check("loop_id", loop_id, str | None)
    if status is not None:
        one_of("status", status, _REQUEST_STATUSES)


def request_id_checked(name: str, value: object) -> int:
    """A request id (or `after_id`) as an int >= 0.

    Raises:
        ArgumentTypeError, ArgumentValueError: it is not one.
    """
    check(name, value, int)
    assert isinstance(value, int)
    if value < 0:
        raise ArgumentValueError(f"{name} must be >= 0, got {value}")
    return value


def note_checked(note: object) -> str:
    """A refusal's note, checked and made `encodable`.

    Raises:
        ArgumentTypeError: it is not a str.
    """
    check("note", note, str)
    assert isinstance(note, str)
    return encodable(note)


def unknown_loop(where: str, loop_id: str) -> UnknownLoopError:
    """The error of a request for a loop the store does not hold."""
    error = UnknownLoopError(loop_id)
    error.args = (f"{where} holds no loop {loop_id!r}",)
    return error


def ended_loop(loop_id: str) -> LoopStateError:
    """The error of a request for a loop that has ended."""
    return LoopStateError(f"loop {loop_id} has ended: no request can act on it")


class LoopStore(CommitLog, Ledger, Leases):
    """Where durable loops live (`Runtime(store=...)`): a commit log, a ledger
    and leases.

    Implementations: `MemoryStore` (one process), `SQLiteStore` (the embedded
    default), `agentfsm.store.postgres.PostgresStore` (several processes); all
    three keep events (when made with `events=True`) and shared contexts too.
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

    async def open(self) -> None:
        """Connect, create or check the layout."""

    async def close(self) -> None:
        """Disconnect."""

    @abstractmethod
    def statistics(self) -> StoreStatistics: ...


@dataclass(slots=True)
class LedgerFold:
    """A loop's ledger as its entries, in the order written, make it: the last
    entry of a key is what the ledger holds for it."""

    calls: dict[str, CallRecord] = field(default_factory=dict)

    def add(self, entry: CallRecord) -> None:
        self.calls[entry.key] = entry

    def of(self, request: int | None) -> list[CallRecord]:
        found = [
            c for c in self.calls.values() if request is None or c.request == request
        ]
        found.sort(key=lambda c: (c.request, c.position))
        return found


read_fields_fast(globals())
