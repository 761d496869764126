"""A loop's forks as its page shows them: the loop it was forked from (its
`loop.started` says, `forked_from`), drawn beside it; the forks asked of it
through the decision inbox (`kind == "fork"`), each with its loop once a
runtime started it; and where a fork may start (its model requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentfsm._paths import LoopPath
from agentfsm.diagrams import path_graph
from agentfsm.events import AgentEvent, LoopStarted
from agentfsm.replay.inbox import fork_id
from agentfsm.store import LoopRequest, SQLStore

from ._actions import fork_points

__all__ = ("fork_data",)


async def fork_data(
    store: SQLStore[Any],
    loop_id: str,
    events: Sequence[AgentEvent],
    requests: Sequence[LoopRequest],
    *,
    enabled: bool,
) -> dict[str, Any]:
    """`from`: the source loop and seq, with the source's path drawn as data
    (`path_graph`; None when the store lacks it), or None: not a fork;
    `forks`: the fork requests, oldest first, each with its loop's id once
    applied (`agentfsm.replay.inbox.fork_id`); `points`: the seqs a fork
    of this loop may start from; `enabled`: whether this UI can store a
    fork request (`Actions.enabled`)."""
    origin = None
    first = events[0] if events else None
    if isinstance(first, LoopStarted) and first.forked_from is not None:
        source = first.forked_from
        stored = await store.load(source.loop_id)
        origin = {
            "loop_id": source.loop_id,
            "seq": source.seq,
            "graph": None if stored is None else path_graph(LoopPath.of(stored.record)),
        }
    forks = [
        {
            "request": r.id,
            "seq": r.seq,
            "model": r.model,
            "by": r.by,
            "status": r.status,
            "note": r.note,
            "loop_id": fork_id(r.id, loop_id) if r.status == "applied" else None,
        }
        for r in requests
        if r.kind == "fork"
    ]
    return {
        "from": origin,
        "forks": forks,
        "points": fork_points(events),
        "enabled": enabled,
    }
