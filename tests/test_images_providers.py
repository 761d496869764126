"""Images through the built-in providers: the request bodies the real SDKs send.

User-message images and tool-result images map onto the Responses API's
`input_image`, Chat Completions' `image_url` parts (its `tool` messages hold
text, so a tool's images become reference lines), the Messages API's `image`
blocks and, for the local model, reference lines; `image_support` answers
what each model takes, and a request holding an image its model cannot take
in a user message is refused before anything is sent. The SDKs run for real
over `tests.http_mock.MockAPI`, and one loop goes through a stub
OpenAI-compatible server on 127.0.0.1.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeAlias

import httpx2
import pytest
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from agentfsm import (
    ConfigurationError,
    FunctionCallItem,
    FunctionCallOutputItem,
    ImageBlock,
    ImageNotSupported,
    ImageSupport,
    InferenceInput,
    InferenceOutput,
    ModelContext,
    ModelMessageItem,
    Outcome,
    Runtime,
    UserMessage,
    tool,
)
from agentfsm.events import InferenceCompleted
from agentfsm.inference import NO_IMAGES
from agentfsm.providers import OutputCompleted, Provider
from agentfsm.providers._common import ImageMapping
from agentfsm.providers.anthropic import AnthropicProvider
from agentfsm.providers.local import LocalProvider, chat_messages, request_kwargs
from agentfsm.providers.openai import OpenAIChatProvider, OpenAIResponsesProvider
from agentfsm.testing import EventRecorder, assert_path
from tests.http_mock import MockAPI, json_response, sse_bytes, sse_response
from tests.test_provider_anthropic import message_body, stream_events, streamed_text
from tests.test_provider_anthropic import text_block as anthropic_text
from tests.test_provider_openai import (
    chat_usage,
    chunk,
    completion_body,
    message_item,
    response_body,
    seq,
    tool_chunk,
)

# A 1x1 PNG, as a file holds it.
PIXEL = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c63f8cfc0f01f0005000201ffa4e2d1"
    "0f0000000049454e44ae426082"
)
# A JPEG's first and last markers: what the sniffing reads.
JPEG_BYTES = (
    b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00\xff\xd9"
)
CAT_URL = "https://images.example/cat.jpg"

PNG = ImageBlock.from_bytes(PIXEL)
JPEG = ImageBlock.from_bytes(JPEG_BYTES)
URL = ImageBlock.from_url(CAT_URL)
PNG_DIGEST = "sha256:" + hashlib.sha256(PIXEL).hexdigest()
JPEG_DIGEST = "sha256:" + hashlib.sha256(JPEG_BYTES).hexdigest()
PNG_LINE = f"[image: image/png, 71 bytes, {PNG_DIGEST[:19]}]"
JPEG_LINE = f"[image: image/jpeg, 22 bytes, {JPEG_DIGEST[:19]}]"
PNG_DATA = base64.b64encode(PIXEL).decode()
JPEG_DATA = base64.b64encode(JPEG_BYTES).decode()
PNG_URL = f"data:image/png;base64,{PNG_DATA}"
JPEG_URL = f"data:image/jpeg;base64,{JPEG_DATA}"

ANTHROPIC_MAX = 5 * 1024 * 1024 * 3 // 4
# A PNG signature padded past Anthropic's limit (5 MiB of base64): a valid
# block, too big there.
BIG = ImageBlock.from_bytes(PIXEL[:8] + bytes(ANTHROPIC_MAX))


def asked_to_look() -> UserMessage:
    return UserMessage(content=["What is in these?", PNG, URL])


def shot_items(*images: ImageBlock, output: str = "the page") -> list[Any]:
    """A screenshot call and its output holding `images`."""
    return [
        UserMessage(content="shoot"),
        FunctionCallItem(call_id="call_1", name="screenshot", arguments="{}"),
        FunctionCallOutputItem(call_id="call_1", output=output, images=images),
    ]


def request_of(model: str, *items: Any) -> InferenceInput:
    return InferenceInput(model=model, context=ModelContext(items=list(items)))


async def infer(
    provider: Provider, request: InferenceInput, *, streaming: bool
) -> InferenceOutput:
    if not streaming:
        return await provider.complete(request)
    async with provider.stream(request) as events:
        seen = [event async for event in events]
    last = seen[-1]
    assert isinstance(last, OutputCompleted)
    return last.output


def responses_provider(api: MockAPI, **options: Any) -> OpenAIResponsesProvider:
    client = AsyncOpenAI(api_key="sk-test", http_client=api.http, max_retries=0)
    return OpenAIResponsesProvider(client=client, **options)


def chat_provider(api: MockAPI, **options: Any) -> OpenAIChatProvider:
    client = AsyncOpenAI(
        api_key="sk-test",
        base_url="http://127.0.0.1:8080/v1",
        http_client=api.http,
        max_retries=0,
    )
    return OpenAIChatProvider(client=client, **options)


def anthropic_provider(api: MockAPI, **options: Any) -> AnthropicProvider:
    client = AsyncAnthropic(api_key="sk-ant-test", http_client=api.http, max_retries=0)
    return AnthropicProvider(client=client, **options)


AnyProvider: TypeAlias = (
    OpenAIResponsesProvider | OpenAIChatProvider | AnthropicProvider | LocalProvider
)


def provider_for(model: str, api: MockAPI) -> AnyProvider:
    """The built-in provider of `model`'s prefix, sending through `api`."""
    prefix = model.partition(":")[0]
    if prefix == "openai":
        return responses_provider(api)
    if prefix == "openai-chat":
        return chat_provider(api)
    if prefix == "anthropic":
        return anthropic_provider(api)
    assert prefix == "local"
    return LocalProvider()


