"""Breakpoints and step mode (`agentfsm.breakpoints`): a pause before a
transition into a state, like a handler's, stored by a durable store and
never asked twice after a crash; set for a runtime, an agent or a loop, while
loops run; `agentfsm run --break STATE` and `--step`.

The crashes are real: a process SIGKILLed right after its store took the
breakpoint's pause, or the decision resuming it (tests/breakpoints_child.py),
and a new process recovers the loop.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentfsm import (
    Abort,
    Break,
    ConfigurationError,
    InferenceInput,
    LoopState,
    LoopStatus,
    LoopView,
    ModelContext,
    Outcome,
    PendingTransition,
    Proceed,
    Rewrite,
    Runtime,
    ToolBatch,
    Trigger,
    tool,
)
from agentfsm.breakpoints import (
    BREAKPOINT_HANDLER,
    ScopedBreak,
    is_breakpoint_pause,
)
from agentfsm.cli import run as run_command
from agentfsm.cli._pause import PauseDecider, unattended
from agentfsm.cli.run import _request, _Unanswered, _watch, breakpoints_of
from agentfsm.exceptions import LoopStateError, UnknownLoopError
from agentfsm.store import SQLiteStore
from agentfsm.testing import EventRecorder, ScriptedProvider, call, calls, text
from tests.helpers import items_of, wait_until
from tests.test_cli_pause import (  # the pseudo-terminal harness and its fixtures
    Terminal,
    agentfsm,
    fake_api,
    run_args,
    says,
    terminal,
    work,
)
from tests.test_cli_pause import calls as api_calls
from tests.test_cli_process import Answer, FakeAPI

__all__ = ("agentfsm", "fake_api", "terminal", "work")  # fixtures, used by name

RAN: list[str] = []


@tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    RAN.append(f"add {a} {b}")
    return a + b


@pytest.fixture(autouse=True)
def _forget_runs() -> None:
    RAN.clear()


def script() -> ScriptedProvider:
    """One call of `add`, then an answer."""
    return ScriptedProvider(
        [calls(call("add", call_id="c1", a=1, b=2)), text("It is 3.")]
    )


def request(*, streaming: bool = False) -> InferenceInput:
    return InferenceInput(
        model="scripted:m", context=ModelContext(), tools=[add], streaming=streaming
    )


async def paused(runtime: Runtime, loop_id: str) -> LoopView:
    """The loop's view once it is paused (or has ended: the caller checks)."""
    await wait_until(lambda: runtime.get(loop_id).status is not LoopStatus.running)
    return runtime.get(loop_id)


def edge(view: LoopView) -> tuple[str, str, str]:
    assert view.pending is not None
    return view.pending.source, view.pending.trigger, view.pending.dest


def several(pending: PendingTransition) -> bool:
    return pending.model_requests >= 1


# ---------------------------------------------------------------- Break


class TestBreak:
    def test_a_state_by_member_or_name(self) -> None:
        assert Break("function_call") == Break(LoopState.function_call)
        assert Break("function_call").state is LoopState.function_call
        assert Break.every().state is None
        assert len({Break("inference"), Break("inference")}) == 1

    def test_an_unknown_state_is_refused(self) -> None:
        with pytest.raises(ValueError, match=r"Break\('tools'\): no such state") as e:
            Break("tools")
        assert isinstance(e.value, ConfigurationError)
        assert "function_call" in str(e.value)

    @pytest.mark.parametrize(
        ("state", "kwargs", "message"),
        [
            (3, {}, "Break takes the state to stop before"),
            ("idle", {"when": 3}, "when= must be a sync callable"),
            ("idle", {"name": 3}, "name must be a str or None"),
        ],
        ids=["state", "when", "name"],
    )
    def test_bad_arguments(self, state: Any, kwargs: Any, message: str) -> None:
        with pytest.raises(TypeError, match=re.escape(message)):
            Break(state, **kwargs)

    def test_an_async_predicate_is_refused(self) -> None:
        async def later(pending: PendingTransition) -> bool:
            return True

        class Later:
            async def __call__(self, pending: PendingTransition) -> bool:
                return True

        for when in (later, Later()):
            with pytest.raises(TypeError, match="an async decision is an"):
                Break("inference", when=when)

    def test_labels(self) -> None:
        assert Break("inference").label == "before inference"
        assert Break.every().label == "every transition"
        assert Break("inference", when=several).label == (
            "before inference when tests.test_breakpoints:several"
        )
        assert Break("idle", name="the end").label == "the end"

    @pytest.mark.parametrize(
        "given",
        [Break("inference"), ["inference"], "inference"],
        ids=["one", "names", "str"],
    )
    def test_runtime_takes_a_list_of_breaks(self, given: Any) -> None:
        with pytest.raises(TypeError, match="breakpoints must be a list of Break"):
            Runtime(breakpoints=given)


