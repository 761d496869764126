"""Every public call checks its arguments before it writes or publishes anything.

A wrong-typed argument raises `TypeError` naming the parameter (a reason of
`404` once reached a stored record and the event log, which then could not be
read back); a duration no timer can take (NaN, negative, infinite) raises
`ValueError` naming the parameter and the value, when the object is made.
Both are `ConfigurationError`s too.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentfsm import (
    Agent,
    Conversation,
    LoopOptions,
    LoopStatus,
    Outcome,
    Runtime,
    Tool,
    current_call,
    tool,
)
from agentfsm._bus import EventBus
from agentfsm.eventlog import EventLogWriter, read_events
from agentfsm.exceptions import ConfigurationError
from agentfsm.store import MemoryStore, SQLiteStore
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from tests.helpers import add, pause_tools, request, wait_until

NAN = float("nan")
INF = float("inf")

# Untyped, to be called with what the type checker would refuse.
_SQLiteStore: Any = SQLiteStore
_MemoryStore: Any = MemoryStore
_EventLogWriter: Any = EventLogWriter


def _raises_type_error(parameter: str) -> Any:
    """`pytest.raises(TypeError)`, its message naming `parameter`."""
    return pytest.raises(TypeError, match=rf"\b{parameter}\b")


# ------------------------------------------------------------- Runtime's calls

Call = Callable[[Any, str], Any]
"""A call of a runtime's method on its paused loop `loop_id` (the runtime is
`Any`: the calls give what the type checker would refuse)."""

RUNTIME_CALLS: list[tuple[str, str, Call]] = [
    ("cancel", "loop_id", lambda rt, _: rt.cancel(404)),
    ("cancel", "reason", lambda rt, lid: rt.cancel(lid, 404)),
    ("resume", "loop_id", lambda rt, _: rt.resume(404)),
    ("resume", "decision", lambda rt, lid: rt.resume(lid, "yes")),
    ("resume", "by", lambda rt, lid: rt.resume(lid, by=7)),
    ("steer", "loop_id", lambda rt, _: rt.steer(404, "hi")),
    ("steer", "message", lambda rt, lid: rt.steer(lid, 42)),
    ("follow_up", "loop_id", lambda rt, _: rt.follow_up(404, "hi")),
    ("follow_up", "message", lambda rt, lid: rt.follow_up(lid, {"content": "x"})),
    ("wait", "loop_id", lambda rt, _: rt.wait(404)),
    ("get", "loop_id", lambda rt, _: rt.get(404)),
    ("snapshot", "loop_id", lambda rt, _: rt.snapshot(["a"])),
    ("watch", "loop_id", lambda rt, _: rt.watch(404)),
    ("watch", "after_seq", lambda rt, lid: rt.watch(lid, "3")),
    ("watch", "after_seq", lambda rt, lid: rt.watch(lid, True)),
    ("loops", "status", lambda rt, _: rt.loops(status="paused")),
    ("run_loop", "agent_id", lambda rt, _: rt.run_loop(1, "q", request())),
    ("run_loop", "message", lambda rt, _: rt.run_loop("a", 42, request())),
    ("run_loop", "inference_input", lambda rt, _: rt.run_loop("a", "q", "gpt")),
    (
        "run_loop",
        "interception_handler",
        lambda rt, _: rt.run_loop("a", "q", request(), 5),
    ),
    (
        "run_loop",
        "max_turns",
        lambda rt, _: rt.run_loop("a", "q", request(), max_turns="3"),
    ),
    (
        "run_loop",
        "deadline",
        lambda rt, _: rt.run_loop("a", "q", request(), deadline="9"),
    ),
    (
        "run_loop",
        "stop_when",
        lambda rt, _: rt.run_loop("a", "q", request(), stop_when=[1]),
    ),
    ("enter_async_context", "context", lambda rt, _: rt.enter_async_context(5)),
    (
        "enter_async_context",
        "name",
        lambda rt, _: rt.enter_async_context(nullcontext(), name=5),
    ),
]


@pytest.mark.parametrize(
    ("call_", "parameter"),
    [pytest.param(c, p, id=f"{m}-{p}") for m, p, c in RUNTIME_CALLS],
)
async def test_a_runtime_call_refuses_a_wrong_type_before_writing_anything(
    tmp_path: Path, call_: Call, parameter: str
) -> None:
    """The call raises `TypeError` naming the parameter; the paused loop's
    store record, its stored events and the event log are as they were, and
    all of them read back."""
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    store_path, log_path = tmp_path / "loops.db", tmp_path / "events.jsonl"
    async with Runtime(
        providers={"scripted": provider},
        store=SQLiteStore(store_path, events=True),
        event_log=log_path,
    ) as runtime:
        recorder = EventRecorder(runtime.bus)
        loop_id = runtime.run_loop("agent", "go", request(), pause_tools)
        await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
        seq = runtime.snapshot(loop_id).seq
        published = len(recorder.events)
        with _raises_type_error(parameter) as raised:
            result = call_(runtime, loop_id)
            if inspect.isawaitable(result):
                await result
        assert isinstance(raised.value, ConfigurationError)
        await anyio.wait_all_tasks_blocked()
        assert runtime.loops() == [loop_id]
        assert runtime.get(loop_id).status is LoopStatus.paused
        assert len(recorder.events) == published
    # A durable runtime leaves a paused loop paused, writing nothing more.
    logged = list(read_events(log_path))
    assert [(e.loop_id, e.seq) for e in logged] == [
        (e.loop_id, e.seq) for e in recorder.events
    ]
    async with SQLiteStore(store_path, events=True) as store:
        stored = await store.load(loop_id)
        kept = await store.events(loop_id)
    assert stored is not None
    assert (stored.record.status, stored.record.seq) == (LoopStatus.paused, seq)
    assert [e.seq for e in kept] == [e.seq for e in recorder.events]


async def test_a_cancel_with_a_reason_reads_back_from_the_store_and_the_log(
    tmp_path: Path,
) -> None:
    """The right call still works: a cancelled loop's reason reads back."""
    provider = ScriptedProvider([calls(call("add", a=1, b=2)), text("3")])
    store_path, log_path = tmp_path / "loops.db", tmp_path / "events.jsonl"
    async with Runtime(
        providers={"scripted": provider},
        store=SQLiteStore(store_path, events=True),
        event_log=log_path,
    ) as runtime:
        loop_id = runtime.run_loop("agent", "go", request(), pause_tools)
        await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)
        runtime.cancel(loop_id, "not needed")
        result = await runtime.wait(loop_id)
    assert (result.outcome, result.reason) == (Outcome.cancelled, "not needed")
    assert list(read_events(log_path))[-1].type == "loop.idle"
    async with SQLiteStore(store_path, events=True) as store:
        stored = await store.load(loop_id)
        assert await store.events(loop_id)
    assert stored is not None
    assert stored.record.status is LoopStatus.done


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        pytest.param({"providers": 5}, "providers", id="providers"),
        pytest.param(
            {"providers": [ScriptedProvider([])]}, "providers", id="providers-list"
        ),
        pytest.param({"keep_finished": "5"}, "keep_finished", id="keep_finished"),
        pytest.param({"event_log": 123}, "event_log", id="event_log"),
        pytest.param({"store": "loops.db"}, "store", id="store"),
        pytest.param({"store": MemoryStore(), "tools": 5}, "tools", id="tools"),
        pytest.param({"store": MemoryStore(), "tools": [5]}, "tools", id="tools-item"),
        pytest.param(
            {"store": MemoryStore(), "handlers": 5}, "handlers", id="handlers"
        ),
        pytest.param(
            {"store": MemoryStore(), "handlers": {1: add.function}},
            "handlers",
            id="handlers-key",
        ),
        pytest.param({"extensions": object()}, "extensions", id="extensions"),
        pytest.param({"extensions": [object()]}, r"extensions\[0", id="extension"),
        pytest.param({"clock": "now"}, "clock", id="clock"),
        pytest.param({"ids": 7}, "ids", id="ids"),
    ],
)
def test_the_runtime_refuses_a_wrong_type_by_name(
    kwargs: dict[str, Any], parameter: str
) -> None:
    with _raises_type_error(parameter):
        Runtime(**kwargs)


