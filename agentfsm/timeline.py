"""What an event log says about its loops: a table of them, one loop's timeline.

`agentfsm inspect events.jsonl` prints `format_table(summarize(events))`;
`--loop ID` prints `format_timeline(build_timeline(events, ID))`; `--html` writes
`render_html(timeline, svg)`. The same functions work on events recorded any
other way (`agentfsm.testing.EventRecorder`, a bus subscription):

```python
events = list(read_events("events.jsonl"))
print(format_table(summarize(events)))
# a loop by its short id (or any part of its id unique to it):
timeline = build_timeline(events, find_loop(events, "4454f1a2"))
print(format_timeline(timeline))
```

An image (a user message's, a tool output's) is shown by its reference in
text, `[image: image/png, 4,035 bytes, sha256:1a2b3c4d5e6f]`, never by its
bytes; the page shows it as a thumbnail too (`thumbnails`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final, NamedTuple, final

from . import events as ev
from ._images import data_url
from ._paths import LoopPath
from ._text import clip, printable, xml_text
from .exceptions import EventLogError
from .interception import ToolBatch
from .messages import FunctionCallOutputItem, ImageBlock, TokenUsage, UserMessage
from .results import LoopStatus
from .states import LoopState, Outcome

__all__ = (
    "LoopSummary",
    "StateTime",
    "Timeline",
    "TimelineRow",
    "aligned",
    "build_timeline",
    "find_loop",
    "format_table",
    "format_timeline",
    "group_by_loop",
    "match_loop_id",
    "render_html",
    "short_ids",
    "summarize",
    "thumbnails",
)


class LoopSummary(NamedTuple):
    """One loop of a log, in a line."""

    loop_id: str
    agent_id: str
    status: LoopStatus
    outcome: Outcome | None
    """`None` while the loop had not ended when the log was written."""
    model_requests: int
    tool_calls: int
    usage: TokenUsage
    started_at: datetime
    """When its first event was published."""
    last_at: datetime
    """When its last event was published (its end, for a finished loop)."""
    question: str | None = None
    """The user message it started with (`None`: it continued its context)."""
    answer: str | None = None
    """The answer it published, if any."""
    forked_from: ev.ForkOrigin | None = None
    """For a fork (`agentfsm.replay.fork`): the loop and seq it continues from."""

    @property
    def duration(self) -> float:
        """Seconds from its first event to its last."""
        return (self.last_at - self.started_at).total_seconds()


class TimelineRow(NamedTuple):
    """One line of a loop's timeline."""

    seq: int
    elapsed: float
    """Seconds since the loop's first event."""
    kind: str
    """`started`, `intercepted`, `paused`, `resumed`, `transition`, `inference`,
    `tool`, `progress`, `answer`, `failed` or `idle`."""
    text: str
    images: tuple[ImageBlock, ...] = ()
    """The images the row's text refers to (a message's, a tool output's), in
    order: the text shows each by its reference, a page as a thumbnail."""


class StateTime(NamedTuple):
    """How long a loop spent in one state, over all its visits."""

    state: LoopState
    visits: int
    seconds: float


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """One loop's story: summary, path, time per state, and what happened when."""

    summary: LoopSummary
    path: LoopPath
    states: tuple[StateTime, ...]
    """The states visited, in `LoopState` order."""
    rows: tuple[TimelineRow, ...]
    answer: str | None
    """The published answer, in full."""
    forks: tuple[str, ...] = ()
    """The ids of the loops forked from this one, in the events given."""


def group_by_loop(events: Iterable[ev.AgentEvent]) -> dict[str, list[ev.AgentEvent]]:
    """The events of each loop in `seq` order; loops in order of their first event."""
    loops: dict[str, list[ev.AgentEvent]] = {}
    for event in events:
        loops.setdefault(event.loop_id, []).append(event)
    for mine in loops.values():
        mine.sort(key=lambda e: e.seq)
    return loops


def find_loop(events: Iterable[ev.AgentEvent], prefix: str | None = None) -> str:
    """The id of the one loop whose id is `prefix` or contains it.

    Loop ids are UUIDv7: ids made close together share their start (a
    timestamp) and differ at their end (random), so a short id is best taken
    from the end, as `short_ids` does; any part unique to one loop works.

    Args:
        events: events of one or more loops.
        prefix: the loop's id or any part of it (its start, its end, its
            middle); `None` picks the only loop there is.

    Raises:
        EventLogError: no loop, or several, match (the message lists them).
    """
    ids = [e.loop_id for e in events]
    return match_loop_id(ids, prefix, "the events hold", EventLogError)


