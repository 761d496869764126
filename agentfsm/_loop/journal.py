"""The journal: the one seam through which a durable loop's runtime keeps it in
a store (`agentfsm._durable.writer.Durable` implements it).

The loop calls it from two places only: the driver (each committed transition,
each state's end, the loop's pause and end) and the tool-call runner (before a
call starts, after it ended). A loop without a store has no journal
(`loop.journal` is None) and pays one `is None` check at each of those places.

A journal may stop the loop in this process: when a write fails, or it finds
that another runtime took the loop (its lease is stale), it raises `Halted`
(at once, or at the next call). The loop then ends nothing, writes nothing
more, and is no longer this runtime's: its store keeps it as of its last
commit, for whoever takes it up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from agentfsm.exceptions import AgentFSMError

if TYPE_CHECKING:
    from agentfsm.messages import FunctionCallOutputItem
    from agentfsm.record import DecisionEntry
    from agentfsm.store import CallRecord, StoreError

    from .batch import PlannedCall
    from .loop import Loop

__all__ = ("Halted", "Journal")


class Halted(AgentFSMError):
    """The loop stopped in this process: its store could not take a write, or
    another runtime took it (`error` says which). Raised by the journal, caught
    by the driver."""

    def __init__(self, error: StoreError) -> None:
        super().__init__(str(error))
        self.error = error


class Journal(Protocol):
    """What a durable loop tells its store, and what the store tells it."""

    fencing_token: int | None
    """The epoch of the loop's lease (`ToolCallContext.fencing_token`)."""

    def check(self) -> None:
        """Raise `Halted` if a write the loop did not wait for failed, or its
        lease was found lost."""

    async def act(self) -> None:
        """Return once the loop's lease is known to be this runtime's: a side
        effect follows that no commit comes before (a recovered loop running
        the state it had entered again, a model request retried).

        Raises:
            Halted: it is not (or a write failed).
        """

    async def write_commit(self, loop: Loop) -> None:
        """A transition was committed (the state it entered has not run): write
        it, or keep it for the next write. Before a state with side effects,
        make sure the loop's lease is still this runtime's."""

    async def take_state_output(self, loop: Loop) -> None:
        """The state entered ran: take what it produced (a model output)."""

    async def ending(self, loop: Loop) -> None:
        """The loop is about to take its edge to `idle`."""

    async def save(self, loop: Loop) -> None:
        """Write the loop as it is now (paused, resumed, ended): return once it
        landed.

        Raises:
            Halted: it did not.
        """

    def store_decision(self, entry: DecisionEntry) -> None:
        """A decision about the loop's next transition, written with its commit."""

    def store_queued(self, loop: Loop) -> None:
        """A message was queued for the paused loop: store it with its record."""

    def closing(self, loop: Loop) -> None:
        """The runtime closes while the loop runs (it stops here, and is taken
        up from its store later): queue what the loop knows that its store
        does not yet (its calls' outputs, a model's output) for the runtime's
        last writes."""

    async def begin_call(self, loop: Loop, planned: PlannedCall) -> CallRecord:
        """The call is about to run: its ledger entry (`done` when it ran
        already: never run it again; else its key is the idempotency key).

        Raises:
            Halted: the call must not start (the lease is lost, a write failed).
        """
        ...

    async def end_call(
        self, loop: Loop, key: str, output: FunctionCallOutputItem, terminate: bool
    ) -> None:
        """The call ended: record its output."""
