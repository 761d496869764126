"""What a person can do from the UI: answer a loop's pause or cancel a loop,
as a request stored in the loop's store (the decision inbox:
`agentfsm.store.Requests`), which the runtime holding the loop applies once.

The server builds the decision, never the page: from the form's fields (a
JSON body, checked here, each fault named by its field) and the loop's
stored record (the pause's seq and its payload, the calls a `ToolBatch`
holds), with `ToolBatch.approve` / `deny` / `with_arguments` / `answer`.
The request names the UI's user (`by`), whom the loop's decision entry then
names in its audit.

```
{"kind": "resume", "seq": 7, "decision": "calls", "calls": {
    "c1": {"action": "approve"},
    "c2": {"action": "deny", "reason": "not this account"},
    "c3": {"action": "edit", "arguments": {"amount": 5}},
    "c4": {"action": "answer", "output": "it ran: receipt 42"}}}
{"kind": "resume", "seq": 7, "decision": "proceed"}
{"kind": "resume", "seq": 7, "decision": "abort", "reason": "wrong customer"}
{"kind": "resume", "seq": 9, "decision": "text", "text": "the answer, edited"}
{"kind": "cancel", "reason": "the user left"}
{"kind": "fork", "seq": 3, "model": "openai:gpt-4.1"}
```

A fork (of any loop, an ended one too) starts a new loop from the loop's
first model request at or after `seq`, with `model` if given
(`agentfsm.replay.fork`); any runtime watching the store that has the loop's
tools applies it, once (`agentfsm.replay.inbox`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import anyio

from agentfsm._arguments import ArgumentTypeError, ArgumentValueError
from agentfsm._text import encodable
from agentfsm.events import AgentEvent, LoopTransition
from agentfsm.exceptions import LoopStateError, StoreError, UnknownLoopError
from agentfsm.interception import Abort, Decision, Proceed, Rewrite, ToolBatch
from agentfsm.messages import ImageBlock, ModelMessageItem, TextBlock, UserMessage
from agentfsm.record import DecisionRecord, LoopRecord
from agentfsm.results import LoopStatus
from agentfsm.states import Trigger
from agentfsm.store import CallRecord, LoopRequest, SQLiteStore, SQLStore

__all__ = ("ActionError", "Actions", "fork_points", "offered", "parse_object")

MAX_BODY: Final = 1 << 20
"""Bytes a request's body may hold (edited arguments, an output to record)."""

_KINDS: Final = ("resume", "cancel", "fork")
_DECISIONS: Final = ("proceed", "abort", "calls", "text")
_CALL_ACTIONS: Final = ("approve", "deny", "edit", "answer")
_FIELDS: Final = {
    "resume": frozenset({"kind", "seq", "decision", "reason", "calls", "text"}),
    "cancel": frozenset({"kind", "reason"}),
    "fork": frozenset({"kind", "seq", "model"}),
}
_CALL_FIELDS: Final = {
    "approve": frozenset({"action"}),
    "deny": frozenset({"action", "reason"}),
    "edit": frozenset({"action", "arguments"}),
    "answer": frozenset({"action", "output"}),
}


class ActionError(Exception):
    """A request the UI refuses: `status` (400 a bad field, 404 no such loop,
    409 the loop is not where the request says, 503 no store to write to)
    and why, naming the `field` at fault when one is."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field

    def data(self) -> dict[str, Any]:
        found: dict[str, Any] = {"error": str(self)}
        if self.field is not None:
            found["field"] = self.field
        return found


def _bad(field: str, message: str) -> ActionError:
    return ActionError(400, f"{field}: {message}", field)


@dataclass(frozen=True, slots=True)
class CallAction:
    """What the form says of one call of a batch."""

    action: Literal["approve", "deny", "edit", "answer"]
    reason: str | None = None
    arguments: dict[str, Any] | None = None
    output: str | None = None


@dataclass(frozen=True, slots=True)
class Wanted:
    """A request's body, checked."""

    kind: Literal["resume", "cancel", "fork"]
    seq: int | None = None
    decision: Literal["proceed", "abort", "calls", "text"] | None = None
    reason: str | None = None
    calls: dict[str, CallAction] = field(default_factory=dict)
    model: str | None = None
    text: str | None = None


