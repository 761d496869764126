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
| `structured_output`  | `text.format` json_schema          | `response_format` json_schema         |
| `temperature`, `top_p` | `temperature`, `top_p`           | the same                              |
| `seed`               | not sent (no such setting)         | `seed`                                |
| `stop_sequences`     | refused (no such setting)          | `stop`                                |
| `parallel_tool_calls` | `parallel_tool_calls` (with tools) | the same                             |

`tool_choice` goes out as `InferenceInput.effective_tool_choice`, so
`reset_tool_choice` is honoured. Of the settings the Responses API lacks, `seed`
is a sampling hint (OpenAI's own is best effort) and is left out; stop
sequences would change the answer, so a request with them is refused with a
`ConfigurationError` pointing to `openai-chat:`, which has them.

A pydantic model as `structured_output` is sent strict, through the SDK's own
schema transform; a JSON schema given as a dict is sent as given, strict only
when it already meets strict mode. Tools are strict when their schema does.

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

from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, Final, Literal, Protocol, TypeAlias, TypeVar

from openai import AsyncOpenAI, AsyncStream

from agentfsm.exceptions import ConfigurationError, ProviderError, ProviderTimeout
from agentfsm.providers import (
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    StreamEvent,
    StreamingDelta,
    split_model,
)
from agentfsm.providers import _openai_chat as chat
from agentfsm.providers import _openai_responses as responses
from agentfsm.providers._common import (
    OwnedClient,
    close_stream,
    env,
    error_detail,
    next_or_none,
    status_error,
    stream_error,
)
from agentfsm.providers._openai_responses import ReasoningSummary

__all__ = (
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
_PLACEHOLDER_KEY: Final = "EMPTY"
"""Sent to compatible servers when no key is set: they take any key, the SDK wants one."""


class _OpenAIProvider(OwnedClient[AsyncOpenAI]):
    """The client and error handling the two OpenAI providers share."""

    __slots__ = ()

    def __init__(
        self,
        *,
        client: AsyncOpenAI | None,
        api_key: str | None,
        base_url: str | None,
        timeout: float | None,
        max_retries: int,
    ) -> None:
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

    Example:
        ```python
        provider = OpenAIResponsesProvider(api_key="sk-...")
        output = await provider.complete(
            InferenceInput(model="openai:gpt-4.1-mini", context=context)
        )
        ```
    """

    __slots__ = ("_encrypted", "_store", "_summary")

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
    ) -> None:
        super().__init__(
            client=client,
            api_key=api_key,
            base_url=base_url,
            timeout=timeout,
            max_retries=max_retries,
        )
        self._store = store
        self._summary: ReasoningSummary | None = reasoning_summary
        self._encrypted = include_encrypted_reasoning

    def request_params(self, request: InferenceInput) -> dict[str, Any]:
        """The arguments `client.responses.create` gets for `request`."""
        return responses.request_params(
            request,
            split_model(request.model)[1],
            store=self._store,
            reasoning_summary=self._summary,
            include_encrypted_reasoning=self._encrypted,
        )

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        """Send the request and map the whole response.

        Raises:
            ProviderError: the API failed (`retryable` when it is transient).
            ProviderTimeout: the request timed out.
        """
        params = self.request_params(request)
        with _mapped_errors():
            response = await self._client.responses.create(**params)
        return responses.output_of(response)

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """Send the request streaming: text, reasoning and argument deltas, then the output.

        Raises:
            ProviderError: the API failed (`retryable` when it is transient).
            ProviderTimeout: the request timed out.
        """
        params = self.request_params(request)
        with _mapped_errors():
            events = await self._client.responses.create(**params, stream=True)
        deltas = _deltas(events, responses.ResponsesStream())
        try:
            yield deltas
        finally:
            await close_stream(deltas, events)


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

    Example:
        ```python
        local = OpenAIChatProvider(base_url="http://127.0.0.1:8000/v1")
        runtime = Runtime(providers={"openai-chat": local})
        ```
    """

    __slots__ = ("_max_tokens_field",)

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        client: AsyncOpenAI | None = None,
        timeout: float | None = None,
        max_retries: int = 0,
        max_tokens_field: MaxTokensField | None = None,
    ) -> None:
        super().__init__(
            client=client,
            api_key=api_key,
            base_url=base_url,
            timeout=timeout,
            max_retries=max_retries,
        )
        if max_tokens_field is None:
            on_openai = self._client.base_url.host == "api.openai.com"
            max_tokens_field = "max_completion_tokens" if on_openai else "max_tokens"
        self._max_tokens_field: MaxTokensField = max_tokens_field

    def request_params(self, request: InferenceInput) -> dict[str, Any]:
        """The arguments `client.chat.completions.create` gets for `request`."""
        return chat.request_params(
            request,
            split_model(request.model)[1],
            max_tokens_field=self._max_tokens_field,
        )

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        """Send the request and map the whole completion.

        Raises:
            ProviderError: the server failed (`retryable` when it is transient).
            ProviderTimeout: the request timed out.
        """
        params = self.request_params(request)
        with _mapped_errors():
            completion = await self._client.chat.completions.create(**params)
        return chat.output_of(completion)

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """Send the request streaming (usage included): deltas, then the output.

        Raises:
            ProviderError: the server failed (`retryable` when it is transient).
            ProviderTimeout: the request timed out.
        """
        params = self.request_params(request)
        with _mapped_errors():
            chunks = await self._client.chat.completions.create(
                **params, stream=True, stream_options={"include_usage": True}
            )
        deltas = _deltas(chunks, chat.ChatStream())
        try:
            yield deltas
        finally:
            await close_stream(deltas, chunks)


class _Feed(Protocol[_E_contra]):
    """`responses.ResponsesStream` and `chat.ChatStream`: SDK events in, deltas out."""

    def feed(self, event: _E_contra) -> list[StreamingDelta]: ...

    def output(self) -> InferenceOutput: ...


async def _deltas(
    events: AsyncStream[_E], state: _Feed[_E]
) -> AsyncGenerator[StreamEvent, None]:
    with _mapped_errors():
        while (event := await next_or_none(events)) is not None:
            for delta in state.feed(event):
                yield delta
    yield OutputCompleted(output=state.output())


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
        kind, message = error_detail(exc.body, exc.message)
        raise status_error(_VENDOR, exc.status_code, kind, message) from exc
    except openai.APIError as exc:  # an error sent inside a stream
        kind, message = error_detail(exc.body, exc.message)
        raise stream_error(
            _VENDOR, kind, message, retryable=kind in responses.RETRYABLE_CODES
        ) from exc