def match_loop_id(
    ids: Iterable[str],
    given: str | None,
    holder: str,
    error: Callable[[str], Exception],
) -> str:
    """The one id of `ids` that is `given` or contains it (the only one when
    `given` is None), as `find_loop` picks one; `holder` starts the message
    that lists them ("the events hold", "loops.db holds") and `error` makes
    the exception raised when none or several match."""
    ids = list(dict.fromkeys(ids))
    known = ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else "")
    if given is None:
        if len(ids) == 1:
            return ids[0]
        raise error(
            f"{holder} {len(ids)} loops ({known}); say which one"
            if ids
            else f"{holder} no loop"
        )
    if given in ids:
        return given
    matches = [i for i in ids if given in i] if given else []
    if len(matches) == 1:
        return matches[0]
    if matches:
        shorts = short_ids(ids)
        listed = ", ".join(shorts[i] for i in matches[:10])
        raise error(
            f"{len(matches)} loops have {given!r} in their id; say which one by "
            f"its short id (the end of its id): {listed}"
            f"{' ...' if len(matches) > 10 else ''}"
        )
    raise error(f"no loop id contains {given!r} (loops: {known or 'none'})")


_SHORT_ID: Final = 8
"""The fewest characters of a short id."""


def short_ids(ids: Iterable[str]) -> dict[str, str]:
    """Each id's short form: its shortest end (of `_SHORT_ID` characters at
    least) that no other id contains, which `find_loop` finds it by (the whole
    id when every end is in another id)."""
    unique = list(dict.fromkeys(ids))
    sizes = {loop_id: min(_SHORT_ID, len(loop_id)) for loop_id in unique}
    pending = [i for i in unique if sizes[i] < len(i)]
    # One round per end length still in question: count in how many ids each
    # substring of that length occurs, once over all ids (not once per id and
    # other id, which was quadratic). An end only its own id holds is unique.
    while pending:
        holders = {size: _holders(unique, size) for size in {sizes[i] for i in pending}}
        left = []
        for loop_id in pending:
            size = sizes[loop_id]
            if holders[size][loop_id[-size:]] > 1:
                sizes[loop_id] = size + 1
                if size + 1 < len(loop_id):
                    left.append(loop_id)
        pending = left
    return {loop_id: loop_id[-sizes[loop_id] :] for loop_id in unique}


def _holders(ids: Sequence[str], size: int) -> Counter[str]:
    """How many of `ids` hold each substring of `size` characters."""
    counts: Counter[str] = Counter()
    for loop_id in ids:
        counts.update({loop_id[k : k + size] for k in range(len(loop_id) - size + 1)})
    return counts


def summarize(events: Iterable[ev.AgentEvent]) -> list[LoopSummary]:
    """One summary per loop, in order of their first event."""
    return [_summary(mine) for mine in group_by_loop(events).values()]


def _summary(mine: Sequence[ev.AgentEvent]) -> LoopSummary:
    first, last = mine[0], mine[-1]
    idle = next((e for e in reversed(mine) if isinstance(e, ev.LoopIdle)), None)
    if idle is not None:
        requests, calls, usage = idle.model_requests, idle.tool_calls, idle.usage
    else:  # not ended: count what the log holds
        completed = [e for e in mine if isinstance(e, ev.InferenceCompleted)]
        requests = len(completed)
        calls = sum(isinstance(e, ev.FunctionCallCompleted) for e in mine)
        usage = TokenUsage()
        for e in completed:
            reported = e.output.token_usage
            usage = usage + (reported or TokenUsage(unreported_requests=1))
    return LoopSummary(
        loop_id=first.loop_id,
        agent_id=first.agent_id,
        status=_status(mine),
        outcome=idle.outcome if idle is not None else None,
        model_requests=requests,
        tool_calls=calls,
        usage=usage,
        started_at=first.ts,
        last_at=last.ts,
        question=next(
            (
                e.message.shown()
                for e in mine
                if isinstance(e, ev.LoopStarted) and e.message is not None
            ),
            None,
        ),
        answer=next(
            (
                e.message.content
                for e in reversed(mine)
                if isinstance(e, ev.ModelAnswer)
            ),
            None,
        ),
        forked_from=first.forked_from if isinstance(first, ev.LoopStarted) else None,
    )


