"""Large values out of line: each string over `LARGE` characters a commit
carries is written once, as a blob keyed by its digest, and the row's JSON
holds `{"$blob": digest}` in its place.

A large value reaches a commit many times over: a 100 MB answer is the context
item, the model output recorded, the record's `answer`, `turn.message` and
step payload, an earlier record's `turn.output`, and three events. Written
inline, a row held it seven times, and SQLite's row limit (1 GB) stopped a
loop whose answer was ~150 MB. Out of line it is written once (the same
object is one blob, and the same text anywhere is one row of `blobs`), in
chunks, without a copy of it whole: a loop's peak memory stays within a small
multiple of its largest item (`make bench-durable`'s memory table).

Only a commit a journal marks `large` (`Commit.large`: one of the values it
carries is over `LARGE`) takes this path: it serializes through Python data
(`model_dump`, `json.dumps`), slower than the models' own serializer, which
every other commit uses. A row written so is marked (its `outlined` column)
and read back through `inline`.

Images too: an image block's bytes (`ImageBlock.data`, base64 in the data)
go out of line whatever their size, and any commit that carries one is
`large` (`is_large`). An image reaches a store many times over (the user's
message in the context and in `loop.started`, a tool's output in the ledger,
the context and `function_call.completed`, a transition's payload, a request's
copy of the context), and each time a row holds only its reference (`$blob`,
beside the block's digest, media type and size) while `blobs` holds its
base64 once. The blob is the base64 text, keyed by that text's digest like any
other: a value of the data shaped like an image block (a structured answer,
say) reads back exactly as it was, whatever digest it claims; the block's own
validation, as it is read back, checks the bytes against the block's digest.

A dict of the data whose one key is a marker's (`$blob`, or `$literal`: a
user's own value) is wrapped as `{"$literal": ...}`, so that no value is
taken for a reference.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Final

from pydantic import BaseModel

from agentfsm.messages import ImageBlock

__all__ = ("CHUNK", "LARGE", "Outline", "chunks", "digest_of", "inline", "is_large")

LARGE: Final = 1 << 16
"""Strings longer than this (in characters) are written out of line."""

CHUNK: Final = 1 << 20
"""Characters encoded at a time (as a blob is hashed, written, and read)."""

_BLOB: Final = "$blob"
_LITERAL: Final = "$literal"


def chunks(text: str) -> Iterator[bytes]:
    """`text` as UTF-8, `CHUNK` characters at a time (a lone surrogate as its
    code point's bytes: the text comes back as it was)."""
    for at in range(0, len(text), CHUNK):
        yield text[at : at + CHUNK].encode("utf-8", "surrogatepass")


def digest_of(text: str) -> tuple[str, int]:
    """The text's digest (SHA-256 of its UTF-8, hex) and its length in bytes."""
    digest = hashlib.sha256()
    size = 0
    for chunk in chunks(text):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def is_large(*values: Any) -> bool:
    """Whether any of `values` (models, sequences of them, strings) holds a
    string over `LARGE` characters or an image's bytes (what a journal checks
    of what a commit carries: a few items, a model output, ledger entries)."""
    for value in values:
        if isinstance(value, str):
            found = len(value) > LARGE
        elif type(value) is ImageBlock:
            found = value.data is not None
        elif isinstance(value, BaseModel):
            found = is_large(*value.__dict__.values())
        elif isinstance(value, tuple | list | deque):
            found = is_large(*value)
        elif isinstance(value, dict):
            found = is_large(*value.values())
        else:
            found = False
        if found:
            return True
    return False


class Outline:
    """The large strings (and images' bytes) of what one commit serializes:
    `text` gives a model's JSON with references in their place; `blobs` lists
    those the loop's run has not written yet, each once. `known` (by the
    string's identity, the store's for the loop's run) spares hashing a string
    a run wrote already; `written` (the store's for the run too, added to as
    each commit lands) holds the digests its commits wrote, which later ones
    refer to without sending them again."""

    def __init__(
        self,
        known: dict[int, tuple[str, str, int]],
        written: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        self.known = known
        self.written = written
        self.blobs: list[tuple[str, str, int]] = []
        """`(digest, text, bytes)` of each new large string met, once each."""
        self._met: set[str] = set()

    def text(self, model: BaseModel, **options: Any) -> str:
        """`model`'s JSON (`model_dump(mode="json", **options)`), outlined."""
        return self.dumps(model.model_dump(mode="json", **options))

    def dumps(self, data: Any) -> str:
        return json.dumps(self.data(data), ensure_ascii=False, separators=(",", ":"))

    def data(self, value: Any) -> Any:
        """`value` (JSON data) with its large strings replaced by references."""
        kind = type(value)
        if kind is str:
            return {_BLOB: self._digest(value)} if len(value) > LARGE else value
        if kind is dict:
            data = value.get("data")
            if type(data) is str and value.get("type") == "image":
                # An image block's base64: out of line whatever its size. Its
                # text is made anew by each dump, so it is hashed, not `known`
                # (which would keep every copy for as long as the run).
                return {
                    key: {_BLOB: self._new(data, *digest_of(data))}
                    if key == "data"
                    else self.data(item)
                    for key, item in value.items()
                }
            out = {key: self.data(item) for key, item in value.items()}
            if len(out) == 1 and (_BLOB in out or _LITERAL in out):
                return {_LITERAL: out}
            return out
        if kind is list or kind is tuple:
            return [self.data(item) for item in value]
        return value

    def _digest(self, text: str) -> str:
        known = self.known.get(id(text))
        if known is None or known[0] is not text:
            known = self.known[id(text)] = (text, *digest_of(text))
        return self._new(*known)

    def _new(self, text: str, digest: str, size: int) -> str:
        """`digest`, its blob listed if the run has not written it."""
        if digest not in self._met and digest not in self.written:
            self._met.add(digest)
            self.blobs.append((digest, text, size))
        return digest


def inline(value: Any, read: Callable[[str], str]) -> Any:
    """`value` (JSON data of an outlined row) with each reference replaced by
    its text (`read(digest)`)."""
    kind = type(value)
    if kind is dict:
        if len(value) == 1:
            if _BLOB in value:
                return read(value[_BLOB])
            if _LITERAL in value:
                return {
                    key: inline(item, read) for key, item in value[_LITERAL].items()
                }
        return {key: inline(item, read) for key, item in value.items()}
    if kind is list:
        return [inline(item, read) for item in value]
    return value
