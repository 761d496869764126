"""Review of the workflow side of agentfsm.temporal: continue-as-new, the
client, and input that crosses into workflow code, attacked as a Temporal
user would, against a real dev server.

The module's dev server suggests continue-as-new once a run's history holds
`SUGGEST_AT` events, a few turns of a loop. asyncio only, as every Temporal
test; one dev server for the module, a task queue per test. Each finding of
the review has a test here, which guards its fix.
"""

from __future__ import annotations

import asyncio  # noqa: TID251 - the gate is the worker's, on asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, UpdateWorkflowExecutionLifecycleStage
from temporalio.api.update.v1 import UpdateRef, WaitPolicy
from temporalio.api.workflowservice.v1 import PollWorkflowExecutionUpdateRequest
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHistory,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from agentfsm import LoopResult, LoopStatus, ModelMessageItem, Outcome, UserMessage
from agentfsm.exceptions import LoopStateError
from agentfsm.temporal import (
    STATE_ATTRIBUTE,
    LoopClient,
    LoopWorkflow,
    MemoryContextStore,
    worker,
    workflow_id,
    workflow_runner,
)
from tests.temporal_review1_agents import (
    AGENTS,
    DEADLINE,
    GATE,
    OWN_LIMIT,
    PROVIDERS,
    SEEN,
    USAGE,
)
from tests.temporal_server import NEEDS_TEMPORAL, dev_server, suggesting_continue_as_new

pytestmark = [
    pytest.mark.temporal,
    pytest.mark.e2e,
    NEEDS_TEMPORAL,
]

SUGGEST_AT = 40
"""History events at which the server suggests continue-as-new (~3 turns)."""

SERVER_ARGS = suggesting_continue_as_new(SUGGEST_AT)

WORKFLOW = "agentfsm.loop"
NOTES = 24
"""Steering messages sent to a paused loop: enough to make it continue as new."""


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
    return f"agentfsm-review1-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------ helpers


async def runs_of(client: Client, wid: str) -> list[WorkflowHistory]:
    """The histories of every run of a workflow, first run first."""
    run_id = (await client.get_workflow_handle(wid).describe()).run_id
    histories: list[WorkflowHistory] = []
    while run_id:
        history = await client.get_workflow_handle(wid, run_id=run_id).fetch_history()
        histories.insert(0, history)
        started = history.events[0].workflow_execution_started_event_attributes
        run_id = started.continued_execution_run_id
    return histories


