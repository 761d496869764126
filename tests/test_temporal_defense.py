"""The loop workflow never wedges on bad input or a bad subscriber, and the
loop's outcome is the workflow's: against a real dev server, driven with
`temporalio`'s own client calls (as a client that never imports agentfsm),
each wedge of issue 26 ends, or goes on, with a clear outcome within 30 s.

asyncio only (a workflow runs on an asyncio loop); one dev server for the
module, a task queue per test.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowHistory,
    WorkflowUpdateFailedError,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from agentfsm import ModelContext, Outcome, Runtime
from agentfsm.events import InputDropped
from agentfsm.results import LoopResult
from agentfsm.temporal import (
    AGENT_ATTRIBUTE,
    BAD_START,
    BAD_UPDATE,
    LOOP_FAILED,
    OUTCOME_ATTRIBUTE,
    OUTCOME_MEMO,
    RESULT_MEMO,
    STATE_ATTRIBUTE,
    WORKFLOW_NAME,
    LoopClient,
    LoopWorkflow,
    worker,
    workflow_id,
    workflow_runner,
)
from tests import temporal_defense_agents as agents
from tests.temporal_defense_agents import AGENTS, PROVIDERS
from tests.temporal_server import NEEDS_TEMPORAL, dev_server

pytestmark = [
    pytest.mark.temporal,
    NEEDS_TEMPORAL,
]

BOUND = 30
"""Seconds any wait of these tests may take: a wedged loop fails the test."""


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio only: a Temporal workflow runs on an asyncio event loop."""
    return "asyncio"


@pytest.fixture(scope="module")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    async with dev_server(
        search_attributes=[STATE_ATTRIBUTE, AGENT_ATTRIBUTE, OUTCOME_ATTRIBUTE]
    ) as environment:
        yield environment


@pytest.fixture
def queue() -> str:
    return f"agentfsm-defense-{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True)
def _fresh_records() -> Iterator[None]:
    yield
    agents.seen.clear()
    agents.failures.clear()
    agents.files.clear()
    agents.release.clear()


def run_worker(env: WorkflowEnvironment, queue: str) -> Any:
    return worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS)


async def start(
    client: Client,
    queue: str,
    agent: str,
    message: str,
    *,
    attributes: bool = True,
) -> WorkflowHandle[Any, Any]:
    """Start a loop as a client without agentfsm would: the input as plain
    data, the search attributes set by hand."""
    loop_id = uuid.uuid4().hex
    pairs = [
        SearchAttributePair(STATE_ATTRIBUTE, "running:idle"),
        SearchAttributePair(AGENT_ATTRIBUTE, agent),
    ]
    return await client.start_workflow(
        WORKFLOW_NAME,
        {"agent": agent, "loop_id": loop_id, "message": {"content": message}},
        id=workflow_id(loop_id),
        task_queue=queue,
        search_attributes=TypedSearchAttributes(pairs) if attributes else None,
    )


def loop_id_of(handle: WorkflowHandle[Any, Any]) -> str:
    return handle.id.removeprefix("agentfsm/")


def events_of(history: WorkflowHistory) -> list[str]:
    return [
        EventType.Name(e.event_type).removeprefix("EVENT_TYPE_") for e in history.events
    ]


def scheduled(history: WorkflowHistory) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = e.activity_task_scheduled_event_attributes
            found.append(
                (attrs.activity_type.name, json.loads(attrs.input.payloads[0].data))
            )
    return found


async def assert_replays(handle: WorkflowHandle[Any, Any]) -> None:
    """The workflow's history replays without a divergence (the paths these
    tests take are deterministic too)."""
    history = await handle.fetch_history()
    replayer = Replayer(workflows=[LoopWorkflow], workflow_runner=workflow_runner())
    replayed = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert replayed.replay_failure is None


async def until(handle: WorkflowHandle[Any, Any], *, status: str, state: str) -> None:
    """Poll the `view` query until the loop has `status` and `state`."""
    with anyio.fail_after(BOUND):
        while True:
            view = await handle.query("view")
            if (view["status"], view["state"]) == (status, state):
                return
            assert view["status"] != "done", view
            await anyio.sleep(0.02)


async def failure_of(handle: WorkflowHandle[Any, Any]) -> BaseException | None:
    """The workflow's failure (it must end within the bound)."""
    with anyio.fail_after(BOUND), pytest.raises(WorkflowFailureError) as info:
        await handle.result()
    return info.value.cause


async def ending(handle: WorkflowHandle[Any, Any]) -> tuple[Any, ...]:
    """`(status, memo outcome, outcome attribute, state attribute)`."""
    described = await handle.describe()
    attributes = described.typed_search_attributes
    return (
        described.status,
        await described.memo_value(OUTCOME_MEMO, None),
        attributes.get(OUTCOME_ATTRIBUTE),
        attributes.get(STATE_ATTRIBUTE),
    )