# ---------------------------------------------------------------- pausing


async def test_pauses_before_the_state_until_resumed() -> None:
    """The loop pauses before entering the state, nothing of it run; the
    pause is a pause like a handler's: published, in the view, resumed."""
    async with Runtime(
        providers={"scripted": script()}, breakpoints=[Break("function_call")]
    ) as runtime:
        recorder = EventRecorder(runtime.bus, ["loop.paused", "transition.intercepted"])
        loop_id = runtime.run_loop("a", "add 1 and 2", request())
        view = await paused(runtime, loop_id)
        assert view.status is LoopStatus.paused
        assert edge(view) == ("inference", "call_tools", "function_call")
        assert view.pause_reason == (
            "breakpoint before function_call: inference --call_tools--> function_call"
        )
        assert is_breakpoint_pause(view.pause_reason)
        assert RAN == []
        assert runtime.snapshot(loop_id).handlers == (BREAKPOINT_HANDLER,)
        runtime.resume(loop_id)
        result = await runtime.wait(loop_id)
    assert (result.outcome, RAN) == ("answered", ["add 1 2"])
    [pause] = [e for e in recorder.events if e.type == "loop.paused"]
    assert pause.reason == view.pause_reason
    decisions = [
        (e.trigger, e.decision, e.handler)
        for e in recorder.events
        if e.type == "transition.intercepted"
    ]
    assert decisions[:3] == [
        ("start", "proceed", 0),
        ("infer", "proceed", 0),
        ("call_tools", "pause", 0),
    ]


@pytest.mark.parametrize("how", ["rewrite", "abort"])
async def test_a_breakpoint_is_resumed_like_any_pause(how: str) -> None:
    """A Rewrite given at a breakpoint is taken (a denied call does not run);
    an Abort ends the loop."""
    provider = script()
    async with Runtime(
        providers={"scripted": provider}, breakpoints=[Break("function_call")]
    ) as runtime:
        loop_id = runtime.run_loop("a", "add 1 and 2", request())
        view = await paused(runtime, loop_id)
        assert view.pending is not None
        batch = view.pending.payload
        assert isinstance(batch, ToolBatch)
        if how == "rewrite":
            runtime.resume(loop_id, Rewrite(payload=batch.deny("c1", "not now")))
        else:
            runtime.resume(loop_id, Abort("stop here"))
        result = await runtime.wait(loop_id)
    assert RAN == []
    if how == "rewrite":
        assert result.outcome == "answered"
        assert "out:c1=ERR" in items_of(provider.requests[-1].context)
    else:
        assert (result.outcome, result.reason) == ("aborted", "stop here")


async def test_inference_stops_a_streaming_request_too() -> None:
    async with Runtime(
        providers={"scripted": script()}, breakpoints=[Break("inference")]
    ) as runtime:
        loop_id = runtime.run_loop("a", "hi", request(streaming=True))
        view = await paused(runtime, loop_id)
        assert edge(view) == (
            "context_update",
            "infer_streaming",
            "inference_streaming",
        )
        runtime.cancel(loop_id)


async def test_when_picks_the_transitions() -> None:
    """A predicate on the pending transition: only the second request pauses."""
    async with Runtime(
        providers={"scripted": script()},
        breakpoints=[Break("inference", when=several)],
    ) as runtime:
        loop_id = runtime.run_loop("a", "add", request())
        view = await paused(runtime, loop_id)
        assert edge(view) == ("function_call", "infer", "inference")
        assert view.model_requests == 1
        assert RAN == ["add 1 2"]
        assert view.pause_reason is not None
        assert "when tests.test_breakpoints:several" in view.pause_reason
        runtime.resume(loop_id)
        assert (await runtime.wait(loop_id)).outcome == "answered"


