"""How `agentfsm run` answers a paused loop.

At a terminal the person decides: for each call awaiting approval, approve it,
deny it with a reason (the model reads it) or edit its arguments (JSON,
checked against the tool's arguments); any other pause is resumed or aborted.
A breakpoint's pause (`--break`, `--step`) is resumed or aborted, whatever its
payload (`--approve-all` approves calls, it does not pass breakpoints).
Without a terminal nobody can answer: the command says so and how a loop
can be resumed, and exits with `PAUSED_EXIT`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import TextIO, TypeAlias

import anyio.to_thread
from pydantic_core import from_json

from agentfsm import Tool
from agentfsm.breakpoints import is_breakpoint_pause
from agentfsm.exceptions import ToolArgumentsError
from agentfsm.inference import InferenceInput
from agentfsm.interception import (
    Abort,
    Decision,
    PendingTransition,
    Proceed,
    Rewrite,
    ToolBatch,
)
from agentfsm.messages import FunctionCallItem, ModelMessageItem, UserMessage
from agentfsm.results import LoopView

from ._text import one_line

__all__ = (
    "LINE_LIMIT",
    "PAUSED_EXIT",
    "Ask",
    "PauseDecider",
    "ask_terminal",
    "awaiting_approval",
    "read_answer",
    "unattended",
)

PAUSED_EXIT = 3
"""The exit code of a run that paused where nobody could answer."""

Ask: TypeAlias = Callable[[str], Awaitable[str | None]]
"""Shows a question and returns the answer (without its newline), or None when
the input ended."""

_ENDED = "no decision: the terminal's input ended"

LINE_LIMIT = 4095
"""The longest line a terminal passes on in its line-editing (canonical) mode,
on Linux: what is typed past it is dropped, the newline still ends the line."""


async def ask_terminal(question: str) -> str | None:
    """Ask at the terminal: the question on stdout, the answer a line of stdin
    (UTF-8; asked again, saying why, when it is not, or when it filled the
    terminal's longest line and so may have been cut)."""
    while True:
        sys.stdout.write(question)
        sys.stdout.flush()
        # Bytes, decoded here: a byte that is not UTF-8 is the person's typo to
        # be told of, not an error of the command. A blocking read, in a
        # thread the run abandons when it is interrupted.
        line = await anyio.to_thread.run_sync(
            sys.stdin.buffer.readline, abandon_on_cancel=True
        )
        if not line:
            return None
        answer, problem = read_answer(line)
        if problem is None:
            return answer
        sys.stdout.write(f"  {problem}\n")


def read_answer(line: bytes) -> tuple[str, str | None]:
    """A line typed at the terminal as text (without its newline), or what is
    wrong with it: not UTF-8, or as long as the terminal's longest line."""
    body = line.rstrip(b"\r\n")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = body[exc.start : exc.start + 1].hex()
        return "", f"not UTF-8 (byte 0x{bad} at {exc.start}): type it again"
    if len(body) >= LINE_LIMIT:
        return "", (
            f"the terminal passes at most {LINE_LIMIT} bytes a line, and this "
            "one reached that, so its end may be lost: type it again, shorter "
            "(arguments longer than that: type @FILE to read them from a file)"
        )
    return text, None


def awaiting_approval(paused: LoopView) -> ToolBatch | None:
    """The tool batch `paused` waits on, if calls in it await approval."""
    pending = paused.pending
    batch = pending.payload if pending is not None else None
    if isinstance(batch, ToolBatch) and batch.awaiting_approval:
        return batch
    return None


class _InputEnded(Exception):
    """The person's input ended (Ctrl-D) before they decided."""


class PauseDecider:
    """Decides how a paused loop goes on.

    Args:
        tools: the tools offered, whose arguments an edit is checked against.
        ask: how to ask the person (`None`: nobody to ask).
        approve_all: approve every call awaiting approval without asking.
        out: where to write what the person needs to know.
    """

    __slots__ = ("_approve_all", "_ask", "_out", "_tools")

    def __init__(
        self,
        tools: Mapping[str, Tool],
        *,
        ask: Ask | None,
        approve_all: bool = False,
        out: TextIO,
    ) -> None:
        self._tools = tools
        self._ask = ask
        self._approve_all = approve_all
        self._out = out

    async def decide(self, paused: LoopView) -> Decision | None:
        """The decision to resume `paused` with; None when nobody can decide."""
        if is_breakpoint_pause(paused.pause_reason):
            if self._ask is None:
                return None
            try:
                return await self._at_breakpoint(paused)
            except _InputEnded:
                self._say("")
                return Abort(_ENDED)
        batch = awaiting_approval(paused)
        if batch is not None and self._approve_all:
            self._say("approved (--approve-all)")
            return Proceed()  # resuming approves every call not denied
        if self._ask is None:
            return None
        try:
            if batch is not None:
                return Rewrite(payload=await self._approve(batch))
            return await self._resume_or_abort(paused.pause_reason or "")
        except _InputEnded:
            self._say("")
            return Abort(_ENDED)

    def _say(self, text: str) -> None:
        self._out.write(text + "\n")
        self._out.flush()

    async def _answer(self, question: str) -> str:
        assert self._ask is not None
        answer = await self._ask(question)
        if answer is None:
            raise _InputEnded
        return answer.strip()

    async def _approve(self, batch: ToolBatch) -> ToolBatch:
        for call in batch.calls:
            if call.call_id not in batch.awaiting_approval:
                continue
            shown = f"{one_line(call.name)}({one_line(call.arguments)})"
            while True:
                answer = (
                    await self._answer(
                        f"approve {shown}? [y]es, [n]o, [e]dit the arguments: "
                    )
                ).lower()
                if answer in ("y", "yes"):
                    batch = batch.approve(call.call_id)
                elif answer in ("n", "no"):
                    reason = await self._answer(
                        "why not? (the model reads it; Enter for no reason): "
                    )
                    batch = batch.deny(
                        call.call_id, reason or "the user denied the call"
                    )
                elif answer in ("e", "edit"):
                    arguments = await self._edit(call)
                    if arguments is None:
                        continue  # back to the question
                    batch = batch.with_arguments(call.call_id, arguments)
                    batch = batch.approve(call.call_id)
                    self._say(
                        f"  {one_line(call.name)} runs with {one_line(arguments)}"
                    )
                else:
                    self._say("  answer y, n or e")
                    continue
                break
        return batch

    async def _edit(self, call: FunctionCallItem) -> str | None:
        """The call's new arguments as JSON text, checked as the loop will
        parse them; None to go back."""
        tool = self._tools.get(call.name)
        while True:
            text = await self._answer(
                f"arguments for {one_line(call.name)} as a JSON object, or "
                "@FILE to read them from a file (Enter to go back): "
            )
            if not text:
                return None
            if text.startswith("@"):  # (no JSON object starts with one)
                read = self._read_file(text[1:].strip())
                if read is None:
                    continue
                text = read
            try:
                # The loop's parser: it refuses what `json` takes and no tool
                # could be given (a lone surrogate's escape, say).
                arguments = from_json(text)
            except ValueError as exc:
                self._say(f"  not JSON: {one_line(str(exc))}")
                continue
            if not isinstance(arguments, dict):
                self._say(f"  not a JSON object: {one_line(text)}")
                continue
            if tool is not None:
                try:
                    tool.validate_arguments(arguments)
                except ToolArgumentsError as exc:
                    self._say(f"  {one_line(str(exc))}")
                    continue
            return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))

    def _read_file(self, path: str) -> str | None:
        """The text of the file `@path` names; None (and why said) if none."""
        try:
            with open(path, "rb") as file:
                data = file.read()
        except OSError as exc:
            self._say(f"  cannot read {one_line(path)}: {exc.strerror or exc}")
            return None
        try:
            return data.decode("utf-8").strip()
        except UnicodeDecodeError as exc:
            self._say(f"  {one_line(path)} is not UTF-8 text (byte {exc.start})")
            return None

    async def _at_breakpoint(self, paused: LoopView) -> Decision:
        """Resume or abort at a breakpoint, having said what the transition
        acts on (a batch's calls are shown with the pause already)."""
        self._say(f"stopped at {one_line(paused.pause_reason or '')}")
        if paused.pending is not None:
            shown = _payload_line(paused.pending)
            if shown is not None:
                self._say(f"  {shown}")
        return await self._resume_or_abort(None)

    async def _resume_or_abort(self, reason: str | None) -> Decision:
        if reason is not None:
            self._say(f"the loop paused: {one_line(reason)}")
        while True:
            answer = (await self._answer("[r]esume or [a]bort? ")).lower()
            if answer in ("r", "resume"):
                return Proceed()
            if answer in ("a", "abort"):
                return Abort("aborted at the prompt")
            self._say("  answer r or a")


