"""`LoopPath`: the path one loop took, from a live loop or rebuilt from its events.

Public as `agentfsm.diagrams.LoopPath`; the diagrams draw it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import final

from . import events as ev
from ._text import clip
from .exceptions import EventLogError
from .interception import PendingTransition
from .record import LoopRecord, PauseRecord
from .results import LoopResult, LoopStatus, LoopView, PathStep
from .states import ERROR_TRIGGERS, LoopState, Outcome

__all__ = ("LoopPath",)

_TITLE_ID = 64
"""The most characters of an id a title shows (a loop id has 36)."""


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class LoopPath:
    """The path one loop took, as the path diagrams draw it."""

    loop_id: str
    agent_id: str
    steps: tuple[PathStep, ...] = ()
    """The transitions taken, in order (step `#n` is `steps[n - 1]`)."""
    rewritten: frozenset[int] = frozenset()
    """Indexes into `steps` of the transitions a handler rewrote: their edge (see
    `PathStep.rewritten_from`) or, known only from events, just their payload."""
    state: LoopState = LoopState.idle
    """The state the loop is in."""
    status: LoopStatus = LoopStatus.running
    outcome: Outcome | None = None
    pending: PathStep | None = None
    """For a paused loop, the transition it waits on."""
    pause_reason: str | None = None

    @classmethod
    def of(cls, loop: LoopPath | LoopView | LoopResult | LoopRecord) -> LoopPath:
        """The path of a live loop (`runtime.get`), of a finished one
        (`runtime.wait`) or of a stored record (`store.load(loop_id).record`)."""
        if isinstance(loop, LoopPath):
            return loop
        rewritten = frozenset(
            i for i, step in enumerate(loop.path) if step.rewritten_from is not None
        )
        if isinstance(loop, LoopResult):
            return cls(
                loop_id=loop.loop_id,
                agent_id=loop.agent_id,
                steps=loop.path,
                rewritten=rewritten,
                status=LoopStatus.done,
                outcome=loop.outcome,
            )
        # A view's pending transition and a record's pause both name the edge.
        waiting: PauseRecord | PendingTransition | None
        if isinstance(loop, LoopRecord):
            waiting = loop.pause
            reason = None if waiting is None else waiting.reason
        else:
            waiting, reason = loop.pending, loop.pause_reason
        return cls(
            loop_id=loop.loop_id,
            agent_id=loop.agent_id,
            steps=loop.path,
            rewritten=rewritten,
            state=loop.state,
            status=loop.status,
            outcome=loop.outcome,
            pending=(
                None
                if waiting is None
                else PathStep(waiting.source, waiting.trigger, waiting.dest)
            ),
            pause_reason=reason,
        )

    @classmethod
    def from_events(
        cls, events: Iterable[ev.AgentEvent], loop_id: str | None = None
    ) -> LoopPath:
        """Rebuild a loop's path from its events (e.g. `read_events(path)`).

        The path comes from `loop.transition` events; rewrites from their
        `rewritten_from` and from `transition.intercepted` rewrite decisions
        (which also reveal rewrites that changed only the payload); the pause
        from `loop.paused` / `loop.resumed`.

        Args:
            events: events of one or more loops; only `loop_id`'s are used.
            loop_id: which loop; may be omitted when the events hold only one.

        Raises:
            EventLogError: no events of that loop, or several loops and no `loop_id`.
        """
        mine = sorted(_events_of(events, loop_id), key=lambda e: e.seq)
        steps: list[PathStep] = []
        rewritten: set[int] = set()
        rewrite_decided = False
        status = LoopStatus.running
        outcome: Outcome | None = None
        pending: PathStep | None = None
        reason: str | None = None
        for event in mine:
            match event:
                case ev.TransitionIntercepted(decision="rewrite"):
                    rewrite_decided = True
                case ev.TransitionIntercepted(decision="abort"):
                    rewrite_decided = False
                case ev.LoopPaused():
                    status = LoopStatus.paused
                    pending = PathStep(event.source, event.trigger, event.dest)
                    reason = event.reason
                case ev.LoopResumed():
                    status = LoopStatus.running
                    pending = reason = None
                case ev.LoopTransition():
                    step = PathStep(
                        event.source, event.trigger, event.dest, event.rewritten_from
                    )
                    intercepted = event.trigger not in ERROR_TRIGGERS
                    if event.rewritten_from is not None or (
                        rewrite_decided and intercepted
                    ):
                        rewritten.add(len(steps))
                    steps.append(step)
                    rewrite_decided = False
                    status = LoopStatus.running
                    pending = reason = None
                case ev.LoopIdle():
                    status = LoopStatus.done
                    outcome = event.outcome
        return cls(
            loop_id=mine[0].loop_id,
            agent_id=mine[0].agent_id,
            steps=tuple(steps),
            rewritten=frozenset(rewritten),
            state=steps[-1].dest if steps else LoopState.idle,
            status=status,
            outcome=outcome,
            pending=pending,
            pause_reason=reason,
        )

    @property
    def visited(self) -> frozenset[LoopState]:
        """The states the loop has been in (`idle` always)."""
        return frozenset({LoopState.idle, *(step.dest for step in self.steps)})

    @property
    def title(self) -> str:
        """`loop <id> (<agent>): <outcome or status>`, each id cut to
        `_TITLE_ID` characters so that the outcome stays in a bounded label."""
        where = self.outcome or (
            f"paused in {self.state}"
            if self.status is LoopStatus.paused
            else f"{self.status} in {self.state}"
        )
        loop_id = clip(self.loop_id, _TITLE_ID)
        agent_id = clip(self.agent_id, _TITLE_ID)
        return f"loop {loop_id} ({agent_id}): {where}"


def _events_of(
    events: Iterable[ev.AgentEvent], loop_id: str | None
) -> Iterator[ev.AgentEvent]:
    found: set[str] = set()
    for event in events:
        if loop_id is None:
            found.add(event.loop_id)
            if len(found) > 1:
                raise EventLogError(
                    "the events hold several loops; say which one (loop_id)"
                )
            yield event
        elif event.loop_id == loop_id:
            found.add(loop_id)
            yield event
    if not found:
        raise EventLogError(
            "the events hold no loop"
            if loop_id is None
            else f"the events hold no loop {loop_id!r}"
        )