def responses_answer(streaming: bool) -> httpx2.Response:
    body = response_body([message_item("ok")])
    if streaming:
        return sse_response(seq([{"type": "response.completed", "response": body}]))
    return json_response(body)


def chat_answer(streaming: bool) -> httpx2.Response:
    if streaming:
        chunks = [
            chunk({"role": "assistant", "content": "ok"}),
            chunk({}, "stop"),
            chunk(usage=chat_usage()),
        ]
        return sse_response(chunks, named=False, done=True)
    return json_response(completion_body({"content": "ok"}))


def anthropic_answer(streaming: bool) -> httpx2.Response:
    if streaming:
        return sse_response(stream_events([streamed_text("ok")]))
    return json_response(message_body([anthropic_text("ok")]))


def input_image(url: str) -> dict[str, Any]:
    return {"type": "input_image", "image_url": url, "detail": "auto"}


def claude_image(media_type: str, data: str) -> dict[str, Any]:
    source = {"type": "base64", "media_type": media_type, "data": data}
    return {"type": "image", "source": source}


STREAMING = pytest.mark.parametrize(
    "streaming", [False, True], ids=["whole", "streaming"]
)

# ================================================================ Responses API


@STREAMING
async def test_responses_sends_images_as_input_image(streaming: bool) -> None:
    """A user message's text, bytes and URL are `input_text` / `input_image`
    parts; a tool's images go in its `function_call_output` after its text."""
    request = request_of(
        "openai:gpt-4.1-mini", asked_to_look(), *shot_items(PNG, JPEG)[1:]
    )
    async with MockAPI(responses_answer(streaming)) as api:
        output = await infer(responses_provider(api), request, streaming=streaming)

    assert api.body["input"] == [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is in these?"},
                input_image(PNG_URL),
                input_image(CAT_URL),
            ],
        },
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "screenshot",
            "arguments": "{}",
        },
        {
            "type": "function_call_output",
            "call_id": "call_1",
            "output": [
                {"type": "input_text", "text": "the page"},
                input_image(PNG_URL),
                input_image(JPEG_URL),
            ],
        },
    ]
    assert output.message == ModelMessageItem(content="ok")
    assert output.images_described == ()


async def test_responses_image_only_tool_output_sends_no_empty_text() -> None:
    """A tool that returned only an image sends the image alone; a text-only
    output stays a string, as before images."""
    items = [
        *shot_items(PNG, output=""),
        FunctionCallItem(call_id="call_2", name="x", arguments="{}"),
    ]
    items.append(FunctionCallOutputItem(call_id="call_2", output="plain"))
    async with MockAPI(responses_answer(False)) as api:
        await responses_provider(api).complete(request_of("openai:gpt-4.1", *items))
    outputs = [
        i["output"]
        for i in api.body["input"]
        if i.get("type") == "function_call_output"
    ]
    assert outputs == [[input_image(PNG_URL)], "plain"]


