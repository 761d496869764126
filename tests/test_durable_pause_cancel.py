"""A durable loop cancelled while its pause is still being saved ends cancelled.

A store across a network takes a while to save a pause, and the loop already
shows `paused` meanwhile; `Runtime.cancel` then only cancels the worker that is
saving it. Found with the PostgreSQL store on trio, where the loop stayed
paused forever (`wait` never returned).
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from agentfsm import InferenceInput, LoopStatus, ModelContext, Outcome, Runtime, tool
from agentfsm.store import Commit, MemoryStore
from agentfsm.testing import ScriptedProvider, call, calls
from tests.helpers import wait_until


@tool(needs_approval=True)
async def pay(amount: int) -> str:
    """Pay an amount."""
    return f"paid {amount}"


class SlowPauses(MemoryStore):
    """Saving a pause waits for `gate`."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = anyio.Event()
        self.saving_pause = False

    async def commit_many(self, commits: Sequence[Commit]) -> list[Exception | None]:
        if any(c.record and c.record.status is LoopStatus.paused for c in commits):
            self.saving_pause = True
            await self.gate.wait()
        return await super().commit_many(commits)


async def test_a_loop_cancelled_while_its_pause_is_saved_ends_cancelled() -> None:
    store = SlowPauses()
    async with Runtime(
        providers={"scripted": ScriptedProvider([calls(call("pay", amount=5))])},
        store=store,
    ) as runtime:
        loop_id = runtime.run_loop(
            "agent",
            "pay 5",
            InferenceInput(model="scripted:m", context=ModelContext(), tools=[pay]),
        )
        await wait_until(lambda: store.saving_pause)
        assert runtime.get(loop_id).status is LoopStatus.paused
        runtime.cancel(loop_id)
        store.gate.set()
        with anyio.fail_after(5):
            result = await runtime.wait(loop_id)
    assert result.outcome is Outcome.cancelled
    stored = await store.load(loop_id)
    assert stored is not None
    assert stored.record.outcome is Outcome.cancelled