def parse(body: bytes) -> Wanted:
    """A request's JSON body, checked (see the module).

    Raises:
        ActionError: 400, naming the field at fault.
    """
    data = parse_object(body)
    kind = data.get("kind")
    if kind not in _KINDS:
        raise _bad("kind", f"'resume', 'cancel' or 'fork', got {_shown(kind)}")
    _only(data, _FIELDS[kind], "")
    if kind == "cancel":
        return Wanted("cancel", reason=_text(data, "reason", "", required=True))
    seq = data.get("seq")
    if kind == "fork":
        if type(seq) is not int or not 0 <= seq < 2**63:
            raise _bad(
                "seq", f"where the fork starts (a seq, an int), got {_shown(seq)}"
            )
        model = _text(data, "model", "", required=False)
        return Wanted("fork", seq, model=(model.strip() or None) if model else None)
    if type(seq) is not int or seq < 0:
        raise _bad("seq", f"the seq of the pause answered (an int), got {_shown(seq)}")
    decision = data.get("decision")
    if decision not in _DECISIONS:
        raise _bad(
            "decision",
            f"'proceed', 'abort', 'calls' or 'text', got {_shown(decision)}",
        )
    reason = _text(data, "reason", "", required=decision == "abort")
    calls: dict[str, CallAction] = {}
    if decision == "calls":
        given = data.get("calls")
        if not isinstance(given, dict) or not given:
            raise _bad("calls", f"an object: call id -> action, got {_shown(given)}")
        calls = {call_id: _call(call_id, act) for call_id, act in given.items()}
    elif "calls" in data:
        raise _bad("calls", f"only with decision 'calls', not {decision!r}")
    text = None
    if decision == "text":
        text = _text(data, "text", "", required=True)
    elif "text" in data:
        raise _bad("text", f"only with decision 'text', not {decision!r}")
    return Wanted("resume", seq, decision, reason, calls, text=text)