async def test_a_predicate_that_raises_fails_the_loop() -> None:
    def broken(pending: PendingTransition) -> bool:
        raise RuntimeError("predicate broke")

    async with Runtime(
        providers={"scripted": script()},
        breakpoints=[Break("inference", when=broken)],
    ) as runtime:
        result = await runtime.wait(runtime.run_loop("a", "add", request()))
    assert result.outcome == "failed"
    assert result.error is not None
    assert "predicate broke" in result.error.message


async def test_step_mode_pauses_before_every_transition() -> None:
    async with Runtime(
        providers={"scripted": script()}, breakpoints=[Break.every()]
    ) as runtime:
        loop_id = runtime.run_loop("a", "add", request())
        stops = []
        while (view := await paused(runtime, loop_id)).status is LoopStatus.paused:
            stops.append(edge(view))
            assert view.pause_reason is not None
            assert view.pause_reason.startswith("breakpoint every transition: ")
            runtime.resume(loop_id)
            await wait_until(lambda: runtime.get(loop_id).pending != view.pending)
        result = await runtime.wait(loop_id)
    assert stops == [(s.source, s.trigger, s.dest) for s in result.path]
    assert len(stops) == 6


class TestAfterTheHandlers:
    """The breakpoint runs last: it sees the transition as it will be taken."""

    async def test_it_sees_a_handler_s_rewrite(self) -> None:
        def ten(pending: PendingTransition) -> Rewrite | None:
            batch = pending.payload
            if isinstance(batch, ToolBatch):
                return Rewrite(payload=batch.with_arguments("c1", {"a": 10, "b": 2}))
            return None

        async with Runtime(
            providers={"scripted": script()}, breakpoints=[Break("function_call")]
        ) as runtime:
            loop_id = runtime.run_loop("a", "add", request(), ten)
            view = await paused(runtime, loop_id)
            assert view.pending is not None
            assert isinstance(view.pending.payload, ToolBatch)
            assert view.pending.payload.calls[0].arguments == '{"a":10,"b":2}'
            runtime.resume(loop_id)
            await runtime.wait(loop_id)
        assert RAN == ["add 10 2"]

    async def test_an_edge_rewritten_away_never_stops(self) -> None:
        """A handler sends the loop to `idle` instead of `inference`: a
        breakpoint on `inference` does not stop it, one on `idle` does."""

        def stop_after_tools(pending: PendingTransition) -> Rewrite | None:
            if pending.trigger is Trigger.infer and pending.source == "function_call":
                return Rewrite(dest=LoopState.idle)
            return None

        async with Runtime(
            providers={"scripted": script()},
            breakpoints=[Break("inference", when=several), Break("idle")],
        ) as runtime:
            loop_id = runtime.run_loop("a", "add", request(), stop_after_tools)
            view = await paused(runtime, loop_id)
            assert edge(view) == ("function_call", "stop", "idle")
            runtime.resume(loop_id)
            result = await runtime.wait(loop_id)
        assert result.outcome == "stopped"

    async def test_an_approval_comes_first(self) -> None:
        @tool(needs_approval=True)
        def send(to: str) -> str:
            """Send."""
            return f"sent to {to}"

        provider = ScriptedProvider([calls(call("send", to="ada")), text("Sent.")])
        async with Runtime(
            providers={"scripted": provider}, breakpoints=[Break("function_call")]
        ) as runtime:
            loop_id = runtime.run_loop(
                "a",
                "send",
                InferenceInput(
                    model="scripted:m", context=ModelContext(), tools=[send]
                ),
            )
            first = await paused(runtime, loop_id)
            assert first.pause_reason == "approval required: send"
            runtime.resume(loop_id)
            await wait_until(lambda: runtime.get(loop_id).pending != first.pending)
            second = await paused(runtime, loop_id)
            assert is_breakpoint_pause(second.pause_reason)
            assert edge(second) == ("inference", "call_tools", "function_call")
            runtime.resume(loop_id)
            assert (await runtime.wait(loop_id)).outcome == "answered"


# ---------------------------------------------------------------- the API


GO: dict[str, anyio.Event] = {}
STARTED: list[str] = []


@tool
async def hold() -> str:
    """Wait until the test lets it go."""
    STARTED.append("hold")
    await GO["hold"].wait()
    return "held"


def holding() -> ScriptedProvider:
    return ScriptedProvider([calls(call("hold", call_id="h1")), text("Done.")])


def hold_request() -> InferenceInput:
    return InferenceInput(model="scripted:m", context=ModelContext(), tools=[hold])


