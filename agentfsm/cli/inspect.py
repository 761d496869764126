"""`agentfsm inspect`: what an event log says about its loops.

```sh
agentfsm inspect events.jsonl                      # a table of the loops
agentfsm inspect events.jsonl --loop 4454f1a2      # one loop's timeline (its short id)
agentfsm inspect events.jsonl --loop 4454f1a2 --html loop.html
```

The work is done by `agentfsm.timeline`; this module only parses arguments,
reads the log and prints. Torn lines (a writer killed mid-line) are
skipped, and stderr says which.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from agentfsm._text import printable
from agentfsm.diagrams import render_svg
from agentfsm.eventlog import _private_opener, read_events
from agentfsm.events import AgentEvent
from agentfsm.exceptions import AgentFSMError, EventLogError
from agentfsm.timeline import (
    build_timeline,
    find_loop,
    format_table,
    format_timeline,
    render_html,
    summarize,
)

_HTML_WIDTH = 400
"""Values are cut later on a page than in a terminal."""


def add_parser(commands: Any) -> None:
    """Register `inspect` and its arguments."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "inspect",
        help="show the loops of an event log, or one loop's timeline",
        description=(
            "Read an event log (Runtime(event_log=...)) and print a table of its "
            "loops; with --loop, that loop's timeline; with --html, a page with "
            "its path diagram (needs graphviz's `dot`) and timeline."
        ),
    )
    parser.add_argument("events", metavar="FILE.jsonl", help="the event log")
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
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the table or the timeline, or write the page."""
    skipped: list[int] = []
    try:
        events = list(read_events(args.events, on_skip=skipped.append))
        report_skipped(args.events, skipped)
        if args.html is not None:
            loop_id = loop_of(args, events)
            timeline = build_timeline(events, loop_id, width=_HTML_WIDTH)
            page = render_html(timeline, render_svg(timeline.path))
            # Its owner's only, as the log is: it quotes prompts and tool outputs.
            with open(
                args.html, "w", encoding="utf-8", opener=_private_opener(0o600)
            ) as html:
                html.write(page)
            print(printable(f"wrote {args.html} (loop {loop_id})", newlines=False))
        elif args.loop is not None:
            loop_id = loop_of(args, events)
            timeline = build_timeline(events, loop_id, width=max(args.width, 10))
            sys.stdout.write(format_timeline(timeline))
        else:
            sys.stdout.write(format_table(summarize(events)))
    except (AgentFSMError, OSError) as exc:
        # The message may quote the log: loop ids, the text of a line.
        print(f"agentfsm inspect: error: {printable(str(exc))}", file=sys.stderr)
        return 1
    return 0


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