def _status(mine: Sequence[ev.AgentEvent]) -> LoopStatus:
    for event in reversed(mine):
        if isinstance(event, ev.LoopIdle):
            return LoopStatus.done
        if isinstance(event, ev.LoopPaused):
            return LoopStatus.paused
        if isinstance(event, ev.LoopResumed | ev.LoopTransition):
            return LoopStatus.running
    return LoopStatus.running


def build_timeline(
    events: Iterable[ev.AgentEvent], loop_id: str, *, width: int = 80
) -> Timeline:
    """The timeline of one loop.

    Args:
        events: events of one or more loops.
        loop_id: the loop's full id (see `find_loop` for prefixes).
        width: long values (arguments, outputs, messages) are cut to this many
            characters.

    Raises:
        EventLogError: the events hold no loop `loop_id`.
    """
    loops = group_by_loop(events)
    mine = loops.get(loop_id)
    if not mine:
        raise EventLogError(f"the events hold no loop {loop_id!r}")
    forks = tuple(
        other
        for other, theirs in loops.items()
        if isinstance(theirs[0], ev.LoopStarted)
        and theirs[0].forked_from is not None
        and theirs[0].forked_from.loop_id == loop_id
    )
    start = mine[0].ts
    rows: list[TimelineRow] = []
    time_in: dict[LoopState, float] = {}
    visits: dict[LoopState, int] = {LoopState.idle: 1}
    state, entered = LoopState.idle, start
    chunks = steps = 0
    answer: str | None = None
    for event in mine:
        text: str | None = None
        match event:
            case ev.LoopTransition():
                spent = (event.ts - entered).total_seconds()
                time_in[state] = time_in.get(state, 0.0) + spent
                state, entered = event.dest, event.ts
                visits[state] = visits.get(state, 0) + 1
                steps += 1
                text = f"{_transition(steps, event)}  [{_seconds(spent)} in {event.source}]"
            case ev.InferenceStream():
                chunks += 1
            case ev.InferenceCompleted():
                text = _inference(event, chunks, width)
                chunks = 0
            case ev.ModelAnswer():
                answer = event.message.content
                text = _quote(answer, width)
            case _:
                text = _describe(event, width)
        if text is not None:
            elapsed = (event.ts - start).total_seconds()
            # A row quotes model and tool names and call ids as the log has them.
            rows.append(
                TimelineRow(
                    event.seq, elapsed, _kind(event), _field(text), _images(event)
                )
            )
    summary = _summary(mine)
    if summary.status is not LoopStatus.done:  # still in `state` when the log ends
        spent = (mine[-1].ts - entered).total_seconds()
        time_in[state] = time_in.get(state, 0.0) + spent
    return Timeline(
        summary=summary,
        path=LoopPath.from_events(mine, loop_id),
        states=tuple(
            StateTime(s, visits[s], time_in.get(s, 0.0))
            for s in LoopState
            if s in visits
        ),
        rows=tuple(rows),
        answer=answer,
        forks=forks,
    )


_KINDS = {
    "loop.started": "started",
    "transition.intercepted": "intercepted",
    "loop.paused": "paused",
    "loop.resumed": "resumed",
    "loop.transition": "transition",
    "inference.completed": "inference",
    "function_call.started": "tool",
    "function_call.completed": "tool",
    "function_call.progress": "progress",
    "model.answer": "answer",
    "loop.failed": "failed",
    "loop.idle": "idle",
}


def _kind(event: ev.AgentEvent) -> str:
    return _KINDS.get(event.type, event.type)


def _transition(step: int, event: ev.LoopTransition) -> str:
    text = f"#{step} {event.source} --{event.trigger}--> {event.dest}"
    if event.rewritten_from is not None:
        text += f" (rewritten from {event.rewritten_from})"
    return text


def _inference(event: ev.InferenceCompleted, chunks: int, width: int) -> str:
    output = event.output
    parts = [event.model + (f" (streamed, {chunks} chunks)" if chunks else "")]
    calls = output.function_calls
    if calls:
        parts.append(
            "calls "
            + ", ".join(_short(f"{c.name}({c.arguments})", width) for c in calls)
        )
    if output.message is not None and output.message.content:
        parts.append("message " + _quote(output.message.content, width))
    if output.images_described:
        parts.append(f"{_count(len(output.images_described), 'image')} sent as text")
    u = output.token_usage
    if u is None:
        parts.append("tokens unknown (not reported)")
    else:
        parts.append(f"{u.input_tokens} in + {u.output_tokens} out tokens")
    return "; ".join(parts)


