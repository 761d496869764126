"""Stored breakpoints: breakpoints set in the store, from any process
(`agentfsm ui`, a script), which every runtime watching the store meets
(`Runtime(requests=True)` syncs its `Runtime.breakpoints` with them).

A stored breakpoint pauses the loops it applies to before they enter a state
(or before every transition: step mode), as a `Break` given in code does; it
applies to one loop or to one agent's loops, and stays until it is removed
(`remove_breakpoint`), which is kept too: who set it, who removed it, when.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from pydantic import BaseModel, ConfigDict

from agentfsm._arguments import ArgumentValueError, check
from agentfsm._models import read_fields_fast
from agentfsm._text import encodable
from agentfsm.exceptions import LoopStateError
from agentfsm.states import LoopState

from ._base import by_checked

__all__ = (
    "NewBreak",
    "SharedBreakpoints",
    "StoredBreak",
    "break_checked",
    "breaks_wanted",
    "ended_loop_break",
)


class StoredBreak(BaseModel):
    """A breakpoint kept in a store (`SharedBreakpoints.add_breakpoint`): every
    runtime watching the store (`Runtime(requests=True)`) pauses the loops it
    applies to before they enter `state` (before every transition when
    `state` is None: step mode).

    Its text (`by`, `removed_by`, ids) is the store's as written: untrusted,
    to be made `printable` before it reaches a terminal."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: int
    """Given by the store: a later breakpoint has a greater id."""
    loop_id: str | None = None
    """The one loop it applies to (None: an agent's)."""
    agent_id: str | None = None
    """The agent whose loops it applies to (None: one loop's)."""
    state: LoopState | None = None
    """The state a transition must enter to pause (None: any, step mode)."""
    by: str
    """Who set it."""
    created_at: datetime
    """When it was set, on the store's clock."""
    removed_at: datetime | None = None
    """When it was removed (None: it is active)."""
    removed_by: str | None = None
    """Who removed it."""

    @property
    def every(self) -> bool:
        """Whether it pauses before every transition (step mode)."""
        return self.state is None

    @property
    def label(self) -> str:
        """What a pause at it calls it: `#3 before function_call, set by
        alice` (the pause's reason starts `breakpoint ` then this)."""
        where = "every transition" if self.state is None else f"before {self.state}"
        return f"#{self.id} {where}, set by {self.by}"


class SharedBreakpoints(ABC):
    """Breakpoints kept in the store for every watching runtime to meet.

    ```python
    async with SQLiteStore("loops.db") as store:
        brk = await store.add_breakpoint(
            loop_id=loop_id, state="function_call", by="alice"
        )
        ...  # each runtime holding the loop with requests=True pauses it there
        await store.remove_breakpoint(brk.id, by="alice")
    ```
    """

    @abstractmethod
    async def add_breakpoint(
        self,
        *,
        loop_id: str | None = None,
        agent_id: str | None = None,
        state: LoopState | str | None = None,
        every: bool = False,
        by: str,
    ) -> StoredBreak:
        """Store a breakpoint: before `state` (or, `every=True`, before every
        transition: step mode), for one loop or for one agent's loops.

        Args:
            loop_id: the loop it applies to (one of `loop_id` and `agent_id`).
            agent_id: the agent whose loops it applies to.
            state: the state to pause before (a `LoopState` or its name).
            every: step mode instead of a state.
            by: who sets it (a non-empty str).

        Returns:
            The breakpoint as stored (its id, `created_at`).

        Raises:
            UnknownLoopError: the store holds no loop `loop_id`.
            LoopStateError: that loop has ended.
            ArgumentTypeError, ArgumentValueError: an argument that does not
                fit (the message names it).
            StoreError: the store could not take it (read-only, say).
        """

    @abstractmethod
    async def remove_breakpoint(
        self, breakpoint_id: int, *, by: str
    ) -> StoredBreak | None:
        """Remove an active breakpoint, naming who did (`by`).

        Returns:
            The breakpoint as removed; None if no active one has that id
            (removed before, or never set).

        Raises:
            ArgumentTypeError, ArgumentValueError: an argument that does not fit.
            StoreError: the store could not take it (read-only, say).
        """

    @abstractmethod
    async def breakpoints(
        self, loop_id: str | None = None, agent_id: str | None = None
    ) -> list[StoredBreak]:
        """The active breakpoints, oldest first: all; or those set for loop
        `loop_id` or for agent `agent_id` (given both: those of either, what
        applies to a loop of that agent). One read (a watching runtime asks
        it at each poll)."""


@dataclass(frozen=True, slots=True)
class NewBreak:
    """`add_breakpoint`'s arguments, checked."""

    loop_id: str | None
    agent_id: str | None
    state: LoopState | None
    by: str


_STATES: Final = ", ".join(s.value for s in LoopState)


def break_checked(
    loop_id: object, agent_id: object, state: object, every: object, by: object
) -> NewBreak:
    """`add_breakpoint`'s arguments, checked, their text made `encodable`.

    Raises:
        ArgumentTypeError, ArgumentValueError: an argument that does not fit.
    """
    check("loop_id", loop_id, str | None)
    check("agent_id", agent_id, str | None)
    check("state", state, str | None, "a LoopState or its name")
    check("every", every, bool)
    if (loop_id is None) == (agent_id is None):
        raise ArgumentValueError(
            "a stored breakpoint applies to one loop (loop_id=) or to one agent's "
            "loops (agent_id=): give exactly one of them"
        )
    for name, value in (("loop_id", loop_id), ("agent_id", agent_id)):
        if value == "":
            raise ArgumentValueError(f"{name} must not be empty")
    if (state is None) == (not every):
        raise ArgumentValueError(
            "a stored breakpoint pauses before a state (state='function_call') "
            "or before every transition (every=True): give exactly one of them"
        )
    target: LoopState | None = None
    if state is not None:
        try:
            target = LoopState(str(state))
        except ValueError:
            raise ArgumentValueError(
                f"state: no such state {state!r} (states: {_STATES})"
            ) from None
    return NewBreak(
        None if loop_id is None else str(loop_id),
        None if agent_id is None else encodable(str(agent_id)),
        target,
        by_checked(by, "sets it"),
    )


def breaks_wanted(loop_id: object, agent_id: object) -> None:
    """`breakpoints`' filters, checked.

    Raises:
        ArgumentTypeError: a filter that is not a str or None.
    """
    check("loop_id", loop_id, str | None)
    check("agent_id", agent_id, str | None)


def ended_loop_break(loop_id: str) -> LoopStateError:
    """The error of a breakpoint for a loop that has ended."""
    return LoopStateError(
        f"loop {loop_id} has ended: it has no transition left to pause at"
    )


read_fields_fast(globals())
