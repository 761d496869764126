"""The repair scan a context keeps for its loops (`agentfsm._loop.repair`)."""

from __future__ import annotations

import weakref

from agentfsm import ModelContext, UserMessage
from agentfsm._loop.repair import context_scan


def test_the_scan_is_kept_with_its_context_and_not_with_copies() -> None:
    """The scan lives in a slot of the context: one per context, shared by
    its loops, absent from copies, dumps and equality; contexts stay weakref-able."""
    context = ModelContext(items=[UserMessage(content="hi")])
    scan = context_scan(context)
    assert context_scan(context) is scan
    copy = context.model_copy(deep=True)
    assert context_scan(copy) is not scan
    assert copy == context
    assert context.model_dump() == {
        "instructions": None,
        "items": [{"type": "user_message", "content": "hi"}],
    }
    assert weakref.ref(context)() is context
