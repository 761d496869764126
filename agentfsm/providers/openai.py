"""OpenAI providers: the Responses API, and Chat Completions for any compatible server.

Install with `pip install 'agentfsm[openai]'`. Two model prefixes are built in:

- `openai:<model>` (`openai:gpt-4.1-mini`) is served by `OpenAIResponsesProvider`,
  on OpenAI's Responses API, whose items map one to one onto agentfsm's.
- `openai-chat:<model>` is served by `OpenAIChatProvider`, on Chat Completions,
  which every OpenAI-compatible server speaks (vLLM, llama.cpp's server, Ollama,
  LM Studio): point it at one with `OPENAI_BASE_URL` or `base_url=`.

The default providers read `OPENAI_API_KEY` and `OPENAI_BASE_URL`; register
your own to choose other settings:

```python
chat = OpenAIChatProvider(base_url="http://127.0.0.1:8080/v1")
async with Runtime(providers={"llama": chat}) as runtime:
    runtime.run_loop("agent", "hi", InferenceInput(model="llama:smollm2", ...))
```

What maps where (see `_openai_responses` and `_openai_chat` for the details):

| `InferenceInput`     | Responses API                      | Chat Completions                      |
|----------------------|------------------------------------|---------------------------------------|
| `max_output_tokens`  | `max_output_tokens`                | `max_completion_tokens` / `max_tokens` |
| `reasoning_effort`   | `reasoning.effort` (+ `summary`)   | `reasoning_effort`                    |
| `tool_choice`        | `auto`/`required`/`none`/function  | the same                              |
| `structured_output`  | by `structured_output_mode` (below) | the same                             |
| `temperature`, `top_p` | `temperature`, `top_p`           | the same                              |
| `seed`               | not sent (no such setting)         | `seed`                                |
| `stop_sequences`     | refused (no such setting)          | `stop`                                |
| `parallel_tool_calls` | `parallel_tool_calls` (with tools) | the same                             |
| `extra_body`         | merged into the body (its keys win) | the same                             |

`tool_choice` goes out as `InferenceInput.effective_tool_choice`, so
`reset_tool_choice` is honoured. Of the settings the Responses API lacks, `seed`
is a sampling hint (OpenAI's own is best effort) and is left out; stop
sequences would change the answer, so a request with them is refused with a
`ConfigurationError` pointing to `openai-chat:`, which has them.

A structured output is asked for in `InferenceInput.structured_output_mode`
([Structured output][structured-output-on-any-server]): `native` is `text.format` /
`response_format` json_schema, `tool` a forced final answer tool
(`final_result`) whose call becomes the answer's message, `prompted` the schema
in the instructions with `json_object`. `auto` is native, then tool, then
prompted on OpenAI's own API; on another server (`openai-chat:` with a
`base_url`) it is tool, then prompted, and a prompted `json_object` carries the
schema (llama.cpp's server turns it into a grammar). A mode the server refuses
(an HTTP 400/422 naming what it sent; elsewhere than OpenAI's API, a 500 too)
is skipped from then on by that provider, for that model, once the next mode
worked; the mode used is `InferenceOutput.structured_output_mode`.

A pydantic model sent natively is strict, through the SDK's own schema
transform; a JSON schema given as a dict is sent as given, strict only when it
already meets strict mode. Tools are strict when their schema does.

Images ([Images][images-in-messages-and-tool-results]): `image_support(model)`
says where a model takes them. On the Responses API a user message's images
are `input_image` parts and a tool's images go in its `function_call_output`
beside its text (up to 20 MiB each, by bytes or URL); on Chat Completions a
user message's images are `image_url` parts, and a `tool` message holds text
only, so a tool's images are each sent as a line of text (their reference),
named by the output's `images_described`. The models in `TEXT_ONLY_MODELS`
take no image (`NO_IMAGES`); `images=` on either provider overrides the
answer for every model (a vision model of your own behind Chat Completions,
say). A request holding a user message's image its model cannot take raises
`ImageNotSupported` before anything is sent; a tool's image it cannot take is
sent as text.

A 404 from the Responses API of a server that is not OpenAI's (Ollama, vLLM,
llama.cpp's server have none) raises a `ProviderError` naming the URL and
suggesting the `openai-chat:` prefix.

Errors become agentfsm errors: rate limits (429), 408/409, 5xx and connection
failures raise `ProviderError(retryable=True)`, timeouts `ProviderTimeout`, and
other HTTP errors `ProviderError(retryable=False)` with the API's message and
`status_code`. The loop retries the retryable ones (`max_retries`), so the
providers tell the SDK not to retry by default.
"""

