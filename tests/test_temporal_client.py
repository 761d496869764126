"""`LoopClient` against a real dev server: its errors, `wait` for each
outcome, the search attributes, seeding and the transcript.

Asyncio only (Temporal's client and workflows are); one dev server for the
module, each test its own task queue. Without the binaries the module is
skipped (they are never downloaded).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import anyio
import pytest
from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment

from agentfsm import (
    ConfigurationError,
    LoopStatus,
    ModelContext,
    ModelMessageItem,
    Outcome,
    UserMessage,
)
from agentfsm.exceptions import LoopStateError, TemporalTimeout
from agentfsm.messages import ContextItem
from agentfsm.temporal import (
    AGENT_ATTRIBUTE,
    OUTCOME_ATTRIBUTE,
    OUTCOME_MEMO,
    STATE_ATTRIBUTE,
    LoopClient,
    worker,
)
from tests.temporal_client_agents import AGENTS, PROVIDERS
from tests.temporal_server import NEEDS_TEMPORAL, dev_server

pytestmark = [
    pytest.mark.temporal,
    NEEDS_TEMPORAL,
]


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
    return f"agentfsm-client-{uuid.uuid4().hex[:8]}"


def loops(env: WorkflowEnvironment, queue: str, **options: Any) -> LoopClient:
    return LoopClient(env.client, task_queue=queue, search_attributes=True, **options)


def running(env: WorkflowEnvironment, queue: str) -> Any:
    return worker(env.client, task_queue=queue, agents=AGENTS, providers=PROVIDERS)


async def until_paused(client: LoopClient, loop_id: str) -> None:
    with anyio.fail_after(30):
        while (view := await client.get(loop_id)).status is not LoopStatus.paused:
            assert view.status is not LoopStatus.done, view
            await anyio.sleep(0.02)


def every_call(client: LoopClient) -> dict[str, Callable[[str], Awaitable[object]]]:
    """Each method that drives or reads a loop, called on `loop_id`."""
    return {
        "get": client.get,
        "transcript": client.transcript,
        "wait": client.wait,
        "steer": lambda i: client.steer(i, "hurry"),
        "follow_up": lambda i: client.follow_up(i, "and then?"),
        "cancel": lambda i: client.cancel(i, "stop"),
        "cancel native": lambda i: client.cancel(i, "stop", native=True),
        "resume": client.resume,
        "approve": lambda i: client.approve(i, ["t1"]),
        "start from_loop": lambda i: client.start("cl-echo", "hi", from_loop=i),
    }


# ----------------------------------------------------------------- the errors


async def test_every_call_on_an_unknown_loop_is_a_loop_state_error(
    env: WorkflowEnvironment, queue: str
) -> None:
    """No Temporal error escapes: each method names the loop that is not there."""
    client = loops(env, queue)
    for name, method in every_call(client).items():
        with pytest.raises(LoopStateError, match="no such loop") as caught:
            await method("never-started")
        assert "never-started" in str(caught.value), name


async def test_signals_and_updates_to_an_ended_loop_are_loop_state_errors(
    env: WorkflowEnvironment, queue: str
) -> None:
    """An ended loop takes no signal and no update (the error names its
    workflow's status); its view, transcript and result are still there."""
    async with running(env, queue):
        client = loops(env, queue)
        loop_id = await client.start("cl-echo", "hello")
        result = await client.wait(loop_id)
        calls = every_call(client)
        for name in (
            "steer",
            "follow_up",
            "cancel",
            "cancel native",
            "resume",
            "approve",
        ):
            with pytest.raises(LoopStateError, match="has ended") as caught:
                await calls[name](loop_id)
            assert "its workflow is COMPLETED" in str(caught.value), name
        view = await client.get(loop_id)
        transcript = await client.transcript(loop_id)
        assert await client.wait(loop_id) == result
        # Start-or-attach: the same id names the same, ended, loop.
        assert await client.start("cl-echo", "again", loop_id=loop_id) == loop_id
    assert result.outcome is Outcome.answered
    assert view.status is LoopStatus.done
    assert [i.type for i in transcript.items] == ["user_message", "model_message"]


async def test_without_a_worker_queries_and_updates_time_out_named(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A query or an update needs a worker: without one, each raises
    `TemporalTimeout` naming the queue after the client's timeout (not
    Temporal's ~30 s); a signal needs only the server."""
    client = loops(env, queue, timeout=1)
    loop_id = await client.start("cl-approval", "pay")
    await client.steer(loop_id, "hurry")  # the server keeps it for the worker
    needing_a_worker: dict[str, Callable[[str], Awaitable[object]]] = {
        "get": client.get,
        "transcript": client.transcript,
        "resume": client.resume,
        "approve": lambda i: client.approve(i, ["t1"]),
    }
    for name, method in needing_a_worker.items():
        with pytest.raises(
            TemporalTimeout, match=f"no worker polled task queue '{queue}'"
        ) as caught:
            await method(loop_id)
        assert (caught.value.loop_id, caught.value.timeout) == (loop_id, 1), name
        assert isinstance(caught.value, TimeoutError)
    # A worker comes up: the loop goes on, with the steering message queued.
    async with running(env, queue):
        await until_paused(client, loop_id)
        await client.approve(loop_id, ["t1"])
        result = await client.wait(loop_id)
    assert result.outcome is Outcome.answered


def test_bad_arguments_are_configuration_errors() -> None:
    """The client's own arguments are checked where they are given."""
    with pytest.raises(ConfigurationError, match="temporalio Client"):
        LoopClient(object(), task_queue="q")  # type: ignore[arg-type]


async def test_bad_start_arguments(env: WorkflowEnvironment, queue: str) -> None:
    """Timeouts, seeds and their sizes are checked before anything is started."""
    with pytest.raises(ConfigurationError, match=r"timeout=\) must be positive"):
        LoopClient(env.client, task_queue=queue, timeout=0)
    client = loops(env, queue)
    with pytest.raises(ConfigurationError, match="not both"):
        await client.start("cl-echo", "hi", context=ModelContext(), from_loop="x")
    with pytest.raises(ConfigurationError, match="got str"):
        await client.start("cl-echo", "hi", context="hello")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="not a sequence of context items"):
        await client.start("cl-echo", "hi", context=[{"role": "user"}])  # type: ignore[list-item]
    huge = [UserMessage(content="x" * 1_100_000), UserMessage(content="y" * 1_100_000)]
    with pytest.raises(
        ValueError, match=r"is 2,200,\d+ bytes, over the 2,000,000 bytes"
    ):
        await client.start("cl-echo", "hi", context=huge, loop_id="too-big")
    # Nothing was started.
    with pytest.raises(LoopStateError, match="no such loop"):
        await client.wait("too-big")
    with pytest.raises(ValueError, match=r"steer\(\) of loop too-big: the signal's"):
        await client.steer("too-big", "y" * 2_100_000)


# ------------------------------------------------------------- wait's outcomes


async def test_wait_returns_the_result_of_every_outcome(
    env: WorkflowEnvironment, queue: str
) -> None:
    """Answered, failed, aborted, cancelled by the signal and by Temporal's
    own cancel: `wait` gives the loop's `LoopResult` each time, and Temporal
    shows each outcome (the workflow's status, the memo, the attribute)."""
    async with running(env, queue):
        client = loops(env, queue)
        answered = await client.start("cl-echo", "hi")
        failed = await client.start("cl-broken", "hi")
        aborted = await client.start("cl-aborting", "hi")
        by_signal = await client.start("cl-approval", "pay")
        native = await client.start("cl-approval", "pay")
        await until_paused(client, by_signal)
        await until_paused(client, native)
        await client.cancel(by_signal, "changed my mind")
        await client.cancel(native, "from the UI", native=True)
        results = {
            i: await client.wait(i)
            for i in (answered, failed, aborted, by_signal, native)
        }
        described = {i: await client.handle(i).describe() for i in results}

    assert results[answered].outcome is Outcome.answered
    assert results[answered].answer == ModelMessageItem(content="hi")
    assert results[failed].outcome is Outcome.failed
    error = results[failed].error
    assert error is not None
    assert "the model is down" in error.message
    assert results[aborted].outcome is Outcome.aborted
    assert results[aborted].reason == "requests are refused here"
    assert results[by_signal].outcome is Outcome.cancelled
    assert results[by_signal].reason == "changed my mind"
    assert results[native].outcome is Outcome.cancelled
    assert results[native].loop_id == native
    statuses = {i: d.status for i, d in described.items()}
    assert statuses == {
        answered: WorkflowExecutionStatus.COMPLETED,
        failed: WorkflowExecutionStatus.FAILED,
        aborted: WorkflowExecutionStatus.COMPLETED,
        by_signal: WorkflowExecutionStatus.COMPLETED,
        native: WorkflowExecutionStatus.CANCELED,
    }
    for loop_id, d in described.items():
        outcome = results[loop_id].outcome.value
        assert (await d.memo())[OUTCOME_MEMO] == outcome
        assert d.typed_search_attributes.get(OUTCOME_ATTRIBUTE) == outcome
        assert (
            d.typed_search_attributes.get(AGENT_ATTRIBUTE) == results[loop_id].agent_id
        )
        assert d.typed_search_attributes.get(STATE_ATTRIBUTE) == "done:idle"


async def test_wait_names_a_workflow_that_ended_without_its_loop(
    env: WorkflowEnvironment, queue: str
) -> None:
    """Terminated, or timed out past `execution_timeout`: no result exists,
    and `wait` says so with a `LoopStateError` naming the status."""
    async with running(env, queue):
        client = loops(env, queue)
        terminated = await client.start("cl-approval", "pay")
        await until_paused(client, terminated)
        await client.handle(terminated).terminate("by hand")
        with pytest.raises(LoopStateError, match=r"terminated \(TERMINATED\)"):
            await client.wait(terminated)
    # No worker: the workflow never runs, and times out.
    short = loops(env, queue, execution_timeout=timedelta(seconds=1))
    timed_out = await short.start("cl-echo", "hi")
    with pytest.raises(LoopStateError, match="TIMED_OUT"):
        await short.wait(timed_out)


# --------------------------------------------------------- search attributes


async def test_search_attributes_name_the_agent_from_the_start(
    env: WorkflowEnvironment, queue: str
) -> None:
    """`search_attributes=True` starts the workflow with its agent and state,
    so a listing finds it before any worker ran it."""
    client = loops(env, queue)
    loop_id = await client.start("cl-echo", "hi")
    attributes = (await client.handle(loop_id).describe()).typed_search_attributes
    assert attributes.get(AGENT_ATTRIBUTE) == "cl-echo"
    assert attributes.get(STATE_ATTRIBUTE) == "running:idle"
    assert attributes.get(OUTCOME_ATTRIBUTE) is None
    plain = LoopClient(env.client, task_queue=queue)
    other = await plain.start("cl-echo", "hi")
    assert not (await plain.handle(other).describe()).typed_search_attributes
    await client.handle(loop_id).terminate("cleanup")
    await client.handle(other).terminate("cleanup")


# --------------------------------------------------------- seeding, transcript


async def test_a_loop_starts_on_a_prior_conversation(
    env: WorkflowEnvironment, queue: str
) -> None:
    """`context=` (a `ModelContext` or its items) and `from_loop=` (another
    loop's transcript): the model sees the prior conversation, and the
    transcript holds it, then the new turn."""
    prior: list[ContextItem] = [
        UserMessage(content="a"),
        ModelMessageItem(content="noted"),
    ]
    async with running(env, queue):
        client = loops(env, queue)
        from_items = await client.start("cl-echo", "b", context=prior)
        from_context = await client.start(
            "cl-echo", "b", context=ModelContext(instructions="Be kind.", items=prior)
        )
        first = await client.wait(from_items)
        second = await client.wait(from_context)
        transcript = await client.transcript(from_items)
        continued = await client.start("cl-echo", "c", from_loop=from_items)
        third = await client.wait(continued)
        third_transcript = await client.transcript(continued)
        instructed = await client.start("cl-instructed", "b", from_loop=from_context)
        await client.wait(instructed)
        instructed_transcript = await client.transcript(instructed)
        with_context = await client.transcript(from_context)

    assert first.answer == ModelMessageItem(content="a|b")
    assert second.answer == ModelMessageItem(content="a|b")
    assert transcript.items == [
        *prior,
        UserMessage(content="b"),
        ModelMessageItem(content="a|b"),
    ]
    assert transcript.instructions is None
    assert with_context.instructions == "Be kind."
    assert third.answer == ModelMessageItem(content="a|b|c")
    assert third_transcript.items == [
        *transcript.items,
        UserMessage(content="c"),
        ModelMessageItem(content="a|b|c"),
    ]
    # The agent's own instructions replace the seed's.
    assert instructed_transcript.instructions == "Be brief."


async def test_a_long_transcript_comes_page_by_page(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A transcript larger than one query's answer (1 MB) is read whole, in
    order, page by page."""
    prior = [ModelMessageItem(content=f"{n}:" + "z" * 300_000) for n in range(5)]
    async with running(env, queue):
        client = loops(env, queue)
        loop_id = await client.start("cl-echo", "q", context=prior)
        result = await client.wait(loop_id)
        transcript = await client.transcript(loop_id)
        page = await client.handle(loop_id).query("transcript", args=[0, 1_000_000])
    assert result.answer == ModelMessageItem(content="q")
    assert transcript.items == [
        *prior,
        UserMessage(content="q"),
        ModelMessageItem(content="q"),
    ]
    assert 1 <= len(page["items"]) < 5
    assert page["total"] == 7
