"""`agentfsm inspect`: what an event log, or a durable store, says about its loops.

```sh
agentfsm inspect events.jsonl                      # a table of the loops
agentfsm inspect events.jsonl --loop 4454f1a2      # one loop's timeline (its short id)
agentfsm inspect events.jsonl --loop 4454f1a2 --html loop.html
agentfsm inspect loops.db --loop 4454f1a2          # a loop of a SQLite store
agentfsm inspect postgresql://app@db/app --loop 4454f1a2
```

What FILE is decides how it is read: a PostgreSQL URL or a SQLite file (its
header) is a store, opened read-only (`agentfsm.cli.loops`); anything else must
be an event log, JSON lines. A store's loop is told from its events where the
store kept them (the timeline an event log gives), else from its records
(`agentfsm.cli._stored`). A file that is neither (empty, an image, bytes that
are not text, text without one event) is an error saying so.

The work is done by `agentfsm.timeline`; this module only parses arguments,
reads and prints. An image is printed as its reference line, never its bytes;
the `--html` page shows it as a thumbnail (a `data:` URL: the page is one
file). Torn lines of a log (a writer killed mid-line) are skipped,
and stderr says which.
"""

from __future__ import annotations

import argparse
import codecs
import os
import stat
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Final, Literal

from agentfsm._arguments import private_opener
from agentfsm._text import printable
from agentfsm.diagrams import LoopPath, render_svg
from agentfsm.eventlog import read_events
from agentfsm.events import AgentEvent
from agentfsm.exceptions import AgentFSMError, EventLogError, StoreError
from agentfsm.store import SQLStore, StoredLoopSummary, UnreadableLoop
from agentfsm.timeline import (
    build_timeline,
    find_loop,
    format_table,
    format_timeline,
    match_loop_id,
    render_html,
    summarize,
)

from ._stored import StoredReport, format_stored, read_report, stored_html
from .loops import (
    add_schema_argument,
    detail,
    format_loops,
    is_store_url,
    with_store,
)

_HTML_WIDTH = 400
"""Values are cut later on a page than in a terminal."""

_SQLITE: Final = b"SQLite format 3\x00"
"""How every SQLite database file starts."""

_KNOWN: Final = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"%PDF-", "a PDF document"),
    (b"\x1f\x8b", "gzip-compressed data"),
    (b"PK\x03\x04", "a zip archive"),
)
"""Files a user may point `inspect` at by mistake, by their first bytes."""

_NEITHER: Final = (
    "neither an event log (JSON lines, Runtime(event_log=...)) nor a store "
    "(a SQLite file, or a postgresql:// URL)"
)


def add_parser(commands: Any) -> None:
    """Register `inspect` and its arguments."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "inspect",
        help="show the loops of an event log or a store, or one loop's timeline",
        description=(
            "Read an event log (Runtime(event_log=...)) or a durable store (a "
            "SQLite file, or a postgresql:// URL; read only) and print a table of "
            "its loops; with --loop, that loop's timeline (from a store's records "
            "when it kept no events); with --html, a page with its path diagram "
            "(needs graphviz's `dot`) and timeline."
        ),
    )
    parser.add_argument(
        "events",
        metavar="FILE",
        help="an event log (FILE.jsonl), a SQLite store, or a PostgreSQL URL",
    )
    parser.add_argument(
        "--loop",
        metavar="ID",
        help="a loop's id, its short id (as the table shows it), or any part "
        "of its id that no other loop's has",
    )
    parser.add_argument(
        "--html",
        metavar="OUT.html",
        help="write the loop's page (path diagram and timeline) to this file",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=80,
        metavar="N",
        help="cut long values to N characters in the timeline (default 80)",
    )
    add_schema_argument(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the table or the timeline, or write the page."""
    try:
        with readable(args.events) as (kind, path):
            if kind == "store":
                inspect_store(args)
            else:
                inspect_log(args, path)
    except (AgentFSMError, OSError) as exc:
        # The message may quote the file: loop ids, the text of a line.
        print(f"agentfsm inspect: error: {printable(str(exc))}", file=sys.stderr)
        return 1
    return 0