class TestAtRunTime:
    async def test_a_loop_without_handlers_meets_one_set_while_it_runs(self) -> None:
        """Set for a running loop (no handler at all when it started), a
        breakpoint stops its next transition; removed, the loop goes on and
        runs with no handler again."""
        GO["hold"] = anyio.Event()
        STARTED.clear()
        async with Runtime(providers={"scripted": holding()}) as runtime:
            loop_id = runtime.run_loop("a", "hold", hold_request())
            await wait_until(lambda: STARTED == ["hold"])
            assert runtime.snapshot(loop_id).handlers == ()
            runtime.breakpoints.add(Break("inference"), loop_id=loop_id)
            assert runtime.breakpoints.list(loop_id=loop_id) == (
                ScopedBreak(Break("inference"), loop_id=loop_id),
            )
            GO["hold"].set()
            view = await paused(runtime, loop_id)
            assert edge(view) == ("function_call", "infer", "inference")
            assert runtime.breakpoints.remove(Break("inference"), loop_id=loop_id)
            assert runtime.snapshot(loop_id).handlers == ()
            runtime.resume(loop_id)
            assert (await runtime.wait(loop_id)).outcome == "answered"
            assert runtime.breakpoints.list() == ()

    async def test_one_agent_s_loops(self) -> None:
        async with Runtime(providers={"scripted": script()}) as runtime:
            runtime.breakpoints.add(Break("function_call"), agent_id="billing")
            billing = runtime.run_loop("billing", "add", request())
            other = runtime.run_loop("support", "add", request())
            assert (await runtime.wait(other)).outcome == "answered"
            view = await paused(runtime, billing)
            assert view.status is LoopStatus.paused
            assert runtime.breakpoints.list(loop_id=billing) == (
                ScopedBreak(Break("function_call"), agent_id="billing"),
            )
            assert runtime.breakpoints.list(agent_id="support") == ()
            runtime.breakpoints.remove(Break("function_call"), agent_id="billing")
            runtime.resume(billing)
            assert (await runtime.wait(billing)).outcome == "answered"
        assert RAN == ["add 1 2", "add 1 2"]

    async def test_step_mode_of_one_loop(self) -> None:
        """Stepping from a breakpoint's pause: the next transition stops too;
        stepping off, the loop runs to its end."""
        async with Runtime(
            providers={"scripted": script()}, breakpoints=[Break("function_call")]
        ) as runtime:
            loop_id = runtime.run_loop("a", "add", request())
            first = await paused(runtime, loop_id)
            runtime.breakpoints.step(loop_id)
            runtime.resume(loop_id)
            await wait_until(lambda: runtime.get(loop_id).pending != first.pending)
            view = await paused(runtime, loop_id)
            assert edge(view) == ("function_call", "infer", "inference")
            assert runtime.breakpoints.list(loop_id=loop_id) == (
                ScopedBreak(Break.every(), loop_id=loop_id),
                ScopedBreak(Break("function_call")),
            )
            runtime.breakpoints.step(loop_id, on=False)
            runtime.resume(loop_id)
            assert (await runtime.wait(loop_id)).outcome == "answered"

    async def test_scopes_are_checked(self) -> None:
        async with Runtime(providers={"scripted": script()}) as runtime:
            breakpoints = runtime.breakpoints
            with pytest.raises(UnknownLoopError):
                breakpoints.add(Break("idle"), loop_id="nope")
            with pytest.raises(ValueError, match="not both"):
                breakpoints.add(Break("idle"), loop_id="x", agent_id="y")
            with pytest.raises(TypeError, match="breakpoint must be a Break"):
                breakpoints.add("idle")  # type: ignore[arg-type]
            loop_id = runtime.run_loop("a", "add", request())
            await runtime.wait(loop_id)
            with pytest.raises(LoopStateError, match="has ended"):
                breakpoints.add(Break("idle"), loop_id=loop_id)
            assert not breakpoints.remove(Break("idle"), loop_id=loop_id)
            assert not breakpoints.remove(Break("idle"))
            assert not breakpoints.armed

    async def test_a_loop_no_breakpoint_applies_to_has_no_handler(self) -> None:
        """The handler is added only to the loops a breakpoint applies to."""
        async with Runtime(
            providers={"scripted": script()}, breakpoints=[Break("function_call")]
        ) as runtime:
            loop_id = runtime.run_loop("a", "add", request())
            await paused(runtime, loop_id)
            runtime.breakpoints.remove(Break("function_call"))
            assert runtime.snapshot(loop_id).handlers == ()
            runtime.resume(loop_id)  # at the breakpoint's place: past the end
            assert (await runtime.wait(loop_id)).outcome == "answered"