# ---------------------------------------------------------------- a bad start


@pytest.mark.parametrize(
    ("data", "named"),
    [
        pytest.param("hi", "the input must be an object", id="plain-string"),
        pytest.param(None, "got null", id="no-input"),
        pytest.param(
            {"agent": "defense.seed"}, "loop_id: Field required", id="no-loop-id"
        ),
        pytest.param(
            {"agent": "defense.seed", "loop_id": ""},
            "loop_id: String should have at least 1 character",
            id="empty-loop-id",
        ),
        pytest.param(
            {"agent": "defense.seed", "loop_id": "x", "colour": "red"},
            "colour: Extra inputs are not permitted",
            id="extra-field",
        ),
        pytest.param(
            {"agent": "defense.seed", "loop_id": "x", "message": {"text": "hi"}},
            "message.content: Field required",
            id="bad-message",
        ),
    ],
)
async def test_a_bad_start_fails_the_workflow_naming_the_field(
    env: WorkflowEnvironment, queue: str, data: Any, named: str
) -> None:
    """A start input that is not a `StartLoop` fails the workflow at once,
    non-retryable, naming what is wrong (not its task, retried forever)."""
    async with run_worker(env, queue):
        handle = await env.client.start_workflow(
            WORKFLOW_NAME, data, id=f"bad-{uuid.uuid4().hex}", task_queue=queue
        )
        cause = await failure_of(handle)
        history = await handle.fetch_history()
        described = await handle.describe()
    assert isinstance(cause, ApplicationError)
    assert (cause.type, cause.non_retryable) == (BAD_START, True)
    assert named in cause.message
    assert handle.id in cause.message
    assert described.status is WorkflowExecutionStatus.FAILED
    assert "WORKFLOW_TASK_FAILED" not in events_of(history)


async def test_an_unknown_agent_fails_the_workflow(
    env: WorkflowEnvironment, queue: str
) -> None:
    async with run_worker(env, queue):
        handle = await start(env.client, queue, "nobody", "hi", attributes=False)
        cause = await failure_of(handle)
    assert isinstance(cause, ApplicationError)
    assert cause.non_retryable
    assert "no TemporalAgent 'nobody'" in cause.message


# ----------------------------------------------------- bad signals and updates


async def test_bad_signals_are_dropped_said_and_the_loop_goes_on(
    env: WorkflowEnvironment, queue: str
) -> None:
    """Signals whose payload the loop cannot use are dropped, each with a
    warning and an `input.dropped` event; a plain string and the OpenAI shape
    are messages; the loop goes on to its answer."""
    with structlog.testing.capture_logs() as logs:
        async with run_worker(env, queue):
            handle = await start(env.client, queue, "defense.approval", "pay")
            loop_id = loop_id_of(handle)
            await until(handle, status="paused", state="inference")
            await handle.signal("steer", 42)
            await handle.signal("steer", {"role": "assistant", "content": "x"})
            await handle.signal("follow_up", ["not", "a", "message"])
            await handle.signal("cancel", {"reason": "stop"})
            await handle.signal("follow_up", "plain text")
            await handle.signal("follow_up", {"role": "user", "content": "openai"})
            await handle.execute_update("approve", args=[["t1"], {}])
            with anyio.fail_after(BOUND):
                result = LoopResult.model_validate(await handle.result())
            history = await handle.fetch_history()
        await assert_replays(handle)

    dropped = [e for e in agents.seen[loop_id] if isinstance(e, InputDropped)]
    assert [e.input for e in dropped] == ["steer", "steer", "follow_up", "cancel"]
    assert "got a number" in dropped[0].reason
    assert "role: Extra inputs are not permitted" in dropped[1].reason
    assert "got an array" in dropped[2].reason
    assert "reason must be a string or null" in dropped[3].reason
    assert all(e.state == "inference" for e in dropped)  # published while paused
    assert [e["signal"] for e in logs if e["event"] == "signal_dropped"] == [
        "steer",
        "steer",
        "follow_up",
        "cancel",
    ]
    assert result.outcome is Outcome.answered
    assert result.answer is not None
    assert result.answer.content == "pay | plain text | openai"
    assert "WORKFLOW_TASK_FAILED" not in events_of(history)