async def replayed_cleanly(histories: list[WorkflowHistory]) -> None:
    replayer = Replayer(workflows=[LoopWorkflow], workflow_runner=workflow_runner())
    for history in histories:
        replayed = await replayer.replay_workflow(
            history, raise_on_replay_failure=False
        )
        assert replayed.replay_failure is None, replayed.replay_failure


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll `check` until it holds, for up to 30 s."""
    with anyio.fail_after(30):
        while (done := await check()) is not True:
            assert done is False, what
            await anyio.sleep(0.05)


async def finished(client: LoopClient, loop_id: str) -> LoopResult:
    with anyio.fail_after(60):
        return await client.wait(loop_id)


async def settled(client: Client, wid: str) -> str:
    """How a workflow settles: its closed status's name, or `wedged: <why>`
    as soon as one of its workflow tasks failed (Temporal retries a failed
    task forever: nothing but a terminate ends the workflow then)."""
    handle = client.get_workflow_handle(wid)
    with anyio.fail_after(30):
        while True:
            history = await handle.fetch_history()
            for event in history.events:
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                    failure = event.workflow_task_failed_event_attributes.failure
                    await handle.terminate("wedged (review test cleanup)")
                    return f"wedged: {failure.message[:300]}"
            status = (await handle.describe()).status
            if status is not WorkflowExecutionStatus.RUNNING:
                assert status is not None
                return status.name
            await anyio.sleep(0.1)


async def paused_and_carried(env: WorkflowEnvironment, client: LoopClient) -> str:
    """A `r1_payer` loop paused for approval, steered (`note 0..`) until it
    continued as new: its id."""
    loop_id = await client.start("r1_payer", "pay the bill")

    async def paused() -> bool:
        return (await client.get(loop_id)).status is LoopStatus.paused

    await until(paused, "paused")
    for n in range(NOTES):
        await client.steer(loop_id, f"note {n}")

    async def continued() -> bool:
        return len(await runs_of(env.client, workflow_id(loop_id))) >= 2

    await until(continued, "continued as new")
    return loop_id


def answer(result: LoopResult) -> str:
    assert result.answer is not None, result
    return result.answer.content


ALL_NOTES = ",".join(f"note {n}" for n in range(NOTES))


# -------------------------------------------- a loop carried over, paused


async def test_the_transcript_of_a_loop_carried_over_paused(
    env: WorkflowEnvironment, queue: str
) -> None:
    """The transcript query answers for a loop a run took up paused (the
    run's instrument learns the loop when the runtime adopts it, not only when
    a run of it starts), and goes on with the loop once it is approved."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await paused_and_carried(env, client)
        paused = await client.transcript(loop_id)
        await client.approve(loop_id, ["p1"])
        await finished(client, loop_id)
        ended = await client.transcript(loop_id)
    # The call waits for approval in the model's output: it enters the
    # context with its output; the steering messages are queued until then.
    assert paused.items == [UserMessage(content="pay the bill")]
    assert ended.items[0] == UserMessage(content="pay the bill")
    assert len(ended.items) == 4 + NOTES  # the call, its output, the notes, the answer
    assert ended.items[-1] == ModelMessageItem(
        content=f"paid 7; {NOTES} notes: {ALL_NOTES}"
    )


async def test_a_bad_signal_to_a_loop_carried_over_paused_is_published(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A signal a run that took up a paused loop drops is published as
    `input.dropped` on the loop's bus, as in the loop's first run."""
    SEEN.clear()
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await paused_and_carried(env, client)
        await client.handle(loop_id).signal("steer", 42)
        await client.approve(loop_id, ["p1"])
        result = await finished(client, loop_id)
    assert answer(result) == f"paid 7; {NOTES} notes: {ALL_NOTES}"
    dropped = [e for e in SEEN if e.loop_id == loop_id and e.type == "input.dropped"]
    assert len(dropped) == 1, [e.type for e in SEEN if e.loop_id == loop_id]


async def test_native_cancel_of_a_loop_carried_over_paused(
    env: WorkflowEnvironment, queue: str
) -> None:
    """Temporal's own cancel reaches the latest run: the loop ends
    cancelled, the workflow CANCELED, `wait` has the result, every run
    replays."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await paused_and_carried(env, client)
        await client.cancel(loop_id, "changed my mind", native=True)
        result = await finished(client, loop_id)
        described = await client.handle(loop_id).describe()
        histories = await runs_of(env.client, workflow_id(loop_id))
        with pytest.raises(LoopStateError, match="has ended"):
            await client.steer(loop_id, "too late")
        with pytest.raises(LoopStateError, match="has ended"):
            await client.cancel(loop_id, native=True)
    assert result.outcome is Outcome.cancelled, result
    assert result.reason is not None
    assert "changed my mind" in result.reason
    assert described.status is WorkflowExecutionStatus.CANCELED
    assert result.model_requests == 1
    await replayed_cleanly(histories)


async def test_signal_cancel_of_a_loop_carried_over_paused(
    env: WorkflowEnvironment, queue: str
) -> None:
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await paused_and_carried(env, client)
        await client.cancel(loop_id, "not today")
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, workflow_id(loop_id))
        with pytest.raises(LoopStateError, match="has ended"):
            await client.approve(loop_id, ["p1"])
    assert result.outcome is Outcome.cancelled, result
    assert result.reason == "not today"
    await replayed_cleanly(histories)


