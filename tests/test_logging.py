"""Logs are bound to the loop and agent; the library never configures structlog."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from structlog.typing import EventDict

from agentfsm import PendingTransition, Runtime, Tool, _logging
from agentfsm.exceptions import ProviderError
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import request

ROOT = Path(__file__).resolve().parent.parent


def proceed(pending: PendingTransition) -> None:
    """An interception handler that lets everything through (and so gets logged)."""


async def test_every_line_carries_loop_and_agent(log_output: list[EventDict]) -> None:
    """Each log line of concurrent loops names its own loop_id and that loop's agent_id."""
    provider = ScriptedProvider(
        [calls(call("add", a=1, b=2), call("add", a=1, b="x"), call("nope")), text("3")]
    )
    with anyio.fail_after(10):
        async with Runtime(providers={"scripted": provider}) as runtime:
            agents = {
                runtime.run_loop(f"agent-{n}", "1+2?", request(), proceed): f"agent-{n}"
                for n in range(4)
            }
            for loop_id in agents:
                await runtime.wait(loop_id)
    assert log_output
    events = {line["event"] for line in log_output}
    assert {"transition_intercepted", "tool_call_error", "loop_idle"} <= (events)
    for line in log_output:
        assert line["loop_id"] in agents, line
        assert line["agent_id"] == agents[line["loop_id"]], line
    assert {line["loop_id"] for line in log_output} == set(agents)


async def test_failing_loop_logs_warning(log_output: list[EventDict]) -> None:
    """A loop that fails logs a warning naming the loop, the state and the error."""
    provider = ScriptedProvider([ProviderError("model is down")])
    with anyio.fail_after(10):
        async with Runtime(providers={"scripted": provider}) as runtime:
            loop_id = runtime.run_loop("agent-1", "hi", request())
            result = await runtime.wait(loop_id)
    assert result.outcome == "failed"
    warnings = [line for line in log_output if line["log_level"] == "warning"]
    assert len(warnings) == 1
    warning = warnings[0]
    assert warning["event"] == "loop_failed"
    assert warning["loop_id"] == loop_id
    assert warning["agent_id"] == "agent-1"
    assert warning["state"] == "inference"
    assert warning["error"] == "ProviderError: model is down"


async def test_answered_loop_logs_no_warning(log_output: list[EventDict]) -> None:
    """A loop that answers logs nothing above info and ends with `loop_idle`."""
    with anyio.fail_after(10):
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hi")])}
        ) as rt:
            loop_id = rt.run_loop("agent-1", "hi", request())
            await rt.wait(loop_id)
    assert {line["log_level"] for line in log_output} <= {"debug", "info"}
    last = log_output[-1]
    assert (last["event"], last["loop_id"], last["outcome"]) == (
        "loop_idle",
        loop_id,
        "answered",
    )


@pytest.mark.parametrize(
    ("wrapper_class", "kept"),
    [
        pytest.param(
            structlog.make_filtering_bound_logger(logging.INFO), True, id="info"
        ),
        pytest.param(
            structlog.make_filtering_bound_logger(logging.WARNING), False, id="warning"
        ),
        pytest.param(structlog.BoundLogger, True, id="unfiltered"),  # no is_enabled_for
    ],
)
async def test_the_end_line_follows_the_configured_level(
    wrapper_class: type[Any], kept: bool
) -> None:
    """A loop's one info line (`Loop.log_info`, no logger bound for it) carries
    its ids where info is kept, and is not made where it is filtered out."""
    old = structlog.get_config()
    with structlog.testing.capture_logs() as logs:
        structlog.configure(wrapper_class=wrapper_class)
        try:
            async with Runtime(
                providers={"scripted": ScriptedProvider([text("hi")])}
            ) as rt:
                loop_id = rt.run_loop("agent-1", "hi", request())
                await rt.wait(loop_id)
        finally:
            structlog.configure(wrapper_class=old["wrapper_class"])
    lines = [line for line in logs if line["event"] == "loop_idle"]
    expected = [("info", loop_id, "agent-1", "answered", None)] if kept else []
    assert [
        (
            line["log_level"],
            line["loop_id"],
            line["agent_id"],
            line["outcome"],
            line["reason"],
        )
        for line in lines
    ] == expected


