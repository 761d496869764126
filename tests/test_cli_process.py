"""The `agentfsm` command in a subprocess, against a fake OpenAI-compatible server.

The command runs from a launcher outside the working directory, as the
`agentfsm` console script does (its `sys.path` starts with the script's own
directory, not the current one), so `--tool mytools:fn` is tested as users run it.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import agentfsm
from tests.test_provider_openai import chunk, completion_body

Answer = Callable[[BaseHTTPRequestHandler], None]


class FakeAPI(ThreadingHTTPServer):
    """Serves canned answers in order; records each request's path, key and body."""

    daemon_threads = True

    def __init__(self, answers: list[Answer]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answers = answers
        self.requests: list[tuple[str, str | None, dict[str, Any]]] = []
        self.release = threading.Event()
        """Set when the test ends: a hanging answer returns."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: FakeAPI

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, self.headers["Authorization"], body))
        self.server.answers.pop(0)(self)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # not to the test's stderr


def json_answer(body: dict[str, Any]) -> Answer:
    def answer(handler: BaseHTTPRequestHandler) -> None:
        data = json.dumps(body).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    return answer


def hanging_stream(*texts: str) -> Answer:
    """Streams `texts` as chunks, then sends nothing more until the test ends."""

    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream")
        handler.end_headers()
        for text in texts:
            data = json.dumps(chunk({"role": "assistant", "content": text}))
            handler.wfile.write(f"data: {data}\n\n".encode())
        handler.wfile.flush()
        handler.server.release.wait(30)  # type: ignore[attr-defined]

    return answer


@pytest.fixture
def fake_api() -> Iterator[Callable[[list[Answer]], FakeAPI]]:
    servers: list[FakeAPI] = []

    def serve(answers: list[Answer]) -> FakeAPI:
        server = FakeAPI(answers)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield serve
    for server in servers:
        server.release.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def command(tmp_path: Path) -> Callable[..., list[str]]:
    """`agentfsm ARGS` as the console script runs it, from a launcher in bin/."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "agentfsm"
    launcher.write_text(
        "import sys\nfrom agentfsm.cli import main\nsys.exit(main())\n",
        encoding="utf-8",
    )

    def command(*args: str) -> list[str]:
        return [sys.executable, str(launcher), *args]

    return command


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        env.pop(name, None)
    return env


def test_version(command: Callable[..., list[str]]) -> None:
    """`agentfsm --version` prints the package's version."""
    done = subprocess.run(
        command("--version"),
        check=False,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=30,
    )
    assert (done.returncode, done.stdout) == (0, f"agentfsm {agentfsm.__version__}\n")


def test_a_tool_from_the_current_directory_on_a_given_server(
    command: Callable[..., list[str]],
    fake_api: Callable[[list[Answer]], FakeAPI],
    tmp_path: Path,
) -> None:
    """`--tool mytools:double` finds mytools.py here; `--base-url`/`--api-key` are used."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "mytools.py").write_text(
        "def double(n: int) -> int:\n    'Double a number.'\n    return 2 * n\n",
        encoding="utf-8",
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "double", "arguments": '{"n": 21}'},
    }
    api = fake_api(
        [
            json_answer(completion_body({"content": None, "tool_calls": [call]})),
            json_answer(completion_body({"content": "It is 42."})),
        ]
    )
    done = subprocess.run(
        command(
            "run",
            "Double 21.",
            "--model",
            "openai-chat:fake",
            "--tool",
            "mytools:double",
            "--base-url",
            api.base_url,
            "--api-key",
            "sk-cli-test",
            "--no-stream",
        ),
        check=False,
        cwd=work,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "  double -> 42" in done.stdout
    assert "model: It is 42." in done.stdout
    assert "outcome: answered" in done.stdout
    assert done.stderr == ""
    (path, key, first), (_, _, second) = api.requests
    assert (path, key) == ("/v1/chat/completions", "Bearer sk-cli-test")
    assert [t["function"]["name"] for t in first["tools"]] == ["double"]
    assert second["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": "42",
    }


def test_base_url_is_refused_for_local_models(
    command: Callable[..., list[str]],
) -> None:
    done = subprocess.run(
        command("run", "hi", "--model", "local:x", "--base-url", "http://x"),
        check=False,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == (
        "error: --base-url and --api-key apply to openai:, openai-chat: and "
        "anthropic: models, not 'local:x'\n"
    )


def test_ctrl_c_ends_the_line_and_sums_up(
    command: Callable[..., list[str]], fake_api: Callable[[list[Answer]], FakeAPI]
) -> None:
    """Interrupted mid-answer, the command ends the line, tells how far it got, exits 130."""
    api = fake_api([hanging_stream("Hello", " there")])
    with subprocess.Popen(
        command("run", "hi", "--model", "openai-chat:fake", "--base-url", api.base_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    ) as proc:
        seen: queue.Queue[str] = queue.Queue()

        def read() -> None:
            assert proc.stdout is not None
            while char := proc.stdout.read(1):
                seen.put(char)
            seen.put("")  # the end

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        text = ""
        try:
            while not text.endswith("model: Hello there"):
                text += seen.get(timeout=30)  # the streamed answer, so far
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=30)
        finally:
            proc.kill()
        while char := seen.get(timeout=10):
            text += char
        reader.join(timeout=10)
        assert proc.stderr is not None
        err = proc.stderr.read()
    assert code == 130, err
    assert text.endswith(
        "model: Hello there\n"
        "\ninterrupted in inference_streaming\n"
        "path: idle -> context_update -> inference_streaming\n"
        "tokens: unknown (not reported), and 0 tool call(s), so far\n"
    ), text
    assert err.strip().endswith("interrupted"), err