def start_input(history: WorkflowHistory) -> dict[str, Any]:
    """A run's start input, as JSON data."""
    started = history.events[0].workflow_execution_started_event_attributes
    data = json.loads(started.input.payloads[0].data)
    assert isinstance(data, dict)
    return data


def as_loop(data: dict[str, Any], loop_id: str) -> dict[str, Any]:
    """A carried run's start input, made that of another loop `loop_id`."""
    data["loop_id"] = loop_id
    data["carried"]["record"]["loop_id"] = loop_id
    return data


async def admitted(client: Client, wid: str, update_id: str) -> bool:
    """Whether the server holds the update `update_id` of workflow `wid`."""
    request = PollWorkflowExecutionUpdateRequest(
        namespace=client.namespace,
        update_ref=UpdateRef(
            workflow_execution=WorkflowExecution(workflow_id=wid),
            update_id=update_id,
        ),
        wait_policy=WaitPolicy(
            lifecycle_stage=UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_ADMITTED
        ),
    )
    try:
        await client.workflow_service.poll_workflow_execution_update(request)
    except RPCError as exc:
        if exc.status is RPCStatusCode.NOT_FOUND:
            return False
        raise
    return True


async def test_an_approve_in_the_first_task_of_a_carried_run_is_applied(
    env: WorkflowEnvironment, queue: str
) -> None:
    """The race of an approve with the continue-as-new of a paused loop, made
    deterministic: a run that takes up a paused loop is started with no worker
    polling its queue, the approve is admitted by the server, then a worker
    starts, and the run's first task holds the start and the update: the
    update waits for the loop, then applies."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await paused_and_carried(env, client)
        data = start_input((await runs_of(env.client, workflow_id(loop_id)))[-1])
        await client.cancel(loop_id)
    # The notes the run before had queued when it continued as new (the rest
    # reached the next run, which this test does not start from).
    notes = [m["content"] for m in data["carried"]["record"]["steering"]]
    assert notes
    later = f"{queue}-later"
    other = f"other-{uuid.uuid4().hex[:6]}"
    wid = workflow_id(other)
    await env.client.start_workflow(
        WORKFLOW, as_loop(data, other), id=wid, task_queue=later
    )
    handle = env.client.get_workflow_handle(wid)
    outcome: list[Any] = []
    answered = anyio.Event()

    async def approve() -> None:
        try:
            outcome.append(
                await handle.execute_update("approve", args=[["p1"], {}], id="a1")
            )
        except WorkflowUpdateFailedError as exc:
            outcome.append(exc.cause)
        answered.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(approve)
        await until(lambda: admitted(env.client, wid, "a1"), "update admitted")
        async with worker(
            env.client, task_queue=later, agents=AGENTS, providers=PROVIDERS
        ):
            with anyio.fail_after(30):
                await answered.wait()
            assert isinstance(outcome[0], dict), outcome  # the view, not a refusal
            result = await finished(LoopClient(env.client, task_queue=later), other)
    assert answer(result) == f"paid 7; {len(notes)} notes: {','.join(notes)}"


# ------------------------------------------------ a running loop, carried


async def test_steers_and_a_follow_up_racing_the_runs_reach_the_model_once(
    env: WorkflowEnvironment, queue: str
) -> None:
    """Steers and a follow-up sent while a long loop switches runs: each
    reaches the model once, the subscriber sees each event once in order
    (no gap, no duplicate at a switch), usage adds up across runs."""
    SEEN.clear()
    GATE["open"] = asyncio.Event()  # the 12th step waits for every signal
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r1_gated_counter", "take 12 steps")
        notes = 10
        for n in range(notes):
            await client.steer(loop_id, f"note {n}")
            if n == notes // 2:
                await client.follow_up(loop_id, "now take 2 steps")
        GATE["open"].set()
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, workflow_id(loop_id))
    assert len(histories) >= 3
    listed = ",".join(f"note {n}" for n in range(notes))
    assert answer(result) == f"took 14 steps; notes: {listed}"
    assert result.tool_calls == 14
    assert result.usage.input_tokens == USAGE.input_tokens * result.model_requests
    assert result.usage.output_tokens == USAGE.output_tokens * result.model_requests
    mine = [e for e in SEEN if e.loop_id == loop_id]
    assert [e.seq for e in mine] == list(range(1, len(mine) + 1))
    types = [e.type for e in mine]
    assert types.count("loop.started") == 1
    assert types.count("loop.idle") == 1
    assert types.count("inference.completed") == result.model_requests
    await replayed_cleanly(histories)


@pytest.mark.parametrize("agent", ["r1_closures", "r1_two_stops"])
async def test_closures_sharing_a_name_still_continue_as_new(
    env: WorkflowEnvironment, queue: str, agent: str
) -> None:
    """Two handlers made by one factory of the user's; two stop conditions
    made by agentfsm's own `tool_called`."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start(agent, "take 8 steps")
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, workflow_id(loop_id))
    assert answer(result) == "took 8 steps; notes: "
    assert len(histories) >= 2, [len(h.events) for h in histories]