def _describe(event: ev.AgentEvent, width: int) -> str | None:
    """The text of a row for the other events (`None`: no row)."""
    match event:
        case ev.LoopStarted(message=message):
            said = (
                "continues its context"
                if message is None
                else _quote(message.shown(), width)
            )
            mode = ", streaming" if event.streaming else ""
            return f"{said} on {event.model}{mode}"
        case ev.TransitionIntercepted():
            who = "resume" if event.handler < 0 else f"handler {event.handler}"
            text = f"{event.source} --{event.trigger}--> {event.dest}: {event.decision}"
            if event.decision == "rewrite" and event.new_dest not in (None, event.dest):
                text += f" to {event.new_dest}"
            if event.reason:
                text += f" ({_short(event.reason, width)})"
            if event.decision == "rewrite" and event.payload is not None:
                text += f"; payload {_payload(event.payload, width)}"
            return f"{text} [{who}]"
        case ev.LoopPaused():
            return (
                f"before {event.source} --{event.trigger}--> {event.dest}: "
                f"{_short(event.reason, width)}"
            )
        case ev.LoopResumed():
            return f"with {event.decision}"
        case ev.FunctionCallStarted():
            return None  # shown with its output, once completed
        case ev.FunctionCallCompleted():
            call, out = event.call, event.output
            result = ("error: " if out.is_error else "") + _output(out, width)
            args = _short(call.arguments, width)
            return f"{call.name}({args}) -> {result}  [{_seconds(event.duration)}]"
        case ev.FunctionCallProgress():
            return f"{event.call_id}: {_short(str(event.progress), width)}"
        case ev.LoopFailed():
            return f"{event.error_type}: {_short(event.message, width)}"
        case ev.LoopIdle():
            reason = f" ({_short(event.reason, width)})" if event.reason else ""
            return f"{event.outcome}{reason}"
    return None


def _payload(payload: ev.EventPayload, width: int) -> str:
    match payload:
        case UserMessage():
            return _quote(payload.shown(), width)
        case tuple():
            return ", ".join(_quote(m.shown(), width) for m in payload)
        case ToolBatch():
            calls = ", ".join(
                f"{c.name}({_short(c.arguments, width)})" for c in payload.calls
            )
            denied = "".join(
                f"; denied {k}: {_short(v, width)}" for k, v in payload.denied.items()
            )
            return f"calls {calls}{denied}"
        case ev.RequestSummary():
            return f"request to {payload.model}"
    return _quote(payload.content, width)


def _output(out: FunctionCallOutputItem, width: int) -> str:
    """A tool's output as a row shows it: its text cut to `width`, then each
    of its images by its reference (never cut: a reference is short)."""
    shown = [_short(out.output, width)] if out.output or not out.images else []
    return " ".join((*shown, *(image.reference for image in out.images)))


def _images(event: ev.AgentEvent) -> tuple[ImageBlock, ...]:
    """The images the event's row refers to (its message's, its output's)."""
    match event:
        case ev.LoopStarted(message=UserMessage() as message):
            return message.images
        case ev.FunctionCallCompleted():
            return event.output.images
        case ev.TransitionIntercepted(decision="rewrite", payload=payload):
            if isinstance(payload, UserMessage):
                return payload.images
            if isinstance(payload, tuple):
                return tuple(image for m in payload for image in m.images)
    return ()


def _field(text: str) -> str:
    """An id, a name or a row on one line, `printable`."""
    return printable(text, newlines=False)


def _short(text: str, width: int) -> str:
    """One `printable` line, cut to `width` characters with an ellipsis."""
    return clip(printable(" ".join(text.split()), newlines=False), width)


def _quote(text: str, width: int) -> str:
    return '"' + _short(text, width) + '"'


def _when(ts: datetime) -> str:
    return ts.isoformat(sep=" ", timespec="milliseconds")


def _seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.3f}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:06.3f}s"


# ---------------------------------------------------------------------- text


def _outcome(summary: LoopSummary) -> str:
    return (
        str(summary.outcome) if summary.outcome is not None else f"({summary.status})"
    )


