"""The one way the commands put untrusted text (a model's, a tool's, a store's)
on one line of the terminal."""

from __future__ import annotations

from agentfsm._text import clip, printable

__all__ = ("one_line",)


def one_line(text: str, width: int | None = None) -> str:
    """`text` `printable` on one line: newlines and tabs escaped; with `width`,
    each run of whitespace made one space and the text cut to `width`
    characters (a reason or an error in a table, rather than arguments shown
    as they are)."""
    if width is None:
        return printable(text, newlines=False)
    return clip(printable(" ".join(text.split()), newlines=False), width)