@pytest.mark.parametrize(
    ("agent", "outcome", "reason"),
    [
        ("r1_own_handlers", Outcome.aborted, f"{OWN_LIMIT} tool calls"),
        ("r1_own_stops", Outcome.stopped, "turn_count"),
    ],
)
async def test_closures_sharing_a_name_each_stay_themselves(
    env: WorkflowEnvironment, queue: str, agent: str, outcome: Outcome, reason: str
) -> None:
    """Two handlers of one factory, two `after_turns` conditions, each pair
    sharing a `__qualname__` but not a limit: the runs after the first bind
    each to itself (by position), so the second ends the loop at its limit,
    in a later run (bound by name, both would be the first, which never
    does)."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start(agent, "take 12 steps")
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, workflow_id(loop_id))
    assert len(histories) >= 2, [len(h.events) for h in histories]
    assert (result.outcome, result.reason) == (outcome, reason), result
    assert result.tool_calls == OWN_LIMIT
    await replayed_cleanly(histories)


# ----------------------------------------------------- a failed loop, large


async def test_a_failed_loop_with_a_huge_error_ends(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A loop failed by a handler raising with a ~0.8 MB message: its result
    holds it twice, the workflow's failure three times (over the 2 MiB
    limit, which wedged the workflow until the result was fitted): the
    workflow fails, and `wait` has the failed result."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r1_big_failure", "take 1 steps")
        how = await settled(env.client, workflow_id(loop_id))
        assert how == "FAILED", how
        result = await finished(client, loop_id)
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert result.error.type == "RuntimeError"


# ------------------------------------- input from a client without agentfsm


async def carried_start(env: WorkflowEnvironment, client: LoopClient) -> dict[str, Any]:
    """The start input of a run that took up a carried loop (a `r1_counter`
    loop long enough to continue as new), as JSON data."""
    loop_id = await client.start("r1_counter", "take 6 steps")
    await finished(client, loop_id)
    histories = await runs_of(env.client, workflow_id(loop_id))
    assert len(histories) >= 2
    data = start_input(histories[1])
    assert data["carried"] is not None
    return data


async def test_a_start_whose_carried_loop_is_another_fails_bad_start(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A start input whose carried record names another loop than its
    `loop_id` (whose signals, updates and queries would reach no loop) fails
    the workflow `agentfsm.BadStart`, naming both ids."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        data = await carried_start(env, client)
        data["loop_id"] = other = f"other-{uuid.uuid4().hex[:6]}"
        handle = await env.client.start_workflow(
            WORKFLOW, data, id=workflow_id(other), task_queue=queue
        )
        how = await settled(env.client, workflow_id(other))
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
    assert how == "FAILED", how
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError)
    assert cause.type == "agentfsm.BadStart"
    assert f"is not loop_id ('{other}')" in cause.message


async def test_a_start_whose_carried_items_are_missing_does_not_wedge(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A carried record whose context items were left out (the record refers
    to them by position): the workflow ends, it does not retry a task."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        data = await carried_start(env, client)
        data["loop_id"] = other = f"noitems-{uuid.uuid4().hex[:6]}"
        data["carried"]["record"]["loop_id"] = other
        data["carried"]["items"] = []
        await env.client.start_workflow(
            WORKFLOW, data, id=workflow_id(other), task_queue=queue
        )
        how = await settled(env.client, workflow_id(other))
    assert not how.startswith("wedged"), how


async def test_a_start_with_a_lone_surrogate_key_fails_bad_start(
    env: WorkflowEnvironment, queue: str
) -> None:
    """An extra key that is a lone surrogate: the workflow fails (its
    message quotes the key), it does not retry a task."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        wid = workflow_id(f"surrogate-{uuid.uuid4().hex[:6]}")
        data = {"agent": "r1_counter", "loop_id": wid, "\ud800": 1}
        await env.client.start_workflow(WORKFLOW, data, id=wid, task_queue=queue)
        how = await settled(env.client, wid)
    assert how == "FAILED", how