_QUOTE_WIDTH: Final = 32
"""How much of a question or an answer the table shows."""


def format_table(summaries: Sequence[LoopSummary]) -> str:
    """The loops as a table: short id, agent, outcome, turns, tool calls, tokens,
    duration, question and answer (`--loop` takes the short id)."""
    header = (
        "LOOP",
        "AGENT",
        "OUTCOME",
        "TURNS",
        "TOOLS",
        "TOKENS",
        "TIME",
        "QUESTION",
        "ANSWER",
    )
    shorts = short_ids(s.loop_id for s in summaries)
    rows = [
        _cells(
            shorts[s.loop_id],
            s.agent_id,
            _outcome(s),
            str(s.model_requests),
            str(s.tool_calls),
            _tokens_cell(s.usage),
            _seconds(s.duration),
            _line(s.question) if s.forked_from is None else _fork_cell(s, shorts),
            _line(s.answer),
        )
        for s in summaries
    ]
    # Turns to time are right-aligned; the rest is text.
    lines = aligned(header, rows, numbers=range(3, 7))
    return "\n".join((*lines, _count(len(rows), "loop"))) + "\n"


def aligned(
    header: Sequence[str], rows: Sequence[Sequence[str]], numbers: range
) -> list[str]:
    """A table's lines: `header` then `rows`, columns two spaces apart, each
    as wide as its widest cell, those in `numbers` right-aligned."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    return [
        "  ".join(
            cell.rjust(w) if i in numbers else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in (header, *rows)
    ]


def _cells(*cells: str) -> tuple[str, ...]:
    """A row of the table, each cell one `printable` line."""
    return tuple(map(_field, cells))


def _fork_cell(summary: LoopSummary, shorts: dict[str, str]) -> str:
    """A fork's question cell: where it was forked from (`fork of 4454f1a2@7`)."""
    origin = summary.forked_from
    assert origin is not None
    parent = shorts.get(origin.loop_id, origin.loop_id[:8])
    return f"fork of {parent}@{origin.seq}"


def _line(text: str | None) -> str:
    """A question or answer on one line of the table, cut to `_QUOTE_WIDTH`."""
    return "-" if text is None else _short(text, _QUOTE_WIDTH)


def _tokens_cell(usage: TokenUsage) -> str:
    """The table's TOKENS: `unknown` when no request reported usage, `15+`
    when only some did."""
    status = usage.status
    if status == "unknown":
        return "unknown"
    return f"{usage.total_tokens}{'+' if status == 'partial' else ''}"


def _totals(summary: LoopSummary) -> str:
    u = summary.usage
    counts = (
        f"{_count(summary.model_requests, 'model request')}, "
        f"{_count(summary.tool_calls, 'tool call')}, "
    )
    if u.status == "unknown":
        return f"{counts}tokens unknown (not reported)"
    noun = "token" if u.total_tokens == 1 else "tokens"
    detail = f"{u.input_tokens} in, {u.output_tokens} out"
    if u.unreported_requests:
        detail += f"; {_count(u.unreported_requests, 'request')} reported none"
    return f"{counts}{_tokens_cell(u)} {noun} ({detail})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _path_text(path: LoopPath) -> str:
    return " -> ".join((LoopState.idle, *(step.dest for step in path.steps)))


def format_timeline(timeline: Timeline) -> str:
    """One loop as text: summary, path, time in each state, timeline, answer."""
    s = timeline.summary
    lines = [
        f"loop {_field(s.loop_id)}",
        f"  agent     {_field(s.agent_id)}",
        f"  outcome   {_outcome(s)}",
        f"  totals    {_totals(s)}",
        f"  started   {_when(s.started_at)}, lasted {_seconds(s.duration)}",
        f"  path      {_path_text(timeline.path)}",
    ]
    if s.forked_from is not None:
        origin = s.forked_from
        lines.append(f"  forked    from {_field(origin.loop_id)} at seq {origin.seq}")
    if timeline.forks:
        lines.append(f"  forks     {_field(', '.join(timeline.forks))}")
    lines.extend(("", "time in state"))
    width = max(len(t.state) for t in timeline.states)
    lines.extend(
        f"  {t.state:<{width}}  {t.visits:>3}x  {_seconds(t.seconds):>9}"
        for t in timeline.states
    )
    lines.extend(("", "timeline"))
    lines.extend(
        f"  {'+' + _seconds(r.elapsed):>9}  {r.kind:<11}  {r.text}"
        for r in timeline.rows
    )
    if timeline.answer is not None:
        lines.extend(
            (
                "",
                "answer",
                *(f"  {printable(line)}" for line in timeline.answer.splitlines()),
            )
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- html

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.8em; }
table { border-collapse: collapse; } td, th { padding: .2em .8em .2em 0;
        text-align: left; vertical-align: top; }
