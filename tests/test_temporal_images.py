"""agentfsm.temporal and images: a loop started with an image, whose tool
returns one, answers with the model having received the same bytes, while
the workflow's history holds each image's bytes a bounded number of times
(never once per request): with `StoreContexts` an image goes by reference,
its bytes kept once, by digest, in the store.

Against a real dev server that suggests continue-as-new early (as
tests/test_temporal_continue.py), so a long loop runs across several runs;
asyncio only, as every Temporal test; a task queue per test.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError, WorkflowHistory
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from agentfsm import ImageBlock, LoopResult, ModelMessageItem, Outcome, UserMessage
from agentfsm.exceptions import ConfigurationError, ImageNotSupported
from agentfsm.messages import FunctionCallOutputItem, TextBlock
from agentfsm.results import LoopStatus
from agentfsm.store import SQLiteStore
from agentfsm.temporal import (
    LoopClient,
    LoopWorkflow,
    MemoryContextStore,
    StoreContexts,
    TemporalAgent,
    worker,
    workflow_id,
    workflow_runner,
)
from tests.temporal_images_agents import (
    AGENTS,
    EVENTS,
    PHOTO,
    POSTER,
    PROVIDERS,
    SEEN,
    SKETCH,
    SNAPSHOT,
    STAMP,
)
from tests.temporal_server import NEEDS_TEMPORAL, dev_server, suggesting_continue_as_new

pytestmark = [
    pytest.mark.temporal,
    pytest.mark.e2e,
    NEEDS_TEMPORAL,
]

SUGGEST_AT = 60
"""History events at which the server suggests continue-as-new: a few turns,
past the short loop's whole history."""


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio only: a Temporal workflow runs on an asyncio event loop."""
    return "asyncio"


@pytest.fixture(scope="module")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    async with dev_server(suggesting_continue_as_new(SUGGEST_AT)) as environment:
        yield environment


@pytest.fixture
def queue() -> str:
    return f"agentfsm-images-{uuid.uuid4().hex[:8]}"


async def runs_of(client: Client, loop_id: str) -> list[WorkflowHistory]:
    """The histories of every run of a loop's workflow, first run first."""
    wid = workflow_id(loop_id)
    run_id = (await client.get_workflow_handle(wid).describe()).run_id
    histories: list[WorkflowHistory] = []
    while run_id:
        history = await client.get_workflow_handle(wid, run_id=run_id).fetch_history()
        histories.insert(0, history)
        started = history.events[0].workflow_execution_started_event_attributes
        run_id = started.continued_execution_run_id
    return histories


def events(histories: list[WorkflowHistory]) -> list[bytes]:
    """Every event of the histories, as the server keeps it (its payloads:
    starts, signals, activities' arguments and results, continue-as-new
    inputs, the result)."""
    return [e.SerializeToString() for h in histories for e in h.events]


def copies(histories: list[WorkflowHistory], image: bytes) -> int:
    """How many times the histories hold `image`'s bytes (as the base64 of
    JSON data: a distinctive piece of it)."""
    piece = base64.b64encode(image)[3000:3064]
    return sum(e.count(piece) for e in events(histories))


def activities(histories: list[WorkflowHistory], suffix: str) -> list[Any]:
    """The arguments of each activity whose name ends with `suffix`."""
    found = []
    for history in histories:
        for e in history.events:
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                attrs = e.activity_task_scheduled_event_attributes
                if attrs.activity_type.name.endswith(suffix):
                    found.append(json.loads(attrs.input.payloads[0].data))
    return found


async def replayed_cleanly(histories: list[WorkflowHistory]) -> None:
    replayer = Replayer(workflows=[LoopWorkflow], workflow_runner=workflow_runner())
    for history in histories:
        replayed = await replayer.replay_workflow(
            history, raise_on_replay_failure=False
        )
        assert replayed.replay_failure is None, replayed.replay_failure


async def finished(client: LoopClient, loop_id: str) -> LoopResult:
    with anyio.fail_after(60):
        return await client.wait(loop_id)


def ask(text: str, image: bytes) -> UserMessage:
    return UserMessage(content=[text, ImageBlock.from_bytes(image)])


