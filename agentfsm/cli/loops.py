"""`agentfsm loops`: the loops a durable store holds, read without touching it.

```sh
agentfsm loops loops.db                          # every loop of a SQLite store
agentfsm loops loops.db --status paused          # the ones waiting for a decision
agentfsm loops postgresql://app@db/app --agent billing --json
```

The store is opened read-only (`SQLiteStore(..., read_only=True)`,
`PostgresStore(..., read_only=True)`): no lease is taken, no loop recovered,
nothing written. What the store holds is untrusted text: it reaches the
terminal `printable`, and the JSON escaped (`ensure_ascii`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

import anyio

from agentfsm._text import printable
from agentfsm.exceptions import AgentFSMError
from agentfsm.messages import TokenUsage
from agentfsm.results import LoopStatus
from agentfsm.store import SQLiteStore, SQLStore, StoredLoopSummary, UnreadableLoop
from agentfsm.timeline import aligned, short_ids

from ._interrupt import exit_at_interrupt
from ._text import one_line

__all__ = (
    "add_parser",
    "add_schema_argument",
    "add_store_arguments",
    "age",
    "detail",
    "format_loops",
    "is_store_url",
    "lease",
    "open_store",
    "run",
    "tokens",
    "with_store",
)

_T = TypeVar("_T")

_URL: Final = re.compile(r"postgres(?:ql)?://", re.IGNORECASE)

_DETAIL_WIDTH: Final = 72
"""How much of a pause reason or an error the table shows."""


def add_parser(commands: Any) -> None:
    """Register `loops` and its arguments."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "loops",
        help="list the loops of a durable store (SQLite file or PostgreSQL URL)",
        description=(
            "List the loops a durable store holds: status, state, agent, turns, "
            "tokens, age; a paused loop's reason and the calls it waits on; a "
            "running loop's owner and lease. The store is only read: no lease is "
            "taken, no loop recovered, nothing written. A loop whose stored data "
            "cannot be read is listed as unreadable, saying why; the others are "
            "listed all the same (exit 0). Exit 1: the store cannot be opened "
            "or read; 130: interrupted (Ctrl-C)."
        ),
    )
    add_store_arguments(parser)
    parser.add_argument(
        "--status",
        choices=[s.value for s in LoopStatus],
        help="only the loops of this status",
    )
    parser.add_argument("--agent", metavar="NAME", help="only this agent's loops")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON document: a list of the loops, with full ids and "
        "times (ISO 8601, UTC)",
    )
    parser.set_defaults(handler=run)


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """The store argument and `--schema`, as `loops` takes them."""
    parser.add_argument(
        "store",
        metavar="STORE",
        help="a SQLite store's file, or a PostgreSQL URL (postgresql://...)",
    )
    add_schema_argument(parser)


