"""A tool call's idempotency key (`agentfsm.current_call().idempotency_key`).

The key names one call of one loop, the same across crashes and recoveries:
the loop id, the number of the model request that asked for it, its position
in that request's batch, the tool's name and its arguments as canonical JSON.
The model's call id plays no part: it may be empty, or repeat. The durable
store's ledger keys its entries by it; a tool passes it on to an API that
deduplicates by key (a payment provider's `Idempotency-Key` header, say).
"""

from __future__ import annotations

import hashlib
import json

__all__ = ("canonical_arguments", "idempotency_key")


def canonical_arguments(arguments: str) -> str:
    """A call's arguments as canonical JSON (sorted keys, no spaces), or as
    given when they are not JSON (the call will fail the same way again)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def idempotency_key(
    loop_id: str, request: int, position: int, name: str, arguments: str
) -> str:
    """The key of one tool call: the same for the same call of the same loop
    (the `request`-th model request's `position`-th call of `name` with these
    arguments), across crashes and recoveries. The model's call id plays no
    part: it may be empty, or repeat."""
    text = json.dumps(
        [loop_id, request, position, name, canonical_arguments(arguments)],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(text.encode()).hexdigest()