# ------------------------------------------------------------ a short loop


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
async def test_a_loop_with_images_answers_with_the_bytes_it_was_sent(
    env: WorkflowEnvironment, queue: str, tmp_path: Path, kind: str
) -> None:
    """Started with text and an image, the loop's tool returns an image: the
    model's second request holds both, byte-equal. With `StoreContexts` the
    history holds the user's image twice (the start's input; the `images`
    activity that hands it to the store) and the tool's never (its activity
    returns a reference); with each worker's own store, each goes inline
    where it first crosses (the start or the tool's result, then the one
    request that sends it), and the `images` activity carries no bytes."""
    SEEN.clear()
    store: Any = (
        StoreContexts(SQLiteStore(tmp_path / "contexts.db"))
        if kind == "sqlite"
        else MemoryContextStore()
    )
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=store,
    ):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("images-looker", ask("take 1 snapshots", PHOTO))
        result = await finished(client, loop_id)
        transcript = await client.transcript(loop_id)
        histories = await runs_of(env.client, loop_id)

    assert result.outcome is Outcome.answered, result
    assert result.answer == ModelMessageItem(content="user: photo, s0: snapshot")
    assert SEEN == [[("user", PHOTO)], [("user", PHOTO), ("s0", SNAPSHOT)]]
    assert len(histories) == 1  # short of the suggested continue-as-new

    looked = activities(histories, ".images")
    assert looked[0]["digests"] == [ImageBlock.from_bytes(PHOTO).digest]
    assert looked[0]["images"] == []  # asked by digest: no bytes
    if kind == "sqlite":
        assert copies(histories, PHOTO) == 2
        assert copies(histories, SNAPSHOT) == 0
        assert len(looked) == 2  # looked for, then kept
        # The transcript holds them as references; the store, their bytes.
        photo, snap = _images(transcript.items)
        assert photo == ImageBlock.from_bytes(PHOTO).as_reference()
        assert snap == ImageBlock.from_bytes(SNAPSHOT).as_reference()
        assert (photo.size, snap.size) == (300_000, 250_000)
        kept = await store.image(ImageBlock.from_bytes(SNAPSHOT).digest)
        assert kept is not None
        assert kept.data == SNAPSHOT
    else:
        assert copies(histories, PHOTO) == 2
        assert copies(histories, SNAPSHOT) == 2
        assert len(looked) == 1  # the store keeps no images: inline from then on
        photo, snap = _images(transcript.items)
        assert (photo.data, snap.data) == (PHOTO, SNAPSHOT)
    await replayed_cleanly(histories)


async def until_paused(client: LoopClient, loop_id: str, reason: str) -> None:
    # Polls the workflow's query: the loop runs in the worker, not here.
    with anyio.fail_after(60):
        while (view := await client.get(loop_id)).status is not LoopStatus.paused:
            assert view.status is not LoopStatus.done, view
            await anyio.sleep(0.02)
    assert view.pause_reason == reason, view


async def test_the_transcript_and_the_view_show_images_by_reference(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    """With `StoreContexts`, what leaves the workflow for a client shows each
    image the store holds as a reference block (`is_reference`, the image's
    digest, no bytes): the transcript's, while the loop waits before its
    first snapshot; the `view` query's pending follow-up, which holds the
    photo again (the store holds it since the first request). The model still
    gets the bytes, and the history holds the photo three times only (the
    start, the `images` activity, the follow-up's signal: the store held it
    by then, so no activity carries it again)."""
    SEEN.clear()
    photo = ImageBlock.from_bytes(PHOTO)
    store = StoreContexts(SQLiteStore(tmp_path / "contexts.db"))
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=store,
    ):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("images-watched", ask("take 1 snapshots", PHOTO))
        await until_paused(client, loop_id, "the first snapshot, to look at")
        transcript = await client.transcript(loop_id)
        await client.follow_up(loop_id, ask("take 1 snapshots", PHOTO))
        resumed = await client.resume(loop_id)
        await until_paused(client, loop_id, "a follow-up, to look at")
        view = await client.get(loop_id)
        after = await client.resume(loop_id)
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, loop_id)

    (shown,) = _images(transcript.items)
    assert shown.is_reference
    assert (shown.digest, shown.size, shown.data) == (photo.digest, len(PHOTO), None)
    assert view.pending is not None
    queued = view.pending.payload
    assert isinstance(queued, tuple)
    (message,) = queued
    assert isinstance(message, UserMessage)
    assert message.text == "take 1 snapshots"
    (pending,) = message.images
    assert pending.is_reference
    assert pending.digest == photo.digest
    assert pending == photo.as_reference()
    for update in (resumed, after):
        assert update.status is not LoopStatus.paused

    assert result.outcome is Outcome.answered, result
    assert result.answer == ModelMessageItem(
        content="user: photo, s0: snapshot, user: photo, s1: snapshot"
    )
    assert SEEN[-1] == [
        ("user", PHOTO),
        ("s0", SNAPSHOT),
        ("user", PHOTO),
        ("s1", SNAPSHOT),
    ]
    assert copies(histories, PHOTO) == 3
    assert copies(histories, SNAPSHOT) == 0
    await replayed_cleanly(histories)


