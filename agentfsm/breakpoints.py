"""Breakpoints and step mode: pause a loop before it enters a state.

A breakpoint names the state a loop is about to enter, optionally with a
predicate on the `PendingTransition`; the loop pauses before any transition
into that state, exactly as if an interception handler had returned
`Pause(reason)`:

```python
async with Runtime(breakpoints=[Break("function_call")]) as runtime:
    loop_id = runtime.run_loop("agent", "hi", request)
    ...  # the loop pauses before it runs any tool call
    runtime.resume(loop_id)  # Proceed(), a Rewrite(...) or an Abort(...)
```

So a breakpoint's pause is a pause like any other: published as
`loop.paused` (its reason names the breakpoint) and shown by
`Runtime.get(loop_id).pending`; with a store, stored with its decision record,
visible to every process, taken up paused after a crash, and never asked
again for a transition it paused once the pause was resumed.

Where it runs: after the loop's own handlers (the approval gate and the
handlers given to `run_loop`), as the last one. So a breakpoint pauses exactly
before the transitions that will enter its state (a handler's rewrite into
the state is caught, one away from it is not), shows the transition as it
will be taken, and the decision it is resumed with is the last word: no
handler rewrites it afterwards. What the handlers before it changed is in
the loop's `transition.intercepted` events (the payload before and after each
rewrite).

Breakpoints apply to every loop of a runtime (`Runtime(breakpoints=[...])`),
or to one agent's loops, or to one loop, and can be added and removed while
loops run, through `Runtime.breakpoints` (a `Breakpoints`): a change takes
effect from the loop's next transition. Step mode is a breakpoint before
every transition, `Break.every()`: `runtime.breakpoints.step(loop_id)`.

Breakpoints can also be kept in a durable store, set from another process
(`agentfsm ui`, a script: `agentfsm.store.SharedBreakpoints`): a runtime
watching the store (`Runtime(requests=True)`) adds them to its own set, and
takes them away once removed, at each read of the store (`Breakpoints.sync`).

A loop with no breakpoint that applies to it pays nothing for them: the
handler is added to a loop's handlers only while one applies to it, and taken
away when none does.
"""

from __future__ import annotations

import builtins
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple

from ._arguments import ArgumentTypeError, ArgumentValueError, check, given
from .exceptions import LoopStateError
from .interception import Pause, PendingTransition
from .record import callable_name
from .states import LoopState

if TYPE_CHECKING:
    from ._loop import Loop
    from .store import StoredBreak

__all__ = (
    "BREAKPOINT_HANDLER",
    "REASON_PREFIX",
    "Break",
    "Breakpoints",
    "ScopedBreak",
    "is_breakpoint_pause",
)

REASON_PREFIX: Final = "breakpoint "
"""How the reason of a breakpoint's pause starts (see `is_breakpoint_pause`)."""

_S = LoopState
_DESTS: Final[Mapping[LoopState, frozenset[LoopState]]] = {
    # `inference` is one state in two modes: a breakpoint on it stops a
    # streaming request too (what `agentfsm run`, streaming by default, sends).
    _S.inference: frozenset({_S.inference, _S.inference_streaming}),
    **{s: frozenset({s}) for s in LoopState if s is not _S.inference},
}
_EVERY: Final = frozenset(LoopState)


