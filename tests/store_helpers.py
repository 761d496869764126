"""What the store tests share: commits made by hand, and a spy that keeps the
records a runtime commits, made whole.

A commit's records leave their paths empty (the commit carries the steps since
the last one of its lease: see `agentfsm.store.Commit`); `commit_of` makes one
from whole records, and `spied` makes the committed ones whole again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentfsm.record import LoopRecord
from agentfsm.results import PathStep
from agentfsm.store import Commit, Lease, LoopStore

__all__ = ("commit_of", "spied", "stripped")


def stripped(record: LoopRecord) -> tuple[LoopRecord, int]:
    """A record as a commit carries it: its path left empty, and its length."""
    return record.model_copy(update={"path": ()}), len(record.path)


def commit_of(
    record: LoopRecord,
    lease: Lease,
    *,
    earlier: Sequence[LoopRecord] = (),
    first: int = 0,
    **fields: Any,
) -> Commit:
    """A commit of `record` (whole), carrying its whole path (the first of a
    lease's commits), with `earlier` records (whole, their paths starts of
    its)."""
    bare, length = stripped(record)
    return Commit(
        record.loop_id,
        lease,
        bare,
        length,
        record.path,
        0,
        first,
        earlier=[stripped(r) for r in earlier],
        **fields,
    )


def spied(store: LoopStore, committed: dict[int, LoopRecord]) -> LoopStore:
    """`store`, keeping each record it is given to commit in `committed`, by
    seq, made whole (its path rebuilt from the commits' steps)."""
    commit_many = store.commit_many
    paths: dict[str, list[PathStep]] = {}

    async def spy(commits: Sequence[Commit]) -> list[Exception | None]:
        for commit in commits:
            record = commit.record
            if record is None:
                continue
            path = paths.setdefault(commit.loop_id, [])
            del path[commit.path_from :]
            path.extend(commit.steps)
            for earlier, length in commit.earlier:
                committed[earlier.seq] = earlier.model_copy(
                    update={"path": tuple(path[:length])}
                )
            committed[record.seq] = record.model_copy(
                update={"path": tuple(path[: commit.path_length])}
            )
        return await commit_many(commits)

    store.commit_many = spy  # type: ignore[method-assign]
    return store
