"""Untrusted text made safe for each place it goes: one module for every sink.

Text reaches a loop from parties agentfsm does not trust: a model's output, a
tool's output, an MCP server, a file read back. Each sink it goes to has its
own rules, and each rule lives here:

- **Lone surrogates** (`"\\udcff"`: `os.listdir` of a non-UTF-8 file name, a
  `\\ud800` escape in a model server's JSON) cannot be encoded as UTF-8, so no
  JSON sink (event log, stores, spans, Temporal payloads, the provider's next
  request) can write them. `encodable` escapes each one as the six characters
  `json.dumps(ensure_ascii=True)` writes for it (`\\udcff`): the text stays
  readable, says where the bad code point was, and encodes everywhere. The
  loop applies it where text enters (model output, tool output, user input,
  error messages), so the model, the store and the event log see the same text.
- **The terminal**: `printable` renders control characters (ESC, OSC, C1,
  bidirectional overrides) visibly, so a model cannot write to a clipboard,
  retitle a window or forge earlier lines.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, MutableMapping
from typing import Annotated, Any, Final, TypeAlias

from pydantic import AfterValidator, BaseModel
from pydantic_core import PydanticSerializationError, to_json

from ._models import json_of

__all__ = (
    "EncodableStr",
    "encodable",
    "encodable_data",
    "json_text",
    "model_json",
    "printable",
    "printable_log",
)

_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def encodable(text: str) -> str:
    """`text` with each lone surrogate escaped as `\\udcff` (what
    `json.dumps(ensure_ascii=True)` writes for it), so that it encodes as
    UTF-8; `text` itself when it has none.

    ASCII text, the common case, costs one flag test (`str.isascii` is O(1) in
    CPython); other text one regex scan, without a copy unless it holds one.
    """
    if text.isascii() or _SURROGATE.search(text) is None:
        return text
    return _SURROGATE.sub(_escape, text)


EncodableStr: TypeAlias = Annotated[str, AfterValidator(encodable)]
"""A str field of a model built from untrusted text (a context item, a pause
reason): validating it escapes its lone surrogates."""


def encodable_data(value: Any) -> Any:
    """`value` with `encodable` applied to every string in it: JSON-like data
    (dict keys included, a list or tuple kept of its type), a model (rebuilt
    from its JSON data, as a sink would read it back) or a dataclass of them.
    What a sink writes when text did not enter through a loop (a model built
    without validation)."""
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, dict):
        return {encodable_data(k): encodable_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [encodable_data(v) for v in value]
        if hasattr(value, "_fields"):  # a NamedTuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, BaseModel):
        data = encodable_data(value.model_dump(mode="json"))
        return type(value).model_validate(data)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: encodable_data(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.init
        }
        return dataclasses.replace(value, **changes)
    return value


def json_text(value: Any) -> str:
    """`value` as text: a str as it is (made `encodable`), anything else as
    JSON, its lone surrogates escaped."""
    if isinstance(value, str):
        return encodable(value)
    try:
        return to_json(value).decode()
    except PydanticSerializationError:  # a lone surrogate (else it raises again)
        return to_json(encodable_data(value)).decode()


def model_json(model: BaseModel) -> str:
    """`model.model_dump_json()`, its lone surrogates escaped as `encodable`
    escapes them: the JSON sinks' fallback for text that did not enter through
    a loop (an agent id, a handler's payload). Costs nothing unless needed."""
    try:
        return json_of(model)
    except PydanticSerializationError:
        return json_text(model.model_dump(mode="json"))


# C0 controls but tab and newline, DEL, C1 controls, the bidirectional
# formatting characters that reorder what a terminal shows (Trojan Source),
# invisible characters and line or paragraph separators that hide or break
# what it shows (not the joiners emoji and some scripts need), and lone
# surrogates.
_CONTROL: Final = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b\u200e\u200f\u2028-\u202e"
    "\u2060-\u2069\ufeff\ud800-\udfff]"
)