async def test_a_start_of_an_agent_named_with_a_lone_surrogate_fails(
    env: WorkflowEnvironment, queue: str
) -> None:
    """An unknown agent whose name holds a lone surrogate: the workflow fails."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        wid = workflow_id(f"surrogate-{uuid.uuid4().hex[:6]}")
        data = {"agent": "r1\ud800", "loop_id": wid}
        await env.client.start_workflow(WORKFLOW, data, id=wid, task_queue=queue)
        how = await settled(env.client, wid)
    assert how == "FAILED", how


async def test_signals_with_lone_surrogates_and_nul_do_not_wedge(
    env: WorkflowEnvironment, queue: str
) -> None:
    """Text with a lone surrogate and a NUL as a steer (kept, escaped), and an
    object whose key is a lone surrogate (dropped): the loop goes on, a
    refused approve names its problem, and the loop is approved after."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r1_payer", "pay the bill")

        async def paused() -> bool:
            return (await client.get(loop_id)).status is LoopStatus.paused

        await until(paused, "paused")
        handle = client.handle(loop_id)
        await handle.signal("steer", "note a\ud800\x00b")
        await handle.signal("follow_up", {"\ud800": "x"})
        await handle.signal("cancel", {"\ud800": "x"})
        with pytest.raises(LoopStateError, match="call_ids must be"):
            await client._update(loop_id, "approve", [{"\ud800": 1}, None])
        await client.approve(loop_id, ["p1"])
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, workflow_id(loop_id))
    assert result.outcome is Outcome.answered, result
    # The lone surrogate is escaped (`agentfsm._text.encodable`), the NUL kept.
    assert result.answer == ModelMessageItem(
        content="paid 7; 1 notes: note a\\ud800\x00b"
    )
    await replayed_cleanly(histories)


# ------------------------------------ what reaches a carried run's first task


