"""End to end, real: SmolLM2 through llama.cpp's server, in process, and on the CLI.

- `python -m llama_cpp.server` serves the model on 127.0.0.1 (one server for
  the module); loops run through `OpenAIChatProvider` and the real openai SDK.
- The same loops run in process through `LocalProvider` (one model load for
  the session: loaded models are cached per process).
- `agentfsm run` runs in a subprocess on the local model.

SmolLM2-135M makes valid tool calls when the tool is forced (they are generated
under a grammar built from the tool's schema) but does not use tool results
well: the tests assert the structure of what happened, never what the model
said. They skip only when the local extra is missing and `CI` is unset.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anyio
import httpx2
import pytest
from pydantic import BaseModel

from agentfsm import (
    AgentEventAdapter,
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    LoopResult,
    ModelContext,
    ModelMessageItem,
    Provider,
    Runtime,
    UserMessage,
)
from agentfsm.cli.demo_tools import add
from agentfsm.cli.run import DEFAULT_INSTRUCTIONS
from agentfsm.events import InferenceCompleted, InferenceStream, LoopIdle
from agentfsm.providers import TextDelta
from agentfsm.providers.local import LocalProvider, smollm2_path
from agentfsm.testing import EventRecorder

from .local_extra import requires_local

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300), requires_local]

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 64
QUESTION = "What is 2 + 3?"


def _path(*, streaming: bool) -> tuple[str, ...]:
    inference = "inference_streaming" if streaming else "inference"
    return (
        "idle",
        "context_update",
        inference,
        "function_call",
        inference,
        "model_message",
        "idle",
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama.cpp's OpenAI-compatible server with SmolLM2, for the whole module."""
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(smollm2_path()),
        "--chat_format",
        "chatml-function-calling",
        "--n_ctx",
        "4096",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    # The server logs a lot: to a file, since a pipe nobody reads would fill
    # up and stall it.
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    url = f"http://127.0.0.1:{port}/v1"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 120
            while not _answers(f"{url}/models"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"llama_cpp.server did not start (exit code {proc.poll()}); "
                        f"its log:\n{log_path.read_text(errors='replace')[-3000:]}"
                    )
                time.sleep(0.2)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx2.get(url, timeout=1).status_code == 200
    except httpx2.TransportError:
        return False


def _request(*, streaming: bool) -> InferenceInput:
    return InferenceInput(
        model="e2e:smollm2",
        context=ModelContext(instructions=DEFAULT_INSTRUCTIONS),
        tools=(add,),
        tool_choice="add",
        reset_tool_choice="none",
        streaming=streaming,
        max_output_tokens=MAX_TOKENS,
    )


async def _run_forced(
    provider: Provider, request: InferenceInput
) -> tuple[LoopResult, list[str]]:
    """One loop with `add` forced until it answered; the result and the kinds of
    the stream deltas published."""
    async with Runtime(providers={"e2e": provider}) as runtime:
        recorder = EventRecorder(runtime.bus)
        loop_id = runtime.run_loop(
            "e2e",
            QUESTION,
            request,
            max_turns=4,
        )
        with anyio.fail_after(240):
            result = await runtime.wait(loop_id)
        kinds: list[str] = [
            e.delta.kind for e in recorder.events if isinstance(e, InferenceStream)
        ]
        recorder.close()
    return result, kinds


def _assert_forced_loop(
    result: LoopResult, request: InferenceInput, kinds: list[str]
) -> None:
    """Path, one call with valid JSON arguments, its output, an answer, the deltas."""
    assert result.outcome == "answered", (result.outcome, result.reason, result.error)
    assert result.states == _path(streaming=request.streaming)
    assert (result.model_requests, result.tool_calls) == (2, 1)
    assert isinstance(result.answer, ModelMessageItem)
    calls = [i for i in request.context.items if isinstance(i, FunctionCallItem)]
    outputs = [
        i for i in request.context.items if isinstance(i, FunctionCallOutputItem)
    ]
    assert [c.name for c in calls] == ["add"]
    arguments = json.loads(calls[0].arguments)
    assert isinstance(arguments, dict)
    assert set(arguments) == {"a", "b"}
    assert [(o.call_id, o.is_error) for o in outputs] == [(calls[0].call_id, False)]
    assert outputs[0].output == str(arguments["a"] + arguments["b"])
    if request.streaming:
        assert kinds.count("tool_call") > 1  # the id and name, then the arguments
    else:
        assert kinds == []


