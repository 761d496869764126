"""`agentfsm run`: tools from the command line, the display, errors (no model needed)."""

from __future__ import annotations

import argparse
import io
import re
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar

import anyio
import pytest
import structlog
from pydantic import BaseModel

from agentfsm import (
    AgentEventAdapter,
    ConfigurationError,
    FunctionProvider,
    InferenceInput,
    InferenceOutput,
    LoopResult,
    ModelContext,
    Pause,
    PendingTransition,
    Runtime,
    TokenUsage,
    Tool,
    ToolBatch,
    tool,
)
from agentfsm.cli import main
from agentfsm.cli import run as run_command
from agentfsm.cli._interrupt import Interrupts
from agentfsm.cli._pause import Ask, PauseDecider, unattended
from agentfsm.cli._view import RunView
from agentfsm.cli.demo_tools import add
from agentfsm.cli.run import (
    _interrupted,
    _request,
    _Unanswered,
    _watch,
    load_tool,
)
from agentfsm.events import (
    FunctionCallCompleted,
    FunctionCallProgress,
    FunctionCallStarted,
    LoopPaused,
    LoopResumed,
)
from agentfsm.messages import FunctionCallOutputItem
from agentfsm.providers.local import LocalProvider
from agentfsm.testing import ScriptedProvider, call, calls, text


def _args(*argv: str) -> argparse.Namespace:
    """The parsed arguments of `agentfsm run ...`."""
    parser = argparse.ArgumentParser()
    run_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


def plain(x: int) -> int:
    """Double a number."""
    return 2 * x


class TestLoadTool:
    def test_tool(self) -> None:
        """A `Tool` is taken as it is."""
        assert load_tool("agentfsm.cli.demo_tools:add") is add

    def test_function(self) -> None:
        """A typed function is made a tool."""
        loaded = load_tool(f"{__name__}:plain")
        assert isinstance(loaded, Tool)
        assert loaded.name == "plain"

    @pytest.mark.parametrize(
        ("spec", "message"),
        [
            pytest.param("add", "must be 'module:function'", id="no-colon"),
            pytest.param("nope.nope:add", "cannot import", id="no-module"),
            pytest.param("agentfsm.cli.demo_tools:nope", "has no 'nope'", id="no-attr"),
        ],
    )
    def test_errors(self, spec: str, message: str) -> None:
        """A bad spec says what is wrong."""
        with pytest.raises(ConfigurationError, match=message):
            load_tool(spec)


class TestRequest:
    def test_defaults(self) -> None:
        """The local model, streaming, a token limit and the default instructions."""
        request = _request(_args("hi"), [])
        assert request.model == "local:smollm2"
        assert request.streaming
        assert request.max_output_tokens == 256
        assert request.context.instructions

    def test_tool_choice_must_name_a_tool(self) -> None:
        """Forcing a tool that is not offered fails before anything runs."""
        with pytest.raises(ConfigurationError, match="names no tool offered"):
            _request(_args("hi", "--tool-choice", "add"), [])
        assert _request(_args("hi", "--tool-choice", "add"), [add]).tool_choice == "add"