# --------------------------------------------------------------- Agent's calls


def _agent() -> Agent:
    return Agent(ScriptedProvider([text("hi")]))


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        pytest.param({"model": 5}, "model", id="model"),
        pytest.param({"provider": "openai"}, "provider", id="provider"),
        pytest.param({"name": 5}, "name", id="name"),
        pytest.param({"instructions": 5}, "instructions", id="instructions"),
        pytest.param({"tools": 5}, "tools", id="tools"),
        pytest.param(
            {"model_settings": [("seed", 1)]}, "model_settings", id="settings"
        ),
        pytest.param({"output_type": 5}, "output_type", id="output_type"),
        pytest.param({"streaming": "yes"}, "streaming", id="streaming"),
        pytest.param({"handlers": 5}, "handlers", id="handlers"),
        pytest.param({"max_turns": "3"}, "max_turns", id="option"),
    ],
)
def test_an_agent_refuses_a_wrong_type_by_name(
    kwargs: dict[str, Any], parameter: str
) -> None:
    kwargs = {"model": "scripted:m", **kwargs}
    with _raises_type_error(parameter):
        Agent(**kwargs)


def test_a_conversation_and_a_request_refuse_what_is_no_context() -> None:
    with _raises_type_error("context"):
        Conversation(5)  # type: ignore[arg-type]
    with _raises_type_error("context"):
        _agent().request([])  # type: ignore[arg-type]


