"""The agents tests/test_temporal_images.py runs: loops whose messages and
tool results hold images.

The provider records the images of each request it is sent (`SEEN`, in the
worker's process, which is the test's), so a test compares the bytes the
model received with those it sent; and the model answers from the context it
is sent, never from a counter, so a context that arrived incomplete (a
continued run's) shows as a wrong answer.
"""

from __future__ import annotations

import hashlib
import re

from agentfsm import (
    FunctionCallOutputItem,
    ImageBlock,
    InferenceInput,
    InferenceOutput,
    ToolResult,
    UserMessage,
    tool,
)
from agentfsm.interception import Decision, Pause, PendingTransition, ToolBatch
from agentfsm.providers.function import FunctionProvider
from agentfsm.states import Trigger
from agentfsm.temporal import TemporalAgent
from agentfsm.testing import call, calls, text


def png(seed: str, size: int) -> bytes:
    """`size` bytes that start as a PNG does (what image blocks check), the
    rest derived from `seed`: distinct images whose base64 a test can find."""
    head = b"\x89PNG\r\n\x1a\n"
    body = b""
    n = 0
    while len(head) + len(body) < size:
        body += hashlib.sha512(f"{seed}/{n}".encode()).digest()
        n += 1
    return (head + body)[:size]


PHOTO = png("photo", 300_000)
"""The image the user sends with the first message."""
SNAPSHOT = png("snapshot", 250_000)
"""The image the `snapshot` tool returns, every time."""
SKETCH = png("sketch", 200_000)
"""The image a follow-up sends."""
POSTER = png("poster", 1_600_000)
"""The image the `poster` tool returns: too large for a payload as base64."""

SEEN: list[list[tuple[str, bytes]]] = []
"""Each request's images as the provider received them, `(where, bytes)`
each, `where` being `user` or the tool call's id."""


@tool
async def snapshot(n: int) -> ToolResult:
    """Take snapshot `n`: an image, and a line saying which."""
    return ToolResult(output=f"snapshot {n}", images=(ImageBlock.from_bytes(SNAPSHOT),))


@tool
async def poster() -> ImageBlock:
    """A large image, alone."""
    return ImageBlock.from_bytes(POSTER)


def _seen(request: InferenceInput) -> list[tuple[str, bytes]]:
    found: list[tuple[str, bytes]] = []
    for item in request.context.items:
        if isinstance(item, UserMessage):
            found.extend(("user", b.data or b"") for b in item.images)
        elif isinstance(item, FunctionCallOutputItem):
            found.extend((item.call_id, b.data or b"") for b in item.images)
    return found


def _named(data: bytes) -> str:
    names = {PHOTO: "photo", SNAPSHOT: "snapshot", SKETCH: "sketch", POSTER: "poster"}
    return names.get(data, f"{len(data)} unknown bytes")


_STEPS = re.compile(r"take (\d+) snapshots")


def looker_model(request: InferenceInput) -> InferenceOutput:
    """Takes as many snapshots as the last "take <n> snapshots" message asks,
    one a turn, then answers with every image it was sent, in order."""
    seen = _seen(request)
    SEEN.append(seen)
    items = request.context.items
    last_ask = max(
        i
        for i, item in enumerate(items)
        if isinstance(item, UserMessage) and _STEPS.search(item.text)
    )
    asked = items[last_ask]
    assert isinstance(asked, UserMessage)
    wanted = int(_STEPS.search(asked.text).group(1))  # type: ignore[union-attr]
    taken = [i for i in items[last_ask:] if isinstance(i, FunctionCallOutputItem)]
    total = sum(isinstance(i, FunctionCallOutputItem) for i in items)
    if len(taken) < wanted:
        return calls(call("snapshot", call_id=f"s{total}", n=total))
    return text(", ".join(f"{where}: {_named(data)}" for where, data in seen))


def poster_model(request: InferenceInput) -> InferenceOutput:
    """Asks for the poster, then answers with every image it was sent and
    the tool's output."""
    seen = _seen(request)
    SEEN.append(seen)
    outputs = [
        i for i in request.context.items if isinstance(i, FunctionCallOutputItem)
    ]
    if not outputs:
        return calls(call("poster", call_id="p1"))
    images = ", ".join(f"{where}: {_named(data)}" for where, data in seen)
    return text(f"{images or 'no images'}; {outputs[0].output}")


def model_for(request: InferenceInput) -> InferenceOutput:
    name = request.model.partition(":")[2]
    return {"looker": looker_model, "poster": poster_model}[name](request)


PROVIDERS = {"fn": FunctionProvider(model_for)}


def pause_to_look(pending: PendingTransition) -> Decision | None:
    """Pauses before the first snapshot runs (so that a test queues a
    follow-up while the loop waits, and reads its transcript) and before a
    follow-up enters the context (so that it reads the view's pending
    messages). Workflow code: it decides from the transition alone."""
    payload = pending.payload
    if pending.trigger is Trigger.follow_up:
        return Pause("a follow-up, to look at")
    if (
        pending.trigger is Trigger.call_tools
        and isinstance(payload, ToolBatch)
        and payload.calls[0].call_id == "s0"
    ):
        return Pause("the first snapshot, to look at")
    return None


LOOKER = TemporalAgent(
    name="images-looker",
    model="fn:looker",
    tools=[snapshot],
    options={"max_turns": 100},
)
POSTERS = TemporalAgent(name="images-poster", model="fn:poster", tools=[poster])
WATCHED = TemporalAgent(
    name="images-watched",
    model="fn:looker",
    tools=[snapshot],
    handlers=[pause_to_look],
    options={"max_turns": 100},
)
AGENTS = (LOOKER, POSTERS, WATCHED)