@dataclass(frozen=True, slots=True, init=False)
class Break:
    """A breakpoint: pause before the loop enters `state` (when `when` says so).

    `Break("inference")` stops before every model request, streaming or not;
    `Break("function_call", when=...)` before the batches of tool calls the
    predicate picks; `Break("idle")` before the loop ends by an answer or a
    stop (`abort`, `fail` and `cancel` are never intercepted). Two breakpoints
    of the same state, predicate and name are equal: adding one twice sets it
    once.

    Args:
        state: the state the transition enters (a `LoopState` or its name).
        when: a sync predicate on the `PendingTransition` (its payload, its
            trigger, the loop's counters); the loop pauses only when it
            returns true. An exception it raises fails the loop, as a
            handler's would.
        name: what the pause's reason calls the breakpoint (default: "before
            STATE", with the predicate's name).

    Raises:
        ValueError: `state` names no state (the message lists them).
        TypeError: `when` is not a sync callable, or `name` not a non-empty str.

    Example:
        ```python
        def big(pending: PendingTransition) -> bool:
            batch = pending.payload
            return isinstance(batch, ToolBatch) and len(batch.calls) > 3

        Runtime(breakpoints=[Break("inference"), Break("function_call", when=big)])
        ```
    """

    state: LoopState | None
    """The state a transition must enter to pause (None: any, `Break.every`)."""
    when: Callable[[PendingTransition], object] | None
    """The predicate, if any."""
    name: str | None
    """The name given, if any."""

    def __init__(
        self,
        state: LoopState | str,
        *,
        when: Callable[[PendingTransition], object] | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(state, str):
            raise ArgumentTypeError(
                f"Break takes the state to stop before (a LoopState or its name, "
                f"e.g. Break('function_call')), got {given(state)}"
            )
        try:
            target: LoopState | None = LoopState(state)
        except ValueError:
            states = ", ".join(s.value for s in LoopState)
            raise ArgumentValueError(
                f"Break({state!r}): no such state (states: {states}); "
                "Break.every() stops before every transition"
            ) from None
        self._set(target, when, name)

    @classmethod
    def every(
        cls,
        *,
        when: Callable[[PendingTransition], object] | None = None,
        name: str | None = None,
    ) -> Break:
        """A breakpoint before every transition (step mode), or before every
        one `when` picks."""
        made = cls.__new__(cls)
        made._set(None, when, name)
        return made

    def _set(
        self,
        state: LoopState | None,
        when: Callable[[PendingTransition], object] | None,
        name: str | None,
    ) -> None:
        if when is not None and not _sync_callable(when):
            raise ArgumentTypeError(
                "when= must be a sync callable taking the PendingTransition and "
                "returning whether to pause (an async decision is an "
                f"interception handler's job), got {given(when)}"
            )
        check("name", name, str | None)
        if name is not None and not name.strip():
            raise ArgumentValueError("name= must not be empty (None: the default)")
        object.__setattr__(self, "state", state)
        object.__setattr__(self, "when", when)
        object.__setattr__(self, "name", name)

    @property
    def label(self) -> str:
        """What the pause's reason calls this breakpoint."""
        if self.name is not None:
            return self.name
        where = "every transition" if self.state is None else f"before {self.state}"
        if self.when is None:
            return where
        return f"{where} when {callable_name(self.when)}"

    def matches(self, pending: PendingTransition) -> bool:
        """Whether the loop pauses before `pending`.

        Raises:
            TypeError: `when` returned an awaitable (an async predicate).
        """
        dests = _EVERY if self.state is None else _DESTS[self.state]
        if pending.dest not in dests:
            return False
        if self.when is None:
            return True
        verdict = self.when(pending)
        if inspect.isawaitable(verdict):
            close = getattr(verdict, "close", None)
            if close is not None:
                close()  # (never awaited: no "coroutine was never awaited" warning)
            raise TypeError(
                f"breakpoint {self.label}: when= returned an awaitable; it must be "
                "a sync predicate (use an interception handler to decide asynchronously)"
            )
        return bool(verdict)

    def reason(self, pending: PendingTransition) -> str:
        """The pause's reason: the breakpoint and the transition it stopped."""
        return (
            f"{REASON_PREFIX}{self.label}: "
            f"{pending.source} --{pending.trigger}--> {pending.dest}"
        )


def _sync_callable(value: object) -> bool:
    """Whether `value` is callable, and no coroutine function (nor an object
    whose `__call__` is one)."""
    if not callable(value):
        return False
    call = getattr(type(value), "__call__", None)  # noqa: B004 - its __call__ itself
    return not (inspect.iscoroutinefunction(value) or inspect.iscoroutinefunction(call))


def is_breakpoint_pause(reason: str | None) -> bool:
    """Whether a pause with this reason is a breakpoint's (`LoopView.pause_reason`,
    `loop.paused`'s reason, a stored loop's `pause_reason`)."""
    return reason is not None and reason.startswith(REASON_PREFIX)


class ScopedBreak(NamedTuple):
    """A breakpoint set on a runtime, and what it applies to."""

    breakpoint: Break
    loop_id: str | None = None
    """The one loop it applies to (None: not one loop's)."""
    agent_id: str | None = None
    """The agent whose loops it applies to (None: not one agent's)."""
    stored: int | None = None
    """The id of the stored breakpoint it is (`agentfsm.store.StoredBreak`),
    or None: given in code."""


_STEP: Final = Break.every()


class Breakpoints:
    """A runtime's breakpoints (`Runtime.breakpoints`), and the interception
    handler that pauses at them.

    Each applies to every loop of the runtime, to the loops of one agent, or
    to one loop; setting or removing one takes effect from each loop's next
    transition (a loop paused meanwhile meets the change once it is resumed:
    a breakpoint added while it waits at a handler's pause is met after that
    handler's decision). Loops that no breakpoint applies to do not run this
    handler at all.

    Per-loop breakpoints go when the loop ends (or leaves this runtime); the
    set lives in this runtime, so a loop recovered by another process meets
    that runtime's breakpoints. Made by the `Runtime`; not thread-safe (call
    it from the runtime's event loop).

    Example:
        ```python
        runtime.breakpoints.add(Break("function_call"), agent_id="billing")
        runtime.breakpoints.step(loop_id)  # pause before its every transition
        runtime.breakpoints.step(loop_id, on=False)
        runtime.breakpoints.list(loop_id=loop_id)  # what applies to that loop
        ```
    """

    __slots__ = (
        "_by_agent",
        "_by_loop",
        "_everywhere",
        "_live",
        "_loops",
        "_stored",
        "_stored_ids",
        "armed",
    )

    def __init__(
        self,
        breakpoints: Iterable[Break],
        loops: Mapping[str, Loop],
        live: Callable[[str], Loop | None],
    ) -> None:
        if isinstance(breakpoints, str | Break) or not isinstance(
            breakpoints, Iterable
        ):
            raise ArgumentTypeError(
                "breakpoints must be a list of Break, e.g. "
                f"breakpoints=[Break('function_call')], got {given(breakpoints)}"
            )
        self._everywhere: list[Break] = []
        self._by_agent: dict[str, list[Break]] = {}
        self._by_loop: dict[str, list[Break]] = {}
        self._loops = loops
        """The runtime's running and paused loops, by id."""
        self._live = live
        """The runtime's lookup: the live loop, None once it ended, or raises."""
        self.armed = False
        """Whether any breakpoint is set (read by the runtime as a loop starts;
        not to be set)."""
        self._stored: dict[int, ScopedBreak] = {}
        """The stored breakpoints set here (`sync`), by their ids."""
        self._stored_ids: dict[Break, int] = {}
        """The same, by the `Break` each is (to name them in `list`)."""
        for given_break in breakpoints:
            check("breakpoints", given_break, Break, "a list of Break")
            if given_break not in self._everywhere:
                self._everywhere.append(given_break)
        self.armed = bool(self._everywhere)

    # ------------------------------------------------------------ the handler

    def __call__(self, pending: PendingTransition) -> Pause | None:
        """Pause before `pending` if a breakpoint that applies to its loop
        matches it (the first one, the loop's own first, then its agent's,
        then the runtime's)."""
        for brk in self._applying(pending.loop_id, pending.agent_id):
            if brk.matches(pending):
                return Pause(brk.reason(pending))
        return None

    def _applying(self, loop_id: str, agent_id: str) -> Iterator[Break]:
        yield from self._by_loop.get(loop_id, ())
        yield from self._by_agent.get(agent_id, ())
        yield from self._everywhere

    # ------------------------------------------------------------ the API

    def add(
        self,
        breakpoint: Break,
        *,
        loop_id: str | None = None,
        agent_id: str | None = None,
    ) -> None:
        """Set a breakpoint: for one loop (running or paused here), for one
        agent's loops (those running and those started later), or, with
        neither, for every loop of the runtime. Setting one that is set
        already (an equal `Break`, same scope) does nothing.

        Raises:
            UnknownLoopError: no loop `loop_id` in this runtime.
            LoopStateError: that loop has ended.
            ValueError: both `loop_id` and `agent_id` were given.
        """
        check("breakpoint", breakpoint, Break, "a Break, e.g. Break('function_call')")
        bucket = self._bucket(loop_id, agent_id, create=True)
        assert bucket is not None
        if breakpoint not in bucket:
            bucket.append(breakpoint)
        self._changed(loop_id, agent_id)

    def remove(
        self,
        breakpoint: Break,
        *,
        loop_id: str | None = None,
        agent_id: str | None = None,
    ) -> bool:
        """Unset a breakpoint set with the same scope; whether it was set (a
        loop that ended has none left).

        Raises:
            ValueError: both `loop_id` and `agent_id` were given.
        """
        check("breakpoint", breakpoint, Break, "a Break, e.g. Break('function_call')")
        bucket = self._bucket(loop_id, agent_id, create=False)
        if bucket is None or breakpoint not in bucket:
            return False
        bucket.remove(breakpoint)
        if not bucket:
            if loop_id is not None:
                del self._by_loop[loop_id]
            elif agent_id is not None:
                del self._by_agent[agent_id]
        self._changed(loop_id, agent_id)
        return True

    def step(
        self,
        loop_id: str | None = None,
        *,
        agent_id: str | None = None,
        on: bool = True,
    ) -> None:
        """Step mode: pause before every transition (`Break.every()`) of one
        loop, of one agent's loops, or (neither given) of every loop; `on=False`
        leaves it.

        Raises:
            UnknownLoopError: no loop `loop_id` in this runtime (`on=True`).
            LoopStateError: that loop has ended (`on=True`).
            ValueError: both `loop_id` and `agent_id` were given.
        """
        check("on", on, bool)
        if on:
            self.add(_STEP, loop_id=loop_id, agent_id=agent_id)
        else:
            self.remove(_STEP, loop_id=loop_id, agent_id=agent_id)

    def list(
        self, *, loop_id: str | None = None, agent_id: str | None = None
    ) -> tuple[ScopedBreak, ...]:
        """The breakpoints set: all of them; or (`loop_id`) those that apply to
        that loop, its own, its agent's and the runtime's; or (`agent_id`)
        those that apply to that agent's loops, its own and the runtime's. In
        the order they are checked: the most specific first.

        Raises:
            ValueError: both `loop_id` and `agent_id` were given.
        """
        self._scope_checked(loop_id, agent_id)
        self._prune()
        found: list[ScopedBreak] = []
        scoped = self._scoped
        if loop_id is not None:
            found += [
                scoped(b, loop_id=loop_id) for b in self._by_loop.get(loop_id, ())
            ]
            loop = self._loops.get(loop_id)
            agent_id = None if loop is None else loop.agent_id
            if agent_id is None:
                found += [scoped(b) for b in self._everywhere]
                return tuple(found)
        if agent_id is not None:
            found += [
                scoped(b, agent_id=agent_id) for b in self._by_agent.get(agent_id, ())
            ]
            found += [scoped(b) for b in self._everywhere]
            return tuple(found)
        for lid, breaks in self._by_loop.items():
            found += [scoped(b, loop_id=lid) for b in breaks]
        for aid, breaks in self._by_agent.items():
            found += [scoped(b, agent_id=aid) for b in breaks]
        found += [scoped(b) for b in self._everywhere]
        return tuple(found)

    def _scoped(
        self, brk: Break, loop_id: str | None = None, agent_id: str | None = None
    ) -> ScopedBreak:
        return ScopedBreak(brk, loop_id, agent_id, self._stored_ids.get(brk))

    # ------------------------------------------------------------ the store

    def sync(self, stored: Iterable[StoredBreak]) -> None:
        """Make the stored breakpoints set here those of `stored` (the store's
        active ones, `SharedBreakpoints.breakpoints()`): set each new one,
        unset each no longer there. What the watching runtime calls at each
        read of the store; breakpoints given in code are left as they are.

        A stored breakpoint of one loop is set once that loop runs here (a
        loop another runtime holds meets it there), and again if the loop
        comes back after leaving (recovered).
        """
        self._prune()
        active = {s.id: s for s in stored}
        for stored_id, scoped in builtins.list(self._stored.items()):
            gone = stored_id not in active
            left = scoped.loop_id is not None and scoped.loop_id not in self._loops
            if gone or left:
                del self._stored[stored_id]
                self._stored_ids.pop(scoped.breakpoint, None)
            if gone and not left:
                self.remove(
                    scoped.breakpoint, loop_id=scoped.loop_id, agent_id=scoped.agent_id
                )
        for stored_id, one in active.items():
            if stored_id in self._stored:
                continue
            if one.loop_id is not None and one.loop_id not in self._loops:
                continue  # not (or not yet) this runtime's loop
            brk = (
                Break.every(name=one.label)
                if one.state is None
                else Break(one.state, name=one.label)
            )
            self.add(brk, loop_id=one.loop_id, agent_id=one.agent_id)
            self._stored[stored_id] = ScopedBreak(
                brk, one.loop_id, one.agent_id, stored_id
            )
            self._stored_ids[brk] = stored_id

    # ------------------------------------------------------------ the loops

    def chain(self, loop: Loop) -> None:
        """Give `loop` this handler, as its last, while a breakpoint applies
        to it, and take it away when none does (the runtime calls this as a
        loop starts or is recovered; the set's changes call it for the loops
        they touch).

        Always the last: so adding or taking it away never moves the loop's
        other handlers, and the index a paused loop resumes from stays theirs
        (one that paused here resumes past the end: the decision is the last).
        """
        handlers = loop.handlers
        attached = bool(handlers) and handlers[-1] is self
        wanted = bool(
            self._everywhere
            or self._by_loop.get(loop.loop_id)
            or self._by_agent.get(loop.agent_id)
        )
        # The loop's record names its handlers anew (`record_of`).
        if wanted and not attached:
            loop.add_handler(self)
        elif attached and not wanted:
            loop.drop_last_handler()

    def _changed(self, loop_id: str | None, agent_id: str | None) -> None:
        self.armed = bool(self._everywhere or self._by_agent or self._by_loop)
        if loop_id is not None:
            loop = self._loops.get(loop_id)
            if loop is not None:
                self.chain(loop)
            return
        for loop in list(self._loops.values()):
            if agent_id is None or loop.agent_id == agent_id:
                self.chain(loop)

    def _bucket(
        self, loop_id: str | None, agent_id: str | None, *, create: bool
    ) -> builtins.list[Break] | None:
        self._scope_checked(loop_id, agent_id)
        self._prune()
        if loop_id is not None:
            if create and self._live(loop_id) is None:  # raises for an unknown one
                raise LoopStateError(
                    f"loop {loop_id} has ended: it has no transition left to pause at"
                )
            return (
                self._by_loop.setdefault(loop_id, [])
                if create
                else self._by_loop.get(loop_id)
            )
        if agent_id is not None:
            return (
                self._by_agent.setdefault(agent_id, [])
                if create
                else self._by_agent.get(agent_id)
            )
        return self._everywhere

    @staticmethod
    def _scope_checked(loop_id: str | None, agent_id: str | None) -> None:
        check("loop_id", loop_id, str | None)
        check("agent_id", agent_id, str | None)
        if loop_id is not None and agent_id is not None:
            raise ArgumentValueError(
                "give loop_id= (one loop) or agent_id= (that agent's loops), not both"
            )

    def _prune(self) -> None:
        """Forget the breakpoints of loops that ended or left this runtime."""
        gone = [lid for lid in self._by_loop if lid not in self._loops]
        for lid in gone:
            del self._by_loop[lid]
        if gone:
            self.armed = bool(self._everywhere or self._by_agent or self._by_loop)


BREAKPOINT_HANDLER: Final = f"{Breakpoints.__module__}:{Breakpoints.__qualname__}"
"""The breakpoints' handler as records and decision records name it
(`callable_name`): a runtime binds the name to its own `Breakpoints`, so a
stored loop that was paused at a breakpoint is taken up by any runtime."""