def _images(items: list[Any]) -> list[ImageBlock]:
    found: list[ImageBlock] = []
    for item in items:
        if isinstance(item, UserMessage | FunctionCallOutputItem):
            found.extend(item.images)
    return found


async def test_a_loop_started_on_another_s_transcript_sees_its_images(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    """`start(from_loop=)` seeds a loop with a transcript whose images are
    references: the new loop's model receives the bytes, read from the store
    by digest, and the new loop's history holds none of them."""
    SEEN.clear()
    store = StoreContexts(SQLiteStore(tmp_path / "contexts.db"))
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=store,
    ):
        client = LoopClient(env.client, task_queue=queue)
        first = await client.start("images-looker", ask("take 1 snapshots", PHOTO))
        await finished(client, first)
        second = await client.start(
            "images-looker", "take 1 snapshots", from_loop=first
        )
        result = await finished(client, second)
        histories = await runs_of(env.client, second)

    assert result.outcome is Outcome.answered, result
    assert result.answer == ModelMessageItem(
        content="user: photo, s0: snapshot, s1: snapshot"
    )
    assert SEEN[-1] == [("user", PHOTO), ("s0", SNAPSHOT), ("s1", SNAPSHOT)]
    assert copies(histories, PHOTO) == 0
    assert copies(histories, SNAPSHOT) == 0
    await replayed_cleanly(histories)


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
async def test_an_image_too_large_for_a_payload_goes_by_reference(
    env: WorkflowEnvironment, queue: str, tmp_path: Path, kind: str
) -> None:
    """A tool's 1.6 MB image (2.1 MB as base64) fits no payload: with
    `StoreContexts` it goes by reference like any image, and the model gets
    it whole; with each worker's own store the model gets an error output
    naming the size, the limit and `StoreContexts`, and the loop goes on."""
    SEEN.clear()
    store: Any = (
        StoreContexts(SQLiteStore(tmp_path / "contexts.db"))
        if kind == "sqlite"
        else MemoryContextStore()
    )
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=store,
    ):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("images-poster", "show me the poster")
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, loop_id)

    assert result.outcome is Outcome.answered, result
    assert result.answer is not None
    assert copies(histories, POSTER) == 0
    if kind == "sqlite":
        assert result.answer.content == "p1: poster; "
        assert SEEN[-1] == [("p1", POSTER)]
    else:
        assert result.answer.content == (
            "no images; tool 'poster' returned 1 image(s) of 1,600,000 bytes in "
            "all, over the 2,000,000 bytes one Temporal payload may carry with "
            "its output; the images were dropped. With a context store every "
            "worker reads (StoreContexts), images go by reference instead."
        )
    await replayed_cleanly(histories)


# ------------------------------------------------- a model that takes fewer


def refusal(model: str, capability: str, block: ImageBlock) -> str:
    """`ImageNotSupported`'s message for a message's image `block`, second in
    its content."""
    return (
        f"model {model!r} does not take {capability}: the message's content[1] "
        f"{block.reference} was refused before it entered the context"
    )


def event_types(histories: list[WorkflowHistory]) -> list[str]:
    return [EventType.Name(e.event_type) for h in histories for e in h.events]