async def test_bad_updates_are_refused_by_their_validators(
    env: WorkflowEnvironment, queue: str
) -> None:
    """Update arguments of the wrong shape are refused, saying which; the loop
    stays paused and a good update then resumes it."""
    async with run_worker(env, queue):
        handle = await start(env.client, queue, "defense.approval", "pay")
        await until(handle, status="paused", state="inference")
        refused = []
        bad: list[tuple[str, list[Any]]] = [
            ("resume", ["proceed"]),
            ("resume", [{"kind": "jump"}]),
            ("approve", ["t1"]),
            ("approve", [["t1"], {"t1": 5}]),
            ("approve", [[1]]),
        ]
        for name, args in bad:
            with pytest.raises(WorkflowUpdateFailedError) as info:
                await handle.execute_update(name, args=args)
            refused.append(info.value.cause)
        view = await handle.query("view")
        await handle.execute_update("approve", args=[["t1"]])
        with anyio.fail_after(BOUND):
            result = LoopResult.model_validate(await handle.result())

    assert all(isinstance(c, ApplicationError) for c in refused)
    assert {c.type for c in refused if isinstance(c, ApplicationError)} == {BAD_UPDATE}
    messages = [str(c) for c in refused]
    assert "the decision must be null or a Decision" in messages[0]
    assert "got a string" in messages[0]
    assert "does not match any of the expected tags" in messages[1]
    assert "call_ids must be an array of call id strings" in messages[2]
    assert "denied must be null or an object" in messages[3]
    assert "call_ids must be an array" in messages[4]
    assert view["status"] == "paused"
    assert result.outcome is Outcome.answered


# ------------------------------------------------------------------ subscribers