def add_schema_argument(parser: argparse.ArgumentParser) -> None:
    """`--schema`, as `loops` and `inspect` take it."""
    parser.add_argument(
        "--schema",
        default="agentfsm",
        help="a PostgreSQL store's schema (default agentfsm)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the store's loops (a table, or JSON)."""

    unreadable: list[UnreadableLoop] = []

    async def read(store: SQLStore[Any]) -> list[StoredLoopSummary]:
        unreadable.clear()
        return await store.loops(
            status=args.status, agent_id=args.agent, unreadable=unreadable
        )

    try:
        loops = with_store(args.store, args.schema, read)
    except (AgentFSMError, OSError) as exc:
        print(f"agentfsm loops: error: {printable(str(exc))}", file=sys.stderr)
        return 1
    now = datetime.now(UTC)
    if args.json:
        listed = [_json(s, now) for s in loops]
        listed += [{"loop_id": u.loop_id, "unreadable": u.reason} for u in unreadable]
        print(json.dumps(listed, indent=2))
    else:
        sys.stdout.write(format_loops(loops, now, unreadable))
    return 0


def is_store_url(target: str) -> bool:
    """Whether `target` names a PostgreSQL store (`postgresql://...`)."""
    return _URL.match(target) is not None


def open_store(target: str, schema: str = "agentfsm") -> SQLStore[Any]:
    """The store at `target` (a PostgreSQL URL, else a SQLite file), opened
    read-only, its events readable.

    Raises:
        AgentFSMError: psycopg is missing for a PostgreSQL URL.
    """
    if is_store_url(target):
        try:
            from agentfsm.store.postgres import PostgresStore
        except ImportError as exc:
            raise AgentFSMError(str(exc)) from None
        return PostgresStore(target, schema=schema, events=True, read_only=True)
    return SQLiteStore(target, events=True, read_only=True)


def with_store(
    target: str, schema: str, read: Callable[[SQLStore[Any]], Awaitable[_T]]
) -> _T:
    """`read(store)` on the store at `target`, opened read-only and closed
    after; Ctrl-C meanwhile ends the process at once (nothing is written)."""

    async def main() -> _T:
        async with open_store(target, schema) as store:
            return await read(store)

    with exit_at_interrupt():
        return anyio.run(main)


# ---------------------------------------------------------------------- text


def format_loops(
    loops: list[StoredLoopSummary],
    now: datetime,
    unreadable: Sequence[UnreadableLoop] = (),
) -> str:
    """The loops as a table: short id, agent, status, state, turns, tool calls,
    tokens, age since started and since the status changed, and what the status
    says (a pause's reason and calls, a lease, an outcome); then a row for
    each loop whose data could not be read, saying why."""
    header = (
        "LOOP",
        "AGENT",
        "STATUS",
        "STATE",
        "TURNS",
        "TOOLS",
        "TOKENS",
        "STARTED",
        "SINCE",
        "DETAIL",
    )
    shorts = short_ids([*(s.loop_id for s in loops), *(u.loop_id for u in unreadable)])
    rows = [
        tuple(
            printable(cell, newlines=False)
            for cell in (
                shorts[s.loop_id],
                s.agent_id,
                s.status.value,
                s.state.value,
                str(s.model_requests),
                str(s.tool_calls),
                tokens(s.usage),
                age(s.started_at, now),
                "-" if s.status_since is None else age(s.status_since, now),
                detail(s, now),
            )
        )
        for s in loops
    ]
    rows += [
        (
            printable(shorts[u.loop_id], newlines=False),
            *("-" * 8),
            f"unreadable: {one_line(u.reason, _DETAIL_WIDTH)}",
        )
        for u in unreadable
    ]
    # Turns to since are right-aligned; the rest is text.
    lines = aligned(header, rows, numbers=range(4, 9))
    counts = Counter(s.status for s in loops)
    by_status = ", ".join(f"{counts[s]} {s.value}" for s in LoopStatus if counts[s])
    if unreadable:
        by_status += f"{', ' if by_status else ''}{len(unreadable)} unreadable"
    count = len(loops) + len(unreadable)
    total = f"{count} loop{'' if count == 1 else 's'}"
    lines.append(f"{total} ({by_status})" if by_status else total)
    return "\n".join(lines) + "\n"


def detail(summary: StoredLoopSummary, now: datetime) -> str:
    """What a loop's status says: a pause's reason and the calls it waits on,
    a lease's owner and expiry, how a loop ended."""
    s = summary
    if s.status is LoopStatus.paused:
        text = one_line(s.pause_reason or "", _DETAIL_WIDTH)
        if s.pending_calls:
            text += f"; calls: {', '.join(s.pending_calls)}"
        if s.lease_live and s.owner is not None:
            text += f"; held by {s.owner}"
        return text
    if s.status is LoopStatus.running:
        return lease(s, now)
    text = s.outcome.value if s.outcome is not None else "ended"
    why = s.error or s.reason
    if why:
        text += f": {one_line(why, _DETAIL_WIDTH)}"
    return text


def lease(summary: StoredLoopSummary, now: datetime) -> str:
    """A running loop's owner and lease: `owner host:1:ab, lease 25s left`."""
    if summary.owner is None or summary.lease_until is None:
        return "no owner (a runtime's recover() takes it up)"
    left = (summary.lease_until - now).total_seconds()
    if summary.lease_live:
        return f"owner {summary.owner}, lease {_span(max(left, 0.0))} left"
    return (
        f"owner {summary.owner}, lease expired {_span(max(-left, 0.0))} ago "
        "(a runtime's recover() takes it up)"
    )


def tokens(usage: TokenUsage) -> str:
    """A loop's total tokens: `unknown` when no request reported any, `N+`
    when some did not (a lower bound)."""
    if usage.status == "unknown":
        return "unknown"
    total = str(usage.total_tokens)
    return f"{total}+" if usage.status == "partial" else total


def age(when: datetime, now: datetime) -> str:
    """How long ago `when` was, in its largest unit or two (`45s`, `3m12s`,
    `2h5m`, `4d3h`)."""
    return _span(max((now - when).total_seconds(), 0.0))


def _span(seconds: float) -> str:
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    for unit, size, smaller, small in (
        ("d", 86400, "h", 3600),
        ("h", 3600, "m", 60),
        ("m", 60, "s", 1),
    ):
        if whole >= size:
            rest = (whole % size) // small
            return f"{whole // size}{unit}{f'{rest}{smaller}' if rest else ''}"
    raise AssertionError(whole)  # pragma: no cover - every whole >= 60 matched


# ---------------------------------------------------------------------- json


def _json(summary: StoredLoopSummary, now: datetime) -> dict[str, Any]:
    """A loop as the JSON document holds it: its fields, times in ISO 8601
    (UTC); its total tokens (null: unknown) and whether `usage` counts every
    request (`usage_status`: complete, partial, unknown); the ages in seconds
    the table shows; `unreadable` null (a loop whose data cannot be read is
    listed as its `loop_id` and `unreadable`, why)."""
    data = summary.model_dump(mode="json")
    usage = summary.usage
    data["total_tokens"] = None if usage.status == "unknown" else usage.total_tokens
    data["usage_status"] = usage.status
    data["age_seconds"] = round((now - summary.started_at).total_seconds(), 3)
    since = summary.status_since
    data["status_age_seconds"] = (
        None if since is None else round((now - since).total_seconds(), 3)
    )
    data["unreadable"] = None
    return data