from __future__ import annotations

try:
    import openai
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "agentfsm.providers.openai needs the OpenAI SDK: pip install 'agentfsm[openai]'"
    ) from exc

from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from typing import Any, Final, Literal, Protocol, TypeAlias, TypeVar

from openai import AsyncOpenAI, AsyncStream

from agentfsm.exceptions import ConfigurationError, ProviderError, ProviderTimeout
from agentfsm.providers import (
    NO_IMAGES,
    ImageSupport,
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    StreamEvent,
    StreamingDelta,
    UsageUpdate,
    split_model,
)
from agentfsm.providers import _openai_chat as chat
from agentfsm.providers import _openai_responses as responses
from agentfsm.providers._common import (
    ImageMapping,
    OwnedClient,
    close_stream,
    env,
    error_detail,
    image_override,
    next_or_none,
    status_error,
    stream_error,
    text_only,
)
from agentfsm.providers._openai_responses import ReasoningSummary
from agentfsm.providers._structured import (
    DETAIL_CHARS,
    NATIVE_FIRST,
    NO_REASON,
    TOOL_FIRST,
    Mode,
    Modes,
    Plan,
)

__all__ = (
    "TEXT_ONLY_MODELS",
    "MaxTokensField",
    "OpenAIChatProvider",
    "OpenAIResponsesProvider",
    "ReasoningSummary",
)

MaxTokensField: TypeAlias = Literal["max_completion_tokens", "max_tokens"]
"""The Chat Completions field that carries `max_output_tokens`."""

_E = TypeVar("_E")
_E_contra = TypeVar("_E_contra", contravariant=True)
_VENDOR: Final = "OpenAI"
_OPENAI_HOST: Final = "api.openai.com"
_PLACEHOLDER_KEY: Final = "EMPTY"
"""Sent to compatible servers when no key is set: they take any key, the SDK wants one."""

TEXT_ONLY_MODELS: Final = (
    "gpt-3.5-turbo*",
    "gpt-4",
    "gpt-4-0314",
    "gpt-4-0613",
    "gpt-4-32k*",
    "gpt-4-0125-preview",
    "gpt-4-1106-preview",
    "gpt-4-turbo-preview",
    "o1-mini*",
    "o1-preview*",
    "o3-mini*",
)
"""OpenAI models that take no image, for which both providers' `image_support`
answers `NO_IMAGES` (a trailing `*`: every name that starts so). Any other
model is taken to take images; `images=` overrides the answer."""

_RESPONSES_IMAGES: Final = ImageSupport()
"""The Responses API: images in user messages and tool results, by bytes or
URL, up to 20 MiB each."""
_CHAT_IMAGES: Final = ImageSupport(tool_results=False)
"""Chat Completions: images in user messages (a `tool` message holds text only)."""


class _OpenAIProvider(OwnedClient[AsyncOpenAI]):
    """The client, error handling and image support the two OpenAI providers share."""

    __slots__ = ("_images",)

    _DEFAULT_IMAGES: ImageSupport = _RESPONSES_IMAGES
    """What a model not in `TEXT_ONLY_MODELS` takes."""

    def __init__(
        self,
        *,
        client: AsyncOpenAI | None,
        api_key: str | None,
        base_url: str | None,
        timeout: float | None,
        max_retries: int,
        images: ImageSupport | None,
    ) -> None:
        self._images = image_override(images)
        if self._given(client, api_key, base_url):
            return
        api_key = api_key or env("OPENAI_API_KEY")
        base_url = base_url or env("OPENAI_BASE_URL")
        if api_key is None:
            if base_url is None:
                raise ConfigurationError(
                    "no OpenAI API key: set OPENAI_API_KEY or pass api_key=, or point "
                    "base_url= (OPENAI_BASE_URL) at an OpenAI-compatible server"
                )
            api_key = _PLACEHOLDER_KEY
        self._made(
            AsyncOpenAI(
                api_key=api_key,
                base_url=base_url,
                timeout=timeout if timeout is not None else openai.DEFAULT_TIMEOUT,
                max_retries=max_retries,
            )
        )

    def image_support(self, model: str) -> ImageSupport:
        """Where `model` (`provider:model`) takes images: the `images=` given to
        the provider, else `NO_IMAGES` for the models in `TEXT_ONLY_MODELS`,
        else what the API takes (see the module)."""
        if self._images is not None:
            return self._images
        if text_only(model, TEXT_ONLY_MODELS):
            return NO_IMAGES
        return self._DEFAULT_IMAGES

    def _image_mapping(self, request: InferenceInput) -> ImageMapping:
        return ImageMapping(request.model, self.image_support(request.model))