@pytest.mark.parametrize("then", ["none", "auto"])
async def test_a_forced_tool_is_forced_once(then: str) -> None:
    """`--tool-choice add` forces `add` until it answered, then `--then-tool-choice`."""
    request = _request(
        _args("2+3?", "--tool-choice", "add", "--then-tool-choice", then), [add]
    )
    assert (request.tool_choice, request.reset_tool_choice) == ("add", then)
    script = ScriptedProvider([calls(call("add", a=2, b=3)), text("5")])
    sent: list[str | None] = []

    async def provider(request: InferenceInput) -> InferenceOutput:
        sent.append(request.effective_tool_choice)  # as a provider sends it, now
        return await script.complete(request)

    async with Runtime(providers={"s": FunctionProvider(provider)}) as runtime:
        loop_id = runtime.run_loop(
            "a", "2+3?", request.model_copy(update={"model": "s:m"})
        )
        assert (await runtime.wait(loop_id)).outcome == "answered"
    assert sent == ["add", then]


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "no-stream"])
async def test_display_and_event_file(streaming: bool, tmp_path: Path) -> None:
    """Transitions, tool calls and the answer are shown; `--events` logs every event."""
    provider = ScriptedProvider(
        [
            calls(call("add", a=2, b=3), usage=TokenUsage(input_tokens=9)),
            text("It is 5.", usage=TokenUsage(input_tokens=12, output_tokens=3)),
        ]
    )
    flag = "--stream" if streaming else "--no-stream"
    args = _args("2+3?", "--model", "s:m", "--tool-choice", "add", flag)
    request = _request(args, [add])
    out = io.StringIO()
    log = tmp_path / "events.jsonl"
    async with Runtime(providers={"s": provider}, event_log=log) as runtime:
        result = await _watch(runtime, args, request, out)
    assert result.outcome == "answered"
    shown = [re.sub(r"\(\d+ ms\)", "(N ms)", s) for s in out.getvalue().splitlines()]
    inference = "inference_streaming" if streaming else "inference"
    assert shown == [
        "[idle --start--> context_update]",
        f"[context_update --infer{'_streaming' * streaming}--> {inference}]",
        f"[{inference} --call_tools--> function_call]",
        '  call add({"a":2,"b":3})',
        "  add -> 5 (N ms)",
        f"[function_call --infer{'_streaming' * streaming}--> {inference}]",
        *(["model: It is 5."] if streaming else []),
        f"[{inference} --answer--> model_message]",
        *([] if streaming else ["model: It is 5."]),
        "[model_message --finish--> idle]",
    ]
    logged = [
        AgentEventAdapter.validate_json(line) for line in log.read_text().splitlines()
    ]
    assert [e.seq for e in logged] == list(range(1, len(logged) + 1))
    assert logged[-1].type == "loop.idle"


