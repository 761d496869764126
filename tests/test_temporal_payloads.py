"""agentfsm.temporal and Temporal's payload limit (2 MB per payload by
default): a value too large to go inline goes by reference through a context
store every worker reads, or ends the call with an error naming its size and
the limit. No loop is wedged (a workflow task failing on every attempt) nor
paused for a reason that is not the real one.

Against a real dev server, as tests/test_temporal.py (one server for the
module, a task queue per test, asyncio only).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowHistory
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from agentfsm import Outcome
from agentfsm.exceptions import ConfigurationError
from agentfsm.messages import FunctionCallOutputItem
from agentfsm.results import LoopResult
from agentfsm.store import SQLiteStore
from agentfsm.temporal import LoopClient, MemoryContextStore, StoreContexts, worker
from agentfsm.temporal._wire import (
    MAX_PAYLOAD,
    output_reference,
    referenced,
)
from agentfsm.temporal._workflow import LOOP_FAILED
from tests.temporal_payload_agents import (
    AGENTS,
    CHATTY_SIZE,
    HUGE_SIZE,
    PROVIDERS,
    TWIN_SIZE,
)
from tests.temporal_server import NEEDS_TEMPORAL, dev_server

pytestmark = [
    pytest.mark.temporal,
    NEEDS_TEMPORAL,
]


BOUND = 60
"""Seconds a loop has to end: a wedged loop never does."""


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio only: a Temporal workflow runs on an asyncio event loop."""
    return "asyncio"


@pytest.fixture(scope="module")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    async with dev_server() as environment:
        yield environment


@pytest.fixture
def queue() -> str:
    return f"agentfsm-payload-{uuid.uuid4().hex[:8]}"


def contexts(kind: str, path: Path, **options: Any) -> Any:
    if kind == "sqlite":
        return StoreContexts(SQLiteStore(path / "contexts.db"), **options)
    return MemoryContextStore()


async def run(
    env: WorkflowEnvironment, queue: str, agent: str, store: Any
) -> tuple[LoopResult, WorkflowHistory]:
    """Run one loop to its end on a worker with `store`; fail the test, not
    hang, if it does not end within `BOUND` seconds."""
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=store,
    ):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start(agent, "go")
        failure: BaseException | None = None
        with anyio.fail_after(BOUND):
            try:
                result = await client.wait(loop_id)
            except WorkflowFailureError as exc:
                failure = exc.cause
        if failure is not None:
            # A failed loop fails its workflow, the result in the details
            # (where `wait` does not return it yet).
            assert isinstance(failure, ApplicationError), failure
            assert failure.type == LOOP_FAILED, failure
            result = LoopResult.model_validate(failure.details[0])
        history = await client.handle(loop_id).fetch_history()
    return result, history


def payloads(history: WorkflowHistory) -> list[tuple[str, str, int]]:
    """`(event, activity name, payload bytes)` of each activity's arguments
    and each completed activity's result."""
    names: dict[int, str] = {}
    found = []
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = e.activity_task_scheduled_event_attributes
            names[e.event_id] = attrs.activity_type.name
            size = sum(len(p.data) for p in attrs.input.payloads)
            found.append(("scheduled", attrs.activity_type.name, size))
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            done = e.activity_task_completed_event_attributes
            size = sum(len(p.data) for p in done.result.payloads)
            found.append(("completed", names[done.scheduled_event_id], size))
    return found


def failed_tasks(history: WorkflowHistory) -> int:
    return sum(
        e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
        for e in history.events
    )


# ------------------------------------------------------- two outputs, together


