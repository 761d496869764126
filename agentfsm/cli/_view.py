"""What `agentfsm run` shows: a loop's events as they come, and a local model loading.

At a terminal a running tool call shows a spinner, its clock and its latest
progress on a status line rewritten in place; elsewhere (a pipe, a file) each
progress report is a line of its own and nothing is rewritten.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO, assert_never

import anyio
from pydantic import JsonValue

from agentfsm import AgentEvent
from agentfsm._text import printable
from agentfsm.events import (
    FunctionCallCompleted,
    FunctionCallProgress,
    FunctionCallStarted,
    InferenceCompleted,
    InferenceStream,
    InputDropped,
    LoopDetached,
    LoopFailed,
    LoopIdle,
    LoopPaused,
    LoopRecovered,
    LoopResumed,
    LoopStarted,
    LoopTransition,
    ModelAnswer,
    TransitionIntercepted,
)
from agentfsm.interception import ToolBatch
from agentfsm.providers import TextDelta
from agentfsm.providers.local import LoadProgress

from ._text import one_line

__all__ = ("LoadDisplay", "RunView")

_FRAMES = "|/-\\"
_CLEAR = "\r\x1b[K"  # back to the line's start, and erase it


def _progress(progress: JsonValue) -> str:
    if isinstance(progress, str):
        return one_line(progress)
    return one_line(json.dumps(progress, ensure_ascii=False, separators=(",", ":")))


@dataclass(slots=True)
class _Running:
    name: str
    started: float
    progress: str | None = None


class RunView:
    """Shows a loop's events as they come: transitions, tool calls, pauses and
    the streamed answer.

    Args:
        out: where to write.
        live: a terminal: running tool calls show a spinner on a status line
            rewritten in place (`spin` animates it).
    """

    __slots__ = (
        "_frame",
        "_out",
        "_running",
        "_status",
        "_streamed",
        "_text_open",
        "live",
    )

    def __init__(self, out: TextIO, *, live: bool = False) -> None:
        self._out = out
        self.live = live
        """Whether running tool calls show a spinner (a terminal)."""
        self._text_open = False  # a line of streamed text is being written
        self._streamed = False  # the current answer arrived as chunks
        self._running: dict[str, _Running] = {}  # call_id -> the call
        self._status = False  # the status line is on screen
        self._frame = 0

    def end_line(self) -> None:
        """End the line of text being written, and take the status line away."""
        if self._status:
            self._out.write(_CLEAR)
            self._status = False
        if self._text_open:
            self._out.write("\n")
            self._text_open = False
        self._out.flush()

    def line_ended(self) -> None:
        """Forget the line being written: something else (Ctrl-C's signal
        handler) ended it, and the status line is off screen."""
        self._status = False
        self._text_open = False

    def line(self, text: str) -> None:
        """Write a line of its own (the status line, if any, stays below it)."""
        status = self._status
        self.end_line()
        self._out.write(text + "\n")
        if status:
            self._draw()
        self._out.flush()

    async def spin(self) -> None:
        """Animate the status line while tool calls run; runs until cancelled."""
        while True:
            await anyio.sleep(0.1)
            self.tick()

    def tick(self) -> None:
        """Draw the spinner's next frame and the calls' clocks, if calls run."""
        if self._running:
            self._frame += 1
            self._draw()
            self._out.flush()

    def _draw(self) -> None:
        if not (self.live and self._running) or self._text_open:
            return
        now = time.monotonic()
        parts = []
        for call in self._running.values():
            part = f"{call.name} {now - call.started:.1f}s"
            if call.progress is not None:
                part += f": {call.progress}"
            parts.append(part)
        text = f"{_FRAMES[self._frame % len(_FRAMES)]} running {', '.join(parts)}"
        # Wider than the terminal, the line would wrap and `_CLEAR` erase its
        # last row only.
        width = shutil.get_terminal_size().columns - 1
        if len(text) > width > 3:
            text = text[: width - 3] + "..."
        self._out.write(_CLEAR + text)
        self._status = True

    def show(self, event: AgentEvent) -> None:
        """Show what `event` tells, if anything."""
        match event:
            case InferenceStream():
                # A call is shown when it starts; reasoning is not shown.
                if isinstance(event.delta, TextDelta):
                    self._text(event.delta.text)
            case LoopTransition():
                self.line(f"[{event.source} --{event.trigger}--> {event.dest}]")
            case InferenceCompleted():
                if event.output.finish_reason == "length":
                    self.line("(the output was cut at the token limit)")
            case FunctionCallStarted():
                call = event.call
                self.line(f"  call {one_line(call.name)}({one_line(call.arguments)})")
                # Drawn from the next tick on: a quick call shows no spinner.
                self._running[call.call_id] = _Running(
                    one_line(call.name), time.monotonic()
                )
            case FunctionCallProgress():
                running = self._running.get(event.call_id)
                progress = _progress(event.progress)
                if running is not None and self.live:
                    running.progress = progress
                    self._draw()
                    self._out.flush()
                else:
                    name = running.name if running else one_line(event.call_id)
                    self.line(f"  {name}: {progress}")
            case FunctionCallCompleted():
                self._running.pop(event.call.call_id, None)
                output = event.output
                status = "error" if output.is_error else "->"
                # An image is shown by its reference line, never its bytes.
                references = (one_line(i.reference) for i in output.images)
                shown = " ".join(filter(None, (printable(output.output), *references)))
                self.line(
                    f"  {one_line(event.call.name)} {status} "
                    f"{shown} ({event.duration * 1000:.0f} ms)"
                )
            case ModelAnswer():
                if not self._streamed:
                    self.line(f"model: {printable(event.message.content)}")
                self._streamed = False
            case LoopPaused():
                self._paused(event)
            case LoopResumed():
                self.line(f"[resumed: {event.decision}]")
            case TransitionIntercepted():
                self._intercepted(event)
            case LoopRecovered():
                self.line(f"[recovered: {event.status}]")
            case LoopFailed():
                self.line(
                    f"failed: {one_line(event.error_type)}: {printable(event.message)}"
                )
            case LoopDetached():
                self.line(f"detached: {printable(event.reason)}")
            case InputDropped():
                self.line(
                    f"[dropped {one_line(event.input)}: {printable(event.reason)}]"
                )
            case LoopStarted() | LoopIdle():
                pass  # the command says what it runs, and sums up at the end
            case _:
                assert_never(event)

    def _text(self, text: str) -> None:
        if self._status:
            self._out.write(_CLEAR)
            self._status = False
        if not self._text_open:
            self._out.write("model: ")
            self._text_open = self._streamed = True
        # A chunk may end inside an escape sequence: each is made printable
        # alone, so no part of one reaches the terminal.
        self._out.write(printable(text))
        self._out.flush()

    def _intercepted(self, event: TransitionIntercepted) -> None:
        # A pause is shown by its `loop.paused`, a resume's decision by its
        # `loop.resumed`; a handler that proceeds changes nothing to show.
        if event.handler < 0 or event.decision in ("proceed", "pause"):
            return
        if event.decision == "abort":
            self.line(
                f"  handler {event.handler} aborted: {one_line(event.reason or '')}"
            )
            return
        to = f" to {event.new_dest}" if event.new_dest is not None else ""
        self.line(f"  handler {event.handler} rewrote {event.trigger}{to}")

    def _paused(self, event: LoopPaused) -> None:
        self.line(f"paused before {event.trigger}: {one_line(event.reason)}")
        if isinstance(event.payload, ToolBatch):
            batch = event.payload
            for call in batch.calls:
                mark = (
                    " (needs approval)"
                    if call.call_id in batch.awaiting_approval
                    else ""
                )
                self.line(f"  {one_line(call.name)}({one_line(call.arguments)}){mark}")


class LoadDisplay:
    """Shows a local model loading: a line when it starts (with a running clock
    on a terminal), then the time it took."""

    __slots__ = ("_label", "_out", "_started", "live")

    def __init__(self, out: TextIO, *, live: bool) -> None:
        self._out = out
        self.live = live
        """Whether the line is rewritten in place (a terminal) to show a clock."""
        self._label = ""
        self._started: float | None = None

    def __call__(self, progress: LoadProgress) -> None:
        if progress.phase == "loading":
            self._started = time.monotonic()
            size = progress.size_bytes / 1e6
            name = Path(progress.path).name
            label = f"loading {progress.model} ({name}, {size:.0f} MB)..."
            self._label = printable(label, newlines=False)
            self._out.write(self._label)
        else:
            self._started = None
            again = f"\r{self._label}" if self.live else ""
            self._out.write(f"{again} loaded in {progress.seconds:.1f}s\n")
        self._out.flush()

    async def tick(self) -> None:
        """Update the clock on the loading line until cancelled."""
        while True:
            await anyio.sleep(0.2)
            if self._started is not None:
                elapsed = time.monotonic() - self._started
                self._out.write(f"\r{self._label} {elapsed:.1f}s")
                self._out.flush()
