"""agentfsm.temporal: deploys pause nothing, heartbeats are per tool and
optional, and a tool's activity has its own retry policy and task queue.

Against a real dev server, as tests/test_temporal.py (asyncio only; one
server for the module; each test its own task queue and its own agents, from
tests/temporal_deploy_agents.py). Tools wait on gates the tests open, never
on a clock.
"""

from __future__ import annotations

import asyncio  # noqa: TID251 - a worker on an event loop of its own, in a thread
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import anyio
import pytest
from temporalio.activity import _Definition
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflow.v1 import PendingActivityInfo
from temporalio.client import Client, WorkflowHistory
from temporalio.common import RetryPolicy
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from agentfsm import ConfigurationError, Outcome, tool
from agentfsm.results import LoopResult
from agentfsm.temporal import (
    MAX_GRACEFUL_SHUTDOWN,
    STATE_ATTRIBUTE,
    LoopClient,
    TemporalAgent,
    ToolActivityOptions,
    worker,
)
from tests import temporal_deploy_agents as tools
from tests.temporal_deploy_agents import GATES, PROVIDERS, RUNS, agents_for, gate
from tests.temporal_server import NEEDS_TEMPORAL, dev_server

pytestmark = [
    pytest.mark.temporal,
    NEEDS_TEMPORAL,
]


BOUND = 30.0
"""How long a test waits for anything to happen (generous: CI is loaded)."""


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
    return f"deploy-{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True)
def _fresh_runs() -> Iterator[None]:
    tools.reset()
    yield
    for opened in GATES.values():  # a failed test must not leave a tool waiting
        opened.set()


async def connect(env: WorkflowEnvironment, identity: str) -> Client:
    """A client of its own for a worker, so its identity (in the history and
    in `activity.client()`) names that worker."""
    return await Client.connect(
        env.client.service_client.config.target_host, identity=identity
    )


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll `check` until it holds; fail naming `what` after `BOUND` seconds."""
    try:
        with anyio.fail_after(BOUND):
            # The server and other threads change what is checked: poll.
            while not await check():  # noqa: ASYNC110
                await anyio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"waited {BOUND:g}s for {what}") from None


def activity_definition(fn: Callable[..., Any]) -> _Definition:
    """What `activity.defn` made of `fn` (its name)."""
    return _Definition.must_from_callable(fn)


def events_of(history: WorkflowHistory) -> list[str]:
    return [
        EventType.Name(e.event_type).removeprefix("EVENT_TYPE_") for e in history.events
    ]


def started_by(history: WorkflowHistory) -> dict[str, set[str]]:
    """Activity name -> the identities of the workers that ran it."""
    names = {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    }
    found: dict[str, set[str]] = {}
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            attrs = e.activity_task_started_event_attributes
            found.setdefault(names[attrs.scheduled_event_id], set()).add(attrs.identity)
    return found


async def pending_tool(
    loops: LoopClient, loop_id: str, name: str
) -> PendingActivityInfo | None:
    description = await loops.handle(loop_id).describe()
    return next(
        (
            p
            for p in description.raw_description.pending_activities
            if p.activity_type.name.endswith(f".tool.{name}")
        ),
        None,
    )


async def answered(loops: LoopClient, loop_id: str) -> LoopResult:
    """The loop's result, within `BOUND` (a paused loop would never end)."""
    try:
        with anyio.fail_after(BOUND):
            return await loops.wait(loop_id)
    except TimeoutError:
        view = await loops.get(loop_id)
        raise AssertionError(
            f"loop {loop_id} did not end within {BOUND:g}s: {view.status} "
            f"({view.pause_reason})"
        ) from None