class TestExitCodes:
    def test_unknown_local_model(self, capsys: pytest.CaptureFixture[str]) -> None:
        """An unknown local model exits 2 and says what to use."""
        assert main(["run", "hi", "--model", "local:nope"]) == 2
        assert "unknown local model 'nope'" in capsys.readouterr().err

    def test_unknown_prefix(self, capsys: pytest.CaptureFixture[str]) -> None:
        """A model no provider serves exits 2, naming the known prefixes."""
        assert main(["run", "hi", "--model", "nope:x"]) == 2
        assert "prefix 'nope' is not registered" in capsys.readouterr().err

    def test_bad_tool(self, capsys: pytest.CaptureFixture[str]) -> None:
        """A tool that cannot be loaded exits 2."""
        assert main(["run", "hi", "--tool", "agentfsm.cli.demo_tools:nope"]) == 2
        assert "has no 'nope'" in capsys.readouterr().err

    def test_missing_extra(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        """Without llama-cpp-python the error says how to install it."""
        monkeypatch.setitem(sys.modules, "llama_cpp", None)
        model = tmp_path / "any.gguf"
        model.write_bytes(b"GGUF")
        assert main(["run", "hi", "--model", f"local:{model}"]) == 2
        err = capsys.readouterr().err
        assert "local models need llama-cpp-python" in err
        assert "make .venv/.local-installed" in err


async def test_missing_extra_fails_the_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request to a local model without llama-cpp-python fails with the hint."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    model = tmp_path / "any.gguf"
    model.write_bytes(b"GGUF")
    request = InferenceInput(model=f"local:{model}", context=ModelContext())
    with pytest.raises(ConfigurationError, match="CMAKE_ARGS"):
        await LocalProvider().complete(request)


def test_run_restores_logging_config() -> None:
    """The command quiets structlog for its run only."""
    before = structlog.get_config()
    assert main(["run", "hi", "--model", "nope:x"]) == 2
    assert structlog.get_config() == before


class TestQuestion:
    @pytest.mark.parametrize("question", ["", "  \n\t"], ids=["empty", "blank"])
    def test_an_empty_question_is_refused(
        self, question: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """No model or server is started for an empty message."""
        assert main(["run", question, "--model", "nope:x"]) == 2
        assert capsys.readouterr().err.startswith("error: the question is empty")


class TestDeadMCPServer:
    """A dead `--mcp` server fails the command before a local model loads."""

    @pytest.fixture
    def loads(self, monkeypatch: pytest.MonkeyPatch) -> list[str]:
        loaded: list[str] = []

        async def load(self: LocalProvider, model: str) -> None:
            loaded.append(model)

        monkeypatch.setattr(LocalProvider, "load", load)
        return loaded

    def test_a_command_that_exits(
        self, loads: list[str], capsys: pytest.CaptureFixture[str]
    ) -> None:
        server = f"{sys.executable} -c pass"
        assert main(["run", "hi", "--model", "local:smollm2", "--mcp", server]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --mcp: cannot connect to MCP server"), err
        assert Path(sys.executable).name in err  # the server, by its label
        assert loads == []

    def test_a_url_that_refuses(
        self, loads: list[str], capsys: pytest.CaptureFixture[str]
    ) -> None:
        # A port held bound but not listening: it refuses, and nothing else
        # can take it meanwhile.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            url = f"http://127.0.0.1:{port}/mcp"
            assert main(["run", "hi", "--model", "local:smollm2", "--mcp", url]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"error: --mcp: cannot connect to MCP server 127.0.0.1:{port}"
        ), err
        assert loads == []


@tool(needs_approval=True)
def send(to: str, body: str) -> str:
    """Send a message."""
    return f"sent to {to}: {body}"


def scripted(*answers: str | None) -> tuple[Ask, list[str]]:
    """An `Ask` giving `answers` in order, and the questions it was asked."""
    asked: list[str] = []
    left = list(answers)

    async def ask(question: str) -> str | None:
        asked.append(question)
        return left.pop(0)

    return ask, asked


async def run_paused(
    pauses: Callable[[TextIO], PauseDecider], *, then: str = "Done."
) -> tuple[LoopResult, str, list[str]]:
    """Run a loop whose model calls `send`, answering its pause with `pauses`:
    its result, what was shown, and the tool outputs the model read."""
    script = ScriptedProvider(
        [calls(call("send", call_id="c1", to="ada", body="hi")), text(then)]
    )
    args = _args("Send hi to Ada.", "--model", "s:m")
    out = io.StringIO()
    async with Runtime(providers={"s": script}) as runtime:
        result = await _watch(
            runtime, args, _request(args, [send]), out, pauses=pauses(out)
        )
    outputs = [
        item.output
        for item in script.requests[-1].context.items
        if isinstance(item, FunctionCallOutputItem)
    ]
    return result, out.getvalue(), outputs


class TestPauseDecider:
    """The prompt's answers, applied to a real paused loop."""

    async def test_approve(self) -> None:
        ask, asked = scripted("y")
        result, _, outputs = await run_paused(
            lambda out: PauseDecider({"send": send}, ask=ask, out=out)
        )
        assert result.outcome == "answered"
        assert outputs == ["sent to ada: hi"]
        assert asked == [
            'approve send({"to":"ada","body":"hi"})? [y]es, [n]o, [e]dit the arguments: '
        ]

    async def test_deny_with_a_reason(self) -> None:
        ask, _ = scripted("no", "  not today ")
        result, _, outputs = await run_paused(
            lambda out: PauseDecider({"send": send}, ask=ask, out=out)
        )
        assert result.outcome == "answered"
        assert len(outputs) == 1
        assert "not today" in outputs[0]
        assert "sent to" not in outputs[0]

    async def test_deny_without_a_reason(self) -> None:
        ask, _ = scripted("n", "")
        _, _, outputs = await run_paused(
            lambda out: PauseDecider({"send": send}, ask=ask, out=out)
        )
        assert "the user denied the call" in outputs[0]

    async def test_edit_until_valid(self) -> None:
        ask, asked = scripted(
            "?",
            "e",
            "",
            "e",
            "[1]",
            "{bad",
            '{"to": "bob"}',
            '{"to":"bob","body":"bye"}',
        )
        result, shown, outputs = await run_paused(
            lambda out: PauseDecider({"send": send}, ask=ask, out=out)
        )
        assert result.outcome == "answered"
        assert outputs == ["sent to bob: bye"]
        assert [q.split(" ")[0] for q in asked] == [
            "approve",  # "?": not an answer
            "approve",
            "arguments",  # Enter: back to the question
            "approve",
            "arguments",  # a list
            "arguments",  # not JSON
            "arguments",  # no body
            "arguments",
        ]
        assert "  answer y, n or e\n" in shown
        assert "  not a JSON object: [1]\n" in shown
        assert "  not JSON: " in shown
        assert "body: Field required" in shown
        assert '  send runs with {"to":"bob","body":"bye"}\n' in shown

    async def test_end_of_input_aborts(self) -> None:
        ask, _ = scripted(None)
        result, _, _ = await run_paused(
            lambda out: PauseDecider({"send": send}, ask=ask, out=out)
        )
        assert (result.outcome, result.reason) == (
            "aborted",
            "no decision: the terminal's input ended",
        )

    async def test_approve_all_asks_nothing(self) -> None:
        ask, asked = scripted()
        result, shown, outputs = await run_paused(
            lambda out: PauseDecider({}, ask=ask, approve_all=True, out=out)
        )
        assert (result.outcome, outputs, asked) == ("answered", ["sent to ada: hi"], [])
        assert "approved (--approve-all)\n" in shown

    async def test_nobody_to_ask(self) -> None:
        """Without a terminal the loop is cancelled and `_watch` says why."""
        with pytest.raises(_Unanswered) as raised:
            await run_paused(lambda out: PauseDecider({}, ask=None, out=out))
        paused = raised.value.paused
        assert paused.status == "paused"
        message = unattended(paused)
        assert message.startswith(
            f"error: loop {paused.loop_id} paused (approval required: send)"
        )
        assert "--approve-all" in message

    @pytest.mark.parametrize(
        ("answers", "outcome"),
        [(["x", "r"], "answered"), (["abort"], "aborted")],
        ids=["resume", "abort"],
    )
    async def test_a_handler_pause(self, answers: list[str], outcome: str) -> None:
        """A pause that is no approval is resumed or aborted."""
        ask, asked = scripted(*answers)
        out = io.StringIO()
        pauses = PauseDecider({}, ask=ask, out=out)
        script = ScriptedProvider([text("Hello.")])

        def wait_here(pending: PendingTransition) -> Pause | None:
            return Pause("look first") if pending.trigger == "answer" else None

        async with Runtime(providers={"s": script}) as runtime:
            with runtime.bus.subscribe("loop.paused") as paused:
                loop_id = runtime.run_loop(
                    "a",
                    "hi",
                    InferenceInput(model="s:m", context=ModelContext()),
                    wait_here,
                )
                await paused.receive()
            decision = await pauses.decide(runtime.get(loop_id))
            assert decision is not None
            runtime.resume(loop_id, decision)
            assert (await runtime.wait(loop_id)).outcome == outcome
        assert out.getvalue().startswith("the loop paused: look first\n")
        assert asked[-1] == "[r]esume or [a]bort? "
        assert len(asked) == len(answers)


E = TypeVar("E", bound=BaseModel)


def event(kind: type[E], seq: int, state: str = "function_call", **fields: Any) -> E:
    """An event of loop `l`, numbered `seq`."""
    envelope = {"event_id": f"l:{seq}", "loop_id": "l", "agent_id": "a", "seq": seq}
    return kind.model_validate({**envelope, "state": state, **fields})


class TestRunView:
    def test_progress_without_a_terminal(self) -> None:
        """Each progress report is a line; no spinner, nothing rewritten."""
        out = io.StringIO()
        view = RunView(out)
        view.show(event(FunctionCallStarted, 1, call=call("fetch", "c1", url="x")))
        view.show(event(FunctionCallProgress, 2, call_id="c1", progress="half"))
        progress = {"done": 3, "of": 4}
        view.show(event(FunctionCallProgress, 3, call_id="c1", progress=progress))
        assert out.getvalue() == (
            '  call fetch({"url":"x"})\n  fetch: half\n  fetch: {"done":3,"of":4}\n'
        )

    def test_spinner_at_a_terminal(self) -> None:
        """A status line shows the running call and its progress, and is
        erased before the next line."""
        out = io.StringIO()
        view = RunView(out, live=True)
        view.show(event(FunctionCallStarted, 1, call=call("fetch", "c1")))
        assert out.getvalue() == "  call fetch({})\n"  # no spinner for a quick call
        view.show(event(FunctionCallProgress, 2, call_id="c1", progress="half"))
        assert re.fullmatch(
            r"  call fetch\(\{\}\)\n\r\x1b\[K\| running fetch \d+\.\ds: half",
            out.getvalue(),
        )
        drawn = len(out.getvalue())
        view.tick()  # what `spin` does every 0.1 s
        assert re.fullmatch(
            r"\r\x1b\[K/ running fetch \d+\.\ds: half", out.getvalue()[drawn:]
        )
        output = FunctionCallOutputItem(call_id="c1", output="ok")
        completed = event(
            FunctionCallCompleted,
            3,
            call=call("fetch", "c1"),
            output=output,
            duration=0.5,
        )
        view.show(completed)
        assert out.getvalue().endswith("\r\x1b[K  fetch -> ok (500 ms)\n")

    def test_pause_and_resume(self) -> None:
        out = io.StringIO()
        view = RunView(out)
        batch = ToolBatch(
            calls=(call("send", "c1", to="ada"), call("add", "c2", a=1)),
            awaiting_approval=("c1",),
        )
        paused = event(
            LoopPaused,
            1,
            "inference",
            source="inference",
            trigger="call_tools",
            dest="function_call",
            reason="approval required: send",
            payload=batch,
        )
        view.show(paused)
        view.show(event(LoopResumed, 2, "inference", decision="rewrite"))
        assert out.getvalue() == (
            "paused before call_tools: approval required: send\n"
            '  send({"to":"ada"}) (needs approval)\n'
            '  add({"a":1})\n'
            "[resumed: rewrite]\n"
        )


class TestInterrupts:
    async def test_the_first_interrupt_wakes_the_run(self) -> None:
        interrupts = Interrupts()
        assert not interrupts.interrupted
        with interrupts.installed(), anyio.fail_after(10):  # a hang guard
            interrupts.interrupt()
            await interrupts.wait()
        assert interrupts.interrupted

    def test_installed_restores_the_handler(self) -> None:
        before = signal.getsignal(signal.SIGINT)
        with Interrupts().installed():
            assert signal.getsignal(signal.SIGINT) is not before
        assert signal.getsignal(signal.SIGINT) is before

    def test_where_the_loop_was(self) -> None:
        out = io.StringIO()
        _interrupted(None, out)
        assert out.getvalue() == "\ninterrupted before the loop started\n"


def test_needs_approval_must_name_a_tool(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", "hi", "--model", "nope:x", "--tool", "agentfsm.cli.demo_tools:add"]
    assert main([*args, "--needs-approval", "sub"]) == 2
    assert "--needs-approval 'sub' names no tool offered (offered: add)" in (
        capsys.readouterr().err
    )


def test_needs_approval_marks_a_copy() -> None:
    """The module's tool is left as it is: others import it too."""
    request = _request(_args("hi", "--needs-approval", "add"), [add])
    (marked,) = request.tools
    assert marked.needs_approval is True
    assert marked is not add
    assert add.needs_approval is False