async def test_responses_describes_the_tool_images_its_override_refuses() -> None:
    """With `images=` taking no URL, a tool's URL image is a reference line
    after its text, the bytes image still an `input_image`, and the output
    names the URL it described."""
    request = request_of("openai:gpt-4.1", *shot_items(PNG, URL))
    async with MockAPI(responses_answer(False)) as api:
        provider = responses_provider(api, images=ImageSupport(urls=False))
        output = await provider.complete(request)
    assert api.body["input"][-1]["output"] == [
        {"type": "input_text", "text": f"the page\n[image: {CAT_URL}]"},
        input_image(PNG_URL),
    ]
    assert output.images_described == (CAT_URL,)


# ============================================================= Chat Completions


@STREAMING
async def test_chat_sends_user_images_and_describes_tool_images(
    streaming: bool,
) -> None:
    """A user message is `text` / `image_url` parts; a `tool` message holds
    text, so each tool image is a reference line and `images_described`
    names its digest (the streamed `OutputCompleted` too)."""
    request = request_of(
        "openai-chat:gpt-4o-mini", asked_to_look(), *shot_items(PNG, JPEG)[1:]
    )
    async with MockAPI(chat_answer(streaming)) as api:
        output = await infer(chat_provider(api), request, streaming=streaming)

    assert api.body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in these?"},
                {"type": "image_url", "image_url": {"url": PNG_URL}},
                {"type": "image_url", "image_url": {"url": CAT_URL}},
            ],
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "screenshot", "arguments": "{}"},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": f"the page\n{PNG_LINE}\n{JPEG_LINE}",
        },
    ]
    assert output.message == ModelMessageItem(content="ok")
    assert output.images_described == (PNG_DIGEST, JPEG_DIGEST)


async def test_chat_text_only_blocks_and_plain_outputs_describe_nothing() -> None:
    """A message of text blocks is `text` parts; a tool output without images
    is its text as before, and nothing is described."""
    request = request_of(
        "openai-chat:m",
        UserMessage(content=["first", "second"]),
        *shot_items()[1:],
    )
    async with MockAPI(chat_answer(False)) as api:
        output = await chat_provider(api).complete(request)
    user, _, tool_message = api.body["messages"]
    assert user["content"] == [
        {"type": "text", "text": "first"},
        {"type": "text", "text": "second"},
    ]
    assert tool_message["content"] == "the page"
    assert output.images_described == ()


# ================================================================= Messages API


@STREAMING
async def test_anthropic_sends_image_blocks(streaming: bool) -> None:
    """A user message's images are `image` blocks (`base64` or `url` source);
    a tool's are blocks of its `tool_result` content, after its text."""
    request = request_of(
        "anthropic:claude-sonnet-4-6", asked_to_look(), *shot_items(PNG, JPEG)[1:]
    )
    async with MockAPI(anthropic_answer(streaming)) as api:
        output = await infer(anthropic_provider(api), request, streaming=streaming)

    assert api.body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in these?"},
                claude_image("image/png", PNG_DATA),
                {"type": "image", "source": {"type": "url", "url": CAT_URL}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "call_1", "name": "screenshot", "input": {}}
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "call_1",
                    "content": [
                        {"type": "text", "text": "the page"},
                        claude_image("image/png", PNG_DATA),
                        claude_image("image/jpeg", JPEG_DATA),
                    ],
                }
            ],
        },
    ]
    assert output.message == ModelMessageItem(content="ok")
    assert output.images_described == ()


async def test_anthropic_describes_a_tool_image_over_5_mib() -> None:
    """A tool image over the API's 5 MiB is a reference line (its bytes are
    not sent), the one beside it still a block; blank text is left out."""
    request = request_of(
        "anthropic:claude-sonnet-4-6", *shot_items(BIG, PNG, output="")
    )
    async with MockAPI(anthropic_answer(False)) as api:
        output = await anthropic_provider(api).complete(request)
    result = api.body["messages"][-1]["content"][0]
    assert result["content"] == [
        {"type": "text", "text": BIG.reference},
        claude_image("image/png", PNG_DATA),
    ]
    assert len(api.requests[0].content) < 10_000
    assert output.images_described == (BIG.digest,)


# ====================================================================== support


