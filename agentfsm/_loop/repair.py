"""Context repair: a function call without an output gets one, in the request only.

A call left without an output (by a crash or a cancellation upstream) gets a
synthetic error output in the request's copy of the context, never in the
loop's context. Finding such calls is incremental: each request scans only the
items appended since the previous one, so a step costs the same whatever the
context's length (`ContextScan`, kept with the context and shared by every loop
appending to it).
"""

from __future__ import annotations

from typing import Final

from agentfsm.inference import InferenceInput, RequestMetadata
from agentfsm.messages import (
    ContextItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    ModelContext,
)

__all__ = ("REPAIRED", "ContextScan", "context_scan", "normalized")

REPAIRED: Final = (
    "no output was recorded for this call (it was interrupted before it finished)"
)


class ContextScan:
    """Tracks the function calls of a context that have no output yet."""

    __slots__ = ("_items", "_open", "_scanned")

    def __init__(self) -> None:
        self._items: list[ContextItem] | None = None
        self._scanned = 0
        self._open: dict[str, int] = {}

    def open_calls(self, items: list[ContextItem]) -> dict[str, int]:
        """`call_id -> index` of the calls without an output in `items`."""
        if items is not self._items or len(items) < self._scanned:
            self._items, self._scanned, self._open = items, 0, {}
        open_calls = self._open
        for index in range(self._scanned, len(items)):
            item = items[index]
            if isinstance(item, FunctionCallItem):
                open_calls[item.call_id] = index
            elif isinstance(item, FunctionCallOutputItem):
                open_calls.pop(item.call_id, None)
        self._scanned = len(items)
        return open_calls

    def clean(self, items: list[ContextItem]) -> bool:
        """Whether `items` is known to have no call without an output (the scan
        read every item and found none open): then `open_calls` has nothing to do."""
        return items is self._items and self._scanned == len(items) and not self._open

    def skip(self, items: list[ContextItem], before: int, after: int) -> None:
        """Mark `items[before:after]` scanned: the loop wrote them, calls with outputs.

        Only when the scan had reached `before`; otherwise the next scan reads them.
        """
        if items is self._items and self._scanned == before:
            self._scanned = after


# The slot's descriptor: reading the slot through it skips the model's `__getattr__`.
_scan_slot = ModelContext.__dict__["_scan"]


def context_scan(context: ModelContext) -> ContextScan:
    """The scan kept with `context`, shared by every loop appending to it."""
    try:
        scan: ContextScan = _scan_slot.__get__(context)
    except AttributeError:  # the context's first loop
        scan = ContextScan()
        _scan_slot.__set__(context, scan)
    return scan


def normalized(
    request: InferenceInput, scan: ContextScan
) -> tuple[InferenceInput, RequestMetadata | None]:
    """The request to send (a repaired copy when calls lack outputs) and, for a
    repaired one, its metadata (see `metadata`)."""
    items = request.context.items
    open_calls = scan.open_calls(items)
    if not open_calls:
        return request, None
    # Each synthetic output goes after the run of calls and outputs holding its
    # call, so providers that group a turn's calls still see them together.
    inserts: dict[int, list[tuple[int, str]]] = {}
    for call_id, index in sorted(open_calls.items(), key=lambda kv: kv[1]):
        end = index
        while end + 1 < len(items) and items[end + 1].type in (
            "function_call",
            "function_call_output",
        ):
            end += 1
        inserts.setdefault(end, []).append((index, call_id))
    repaired: list[ContextItem] = []
    repairs: list[tuple[int, int, str]] = []
    for index, item in enumerate(items):
        repaired.append(item)
        for call_index, call_id in inserts.get(index, ()):
            repairs.append((len(repaired), call_index, call_id))
            repaired.append(FunctionCallOutputItem.error(call_id, REPAIRED))
    context = request.context.model_copy(update={"items": repaired})
    return request.model_copy(update={"context": context}), RequestMetadata(
        len(items), repairs
    )
