"""One durable loop's side of the store: what it has written, and the ledger.

Every durable loop holds a `Durable` (`loop.durable`; None for a loop without
a store). The driver awaits `save` after each committed transition and when a
run ends (paused, finished); the inference state hands it the model's output
(`recorded` on the way in, after a recovery; `inference` on the way out); the
tool calls go through `begin_call` / `end_call` (the ledger).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentfsm._keys import idempotency_key
from agentfsm.inference import InferenceOutput
from agentfsm.messages import ContextItem, FunctionCallItem, FunctionCallOutputItem
from agentfsm.store._base import CallRecord, Commit, LoopStore

if TYPE_CHECKING:
    from agentfsm._loop.loop import Loop

__all__ = ("Durable",)


class Durable:
    """What one loop has written to its store, and its ledger calls."""

    __slots__ = ("answer", "inference", "owner", "recorded", "store", "written")

    def __init__(self, store: LoopStore, owner: str, written: int = 0) -> None:
        self.store = store
        self.owner = owner
        self.written = written
        """How many context items the store holds."""
        self.answer: ContextItem | None = None
        """The item at `loop.answer_at` when last written (a handler may replace it)."""
        self.inference: tuple[int, InferenceOutput] | None = None
        """A model output to write with the next commit."""
        self.recorded: InferenceOutput | None = None
        """The output of the request a recovered loop was making, if recorded."""

    async def save(self, loop: Loop) -> None:
        """Write the loop's record and what its context gained since the last write."""
        items = loop.input.context.items
        first = self.written
        truncate = first > len(items)
        if truncate:
            first = 0  # the context shrank (someone edited it): write it whole
        replaced = None
        at = loop.answer_at
        if at is not None and at < first and items[at] is not self.answer:
            replaced = {at: items[at]}  # an answer a handler rewrote at `finish`
        commit = Commit(loop.snapshot(), first, items[first:], replaced, self.inference)
        self.inference = None
        await self.store.commit(commit, self.owner)
        self.written = len(items)
        if at is not None and at < len(items):
            self.answer = items[at]

    async def write_inference(self, loop: Loop) -> None:
        """Write the output now, not with the next commit: the loop's handlers
        decide about it first, and may take a while (a crash meanwhile would
        send the request, and pay for it, again)."""
        if self.inference is not None:
            number, output = self.inference
            await self.store.record_inference(loop.loop_id, number, output)
            self.inference = None

    # ----------------------------------------------------------------- ledger

    def key(self, loop: Loop, position: int, call: FunctionCallItem) -> str:
        return idempotency_key(
            loop.loop_id, loop.model_requests, position, call.name, call.arguments
        )

    async def begin_call(
        self, loop: Loop, key: str, position: int, call: FunctionCallItem
    ) -> CallRecord:
        """Record the intent to run `call`; the ledger's entry (`done` when the
        call ran already: its recorded output is the output)."""
        return await self.store.begin_call(
            CallRecord(
                key=key,
                loop_id=loop.loop_id,
                request=loop.model_requests,
                position=position,
                tool=call.name,
                call_id=call.call_id,
                status="started",
            )
        )

    async def end_call(
        self, key: str, output: FunctionCallOutputItem, terminate: bool
    ) -> None:
        await self.store.end_call(key, output, terminate)
