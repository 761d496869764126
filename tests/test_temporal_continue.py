"""Continue-as-new: a loop goes on in new runs of its workflow, past a
lowered history limit, invisibly to clients.

The module's dev server suggests continue-as-new once a run's history holds
`SUGGEST_AT` events (`limit.historyCount.suggestContinueAsNew`, lowered from
the server's default of thousands), a few turns of a loop. asyncio only, as
every Temporal test; one dev server for the module, a task queue per test.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from agentfsm import (
    LoopResult,
    LoopState,
    LoopStatus,
    ModelMessageItem,
    Outcome,
    Trigger,
)
from agentfsm.temporal import (
    STATE_ATTRIBUTE,
    LoopClient,
    LoopWorkflow,
    MemoryContextStore,
    worker,
    workflow_id,
    workflow_runner,
)
from agentfsm.temporal import _carry as carry
from tests.temporal_continue_agents import AGENTS, PROVIDERS, SEEN
from tests.temporal_server import NEEDS_TEMPORAL, dev_server, suggesting_continue_as_new

pytestmark = [
    pytest.mark.temporal,
    pytest.mark.e2e,
    NEEDS_TEMPORAL,
]

SUGGEST_AT = 40
"""History events at which the server suggests continue-as-new (~3 turns)."""

HISTORY_LIMIT = 150
"""History events at which the server terminates a run (lowered from 51,200):
the long loop below makes more events than this in all, and ends answered."""

SERVER_ARGS = [
    *suggesting_continue_as_new(SUGGEST_AT),
    "--dynamic-config-value",
    f"limit.historyCount.error={HISTORY_LIMIT}",
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio only: a Temporal workflow runs on an asyncio event loop."""
    return "asyncio"


@pytest.fixture(scope="module")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    async with dev_server(
        SERVER_ARGS, search_attributes=[STATE_ATTRIBUTE]
    ) as environment:
        yield environment


@pytest.fixture
def queue() -> str:
    return f"agentfsm-continue-{uuid.uuid4().hex[:8]}"


async def runs_of(client: Client, loop_id: str) -> list[WorkflowHistory]:
    """The histories of every run of a loop's workflow, first run first (each
    run's start names the run it continues)."""
    wid = workflow_id(loop_id)
    run_id = (await client.get_workflow_handle(wid).describe()).run_id
    histories: list[WorkflowHistory] = []
    while run_id:
        history = await client.get_workflow_handle(wid, run_id=run_id).fetch_history()
        histories.insert(0, history)
        started = history.events[0].workflow_execution_started_event_attributes
        run_id = started.continued_execution_run_id
    return histories


def last_event(history: WorkflowHistory) -> str:
    return EventType.Name(history.events[-1].event_type)


async def replayed_cleanly(histories: list[WorkflowHistory]) -> None:
    replayer = Replayer(workflows=[LoopWorkflow], workflow_runner=workflow_runner())
    for history in histories:
        replayed = await replayer.replay_workflow(
            history, raise_on_replay_failure=False
        )
        assert replayed.replay_failure is None, replayed.replay_failure