# ---------------------------------------------------------------- durable


async def test_a_stored_pause_is_taken_up_by_a_runtime_without_breakpoints(
    tmp_path: Path,
) -> None:
    """A runtime leaving a loop paused at a breakpoint leaves it so in its
    store; another one (with no breakpoint) takes it up paused, and resuming
    it does not ask again: the decisions name the breakpoint, once."""
    db = str(tmp_path / "loops.db")
    provider = script()  # one: the second runtime goes on with its script
    async with Runtime(
        providers={"scripted": provider},
        store=SQLiteStore(db),
        breakpoints=[Break("function_call")],
    ) as first:
        loop_id = first.run_loop("a", "add", request())
        view = await paused(first, loop_id)
    async with Runtime(
        providers={"scripted": provider}, store=SQLiteStore(db), tools=[add]
    ) as second:
        recorder = EventRecorder(second.bus, "loop.paused")
        report = await second.recover()
        assert report.paused == [loop_id]
        again = second.get(loop_id)
        assert (again.pause_reason, again.pending) == (view.pause_reason, view.pending)
        assert second.snapshot(loop_id).handlers == ()
        second.resume(loop_id, Proceed(), by="ada")
        result = await second.wait(loop_id)
        store = second.store
        assert isinstance(store, SQLiteStore)
        decisions = await store.decisions(loop_id)
    assert (result.outcome, RAN, recorder.events) == ("answered", ["add 1 2"], [])
    assert [(d.handler, d.decision.kind, d.by) for d in decisions] == [
        (BREAKPOINT_HANDLER, "pause", None),
        (None, "proceed", "ada"),
    ]


CHILD = Path(__file__).with_name("breakpoints_child.py")
REASON = "breakpoint before function_call: inference --call_tools--> function_call"
ROOT = CHILD.parent.parent


