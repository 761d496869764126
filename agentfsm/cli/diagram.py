"""`agentfsm diagram`: draw the loop machine, or the path one loop took.

```sh
agentfsm diagram                                  # the machine, mermaid
agentfsm diagram --format svg -o loop.svg         # the machine, SVG (graphviz)
agentfsm diagram --events events.jsonl --loop 4454f1a2 --format png -o path.png
```
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

from agentfsm._arguments import private_opener
from agentfsm._text import printable
from agentfsm.diagrams import (
    LoopPath,
    render_dot,
    render_markdown,
    render_mermaid,
    render_path_mermaid,
    render_png,
    render_svg,
)
from agentfsm.exceptions import AgentFSMError, StoreError
from agentfsm.store import SQLStore

from .inspect import loop_of, read_log, read_loop, readable, report_skipped
from .loops import add_schema_argument, with_store

FORMATS = ("mermaid", "dot", "svg", "png")


def add_parser(commands: Any) -> None:
    """Register `diagram` and its arguments."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "diagram",
        help="draw the loop machine, or one loop's path (mermaid, DOT, SVG, PNG)",
        description=(
            "Draw the loop machine, or, with --events, the path one loop took: "
            "visited states highlighted, each edge it took labelled with the steps "
            "that took it. SVG and PNG need graphviz's `dot` program."
        ),
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="mermaid",
        help="mermaid (default) or DOT text, or SVG or PNG drawn by graphviz",
    )
    parser.add_argument(
        "--events",
        metavar="FILE",
        help="an event log (FILE.jsonl), a SQLite store, or a PostgreSQL URL; "
        "draw one loop's path",
    )
    parser.add_argument(
        "--loop",
        metavar="ID",
        help="the loop to draw (its id, its short id, or any part of its id unique to it); "
        "may be left out when the log holds one loop",
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="the machine as a markdown page with a mermaid block",
    )
    parser.add_argument("-o", "--output", help="write to this file instead of stdout")
    add_schema_argument(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Draw and print (or write) the diagram."""
    problem = _usage_problem(args)
    if problem is not None:
        print(f"agentfsm diagram: error: {problem}", file=sys.stderr)
        return 2
    try:
        drawing = _draw(args)
        if args.output:
            _write(Path(args.output), drawing)
        elif isinstance(drawing, bytes):
            sys.stdout.buffer.write(drawing)
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(drawing)
    except (AgentFSMError, OSError) as exc:
        # The message may quote the log or graphviz's complaint about a label.
        print(f"agentfsm diagram: error: {printable(str(exc))}", file=sys.stderr)
        return 1
    return 0


def _usage_problem(args: argparse.Namespace) -> str | None:
    if args.loop is not None and args.events is None:
        return "--loop needs --events FILE.jsonl (the log to find the loop in)"
    if args.markdown and (args.format != "mermaid" or args.events is not None):
        return (
            "--markdown draws the machine in mermaid; leave out --format and --events"
        )
    if args.format == "png" and not args.output and sys.stdout.isatty():
        return "not writing PNG to a terminal: add -o FILE.png (or redirect stdout)"
    return None


def _draw(args: argparse.Namespace) -> str | bytes:
    path: LoopPath | None = None
    if args.events is not None:
        path = _loop_path(args)
    match args.format:
        case "mermaid" if path is None:
            return render_markdown() if args.markdown else render_mermaid()
        case "mermaid":
            assert path is not None
            return render_path_mermaid(path)
        case "dot":
            return render_dot(path)
        case "svg":
            return render_svg(path)
        case _:
            return render_png(path)


def _loop_path(args: argparse.Namespace) -> LoopPath:
    """The path of the loop `--loop` names in `--events`: an event log, or a
    store (told apart as `inspect` tells them), its path from its record."""
    with readable(args.events) as (kind, source):
        if kind == "store":
            return with_store(args.events, args.schema, partial(_stored, args.loop))
        skipped: list[int] = []
        events = read_log(args.events, source, skipped)
        report_skipped(args.events, skipped, "diagram")  # on stderr, as inspect does
        return LoopPath.from_events(events, loop_of(args, events))


async def _stored(given: str | None, store: SQLStore[Any]) -> LoopPath:
    summary = await read_loop(store, given)
    stored = await store.load(summary.loop_id)
    if stored is None:
        raise StoreError(f"loop {summary.loop_id} left the store while it was read")
    return LoopPath.of(stored.record)


def _write(target: Path, drawing: str | bytes) -> None:
    # Created 0600: a drawing of a log names its agents and quotes its pauses.
    data = drawing if isinstance(drawing, bytes) else drawing.encode("utf-8")
    with open(target, "wb", opener=private_opener(0o600)) as file:
        file.write(data)
