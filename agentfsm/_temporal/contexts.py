"""`StoreContexts`: a `ContextStore` on agentfsm's durable store, which every
worker reads, so that a request landing on another worker (or after a
restart) still carries only the items added since the last one.

Append-only: a request writes only the items past the prefix the store holds
(the digests chain, so one equal digest at the end of the prefix means the
whole prefix is equal). The cost of a request stays linear in what it adds,
not in the context's size, and history never carries the whole context.
"""

from __future__ import annotations

from agentfsm.exceptions import ConfigurationError
from agentfsm.messages import ContextItem
from agentfsm.store import LoopStore, SharedContexts

__all__ = ("StoreContexts",)


_HELD_KEPT = 4096


class StoreContexts:
    """Each workflow's context in a durable store (`SQLiteStore` for workers
    on one machine, `PostgresStore` for workers anywhere); opened on first use.

    ```python
    contexts = StoreContexts(PostgresStore("postgresql://..."))
    async with worker(client, task_queue="agents", agents=..., context_store=contexts):
        ...
    ```
    """

    def __init__(self, store: LoopStore) -> None:
        if not isinstance(store, SharedContexts):
            raise ConfigurationError(
                f"{type(store).__name__} keeps no shared contexts: use SQLiteStore "
                "or PostgresStore"
            )
        self.store = store
        self._contexts: SharedContexts = store
        self._opened = False
        self._held: dict[str, tuple[int, str]] = {}
        """What this worker last saw the store hold of a loop: its length and
        its last digest (a hint; the store decides), for the `_HELD_KEPT`
        loops it saw last (a long-lived worker sees loops without end)."""
        self.misses = 0
        """How many requests referred to a prefix the store did not hold."""

    async def _open(self) -> None:
        if not self._opened:
            await self.store.open()
            self._opened = True

    async def get(self, loop_id: str) -> tuple[list[ContextItem], list[str]] | None:
        await self._open()
        held = await self._contexts.context(loop_id)
        if held is None:
            self._held.pop(loop_id, None)
            return None
        self._remember(loop_id, held[1])
        return held

    async def put(
        self, loop_id: str, items: list[ContextItem], digests: list[str]
    ) -> None:
        await self._open()
        first = 0
        known = self._held.get(loop_id)
        if known is not None:
            length, last = known
            if 0 < length <= len(digests) and digests[length - 1] == last:
                first = length  # the store holds this prefix: append the rest
        await self._contexts.append_context(
            loop_id, first, items[first:], digests[first:]
        )
        self._remember(loop_id, digests)

    def _remember(self, loop_id: str, digests: list[str]) -> None:
        held = self._held
        held.pop(loop_id, None)  # the most recent last
        if len(held) >= _HELD_KEPT:
            del held[next(iter(held))]  # the oldest
        held[loop_id] = (len(digests), digests[-1] if digests else "")
