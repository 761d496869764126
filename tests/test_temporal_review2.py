"""An adversarial review of agentfsm.temporal's activity side (issue 26):
payload sizes at and around each threshold (measured in the default
converter's bytes: non-ASCII text is escaped), values by reference, the
history rebuild on a context-store miss, deploys, heartbeats and routing.

A test marked `xfail(strict=True)` shows a finding: it asserts the behaviour
the issue asks for, and fails on the code as it is.

Against a real dev server, as tests/test_temporal.py (one server for the
module, a task queue per test, asyncio only); the server suggests
continue-as-new early (`SUGGEST_AT`), so that a loop of a few turns goes on in
a new run.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import temporalio.converter
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory
from temporalio.testing import WorkflowEnvironment

from agentfsm import Outcome, TokenUsage
from agentfsm.exceptions import ConfigurationError
from agentfsm.options import LoopOptions
from agentfsm.results import ErrorInfo, LoopResult, PathStep
from agentfsm.states import LoopState, Trigger
from agentfsm.store import SQLiteStore
from agentfsm.temporal import (
    LoopClient,
    MemoryContextStore,
    StoreContexts,
    TemporalAgent,
    ToolActivityOptions,
    worker,
    workflow_id,
)
from agentfsm.temporal._activities import _fit
from agentfsm.temporal._agent import ROUTED_WAIT
from agentfsm.temporal._wire import (
    MAX_ERROR_TEXT,
    MAX_MODEL_OUTPUT,
    MAX_PAYLOAD,
    MAX_PROGRESS,
    MAX_RESULT,
    InferResult,
    ToolArgs,
    ToolOutcome,
    dump,
    fitted_result,
    payload_size,
    referenced,
)
from agentfsm.testing import text
from tests import temporal_review2_agents as agents
from tests.temporal_review2_agents import AGENTS, PROVIDERS, STEPS
from tests.temporal_server import NEEDS_TEMPORAL, dev_server, suggesting_continue_as_new

pytestmark = [
    pytest.mark.temporal,
    pytest.mark.e2e,
    NEEDS_TEMPORAL,
]

SUGGEST_AT = 50
"""History events at which the server suggests continue-as-new: past the
one- and two-turn loops of most tests, within the `steps` loop."""
SERVER_ARGS = suggesting_continue_as_new(SUGGEST_AT)
BOUND = 60
"""Seconds a loop has to end: a wedged loop never does."""

_SCHEDULED = EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
_COMPLETED = EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
_FAILED = EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
_TASK_FAILED = EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """asyncio only: a Temporal workflow runs on an asyncio event loop."""
    return "asyncio"


@pytest.fixture(scope="module")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    async with dev_server(SERVER_ARGS) as environment:
        yield environment


@pytest.fixture
def queue() -> str:
    return f"agentfsm-review2-{uuid.uuid4().hex[:8]}"


@pytest.fixture(autouse=True)
def _plan() -> None:
    agents.reset()


def shared(path: Path, **options: Any) -> StoreContexts:
    return StoreContexts(SQLiteStore(path / "contexts.db"), **options)


async def run(
    env: WorkflowEnvironment,
    queue: str,
    agent: str,
    store: Any,
    message: str = "go",
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
        loop_id = await client.start(agent, message)
        with anyio.fail_after(BOUND):
            result = await client.wait(loop_id)
        history = await client.handle(loop_id).fetch_history()
    return result, history


def data_of(payloads: Any) -> Any:
    return temporalio.converter.default().payload_converter.from_payload(payloads[0])


def tool_outcomes(history: WorkflowHistory) -> list[dict[str, Any]]:
    """Each completed tool activity's `ToolOutcome`, as data."""
    names: dict[int, str] = {}
    found = []
    for e in history.events:
        if e.event_type == _SCHEDULED:
            attrs = e.activity_task_scheduled_event_attributes
            names[e.event_id] = attrs.activity_type.name
        elif e.event_type == _COMPLETED:
            done = e.activity_task_completed_event_attributes
            if ".tool." in names[done.scheduled_event_id]:
                found.append(data_of(done.result.payloads))
    return found


def count(history: WorkflowHistory, kind: int) -> int:
    return sum(e.event_type == kind for e in history.events)


