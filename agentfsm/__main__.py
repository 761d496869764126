"""The `agentfsm` command: `python -m agentfsm diagram`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .diagrams import render_markdown, render_mermaid


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = argparse.ArgumentParser(prog="agentfsm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    diagram = commands.add_parser(
        "diagram", help="print the loop machine as a mermaid diagram"
    )
    diagram.add_argument(
        "--markdown", action="store_true", help="wrap it in a markdown page"
    )
    diagram.add_argument("-o", "--output", help="write to this file instead of stdout")
    args = parser.parse_args(argv)
    if args.command == "diagram":
        text = render_markdown() if args.markdown else render_mermaid()
        if args.output:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