# asyncio only: on trio, the openai SDK leaves the async generator of httpx2's
# response body unexhausted at the end of an SSE stream (even once the stream
# is closed), and trio reports it as a ResourceWarning when it is collected.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_openai_chat_provider_on_llama_server(
    server_url: str, streaming: bool
) -> None:
    """Chat Completions through the real openai SDK: a forced call, then an answer."""
    from agentfsm.providers.openai import OpenAIChatProvider

    request = _request(streaming=streaming)
    async with OpenAIChatProvider(base_url=server_url, api_key="local") as provider:
        result, kinds = await _run_forced(provider, request)
    _assert_forced_loop(result, request, kinds)
    if not streaming:  # llama.cpp's server sends no usage in streams
        assert result.usage.input_tokens > 0
        assert result.usage.output_tokens > 0


@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_local_provider_in_process(streaming: bool) -> None:
    """The same loop in process through LocalProvider, with usage counted."""
    request = _request(streaming=streaming)
    result, kinds = await _run_forced(LocalProvider(), request)
    _assert_forced_loop(result, request, kinds)
    assert result.usage.input_tokens > 0
    assert result.usage.output_tokens > 0


async def test_local_provider_cuts_at_max_tokens() -> None:
    """A long answer stops at `max_output_tokens`, with finish reason `length`."""
    context = ModelContext()
    context.append(UserMessage(content="Write a long story about a cat."))
    request = InferenceInput(
        model="local:smollm2", context=context, max_output_tokens=8
    )
    output = await LocalProvider().complete(request)
    assert output.finish_reason == "length"
    assert output.token_usage is not None
    assert output.token_usage.output_tokens == 8


def test_agentfsm_run(tmp_path: Path) -> None:
    """`agentfsm run` on the local model: exit 0, streamed answer, path and tokens."""
    events = tmp_path / "events.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentfsm",
            "run",
            QUESTION,
            "--tool",
            "agentfsm.cli.demo_tools:add",
            "--tool-choice",
            "add",
            "--max-output-tokens",
            str(MAX_TOKENS),
            "--events",
            str(events),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    assert "loaded in" in proc.stderr
    assert "[idle --start--> context_update]" in out
    assert "  call add(" in out
    assert "model: " in out
    assert f"path: {' -> '.join(_path(streaming=True))}" in out
    assert "tokens: " in out
    assert "outcome: answered" in out
    lines = events.read_text(encoding="utf-8").splitlines()
    logged = [AgentEventAdapter.validate_json(line) for line in lines]
    deltas = [e.delta.kind for e in logged if isinstance(e, InferenceStream)]
    assert "text" in deltas  # the answer was streamed
    assert isinstance(logged[-1], LoopIdle)
    assert logged[-1].outcome == "answered"
    assert [e.seq for e in logged] == list(range(1, len(logged) + 1))


def _long_request(max_tokens: int) -> InferenceInput:
    context = ModelContext()
    context.append(UserMessage(content="Write a long story about a cat."))
    return InferenceInput(
        model="local:smollm2", context=context, max_output_tokens=max_tokens
    )


async def test_leaving_a_stream_early_frees_the_model() -> None:
    """A consumer that leaves a stream stops its generation: the next request runs."""
    provider = LocalProvider()
    async with provider.stream(_long_request(400)) as events:
        async for event in events:
            assert isinstance(event, TextDelta)
            break
    with anyio.fail_after(20):
        output = await provider.complete(_long_request(4))
    assert output.finish_reason == "length"


async def test_cancelled_loop_frees_the_model() -> None:
    """Cancelling a loop mid-stream ends it `cancelled`; the model serves the next."""
    provider = LocalProvider()
    request = _long_request(400).model_copy(update={"streaming": True})
    async with Runtime(providers={"local": provider}) as runtime:
        with runtime.bus.subscribe("inference.stream") as chunks:
            loop_id = runtime.run_loop("e2e", None, request)
            with anyio.fail_after(60):
                await chunks.receive()
        runtime.cancel(loop_id, "enough")
        result = await runtime.wait(loop_id)
    assert result.outcome == "cancelled"
    with anyio.fail_after(20):
        output = await provider.complete(_long_request(4))
    assert output.finish_reason == "length"


class City(BaseModel):
    name: str
    population: int


async def test_local_structured_output() -> None:
    """A structured output is generated under its schema's grammar: it validates."""
    request = InferenceInput(
        model="local:smollm2",
        context=ModelContext(instructions="Answer in JSON."),
        structured_output=City,
        streaming=True,
        max_output_tokens=MAX_TOKENS,
    )
    async with Runtime(providers={"local": LocalProvider()}) as runtime:
        loop_id = runtime.run_loop(
            "e2e", "Which is the biggest city of France?", request
        )
        with anyio.fail_after(60):
            result = await runtime.wait(loop_id)
    assert result.outcome == "answered", (result.reason, result.error)
    assert isinstance(result.output, City)


class Capital(BaseModel):
    city: str
    country: str


