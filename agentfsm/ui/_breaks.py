"""Breakpoints from the UI: set and removed in the store
(`agentfsm.store.SharedBreakpoints`), where every runtime watching it
(`Runtime(requests=True)`) meets them, naming the UI's user.

```
{"loop_id": "01a2...", "state": "function_call"}   before a state, for one loop
{"agent_id": "billing", "state": "inference"}       for that agent's loops
{"loop_id": "01a2...", "every": true}                step mode, for one loop
```
"""

from __future__ import annotations

from typing import Final

from agentfsm._arguments import ArgumentTypeError, ArgumentValueError
from agentfsm.exceptions import LoopStateError, UnknownLoopError
from agentfsm.states import LoopState
from agentfsm.store import StoredBreak

from ._actions import ActionError, Actions, _bad, _only, _shown, parse_object

__all__ = ("Breaks", "STATES")

STATES: Final = tuple(
    s.value for s in LoopState if s is not LoopState.inference_streaming
)
"""The states a page offers to pause before (`inference` stops a streaming
request too)."""

_FIELDS: Final = frozenset({"loop_id", "agent_id", "state", "every"})


class Breaks:
    """The UI's breakpoints, written where its requests are (`Actions`)."""

    def __init__(self, actions: Actions) -> None:
        self.actions = actions

    async def active(
        self, loop_id: str | None = None, agent_id: str | None = None
    ) -> list[StoredBreak]:
        """The active stored breakpoints (those of the loop or the agent, if
        named), oldest first."""
        store = self.actions.reader()
        return await store.breakpoints(loop_id, agent_id)

    async def add(self, body: bytes) -> StoredBreak:
        """Store the breakpoint the body asks for (see the module), by the
        UI's user, and poke the runtime the UI is mounted beside.

        Raises:
            ActionError: 400 a field that does not fit (named), 404 no such
                loop, 409 the loop has ended, 503 no store to write to.
        """
        data = parse_object(body)
        _only(data, _FIELDS, "")
        loop_id, agent_id = data.get("loop_id"), data.get("agent_id")
        if (loop_id is None) == (agent_id is None):
            raise _bad("loop_id", "give loop_id (one loop) or agent_id (its loops)")
        for name, value in (("loop_id", loop_id), ("agent_id", agent_id)):
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(name, f"a non-empty string, got {_shown(value)}")
        state, every = data.get("state"), data.get("every", False)
        if every is not True and every is not False:
            raise _bad("every", f"true (step mode) or false, got {_shown(every)}")
        if every and state is not None:
            raise _bad("state", "step mode (every) pauses before every state: no state")
        if not every and state not in STATES:
            raise _bad("state", f"one of {', '.join(STATES)}, got {_shown(state)}")
        store = await self.actions.writable()
        try:
            made = await store.add_breakpoint(
                loop_id=loop_id,
                agent_id=agent_id,
                state=state,
                every=every,
                by=self.actions.user,
            )
        except UnknownLoopError as exc:
            raise ActionError(404, str(exc)) from None
        except LoopStateError as exc:
            raise ActionError(409, str(exc)) from None
        except (ArgumentTypeError, ArgumentValueError) as exc:
            raise ActionError(400, str(exc)) from None
        self._poke()
        return made

    async def remove(self, breakpoint_id: int) -> StoredBreak:
        """Remove an active stored breakpoint, by the UI's user.

        Raises:
            ActionError: 404 no active breakpoint has that id, 503 no store
                to write to.
        """
        store = await self.actions.writable()
        removed = await store.remove_breakpoint(breakpoint_id, by=self.actions.user)
        if removed is None:
            raise ActionError(
                404, f"no active breakpoint #{breakpoint_id} (removed already?)"
            )
        self._poke()
        return removed

    def _poke(self) -> None:
        if self.actions.poke is not None:
            self.actions.poke()
