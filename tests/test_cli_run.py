"""`agentfsm run`: tools from the command line, the display, errors (no model needed)."""

from __future__ import annotations

import argparse
import io
import re
import sys
from pathlib import Path

import pytest
import structlog

from agentfsm import (
    AgentEventAdapter,
    ConfigurationError,
    FunctionProvider,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    Runtime,
    TokenUsage,
    Tool,
)
from agentfsm.cli import main
from agentfsm.cli import run as run_command
from agentfsm.cli.run import (
    _request,
    _watch,
    load_tool,
)
from agentfsm.demo_tools import add
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
        assert load_tool("agentfsm.demo_tools:add") is add

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
            pytest.param("agentfsm.demo_tools:nope", "has no 'nope'", id="no-attr"),
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
        assert main(["run", "hi", "--tool", "agentfsm.demo_tools:nope"]) == 2
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