async def test_a_long_loop_continues_as_new_and_ends_once(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A loop of 13 one-call turns and a follow-up runs across several runs:
    its result is whole (every step, every request, the follow-up's), its
    subscriber saw each event once, in order, one `loop.started` and one
    `loop.idle`, the context store was never missed (each run's first request
    referred to what the run before sent), and every run replays."""
    SEEN.clear()
    store = MemoryContextStore()
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=store,
    ):
        client = LoopClient(env.client, task_queue=queue, state_attribute=True)
        loop_id = await client.start("counter", "take 10 steps")
        await client.follow_up(loop_id, "now take 3 steps")
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, loop_id)

    assert result.outcome is Outcome.answered, result
    assert result.answer == ModelMessageItem(content="took 13 steps")
    assert result.tool_calls == 13
    assert result.model_requests == 15
    triggers = [s.trigger for s in result.path]
    assert triggers.count(Trigger.infer) == 15
    assert triggers.count(Trigger.follow_up) == 1
    assert result.path[0].trigger is Trigger.start
    assert result.path[-1].dest is LoopState.idle

    assert len(histories) >= 3, [len(h.events) for h in histories]
    assert sum(len(h.events) for h in histories) > HISTORY_LIMIT
    for earlier in histories[:-1]:
        assert last_event(earlier) == "EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW"
    assert last_event(histories[-1]) == "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED"
    assert store.misses == 0

    types = [e.type for e in SEEN]
    assert types.count("loop.started") == 1
    assert types[0] == "loop.started"
    assert types.count("loop.idle") == 1
    assert types[-1] == "loop.idle"
    assert types.count("inference.completed") == 15
    assert [e.seq for e in SEEN] == list(range(1, len(SEEN) + 1))
    assert {e.loop_id for e in SEEN} == {loop_id}
    await replayed_cleanly(histories)


async def test_a_streaming_loop_continues_as_new(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A loop whose requests stream is handed over at the same boundary (the
    stream is not opened): every run replays, the answer is whole."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("streamed_counter", "take 8 steps")
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, loop_id)
    assert result.answer == ModelMessageItem(content="took 8 steps")
    assert [s.trigger for s in result.path].count(Trigger.infer_streaming) == 9
    assert len(histories) >= 2
    await replayed_cleanly(histories)


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll `check` until it holds, for up to 30 s."""
    with anyio.fail_after(30):
        while (done := await check()) is not True:
            assert done is False, what
            await anyio.sleep(0.05)


async def finished(client: LoopClient, loop_id: str) -> LoopResult:
    """The loop's result, within a bound generous for a loaded machine."""
    with anyio.fail_after(60):
        return await client.wait(loop_id)


async def test_a_paused_loop_continues_as_new_and_is_approved_after(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A loop paused for approval receives signal after signal until its
    history is long: it continues as new still paused, the query and the
    approve update reach the latest run, and every steering message, those
    sent while the run changed included, reaches the model."""
    notes = 24
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue, state_attribute=True)
        loop_id = await client.start("payer", "pay the bill")

        async def paused() -> bool:
            view = await client.get(loop_id)
            return view.status is LoopStatus.paused

        await until(paused, "paused")
        for n in range(notes):
            await client.steer(loop_id, f"note {n}")

        async def continued() -> bool:
            return len(await runs_of(env.client, loop_id)) >= 2

        await until(continued, "continued as new")
        view = await client.get(loop_id)
        assert view.status is LoopStatus.paused
        assert view.pending is not None
        assert view.pending.trigger is Trigger.call_tools
        described = await client.handle(loop_id).describe()
        assert (
            described.typed_search_attributes.get(STATE_ATTRIBUTE)
            == f"paused:{view.state}"
        )
        await client.approve(loop_id, ["p1"])
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, loop_id)

    assert result.outcome is Outcome.answered, result
    listed = ",".join(f"note {n}" for n in range(notes))
    assert result.answer == ModelMessageItem(content=f"paid 7; {notes} notes: {listed}")
    assert result.model_requests == 2
    assert len(histories) >= 2
    first = histories[0]
    assert last_event(first) == "EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW"
    # The first run handed the loop over paused: it sent one request only.
    scheduled = [
        e
        for e in first.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]
    assert len(scheduled) == 1
    await replayed_cleanly(histories)


async def test_a_loop_too_large_to_carry_goes_on_in_its_run(
    env: WorkflowEnvironment,
    queue: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """When what a run would carry does not fit in a payload (the limit is
    lowered here), the loop waiting at the boundary is let go: it goes on in
    the same run, to the same answer, and the run says why once."""
    monkeypatch.setattr(carry, "MAX_PAYLOAD", 100)
    with caplog.at_level(logging.WARNING, logger="temporalio.workflow"):
        async with worker(
            env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS
        ):
            client = LoopClient(env.client, task_queue=queue)
            loop_id = await client.start("counter", "take 8 steps")
            result = await finished(client, loop_id)
            histories = await runs_of(env.client, loop_id)
    assert result.outcome is Outcome.answered, result
    assert result.answer == ModelMessageItem(content="took 8 steps")
    assert len(histories) == 1
    assert len(histories[0].events) > SUGGEST_AT  # suggested, and kept
    warned = [
        r.getMessage()
        for r in caplog.records
        if "does not continue as new" in r.getMessage()
    ]
    assert len(warned) == 1, warned
    assert "over the 100-byte payload limit" in warned[0]