async def unpolled_carried_run(env: WorkflowEnvironment, queue: str) -> tuple[str, str]:
    """A run that takes up a paused `r1_payer` loop (the start input a
    continue-as-new made, given another loop id), started on a task queue no
    worker polls yet: what is sent to it now reaches its first task. Its loop
    id and its queue."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await paused_and_carried(env, client)
        data = start_input((await runs_of(env.client, workflow_id(loop_id)))[-1])
        await client.cancel(loop_id)
    later = f"{queue}-later"
    other = f"other-{uuid.uuid4().hex[:6]}"
    await env.client.start_workflow(
        WORKFLOW, as_loop(data, other), id=workflow_id(other), task_queue=later
    )
    return other, later


async def test_a_native_cancel_in_the_first_task_of_a_carried_run(
    env: WorkflowEnvironment, queue: str
) -> None:
    """Temporal's cancel delivered with a carried run's start: the loop that
    run took up ends cancelled (its result in the memo), not 'cancelled
    before the loop started'."""
    loop_id, later = await unpolled_carried_run(env, queue)
    client = LoopClient(env.client, task_queue=later)
    await client.cancel(loop_id, "stop", native=True)
    async with worker(env.client, task_queue=later, agents=AGENTS, providers=PROVIDERS):
        result = await finished(client, loop_id)
        described = await client.handle(loop_id).describe()
    assert result.outcome is Outcome.cancelled, result
    assert result.model_requests == 1  # the run before's request, carried
    assert described.status is WorkflowExecutionStatus.CANCELED


async def test_a_steer_and_a_cancel_signal_in_the_first_task_of_a_carried_run(
    env: WorkflowEnvironment, queue: str
) -> None:
    loop_id, later = await unpolled_carried_run(env, queue)
    client = LoopClient(env.client, task_queue=later)
    await client.steer(loop_id, "note late")
    await client.cancel(loop_id, "stop")
    async with worker(env.client, task_queue=later, agents=AGENTS, providers=PROVIDERS):
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, workflow_id(loop_id))
    assert result.outcome is Outcome.cancelled, result
    assert result.reason == "stop"
    await replayed_cleanly(histories)


# ------------------------------------------ what a carried loop keeps