async def test_outputs_too_large_together_fail_the_loop_on_a_memory_store(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    """Two 1.2 MB outputs fit a payload each, not the next request together:
    with each worker's own store they cannot go by reference, so the loop
    fails, naming the size, the limit and `StoreContexts` (it used to fail
    every workflow task, TMPRL1103, for ever)."""
    result, history = await run(env, queue, "payload-twins", MemoryContextStore())
    assert result.outcome is Outcome.failed
    assert result.error is not None
    message = result.error.message
    assert f"{MAX_PAYLOAD:,} bytes" in message
    assert "StoreContexts" in message
    inline = int(message.split(" carry ")[1].split(" bytes")[0].replace(",", ""))
    assert inline > 2 * TWIN_SIZE
    assert failed_tasks(history) == 0
    assert all(size <= MAX_PAYLOAD for _, _, size in payloads(history))


@pytest.mark.parametrize("by_reference", [None, 4 * MAX_PAYLOAD])
async def test_outputs_too_large_together_reach_the_model_whole_on_a_shared_store(
    env: WorkflowEnvironment, queue: str, tmp_path: Path, by_reference: int | None
) -> None:
    """With `StoreContexts` the model gets both outputs whole: each goes by
    reference (by default, over 256 KiB), or, kept inline by a higher
    `by_reference`, the items are handed to the store ahead of the request
    (the `context` activity), which then refers to them."""
    options = {} if by_reference is None else {"by_reference": by_reference}
    store = contexts("sqlite", tmp_path, **options)
    result, history = await run(env, queue, "payload-twins", store)
    assert result.outcome is Outcome.answered, result
    assert result.output == "t1: whole\nt2: whole"
    sizes = payloads(history)
    assert all(size <= MAX_PAYLOAD for _, _, size in sizes)
    assert failed_tasks(history) == 0
    handed = [s for event, name, s in sizes if name.endswith(".context")]
    tools = [s for event, name, s in sizes if event == "completed" and ".tool." in name]
    if by_reference is None:
        assert handed == []
        assert all(size < 5_000 for size in tools)  # references, not outputs
    else:
        assert len(handed) == 4  # two parts (one output each), scheduled, done
        assert all(size > TWIN_SIZE for size in tools)


# ---------------------------------------------------------- one output, huge


async def test_an_output_too_large_for_any_payload_is_an_error_the_model_sees(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A 2.6 MB output cannot be an activity's result: with each worker's own
    store the model gets an error output naming its size, the limit and
    `StoreContexts`, and the loop goes on (it used to pause, "lost with its
    worker")."""
    result, history = await run(env, queue, "payload-huge", MemoryContextStore())
    assert result.outcome is Outcome.answered, result
    assert result.output is not None
    assert result.output.startswith("h1: error: tool 'blob' returned ")
    assert f"{HUGE_SIZE + 2:,} bytes" in result.output  # the JSON string's quotes
    assert f"{MAX_PAYLOAD:,} bytes" in result.output
    assert "StoreContexts" in result.output
    assert failed_tasks(history) == 0


async def test_an_output_too_large_for_any_payload_reaches_the_model_whole(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    """With `StoreContexts` the 2.6 MB output goes by reference: the workflow
    holds a reference (its size, its key, its beginning), and the inference
    activity puts the output back whole for the model."""
    store = contexts("sqlite", tmp_path)
    result, history = await run(env, queue, "payload-huge", store)
    assert result.outcome is Outcome.answered, result
    assert result.output == "h1: whole"
    assert all(size <= MAX_PAYLOAD for _, _, size in payloads(history))
    completed = [
        e.activity_task_completed_event_attributes.result.payloads[0].data
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
    ]
    outcome = json.loads(completed[1])  # the tool's, after the first request
    assert outcome["stored"] == HUGE_SIZE
    key = referenced(outcome["output"])
    assert key is not None
    assert outcome["output"].endswith("z" * 1000 + "...")
    assert await store.output(key) == "z" * HUGE_SIZE


async def test_an_output_by_reference_keeps_the_loop_s_own_limit(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    """`max_tool_output_chars` holds for an output that would go by reference
    (the workflow, which checks it, sees only the reference): the model gets
    the loop's own error output, and nothing is stored."""
    store = contexts("sqlite", tmp_path)
    result, _ = await run(env, queue, "payload-bounded", store)
    assert result.outcome is Outcome.answered, result
    assert result.output == (
        f"h1: error: the output of tool 'blob' has {HUGE_SIZE:,} characters, more "
        "than the loop's max_tool_output_chars=1,000,000; it was not kept"
    )


# ------------------------------------------------------------ a model's answer


async def test_a_model_answer_too_large_for_the_result_fails_the_loop(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A 1.5 MB answer fits a payload but not the loop's result, which holds
    it twice: the inference activity refuses it (before it enters the
    history), and the loop fails naming the size and the limit."""
    result, history = await run(env, queue, "payload-chatty", MemoryContextStore())
    assert result.outcome is Outcome.failed
    assert result.error is not None
    size = int(
        result.error.message.split(" is ")[1].split(" bytes")[0].replace(",", "")
    )
    assert CHATTY_SIZE < size < CHATTY_SIZE + 1_000  # the answer, as JSON
    assert f"{MAX_PAYLOAD // 2:,} bytes" in result.error.message
    assert failed_tasks(history) == 0
    assert all(size < CHATTY_SIZE for _, _, size in payloads(history))


# ------------------------------------------------------------------ the parts


def test_a_reference_names_its_key_and_shows_the_output_s_beginning() -> None:
    key = "ab" * 32
    text = output_reference(key, "é" * 2000)
    assert referenced(text) == key
    assert "4000 bytes" in text
    assert text.endswith("é" * 1000 + "...")
    assert referenced("[agentfsm: a tool output of 12 bytes, stored by") is None
    assert referenced("x" + text) is None  # only at the start


async def test_store_contexts_keeps_outputs_beside_contexts(tmp_path: Path) -> None:
    store = StoreContexts(SQLiteStore(tmp_path / "c.db"))
    assert store.by_reference == 256 * 1024
    key = "cd" * 32
    assert await store.output(key) is None
    await store.put_output(key, "a large output")
    await store.put_output(key, "a large output")  # a retried activity's
    assert await store.output(key) == "a large output"
    assert await store.get(key) is None  # not a loop's context


def test_store_contexts_refuses_a_bad_threshold(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="by_reference must be an int"):
        StoreContexts(SQLiteStore(tmp_path / "c.db"), by_reference=0)
    with pytest.raises(ConfigurationError, match="by_reference must be an int"):
        StoreContexts(SQLiteStore(tmp_path / "c.db"), by_reference=1.5)  # type: ignore[arg-type]


def test_an_output_item_holds_its_reference() -> None:
    """What the workflow's context (and so handlers, the transcript and the
    loop's record) holds for an output stored by reference."""
    key = "ef" * 32
    item = FunctionCallOutputItem(call_id="c1", output=output_reference(key, "x"))
    assert referenced(item.output) == key