def printable_log(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> Mapping[str, Any]:
    """A structlog processor: every str value of a log line `printable` on one
    line (a console renderer prints values as they are, and a tool named by
    an MCP server, or a model, is such a value)."""
    return {
        key: printable(value, newlines=False) if isinstance(value, str) else value
        for key, value in event.items()
    }


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, newlines: bool = True) -> str:
    """`text` safe to print to a terminal: each control character (ESC and the
    sequences it starts, C1 controls, DEL, bidirectional overrides, lone
    surrogates) written as its escape (`\\x1b`, `\\u202e`). Tabs stay; newlines
    (a CRLF too, as a newline) stay unless `newlines` is false (a one-line field: an id, a tool name)."""
    text = _CONTROL.sub(_visible, text.replace("\r\n", "\n"))
    if not newlines and ("\n" in text or "\t" in text):
        text = text.replace("\n", "\\n").replace("\t", "\\t")
    return text


# ----------------------------------------------------------- diagrams and pages

LABEL_LIMIT: Final = 200
"""The most characters of untrusted text a diagram label shows (graphviz
refuses a string over 16 KB; a note that long is unreadable anyway)."""

# What XML 1.0 forbids and `printable` keeps: the noncharacters U+FFFE, U+FFFF.
_NONCHARACTER: Final = re.compile("[\ufffe\uffff]")

_MARKUP: Final = str.maketrans(
    {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#x27;"}
)


def clip(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, the last one an ellipsis when cut."""
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "…"


def xml_safe(text: str, *, newlines: bool = True) -> str:
    """`printable(text, newlines=newlines)` that is also XML 1.0 character
    data: U+FFFE and U+FFFF escaped too (`printable` escapes the other
    characters XML forbids, C0 controls and lone surrogates). Markup is left
    as it is: see `xml_text`."""
    return _NONCHARACTER.sub(_visible, printable(text, newlines=newlines))


def xml_text(text: str, *, newlines: bool = True) -> str:
    """`text` safe as an XML or HTML element's content or attribute value:
    `xml_safe`, with `& < > " '` written as entities."""
    return xml_safe(text, newlines=newlines).translate(_MARKUP)


def diagram_label(
    text: str, *, limit: int = LABEL_LIMIT, newlines: bool = False
) -> str:
    """Untrusted text as a diagram's label: on one line (each run of
    whitespace one space) unless `newlines`, `xml_safe` (so an SVG drawn from
    it parses), cut to `limit` characters."""
    if not newlines:
        text = " ".join(text.split())
    return clip(xml_safe(text, newlines=newlines), limit)


def dot_label(text: str, *, limit: int = LABEL_LIMIT) -> str:
    """Untrusted text as a graphviz DOT quoted string, quotes included:
    `diagram_label` keeping its line breaks, `&` written `&amp;` (graphviz
    decodes entities in labels, and `&#0;` would reach the SVG as a character
    XML forbids), backslashes (`\\N` is the node's name) and quotes escaped."""
    label = diagram_label(text, limit=limit, newlines=True).replace("&", "&amp;")
    label = label.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + label.replace("\n", "\\n") + '"'


# What ends a mermaid label or string, starts a directive (`%%{init}%%`) or a
# comment, or is markup; written as mermaid's entity codes (`#37;`).
_MERMAID_SPECIAL: Final = re.compile('["#%&;<>\\[\\]{}`]')
# `end note` closes a note wherever it stands in the note's text.
_END_NOTE: Final = re.compile("(end) (note)", re.IGNORECASE)


def _entity_code(match: re.Match[str]) -> str:
    return f"#{ord(match.group())};"


def mermaid_label(text: str, *, limit: int = LABEL_LIMIT) -> str:
    """Untrusted text as a mermaid label (a note, a state's name, the title):
    `diagram_label`, with the characters that could end the label, start a
    directive, a comment or markup written as mermaid entity codes (`#37;`),
    and `end note` broken by one (`end#32;note`)."""
    label = _MERMAID_SPECIAL.sub(_entity_code, diagram_label(text, limit=limit))
    return _END_NOTE.sub(r"\1#32;\2", label)
