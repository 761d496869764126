"""A finished loop replayed from its own recording, from its page: what
`agentfsm.replay.replay` finds (the first divergence, or none).

The replay answers every model request and every tool call from the
recording (stand-ins: no network, no side effect). The standalone UI has no
handlers: it replays with none (a recording whose handlers rewrote or paused
steps diverges there, which is what it shows); mounted beside a runtime
(`agentfsm.ui.app(runtime)`) it binds the recording's handlers and callables
to the runtime's, by name, as a recovery does.

Its cost is bounded: it runs in a worker thread, in an event loop of its own
(the server's stays free for the pages), under a timeout, one at a time per
loop and `_AT_ONCE` at once in all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.to_thread

from agentfsm.exceptions import ConfigurationError
from agentfsm.replay import replay
from agentfsm.replay.inbox import bound
from agentfsm.replay.recording import Recording
from agentfsm.results import LoopStatus

from ._actions import ActionError

if TYPE_CHECKING:
    from agentfsm.events import AgentEvent
    from agentfsm.store import SQLStore

__all__ = ("Replays",)

_AT_ONCE: Final = 2
"""Replays running at once, over all loops (each holds a worker thread)."""


class Replays:
    """The replays a page asks for (see the module).

    Args:
        store: the store the loops are read from (it keeps their events).
        callables: a runtime's callables by name (`Bindings.callables`) to
            bind the recording's handlers to; None: replay with no handlers.
        timeout: seconds a replay may take before it is stopped.
    """

    def __init__(
        self,
        store: SQLStore[Any],
        *,
        callables: Mapping[str, Any] | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.store = store
        self.callables = callables
        self.timeout = timeout
        self._running: set[str] = set()
        self._limiter = anyio.CapacityLimiter(_AT_ONCE)

    async def replay(self, loop_id: str) -> dict[str, Any]:
        """Replay the finished loop; its report as the page shows it.

        Raises:
            ActionError: 404 no such loop; 409 it has not ended, the store
                keeps no events of it, or a replay of it is running.
            StoreError: the store cannot be read.
        """
        stored = await self.store.load(loop_id)
        if stored is None:
            raise ActionError(404, f"the store holds no loop {loop_id!r}")
        if stored.record.status is not LoopStatus.done:
            raise ActionError(
                409,
                f"loop {loop_id} is {stored.record.status}: a replay re-drives a "
                "loop that has ended",
            )
        if not self.store.keeps_events:
            raise ActionError(
                409,
                "the store keeps no events, and a replay re-drives them "
                "(SQLiteStore(..., events=True) keeps them)",
            )
        if loop_id in self._running:
            raise ActionError(409, f"a replay of loop {loop_id} is running already")
        self._running.add(loop_id)
        try:
            events = await self.store.events(loop_id)
            return await anyio.to_thread.run_sync(
                _replayed,
                events,
                loop_id,
                self.callables,
                self.timeout,
                limiter=self._limiter,
            )
        finally:
            self._running.discard(loop_id)


def _replayed(
    events: Sequence[AgentEvent],
    loop_id: str,
    callables: Mapping[str, Any] | None,
    timeout: float,
) -> dict[str, Any]:
    """The replay, in this worker thread's own event loop, as JSON data."""
    return anyio.run(_replay, events, loop_id, callables, timeout)


async def _replay(
    events: Sequence[AgentEvent],
    loop_id: str,
    callables: Mapping[str, Any] | None,
    timeout: float,  # noqa: ASYNC109 - the bound of a replay in another thread
) -> dict[str, Any]:
    shown: dict[str, Any] = {
        "loop_id": loop_id,
        "handlers": "none" if callables is None else "the runtime's",
    }
    try:
        options: dict[str, Any] = {}
        schema = None
        handlers: list[Any] = []
        if callables is not None:
            names = bound(Recording.of(events), callables)
            handlers, options, schema = (
                names.handlers,
                names.options,
                names.structured_output,
            )
        with anyio.fail_after(timeout):
            report = await replay(
                events,
                loop_id=loop_id,
                handlers=handlers,
                options=options,  # type: ignore[arg-type]
                structured_output=schema,
            )
    except ConfigurationError as exc:
        return {**shown, "error": f"it cannot be replayed: {exc}"}
    except TimeoutError:
        return {**shown, "error": f"the replay took over {timeout:g} s: stopped"}
    divergence = report.divergence
    return {
        **shown,
        "replay_loop_id": report.replay_loop_id,
        "diverged": divergence is not None,
        "text": report.describe(),
        "outcome": str(report.result.outcome),
        "events": len(report.events),
        "divergence": None
        if divergence is None
        else divergence.model_dump(
            mode="json",
            include={"seq", "actual_seq", "expected", "actual", "differences"},
        ),
    }
