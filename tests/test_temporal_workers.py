"""agentfsm.temporal with several workers on one task queue, and with an
encrypting payload codec (docs/how-to/temporal-production.md), against a real
dev server.

With two workers, the server dispatches each activity to either: a worker's
own `MemoryContextStore` then often lacks the prefix a request refers to (the
other worker served the previous request). The store's misses are counted;
the worker rebuilds the context from the workflow's history, so no activity
fails and nothing is sent whole. A `StoreContexts` both workers read never
misses. asyncio only (Temporal's workflow event loop is an asyncio loop); one
dev server for the module, each test its own task queue.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import temporalio.converter
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from agentfsm import ModelMessageItem, Outcome
from agentfsm.store import SQLiteStore
from agentfsm.temporal import (
    STATE_ATTRIBUTE,
    ContextStore,
    LoopClient,
    LoopWorkflow,
    MemoryContextStore,
    StoreContexts,
    worker,
    workflow_runner,
)
from tests.temporal_server import NEEDS_TEMPORAL, dev_server
from tests.temporal_workers_agents import AGENTS, PROVIDERS, STEPS, STEPS_ANSWER

pytestmark = [
    pytest.mark.temporal,
    pytest.mark.e2e,
    NEEDS_TEMPORAL,
]


INFER_SCHEDULED = EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
INFER_STARTED = EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio only: a Temporal workflow runs on an asyncio event loop."""
    return "asyncio"


@pytest.fixture(scope="module")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    async with dev_server(search_attributes=[STATE_ATTRIBUTE]) as environment:
        yield environment


@pytest.fixture(scope="module")
async def other_client(env: WorkflowEnvironment) -> Client:
    """A client on a runtime of its own, as another process's would be: one
    runtime refuses two workers of one task queue."""
    return await Client.connect(
        env.client.service_client.config.target_host,
        namespace=env.client.namespace,
        runtime=Runtime(telemetry=TelemetryConfig()),
    )


@pytest.fixture
def queue() -> str:
    return f"agentfsm-workers-{uuid.uuid4().hex[:8]}"


def infer_requests(history: WorkflowHistory) -> list[tuple[int, int]]:
    """`(base, items sent)` of each inference activity the workflow scheduled."""
    found = []
    for event in history.events:
        if event.event_type == INFER_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            if attrs.activity_type.name.endswith(".infer"):
                arg = temporalio.converter.default().payload_converter.from_payload(
                    attrs.input.payloads[0]
                )
                found.append((arg["base"], len(arg["items"])))
    return found


def failed_activities(history: WorkflowHistory) -> int:
    return sum(
        e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
        for e in history.events
    )


def infer_workers(history: WorkflowHistory) -> set[str]:
    """The workers that ran the workflow's inference activities."""
    infers = {
        e.event_id
        for e in history.events
        if e.event_type == INFER_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name.endswith(
            ".infer"
        )
    }
    return {
        e.activity_task_started_event_attributes.identity
        for e in history.events
        if e.event_type == INFER_STARTED
        and e.activity_task_started_event_attributes.scheduled_event_id in infers
    }


async def run_steps(client: LoopClient, count: int) -> list[str]:
    """`count` loops of the `steps` agent at once; their loop ids."""
    ids = [await client.start("steps", "take the steps") for _ in range(count)]
    results: dict[str, Any] = {}

    async def wait(loop_id: str) -> None:
        results[loop_id] = await client.wait(loop_id)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for loop_id in ids:
                tg.start_soon(wait, loop_id)
    for loop_id in ids:
        result = results[loop_id]
        assert result.outcome is Outcome.answered, result
        assert result.answer == ModelMessageItem(content=STEPS_ANSWER)
        assert result.model_requests == STEPS + 1
    return ids


async def two_workers(
    clients: tuple[Client, Client],
    queue: str,
    stores: tuple[ContextStore, ContextStore],
) -> tuple[list[WorkflowHistory], int]:
    """Loops of the `steps` agent on two workers of one queue, each activity
    dispatched by the server (no eager execution on the workflow's worker), in
    rounds of four until a loop's requests ran on both workers (five rounds at
    most): the histories, and how many loops' requests ran on both."""
    client = LoopClient(clients[0], task_queue=queue)
    histories: list[WorkflowHistory] = []
    spread = 0
    async with (
        worker(
            clients[0],
            task_queue=queue,
            agents=AGENTS,
            providers=PROVIDERS,
            context_store=stores[0],
            identity="worker-a",
            disable_eager_activity_execution=True,
        ),
        worker(
            clients[1],
            task_queue=queue,
            agents=AGENTS,
            providers=PROVIDERS,
            context_store=stores[1],
            identity="worker-b",
            disable_eager_activity_execution=True,
        ),
    ):
        for _ in range(5):
            for loop_id in await run_steps(client, 4):
                history = await client.handle(loop_id).fetch_history()
                histories.append(history)
                spread += infer_workers(history) == {"worker-a", "worker-b"}
            if spread:
                break
    return histories, spread