@contextmanager
def readable(target: str) -> Iterator[tuple[Literal["store", "log"], str]]:
    """What `target` is (a store: a PostgreSQL URL or a SQLite file; else, by
    its first bytes, maybe an event log), and the file to read it from: itself,
    or, for a stream that can be read only once (a pipe, /dev/stdin), a
    private copy of all it held (removed after the block).

    Raises:
        EventLogError: it is neither (empty, a known binary format, not text);
            the message says what it is.
        OSError: it cannot be read.
    """
    if is_store_url(target):
        yield "store", target
        return
    with open(target, "rb") as file:
        if stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            yield kind_of(target, file.read(len(_SQLITE) + 4096)), target
            return
        data = file.read()  # read once: what was read is not there again
    kind = kind_of(target, data)
    if kind == "store":
        raise EventLogError(
            f"{target} is a SQLite database read from a stream (a pipe): give "
            "the store's file itself, which SQLite reads with its -wal file"
        )
    fd, copy = tempfile.mkstemp(prefix="agentfsm-inspect-", suffix=".jsonl")
    try:
        with os.fdopen(fd, "wb") as out:  # mkstemp: its owner's only
            out.write(data)
        yield kind, copy
    finally:
        os.unlink(copy)


def kind_of(target: str, head: bytes) -> Literal["store", "log"]:
    """Whether the file `target`, by its first bytes `head`, is a SQLite
    store or may be an event log.

    Raises:
        EventLogError: it is neither (empty, a known binary format, not text);
            the message says what it is.
    """
    if head.startswith(_SQLITE):
        return "store"
    if not head:
        raise EventLogError(f"{target} is empty: {_NEITHER}")
    what = next((name for magic, name in _KNOWN if head.startswith(magic)), None)
    if what is None and not _text(head[:4096]):
        what = "binary data (not UTF-8 text)"
    if what is not None:
        raise EventLogError(f"{target} is {what}: {_NEITHER}")
    return "log"


def _text(head: bytes) -> bool:
    """Whether `head` (a file's start, maybe cut mid-character) is UTF-8 text."""
    if b"\x00" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


# ---------------------------------------------------------------- event logs


def inspect_log(args: argparse.Namespace, path: str | None = None) -> None:
    """`inspect` of an event log (read from `path`, when it is a copy of
    `args.events`)."""
    skipped: list[int] = []
    events = read_log(args.events, path, skipped)
    if not events:
        # (Torn lines are the ends of events: a file of nothing else is not a log.)
        raise EventLogError(
            f"{args.events} holds no agentfsm event: "
            + (
                f"none of its {len(skipped)} lines is JSON, so it is {_NEITHER}"
                if skipped
                else "it has blank lines only"
            )
        )
    report_skipped(args.events, skipped)
    if args.html is not None:
        loop_id = loop_of(args, events)
        timeline = build_timeline(events, loop_id, width=_HTML_WIDTH)
        write_page(args.html, render_html(timeline, render_svg(timeline.path)))
        print(printable(f"wrote {args.html} (loop {loop_id})", newlines=False))
    elif args.loop is not None:
        loop_id = loop_of(args, events)
        timeline = build_timeline(events, loop_id, width=max(args.width, 10))
        sys.stdout.write(format_timeline(timeline))
    else:
        sys.stdout.write(format_table(summarize(events)))


def read_log(name: str, path: str | None, skipped: list[int]) -> list[AgentEvent]:
    """The events of the log `name` (read from `path`, a copy of it, when
    given), the torn lines skipped added to `skipped`; errors name `name`."""
    path = name if path is None else path
    try:
        return list(read_events(path, on_skip=skipped.append))
    except EventLogError as exc:
        raise EventLogError(str(exc).replace(path, name, 1)) from None


def write_page(path: str, page: str) -> None:
    """Write an HTML page, its owner's only, as the log and the store are: it
    quotes prompts and tool outputs."""
    with open(path, "w", encoding="utf-8", opener=private_opener(0o600)) as html:
        html.write(page)