_SHOWN = 200
"""How much of a message a breakpoint's prompt shows, at most."""


def _payload_line(pending: PendingTransition) -> str | None:
    """One line saying what a stopped transition acts on (None for a batch,
    which the pause's own lines show, and for nothing)."""
    payload = pending.payload
    if isinstance(payload, InferenceInput):
        return (
            f"the request to {one_line(payload.model)}: "
            f"{len(payload.context.items)} context item(s), {len(payload.tools)} tool(s)"
        )
    if isinstance(payload, ModelMessageItem):
        return f"the answer: {one_line(payload.content, _SHOWN)}"
    if isinstance(payload, UserMessage):
        payload = (payload,)
    if isinstance(payload, tuple) and payload:
        return "; ".join(f"user: {one_line(m.shown(), _SHOWN)}" for m in payload)
    return None


def unattended(paused: LoopView) -> str:
    """What to tell when `paused` cannot be answered: no terminal to ask."""
    reason = one_line(paused.pause_reason or "")
    answer = "To answer, run the command at a terminal"
    if is_breakpoint_pause(paused.pause_reason):
        answer += ", or without --break and --step"
    elif awaiting_approval(paused) is not None:
        answer += "; to approve every call without asking, add --approve-all"
    return (
        f"error: loop {paused.loop_id} paused ({reason}), and there is no "
        "terminal to ask: stdin and stdout are not both terminals.\n"
        "This run keeps no store, so the loop ends with the command (it is "
        f"cancelled). {answer}.\n"
        "From Python, a Runtime(store=...) keeps a paused loop across "
        "processes, and runtime.resume(loop_id, decision) continues it: see "
        "docs/how-to/approval.md and docs/durability.md."
    )