@pytest.mark.parametrize(
    ("model", "support"),
    [
        ("openai:gpt-4.1-mini", ImageSupport()),
        ("openai:gpt-4o", ImageSupport()),
        ("openai:o3", ImageSupport()),
        ("openai:gpt-4", NO_IMAGES),
        ("openai:gpt-4-0613", NO_IMAGES),
        ("openai:gpt-3.5-turbo-0125", NO_IMAGES),
        ("openai:o1-mini", NO_IMAGES),
        ("openai:o3-mini-2025-01-31", NO_IMAGES),
        ("openai-chat:gpt-4o-mini", ImageSupport(tool_results=False)),
        ("openai-chat:qwen2.5-vl:7b", ImageSupport(tool_results=False)),
        ("openai-chat:gpt-3.5-turbo", NO_IMAGES),
        ("anthropic:claude-sonnet-4-6", ImageSupport(max_bytes=ANTHROPIC_MAX)),
        ("anthropic:claude-2.1", NO_IMAGES),
        ("local:smollm2", NO_IMAGES),
    ],
)
async def test_image_support(model: str, support: ImageSupport) -> None:
    """What each built-in provider says a model takes."""
    async with MockAPI() as api:
        assert provider_for(model, api).image_support(model) == support


async def test_images_override_answers_for_every_model() -> None:
    """`images=` wins over the model list; on Chat Completions its
    `tool_results` is False whatever it says (a `tool` message holds text)."""
    mine = ImageSupport(urls=False, max_bytes=1000)
    async with MockAPI() as api:
        assert (
            responses_provider(api, images=mine).image_support("openai:gpt-4") == mine
        )
        assert (
            anthropic_provider(api, images=NO_IMAGES).image_support(
                "anthropic:claude-sonnet-4-6"
            )
            == NO_IMAGES
        )
        chat = chat_provider(api, images=mine)
        assert chat.image_support("openai-chat:llava") == ImageSupport(
            tool_results=False, urls=False, max_bytes=1000
        )
        with pytest.raises(ConfigurationError, match="images must be an ImageSupport"):
            chat_provider(api, images=True)


# ============================================================ refused at mapping


@STREAMING
@pytest.mark.parametrize(
    ("model", "capability"),
    [
        ("openai:gpt-3.5-turbo", "images in user messages"),
        ("openai-chat:gpt-4", "images in user messages"),
        ("anthropic:claude-2.1", "images in user messages"),
    ],
)
async def test_a_user_image_the_model_cannot_take_is_refused_unsent(
    model: str, capability: str, streaming: bool
) -> None:
    """A context holding a user image its (text-only) model cannot take raises
    `ImageNotSupported` naming the model, the capability and the block, and
    nothing reaches the server."""
    request = request_of(model, asked_to_look())
    async with MockAPI() as api:
        with pytest.raises(ImageNotSupported) as caught:
            await infer(provider_for(model, api), request, streaming=streaming)
    assert api.requests == []
    error = caught.value
    assert (error.model, error.capability) == (model, capability)
    assert error.block == f"content[1] {PNG_LINE}"
    assert model in str(error)
    assert PNG_LINE in str(error)


async def test_anthropic_refuses_a_user_image_over_5_mib() -> None:
    """A user image over 5 MiB is refused on Anthropic (a tool's is described)."""
    request = request_of("anthropic:claude-sonnet-4-6", UserMessage(content=[BIG]))
    async with MockAPI() as api:
        with pytest.raises(ImageNotSupported) as caught:
            await anthropic_provider(api).complete(request)
    assert caught.value.capability == f"images over {ANTHROPIC_MAX:,} bytes"
    assert caught.value.block == f"content[0] {BIG.reference}"


async def test_a_refused_mapping_fails_the_loop_idle() -> None:
    """A context filled directly with an image message for a text-only model:
    the provider refuses it before any request, and the loop fails with
    `ImageNotSupported`, ending idle."""
    inference_input = InferenceInput(
        model="openai:gpt-3.5-turbo",
        context=ModelContext(items=[UserMessage(content=["look", PNG])]),
    )
    async with (
        MockAPI() as api,
        Runtime(providers={"openai": responses_provider(api)}) as runtime,
    ):
        loop_id = runtime.run_loop("agent", "and now?", inference_input)
        result = await runtime.wait(loop_id)
    assert api.requests == []
    assert result.outcome is Outcome.failed
    assert result.error is not None
    assert result.error.type == "ImageNotSupported"
    assert "images in user messages" in result.error.message
    assert_path(result, "idle context_update inference idle")


# ======================================================================== local