@pytest.mark.parametrize(
    ("agent", "model", "capability"),
    [
        ("images-text-only", "fn:texter", "images in user messages"),
        ("images-small-only", "fn:looker", "images over 100,000 bytes"),
    ],
)
async def test_a_start_with_an_image_the_model_cannot_take_fails_the_workflow(
    env: WorkflowEnvironment, queue: str, agent: str, model: str, capability: str
) -> None:
    """An agent declares where its model takes images (`TemporalAgent(
    images=)`): a start whose message holds an image it cannot take (none at
    all; none over 100,000 bytes, the photo being 300,000) fails the workflow
    at once, non-retryable, `ImageNotSupported` naming the model, the
    capability and the block, its first detail those three; no activity was
    scheduled, the provider was never called, no workflow task failed."""
    SEEN.clear()
    photo = ImageBlock.from_bytes(PHOTO)
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start(agent, ask("take 1 snapshots", PHOTO))
        with anyio.fail_after(60), pytest.raises(WorkflowFailureError) as failed:
            await client.handle(loop_id).result()
        with pytest.raises(ImageNotSupported, match=capability) as told:
            await finished(client, loop_id)
        histories = await runs_of(env.client, loop_id)
    assert (told.value.model, told.value.capability) == (model, capability)

    cause = failed.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == "ImageNotSupported"
    assert cause.non_retryable
    assert cause.message == refusal(model, capability, photo)
    block = f"content[1] {photo.reference}"
    assert list(cause.details) == [
        {"model": model, "capability": capability, "block": block}
    ]
    assert SEEN == []
    types = event_types(histories)
    assert types[-1] == "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED"
    assert "EVENT_TYPE_WORKFLOW_TASK_FAILED" not in types
    assert [t for t in types if "ACTIVITY" in t] == []
    await replayed_cleanly(histories)


@pytest.mark.parametrize("signal", ["steer", "follow_up"])
async def test_a_signal_with_an_image_the_model_cannot_take_is_dropped(
    env: WorkflowEnvironment, queue: str, signal: str
) -> None:
    """A text-only agent's loop (`images=NO_IMAGES`), paused before its tool
    runs, is sent a message with the photo, then one of text: the first is
    dropped (`input.dropped` naming the signal, its reason `ImageNotSupported`'s
    message), the second enters the context, and the loop answers from the
    texts, its model never sent an image; no workflow task failed."""
    SEEN.clear()
    EVENTS.clear()
    photo = ImageBlock.from_bytes(PHOTO)
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("images-text-only", "take a note")
        await until_paused(client, loop_id, "the note, to signal")
        send = client.steer if signal == "steer" else client.follow_up
        await send(loop_id, ask("look at this", PHOTO))
        await send(loop_id, "text too")
        await client.resume(loop_id)
        result = await finished(client, loop_id)
        transcript = await client.transcript(loop_id)
        histories = await runs_of(env.client, loop_id)

    assert result.outcome is Outcome.answered, result
    assert result.answer == ModelMessageItem(content="take a note | text too; 0 images")
    # The answer after the note; a follow-up's own turn after that.
    requests = 2 if signal == "steer" else 3
    assert len(SEEN) == requests
    assert all(seen == [] for seen in SEEN)
    assert [i.text for i in transcript.items if isinstance(i, UserMessage)] == [
        "take a note",
        "text too",
    ]
    dropped = [e for e in EVENTS if e.loop_id == loop_id and e.type == "input.dropped"]
    assert [(e.input, e.reason) for e in dropped] == [
        (signal, refusal("fn:texter", "images in user messages", photo))
    ]
    assert "EVENT_TYPE_WORKFLOW_TASK_FAILED" not in event_types(histories)
    await replayed_cleanly(histories)


