"""`agentfsm run` at a terminal: pauses answered at the prompt, the spinner,
Ctrl-C; and without one, the pause reported with exit code 3.

The command runs in a subprocess on a pseudo-terminal (its controlling
terminal, so Ctrl-C typed there reaches it as SIGINT, as in a shell), against a
fake OpenAI-compatible server. Every wait is for what the command prints, with
a generous bound that only guards against a hang.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_cli_process import Answer, FakeAPI, _env, fake_api, json_answer
from tests.test_provider_openai import completion_body

if sys.platform == "win32":  # pragma: no cover
    pytest.skip("pseudo-terminals are POSIX", allow_module_level=True)

import pty

__all__ = ("fake_api",)  # the fixture, shared with tests/test_cli_process.py

HANG = 20.0
"""Seconds a process may take to exit after Ctrl-C: a hang guard, not a speed test."""

TOOLS = '''\
import time

import anyio

from agentfsm import report_progress, tool


@tool(needs_approval=True)
def send(to: str, body: str) -> str:
    """Send a message."""
    return f"sent to {to}: {body}"


@tool(timeout=None)
def slow(seconds: int) -> str:
    """Sleep, whatever happens (a sync tool that never checks for a cancel)."""
    report_progress("sleeping")
    time.sleep(seconds)
    return "slept"


@tool(timeout=None)
async def stubborn(seconds: int) -> str:
    """Sleep, shielded from any cancel (an async tool's long cleanup)."""
    report_progress("shielded")
    with anyio.CancelScope(shield=True):
        await anyio.sleep(seconds)
    return "done"


@tool(timeout=None)
def gated(path: str) -> str:
    """Report progress, then wait for a line on the named pipe `path`."""
    report_progress({"step": 1, "of": 2})
    with open(path, encoding="utf-8") as pipe:
        return pipe.readline().strip()


@tool
def steps() -> str:
    """Report progress and return."""
    report_progress("half way")
    return "done"
'''

# Run as the console script is; as the session leader, it makes the terminal
# it was given its controlling one (what a shell does for the commands it runs).
LAUNCHER = """\
import fcntl, sys, termios
fcntl.ioctl(0, termios.TIOCSCTTY, 0)
from agentfsm.cli import main
sys.exit(main())
"""


class Terminal:
    """A command on a pseudo-terminal: what it printed, and keys typed to it."""

    def __init__(self, argv: list[str], *, cwd: Path) -> None:
        master, slave = pty.openpty()
        self.process = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            cwd=cwd,
            env=_env(),
            start_new_session=True,
        )
        os.close(slave)  # the child's only: the end of its output reads as EOF
        self._fd = master
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        """Everything the command printed so far (and the terminal echoed)."""
        self._seen = 0
        self._ended = False

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self._fd], [], [], max(timeout, 0))
        if not ready:
            return
        try:
            data = os.read(self._fd, 4096)
        except OSError:  # EIO: every end of the terminal's child side closed
            data = b""
        if not data:
            self._ended = True
        self.text += self._decoder.decode(data, final=not data)

    def expect(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        """Wait until the command prints `pattern` (a regex) after the last match."""
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while (found := regex.search(self.text, self._seen)) is None:
            if self._ended or time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not printed; printed:\n{self.text}")
            self._read(deadline - time.monotonic())
        self._seen = found.end()
        return found

    def type(self, keys: str) -> None:
        """Type `keys` at the terminal."""
        os.write(self._fd, keys.encode())

    def wait(self, timeout: float = 60) -> int:
        """The exit code, once the command has exited (all it printed read)."""
        deadline = time.monotonic() + timeout
        while not self._ended:
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {timeout}s:\n{self.text}")
            self._read(deadline - time.monotonic())
        return self.process.wait(timeout=max(deadline - time.monotonic(), 1))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        os.close(self._fd)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A working directory with the tools module, `clitools.py`."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "clitools.py").write_text(TOOLS, encoding="utf-8")
    return work


@pytest.fixture
def agentfsm(tmp_path: Path) -> Callable[..., list[str]]:
    """`agentfsm ARGS`, launched as a terminal's command."""
    launcher = tmp_path / "launch_on_terminal.py"
    launcher.write_text(LAUNCHER, encoding="utf-8")
    return lambda *args: [sys.executable, str(launcher), *args]


@pytest.fixture
def terminal(
    agentfsm: Callable[..., list[str]], work: Path
) -> Iterator[Callable[..., Terminal]]:
    """Start `agentfsm ARGS` on a terminal of its own."""
    started: list[Terminal] = []

    def start(*args: str) -> Terminal:
        started.append(Terminal(agentfsm(*args), cwd=work))
        return started[-1]

    yield start
    for term in started:
        term.close()


def calls(name: str, **arguments: Any) -> Answer:
    """The model's answer: one call of `name`."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
    return json_answer(completion_body({"content": None, "tool_calls": [call]}))


def says(text: str) -> Answer:
    """The model's answer: `text`."""
    return json_answer(completion_body({"content": text}))


def run_args(api: FakeAPI, *tools: str) -> list[str]:
    """`run` on the fake server, offering `tools` from clitools.py."""
    args = ["run", "Do it.", "--model", "openai-chat:fake"]
    args += ["--base-url", api.base_url, "--no-stream"]
    for name in tools:
        args += ["--tool", name if ":" in name else f"clitools:{name}"]
    return args


def tool_output(api: FakeAPI) -> str:
    """What the model was told the call returned (its last request's tool message)."""
    message = api.requests[-1][2]["messages"][-1]
    assert message["role"] == "tool"
    output: str = message["content"]
    return output


class TestApprovalPrompt:
    def test_approve_a_demo_tool(
        self,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """`--needs-approval add` asks before the demo tool runs; `y` runs it."""
        api = fake_api([calls("add", a=2, b=3), says("It is 5.")])
        args = run_args(api, "agentfsm.cli.demo_tools:add")
        term = terminal(*args, "--needs-approval", "add")
        term.expect(r"paused before call_tools: approval required: add")
        term.expect(re.escape('approve add({"a": 2, "b": 3})? [y]es, [n]o, [e]dit'))
        assert len(api.requests) == 1  # nothing ran yet
        term.type("y\n")
        term.expect(r"add -> 5 \(\d+ ms\)")
        term.expect("outcome: answered")
        assert term.wait() == 0
        assert tool_output(api) == "5"

    def test_deny_with_a_reason(
        self,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """A denied call does not run; the model reads the reason given."""
        api = fake_api([calls("send", to="ada", body="hi"), says("Not sent.")])
        term = terminal(*run_args(api, "send"))
        term.expect(re.escape("approve send("))
        term.type("n\n")
        term.expect(re.escape("why not? (the model reads it"))
        term.type("not to Ada, not today\n")
        term.expect("outcome: answered")
        assert term.wait() == 0
        assert "not to Ada, not today" in tool_output(api)
        assert "sent to" not in term.text  # the tool never ran

    def test_edit_the_arguments(
        self,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """Edited arguments are checked (re-asked until valid) and the tool
        runs with them."""
        api = fake_api([calls("send", to="ada", body="hi"), says("Sent to Bob.")])
        term = terminal(*run_args(api, "send"))
        term.expect(re.escape("approve send("))
        term.type("e\n")
        term.expect(re.escape("arguments for send as a JSON object"))
        term.type("{oops\n")
        term.expect("not JSON")
        term.type('{"to": 5}\n')
        term.expect(r"invalid arguments for tool 'send': to: .*; body: Field required")
        term.type('["bob"]\n')
        term.expect("not a JSON object")
        term.type('{"to": "bob", "body": "bye"}\n')
        term.expect(re.escape('send runs with {"to":"bob","body":"bye"}'))
        term.expect(re.escape("send -> sent to bob: bye"))
        term.expect("outcome: answered")
        assert term.wait() == 0
        assert tool_output(api) == "sent to bob: bye"

    def test_an_answer_not_offered_is_asked_again(
        self,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        api = fake_api([calls("send", to="ada", body="hi"), says("Sent.")])
        term = terminal(*run_args(api, "send"))
        term.expect(re.escape("approve send("))
        term.type("maybe\n")
        term.expect("answer y, n or e")
        term.expect(re.escape("approve send("))
        term.type("yes\n")
        term.expect("outcome: answered")
        assert term.wait() == 0
        assert tool_output(api) == "sent to ada: hi"

    def test_end_of_input_aborts(
        self,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """Ctrl-D at the prompt decides nothing: the loop is aborted, exit 1."""
        api = fake_api([calls("send", to="ada", body="hi")])
        term = terminal(*run_args(api, "send"))
        term.expect(re.escape("approve send("))
        term.type("\x04")
        term.expect("outcome: aborted")
        assert term.wait() == 1
        assert "no decision: the terminal's input ended" in term.text
        assert len(api.requests) == 1

    def test_ctrl_c_at_the_prompt_names_the_pause(
        self,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """Interrupted while it waits for a person, the command says so."""
        api = fake_api([calls("send", to="ada", body="hi")])
        term = terminal(*run_args(api, "send"))
        term.expect(re.escape("approve send("))
        term.type("\x03")
        term.expect(
            re.escape(
                "interrupted in inference, paused before call_tools "
                "(approval required: send)\r\n"
                "path: idle -> context_update -> inference\r\n"
            )
        )
        assert term.wait(HANG) == 130
        assert "Traceback" not in term.text


class TestWithoutATerminal:
    def run(
        self, work: Path, api: FakeAPI, *args: str
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentfsm", *run_args(api, "send"), *args],
            check=False,
            cwd=work,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
        )

    def test_the_pause_is_reported_with_exit_code_3(
        self, work: Path, fake_api: Callable[[list[Answer]], FakeAPI]
    ) -> None:
        api = fake_api([calls("send", to="ada", body="hi")])
        done = self.run(work, api)
        assert done.returncode == 3, done.stderr
        assert (
            "paused before call_tools: approval required: send\n"
            '  send({"to": "ada", "body": "hi"}) (needs approval)\n'
        ) in done.stdout
        assert re.match(
            r"error: loop \S+ paused \(approval required: send\), and there is no "
            r"terminal to ask",
            done.stderr,
        ), done.stderr
        assert "add --approve-all" in done.stderr
        assert "runtime.resume(loop_id, decision)" in done.stderr
        assert "sent to" not in done.stdout
        assert len(api.requests) == 1

    def test_approve_all(
        self, work: Path, fake_api: Callable[[list[Answer]], FakeAPI]
    ) -> None:
        api = fake_api([calls("send", to="ada", body="hi"), says("Sent.")])
        done = self.run(work, api, "--approve-all")
        assert done.returncode == 0, done.stderr
        assert "approved (--approve-all)" in done.stdout
        assert tool_output(api) == "sent to ada: hi"

    def test_progress_is_a_line(
        self, work: Path, fake_api: Callable[[list[Answer]], FakeAPI]
    ) -> None:
        """Without a terminal no spinner is drawn; progress is a line of its own."""
        api = fake_api([calls("steps"), says("Done.")])
        done = subprocess.run(
            [sys.executable, "-m", "agentfsm", *run_args(api, "steps")],
            check=False,
            cwd=work,
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "  call steps({})\n  steps: half way\n  steps -> done" in done.stdout
        assert "\r" not in done.stdout
        assert "running" not in done.stdout


def test_a_running_tool_shows_a_spinner_and_its_progress(
    terminal: Callable[..., Terminal],
    fake_api: Callable[[list[Answer]], FakeAPI],
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    api = fake_api([calls("gated", path=str(gate)), says("Done.")])
    term = terminal(*run_args(api, "gated"))
    term.expect(r'\r\x1b\[K[|/\\-] running gated \d+\.\ds: \{"step":1,"of":2\}')
    # Redrawn while it runs: the spinner's next frame.
    term.expect(r'\r\x1b\[K[|/\\-] running gated \d+\.\ds: \{"step":1,"of":2\}')
    with gate.open("w", encoding="utf-8") as pipe:
        pipe.write("open\n")
    term.expect(r"\r\x1b\[K  gated -> open \(\d+ ms\)\r\n")
    term.expect("outcome: answered")
    assert term.wait() == 0


class TestCtrlC:
    def test_a_sync_tool_does_not_hold_the_exit(
        self,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """Ctrl-C while a sync tool sleeps 60 s: the process exits without it."""
        api = fake_api([calls("slow", seconds=60)])
        term = terminal(*run_args(api, "slow"))
        term.expect("running slow .*: sleeping")
        term.type("\x03")
        assert term.wait(HANG) == 130
        term.expect(
            re.escape(
                "interrupted in function_call\r\n"
                "path: idle -> context_update -> inference -> function_call\r\n"
            )
        )
        term.expect(r"interrupted\r\n$")
        assert "Traceback" not in term.text

    def test_a_second_ctrl_c_exits_at_once(
        self,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """While stopping waits (on a tool that shields itself from the cancel
        for 600 s), a second Ctrl-C ends the process."""
        api = fake_api([calls("stubborn", seconds=600)])
        term = terminal(*run_args(api, "stubborn"))
        term.expect("running stubborn .*: shielded")
        term.type("\x03")
        term.expect(re.escape("interrupted in function_call\r\n"))
        term.type("\x03")
        assert term.wait(HANG) == 130
        assert "Traceback" not in term.text


# ------------------------------------------------------- issue 27, review fixes

LEFT_BEHIND = '''

@tool(timeout=1)
def stuck() -> str:
    """Block for good, past the timeout (a sync tool that cannot be stopped)."""
    threading.Event().wait()
    return "never"


@tool(timeout=None)
async def blocker(path: str) -> str:
    """Block the event loop until a line comes on the named pipe `path`."""
    report_progress("blocking")
    with open(path, encoding="utf-8") as pipe:
        return pipe.readline().strip()
'''


@pytest.fixture
def more_tools(work: Path) -> Path:
    """clitools.py with `stuck` and `blocker` too."""
    module = work / "clitools.py"
    module.write_text("import threading\n" + TOOLS + LEFT_BEHIND, encoding="utf-8")
    return work


class TestExit:
    def test_a_tool_thread_left_running_does_not_hold_a_normal_exit(
        self,
        more_tools: Path,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """A sync tool past its timeout, blocked for good: the loop answers,
        and the process exits 0 without waiting for the thread."""
        api = fake_api([calls("stuck"), says("done")])
        term = terminal(*run_args(api, "stuck"))
        term.expect("outcome: answered")
        assert term.wait(HANG) == 0
        assert "Traceback" not in term.text

    def test_ctrl_c_while_the_local_model_loads(
        self, tmp_path: Path, work: Path
    ) -> None:
        """The load (blocked for good here) is abandoned: exit 130 at once."""
        model = tmp_path / "model.gguf"
        model.write_bytes(b"x" * 1000)
        launcher = tmp_path / "launch_loading.py"
        launcher.write_text(
            "import threading\n"
            "import agentfsm.providers.local as local\n"
            "local._load = lambda *args: threading.Event().wait()\n" + LAUNCHER,
            encoding="utf-8",
        )
        term = Terminal(
            [sys.executable, str(launcher), "run", "hi", "--model", f"local:{model}"],
            cwd=work,
        )
        try:
            term.expect("loading")
            term.type("\x03")
            assert term.wait(HANG) == 130
            term.expect(r"interrupted\r\n$")
            assert "Traceback" not in term.text
        finally:
            term.close()

    def test_the_first_ctrl_c_is_told_while_the_event_loop_is_blocked(
        self,
        more_tools: Path,
        tmp_path: Path,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """An async tool blocks the event loop: Ctrl-C is answered at once,
        from the signal handler; the run stops once the tool returns."""
        pipe = tmp_path / "gate"
        os.mkfifo(pipe)
        api = fake_api([calls("blocker", path=str(pipe)), says("done")])
        term = terminal(*run_args(api, "blocker"))
        # Opened once the tool opens it to read, and blocks the event loop:
        # nothing the run's tasks print (not even the call) is shown after.
        with open(pipe, "w", encoding="utf-8") as gate:
            term.type("\x03")
            term.expect(re.escape("interrupted: stopping the loop"))
            gate.write("go\n")
        assert term.wait(HANG) == 130
        assert "Traceback" not in term.text

    def test_an_interrupted_request_counts_its_tokens_as_unknown(
        self,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """Ctrl-C mid-stream: the request in flight reported no usage, so
        the tokens are unknown, as the summary of an ended loop says."""
        from tests.test_cli_process import hanging_stream

        api = fake_api([hanging_stream("Hello", " wor")])
        term = terminal(
            "run", "Do it.", "--model", "openai-chat:fake", "--base-url", api.base_url
        )
        term.expect("wor")
        term.type("\x03")
        assert term.wait(HANG) == 130
        api.release.set()
        term.expect(re.escape("tokens: unknown (not reported), and 0 tool call(s)"))

    def test_ctrl_c_on_loops_with_a_server_that_does_not_answer(
        self, terminal: Callable[..., Terminal]
    ) -> None:
        """A PostgreSQL address that accepts and never answers: Ctrl-C ends
        `loops` at once, 130, no traceback."""
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            port = server.getsockname()[1]
            term = terminal("loops", f"postgresql://u:secret@127.0.0.1:{port}/db")
            connection, _ = server.accept()  # the command is connecting
            with connection:
                term.type("\x03")
                assert term.wait(HANG) == 130
        term.expect(r"interrupted\r\n")
        assert "Traceback" not in term.text


class TestPromptInput:
    def test_bytes_that_are_not_utf8_are_asked_again(
        self,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        api = fake_api([calls("send", to="a", body="b"), says("done")])
        term = terminal(*run_args(api, "send"))
        term.expect(r"\[e\]dit the arguments: ")
        os.write(term._fd, b"n\n")
        term.expect(r"Enter for no reason\): ")
        os.write(term._fd, b"bad \xff byte\n")
        term.expect(re.escape("not UTF-8 (byte 0xff at 4): type it again"))
        term.expect(r"Enter for no reason\): ")
        term.type("too risky\n")
        assert term.wait(HANG) == 0
        assert "too risky" in tool_output(api)
        assert "Traceback" not in term.text

    def test_arguments_the_loop_could_not_parse_are_refused(
        self,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """A lone surrogate's escape is JSON to `json`, not to the loop's
        parser: refused at the prompt, not failing the call after."""
        api = fake_api([calls("send", to="a", body="b"), says("done")])
        term = terminal(*run_args(api, "send"))
        term.expect(r"\[e\]dit the arguments: ")
        term.type("e\n")
        term.expect(r"Enter to go back\): ")
        term.type('{"to": "\\ud800", "body": "x"}\n')
        term.expect(r"  not JSON: .*\r\n")
        term.expect(r"Enter to go back\): ")
        term.type('{"to": "b", "body": "x"}\n')
        term.expect(re.escape('send runs with {"to":"b","body":"x"}'))
        assert term.wait(HANG) == 0
        assert tool_output(api) == "sent to b: x"

    def test_a_line_the_terminal_cut_is_told_and_a_file_read(
        self,
        work: Path,
        terminal: Callable[..., Terminal],
        fake_api: Callable[[list[Answer]], FakeAPI],
    ) -> None:
        """Past 4095 bytes the terminal drops what is typed: said so, and
        `@FILE` reads long arguments from a file."""
        api = fake_api([calls("send", to="a", body="b"), says("done")])
        term = terminal(*run_args(api, "send"))
        term.expect(r"\[e\]dit the arguments: ")
        term.type("e\n")
        term.expect(r"Enter to go back\): ")
        big = json.dumps({"to": "a", "body": "x" * 6000})
        for start in range(0, len(big), 512):  # as a paste arrives
            term.type(big[start : start + 512])
        term.type("\n")
        term.expect(re.escape("the terminal passes at most 4095 bytes a line"))
        term.expect(r"Enter to go back\): ")
        (work / "args.json").write_text(big, encoding="utf-8")
        term.type("@args.json\n")
        assert term.wait(HANG) == 0
        assert tool_output(api) == "sent to a: " + "x" * 6000