async def test_a_subscriber_that_raises_keeps_receiving(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A subscriber raising on one event is logged and gets every later one,
    up to `loop.idle`; the workflow's task never fails."""
    with structlog.testing.capture_logs() as logs:
        async with run_worker(env, queue):
            handle = await start(env.client, queue, "defense.flaky", "go")
            with anyio.fail_after(BOUND):
                result = LoopResult.model_validate(await handle.result())
            history = await handle.fetch_history()
        await assert_replays(handle)
    loop_id = loop_id_of(handle)
    assert agents.failures == ["loop.transition"]
    types = [e.type for e in agents.seen[loop_id]]
    assert types[0] == "loop.started"
    assert types[-1] == "loop.idle"
    # Every transition but the one it raised on.
    assert types.count("loop.transition") == len(result.path) - 1
    failed = [e for e in logs if e["event"] == "subscriber_failed"]
    assert [(e["loop_id"], e["event_type"]) for e in failed] == [
        (loop_id, "loop.transition")
    ]
    assert result.outcome is Outcome.answered
    assert "WORKFLOW_TASK_FAILED" not in events_of(history)


async def test_a_subscriber_writes_a_file_in_the_sandbox(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    """Under the default (sandboxed) runner a subscriber may open a file: it
    runs outside the sandbox's restrictions."""
    written = tmp_path / "events.txt"
    loop_id = uuid.uuid4().hex
    agents.files[loop_id] = written
    async with run_worker(env, queue):
        client = LoopClient(env.client, task_queue=queue)
        await client.start("defense.writer", "go", loop_id=loop_id)
        with anyio.fail_after(BOUND):
            result = LoopResult.model_validate(await client.handle(loop_id).result())
    lines = written.read_text().splitlines()
    assert lines[0] == "loop.started"
    assert lines[-1] == "loop.idle"
    assert lines.count("loop.transition") == len(result.path)


# --------------------------------------------------------------------- outcomes


async def test_an_answered_loop_completes_its_workflow(
    env: WorkflowEnvironment, queue: str
) -> None:
    async with run_worker(env, queue):
        handle = await start(env.client, queue, "defense.seed", "2+3")
        with anyio.fail_after(BOUND):
            result = LoopResult.model_validate(await handle.result())
        ended = await ending(handle)
    assert result.outcome is Outcome.answered
    assert ended == (
        WorkflowExecutionStatus.COMPLETED,
        "answered",
        "answered",
        "done:idle",
    )


async def test_a_failed_loop_fails_its_workflow_with_its_result(
    env: WorkflowEnvironment, queue: str
) -> None:
    """The workflow fails `LOOP_FAILED`, not retried, naming the loop and its
    error; the loop's result is the failure's first detail."""
    async with run_worker(env, queue):
        handle = await start(env.client, queue, "defense.broken", "hi")
        cause = await failure_of(handle)
        ended = await ending(handle)
        await assert_replays(handle)
    assert isinstance(cause, ApplicationError)
    assert (cause.type, cause.non_retryable) == (LOOP_FAILED, True)
    assert loop_id_of(handle) in cause.message
    assert "ProviderError: the model is down" in cause.message
    result = LoopResult.model_validate(cause.details[0])
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert result.error.message == "the model is down"
    assert ended == (WorkflowExecutionStatus.FAILED, "failed", "failed", "done:idle")


async def test_aborted_and_signal_cancelled_loops_complete_saying_so(
    env: WorkflowEnvironment, queue: str
) -> None:
    async with run_worker(env, queue):
        aborted = await start(env.client, queue, "defense.aborted", "2+3")
        cancelled = await start(env.client, queue, "defense.approval", "pay")
        await until(cancelled, status="paused", state="inference")
        await cancelled.signal("cancel", "changed my mind")
        with anyio.fail_after(BOUND):
            results = [
                LoopResult.model_validate(await h.result())
                for h in (aborted, cancelled)
            ]
        endings = [await ending(h) for h in (aborted, cancelled)]
    assert [(r.outcome, r.reason) for r in results] == [
        (Outcome.aborted, "no tools today"),
        (Outcome.cancelled, "changed my mind"),
    ]
    done = WorkflowExecutionStatus.COMPLETED
    assert endings == [
        (done, "aborted", "aborted", "done:idle"),
        (done, "cancelled", "cancelled", "done:idle"),
    ]


async def test_temporal_cancel_of_a_paused_loop(
    env: WorkflowEnvironment, queue: str
) -> None:
    """Temporal's own cancel cancels the loop: the workflow ends CANCELED,
    the loop's result in its memo."""
    async with run_worker(env, queue):
        handle = await start(env.client, queue, "defense.approval", "pay")
        await until(handle, status="paused", state="inference")
        await handle.cancel()
        cause = await failure_of(handle)
        ended = await ending(handle)
        kept = await (await handle.describe()).memo_value(RESULT_MEMO)
        await assert_replays(handle)
    assert isinstance(cause, CancelledError)
    assert ended == (
        WorkflowExecutionStatus.CANCELED,
        "cancelled",
        "cancelled",
        "done:idle",
    )
    result = LoopResult.model_validate(kept)
    assert result.loop_id == loop_id_of(handle)
    assert result.outcome is Outcome.cancelled


async def test_temporal_cancel_right_after_the_start(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A cancel that may reach the workflow with its start (before the loop
    exists) cancels the loop all the same."""
    async with run_worker(env, queue):
        handle = await start(env.client, queue, "defense.approval", "pay")
        await handle.cancel()
        cause = await failure_of(handle)
        ended = await ending(handle)
        kept = await (await handle.describe()).memo_value(RESULT_MEMO)
    assert isinstance(cause, CancelledError)
    assert ended[:2] == (WorkflowExecutionStatus.CANCELED, "cancelled")
    assert LoopResult.model_validate(kept).outcome is Outcome.cancelled


async def test_temporal_cancel_of_a_loop_mid_tool(
    env: WorkflowEnvironment, queue: str
) -> None:
    """Cancelled while its tool's activity runs, the loop ends cancelled at
    once (the activity is asked to stop) and the workflow ends CANCELED; a
    workflow started without search attributes gets the memo only."""
    async with run_worker(env, queue):
        handle = await start(
            env.client, queue, "defense.hold", "key-1", attributes=False
        )
        await until(handle, status="running", state="function_call")
        await handle.cancel()
        try:
            cause = await failure_of(handle)
        finally:
            agents.released("key-1").set()  # the tool's activity may end now
        ended = await ending(handle)
        kept = await (await handle.describe()).memo_value(RESULT_MEMO)
        await assert_replays(handle)
    assert isinstance(cause, CancelledError)
    assert ended == (WorkflowExecutionStatus.CANCELED, "cancelled", None, None)
    result = LoopResult.model_validate(kept)
    assert result.outcome is Outcome.cancelled
    assert result.tool_calls == 1
    assert result.answer is None


# ------------------------------------------------------------------- model swap


async def test_a_handlers_model_swap_works_as_in_process(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A handler that rewrites the request's model to another provider's
    sends that request to the worker's other provider, as in a process."""
    async with run_worker(env, queue):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("defense.swapped", "2+3")
        with anyio.fail_after(BOUND):
            on_temporal = LoopResult.model_validate(
                await client.handle(loop_id).result()
            )
        history = await client.handle(loop_id).fetch_history()
    async with Runtime(providers=PROVIDERS) as runtime:
        agent = agents.SWAPPED
        in_process = await runtime.wait(
            runtime.run_loop(
                "p", "2+3", agent.request(ModelContext()), [agents.swap_after_first]
            )
        )
    models = [
        arg["model"] for name, arg in scheduled(history) if name.endswith("infer")
    ]
    assert models == ["dfn:small", "bigco:large"]
    assert on_temporal.answer is not None
    assert on_temporal.answer.content == "big(bigco:large): 5"
    assert on_temporal.answer == in_process.answer
    assert [s.trigger for s in on_temporal.path] == [s.trigger for s in in_process.path]
    assert on_temporal.model_requests == in_process.model_requests == 2
