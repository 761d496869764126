"""`agentfsm diagram`: print the loop machine as a mermaid diagram."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from agentfsm.diagrams import render_markdown, render_mermaid


def add_parser(commands: Any) -> None:
    """Register `diagram` and its arguments."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "diagram", help="print the loop machine as a mermaid diagram"
    )
    parser.add_argument(
        "--markdown", action="store_true", help="wrap it in a markdown page"
    )
    parser.add_argument("-o", "--output", help="write to this file instead of stdout")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print (or write) the diagram."""
    text = render_markdown() if args.markdown else render_mermaid()
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