async def test_two_workers_with_memory_stores_rebuild_what_they_miss(
    env: WorkflowEnvironment, other_client: Client, queue: str
) -> None:
    """Each worker's memory store misses whenever the other worker served the
    loop's previous request (often, not once per worker and loop): the worker
    rebuilds the prefix from the workflow's history, so no inference activity
    fails and no request after a loop's first sends its whole context."""
    stores = (MemoryContextStore(), MemoryContextStore())
    histories, spread = await two_workers((env.client, other_client), queue, stores)
    assert spread > 0
    misses = stores[0].misses + stores[1].misses
    rebuilt = stores[0].rebuilt + stores[1].rebuilt
    # A loop's request that follows one the other worker served misses.
    assert misses >= spread
    assert rebuilt == misses
    for history in histories:
        assert failed_activities(history) == 0
        requests = infer_requests(history)
        assert len(requests) == STEPS + 1
        assert [base > 0 for base, _ in requests] == [False] + [True] * STEPS


async def test_two_workers_sharing_store_contexts_never_miss(
    env: WorkflowEnvironment, other_client: Client, queue: str, tmp_path: Path
) -> None:
    """`StoreContexts` on one SQLite file that both workers read: no request
    misses, whichever worker serves it, and every loop answers."""
    path = tmp_path / "contexts.db"
    stores = (StoreContexts(SQLiteStore(path)), StoreContexts(SQLiteStore(path)))
    histories, spread = await two_workers((env.client, other_client), queue, stores)
    assert spread > 0
    assert (stores[0].misses, stores[1].misses) == (0, 0)
    for history in histories:
        assert failed_activities(history) == 0
        assert [base > 0 for base, _ in infer_requests(history)] == [False] + [
            True
        ] * STEPS


async def test_a_store_that_keeps_nothing_rebuilds_every_request(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A store that never holds the prefix (the worst case of a worker's
    memory): every request after the first misses and is rebuilt from the
    history; the model sees the whole context each time (its answer names
    every output), and the history carries each item once."""
    store = Forgetful()
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=store,
    ):
        client = LoopClient(env.client, task_queue=queue)
        (loop_id,) = await run_steps(client, 1)
        history = await client.handle(loop_id).fetch_history()
    assert (store.misses, store.rebuilt) == (STEPS, STEPS)
    assert failed_activities(history) == 0
    # The first request sends the prompt; each later one the call and output
    # of the turn before.
    assert infer_requests(history) == [(0, 1)] + [(1 + 2 * n, 2) for n in range(10)]


async def test_a_handler_patched_for_a_deploy_runs_and_replays(
    env: WorkflowEnvironment, queue: str
) -> None:
    """The docs' `workflow.patched()` handler: in workflow code, the new branch
    decides (the loop stops at its fourth tool call), the patch is a marker in
    the history, and the history replays."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("budget", "take the steps")
        with anyio.fail_after(30):
            result = await client.wait(loop_id)
        history = await client.handle(loop_id).fetch_history()
    assert result.outcome is Outcome.aborted
    assert result.reason == "tool budget of 3 calls reached"
    assert result.tool_calls == 3
    markers = [
        e.marker_recorded_event_attributes.marker_name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
    ]
    assert markers == ["core_patch"]
    replayer = Replayer(workflows=[LoopWorkflow], workflow_runner=workflow_runner())
    await replayer.replay_workflow(history)


# --------------------------------------------------------- an encrypting codec

SECRET = "the vault code is 7-4-1-9-zebra"


def encrypted(client: Client) -> Client:
    """`client` with every payload encrypted (the codec the docs show)."""
    from tests.temporal_workers_agents import AESGCMCodec

    codec = AESGCMCodec(key=bytes(range(32)), key_id="test-key-1")
    config = client.config()
    config["data_converter"] = dataclasses.replace(
        temporalio.converter.default(), payload_codec=codec
    )
    return Client(**config)


class Forgetful(MemoryContextStore):
    """Keeps nothing: every request after a loop's first misses."""

    async def put(self, loop_id: str, items: Any, digests: Any) -> None:
        pass


async def secret_history(
    client: Client, queue: str, store: ContextStore
) -> tuple[Any, bytes]:
    """A loop of the `secret` agent on `client`: its result, and its history as
    the server stores it (every event's bytes)."""
    async with worker(
        client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=store,
    ):
        loops = LoopClient(client, task_queue=queue)
        loop_id = await loops.start("secret", SECRET)
        with anyio.fail_after(30):
            result = await loops.wait(loop_id)
        history = await loops.handle(loop_id).fetch_history()
    stored = b"".join(e.SerializeToString() for e in history.events)
    return result, stored


async def test_an_encrypting_codec_keeps_prompts_out_of_the_history(
    env: WorkflowEnvironment, queue: str
) -> None:
    """With an AES-GCM payload codec on the client and the worker, the loop
    runs as usual (the model, the tool and the client see plaintext) and the
    history the server keeps holds none of the prompt's text; without the
    codec the same loop's history does. The worker's store keeps nothing, so
    the second request's context is rebuilt from the encrypted history."""
    store = Forgetful()
    result, stored = await secret_history(encrypted(env.client), queue, store)
    assert result.answer == ModelMessageItem(content=f"kept: {SECRET}")
    assert (store.misses, store.rebuilt) == (1, 1)
    assert b"binary/encrypted" in stored
    for fragment in (SECRET, "vault code", "7-4-1-9", "zebra"):
        assert fragment.encode() not in stored, fragment

    _, plain = await secret_history(env.client, f"{queue}-plain", MemoryContextStore())
    assert SECRET.encode() in plain