async def test_context_bound_for_code_in_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tools (sync in a thread, and async) see loop_id/agent_id in structlog contextvars."""
    seen: list[dict[str, Any]] = []

    def sync_probe() -> str:
        seen.append(structlog.contextvars.get_contextvars())
        return "ok"

    async def async_probe() -> str:
        seen.append(structlog.contextvars.get_contextvars())
        return "ok"

    tools = (Tool.from_function(sync_probe), Tool.from_function(async_probe))
    turn = [calls(call("sync_probe"), call("async_probe")), text("")]
    provider = ScriptedProvider(turn * 3)
    # The first loop binds through structlog, the next ones set the variables
    # it named (`_logging.bind_loop_ids`); the caller's own binding stays its.
    monkeypatch.setattr(_logging, "_loop_vars", None)
    structlog.contextvars.bind_contextvars(loop_id="caller")
    with anyio.fail_after(10):
        async with Runtime(providers={"scripted": provider}) as runtime:
            ids = []
            for agent in ("agent-7", "agent-8", "agent-9"):
                loop_id = runtime.run_loop(agent, "go", request(*tools))
                await runtime.wait(loop_id)
                ids.append((loop_id, agent))
    expected = [{"loop_id": i, "agent_id": a} for i, a in ids for _ in range(2)]
    assert [{k: s.get(k) for k in ("loop_id", "agent_id")} for s in seen] == expected
    assert structlog.contextvars.get_contextvars() == {"loop_id": "caller"}
    structlog.contextvars.clear_contextvars()


def test_library_never_configures_structlog() -> None:
    """Importing agentfsm and running a loop leaves structlog unconfigured."""
    script = textwrap.dedent(
        """
        import anyio, structlog
        import agentfsm
        from agentfsm.testing import ScriptedProvider, text
        from tests.helpers import request

        async def main():
            provider = ScriptedProvider([text("hi")])
            async with agentfsm.Runtime(providers={"scripted": provider}) as runtime:
                return await runtime.wait(runtime.run_loop("a", "hi", request()))

        before = structlog.is_configured()
        result = anyio.run(main)
        print("configured:", before, structlog.is_configured(), result.outcome)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=30,
    )
    assert done.stdout.splitlines()[-1] == "configured: False False answered"


_QUIET_SCRIPT = """
import anyio, structlog
import agentfsm
from agentfsm.exceptions import ProviderError
from agentfsm.testing import ScriptedProvider, text
from tests.helpers import request

async def main():
    provider = ScriptedProvider([text("hi")])
    failing = ScriptedProvider([ProviderError("model is down")])
    async with agentfsm.Runtime(
        providers={"scripted": provider, "down": failing}
    ) as runtime:
        answered = await runtime.wait(runtime.run_loop("a", "hi", request()))
        failed = await runtime.wait(
            runtime.run_loop("b", "hi", request(model="down:m"))
        )
    return answered.outcome, failed.outcome

if CONFIGURE:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory())  # stdout
print("outcomes:", *anyio.run(main))
"""


def _run_quiet_script(configure: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", f"CONFIGURE = {configure}\n{_QUIET_SCRIPT}"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=30,
    )


def test_unconfigured_the_library_warns_on_stderr_only() -> None:
    """Unconfigured, no info line is written anywhere and warnings go to stderr."""
    done = _run_quiet_script(configure=False)
    assert done.stdout == "outcomes: answered failed\n"  # the program's output only
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "loop_failed" in lines[0]
    assert "warning" in lines[0]
    assert "ProviderError: model is down" in lines[0]
    assert "loop_idle" not in done.stderr  # an info line


def test_once_configured_the_application_decides() -> None:
    """An application that configures structlog gets the info lines where it said."""
    done = _run_quiet_script(configure=True)
    assert done.stdout.splitlines()[-1] == "outcomes: answered failed"
    assert "loop_idle" in done.stdout
    assert "loop_failed" in done.stdout
    assert done.stderr == ""