th { color: #555; font-weight: 600; } .num { text-align: right; }
.timeline td:nth-child(3) { font-family: ui-monospace, monospace;
        white-space: pre-wrap; word-break: break-word; }
.k-transition { color: #1f3fbf; } .k-intercepted, .k-paused, .k-resumed { color: #b35c00; }
.k-failed { color: #b00020; } .k-answer, .k-idle { color: #087f23; }
figure { margin: 0; overflow-x: auto; } figure svg { max-width: 100%; height: auto; }
pre { white-space: pre-wrap; background: #f6f6f6; padding: .8em; }
.thumbs { display: flex; flex-wrap: wrap; gap: .4em; margin-top: .3em; }
.thumbs img { max-width: 160px; max-height: 160px; border: 1px solid #ccc; }
"""


def thumbnails(images: Iterable[ImageBlock]) -> str:
    """The images as a page shows them: each held as bytes a thumbnail of its
    own (a `data:` URL: the page is one file), its reference as its alt text
    and title; an image by URL is left to the reference the text shows (a
    page read from a file fetches nothing)."""
    # base64 in a data: URL holds nothing an attribute would need escaped.
    shown = "".join(
        f'<img src="{data_url(image.media_type, image.data)}" '
        f'alt="{xml_text(image.reference)}" title="{xml_text(image.reference)}">'
        for image in images
        if image.data is not None and image.media_type is not None
    )
    return f"<div class=thumbs>{shown}</div>" if shown else ""


def render_html(timeline: Timeline, svg: str) -> str:
    """One self-contained page: the loop's summary, path diagram and timeline.

    Args:
        timeline: from `build_timeline` (a `width` of a few hundred suits a page).
        svg: the path diagram, `agentfsm.diagrams.render_svg(timeline.path)`;
            it is inlined (its XML prolog dropped).
    """
    s = timeline.summary
    e = xml_text  # the page is XML-valid too: no character XML forbids
    start = svg.find("<svg")
    figure = svg[start:] if start >= 0 else svg
    summary = "".join(
        f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>"
        for k, v in (
            ("agent", s.agent_id),
            ("outcome", _outcome(s)),
            ("totals", _totals(s)),
            ("started", _when(s.started_at)),
            ("lasted", _seconds(s.duration)),
            ("path", _path_text(timeline.path)),
        )
    )
    states = "".join(
        f"<tr><td>{e(t.state)}</td><td class=num>{t.visits}</td>"
        f"<td class=num>{e(_seconds(t.seconds))}</td></tr>"
        for t in timeline.states
    )
    rows = "".join(
        f'<tr class="k-{e(r.kind)}"><td class=num>+{e(_seconds(r.elapsed))}</td>'
        f"<td>{e(r.kind)}</td><td>{e(r.text)}{thumbnails(r.images)}</td></tr>"
        for r in timeline.rows
    )
    answer = (
        ""
        if timeline.answer is None
        else f"<h2>Answer</h2><pre>{e(timeline.answer)}</pre>"
    )
    return (
        "<!DOCTYPE html>\n<html lang=en>\n<head>\n<meta charset=utf-8>\n"
        f"<title>agentfsm loop {e(s.loop_id)}</title>\n<style>{_CSS}</style>\n"
        "</head>\n<body>\n"
        f"<h1>Loop <code>{e(s.loop_id)}</code></h1>\n"
        f"<table class=summary>{summary}</table>\n"
        f"<h2>Path</h2>\n<figure>\n{figure.strip()}\n</figure>\n"
        "<h2>Time in state</h2>\n<table><tr><th>state</th><th class=num>visits</th>"
        f"<th class=num>time</th></tr>{states}</table>\n"
        "<h2>Timeline</h2>\n<table class=timeline><tr><th class=num>time</th>"
        f"<th>event</th><th>what</th></tr>{rows}</table>\n"
        f"{answer}\n</body>\n</html>\n"
    )