@asynccontextmanager
async def thread_worker(
    env: WorkflowEnvironment,
    *,
    identity: str,
    task_queue: str,
    agents: Sequence[TemporalAgent],
) -> AsyncIterator[None]:
    """An activities-only worker on an event loop of its own, in a thread
    named `identity`: a tool that blocks that event loop blocks neither the
    test nor the worker that runs the workflows."""
    ready = threading.Event()
    failure: list[BaseException] = []
    stop: list[Callable[[], None]] = []

    async def main() -> None:
        client = await connect(env, identity)
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        async with worker(
            client, task_queue=task_queue, agents=agents, workflows=False
        ):

            def set_stopping() -> None:
                loop.call_soon_threadsafe(stopping.set)

            stop.append(set_stopping)
            ready.set()
            await stopping.wait()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name=identity, daemon=True)
    thread.start()
    try:
        assert await anyio.to_thread.run_sync(ready.wait, BOUND)
        assert not failure, failure
        yield
    except BaseException:
        for opened in GATES.values():  # a tool blocking that loop would keep it
            opened.set()
        raise
    finally:
        if stop:
            stop[0]()
        await anyio.to_thread.run_sync(thread.join, BOUND)
        assert not failure, failure


# ------------------------------------------------------------------ deploys


async def test_a_graceful_stop_mid_tool_lets_the_call_finish(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A deploy: the worker running a tool call (on_crash="pause") is stopped
    gracefully while the new one is up. The call completes in the old worker,
    once, and the loop ends answered on the new one; nothing pauses."""
    agent = agents_for(queue)["deploy"]
    release = gate("deploy")
    loops = LoopClient(env.client, task_queue=queue)
    old = worker(
        await connect(env, "old"),
        task_queue=queue,
        agents=[agent],
        providers=PROVIDERS,
        # Once the old worker is gone, its loops' next tasks go to the normal
        # queue after 1 s (its sticky queue's timeout), not 10 s.
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=1),
    )
    assert old.config()["graceful_shutdown_timeout"] == MAX_GRACEFUL_SHUTDOWN
    async with anyio.create_task_group() as tg:
        tg.start_soon(old.run)
        loop_id = await loops.start(agent.name, "go")

        async def started() -> bool:
            return bool(RUNS.of("finish_during_deploy", "start"))

        await until(started, "the tool to start")
        tg.start_soon(old.shutdown)

        async def shutdown_seen() -> bool:
            return bool(RUNS.of("finish_during_deploy", "shutdown seen"))

        await until(shutdown_seen, "the tool to see its worker stopping")
        async with worker(
            await connect(env, "new"),
            task_queue=queue,
            agents=[agent],
            providers=PROVIDERS,
        ):
            release.set()  # the tool finishes while its worker is stopping
            result = await answered(loops, loop_id)
            history = await loops.handle(loop_id).fetch_history()
    assert result.outcome is Outcome.answered
    assert result.answer is not None
    assert result.answer.content == "finished"
    assert [e["worker"] for e in RUNS.of("finish_during_deploy", "start")] == ["old"]
    assert "ACTIVITY_TASK_COMPLETED" in events_of(history)
    assert "ACTIVITY_TASK_FAILED" not in events_of(history)
    ran = started_by(history)
    assert ran[f"agentfsm.{agent.name}.tool.finish_during_deploy"] == {"old"}
    assert ran[f"agentfsm.{agent.name}.infer"] == {"old", "new"}


async def test_the_graceful_shutdown_follows_the_longest_timeout(
    env: WorkflowEnvironment, queue: str
) -> None:
    """The longest attempt among the activities a worker runs, capped at
    `MAX_GRACEFUL_SHUTDOWN`; the caller's own value wins. (One worker per
    client and queue: Temporal's core refuses a second.)"""

    @tool(timeout=20)
    async def short() -> str:
        """Short."""
        return "ok"

    @tool(timeout=45)
    async def longer() -> str:
        """Longer."""
        return "ok"

    @tool(timeout=None)
    async def forever() -> str:
        """No timeout: `no_timeout` (an hour) is its activity's."""
        return "ok"

    timed = TemporalAgent(
        name="graceful-timed",
        model="deploy:x",
        tools=[short, longer, forever],
        options={"inference_timeout": 30},
        tool_options={
            "forever": ToolActivityOptions(
                start_to_close_timeout=timedelta(seconds=40),
                task_queue=f"{queue}-elsewhere",
            )
        },
    )
    untimed = TemporalAgent(
        name="graceful-untimed",
        model="deploy:x",
        tools=[forever],
        options={"inference_timeout": 10},
    )

    def graceful(w: Worker) -> timedelta:
        shutdown: timedelta = w.config()["graceful_shutdown_timeout"]
        return shutdown

    # `forever` runs elsewhere: the longest here is `longer`'s 45 s.
    assert graceful(
        worker(env.client, task_queue=f"{queue}-1", agents=[timed])
    ) == timedelta(seconds=45)
    assert graceful(
        worker(
            env.client, task_queue=f"{queue}-elsewhere", agents=[timed], workflows=False
        )
    ) == timedelta(seconds=40)
    assert graceful(worker(env.client, task_queue=f"{queue}-2", agents=[untimed])) == (
        MAX_GRACEFUL_SHUTDOWN
    )
    assert graceful(
        worker(
            env.client,
            task_queue=f"{queue}-3",
            agents=[untimed],
            graceful_shutdown_timeout=timedelta(seconds=3),
        )
    ) == timedelta(seconds=3)


# ------------------------------------------------------------------ heartbeats


async def test_a_tool_blocking_its_event_loop_runs_once_by_default(
    env: WorkflowEnvironment, queue: str
) -> None:
    """An async tool that blocks its worker's event loop (with on_crash="retry",
    which used to run it three times) has no heartbeat timeout by default: its
    one attempt runs to the end and its output is the loop's."""
    agent = agents_for(queue)["blocking"]
    release = gate("block-1")
    loops = LoopClient(env.client, task_queue=queue)
    async with (
        worker(env.client, task_queue=queue, agents=[agent], providers=PROVIDERS),
        thread_worker(
            env, identity="blocky", task_queue=f"{queue}-blocky", agents=[agent]
        ),
    ):
        loop_id = await loops.start(agent.name, "go")

        async def started() -> bool:
            return bool(RUNS.of("block", "start"))

        await until(started, "the tool to block its event loop")
        history = await loops.handle(loop_id).fetch_history()
        scheduled = [
            e.activity_task_scheduled_event_attributes
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
            and e.activity_task_scheduled_event_attributes.activity_type.name.endswith(
                ".tool.block"
            )
        ]
        # Nothing on the server can end the attempt for want of a heartbeat;
        # the block outlasts the opted-in test's 1 s heartbeat timeout twice
        # over (not a race: without a heartbeat timeout, any length is fine).
        await anyio.sleep(2)
        release.set()
        result = await answered(loops, loop_id)
    assert len(scheduled) == 1
    assert scheduled[0].heartbeat_timeout.ToTimedelta() == timedelta()  # none
    assert result.outcome is Outcome.answered
    assert result.answer is not None
    assert result.answer.content == "blocked and done (attempt 1)"
    runs = RUNS.of("block", "start")
    assert [(r["attempt"], r["thread"]) for r in runs] == [(1, "blocky")]


async def test_an_opted_in_heartbeat_ends_a_blocked_attempt(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A tool that opted in to a heartbeat timeout and blocks its event loop
    past it has that attempt ended by Temporal and retried by its own retry
    policy (2 attempts here); when none is left, the model gets the timeout."""
    agent = agents_for(queue)["blocking-beats"]
    first, second = gate("block-1"), gate("block-2")
    loops = LoopClient(env.client, task_queue=queue)
    async with (
        worker(env.client, task_queue=queue, agents=[agent], providers=PROVIDERS),
        thread_worker(
            env, identity="blocky", task_queue=f"{queue}-blocky", agents=[agent]
        ),
    ):
        loop_id = await loops.start(agent.name, "go")

        def attempts_started(n: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return len(RUNS.of("block", "start")) >= n

            return check

        async def retried() -> bool:
            pending = await pending_tool(loops, loop_id, "block")
            return pending is not None and pending.attempt >= 2

        async def timed_out() -> bool:
            history = await loops.handle(loop_id).fetch_history()
            return "ACTIVITY_TASK_TIMED_OUT" in events_of(history)

        await until(attempts_started(1), "the first attempt")
        await until(retried, "the server to end the first attempt")
        first.set()
        await until(attempts_started(2), "the second attempt")
        await until(timed_out, "the server to end the second attempt")
        second.set()
        result = await answered(loops, loop_id)
        history = await loops.handle(loop_id).fetch_history()
    assert [r["attempt"] for r in RUNS.of("block", "start")] == [1, 2]
    assert result.outcome is Outcome.answered
    assert result.answer is not None
    assert "timed out (HEARTBEAT) after 2 attempts" in result.answer.content
    assert events_of(history).count("ACTIVITY_TASK_TIMED_OUT") == 1
    assert started_by(history)[f"agentfsm.{agent.name}.tool.block"] == {"blocky"}


@pytest.mark.parametrize("role", ["progress", "progress-beats"])
async def test_progress_is_carried_in_the_heartbeat_details(
    env: WorkflowEnvironment, queue: str, role: str
) -> None:
    """A tool's progress report (from a sync tool's thread) is a heartbeat,
    the progress its details, with or without a heartbeat timeout; with one,
    the timer's beats keep the last progress as the details."""
    agent = agents_for(queue)[role]
    release = gate("progress")
    loops = LoopClient(env.client, task_queue=queue)
    decode = env.client.data_converter.decode
    async with worker(
        env.client, task_queue=queue, agents=[agent], providers=PROVIDERS
    ):
        loop_id = await loops.start(agent.name, "go")
        seen: list[PendingActivityInfo] = []

        async def details_are_the_progress() -> bool:
            pending = await pending_tool(loops, loop_id, "progress")
            if pending is None or not pending.heartbeat_details.payloads:
                return False
            details = await decode(pending.heartbeat_details.payloads)
            assert details == [{"step": 1, "of": 2}]
            seen.append(pending)
            return True

        await until(details_are_the_progress, "the progress in the details")
        if agent.tool_defaults.heartbeat_timeout is not None:
            first = seen[-1].last_heartbeat_time.ToDatetime()

            async def a_later_timer_beat() -> bool:
                seen.clear()
                await until(details_are_the_progress, "the details")
                return seen[-1].last_heartbeat_time.ToDatetime() > first

            await until(a_later_timer_beat, "a timer's heartbeat")
        release.set()
        result = await answered(loops, loop_id)
    assert result.answer is not None
    assert result.answer.content == "progressed"
    assert [r["taken"] for r in RUNS.of("progress", "reported")] == [True]


# ------------------------------------------------------------------ routing


async def test_tools_run_on_the_workers_of_their_queue(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A tool routed to the "gpu" queue runs only in the worker polling it
    (activities only); the model calls and the unrouted tool run in the
    loops' worker."""
    agent = agents_for(queue)["routed"]
    loops = LoopClient(env.client, task_queue=queue)
    async with (
        worker(
            await connect(env, "main"),
            task_queue=queue,
            agents=[agent],
            providers=PROVIDERS,
        ) as main,
        worker(
            await connect(env, "gpu"),
            task_queue=f"{queue}-gpu",
            agents=[agent],
            workflows=False,
        ) as gpu,
    ):
        loop_id = await loops.start(agent.name, "where?")
        result = await answered(loops, loop_id)
        history = await loops.handle(loop_id).fetch_history()
    assert result.answer is not None
    assert result.answer.content == f"ran on {queue}-gpu | ran on {queue}"
    assert [(r["worker"], r["task_queue"]) for r in RUNS.of("where")] == [
        ("gpu", f"{queue}-gpu")
    ]
    assert [(r["worker"], r["task_queue"]) for r in RUNS.of("here")] == [
        ("main", queue)
    ]
    assert started_by(history) == {
        f"agentfsm.{agent.name}.infer": {"main"},
        f"agentfsm.{agent.name}.tool.here": {"main"},
        f"agentfsm.{agent.name}.tool.where": {"gpu"},
    }
    # Each worker has only what its queue dispatches.
    names = {
        w: sorted(activity_definition(a).name or "" for a in w.config()["activities"])
        for w in (main, gpu)
    }
    assert names[gpu] == [f"agentfsm.{agent.name}.tool.where"]
    assert f"agentfsm.{agent.name}.tool.where" not in names[main]
    assert main.config()["workflows"]
    assert not gpu.config()["workflows"]


async def test_a_tool_has_its_own_retry_policy_and_timeouts(
    env: WorkflowEnvironment, queue: str
) -> None:
    """The options given for a tool by name are its activity's, each field
    left None taken from `tool_defaults`; a pause tool stays at one attempt."""
    policy = RetryPolicy(maximum_attempts=5, initial_interval=timedelta(seconds=2))
    agent = TemporalAgent(
        name=f"{queue}-options",
        model="deploy:again+here",
        tools=[tools.again, tools.here],
        tool_defaults=ToolActivityOptions(
            heartbeat_timeout=timedelta(seconds=7),
            schedule_to_close_timeout=timedelta(minutes=3),
            retry_policy=RetryPolicy(maximum_attempts=4),
        ),
        tool_options={
            "again": ToolActivityOptions(
                retry_policy=policy, start_to_close_timeout=timedelta(seconds=9)
            )
        },
    )
    loops = LoopClient(env.client, task_queue=queue)
    async with worker(
        env.client, task_queue=queue, agents=[agent], providers=PROVIDERS
    ):
        loop_id = await loops.start(agent.name, "go")
        result = await answered(loops, loop_id)
        history = await loops.handle(loop_id).fetch_history()
    assert result.outcome is Outcome.answered
    scheduled = {
        attrs.activity_type.name.rpartition(".")[2]: attrs
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
        and ".tool."
        in (attrs := e.activity_task_scheduled_event_attributes).activity_type.name
    }
    again, here = scheduled["again"], scheduled["here"]
    assert again.retry_policy.maximum_attempts == 5
    assert again.retry_policy.initial_interval.ToTimedelta() == timedelta(seconds=2)
    assert again.start_to_close_timeout.ToTimedelta() == timedelta(seconds=9)
    assert again.heartbeat_timeout.ToTimedelta() == timedelta(seconds=7)
    assert again.schedule_to_close_timeout.ToTimedelta() == timedelta(minutes=3)
    # `here` is on_crash="pause": the default policy is not for it.
    assert here.retry_policy.maximum_attempts == 1
    assert tools.here.timeout is not None
    assert here.start_to_close_timeout.ToTimedelta() == timedelta(
        seconds=tools.here.timeout
    )
    assert here.heartbeat_timeout.ToTimedelta() == timedelta(seconds=7)


# ------------------------------------------------------------------ bad options


def test_bad_tool_options_are_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match="names 'nope', which is not one"):
        TemporalAgent(
            name="bad",
            model="deploy:x",
            tools=[tools.here],
            tool_options={"nope": ToolActivityOptions()},
        )
    with pytest.raises(ConfigurationError, match="tool_options\\['here'\\] must be"):
        TemporalAgent(
            name="bad",
            model="deploy:x",
            tools=[tools.here],
            tool_options={"here": {"task_queue": "x"}},  # type: ignore[dict-item]
        )
    with pytest.raises(ConfigurationError, match="'here' has on_crash='pause'"):
        TemporalAgent(
            name="bad",
            model="deploy:x",
            tools=[tools.here],
            tool_options={
                "here": ToolActivityOptions(
                    retry_policy=RetryPolicy(maximum_attempts=0)
                )
            },
        )
    with pytest.raises(
        ConfigurationError, match="heartbeat_timeout must be a positive"
    ):
        ToolActivityOptions(heartbeat_timeout=timedelta())
    with pytest.raises(ConfigurationError, match="start_to_close_timeout must be"):
        ToolActivityOptions(start_to_close_timeout=30)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="task_queue must be a non-empty"):
        ToolActivityOptions(task_queue=" ")
    with pytest.raises(ConfigurationError, match="retry_policy is invalid"):
        ToolActivityOptions(retry_policy=RetryPolicy(backoff_coefficient=0.5))


async def test_an_activities_only_worker_needs_a_tool_routed_to_it(
    env: WorkflowEnvironment, queue: str
) -> None:
    agent = agents_for(queue)["routed"]
    with pytest.raises(
        ConfigurationError,
        match=f"on task queue 'other' would run nothing.*'{queue}-gpu'",
    ):
        worker(env.client, task_queue="other", agents=[agent], workflows=False)