AgentCall = Callable[[Any, Runtime], Any]

AGENT_CALLS: list[tuple[str, str, AgentCall]] = [
    ("start", "message", lambda a, rt: a.start(5, runtime=rt)),
    ("start", "conversation", lambda a, rt: a.start("q", runtime=rt, conversation=[])),
    ("start", "runtime", lambda a, rt: a.start("q", runtime="rt")),
    ("start", "max_turns", lambda a, rt: a.start("q", runtime=rt, max_turns="3")),
    ("run", "message", lambda a, rt: a.run(5)),
    ("run", "conversation", lambda a, rt: a.run("q", conversation=[])),
    ("run", "runtime", lambda a, rt: a.run("q", runtime="rt")),
    ("run", "raise_on_failure", lambda a, rt: a.run("q", raise_on_failure="no")),
]


@pytest.mark.parametrize(
    ("call_", "parameter"),
    [pytest.param(c, p, id=f"{m}-{p}") for m, p, c in AGENT_CALLS],
)
async def test_an_agent_call_refuses_a_wrong_type_before_starting_a_loop(
    call_: AgentCall, parameter: str
) -> None:
    agent = _agent()
    async with Runtime() as runtime:
        recorder = EventRecorder(runtime.bus)
        with _raises_type_error(parameter):
            result = call_(agent, runtime)
            if inspect.isawaitable(result):
                await result
        assert runtime.loops() == []
        assert recorder.events == []
        assert runtime.providers.prefixes == []  # not even the agent's provider


@pytest.mark.parametrize(
    ("kwargs", "parameter"),
    [
        pytest.param({"message": 5}, "message", id="message"),
        pytest.param({"conversation": 5}, "conversation", id="conversation"),
        pytest.param({"backend": 5}, "backend", id="backend"),
        pytest.param({"raise_on_failure": 1}, "raise_on_failure", id="raise"),
    ],
)
def test_run_sync_refuses_a_wrong_type_by_name(
    kwargs: dict[str, Any], parameter: str
) -> None:
    kwargs = {"message": "q", **kwargs}
    message = kwargs.pop("message")
    with _raises_type_error(parameter):
        _agent().run_sync(message, **kwargs)


def test_run_sync_refuses_an_unknown_backend_by_name() -> None:
    with pytest.raises(
        ValueError, match="backend must be 'asyncio' or 'trio', got 'uv'"
    ):
        _agent().run_sync("q", backend="uv")  # type: ignore[arg-type]


# ------------------------------------------------- stores and the event log


