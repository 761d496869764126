"""One loop as a durable store's records tell it (`agentfsm inspect STORE --loop
ID` for a store that kept no events of it): its status, lease, path, model
requests, tool calls, decisions and answer. Records carry no times but the
loop's start, end and decisions, so there is no timeline: a store made with
`events=True` gives one (`agentfsm.timeline`, from its events).

Everything here is the store's text, untrusted: each line `printable`, each
value of the page `xml_text`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from agentfsm._text import printable, xml_text
from agentfsm.inference import InferenceOutput
from agentfsm.record import DecisionEntry, LoopRecord
from agentfsm.results import LoopStatus
from agentfsm.states import LoopState
from agentfsm.store import CallRecord, SQLStore, StoredLoopSummary
from agentfsm.timeline import thumbnails

from ._text import one_line
from .loops import age, detail, lease, tokens

__all__ = ("StoredReport", "format_stored", "read_report", "stored_html")

NO_EVENTS: Final = (
    "no timeline: the store kept no events of this loop (a store made with "
    "events=True keeps them); this is what its records say"
)


@dataclass(frozen=True, slots=True)
class StoredReport:
    """What a store holds of one loop."""

    summary: StoredLoopSummary
    record: LoopRecord
    """Its latest record, path included."""
    outputs: tuple[InferenceOutput | None, ...]
    """Each model request's recorded output, by number from 1 (None: none
    recorded, as for a request in flight when its process stopped)."""
    calls: tuple[CallRecord, ...]
    decisions: tuple[DecisionEntry, ...]


async def read_report(
    store: SQLStore[Any], summary: StoredLoopSummary
) -> StoredReport | None:
    """The loop's report, in a few reads (None: it is gone meanwhile)."""
    loop_id = summary.loop_id
    stored = await store.load(loop_id)
    if stored is None:
        return None
    record = stored.record
    outputs = [
        await store.inference(loop_id, n) for n in range(1, record.model_requests + 1)
    ]
    return StoredReport(
        summary=summary,
        record=record,
        outputs=tuple(outputs),
        calls=tuple(await store.calls(loop_id)),
        decisions=tuple(await store.decisions(loop_id)),
    )


# ------------------------------------------------------------------ sections


def _when(ts: datetime, now: datetime) -> str:
    return f"{ts.isoformat(sep=' ', timespec='milliseconds')} ({age(ts, now)} ago)"


def _head(report: StoredReport, now: datetime, width: int) -> list[tuple[str, str]]:
    """The summary's fields, as (label, value) pairs."""
    s, record = report.summary, report.record
    status = f"{s.status.value} in {s.state.value}"
    if s.status_since is not None:
        status += f", since {_when(s.status_since, now)}"
    fields = [("agent", s.agent_id), ("status", status)]
    pause = record.pause
    if pause is not None:
        edge = f"{pause.source} --{pause.trigger}--> {pause.dest}"
        fields.append(("waits on", f"{edge}: {one_line(pause.reason, width)}"))
        if s.pending_calls:
            fields.append(("calls", ", ".join(s.pending_calls)))
    if s.status is LoopStatus.done:
        fields.append(("outcome", detail(s, now)))
    elif s.status is LoopStatus.running or s.lease_live:
        fields.append(("lease", lease(s, now)))
    u = s.usage
    totals = (
        f"{_count(s.model_requests, 'model request')}, "
        f"{_count(s.tool_calls, 'tool call')}, {tokens(u)} tokens"
    )
    if u.status != "unknown":
        totals += f" ({u.input_tokens} in, {u.output_tokens} out)"
    fields.append(("totals", totals))
    fields.append(("started", _when(s.started_at, now)))
    if s.ended_at is not None:
        fields.append(("ended", _when(s.ended_at, now)))
    fields.append(("path", _path_text(record)))
    return [(label, printable(value, newlines=False)) for label, value in fields]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _path_text(record: LoopRecord) -> str:
    return " -> ".join((LoopState.idle, *(step.dest for step in record.path)))


def _steps(record: LoopRecord) -> list[str]:
    rows = []
    for n, step in enumerate(record.path, 1):
        text = f"#{n} {step.source} --{step.trigger}--> {step.dest}"
        if step.rewritten_from is not None:
            text += f" (rewritten from {step.rewritten_from})"
        rows.append(text)
    return rows


def _requests(report: StoredReport, width: int) -> list[str]:
    rows = []
    for n, output in enumerate(report.outputs, 1):
        if output is None:
            rows.append(f"#{n} no output recorded")
            continue
        parts = []
        if output.function_calls:
            parts.append(
                "calls "
                + ", ".join(
                    one_line(f"{c.name}({c.arguments})", width)
                    for c in output.function_calls
                )
            )
        message = output.message
        if message is not None and message.content:
            parts.append(f'message "{one_line(message.content, width)}"')
        if described := len(output.images_described):
            parts.append(f"{_count(described, 'image')} sent as text")
        usage = output.token_usage
        parts.append(
            "usage unknown"
            if usage is None
            else f"{usage.input_tokens} in + {usage.output_tokens} out tokens"
        )
        rows.append(f"#{n} " + "; ".join(parts))
    return rows


_CALL_STATUS: Final = {
    "started": "started, no output recorded",
    "uncertain": "uncertain (its process stopped during it)",
    "retry": "to run again",
    "done": "done",
}