def report_skipped(path: str, lines: list[int], command: str = "inspect") -> None:
    """Say on stderr which torn lines reading the log skipped, if any."""
    if not lines:
        return
    which = (
        f"line {lines[0]}"
        if len(lines) == 1
        else f"{len(lines)} lines ({', '.join(map(str, lines))})"
    )
    print(
        f"agentfsm {command}: skipped {which} of {printable(path)}: not valid "
        "JSON, torn by a writer killed mid-line",
        file=sys.stderr,
    )


def loop_of(args: argparse.Namespace, events: list[AgentEvent]) -> str:
    """The loop `--loop` picks from the events of `--events` (the only one when
    it is left out), with an error naming the file."""
    try:
        return find_loop(events, args.loop)
    except EventLogError as exc:
        hint = "" if args.loop is not None else " with --loop ID"
        raise EventLogError(f"{args.events}: {exc}{hint}") from None


# -------------------------------------------------------------------- stores


def inspect_store(args: argparse.Namespace) -> None:
    """`inspect` of a store: its loops (as `agentfsm loops` lists them), or
    one loop's timeline or page."""
    wants_loop = args.loop is not None or args.html is not None

    unreadable: list[UnreadableLoop] = []

    async def read(
        store: SQLStore[Any],
    ) -> tuple[list[StoredLoopSummary], list[AgentEvent], StoredReport | None]:
        unreadable.clear()
        if not wants_loop:
            return await store.loops(unreadable=unreadable), [], None
        summary = await read_loop(store, args.loop)
        events = await store.events(summary.loop_id)
        report = None if events else await read_report(store, summary)
        if not events and report is None:
            raise StoreError(f"loop {summary.loop_id} left the store while it was read")
        return [summary], events, report

    loops, events, report = with_store(args.events, args.schema, read)
    now = datetime.now(UTC)
    if not wants_loop:
        sys.stdout.write(format_loops(loops, now, unreadable))
        return
    [summary] = loops
    loop_id = summary.loop_id
    width = _HTML_WIDTH if args.html is not None else max(args.width, 10)
    if args.html is not None:
        if report is not None:
            page = stored_html(
                report, render_svg(LoopPath.of(report.record)), now, width
            )
        else:
            timeline = build_timeline(events, loop_id, width=width)
            page = render_html(timeline, render_svg(timeline.path))
        write_page(args.html, page)
        print(printable(f"wrote {args.html} (loop {loop_id})", newlines=False))
    elif report is not None:
        sys.stdout.write(format_stored(report, now, width))
    else:
        sys.stdout.write(format_timeline(build_timeline(events, loop_id, width=width)))
        state = f"{summary.status.value} in {summary.state.value}"
        line = f"  {state}: {detail(summary, now)}"
        sys.stdout.write(f"\nin the store\n{printable(line, newlines=False)}\n")


async def read_loop(store: SQLStore[Any], given: str | None) -> StoredLoopSummary:
    """The summary of the loop `--loop` names (see `pick_loop`): that loop's
    data only is read, so another's that cannot be read does not matter.

    Raises:
        StoreError: no loop or several match, the loop left the store, or its
            data cannot be read.
    """
    loop_id = pick_loop(await store.loop_ids(), given, store.where)
    unreadable: list[UnreadableLoop] = []
    found = await store.loops(loop_id=loop_id, unreadable=unreadable)
    if unreadable:
        raise StoreError(f"{store.where}: {unreadable[0].reason}")
    if not found:
        raise StoreError(f"loop {loop_id} left the store while it was read")
    return found[0]


def pick_loop(ids: Sequence[str], given: str | None, where: str) -> str:
    """The id of the loop `--loop` names among a store's `ids` (its id, its
    short id, any part of its id no other loop's has; the only one when
    `given` is None).

    Raises:
        StoreError: none matches, or several (the message lists them).
    """
    return match_loop_id(
        ids,
        given,
        f"{where} holds",
        lambda message: StoreError(f"{message} (--loop ID)"),
    )