def answer_of(size: int, fill: str) -> str:
    """An answer whose `InferResult` is exactly `size` bytes as the default
    converter writes it: `fill` (one char, escaped or not) and ASCII padding."""
    overhead = payload_size(dump(InferResult(output=text(""))))
    width = len(json.dumps(fill)) - 2
    many, pad = divmod(size - overhead, width)
    answer = fill * many + "x" * pad
    assert payload_size(dump(InferResult(output=text(answer)))) == size
    return answer


# ------------------------------------------------------------------ thresholds


async def test_by_reference_splits_at_its_threshold_in_escaped_bytes(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    """`by_reference` is measured as the converter writes the output (non-
    ASCII escaped, `\\u00e9` for `é`): an output exactly at it stays inline,
    one character more goes by reference; the model gets both whole."""
    threshold = 60_002  # "é" * 10_000 as JSON: 6 bytes each and two quotes
    agents.PLAN["parts"] = [(10_000, "é"), (10_001, "é")]
    result, history = await run(
        env, queue, "r2-blob", shared(tmp_path, by_reference=threshold)
    )
    assert result.outcome is Outcome.answered, result
    assert result.output == "b0: whole\nb1: whole"
    (inline,) = [o for o in tool_outcomes(history) if "stored" not in o]
    (stored,) = [o for o in tool_outcomes(history) if "stored" in o]
    assert inline["output"] == "é" * 10_000
    assert stored["stored"] == 10_001 * 2  # its UTF-8 bytes
    assert referenced(stored["output"]) is not None
    assert count(history, _TASK_FAILED) == 0


async def test_an_output_at_the_payload_limit_on_a_memory_store_ends_clearly(
    env: WorkflowEnvironment, queue: str
) -> None:
    """On a worker's own store, an output whose `ToolOutcome` is exactly
    `MAX_PAYLOAD` bytes comes back inline (no failed activity, no failed task),
    and the next request, which cannot carry it with the rest, fails the loop
    naming the size, the limit and `StoreContexts`."""
    outcome = dump(ToolOutcome(output=""))
    agents.PLAN.update(size=MAX_PAYLOAD - payload_size(outcome), fill="a")
    assert payload_size(dump(ToolOutcome(output="a" * agents.PLAN["size"]))) == (
        MAX_PAYLOAD
    )
    result, history = await run(env, queue, "r2-blob", MemoryContextStore())
    assert result.outcome is Outcome.failed, result
    assert result.error is not None
    assert f"{MAX_PAYLOAD:,} bytes" in result.error.message
    assert "StoreContexts" in result.error.message
    (inline,) = tool_outcomes(history)
    assert len(inline["output"]) == agents.PLAN["size"]
    assert count(history, _TASK_FAILED) == 0


async def test_an_output_one_byte_over_the_payload_limit_is_an_error_output(
    env: WorkflowEnvironment, queue: str
) -> None:
    """One byte more, and the output is
    dropped for an error output naming its size: the model sees it and the
    loop answers."""
    outcome = dump(ToolOutcome(output=""))
    room = MAX_PAYLOAD - payload_size(outcome)
    agents.PLAN.update(size=room + 1, fill="a")
    result, history = await run(env, queue, "r2-blob", MemoryContextStore())
    assert result.outcome is Outcome.answered, result
    assert result.output is not None
    assert result.output.startswith("b0: error: tool 'blob' returned ")
    assert f"{MAX_PAYLOAD:,} bytes" in result.output
    assert count(history, _TASK_FAILED) == 0


async def test_a_shared_store_never_drops_an_output_it_could_keep(
    tmp_path: Path,
) -> None:
    """An output that fits no payload with its `ToolOutcome` goes by
    reference on a shared store, whatever its `by_reference` (even one over
    `MAX_PAYLOAD`), never dropped for an error."""
    store = shared(tmp_path, by_reference=4 * MAX_PAYLOAD)
    output = "a" * (MAX_PAYLOAD - 20)  # 2 quotes: 18 bytes under the limit
    args = ToolArgs(
        loop_id="l1",
        agent_id="a",
        call_id="c1",
        name="blob",
        arguments="{}",
        request=1,
        position=0,
        idempotency_key="k",
    )
    fitted = await _fit(ToolOutcome(output=output), args, store, LoopOptions.of({}))
    assert not fitted.is_error, fitted.output[:200]
    assert payload_size(fitted.model_dump(mode="json", exclude_none=True)) <= (
        MAX_PAYLOAD
    )


@pytest.mark.parametrize("fill", ["x", "é"])
async def test_a_model_answer_at_its_limit_is_the_loop_s_result(
    env: WorkflowEnvironment, queue: str, fill: str
) -> None:
    """An answer whose `InferResult` is exactly `MAX_MODEL_OUTPUT` bytes (as
    the converter writes it: `é` escaped) is the loop's answer, its result
    carrying it twice within one payload; one byte more fails the loop,
    naming the size and the limit. No workflow task fails either way."""
    agents.PLAN["answer"] = answer_of(MAX_MODEL_OUTPUT, fill)
    result, history = await run(env, queue, "r2-answer", MemoryContextStore())
    assert result.outcome is Outcome.answered, result.error
    assert result.output == agents.PLAN["answer"]
    assert count(history, _TASK_FAILED) == 0

    agents.PLAN["answer"] = answer_of(MAX_MODEL_OUTPUT + 1, "x")
    result, history = await run(env, queue + "-over", "r2-answer", None)
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert f"{MAX_MODEL_OUTPUT + 1:,} bytes" in result.error.message
    assert count(history, _TASK_FAILED) == 0


async def test_a_call_with_arguments_over_the_limit_fails_the_loop_clearly(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A model output asking for a call with 3 MB of arguments never enters
    the history: the loop fails naming the output's size and the limit."""
    agents.PLAN["arguments"] = "q" * 3_000_000
    result, history = await run(env, queue, "r2-arguments", MemoryContextStore())
    assert result.outcome is Outcome.failed, result
    assert result.error is not None
    assert f"{MAX_MODEL_OUTPUT:,} bytes" in result.error.message
    assert count(history, _TASK_FAILED) == 0
    assert not tool_outcomes(history)


async def test_a_call_with_large_arguments_under_the_limit_runs(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    """Arguments of 900 KB (under the model output's limit) go to the tool
    inline and the loop answers."""
    agents.PLAN["arguments"] = "é" * 150_000  # 900 KB escaped
    result, history = await run(env, queue, "r2-arguments", shared(tmp_path))
    assert result.outcome is Outcome.answered, result
    assert result.output == "took 150000"
    assert count(history, _TASK_FAILED) == 0


async def test_a_provider_error_of_any_length_ends_the_loop_clearly(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A provider error of 1.2 MB (carried three times by a failed loop's
    workflow failure) fails the workflow, no workflow task: its message is
    cut to `MAX_ERROR_TEXT` bytes, saying how long it was."""
    agents.PLAN["error"] = "E" * 1_200_000
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
    ):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r2-refuse", "go")
        with anyio.fail_after(BOUND):
            while True:
                history = await client.handle(loop_id).fetch_history()
                if count(history, _TASK_FAILED) or history.events[-1].event_type in (
                    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED,
                    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED,
                    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_TERMINATED,
                ):
                    break
                await anyio.sleep(0.2)
        description = await client.handle(loop_id).describe()
        if count(history, _TASK_FAILED):
            await client.handle(loop_id).terminate("wedged: the test ends it")
    assert count(history, _TASK_FAILED) == 0, "the workflow task fails"
    assert EventType.Name(history.events[-1].event_type) == (
        "EVENT_TYPE_WORKFLOW_EXECUTION_FAILED"
    ), description.status
    result = await client.wait(loop_id)
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert result.error.message.startswith("EEEE")
    assert result.error.message.endswith("(1,200,000 bytes in all)")
    assert payload_size(result.error.message) <= MAX_ERROR_TEXT


# ------------------------------------------------------------ steering, large


@pytest.mark.parametrize("size", [1_900_000, 2_050_000])
async def test_a_large_steering_message_goes_on_or_fails_clearly(
    env: WorkflowEnvironment, queue: str, tmp_path: Path, size: int
) -> None:
    """A steering message near the payload limit (under the server's 2 MiB
    signal limit): with `StoreContexts` one under `MAX_PAYLOAD` reaches the
    model (handed to the store ahead of the request); one over fails the loop
    naming the item, its size and the limit. Never a failed workflow task."""
    agents.gate("steer")
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=shared(tmp_path),
    ):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r2-steered", "go")
        with anyio.fail_after(BOUND):
            while not agents.SEEN:  # noqa: ASYNC110 - the worker's thread sets it
                await anyio.sleep(0.05)
            # Sent as a client that never imports agentfsm would (`LoopClient`
            # refuses a message over `MAX_PAYLOAD` itself).
            await client.handle(loop_id).signal(
                "steer", {"type": "user_message", "content": "s" * size}
            )
            agents.GATES["steer"].set()
            result = await client.wait(loop_id)
        history = await client.handle(loop_id).fetch_history()
    assert count(history, _TASK_FAILED) == 0
    if size < MAX_PAYLOAD:
        assert result.outcome is Outcome.answered, result.error
        assert result.output == f"user messages: [2, {size}]"
    else:
        assert result.outcome is Outcome.failed
        assert result.error is not None
        assert f"{MAX_PAYLOAD:,} bytes" in result.error.message


# ---------------------------------------------------------- values by reference


async def test_a_reference_never_reaches_the_model_as_its_stand_in(
    env: WorkflowEnvironment, queue: str, tmp_path: Path
) -> None:
    """An output stored by reference by a tool on a `StoreContexts` worker,
    read by an inference on a worker whose store is its own: the loop fails
    saying so (naming `StoreContexts`), the model never gets the stand-in."""
    tools_queue = queue + "-tools"
    routed = TemporalAgent(
        name=f"r2-blob-routed-{queue}",
        model="fn:blob",
        tools=[agents.blob],
        tool_options={"blob": ToolActivityOptions(task_queue=tools_queue)},
    )
    agents.PLAN.update(size=300_000, fill="r")  # over the default 256 KiB
    async with (
        worker(
            env.client,
            task_queue=tools_queue,
            agents=[routed],
            providers=PROVIDERS,
            context_store=shared(tmp_path),
            workflows=False,
        ),
        worker(
            env.client,
            task_queue=queue,
            agents=[routed],
            providers=PROVIDERS,
            context_store=MemoryContextStore(),
        ),
    ):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start(routed.name, "go")
        with anyio.fail_after(BOUND):
            result = await client.wait(loop_id)
    # The loop failed saying why: never the reference in its place.
    assert result.outcome is Outcome.failed, result.output
    assert result.error is not None
    assert "stored by reference" in result.error.message
    assert "StoreContexts" in result.error.message


# --------------------------------------------------------- the history rebuild


class Forgetful(MemoryContextStore):
    """Keeps nothing: every request after a loop's first misses (the worst
    case of a worker's own store: two workers, a restart)."""

    async def put(self, loop_id: str, items: Any, digests: Any) -> None:
        pass


async def runs_of(env: WorkflowEnvironment, loop_id: str) -> list[WorkflowHistory]:
    """The histories of every run of a loop's workflow, first run first."""
    wid = workflow_id(loop_id)
    run_id = (await env.client.get_workflow_handle(wid).describe()).run_id
    histories: list[WorkflowHistory] = []
    while run_id:
        history = await env.client.get_workflow_handle(
            wid, run_id=run_id
        ).fetch_history()
        histories.insert(0, history)
        started = history.events[0].workflow_execution_started_event_attributes
        run_id = started.continued_execution_run_id
    return histories


async def test_a_continued_run_rebuilds_what_its_store_misses(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A store that keeps nothing misses every request after the first, in
    every run: each miss is rebuilt from the history (a continued run's from
    the items its input carried), none is a failed activity."""
    store = Forgetful()
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        context_store=store,
    ):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r2-steps", "go")
        with anyio.fail_after(BOUND):
            result = await client.wait(loop_id)
        histories = await runs_of(env, loop_id)
    assert result.outcome is Outcome.answered, result.error
    assert result.output == "; ".join(f"step {n} done" for n in range(STEPS))
    assert len(histories) > 1  # it did continue as new
    assert store.misses == store.rebuilt
    assert sum(count(h, _FAILED) for h in histories) == 0


# -------------------------------------------------------------- deploys, routing


async def test_a_graceful_stop_mid_model_call_loses_nothing(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A worker stopped while a model call runs lets it finish (the graceful
    shutdown follows the model call's timeout): its output is the loop's, on
    one attempt, and a second worker finishes the loop."""
    agents.gate("model")
    client = LoopClient(env.client, task_queue=queue)
    first = worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
        identity="first",
    )
    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.run)
            loop_id = await client.start("r2-slow", "go")
            while not agents.SEEN:  # noqa: ASYNC110 - the worker's thread sets it
                await anyio.sleep(0.05)
            tg.start_soon(first.shutdown)
            # The model call saw the shutdown begin.
            while len(agents.SEEN) < 2:  # noqa: ASYNC110 - the worker's thread sets it
                await anyio.sleep(0.05)
            agents.GATES["model"].set()
        async with worker(
            env.client,
            task_queue=queue,
            agents=AGENTS,
            providers=PROVIDERS,
            identity="second",
        ):
            result = await client.wait(loop_id)
    assert result.outcome is Outcome.answered, result.error
    assert result.output == "answered during a deploy"
    assert [s for s in agents.SEEN if "attempt" in s] == [
        {"model": "started", "attempt": 1}
    ]


async def test_a_tool_routed_to_a_queue_nobody_polls_is_bounded(
    env: WorkflowEnvironment, queue: str
) -> None:
    """A routed tool's activity has a schedule-to-start timeout by default
    (`ROUTED_WAIT`): a queue nobody polls does not hold the loop for ever."""
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
    ):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r2-far", "go")
        with anyio.fail_after(BOUND):
            while True:
                history = await client.handle(loop_id).fetch_history()
                scheduled = [
                    e.activity_task_scheduled_event_attributes
                    for e in history.events
                    if e.event_type == _SCHEDULED
                    and ".tool."
                    in e.activity_task_scheduled_event_attributes.activity_type.name
                ]
                if scheduled:
                    break
                await anyio.sleep(0.1)
        await client.cancel(loop_id)
        with anyio.fail_after(BOUND):
            await client.wait(loop_id)
    (attrs,) = scheduled
    assert attrs.task_queue.name == agents.NOWHERE
    # Something bounds how long the call waits for a worker of its queue.
    assert (
        attrs.schedule_to_start_timeout.ToTimedelta() > timedelta()
        or attrs.schedule_to_close_timeout.ToTimedelta() > timedelta()
    )
    assert attrs.schedule_to_start_timeout.ToTimedelta() == ROUTED_WAIT


async def test_a_call_no_worker_takes_is_an_error_output_naming_the_queue(
    env: WorkflowEnvironment, queue: str
) -> None:
    """When a routed call's schedule-to-start timeout lapses, the call never
    ran: the model sees an error output naming the queue, and the loop
    answers (an `on_crash="pause"` tool does not pause: nothing is unsure)."""
    result, history = await run(env, queue, "r2-far-soon", None)
    assert result.outcome is Outcome.answered, result
    assert result.output is not None
    assert result.output.startswith(
        f"error: tool 'far': no worker of task queue {agents.NOWHERE!r} took"
    ), result.output
    assert "schedule_to_start_timeout" in result.output
    assert count(history, _TASK_FAILED) == 0


def test_an_activities_only_worker_for_an_empty_queue_is_refused() -> None:
    """`worker(workflows=False)` for a queue no tool is routed to names the
    queue and where the tools are routed."""
    with pytest.raises(ConfigurationError) as raised:
        worker(
            object(),  # type: ignore[arg-type]
            task_queue="empty",
            agents=AGENTS,
            providers=PROVIDERS,
            workflows=False,
        )
    message = str(raised.value)
    assert "'empty'" in message
    assert repr(agents.NOWHERE) in message


# ------------------------------------------------------------------- progress


@pytest.mark.parametrize(
    "progress", [object(), "p" * (MAX_PROGRESS + 1)], ids=["not-json", "too-large"]
)
async def test_a_progress_report_that_is_not_json_never_kills_the_call(
    env: WorkflowEnvironment, queue: str, progress: object
) -> None:
    """Progress the converter cannot encode, or over `MAX_PROGRESS` bytes, is
    refused where it is reported (`report_progress` returns False); the call
    goes on and its output is the model's, the loop neither pauses nor
    loses it."""
    agents.PLAN["progress"] = progress
    async with worker(
        env.client,
        task_queue=queue,
        agents=AGENTS,
        providers=PROVIDERS,
    ):
        client = LoopClient(env.client, task_queue=queue)
        loop_id = await client.start("r2-progress", "go")
        with anyio.fail_after(BOUND):
            while True:
                view = await client.get(loop_id)
                if view.status.value != "running":
                    break
                await anyio.sleep(0.1)
        if view.status.value == "paused":
            reason = view.pending
            await client.cancel(loop_id)
            with anyio.fail_after(BOUND):
                await client.wait(loop_id)
            pytest.fail(f"the loop paused: {reason}")
        with anyio.fail_after(BOUND):
            result = await client.wait(loop_id)
    assert result.outcome is Outcome.answered
    assert result.output == "ok: reported: False"


# ------------------------------------------------------------ options' edges


def test_tool_activity_options_edges() -> None:
    """Edge values: a whitespace-only queue is refused, a zero or negative
    timeout is refused, an unlimited retry policy for a pause tool given by
    name is refused; sub-second values pass through as given."""
    with pytest.raises(ConfigurationError, match="task_queue"):
        ToolActivityOptions(task_queue="   ")
    with pytest.raises(ConfigurationError, match="heartbeat_timeout"):
        ToolActivityOptions(heartbeat_timeout=timedelta(0))
    with pytest.raises(ConfigurationError, match="start_to_close_timeout"):
        ToolActivityOptions(start_to_close_timeout=timedelta(seconds=-1))
    from temporalio.common import RetryPolicy

    with pytest.raises(ConfigurationError, match="on_crash='pause'"):
        TemporalAgent(
            name="r2-edge",
            model="fn:answer",
            tools=[agents.progress],
            tool_options={
                "progress": ToolActivityOptions(
                    retry_policy=RetryPolicy(maximum_attempts=0)
                )
            },
        )
    tiny = TemporalAgent(
        name="r2-edge",
        model="fn:answer",
        tools=[agents.blob],
        tool_defaults=ToolActivityOptions(
            schedule_to_close_timeout=timedelta(milliseconds=500)
        ),
    )
    options = tiny.activity_options(agents.blob)
    # The attempt keeps the tool's own timeout (Temporal caps it by the whole
    # call's).
    assert options.schedule_to_close_timeout == timedelta(milliseconds=500)
    assert options.start_to_close_timeout == timedelta(seconds=agents.blob.timeout or 0)


# ---------------------------------------------------------- what a loop ends with


def _result(**fields: Any) -> LoopResult:
    now = datetime.now(UTC)
    return LoopResult(
        loop_id="l1",
        agent_id="a",
        usage=TokenUsage(),
        model_requests=1,
        tool_calls=0,
        started_at=now,
        ended_at=now,
        **{"path": (), **fields},
    )


def test_a_result_of_a_usual_size_is_left_whole() -> None:
    """An answer at the model output's limit, carried twice, fits as it is."""
    words = answer_of(MAX_MODEL_OUTPUT, "é")
    step = PathStep(LoopState.idle, Trigger.start, LoopState.inference)
    result = _result(
        outcome=Outcome.answered,
        answer=text(words).items[0],
        output=words,
        path=(step,) * 50,
    )
    assert fitted_result(result, MAX_RESULT) == (result, [])


def test_a_result_too_large_to_end_a_workflow_is_made_to_fit() -> None:
    """Texts are cut first, then the answer goes if it alone is too large,
    then the path's earliest steps; the reason says what was left out."""
    step = PathStep(LoopState.inference, Trigger.call_tools, LoopState.function_call)
    last = PathStep(LoopState.function_call, Trigger.fail, LoopState.idle)
    result = _result(
        outcome=Outcome.failed,
        reason="R" * 1_500_000,
        error=ErrorInfo(type="ProviderError", message="E" * 1_200_000),
        output="o" * 2_000_000,  # too large with the rest, path or not
        path=(step,) * 60_000 + (last,),
    )
    fitted, dropped = fitted_result(result, MAX_RESULT)
    assert payload_size(fitted.model_dump(mode="json")) <= MAX_RESULT
    assert fitted.error is not None
    assert fitted.error.message.endswith("(1,200,000 bytes in all)")
    assert fitted.output is None
    assert 0 < len(fitted.path) < 60_001
    assert fitted.path[-1] == last  # the latest steps are kept
    assert fitted.reason is not None
    assert fitted.reason.startswith("RRR")
    assert f"the first {60_001 - len(fitted.path):,} of its 60,001 path steps" in (
        fitted.reason
    )
    assert "its answer and output" in fitted.reason
    assert len(dropped) == 4