def child(backend: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AGENTFSM_BACKEND": backend}
    return subprocess.run(
        [sys.executable, str(CHILD), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.e2e
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize(
    "crash", ["at_pause", "at_pause, twice", "after_resume"], ids=str
)
def test_a_crash_never_asks_twice(backend: str, crash: str, tmp_path: Path) -> None:
    """SIGKILLed once the pause is stored, the loop is taken up paused (and
    paused again after a second crash while paused); SIGKILLed once the
    decision resuming it is stored, it goes on without pausing. Either way the
    breakpoint asked once and the tool ran once."""
    db, side = str(tmp_path / "loops.db"), str(tmp_path / "side")
    mode = crash.split(",")[0]
    ran = child(backend, "run", db, side, mode)
    assert ran.returncode == -signal.SIGKILL, ran.stderr[-2000:]
    loop_id = ran.stdout.split()[0]
    if crash.endswith("twice"):
        held = child(backend, "recover", db, side, loop_id, "hold")
        assert held.returncode == -signal.SIGKILL, held.stderr[-2000:]
    recovered = child(backend, "recover", db, side, loop_id)
    assert recovered.returncode == 0, recovered.stderr[-2000:]
    result = json.loads(recovered.stdout.splitlines()[-1])
    by = "first process" if mode == "after_resume" else "after the crash"
    assert result == {
        "running": [loop_id] if mode == "after_resume" else [],
        "paused": [] if mode == "after_resume" else [loop_id],
        "pauses": 0,
        "outcome": "answered",
        "decisions": [
            [
                BREAKPOINT_HANDLER,
                "pause",
                REASON,
                None,
            ],
            [None, "proceed", None, by],
        ],
    }
    assert Path(side).read_text().splitlines() == ["charged 5"]


# ---------------------------------------------------------------- the CLI


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    run_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


class TestCommandLine:
    def test_flags(self) -> None:
        assert breakpoints_of(_args("q")) == []
        assert breakpoints_of(
            _args("q", "--break", "inference", "--break", "function_call")
        ) == [Break("inference"), Break("function_call")]
        assert breakpoints_of(_args("q", "--step", "--break", "idle")) == [
            Break.every()
        ]

    def test_an_unknown_state_is_refused(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as exited:
            _args("q", "--break", "tools")
        assert exited.value.code == 2
        assert "invalid choice: 'tools'" in capsys.readouterr().err

    async def run_with(
        self, answers: list[str | None], *argv: str, approve_all: bool = False
    ) -> tuple[str, list[str], Any]:
        asked: list[str] = []

        async def ask(question: str) -> str | None:
            asked.append(question)
            return answers.pop(0)

        @tool(needs_approval=True)
        def send(to: str) -> str:
            """Send."""
            RAN.append(f"send {to}")
            return f"sent to {to}"

        provider = ScriptedProvider([calls(call("send", to="ada")), text("Sent.")])
        args = _args("Send it.", "--model", "s:m", *argv)
        out = io.StringIO()
        async with Runtime(
            providers={"s": provider}, breakpoints=breakpoints_of(args)
        ) as runtime:
            result = await _watch(
                runtime,
                args,
                _request(args, [send]),
                out,
                pauses=PauseDecider(
                    {"send": send}, ask=ask, approve_all=approve_all, out=out
                ),
            )
        return out.getvalue(), asked, result

    async def test_resume_at_a_breakpoint(self) -> None:
        """`--break function_call`: asked after the approval, resume or abort."""
        shown, asked, result = await self.run_with(
            ["y", "go", "r"], "--break", "function_call"
        )
        assert result.outcome == Outcome.answered
        assert asked[0].startswith("approve send(")
        assert asked[1:] == ["[r]esume or [a]bort? ", "[r]esume or [a]bort? "]
        assert (
            "stopped at breakpoint before function_call: "
            "inference_streaming --call_tools--> function_call\n"
        ) in shown
        assert "  answer r or a\n" in shown
        assert RAN == ["send ada"]

    async def test_approve_all_still_stops_at_a_breakpoint(self) -> None:
        shown, asked, result = await self.run_with(
            ["a"], "--break", "function_call", approve_all=True
        )
        assert (result.outcome, result.reason) == ("aborted", "aborted at the prompt")
        assert asked == ["[r]esume or [a]bort? "]
        assert "approved (--approve-all)" in shown
        assert RAN == []

    async def test_step(self) -> None:
        """`--step`: a stop before each transition of the loop."""
        shown, asked, result = await self.run_with(
            ["r"] * 10, "--step", approve_all=True
        )
        assert result.outcome == Outcome.answered
        assert len(asked) == len(result.path) == 6
        stops = [line for line in shown.splitlines() if line.startswith("stopped at")]
        assert stops[0] == (
            "stopped at breakpoint every transition: idle --start--> context_update"
        )
        assert len(stops) == 6
        # What each transition acts on (a batch's calls: with the pause).
        assert "  user: Send it.\n" in shown
        assert "  the request to s:m: 1 context item(s), 1 tool(s)\n" in shown
        assert "  the answer: Sent.\n" in shown

    async def test_nobody_to_ask_at_a_breakpoint(self) -> None:
        args = _args("Add.", "--model", "scripted:m", "--break", "inference")
        out = io.StringIO()
        with pytest.raises(_Unanswered) as raised:
            async with Runtime(
                providers={"scripted": script()}, breakpoints=breakpoints_of(args)
            ) as runtime:
                await _watch(
                    runtime,
                    args,
                    _request(args, [add]),
                    out,
                    pauses=PauseDecider({}, ask=None, out=out),
                )
        message = unattended(raised.value.paused)
        assert "paused (breakpoint before inference: " in message
        assert "without --break and --step" in message


@pytest.mark.e2e
def test_break_at_a_terminal(
    terminal: Callable[..., Terminal],
    fake_api: Callable[[list[Answer]], FakeAPI],
) -> None:
    """`agentfsm run --break function_call` at a terminal: it stops before
    the tool runs, `r` resumes it."""
    api = fake_api([api_calls("add", a=2, b=3), says("It is 5.")])
    term = terminal(
        *run_args(api, "agentfsm.cli.demo_tools:add"), "--break", "function_call"
    )
    term.expect(re.escape("at breakpoint before function_call"))
    term.expect(re.escape("[r]esume or [a]bort? "))
    assert len(api.requests) == 1
    term.type("r\n")
    term.expect(r"add -> 5")
    term.expect("outcome: answered")
    assert term.wait() == 0