def parse_object(body: bytes) -> dict[str, Any]:
    """A body that must be one JSON object (no key twice, no NaN).

    Raises:
        ActionError: 400, naming the body.
    """
    try:
        data = json.loads(body, object_pairs_hook=_no_repeats, parse_constant=_no_nan)
    except _Repeated as exc:
        raise _bad("body", f"the key {exc.args[0]!r} is given twice") from None
    except (ValueError, RecursionError) as exc:
        raise _bad("body", f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise _bad("body", f"a JSON object, got {_what(data)}")
    return data


def _call(call_id: str, given: object) -> CallAction:
    """What the form says of one call, checked (`calls.<id>...` at fault)."""
    where = f"calls.{call_id}"
    if not isinstance(given, dict):
        raise _bad(where, f"an object with an action, got {_what(given)}")
    action = given.get("action")
    if action not in _CALL_ACTIONS:
        raise _bad(
            f"{where}.action",
            f"'approve', 'deny', 'edit' or 'answer', got {_shown(action)}",
        )
    _only(given, _CALL_FIELDS[action], f"{where}.")
    if action == "deny":
        return CallAction("deny", reason=_text(given, "reason", where, required=True))
    if action == "answer":
        output = given.get("output")
        if not isinstance(output, str):
            raise _bad(
                f"{where}.output", f"the output to record (a str), got {_shown(output)}"
            )
        return CallAction("answer", output=output)
    if action == "edit":
        return CallAction("edit", arguments=_arguments(given.get("arguments"), where))
    return CallAction("approve")


def _arguments(given: object, where: str) -> dict[str, Any]:
    """Edited arguments: a JSON object, or its text."""
    if isinstance(given, str):
        try:
            given = json.loads(given, parse_constant=_no_nan)
        except (ValueError, RecursionError) as exc:
            raise _bad(f"{where}.arguments", f"not JSON ({exc})") from None
    if not isinstance(given, dict):
        raise _bad(f"{where}.arguments", f"a JSON object, got {_what(given)}")
    return given


def _text(
    data: Mapping[str, Any], name: str, where: str, *, required: bool
) -> str | None:
    value = data.get(name)
    named = f"{where}.{name}" if where else name
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        need = "some words (a non-empty str)" if required else "a str"
        raise _bad(named, f"{need}, got {_shown(value)}")
    return value


def _only(data: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    for key in data:
        if key not in allowed:
            raise _bad(
                f"{where}{key}",
                f"not a field here (takes {', '.join(sorted(allowed))})",
            )


class _Repeated(ValueError):
    pass


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _Repeated(key)
        found[key] = value
    return found


def _no_nan(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _what(value: object) -> str:
    if value is None:
        return "null"
    names: dict[type, str] = {dict: "an object", list: "an array", str: "a string"}
    return names.get(type(value), type(value).__name__)


def _shown(value: object) -> str:
    text = (
        json.dumps(value)
        if isinstance(value, str | int | float | bool | None)
        else _what(value)
    )
    return text if len(text) <= 80 else f"{text[:77]}..."


# ---------------------------------------------------------------- decisions


def decision_of(
    record: LoopRecord, uncertain: frozenset[str], wanted: Wanted
) -> Decision:
    """The decision a resume's form asks for, over the loop's stored pause.

    Raises:
        ActionError: 409 the loop is not paused at the form's seq; 400 the
            form does not fit the pause (a call it does not hold, a call
            awaiting a decision the form leaves out).
    """
    pause = record.pause
    if record.status is not LoopStatus.paused or pause is None:
        raise ActionError(
            409,
            f"loop {record.loop_id} is {record.status}, not paused: nothing to resume",
        )
    if pause.seq != wanted.seq:
        raise ActionError(
            409,
            f"loop {record.loop_id} is paused at seq {pause.seq}, not at seq "
            f"{wanted.seq} (it moved on: reload the page)",
            "seq",
        )
    if wanted.decision == "proceed":
        return Proceed()
    if wanted.decision == "abort":
        assert wanted.reason is not None
        return Abort(wanted.reason)
    if wanted.decision == "text":
        assert wanted.text is not None
        return Rewrite(payload=_rewritten(pause.payload, wanted.text, pause.seq))
    batch = pause.payload
    if not isinstance(batch, ToolBatch):
        raise _bad(
            "decision",
            f"the pause at seq {pause.seq} is not over tool calls (it is before "
            f"{pause.trigger}): proceed or abort",
        )
    known = {c.call_id for c in batch.calls}
    for call_id in wanted.calls:
        if call_id not in known:
            held = ", ".join(sorted(known))
            raise _bad(
                f"calls.{call_id}",
                f"the paused batch holds no such call (it holds {held})",
            )
    for call_id in (*batch.awaiting_approval, *sorted(uncertain & known)):
        if call_id not in wanted.calls:
            waits = (
                "awaits approval"
                if call_id in batch.awaiting_approval
                else "is uncertain"
            )
            raise _bad(
                f"calls.{call_id}",
                f"the call {waits}: say what becomes of it (approve, deny, edit "
                "or answer)",
            )
    for call_id, act in wanted.calls.items():
        batch = _applied(batch, call_id, act)
    return Rewrite(payload=batch)


def _rewritten(payload: object, text: str, seq: int) -> ModelMessageItem | UserMessage:
    """The paused transition's message (the model's answer, a user's
    message) with the form's text in place of its own (a user's images kept,
    after it).

    Raises:
        ActionError: 400, the pause holds no single message.
    """
    if isinstance(payload, UserMessage) and payload.images:
        # Its images by reference: the request keeps no copy of their bytes,
        # the runtime applying it takes them from the paused message.
        replaced = _text_replaced(payload, encodable(text))
        blocks = [
            b.as_reference() if isinstance(b, ImageBlock) else b
            for b in replaced.content
        ]
        return UserMessage(content=blocks)
    if isinstance(payload, ModelMessageItem | UserMessage):
        return payload.model_copy(update={"content": encodable(text)})
    raise _bad(
        "decision",
        f"the pause at seq {seq} holds no message whose text could be "
        "rewritten: proceed, abort or decide its calls",
    )


def _text_replaced(message: UserMessage, text: str) -> UserMessage:
    """A message of blocks with `text` as its text: the first text block holds
    it, the others go, the images stay where they were (unchanged text: the
    message itself)."""
    if text == message.text:
        return message
    blocks: list[TextBlock | ImageBlock] = []
    placed = False
    for block in message.content:
        if isinstance(block, ImageBlock):
            blocks.append(block)
        elif not placed:
            blocks.append(TextBlock(text=text))
            placed = True
    if not placed and text:
        blocks.insert(0, TextBlock(text=text))
    return UserMessage(content=blocks)


def _applied(batch: ToolBatch, call_id: str, act: CallAction) -> ToolBatch:
    if act.action == "deny":
        assert act.reason is not None
        return batch.deny(call_id, act.reason)
    if act.action == "answer":
        assert act.output is not None
        return batch.approve(call_id).answer(call_id, act.output)
    if act.action == "edit":
        assert act.arguments is not None
        batch = batch.with_arguments(call_id, act.arguments)
    return batch.approve(call_id)


def record_of(decision: Decision) -> DecisionRecord:
    """A resume's decision as the inbox stores it (`LoopRequest.decision`)."""
    if isinstance(decision, Rewrite):
        # The UI rewrites a batch of calls or one message (see `decision_of`).
        assert isinstance(decision.payload, ToolBatch | ModelMessageItem | UserMessage)
        return DecisionRecord(
            kind="rewrite", dest=decision.dest, payload=decision.payload
        )
    if isinstance(decision, Abort):
        return DecisionRecord(kind="abort", reason=decision.reason)
    return DecisionRecord(kind="proceed")


def uncertain_of(record: LoopRecord, ledger: list[CallRecord]) -> frozenset[str]:
    """The calls of the loop's last batch whose outcome is uncertain (a
    recovery paused the loop over them: they may or may not have run)."""
    return frozenset(
        c.call_id
        for c in ledger
        if c.status == "uncertain" and c.request == record.model_requests
    )


def offered(record: LoopRecord, ledger: list[CallRecord]) -> dict[str, Any] | None:
    """What the loop's page offers to do (None: nothing, the loop has ended;
    a fork is offered apart): `cancel`, and for a paused loop `resume`: the
    pause's seq and, over a batch of tool calls, each call with what it
    waits on."""
    if record.status is LoopStatus.done:
        return None
    pause = record.pause
    if record.status is not LoopStatus.paused or pause is None:
        return {"cancel": True, "resume": None}
    resume: dict[str, Any] = {
        "seq": pause.seq,
        "trigger": pause.trigger,
        "calls": None,
        "text": None,
    }
    batch = pause.payload
    if isinstance(batch, ModelMessageItem):
        # (its text, rewritable: the model's answer or a person's message)
        resume["text"] = {"of": batch.type, "content": batch.content}
    elif isinstance(batch, UserMessage):
        # A message's images stay as they are: its text is what is rewritten.
        resume["text"] = {"of": batch.type, "content": batch.text}
    if isinstance(batch, ToolBatch):
        uncertain = uncertain_of(record, ledger)
        resume["calls"] = [
            {
                "call_id": c.call_id,
                "name": c.name,
                "arguments": c.arguments,
                "awaiting": c.call_id in batch.awaiting_approval,
                "uncertain": c.call_id in uncertain,
                "denied": batch.denied.get(c.call_id),
                "answered": batch.outputs.get(c.call_id),
            }
            for c in batch.calls
        ]
    return {"cancel": True, "resume": resume}


def fork_points(events: Sequence[AgentEvent]) -> list[int]:
    """The seqs a fork may start from: the loop's model requests (its `infer`
    transitions), in order."""
    return [
        e.seq
        for e in events
        if isinstance(e, LoopTransition)
        and e.trigger in (Trigger.infer, Trigger.infer_streaming)
    ]


# ------------------------------------------------------------------ the inbox


class Actions:
    """The UI's acting side over a store: its user, where requests are
    written, and whom to poke once one is.

    `store` is what the UI reads; requests go to it when it is writable (a
    runtime's store, a store given to `agentfsm.ui.app`), else to `writer`, a
    writable store of the same data, opened at the first request (so that a
    UI nobody acts from never writes) and closed with the app.
    """

    def __init__(
        self,
        store: SQLStore[Any],
        *,
        user: str,
        writer: SQLStore[Any] | None = None,
        poke: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.user = user
        self.writer = writer
        self.poke = poke
        self._opened = False
        self._lock = anyio.Lock()

    @property
    def enabled(self) -> bool:
        """Whether requests can be written (a writable store, or a writer)."""
        return not self.store.read_only or self.writer is not None

    async def close(self) -> None:
        if self._opened and self.writer is not None:
            self._opened = False
            await self.writer.close()

    async def requests(self, loop_id: str) -> list[LoopRequest]:
        """The loop's requests, oldest first (read where they are written
        once the writer is open: a read-only handle of a store made before
        the inbox existed does not see the table the writer made)."""
        return await self.reader().requests(loop_id)

    def reader(self) -> SQLStore[Any]:
        """Where what the UI writes is read back: the writer once open, else
        the store."""
        return self.writer if self._opened and self.writer is not None else self.store

    async def writable(self) -> SQLStore[Any]:
        """The store the UI writes to (see `_inbox`).

        Raises:
            ActionError: 503, the UI has nowhere to write.
        """
        return await self._inbox()

    async def submit(self, loop_id: str, body: bytes) -> LoopRequest:
        """Store the request a form asks for, by the UI's user, and poke the
        runtime the UI is mounted beside (it applies it at once).

        Raises:
            ActionError: the body, the loop or the store refuse it (see
                `ActionError`).
            StoreError: the store cannot be read or written.
        """
        wanted = parse(body)
        stored = await self.store.load(loop_id)
        if stored is None:
            raise ActionError(404, f"the store holds no loop {loop_id!r}")
        record = stored.record
        if wanted.kind == "fork":
            await self._fork_point(loop_id, wanted)
        elif record.status is LoopStatus.done:
            raise ActionError(409, f"loop {loop_id} has ended: nothing can act on it")
        decision: DecisionRecord | None = None
        if wanted.kind == "resume":
            ledger = await self.store.calls(loop_id, record.model_requests)
            chosen = decision_of(record, uncertain_of(record, ledger), wanted)
            decision = record_of(chosen)
        inbox = await self._inbox()
        try:
            request = await inbox.submit_request(
                loop_id,
                wanted.kind,
                decision=decision,
                seq=wanted.seq,
                by=self.user,
                reason=wanted.reason,
                model=wanted.model,
            )
        except UnknownLoopError as exc:
            raise ActionError(404, str(exc)) from None
        except LoopStateError as exc:
            raise ActionError(409, str(exc)) from None
        except (ArgumentTypeError, ArgumentValueError) as exc:
            raise ActionError(400, str(exc)) from None
        if self.poke is not None:
            self.poke()
        return request

    async def _fork_point(self, loop_id: str, wanted: Wanted) -> None:
        """Check that the loop made a model request at or after the fork's seq
        (a fork replays its events up to it).

        Raises:
            ActionError: 409 the store keeps no events; 400 no such request.
        """
        if not self.store.keeps_events:
            raise ActionError(
                409,
                "the store keeps no events, and a fork replays them "
                "(SQLiteStore(..., events=True) keeps them)",
            )
        points = fork_points(await self.store.events(loop_id))
        assert wanted.seq is not None
        if not any(seq >= wanted.seq for seq in points):
            last = f"its last is at seq {points[-1]}" if points else "it made none"
            raise _bad(
                "seq",
                f"loop {loop_id} made no model request at or after seq "
                f"{wanted.seq} ({last}): a fork starts from one",
            )

    async def _inbox(self) -> SQLStore[Any]:
        """The store requests are written to (the writer opened once)."""
        if not self.store.read_only:
            return self.store
        writer = self.writer
        if writer is None:
            raise ActionError(
                503,
                "this UI reads a store opened read_only=True and was given no "
                "writer: it stores no request (agentfsm.ui.app(..., writer=...))",
            )
        async with self._lock:
            if not self._opened:
                if (
                    isinstance(writer, SQLiteStore)
                    and not await anyio.Path(writer.path).exists()
                ):
                    # Opened writable, SQLite would make a new, empty store.
                    raise StoreError(f"{writer.path}: the store's file is gone")
                await writer.open()
                self._opened = True
        return writer
