"""`StoreContexts`: a `ContextStore` on agentfsm's durable store, which every
worker reads, so that a request landing on another worker (or after a
restart) still carries only the items added since the last one.

Append-only: a request writes only the items past the prefix the store holds
(the digests chain, so one equal digest at the end of the prefix means the
whole prefix is equal). The cost of a request stays linear in what it adds,
not in the context's size, and history never carries the whole context.

It also keeps tool outputs too large to go inline (by reference, under a
digest of the loop's id and the output), and the bytes of images (by their
digest: one copy for every loop, request and run that refers to one),
beside the contexts.
"""

from __future__ import annotations

from collections import OrderedDict

from agentfsm.exceptions import ConfigurationError
from agentfsm.messages import (
    ContextItem,
    FunctionCallOutputItem,
    ImageBlock,
    UserMessage,
)
from agentfsm.store import LoopStore, SharedContexts

__all__ = ("StoreContexts",)


_HELD_KEPT = 4096
_OUTPUTS_KEPT = 8
_IMAGE_BYTES_KEPT = 64 * 1024 * 1024
_IMAGES_HELD_KEPT = 65_536

BY_REFERENCE = 256 * 1024
"""`StoreContexts`' default `by_reference`: Temporal's own external payload
storage's default threshold, half the server's warning size (512 KiB)."""


class StoreContexts:
    """Each workflow's context in a durable store (`SQLiteStore` for workers
    on one machine, `PostgresStore` for workers anywhere); opened on first use.

    ```python
    contexts = StoreContexts(PostgresStore("postgresql://..."))
    async with worker(client, task_queue="agents", agents=..., context_store=contexts):
        ...
    ```

    Since every worker reads it, large values go through it by reference
    instead of inline in Temporal's payloads: a tool output over
    `by_reference` bytes (default 256 KiB) is kept here by the tool's activity,
    which returns a reference, and context items that would make a request's
    arguments too large are handed to it ahead of the request. Every image
    goes by reference, whatever its size: its bytes are kept here once, by
    their digest (`put_image`, `image`).
    """

    def __init__(self, store: LoopStore, *, by_reference: int = BY_REFERENCE) -> None:
        if not isinstance(store, SharedContexts):
            raise ConfigurationError(
                f"{type(store).__name__} keeps no shared contexts: use SQLiteStore "
                "or PostgresStore"
            )
        if type(by_reference) is not int or by_reference < 1:
            raise ConfigurationError(
                f"by_reference must be an int >= 1 (bytes), got {by_reference!r}"
            )
        self.by_reference = by_reference
        """Tool outputs larger than this many bytes (as JSON) go by reference."""
        self.store = store
        self._outputs: OrderedDict[str, str] = OrderedDict()
        """The outputs this worker read last: a key names one content, so
        they are never stale, and each request of a loop reads them again."""
        self._contexts: SharedContexts = store
        self._opened = False
        self._held: dict[str, tuple[int, str]] = {}
        """What this worker last saw the store hold of a loop: its length and
        its last digest (a hint; the store decides), for the `_HELD_KEPT`
        loops it saw last (a long-lived worker sees loops without end)."""
        self._images: OrderedDict[str, ImageBlock] = OrderedDict()
        """The images this worker read or wrote last, at most
        `_IMAGE_BYTES_KEPT` bytes of them (a digest names one content)."""
        self._image_bytes = 0
        self._images_held: OrderedDict[str, None] = OrderedDict()
        """Digests of images this worker knows the store holds (not written
        again)."""
        self.misses = 0
        """How many requests referred to a prefix the store did not hold."""
        self.rebuilt = 0
        """How many of those misses were rebuilt from the workflow's history."""

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

    async def put_output(self, key: str, output: str) -> None:
        """Keep a tool output under `key` (its digest: writing it again is
        harmless, so a retried activity may)."""
        await self._open()
        item = FunctionCallOutputItem(call_id=key, output=output)
        await self._contexts.append_context(_output_id(key), 0, [item], [key])

    async def output(self, key: str) -> str | None:
        """The tool output kept under `key`, or None."""
        kept = self._outputs
        if key in kept:
            kept.move_to_end(key)
            return kept[key]
        await self._open()
        held = await self._contexts.context(_output_id(key))
        if held is None or not held[0]:
            return None
        item = held[0][0]
        if not isinstance(item, FunctionCallOutputItem):
            return None
        kept[key] = item.output
        if len(kept) > _OUTPUTS_KEPT:
            kept.popitem(last=False)
        return item.output

    async def put_image(self, block: ImageBlock) -> None:
        """Keep an image's bytes under its digest (writing it again is
        harmless: a retried activity may; one this worker wrote or read is
        not written again)."""
        digest = block.digest
        if block.data is None or digest is None:
            kind = "by reference" if block.is_reference else "by URL"
            raise ConfigurationError(
                f"put_image() keeps an image's bytes: {block.reference} is {kind}, "
                "without them"
            )
        if digest in self._images_held:
            return
        await self._open()
        message = UserMessage(content=(block,))
        await self._contexts.append_context(_image_id(digest), 0, [message], [digest])
        self._held_image(digest)
        self._keep(block)

    async def image(self, digest: str) -> ImageBlock | None:
        """The image kept under `digest` (its bytes checked against it as
        they are read back), or None."""
        kept = self._images.get(digest)
        if kept is not None:
            self._images.move_to_end(digest)
            return kept
        await self._open()
        held = await self._contexts.context(_image_id(digest))
        if held is None or not held[0]:
            return None
        item = held[0][0]
        images = item.images if isinstance(item, UserMessage) else ()
        if len(images) != 1 or images[0].digest != digest:
            return None
        self._held_image(digest)
        self._keep(images[0])
        return images[0]

    def _held_image(self, digest: str) -> None:
        held = self._images_held
        held[digest] = None
        held.move_to_end(digest)
        if len(held) > _IMAGES_HELD_KEPT:
            held.popitem(last=False)

    def _keep(self, block: ImageBlock) -> None:
        assert block.digest is not None  # a block of bytes has both
        assert block.size is not None
        if block.size > _IMAGE_BYTES_KEPT // 4:
            return  # a few large images would push every other one out
        kept = self._images
        if block.digest not in kept:
            kept[block.digest] = block
            self._image_bytes += block.size
        while self._image_bytes > _IMAGE_BYTES_KEPT:
            _, oldest = kept.popitem(last=False)
            self._image_bytes -= oldest.size or 0

    def _remember(self, loop_id: str, digests: list[str]) -> None:
        held = self._held
        held.pop(loop_id, None)  # the most recent last
        if len(held) >= _HELD_KEPT:
            del held[next(iter(held))]  # the oldest
        held[loop_id] = (len(digests), digests[-1] if digests else "")


def _output_id(key: str) -> str:
    # Beside the loops' contexts, which are kept under the loops' ids.
    return f"agentfsm.output/{key}"


def _image_id(digest: str) -> str:
    # One for every loop: an image's bytes are named by their digest alone.
    return f"agentfsm.image/{digest}"