class OpenAIResponsesProvider(_OpenAIProvider):
    """Serves `openai:<model>` through OpenAI's Responses API.

    Requests are stateless: the whole context goes with each one, and nothing is
    stored on OpenAI's side (`store=False`). When `reasoning_effort` is set the
    provider asks for the reasoning summary and the encrypted reasoning, which
    the next request sends back so the model keeps its train of thought across
    tool calls.

    Args:
        api_key: the API key (default: `OPENAI_API_KEY`).
        base_url: the API's URL (default: `OPENAI_BASE_URL`, else OpenAI's).
        client: a ready `AsyncOpenAI` client, instead of `api_key`/`base_url`
            (the provider then leaves closing it to you).
        timeout: seconds a request may take (default: the SDK's).
        max_retries: the SDK's own retries; the loop already retries transient
            errors, so the default is none.
        store: let OpenAI store the responses.
        reasoning_summary: the summary to ask for when `reasoning_effort` is set
            (`None`: ask for none).
        include_encrypted_reasoning: ask for encrypted reasoning (default: when
            `reasoning_effort` is set and `store` is off; non-reasoning models
            reject it).
        images: where every model takes images, instead of what
            `image_support` knows of OpenAI's models (images in user messages
            and tool results, by bytes or URL, up to 20 MiB; `NO_IMAGES` for
            `TEXT_ONLY_MODELS`).

    Example:
        ```python
        provider = OpenAIResponsesProvider(api_key="sk-...")
        output = await provider.complete(
            InferenceInput(model="openai:gpt-4.1-mini", context=context)
        )
        ```
    """

    __slots__ = ("_encrypted", "_modes", "_store", "_summary")

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        client: AsyncOpenAI | None = None,
        timeout: float | None = None,
        max_retries: int = 0,
        store: bool = False,
        reasoning_summary: ReasoningSummary | None = "auto",
        include_encrypted_reasoning: bool | None = None,
        images: ImageSupport | None = None,
    ) -> None:
        super().__init__(
            client=client,
            api_key=api_key,
            base_url=base_url,
            timeout=timeout,
            max_retries=max_retries,
            images=images,
        )
        self._store = store
        self._summary: ReasoningSummary | None = reasoning_summary
        self._encrypted = include_encrypted_reasoning
        self._modes = Modes(
            NATIVE_FIRST, vendor=self._client.base_url.host == _OPENAI_HOST
        )

    def request_params(
        self, request: InferenceInput, *, mode: Mode | None = None
    ) -> dict[str, Any]:
        """The arguments `client.responses.create` gets for `request`, its
        structured output asked for in `mode` (default: the first mode the
        provider tries).

        Raises:
            ImageNotSupported: a user message holds an image the model cannot take.
        """
        plan = self._modes.plan(request, mode)
        return self._params(request, plan, self._image_mapping(request))

    def _params(
        self, request: InferenceInput, plan: Plan | None, images: ImageMapping
    ) -> dict[str, Any]:
        return responses.request_params(
            request,
            split_model(request.model)[1],
            store=self._store,
            reasoning_summary=self._summary,
            include_encrypted_reasoning=self._encrypted,
            plan=plan,
            images=images,
        )

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        """Send the request and map the whole response.

        Raises:
            ProviderError: the API failed (`retryable` when it is transient);
                a 404 from a server that is not OpenAI's suggests `openai-chat:`.
            ProviderTimeout: the request timed out.
        """
        return await self._modes.complete(request, self._complete)

    async def _complete(
        self, request: InferenceInput, plan: Plan | None
    ) -> InferenceOutput:
        images = self._image_mapping(request)
        params = self._params(request, plan, images)
        with _mapped_errors(), self._not_found_hint():
            response = await self._client.responses.create(**params)
        return images.output(responses.output_of(response))

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """Send the request streaming: text, reasoning and argument deltas, then the output.

        Raises:
            ProviderError: the API failed (`retryable` when it is transient);
                a 404 from a server that is not OpenAI's suggests `openai-chat:`.
            ProviderTimeout: the request timed out.
        """
        async with self._modes.stream(request, self._open) as deltas:
            yield deltas

    @asynccontextmanager
    async def _open(
        self, request: InferenceInput, plan: Plan | None
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        images = self._image_mapping(request)
        params = self._params(request, plan, images)
        with _mapped_errors(), self._not_found_hint():
            events = await self._client.responses.create(**params, stream=True)
        deltas = _deltas(events, responses.ResponsesStream(), images)
        try:
            yield deltas
        finally:
            await close_stream(deltas, events)

    @contextmanager
    def _not_found_hint(self) -> Iterator[None]:
        """A 404 from a server that is not OpenAI's, as the likely cause: it has
        no Responses API (Ollama, vLLM and llama.cpp's server have Chat
        Completions, which `openai-chat:` speaks)."""
        try:
            yield
        except openai.NotFoundError as exc:
            url = self._client.base_url
            if url.host == _OPENAI_HOST:
                raise
            text = exc.response.text.strip()[:DETAIL_CHARS] or "no message"
            _, detail = error_detail(exc.body, text)
            raise ProviderError(
                f"{url}responses answered HTTP 404 ({detail}): this server may "
                "not have OpenAI's Responses API, which the `openai:` prefix "
                "uses; for an OpenAI-compatible server (Ollama, vLLM, llama.cpp's "
                "server, LM Studio) use the `openai-chat:` prefix (Chat "
                "Completions), e.g. model='openai-chat:<model>'",
                status_code=404,
            ) from exc


class OpenAIChatProvider(_OpenAIProvider):
    """Serves `openai-chat:<model>` through Chat Completions, on any compatible server.

    The model name is everything after the prefix, colons included
    (`openai-chat:qwen2.5:7b` asks Ollama for `qwen2.5:7b`). Reasoning that
    compatible servers return as `reasoning_content` (or `reasoning`) becomes
    `ReasoningItem`s and `ReasoningDelta`s.

    Args:
        api_key: the API key (default: `OPENAI_API_KEY`; with a `base_url` and
            no key, a placeholder, as local servers take any).
        base_url: the server's URL, e.g. `http://127.0.0.1:8080/v1` (default:
            `OPENAI_BASE_URL`, else OpenAI's).
        client: a ready `AsyncOpenAI` client, instead of `api_key`/`base_url`
            (the provider then leaves closing it to you).
        timeout: seconds a request may take (default: the SDK's).
        max_retries: the SDK's own retries; the loop already retries transient
            errors, so the default is none.
        max_tokens_field: the field for `max_output_tokens` (default:
            `max_completion_tokens` on OpenAI, whose reasoning models reject
            `max_tokens`, and `max_tokens`, which every server knows, elsewhere).
        images: where every model takes images, instead of what
            `image_support` assumes (images in user messages, by bytes or URL,
            up to 20 MiB; `NO_IMAGES` for `TEXT_ONLY_MODELS`): e.g.
            `NO_IMAGES` for a server of text-only models, or a `max_bytes` of
            its own. Its `tool_results` is taken as False whatever it says: a
            `tool` message holds text only.

    Example:
        ```python
        local = OpenAIChatProvider(base_url="http://127.0.0.1:8000/v1")
        runtime = Runtime(providers={"openai-chat": local})
        ```
    """

    __slots__ = ("_max_tokens_field", "_modes", "_on_openai")

    _DEFAULT_IMAGES = _CHAT_IMAGES

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        client: AsyncOpenAI | None = None,
        timeout: float | None = None,
        max_retries: int = 0,
        max_tokens_field: MaxTokensField | None = None,
        images: ImageSupport | None = None,
    ) -> None:
        images = image_override(images)
        if images is not None and images.tool_results:
            images = replace(images, tool_results=False)
        super().__init__(
            client=client,
            api_key=api_key,
            base_url=base_url,
            timeout=timeout,
            max_retries=max_retries,
            images=images,
        )
        self._on_openai = self._client.base_url.host == _OPENAI_HOST
        if max_tokens_field is None:
            max_tokens_field = (
                "max_completion_tokens" if self._on_openai else "max_tokens"
            )
        self._max_tokens_field: MaxTokensField = max_tokens_field
        # OpenAI's own API has json_schema; other servers vary, and a tool call
        # works on any that has tools (and is a grammar on llama.cpp's).
        self._modes = Modes(
            NATIVE_FIRST if self._on_openai else TOOL_FIRST, vendor=self._on_openai
        )

    def request_params(
        self, request: InferenceInput, *, mode: Mode | None = None
    ) -> dict[str, Any]:
        """The arguments `client.chat.completions.create` gets for `request`,
        its structured output asked for in `mode` (default: the first mode the
        provider tries).

        Raises:
            ImageNotSupported: a user message holds an image the model cannot take.
        """
        plan = self._modes.plan(request, mode)
        return self._params(request, plan, self._image_mapping(request))

    def _params(
        self, request: InferenceInput, plan: Plan | None, images: ImageMapping
    ) -> dict[str, Any]:
        return chat.request_params(
            request,
            split_model(request.model)[1],
            max_tokens_field=self._max_tokens_field,
            plan=plan,
            json_schema_in_json_object=not self._on_openai,
            images=images,
        )

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        """Send the request and map the whole completion.

        Raises:
            ProviderError: the server failed (`retryable` when it is transient).
            ProviderTimeout: the request timed out.
        """
        return await self._modes.complete(request, self._complete)

    async def _complete(
        self, request: InferenceInput, plan: Plan | None
    ) -> InferenceOutput:
        images = self._image_mapping(request)
        params = self._params(request, plan, images)
        with _mapped_errors():
            completion = await self._client.chat.completions.create(**params)
        return images.output(chat.output_of(completion))

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """Send the request streaming (usage included): deltas, then the output.

        Raises:
            ProviderError: the server failed (`retryable` when it is transient).
            ProviderTimeout: the request timed out.
        """
        async with self._modes.stream(request, self._open) as deltas:
            yield deltas

    @asynccontextmanager
    async def _open(
        self, request: InferenceInput, plan: Plan | None
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        images = self._image_mapping(request)
        params = self._params(request, plan, images)
        with _mapped_errors():
            chunks = await self._client.chat.completions.create(
                **params, stream=True, stream_options={"include_usage": True}
            )
        deltas = _deltas(chunks, chat.ChatStream(), images)
        try:
            yield deltas
        finally:
            await close_stream(deltas, chunks)


class _Feed(Protocol[_E_contra]):
    """`responses.ResponsesStream` and `chat.ChatStream`: SDK events in, deltas out."""

    def feed(self, event: _E_contra) -> Sequence[StreamingDelta | UsageUpdate]: ...

    def output(self) -> InferenceOutput: ...


async def _deltas(
    events: AsyncStream[_E], state: _Feed[_E], images: ImageMapping
) -> AsyncGenerator[StreamEvent, None]:
    with _mapped_errors():
        while (event := await next_or_none(events)) is not None:
            for delta in state.feed(event):
                yield delta
    yield OutputCompleted(output=images.output(state.output()))


@contextmanager
def _mapped_errors() -> Iterator[None]:
    """Turn the SDK's exceptions into agentfsm's."""
    try:
        yield
    except openai.APITimeoutError as exc:
        raise ProviderTimeout(f"{_VENDOR}: the request timed out") from exc
    except openai.APIConnectionError as exc:
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        raise ProviderError(f"{_VENDOR}: {exc.message}{cause}", retryable=True) from exc
    except openai.APIStatusError as exc:
        kind, message = error_detail(exc.body, "")
        # A JSON error with an empty message (llama.cpp's server, on an
        # assertion) says so, which lets `auto` structured output move on.
        message = message or (NO_REASON if isinstance(exc.body, dict) else exc.message)
        raise status_error(_VENDOR, exc.status_code, kind, message) from exc
    except openai.APIError as exc:  # an error sent inside a stream
        kind, message = error_detail(exc.body, exc.message)
        raise stream_error(
            _VENDOR, kind, message, retryable=kind in responses.RETRYABLE_CODES
        ) from exc