def _postgres(**kwargs: Any) -> Any:
    postgres = pytest.importorskip("agentfsm.store.postgres")
    return postgres.PostgresStore(**kwargs)


@pytest.mark.parametrize(
    ("make", "parameter"),
    [
        pytest.param(lambda p: _SQLiteStore(5), "path", id="sqlite-path"),
        pytest.param(
            lambda p: _SQLiteStore(p, durability=1),
            "durability",
            id="sqlite-durability",
        ),
        pytest.param(
            lambda p: _SQLiteStore(p, events="yes"), "events", id="sqlite-events"
        ),
        pytest.param(
            lambda p: _SQLiteStore(p, lease_ttl="30"), "lease_ttl", id="sqlite-ttl"
        ),
        pytest.param(
            lambda p: _SQLiteStore(p, busy_timeout=None),
            "busy_timeout",
            id="sqlite-busy",
        ),
        pytest.param(lambda p: _MemoryStore(events=1), "events", id="memory-events"),
        pytest.param(
            lambda p: _MemoryStore(lease_ttl=True), "lease_ttl", id="memory-ttl"
        ),
        pytest.param(
            lambda p: _postgres(conninfo=b"host=x"), "conninfo", id="pg-conninfo"
        ),
        pytest.param(lambda p: _postgres(schema=5), "schema", id="pg-schema"),
        pytest.param(lambda p: _postgres(events="no"), "events", id="pg-events"),
        pytest.param(lambda p: _postgres(lease_ttl="1"), "lease_ttl", id="pg-ttl"),
        pytest.param(
            lambda p: _postgres(connect_timeout="soon"),
            "connect_timeout",
            id="pg-connect",
        ),
        pytest.param(lambda p: _EventLogWriter("bus", p), "bus", id="log-bus"),
        pytest.param(lambda p: _EventLogWriter(EventBus(), 5), "path", id="log-path"),
        pytest.param(
            lambda p: _EventLogWriter(EventBus(), p, buffer="9"),
            "buffer",
            id="log-buffer",
        ),
    ],
)
def test_a_store_or_log_refuses_a_wrong_type_by_name(
    tmp_path: Path, make: Callable[[Path], object], parameter: str
) -> None:
    with _raises_type_error(parameter):
        make(tmp_path / "file")


def test_the_postgres_type_error_never_quotes_the_conninfo() -> None:
    with pytest.raises(TypeError) as raised:
        _postgres(conninfo=b"password=s3cret")
    assert "s3cret" not in str(raised.value)


# ------------------------------------------------------------------ durations


async def _quick(a: int) -> int:
    """Return `a`."""
    return a


def _mcp(**options: Any) -> Any:
    mcp = pytest.importorskip("agentfsm.mcp")
    return mcp.MCPToolset("python -c pass", **options)


Make = Callable[[Any], object]
"""Makes an object from one duration."""

DURATIONS = [
    # pytest.param(the parameter, a maker, whether 0 is refused too, id=...)
    pytest.param("timeout", lambda v: Tool(_quick, timeout=v), True, id="tool"),
    pytest.param("timeout", lambda v: tool(timeout=v)(_quick), True, id="@tool"),
    pytest.param(
        "inference_timeout",
        lambda v: LoopOptions(inference_timeout=v),
        True,
        id="inference_timeout",
    ),
    pytest.param("deadline", lambda v: LoopOptions(deadline=v), True, id="deadline"),
    pytest.param(
        "retry_backoff", lambda v: LoopOptions(retry_backoff=v), False, id="backoff"
    ),
    pytest.param(
        "lease_ttl", lambda v: MemoryStore(lease_ttl=v), True, id="memory-lease_ttl"
    ),
    pytest.param(
        "lease_ttl",
        lambda v: SQLiteStore("never-opened.db", lease_ttl=v),
        True,
        id="sqlite-lease_ttl",
    ),
    pytest.param(
        "busy_timeout",
        lambda v: SQLiteStore("never-opened.db", busy_timeout=v),
        False,
        id="sqlite-busy_timeout",
    ),
    pytest.param(
        "lease_ttl", lambda v: _postgres(lease_ttl=v), True, id="postgres-lease_ttl"
    ),
    pytest.param(
        "connect_timeout",
        lambda v: _postgres(connect_timeout=v),
        True,
        id="postgres-connect_timeout",
    ),
    pytest.param("timeout", lambda v: _mcp(timeout=v), True, id="mcp-timeout"),
    pytest.param(
        "connect_timeout",
        lambda v: _mcp(connect_timeout=v),
        True,
        id="mcp-connect_timeout",
    ),
]