async def test_a_rewrite_adding_an_image_the_model_cannot_take_fails_the_loop(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A handler's rewrite of a text-only agent's start adds an image: the
    loop fails `ImageNotSupported` before the message enters the context,
    as on a `Runtime` (the workflow fails `LOOP_FAILED`, the result in its
    details), nothing sent, no workflow task failed."""
    SEEN.clear()
    EVENTS.clear()
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("images-stamped", "stamp it")
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, loop_id)

    assert result.outcome is Outcome.failed, result
    assert result.error is not None
    assert result.error.type == "ImageNotSupported"
    assert result.error.message == refusal(
        "fn:texter", "images in user messages", ImageBlock.from_bytes(STAMP)
    )
    assert SEEN == []
    types = event_types(histories)
    assert types[-1] == "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED"
    failure = histories[-1].events[-1].workflow_execution_failed_event_attributes
    assert failure.failure.application_failure_info.type == "agentfsm.LoopFailed"
    assert "EVENT_TYPE_WORKFLOW_TASK_FAILED" not in types
    assert [t for t in types if "ACTIVITY" in t] == []
    await replayed_cleanly(histories)


# ------------------------------------------------------------- a long loop


async def test_images_go_by_reference_across_continue_as_new(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    """A loop of many one-snapshot turns, and a follow-up with another image,
    runs across several runs: each request's model receives every image of
    the context byte-equal, and the histories of all the runs hold the
    user's images twice each (the start's or the signal's input; the `images`
    activity), the tool's never, whatever the number of requests and runs;
    every run replays."""
    SEEN.clear()
    store = StoreContexts(SQLiteStore(tmp_path / "contexts.db"))
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=store,
    ):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("images-looker", ask("take 6 snapshots", PHOTO))
        await client.follow_up(loop_id, ask("take 2 snapshots", SKETCH))
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, loop_id)

    assert result.outcome is Outcome.answered, result
    snaps = ", ".join(f"s{n}: snapshot" for n in range(6))
    more = ", ".join(f"s{n}: snapshot" for n in range(6, 8))
    assert result.answer == ModelMessageItem(
        content=f"user: photo, {snaps}, user: sketch, {more}"
    )
    assert result.model_requests == len(SEEN) == 10
    for n, seen in enumerate(SEEN):
        expected = [("user", PHOTO)] + [(f"s{k}", SNAPSHOT) for k in range(min(n, 6))]
        if n >= 7:
            expected += [("user", SKETCH)]
            expected += [(f"s{k}", SNAPSHOT) for k in range(6, n - 1)]
        assert seen == expected, n

    assert len(histories) >= 2, [len(h.events) for h in histories]
    for earlier in histories[:-1]:
        last = EventType.Name(earlier.events[-1].event_type)
        assert last == "EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW"
    assert copies(histories, PHOTO) == 2
    assert copies(histories, SKETCH) == 2
    assert copies(histories, SNAPSHOT) == 0
    total = sum(len(e) for e in events(histories))
    sent = sum(len(data) for seen in SEEN for _, data in seen)
    assert sent > 6_000_000  # what inline contexts would have carried, at least
    assert total < 4 * (len(PHOTO) + len(SKETCH))  # the two copies, in base64
    await replayed_cleanly(histories)


# ------------------------------------------------------------------ the parts


def test_what_crosses_holds_a_reference_for_each_image_the_store_holds() -> None:
    """`Images.wire` gives each image whose digest the store holds as its
    reference (`as_reference`: no bytes, the same digest, type and size), and
    leaves alone the images it does not hold, images by URL and items without
    images; a request's arguments carry the references as themselves, and
    none of the bytes."""
    from agentfsm.temporal._calls import Images
    from agentfsm.temporal._wire import InferArgs, dump

    held, other = ImageBlock.from_bytes(SKETCH), ImageBlock.from_bytes(PHOTO)
    by_url = ImageBlock.from_url("https://example.com/a.png")
    plain = UserMessage(content="no image")
    message = UserMessage(content=["look", held, by_url])
    output = FunctionCallOutputItem(call_id="c1", output="two", images=(held, other))
    images = Images(None)  # type: ignore[arg-type]  # wire() asks no activity
    images.held = {held.digest or ""}
    wired = images.wire([plain, message, output])
    assert wired[0] is plain
    assert isinstance(wired[1], UserMessage)
    assert isinstance(wired[2], FunctionCallOutputItem)
    (ref, url), (out_ref, out_other) = wired[1].images, wired[2].images
    for reference in (ref, out_ref):
        assert reference.is_reference
        assert (reference.data, reference.url) == (None, None)
        assert (reference.digest, reference.media_type, reference.size) == (
            held.digest,
            "image/png",
            len(SKETCH),
        )
    assert url is by_url
    assert out_other is other
    assert message.images == (held, by_url)  # the workflow's own is unchanged

    args = InferArgs(
        loop_id="l", request=1, model="fn:x", items=tuple(wired), digests=("a",) * 3
    )
    sent = json.dumps(dump(args))
    assert base64.b64encode(SKETCH)[3000:3064].decode() not in sent
    assert base64.b64encode(PHOTO)[3000:3064].decode() in sent
    assert InferArgs.model_validate(json.loads(sent)) == args


async def test_store_contexts_keeps_an_image_once_by_digest(tmp_path: Path) -> None:
    """`put_image` keeps the bytes under their digest (again: harmless);
    `image` reads them back, checked, from another `StoreContexts` on the
    same file (another worker)."""
    path = tmp_path / "c.db"
    writer = StoreContexts(SQLiteStore(path))
    block = ImageBlock.from_bytes(PHOTO)
    assert block.digest is not None
    assert await writer.image(block.digest) is None
    await writer.put_image(block)
    await writer.put_image(block)
    reader = StoreContexts(SQLiteStore(path))
    read = await reader.image(block.digest)
    assert read is not None
    assert read.data == PHOTO
    assert await reader.get(block.digest) is None  # not a loop's context
    with pytest.raises(Exception, match="keeps an image's bytes"):
        await writer.put_image(ImageBlock.from_url("https://example.com/a.png"))
    with pytest.raises(Exception, match="is by reference, without them"):
        await writer.put_image(block.as_reference())


def test_an_agent_s_images_must_be_an_image_support() -> None:
    """`TemporalAgent(images=)` takes an `ImageSupport` or None; anything
    else is refused when the agent is made, naming the agent."""
    with pytest.raises(ConfigurationError, match=r"'seer'.*images must be an"):
        TemporalAgent(name="seer", model="fn:looker", images="x")  # type: ignore[arg-type]
    assert TemporalAgent(name="seer", model="fn:looker").images is None


def test_a_message_of_blocks_reads_back_from_a_start() -> None:
    """What `LoopClient.start` sends for a message with an image reads back
    whole in the workflow (its bytes as base64 in the start's JSON)."""
    from agentfsm.temporal._wire import StartLoop, dump

    message = UserMessage(
        content=[TextBlock(text="look"), ImageBlock.from_bytes(PHOTO)]
    )
    start = StartLoop(agent="a", loop_id="l", message=message)
    assert StartLoop.model_validate(json.loads(json.dumps(dump(start)))) == start


async def test_an_image_the_store_cannot_give_fails_the_request(tmp_path: Path) -> None:
    """The inference activity puts each reference back as its bytes, or
    fails the request (non-retryable, naming the image): never the reference
    in the image's place. A store of the worker's own keeps no images."""
    from temporalio.exceptions import ApplicationError

    from agentfsm.temporal._activities import _with_bytes
    from agentfsm.temporal._wire import IMAGE_MISSING

    block = ImageBlock.from_bytes(SKETCH)
    item = UserMessage(content=["look", block.as_reference()])
    with pytest.raises(ApplicationError, match="keeps no images") as own:
        await _with_bytes([item], "l1", MemoryContextStore())
    store = StoreContexts(SQLiteStore(tmp_path / "c.db"))
    with pytest.raises(
        ApplicationError, match=f"does not hold image {block.digest}"
    ) as lost:
        await _with_bytes([item], "l1", store)
    await store.put_image(block)
    # A reference whose type is not that of the bytes the store holds.
    forged = ImageBlock(digest=block.digest, media_type="image/jpeg", size=len(SKETCH))
    with pytest.raises(ApplicationError, match="are not those of") as other:
        await _with_bytes([UserMessage(content=[forged])], "l1", store)
    for caught in (own, lost, other):
        assert caught.value.type == IMAGE_MISSING
        assert caught.value.non_retryable
        assert (block.digest or "")[:19] in caught.value.message  # names it
    output = FunctionCallOutputItem(
        call_id="c1", output="one", images=(block.as_reference(),)
    )
    back, out = await _with_bytes([item, output], "l1", store)
    assert isinstance(back, UserMessage)
    assert isinstance(out, FunctionCallOutputItem)
    assert back.content[0] == TextBlock(text="look")
    assert back.images == out.images == (block,)
    assert [b.data for b in back.images] == [SKETCH]