async def test_a_carried_paused_loop_keeps_its_deadline(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A paused loop with a deadline continues as new: its deadline goes on
    in the next run (on the workflow's clock), which fails it there
    (`LoopTimeout`) when it is due, not later, not earlier."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r1_payer_deadline", "pay the bill")

        async def paused() -> bool:
            return (await client.get(loop_id)).status is LoopStatus.paused

        await until(paused, "paused")
        for n in range(NOTES):
            await client.steer(loop_id, f"note {n}")
        with anyio.fail_after(DEADLINE + 60):
            result = await client.wait(loop_id)
        histories = await runs_of(env.client, workflow_id(loop_id))
    assert len(histories) >= 2  # it continued as new before its deadline
    assert result.outcome is Outcome.failed, result
    assert result.error is not None
    assert result.error.type == "LoopTimeout"
    # Carried as the first run set it (on the workflow's clock), not re-armed.
    started = result.started_at.timestamp()
    for history in histories[1:]:
        deadline_at = start_input(history)["carried"]["record"]["deadline_at"]
        assert deadline_at == pytest.approx(started + DEADLINE, abs=0.01)
    assert (result.ended_at - result.started_at).total_seconds() >= DEADLINE
    await replayed_cleanly(histories)


async def test_a_carried_loop_keeps_its_structured_output(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A loop with a structured output (a pydantic model, bound by name in
    each run) continues as new, retries a prose answer, and ends with the
    parsed output."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r1_structured", "take 8 steps")
        result = await finished(client, loop_id)
        histories = await runs_of(env.client, workflow_id(loop_id))
    assert len(histories) >= 2
    assert result.outcome is Outcome.answered, result
    assert result.output == {"steps": 8}
    assert result.model_requests == 10  # 8 calls, the prose, the JSON
    await replayed_cleanly(histories)


@pytest.mark.parametrize("store", ["kept", "forgotten"])
async def test_a_loop_with_a_large_context_still_continues_as_new(
    env: WorkflowEnvironment, queue: str, caplog: pytest.LogCaptureFixture, store: str
) -> None:
    """A loop whose context outgrows one payload (ten 200 KB tool outputs)
    goes on continuing as new: the next run's input carries the items the
    context store was sent by reference, and the run reads them back. With a
    worker's store that keeps nothing (`forgotten`), the run rebuilds them
    from the histories of the runs before, as each request its context."""
    contexts = MemoryContextStore(max_loops=0 if store == "forgotten" else 1_000)
    with caplog.at_level(logging.WARNING, logger="temporalio.workflow"):
        async with worker(
            env.client,
            task_queue=queue,
            agents=AGENTS,
            providers=PROVIDERS,
            context_store=contexts,
        ):
            client = LoopClient(env.client, task_queue=queue)
            loop_id = await client.start("r1_bulky", "take 14 steps")
            result = await finished(client, loop_id)
            histories = await runs_of(env.client, workflow_id(loop_id))
    assert answer(result) == "took 14 steps; notes: "
    refused = [
        r.getMessage()
        for r in caplog.records
        if "does not continue as new" in r.getMessage()
    ]
    assert refused == []
    carried = [start_input(h)["carried"] for h in histories[1:]]
    by_reference = [c for c in carried if c["base"] > 0]
    assert by_reference, [c["base"] for c in carried]
    assert all(len(json.dumps(c)) < 2_000_000 for c in carried)
    if store == "forgotten":
        assert contexts.misses == contexts.rebuilt > 0
    else:
        assert contexts.misses == 0
    await replayed_cleanly(histories)


async def test_odd_updates_end_or_refuse_never_wedge(
    env: WorkflowEnvironment, queue: str
) -> None:
    """Updates a client without agentfsm may send to a paused loop: an abort
    whose reason holds a lone surrogate, a denial whose reason does, a rewrite
    to an edge that does not leave the pending state, a rewrite whose payload
    is not the transition's: each is refused or ends the loop, and no
    workflow task fails."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)

        async def paused_loop() -> str:
            loop_id = await client.start("r1_payer", "pay the bill")

            async def paused() -> bool:
                return (await client.get(loop_id)).status is LoopStatus.paused

            await until(paused, "paused")
            return loop_id

        shapes: list[tuple[str, list[Any]]] = [
            ("resume", [{"kind": "abort", "reason": "no \ud800 way"}]),
            ("approve", [[], {"p1": "denied \ud800\x00"}]),
            ("resume", [{"kind": "rewrite", "dest": "model_message"}]),
            ("resume", [{"kind": "rewrite", "payload": {"type": "user_message"}}]),
            ("resume", [{"kind": "rewrite", "payload": "not a batch"}]),
        ]
        outcomes: list[tuple[bool, str, Outcome]] = []
        for name, args in shapes:
            loop_id = await paused_loop()
            try:
                await client._update(loop_id, name, args)
            except LoopStateError:
                refused = True
                await client.cancel(loop_id)
            else:
                refused = False
            how = await settled(env.client, workflow_id(loop_id))
            assert not how.startswith("wedged"), (name, args, how)
            result = await finished(client, loop_id)
            outcomes.append((refused, how, result.outcome))
            if args[0] == {"kind": "abort", "reason": "no \ud800 way"}:
                assert result.reason == "no \\ud800 way"  # escaped, as a signal's
    assert outcomes == [
        (False, "COMPLETED", Outcome.aborted),
        (False, "COMPLETED", Outcome.answered),
        (False, "COMPLETED", Outcome.answered),
        (True, "COMPLETED", Outcome.cancelled),
        (True, "COMPLETED", Outcome.cancelled),
    ]


async def test_a_cancel_with_no_input_and_an_approve_with_none(
    env: WorkflowEnvironment, queue: str
) -> None:
    """`temporal workflow signal --name cancel` with no `--input` cancels (the
    reason is optional); an approve with no arguments is refused and the loop
    stays paused."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r1_payer", "pay the bill")

        async def paused() -> bool:
            return (await client.get(loop_id)).status is LoopStatus.paused

        await until(paused, "paused")
        with pytest.raises(LoopStateError, match="refused"):
            await client._update(loop_id, "approve", [])
        assert (await client.get(loop_id)).status is LoopStatus.paused
        await client.handle(loop_id).signal("cancel", args=[])
        result = await finished(client, loop_id)
        how = await settled(env.client, workflow_id(loop_id))
    assert how == "COMPLETED"
    assert result.outcome is Outcome.cancelled