@pytest.mark.parametrize(("parameter", "make", "positive"), DURATIONS)
@pytest.mark.parametrize(
    ("value", "shown"),
    [
        pytest.param(NAN, "nan", id="nan"),
        pytest.param(-1, "-1", id="negative"),
        pytest.param(INF, "inf", id="inf"),
        pytest.param(-INF, "-inf", id="-inf"),
        pytest.param(0, "0", id="zero"),
    ],
)
def test_a_duration_no_timer_can_take_is_refused_when_made(
    parameter: str, make: Make, positive: bool, value: float, shown: str
) -> None:
    """NaN, negative and infinite durations are refused, naming the parameter
    and the value (and 0, where nothing could finish in it); a valid one is
    taken (the stores and the toolset are made, not opened)."""
    if value == 0 and not positive:
        make(value)
        return
    with pytest.raises(
        ValueError, match=rf"^{parameter} must be .*, got {shown}$"
    ) as e:
        make(value)
    assert isinstance(e.value, ConfigurationError)
    make(0.25)


@pytest.mark.parametrize(("parameter", "make", "positive"), DURATIONS)
def test_a_duration_that_is_no_number_is_a_type_error(
    parameter: str, make: Make, positive: bool
) -> None:
    with _raises_type_error(parameter):
        make("5")
    with _raises_type_error(parameter):
        make(True)


def test_a_tool_without_a_timeout_still_takes_none() -> None:
    assert Tool(_quick, timeout=None).timeout is None
    assert LoopOptions(inference_timeout=None, deadline=None).deadline is None


def test_a_large_int_is_an_infinite_duration() -> None:
    with pytest.raises(ValueError, match="timeout must be positive"):
        Tool(_quick, timeout=10**400)


async def test_tools_with_a_tiny_timeout_still_work() -> None:
    """A call that never waits finishes under a tiny timeout; one that waits
    times out, its output an error; the loop, and the next one, go on."""

    @tool(timeout=1e-6)
    async def instant(a: int) -> int:
        """Return `a`."""
        return a

    @tool(timeout=1e-6)
    async def stuck() -> str:
        """Never return."""
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    script = [calls(call("instant", a=7), call("stuck")), text("done")]
    provider = ScriptedProvider(script)
    async with Runtime(providers={"scripted": provider}) as runtime:
        first = await runtime.wait(runtime.run_loop("a", "q", request(instant, stuck)))
        second = await runtime.wait(runtime.run_loop("a", "q", request(instant, stuck)))
    assert first.outcome is second.outcome is Outcome.answered
    outputs = [
        i
        for i in provider.requests[1].context.items
        if i.type == "function_call_output"
    ]
    assert (outputs[0].output, outputs[0].is_error) == ("7", False)
    assert outputs[1].is_error
    assert "timed out" in outputs[1].output


async def test_wait_cancelled_refuses_a_nan_timeout() -> None:
    """A sync tool sleeping with `wait_cancelled(nan)` is told so (a NaN wait
    returned at once before)."""

    @tool
    def sleeper() -> str:
        """Sleep."""
        try:
            current_call().wait_cancelled(math.nan)
        except ValueError as exc:
            return str(exc)
        return "slept"

    provider = ScriptedProvider([calls(call("sleeper")), text("done")])
    async with Runtime(providers={"scripted": provider}) as runtime:
        await runtime.wait(runtime.run_loop("a", "q", request(sleeper)))
    (output,) = [
        i
        for i in provider.requests[1].context.items
        if i.type == "function_call_output"
    ]
    assert (
        output.output
        == "timeout must be a finite number of seconds >= 0 or None, got nan"
    )