def test_local_refuses_user_images_and_describes_tool_images() -> None:
    """The local chat format renders text: a user image is refused, a tool's
    images (bytes or URL) are reference lines in its result's message."""
    with pytest.raises(ImageNotSupported) as caught:
        request_kwargs(request_of("local:smollm2", asked_to_look()))
    assert caught.value.model == "local:smollm2"
    assert caught.value.capability == "images in user messages"

    mapping = ImageMapping("local:smollm2", NO_IMAGES)
    request = request_of(
        "local:smollm2", UserMessage(content=["one", "two"]), *shot_items(PNG, URL)[1:]
    )
    messages = chat_messages(request, images=mapping)
    assert messages[0] == {"role": "user", "content": "one\ntwo"}
    assert messages[-1] == {
        "role": "user",
        "content": f"Result of screenshot: the page\n{PNG_LINE}\n[image: {CAT_URL}]",
    }
    assert mapping.described == (PNG_DIGEST, CAT_URL)


@STREAMING
async def test_local_provider_refuses_before_loading(streaming: bool) -> None:
    """`LocalProvider` refuses a user image before it looks for the model (a
    path to no file would otherwise be the error)."""
    request = request_of("local:/nowhere/model.gguf", asked_to_look())
    with pytest.raises(ImageNotSupported, match="images in user messages"):
        await infer(LocalProvider(), request, streaming=streaming)


# ============================================== a loop on a stub chat server


class StubChatServer(ThreadingHTTPServer):
    """An OpenAI-compatible server on 127.0.0.1: answers each POST with the
    next canned `(content type, body)` and records the request bodies."""

    daemon_threads = True

    def __init__(self, answers: list[tuple[str, bytes]]) -> None:
        super().__init__(("127.0.0.1", 0), _StubHandler)
        self.answers = answers
        self.bodies: list[dict[str, Any]] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _StubHandler(BaseHTTPRequestHandler):
    server: StubChatServer

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append(json.loads(body))
        kind, answer = self.server.answers.pop(0)
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # not to the test's stderr


def stub_turns(streaming: bool) -> list[tuple[str, bytes]]:
    """A screenshot call, then the answer."""
    if streaming:
        first = [
            tool_chunk(0, id="call_1", name="screenshot", arguments="{}"),
            chunk({}, "tool_calls"),
        ]
        second = [chunk({"role": "assistant", "content": "a pixel"}), chunk({}, "stop")]
        return [
            ("text/event-stream", sse_bytes(part, named=False, done=True))
            for part in (first, second)
        ]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "screenshot", "arguments": "{}"},
    }
    bodies = [
        completion_body({"content": None, "tool_calls": [call]}, "tool_calls"),
        completion_body({"content": "a pixel"}),
    ]
    return [("application/json", json.dumps(b).encode()) for b in bodies]


@pytest.fixture
def stub_server() -> Iterator[list[StubChatServer]]:
    """Starts `StubChatServer`s (appended by the test); stops them after it."""
    servers: list[StubChatServer] = []
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


@tool
async def screenshot() -> ImageBlock:
    """Takes a screenshot of the page."""
    return PNG


# Over a real connection the SDK leaves one generator more unclosed at
# `[DONE]` than pyproject.toml's filter names (httpcore2's, under httpx2's):
# trio reports it when it is collected; the response itself is closed.
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <async_generator object "
    "PoolByteStream.__aiter__:pytest.PytestUnraisableExceptionWarning"
)
@STREAMING
async def test_loop_on_a_chat_server_describes_the_tool_image(
    stub_server: list[StubChatServer], streaming: bool
) -> None:
    """A tool returns an image; on Chat Completions the next request's `tool`
    message is its reference line, and `inference.completed` names its digest."""
    server = StubChatServer(stub_turns(streaming))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stub_server.append(server)
    inference_input = InferenceInput(
        model="openai-chat:vision",
        context=ModelContext(),
        tools=[screenshot],
        streaming=streaming,
    )
    chat = OpenAIChatProvider(base_url=server.base_url, api_key="sk-test")
    async with chat, Runtime(providers={"openai-chat": chat}) as runtime:
        recorder = EventRecorder(runtime.bus, "inference.completed")
        loop_id = runtime.run_loop("agent", "what is on the page?", inference_input)
        result = await runtime.wait(loop_id)
        completed = [e for e in recorder.events if isinstance(e, InferenceCompleted)]
        recorder.close()

    assert result.outcome is Outcome.answered
    assert result.answer == ModelMessageItem(content="a pixel")
    output_item = inference_input.context.items[2]
    assert output_item == FunctionCallOutputItem(
        call_id="call_1", output="", images=(PNG,)
    )
    first, second = server.bodies
    assert [m["role"] for m in first["messages"]] == ["user"]
    assert second["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": PNG_LINE,
    }
    assert [e.output.images_described for e in completed] == [(), (PNG_DIGEST,)]