def _calls(report: StoredReport, width: int) -> list[str]:
    rows = []
    for call in report.calls:
        output = (
            report.outputs[call.request - 1]
            if 0 < call.request <= len(report.outputs)
            else None
        )
        asked = output.function_calls if output is not None else ()
        arguments = (
            asked[call.position].arguments if call.position < len(asked) else "..."
        )
        text = f"{call.tool}({arguments}) [{call.call_id}]: {_CALL_STATUS[call.status]}"
        if call.output is not None:
            error = "error: " if call.output.is_error else ""
            text += f" -> {error}{call.output.output}"
        if call.by is not None:
            text += f" (settled by {call.by})"
        if call.attempt > 1:
            text += f" (attempt {call.attempt})"
        # The images' references after the cut: a long output keeps them shown.
        images = call.output.images if call.output is not None else ()
        rows.append(
            " ".join(
                (one_line(text, width * 2), *(one_line(i.reference) for i in images))
            )
        )
    return rows


def _decisions(report: StoredReport, width: int) -> list[str]:
    rows = []
    for d in report.decisions:
        decision = d.decision
        text = f"{d.source} --{d.trigger}--> {d.dest}: {decision.kind}"
        if decision.dest is not None and decision.dest != d.dest:
            text += f" to {decision.dest}"
        if decision.reason:
            text += f" ({decision.reason})"
        who = "resume" if d.handler is None else f"handler {d.handler}"
        if d.by is not None:
            who += f", by {d.by}"
        when = d.at.isoformat(sep=" ", timespec="milliseconds")
        rows.append(one_line(f"{when}  {text} [{who}]", width * 2))
    return rows


def _answer(record: LoopRecord) -> str | None:
    return None if record.answer is None else record.answer.content


def _sections(report: StoredReport, width: int) -> list[tuple[str, list[str]]]:
    return [
        ("steps", _steps(report.record)),
        ("model requests", _requests(report, width)),
        ("tool calls", _calls(report, width)),
        ("decisions", _decisions(report, width)),
    ]


# ---------------------------------------------------------------------- text


def format_stored(report: StoredReport, now: datetime, width: int = 80) -> str:
    """The loop as text: its summary, then its steps, model requests, tool
    calls, decisions and answer."""
    lines = [f"loop {printable(report.summary.loop_id, newlines=False)}"]
    lines.extend(f"  {label:<9} {value}" for label, value in _head(report, now, width))
    lines.extend(("", f"  {NO_EVENTS}"))
    for title, rows in _sections(report, width):
        if rows:
            lines.extend(("", title, *(f"  {row}" for row in rows)))
    answer = _answer(report.record)
    if answer is not None:
        lines.extend(
            ("", "answer", *(f"  {printable(a)}" for a in answer.splitlines()))
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- html

_CSS: Final = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 72em;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin-top: 1.8em; }
table { border-collapse: collapse; } td, th { padding: .2em .8em .2em 0;
        text-align: left; vertical-align: top; }
th { color: #555; font-weight: 600; } .note { color: #555; }
ol { font-family: ui-monospace, monospace; padding-left: 2em; }
li { white-space: pre-wrap; word-break: break-word; }
figure { margin: 0; overflow-x: auto; } figure svg { max-width: 100%; height: auto; }
pre { white-space: pre-wrap; background: #f6f6f6; padding: .8em; }
.thumbs { display: flex; flex-wrap: wrap; gap: .4em; margin-top: .3em; }
.thumbs img { max-width: 160px; max-height: 160px; border: 1px solid #ccc; }
"""


def stored_html(report: StoredReport, svg: str, now: datetime, width: int = 400) -> str:
    """One self-contained page: the loop's summary, its path diagram (`svg`,
    `agentfsm.diagrams.render_svg(LoopPath.of(record))`, inlined without its XML
    prolog), and the sections of `format_stored`."""
    e = xml_text  # the page is XML-valid too: no character XML forbids
    loop_id = report.summary.loop_id
    start = svg.find("<svg")
    figure = svg[start:] if start >= 0 else svg
    head = "".join(
        f"<tr><th>{e(label)}</th><td>{e(value)}</td></tr>"
        for label, value in _head(report, now, width)
    )
    parts = [
        "<!DOCTYPE html>\n<html lang=en>\n<head>\n<meta charset=utf-8>\n",
        f"<title>agentfsm loop {e(loop_id)}</title>\n<style>{_CSS}</style>\n",
        "</head>\n<body>\n",
        f"<h1>Loop <code>{e(loop_id)}</code></h1>\n",
        f"<table class=summary>{head}</table>\n",
        f"<p class=note>{e(NO_EVENTS)}</p>\n",
        f"<h2>Path</h2>\n<figure>\n{figure.strip()}\n</figure>\n",
    ]
    calls = {
        "tool calls": [
            thumbnails(c.output.images if c.output is not None else ())
            for c in report.calls
        ]
    }
    for title, rows in _sections(report, width):
        if rows:
            # A tool call's row shows its output's images (one row per call).
            shown = calls.get(title, [""] * len(rows))
            items = "".join(
                f"<li>{e(row)}{more}</li>"
                for row, more in zip(rows, shown, strict=True)
            )
            parts.append(f"<h2>{e(title.capitalize())}</h2>\n<ol>{items}</ol>\n")
    answer = _answer(report.record)
    if answer is not None:
        parts.append(f"<h2>Answer</h2><pre>{e(answer)}</pre>\n")
    parts.append("</body>\n</html>\n")
    return "".join(parts)