CAPITAL_QUESTION = "What is the capital of France?"
StructuredMode = Literal["native", "tool", "prompted"] | None


async def _structured_loop(
    provider: Provider, request: InferenceInput, question: str
) -> tuple[LoopResult, list[StructuredMode]]:
    """One loop; its result and the structured output mode of each request."""
    async with Runtime(providers={"e2e": provider}) as runtime:
        recorder = EventRecorder(runtime.bus, "inference.completed")
        loop_id = runtime.run_loop("e2e", question, request, max_turns=4)
        with anyio.fail_after(240):
            result = await runtime.wait(loop_id)
        modes = [
            e.output.structured_output_mode
            for e in recorder.events
            if isinstance(e, InferenceCompleted)
        ]
        recorder.close()
    return result, modes


def _capital_request(*, streaming: bool = False, **fields: Any) -> InferenceInput:
    return InferenceInput(
        model="e2e:smollm2",
        context=ModelContext(),
        structured_output=Capital,
        streaming=streaming,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        **fields,
    )


# asyncio only, as above.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("streaming", [False, True], ids=["complete", "stream"])
async def test_structured_output_auto_on_llama_server(
    server_url: str, streaming: bool
) -> None:
    """`auto` on llama.cpp's server is the final tool, forced by name (a grammar):
    the answer validates, and the mode is published."""
    from agentfsm.providers.openai import OpenAIChatProvider

    request = _capital_request(streaming=streaming)
    async with OpenAIChatProvider(base_url=server_url, api_key="local") as provider:
        result, modes = await _structured_loop(provider, request, CAPITAL_QUESTION)
    assert result.outcome == "answered", (result.reason, result.error)
    assert isinstance(result.output, Capital)
    assert modes == ["tool"]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_structured_output_prompted_on_llama_server(server_url: str) -> None:
    """`prompted` sends `json_object` with the schema, which llama.cpp makes a grammar."""
    from agentfsm.providers.openai import OpenAIChatProvider

    request = _capital_request(structured_output_mode="prompted")
    async with OpenAIChatProvider(base_url=server_url, api_key="local") as provider:
        result, modes = await _structured_loop(provider, request, CAPITAL_QUESTION)
    assert result.outcome == "answered", (result.reason, result.error)
    assert isinstance(result.output, Capital)
    assert modes == ["prompted"]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_native_refused_by_llama_server_says_what_to_use(server_url: str) -> None:
    """llama.cpp's server refuses json_schema: one request, a short error naming the
    other modes (before: two retries and a 1 KB traceback)."""
    from openai import AsyncOpenAI

    from agentfsm.providers.openai import OpenAIChatProvider

    sent: list[str] = []

    async def count(request: httpx2.Request) -> None:
        sent.append(request.url.path)

    http = httpx2.AsyncClient(event_hooks={"request": [count]})
    client = AsyncOpenAI(
        base_url=server_url, api_key="local", http_client=http, max_retries=0
    )
    request = _capital_request(structured_output_mode="native")
    async with http:
        result, modes = await _structured_loop(
            OpenAIChatProvider(client=client), request, CAPITAL_QUESTION
        )
    assert result.outcome == "failed"
    assert result.error is not None
    assert result.error.message.startswith(
        "the server refused structured output mode 'native': try "
        "structured_output_mode='tool' or 'prompted'"
    )
    assert len(result.error.message) < 600
    assert sent == ["/v1/chat/completions"]
    assert modes == []


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_auto_beside_a_tool_falls_back_once_on_llama_server(
    server_url: str,
) -> None:
    """With a tool offered, the tool mode's `required` choice fails on llama.cpp's
    server (a 500 without a message): auto moves on to prompted, and the provider
    does not send the refused mode again."""
    from openai import AsyncOpenAI

    from agentfsm.providers.openai import OpenAIChatProvider

    sent: list[str] = []

    async def count(request: httpx2.Request) -> None:
        sent.append(request.url.path)

    http = httpx2.AsyncClient(event_hooks={"request": [count]})
    client = AsyncOpenAI(
        base_url=server_url, api_key="local", http_client=http, max_retries=0
    )
    async with http:
        provider = OpenAIChatProvider(client=client)
        first, first_modes = await _structured_loop(
            provider, _capital_request(tools=(add,)), CAPITAL_QUESTION
        )
        before = len(sent)
        second, second_modes = await _structured_loop(
            provider, _capital_request(tools=(add,)), CAPITAL_QUESTION
        )
    # The model may answer, or call `add`: each request said how it asked.
    assert first_modes
    assert set(first_modes) == set(second_modes) == {"prompted"}
    assert before == len(first_modes) + 1  # the one refused request
    assert len(sent) - before == len(second_modes)
    assert first.model_requests == len(first_modes)
    assert second.model_requests == len(second_modes)
