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
from agentfsm.events import AgentEvent
from agentfsm.inference import NO_IMAGES, ImageSupport
from agentfsm.interception import Decision, Pause, PendingTransition, Rewrite, ToolBatch
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
STAMP = png("stamp", 2_000)
"""The image a handler's rewrite adds to a message."""

SEEN: list[list[tuple[str, bytes]]] = []
"""Each request's images as the provider received them, `(where, bytes)`
each, `where` being `user` or the tool call's id."""
EVENTS: list[AgentEvent] = []
"""The events of the loops of the agents that take no images (their
subscriber, called in the worker's process, which is the test's)."""


@tool
async def snapshot(n: int) -> ToolResult:
    """Take snapshot `n`: an image, and a line saying which."""
    return ToolResult(output=f"snapshot {n}", images=(ImageBlock.from_bytes(SNAPSHOT),))


@tool
async def note() -> str:
    """Take a note."""
    return "noted"


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


def texter_model(request: InferenceInput) -> InferenceOutput:
    """Takes a note, then answers with the text of each user message it was
    sent and the number of images: a message that entered the context shows."""
    seen = _seen(request)
    SEEN.append(seen)
    items = request.context.items
    if not any(isinstance(i, FunctionCallOutputItem) for i in items):
        return calls(call("note", call_id="n1"))
    texts = " | ".join(i.text for i in items if isinstance(i, UserMessage))
    return text(f"{texts}; {len(seen)} images")


def model_for(request: InferenceInput) -> InferenceOutput:
    name = request.model.partition(":")[2]
    models = {"looker": looker_model, "poster": poster_model, "texter": texter_model}
    return models[name](request)


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


def pause_to_note(pending: PendingTransition) -> Decision | None:
    """Pauses before the note is taken, so that a test signals the loop
    while it waits."""
    if pending.trigger is Trigger.call_tools:
        return Pause("the note, to signal")
    return None


def add_a_stamp(pending: PendingTransition) -> Decision | None:
    """Rewrites a start's "stamp it" into the same text with an image."""
    message = pending.payload
    if (
        pending.trigger is Trigger.start
        and isinstance(message, UserMessage)
        and message.content == "stamp it"
    ):
        return Rewrite(
            payload=UserMessage(content=["stamp it", ImageBlock.from_bytes(STAMP)])
        )
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
TEXT_ONLY = TemporalAgent(
    name="images-text-only",
    model="fn:texter",
    tools=[note],
    handlers=[pause_to_note],
    subscribers=[EVENTS.append],
    images=NO_IMAGES,
)
SMALL_ONLY = TemporalAgent(
    name="images-small-only",
    model="fn:looker",
    tools=[snapshot],
    images=ImageSupport(max_bytes=100_000),
)
STAMPED = TemporalAgent(
    name="images-stamped",
    model="fn:texter",
    tools=[note],
    handlers=[add_a_stamp],
    subscribers=[EVENTS.append],
    images=NO_IMAGES,
)
AGENTS = (LOOKER, POSTERS, WATCHED, TEXT_ONLY, SMALL_ONLY, STAMPED)