@pytest.mark.parametrize(
    ("signal", "args"),
    [
        ("steer", []),
        ("follow_up", []),
        ("steer", ["note x", "note y"]),
        ("follow_up", ["note x", "note y"]),
        ("cancel", ["why", "and more"]),
    ],
)
async def test_a_signal_with_the_wrong_number_of_inputs_does_not_wedge(
    env: WorkflowEnvironment, queue: str, signal: str, args: list[Any]
) -> None:
    """`temporal workflow signal --name steer` without `--input`, or with two:
    the signal is dropped with an `input.dropped` event naming the count, and
    the loop goes on (a cancel after it ends it)."""
    SEEN.clear()
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r1_payer", "pay the bill")

        async def paused() -> bool:
            return (await client.get(loop_id)).status is LoopStatus.paused

        await until(paused, "paused")
        await client.handle(loop_id).signal(signal, args=args)
        await client.cancel(loop_id, "done")
        how = await settled(env.client, workflow_id(loop_id))
        result = await finished(client, loop_id)
    assert how == "COMPLETED", how
    assert result.outcome is Outcome.cancelled
    assert result.reason == "done"
    dropped = [e for e in SEEN if e.loop_id == loop_id and e.type == "input.dropped"]
    assert [(e.input, f"got {len(args)}" in e.reason) for e in dropped] == [
        (signal, True)
    ]


@pytest.mark.parametrize("loop_id", ["nul\x00id", "émoji🙂"])
async def test_a_raw_start_with_an_odd_loop_id_runs(
    env: WorkflowEnvironment, queue: str, loop_id: str
) -> None:
    """A client without agentfsm starts a loop whose `loop_id` (in the input,
    not the workflow id) holds a NUL or non-ASCII text: the loop runs to its
    answer; a query with arguments of the wrong types fails the query alone,
    and a transcript page holds one item at least."""
    wid = f"raw-{uuid.uuid4().hex[:6]}"
    message = {"type": "user_message", "content": "take 2 steps"}
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        handle = await env.client.start_workflow(
            WORKFLOW,
            {"agent": "r1_counter", "loop_id": loop_id, "message": message},
            id=wid,
            task_queue=queue,
        )
        how = await settled(env.client, wid)
        data = await handle.result()
        with pytest.raises(WorkflowQueryFailedError):
            await handle.query("transcript", args=["zero", {}])
        page = await handle.query("transcript", args=[1, 10])
    assert how == "COMPLETED", how
    result = LoopResult.model_validate(data)
    assert result.loop_id == loop_id
    assert answer(result) == "took 2 steps; notes: "
    assert page["total"] == 6
    assert len(page["items"]) == 1


async def test_raw_starts_the_workflow_refuses(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A `loop_id` with a lone surrogate, and a message as a plain string
    (which the `steer` signal accepts, but the start does not): each fails
    the workflow `agentfsm.BadStart` naming the field."""
    async with worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS):
        problems = []
        for data in (
            {"agent": "r1_counter", "loop_id": "lone\ud800id"},
            {"agent": "r1_counter", "loop_id": "x", "message": "take 2 steps"},
        ):
            wid = f"raw-{uuid.uuid4().hex[:6]}"
            handle = await env.client.start_workflow(
                WORKFLOW, data, id=wid, task_queue=queue
            )
            assert await settled(env.client, wid) == "FAILED"
            with pytest.raises(WorkflowFailureError) as failed:
                await handle.result()
            cause = failed.value.cause
            assert isinstance(cause, ApplicationError)
            assert cause.type == "agentfsm.BadStart"
            problems.append(cause.message.partition("bad input: ")[2])
    assert problems[0].startswith("loop_id: Input should be a valid string")
    assert problems[1].startswith("message: Input should be a valid dictionary")
