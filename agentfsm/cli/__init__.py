"""The `agentfsm` command line: one module per subcommand.

Each subcommand module has `add_parser(subparsers)`, which registers its
arguments and sets `handler` to a function `(args) -> int` (the exit code).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from agentfsm import __version__

from . import diagram, inspect, loops, run, ui

SUBCOMMANDS = (diagram, run, inspect, loops, ui)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="agentfsm",
        description="An explicit state-machine runtime for LLM agent loops.",
    )
    parser.add_argument(
        "--version", action="version", version=f"agentfsm {__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in SUBCOMMANDS:
        command.add_parser(commands)
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
