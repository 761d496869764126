"""An agent definition: what loops are started from, over and over.

An `Agent` holds what does not change from one loop to the next: the model, the
instructions, the tools, the model settings, the interception handlers and the
loop options. It holds no conversation: each loop runs on a `Conversation`'s
context (one `ModelContext` per conversation), or on a fresh one. So one agent
can serve any number of users at once, and no user sees another's messages.

```python
agent = Agent("openai:gpt-4.1-mini", instructions="Answer in one sentence.")
print(agent.run_sync("What is the capital of France?").answer.content)
```

A conversation over several loops keeps its context between them:

```python
chat = Conversation()
await agent.run("My name is Ada.", conversation=chat)
result = await agent.run("What is my name?", conversation=chat)  # it knows
```

`Agent.start` starts a loop and returns its id at once, as `Runtime.run_loop`
does (it is a thin layer over it); `Agent.run` waits for the result, on the
current runtime or on one it opens for the call, and raises `LoopFailedError`
for a loop that failed (a wrong URL or key, say), so that a script never reads
an answer that is not there; `Agent.run_sync` is `run` for scripts. The model may be a provider object instead of a name (a
`ScriptedProvider` in tests, say), or a provider object may serve a model by
name (`Agent("llama3", provider=OpenAIChatProvider(base_url=...))`): the agent
registers it with each runtime it starts loops on.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Generic,
    Literal,
    Self,
    TypeVar,
    Unpack,
    final,
    get_type_hints,
    overload,
)

import anyio
from pydantic import BaseModel, ValidationError

from ._arguments import ArgumentTypeError, ArgumentValueError, check, one_of
from ._runtime import Runtime, current_runtime
from .exceptions import (
    AgentFSMError,
    ConfigurationError,
    LoopFailedError,
    LoopStateError,
    NoRuntimeError,
)
from .inference import InferenceInput, ModelSettings
from .interception import InterceptionHandler
from .messages import ContextItem, ModelContext, UserMessage
from .options import LoopOptions, LoopOptionsDict
from .providers import Provider, split_model
from .results import ErrorInfo, LoopResult, LoopStatus, OutputT
from .states import Outcome
from .tools import Tool, format_validation_error

if TYPE_CHECKING:
    from ._bus import Subscription
    from .events import AgentEvent

__all__ = ("Agent", "Conversation", "StreamedRun")

_ModelT = TypeVar("_ModelT", bound=BaseModel)

_SETTINGS: Final = frozenset(get_type_hints(ModelSettings))
_FORCING: Final = frozenset({"auto", "none"})
_prefixes = itertools.count(1)


@final
class Conversation:
    """One conversation: the context its loops share, one loop after another.

    Each loop started on it appends the user's message and the model's items
    to `context`, so the next loop sees them. Start loops on one conversation
    one at a time (await each); loops started on it together would interleave
    their items, as loops sharing any context do.

    Example:
        ```python
        chat = Conversation()
        await agent.run("My name is Ada.", conversation=chat)
        await agent.run("What is my name?", conversation=chat)
        chat.items  # both questions, both answers
        ```
    """

    __slots__ = ("context", "loop_ids")

    def __init__(self, context: ModelContext | None = None) -> None:
        """A new conversation (or one continuing `context`)."""
        check("context", context, ModelContext | None)
        self.context = context if context is not None else ModelContext()
        """The instructions and the items; each loop started on the
        conversation appends to it (and an agent with instructions sets them)."""
        self.loop_ids: list[str] = []
        """The loops started on this conversation, oldest first."""

    @property
    def items(self) -> list[ContextItem]:
        """The conversation so far, oldest first."""
        return self.context.items

    def __repr__(self) -> str:
        return (
            f"Conversation(items={len(self.context.items)}, loops={len(self.loop_ids)})"
        )


@final
class Agent(Generic[OutputT]):
    """A reusable, stateless agent definition: loops are started from it.

    Generic in what its loops answer with: `Agent(...)` is an `Agent[str]`,
    `Agent(..., output_type=Person)` an `Agent[Person]`, so `result.output` is
    typed (`str | None`, `Person | None`; JSON data, `Any`, for a JSON schema).

    Args:
        model: a `provider:model` name (`"openai:gpt-4.1-mini"`); with
            `provider=`, the model's name as that provider knows it
            (`"llama3"`, sent as it is); or a provider object alone (a
            `ScriptedProvider`, say: it gets the agent's name as the model).
        provider: a provider object to send the requests to, which the agent
            registers with each runtime it uses; `model` then names the model.
        name: the `agent_id` its loops run under (default `"agent"`).
        instructions: the system prompt; each loop's context gets it (without
            it, a conversation keeps the instructions it has).
        tools: `Tool`s, or typed functions (each made a tool as `@tool` would).
        model_settings: temperature, seed, tool choice, ... (`ModelSettings`).
            A forcing `tool_choice` (`"required"` or a tool's name) is forced
            once, then `"auto"`, unless `reset_tool_choice` says otherwise.
        output_type: a pydantic model (or JSON schema) the answer must follow;
            the parsed answer is `LoopResult.output` (without it, the answer's
            text is).
        streaming: take the streaming path (each chunk is published as
            `inference.stream`).
        handlers: interception handlers, run in order before every transition.
        **options: loop options (`max_turns`, `stop_when`, `tool_execution`,
            ...: see `agentfsm.options.LoopOptions`).

    Raises:
        ConfigurationError: any of it is wrong (the error says which), at once.

    Example:
        ```python
        agent = Agent(
            "openai:gpt-4.1-mini",
            instructions="Use the tools.",
            tools=[add],
            model_settings={"temperature": 0.2},
            max_turns=8,
        )
        result = await agent.run("What is 2 + 3?")
        ```

        A provider configured in code, serving a model by name:

        ```python
        from agentfsm.providers.openai import OpenAIChatProvider

        ollama = OpenAIChatProvider(base_url="http://localhost:11434/v1")
        agent = Agent("llama3", provider=ollama)
        ```
    """

    __slots__ = (
        "_handlers",
        "_input",
        "_options",
        "_prefix",
        "_provider",
        "instructions",
        "model",
        "name",
        "tools",
    )

    # The overloads give the agent its output type (the last, what it takes).
    @overload
    def __init__(
        self: Agent[str],
        model: str | Provider,
        *,
        provider: Provider | None = None,
        name: str = "agent",
        instructions: str | None = None,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        model_settings: ModelSettings | None = None,
        output_type: None = None,
        streaming: bool = False,
        handlers: Sequence[InterceptionHandler] | InterceptionHandler = (),
        **options: Unpack[LoopOptionsDict],
    ) -> None: ...

    @overload
    def __init__(
        self: Agent[_ModelT],
        model: str | Provider,
        *,
        provider: Provider | None = None,
        name: str = "agent",
        instructions: str | None = None,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        model_settings: ModelSettings | None = None,
        output_type: type[_ModelT],
        streaming: bool = False,
        handlers: Sequence[InterceptionHandler] | InterceptionHandler = (),
        **options: Unpack[LoopOptionsDict],
    ) -> None: ...

    @overload
    def __init__(
        self: Agent[Any],
        model: str | Provider,
        *,
        provider: Provider | None = None,
        name: str = "agent",
        instructions: str | None = None,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        model_settings: ModelSettings | None = None,
        output_type: dict[str, Any],
        streaming: bool = False,
        handlers: Sequence[InterceptionHandler] | InterceptionHandler = (),
        **options: Unpack[LoopOptionsDict],
    ) -> None: ...

    def __init__(
        self,
        model: str | Provider,
        *,
        provider: Provider | None = None,
        name: str = "agent",
        instructions: str | None = None,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        model_settings: ModelSettings | None = None,
        output_type: type[BaseModel] | dict[str, Any] | None = None,
        streaming: bool = False,
        handlers: Sequence[InterceptionHandler] | InterceptionHandler = (),
        **options: Unpack[LoopOptionsDict],
    ) -> None:
        check("name", name, str, "a non-empty str")
        if not name:
            raise ArgumentValueError("an agent's name must be a non-empty str, got ''")
        check("instructions", instructions, str | None)
        check(
            "output_type",
            output_type,
            type | dict | None,
            "a pydantic model class, a JSON schema (dict) or None",
        )
        check("streaming", streaming, bool)
        self.name = name
        """The `agent_id` of the loops started from this agent."""
        self._provider, self._prefix, self.model = _model(model, provider, name)
        self.instructions = instructions
        """The system prompt of every loop."""
        self.tools: tuple[Tool, ...] = _tools(tools, name)
        """The tools every loop offers."""
        self._handlers = _handler_list(handlers, name)
        LoopOptions.of(options)  # bad options fail here, not at the first loop
        self._options: LoopOptionsDict = {**options}  # (the caller keeps theirs)
        settings = _settings(model_settings, name)
        try:
            # Built once: each loop's request is this one on its own context.
            self._input = InferenceInput(
                model=self.model,
                context=ModelContext(instructions=instructions),
                tools=self.tools,
                structured_output=output_type,
                streaming=streaming,
                **settings,
            )
        except ValidationError as exc:
            raise ConfigurationError(
                f"agent {name!r}: {format_validation_error(exc)}"
            ) from exc
        _check_tool_choice(self._input.tool_choice, self.tools, name)

    def __repr__(self) -> str:
        return f"Agent({self.model!r}, name={self.name!r}, tools={len(self.tools)})"

    @property
    def model_settings(self) -> ModelSettings:
        """The model settings every request goes out with (those set)."""
        values = self._input.model_dump(include=set(_SETTINGS), exclude_defaults=True)
        settings: ModelSettings = values  # type: ignore[assignment]
        return settings

    def request(self, context: ModelContext) -> InferenceInput:
        """The `InferenceInput` a loop of this agent runs on `context`.

        For `Runtime.run_loop` directly. The context gets the agent's
        instructions, if it has any (so agents taking turns on a conversation
        each speak with their own); otherwise it keeps its own.
        """
        check("context", context, ModelContext)
        if self.instructions is not None:
            context.instructions = self.instructions
        return self._input.model_copy(update={"context": context})

    def start(
        self,
        message: UserMessage | str | None,
        *,
        conversation: Conversation | None = None,
        runtime: Runtime | None = None,
        stream: bool = False,
        **options: Unpack[LoopOptionsDict],
    ) -> str:
        """Start a loop on `message` and return its `loop_id` at once.

        Args:
            message: the user's message (`None` continues the conversation,
                which must then end with a user message or a tool output).
            conversation: the conversation to continue (default: a new context
                for this loop alone).
            runtime: the runtime to run it on (default: the current one).
            stream: keep the loop's events for `runtime.events(loop_id)` (see
                `Runtime.run_loop`; `run_stream` does it for you).
            **options: loop options for this loop, over the agent's own.

        Raises:
            NoRuntimeError: no runtime given and none is current.
            ConfigurationError: the message or an option is wrong.
        """
        _call_checked(message, conversation, runtime)
        check("stream", stream, bool)
        return self._start(message, conversation, runtime, options, stream=stream)

    def _start(
        self,
        message: UserMessage | str | None,
        conversation: Conversation | None,
        runtime: Runtime | None,
        options: LoopOptionsDict,
        *,
        stream: bool,
        streaming: bool = False,
    ) -> str:
        """`start`, its arguments checked; `streaming`: take the streaming path
        whatever the agent says."""
        if runtime is None:
            try:
                runtime = current_runtime()
            except NoRuntimeError:
                raise NoRuntimeError(
                    "agent.start() needs a runtime: call it inside `async with "
                    "Runtime():`, pass runtime=, or use `await agent.run(...)`, "
                    "which opens one"
                ) from None
        if conversation is None:
            conversation = Conversation()
        merged: LoopOptionsDict = {**self._options, **options}
        if options:  # bad ones fail before the provider is registered
            LoopOptions.of(merged)
        self._register(runtime)
        request = self.request(conversation.context)
        if streaming and not request.streaming:
            request = request.model_copy(update={"streaming": True})
        loop_id = runtime.run_loop(
            self.name, message, request, self._handlers, stream=stream, **merged
        )
        conversation.loop_ids.append(loop_id)
        return loop_id

    async def run(
        self,
        message: UserMessage | str | None,
        *,
        conversation: Conversation | None = None,
        runtime: Runtime | None = None,
        raise_on_failure: bool = True,
        **options: Unpack[LoopOptionsDict],
    ) -> LoopResult[OutputT]:
        """Run a loop on `message` and return how it ended.

        On `runtime`, or the current one; without either, on a `Runtime` opened
        for this call (and closed after it).

        Args:
            message: the user's message (see `start`).
            conversation: the conversation to continue (see `start`).
            runtime: the runtime to run it on (see `start`).
            raise_on_failure: raise `LoopFailedError` for a loop that failed
                (the default); `False` returns its result, as for the other
                outcomes (`answered`, `stopped`, `aborted`, `cancelled`),
                which are always returned.
            **options: loop options for this loop, over the agent's own.

        Raises:
            LoopFailedError: the loop failed (a provider or tool error it could
                not get past: a wrong URL or key, say); its `result` is the
                loop's result.

        Example:
            ```python
            result = await agent.run("What is 2 + 3?")
            print(result.answer.content if result.answer else result.outcome)
            ```
        """
        _call_checked(message, conversation, runtime)
        check("raise_on_failure", raise_on_failure, bool)
        if runtime is None:
            with contextlib.suppress(NoRuntimeError):  # then one is opened here
                runtime = current_runtime()
        if runtime is None:
            async with Runtime() as own:
                result = await self._run(message, conversation, own, options)
        else:
            result = await self._run(message, conversation, runtime, options)
        # Raised here, out of the runtime this call opened: inside it, the
        # error would leave as an ExceptionGroup on trio.
        return _raised_for_failure(result) if raise_on_failure else result

    async def _run(
        self,
        message: UserMessage | str | None,
        conversation: Conversation | None,
        runtime: Runtime,
        options: LoopOptionsDict,
    ) -> LoopResult[OutputT]:
        loop_id = self.start(
            message, conversation=conversation, runtime=runtime, **options
        )
        return await runtime.wait(loop_id)

    def run_stream(
        self,
        message: UserMessage | str | None,
        *,
        conversation: Conversation | None = None,
        runtime: Runtime | None = None,
        raise_on_failure: bool = True,
        **options: Unpack[LoopOptionsDict],
    ) -> AbstractAsyncContextManager[StreamedRun[OutputT]]:
        """Run a loop on `message`, streaming: its events as they come, then
        its result.

        The loop takes the streaming path (each chunk of the model's text is an
        `inference.stream` event) whatever `streaming=` the agent was made
        with. It runs on `runtime`, or the current one, or one opened for the
        block (closed when it is left). Leaving the block before the loop ended
        cancels it, and drops the events not read; no event is missed however
        late the block starts reading (see `Runtime.events`).

        Args:
            message: the user's message (see `start`).
            conversation: the conversation to continue (see `start`).
            runtime: the runtime to run it on (see `start`).
            raise_on_failure: `StreamedRun.result()` raises `LoopFailedError`
                for a loop that failed (the default; see `run`).
            **options: loop options for this loop, over the agent's own.

        Returns:
            An async context manager giving a `StreamedRun`.

        Example:
            ```python
            async with agent.run_stream("Tell me a story.") as run:
                async for chunk in run.text_deltas():
                    print(chunk, end="", flush=True)
                result = await run.result()
            ```
        """
        _call_checked(message, conversation, runtime)
        check("raise_on_failure", raise_on_failure, bool)
        if options:  # bad ones fail here, not when the block is entered
            LoopOptions.of({**self._options, **options})
        return self._streamed(message, conversation, runtime, raise_on_failure, options)

    @contextlib.asynccontextmanager
    async def _streamed(
        self,
        message: UserMessage | str | None,
        conversation: Conversation | None,
        runtime: Runtime | None,
        raise_on_failure: bool,
        options: LoopOptionsDict,
    ) -> AsyncIterator[StreamedRun[OutputT]]:
        if runtime is None:
            with contextlib.suppress(NoRuntimeError):  # then one is opened here
                runtime = current_runtime()
        if runtime is None:
            async with (
                Runtime() as own,
                self._streamed(
                    message, conversation, own, raise_on_failure, options
                ) as streamed,
            ):
                yield streamed
            return
        loop_id = self._start(
            message, conversation, runtime, options, stream=True, streaming=True
        )
        run: StreamedRun[OutputT] = StreamedRun(
            runtime, loop_id, runtime.events(loop_id), raise_on_failure
        )
        try:
            yield run
        finally:
            run._close()

    def run_sync(
        self,
        message: UserMessage | str | None,
        *,
        conversation: Conversation | None = None,
        backend: Literal["asyncio", "trio"] = "asyncio",
        raise_on_failure: bool = True,
        **options: Unpack[LoopOptionsDict],
    ) -> LoopResult[OutputT]:
        """`run` for code that is not async: opens an event loop and a runtime.

        Raises:
            ConfigurationError: called from async code (await `run` there).
            LoopFailedError: the loop failed (unless `raise_on_failure=False`).
        """
        _call_checked(message, conversation, None)
        check("raise_on_failure", raise_on_failure, bool)
        one_of("backend", backend, ("asyncio", "trio"))
        try:
            anyio.get_current_task()
        except RuntimeError:  # no event loop runs here: as it should be
            pass
        else:
            raise ConfigurationError(
                "run_sync() was called inside a running event loop: "
                "use `await agent.run(...)` there"
            )
        run = partial(
            self.run,
            message,
            conversation=conversation,
            raise_on_failure=raise_on_failure,
            **options,
        )
        return anyio.run(run, backend=backend)

    def _register(self, runtime: Runtime) -> None:
        """Register the agent's provider object (if it has one) with `runtime`."""
        if self._provider is None:
            return
        registry = runtime.providers
        try:
            registered = registry.resolve(self.model)
        except AgentFSMError:  # not registered yet (UnknownProvider)
            registered = None
        if registered is not self._provider:
            registry.register(self._prefix, self._provider)


@final
class StreamedRun(Generic[OutputT]):
    """A loop `Agent.run_stream` started: iterate it for the loop's events as
    they come, from `loop.started` to `loop.idle`, then `await result()`.

    The events are the loop's own (`agentfsm.events`): the model's text chunks
    (`inference.stream`), tool calls, pauses (the stream goes on after
    `Runtime.resume`), the answer. Unread events wait in an unbounded buffer,
    so a slow reader never holds the loop; leaving the block drops them.

    A pause (a tool that `needs_approval`, a handler's `Pause`) lasts until
    `run.runtime.resume(run.loop_id, ...)`: iterating the run shows it
    (`loop.paused`), `text_deltas()` raises `LoopStateError` at it, and
    `result()` waits through it.

    Example:
        ```python
        async with agent.run_stream("What is 2 + 3?") as run:
            async for event in run:
                if event.type == "function_call.started":
                    print("calling", event.call.name)
            print((await run.result()).output)
        ```
    """

    __slots__ = ("_events", "_left", "_raise", "loop_id", "runtime")

    def __init__(
        self,
        runtime: Runtime,
        loop_id: str,
        events: Subscription,
        raise_on_failure: bool,
    ) -> None:
        self.runtime = runtime
        """The runtime the loop runs on (to `resume` it, `steer` it, ...)."""
        self.loop_id = loop_id
        """The loop's id."""
        self._events = events
        self._raise = raise_on_failure
        self._left = False
        """Whether the `run_stream` block was left (the events were dropped)."""

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> AgentEvent:
        if self._left:
            raise LoopStateError(_LEFT.format(self.loop_id))
        return await self._events.__anext__()

    def text_deltas(self) -> AsyncIterator[str]:
        """The model's text as it comes, chunk by chunk (each request's in
        turn; its reasoning and tool calls left out), until the loop ends.

        It reads the run's events, so those it passes over are not seen by
        `async for event in run`; breaking out of it leaves the rest unread.

        Raises:
            LoopStateError: the loop paused (a handler asked for approval):
                the message tells why. Resume it
                (`run.runtime.resume(run.loop_id, ...)`) and iterate
                `text_deltas()` again: it goes on after the pause.
        """
        if self._left:
            raise LoopStateError(_LEFT.format(self.loop_id))
        return _TextDeltas(self)

    async def result(self) -> LoopResult[OutputT]:
        """Wait for the loop to end (the events need not be read) and return its
        result; `result().output` is the answer's text, or its parse.

        A pause is not an end: while the loop is paused (a handler asked for
        approval), this waits until someone resumes it
        (`run.runtime.resume(run.loop_id, ...)`) and the loop ends. Where a
        pause may come, watch for it: read the events (`loop.paused`), or
        `text_deltas()`, which raises `LoopStateError` at a pause.

        Raises:
            LoopFailedError: the loop failed (unless `raise_on_failure=False`).
            LoopDetachedError: a durable loop stopped here without ending.
        """
        result: LoopResult[OutputT] = await self.runtime.wait(self.loop_id)
        return _raised_for_failure(result) if self._raise else result

    def _close(self) -> None:
        """The block was left: a loop still running or paused is cancelled, and
        the events not read are dropped (reading them now raises)."""
        self._left = True
        self._events.close()
        self._events.drain()  # (close() alone leaves the buffered ones readable)
        with contextlib.suppress(AgentFSMError):  # ended, forgotten, detached
            view = self.runtime.get(self.loop_id)
            if view.status is not LoopStatus.done:
                self.runtime.cancel(
                    self.loop_id, "the run_stream block was left before the loop ended"
                )

    def __repr__(self) -> str:
        return f"StreamedRun(loop_id={self.loop_id!r})"


_LEFT: Final = (
    "the run_stream block of loop {} was left: its events were dropped "
    "(read them inside the block)"
)


@final
class _TextDeltas:
    """`StreamedRun.text_deltas()`: an async iterator object rather than an
    async generator, so that breaking out of it leaves nothing unfinished (trio
    warns of an async generator collected before it was exhausted)."""

    __slots__ = ("_run",)

    def __init__(self, run: StreamedRun[Any]) -> None:
        self._run = run

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> str:
        from .events import InferenceStream, LoopPaused  # (loaded on first use)
        from .inference import TextDelta

        run = self._run
        while True:
            event = await run.__anext__()
            if isinstance(event, InferenceStream):
                if isinstance(event.delta, TextDelta):
                    return event.delta.text
            elif isinstance(event, LoopPaused):
                # Waiting would hang: a pause lasts until someone resumes it.
                raise LoopStateError(
                    f"loop {run.loop_id} paused ({event.reason}): no more text "
                    "comes until it is resumed. Resume it with "
                    "run.runtime.resume(run.loop_id, ...) (or end it with "
                    "run.runtime.cancel(run.loop_id)), then iterate "
                    "run.text_deltas() again: it goes on after the pause"
                )


def _raised_for_failure(result: LoopResult[OutputT]) -> LoopResult[OutputT]:
    """`result`, unless its loop failed: then `LoopFailedError`."""
    if result.outcome is Outcome.failed:
        error = result.error or ErrorInfo(type="Error", message=result.reason or "")
        raise LoopFailedError(result.loop_id, error, result=result)
    return result


def _call_checked(message: object, conversation: object, runtime: object) -> None:
    """Refuse arguments of `start`, `run` or `run_sync` of another type than
    they take, before a runtime is opened or a provider registered."""
    check("message", message, str | UserMessage | None)
    check("conversation", conversation, Conversation | None)
    check("runtime", runtime, Runtime | None)


def _model(
    model: str | Provider, provider: Provider | None, name: str
) -> tuple[Provider | None, str, str]:
    """`(provider object or None, its prefix, the model name)` of
    `Agent(model, provider=provider)`."""
    if provider is not None:
        if not isinstance(model, str) or not model:
            error = ArgumentValueError if isinstance(model, str) else ArgumentTypeError
            raise error(
                f"agent {name!r}: with provider=, model must be the name of the "
                f"model (e.g. 'llama3'), got {model!r}"
            )
        return _provider_object(provider, "provider", name, model)
    if isinstance(model, str):
        prefix, _ = split_model(model)  # a name without a prefix fails here
        return None, prefix, model
    return _provider_object(model, "model", name, name)


def _provider_object(
    provider: object, argument: str, name: str, model_name: str
) -> tuple[Provider, str, str]:
    if isinstance(provider, type) or not isinstance(provider, Provider):
        what = (
            "a 'provider:model' name or a provider"
            if argument == "model"
            else "a provider"
        )
        raise ArgumentTypeError(
            f"agent {name!r}: {argument} must be {what} object (with complete() "
            f"and stream()), got {provider!r}"
        )
    # A prefix of its own per agent: it never takes the place of another
    # provider. The model name follows it as it is (`llama3:8b` included: the
    # provider reads what follows the first colon).
    prefix = f"{type(provider).__name__.lower()}-{next(_prefixes)}"
    return provider, prefix, f"{prefix}:{model_name}"


def _tools(tools: Sequence[Tool | Callable[..., Any]], name: str) -> tuple[Tool, ...]:
    if isinstance(tools, Tool) or callable(tools):
        example = getattr(tools, "name", None) or getattr(tools, "__name__", "fn")
        raise ArgumentTypeError(
            f"agent {name!r}: tools must be a list of tools, e.g. tools=[{example}]"
        )
    given: object = tools  # (mypy holds it cannot be a str; a caller's can)
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        raise ArgumentTypeError(
            f"agent {name!r}: tools must be a list of tools, got {type(tools).__name__}"
        )
    made: list[Tool] = []
    for candidate in tools:
        if isinstance(candidate, Tool):
            made.append(candidate)
        elif callable(candidate):
            made.append(Tool.from_function(candidate))
        else:
            raise ArgumentTypeError(
                f"agent {name!r}: a tool must be a Tool or a function, got {candidate!r}"
            )
    names = [t.name for t in made]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigurationError(
            f"agent {name!r}: two tools are named {', '.join(map(repr, duplicates))}"
        )
    return tuple(made)


def _check_tool_choice(choice: str | None, tools: tuple[Tool, ...], name: str) -> None:
    """Refuse a `tool_choice` that forces a tool the agent does not have: each
    request would go out forcing it, and fail (or be ignored) at the provider."""
    names = [t.name for t in tools]
    if choice in (None, "auto", "none") or choice in names:
        return
    if choice == "required":
        if not names:
            raise ConfigurationError(
                f"agent {name!r}: tool_choice 'required' forces a tool call, "
                "but the agent has no tools"
            )
        return
    raise ConfigurationError(
        f"agent {name!r}: tool_choice {choice!r} is not one of its tools "
        f"(its tools: {', '.join(map(repr, names)) or 'none'}; or 'auto', "
        "'required', 'none')"
    )


def _handler_list(
    handlers: Sequence[InterceptionHandler] | InterceptionHandler, name: str
) -> tuple[InterceptionHandler, ...]:
    given: object = handlers  # (mypy holds it cannot be a str; a caller's can)
    if not callable(given) and (
        isinstance(given, str | bytes) or not isinstance(given, Sequence)
    ):
        raise ArgumentTypeError(
            f"agent {name!r}: handlers must be a callable or a list of callables, "
            f"got {type(given).__name__}"
        )
    found = (handlers,) if callable(handlers) else tuple(handlers)
    for handler in found:
        if not callable(handler):
            raise ArgumentTypeError(
                f"agent {name!r}: interception handler {handler!r} is not callable"
            )
    return found


def _settings(settings: ModelSettings | None, name: str) -> dict[str, Any]:
    """The `InferenceInput` fields of `model_settings`, checked by name."""
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise ArgumentTypeError(
            f"agent {name!r}: model_settings must be a dict, got {type(settings).__name__}"
        )
    unknown = set(settings) - _SETTINGS
    if unknown:
        raise ConfigurationError(
            f"agent {name!r}: unknown model settings: {', '.join(sorted(unknown))} "
            f"(known: {', '.join(sorted(_SETTINGS))})"
        )
    values: dict[str, Any] = dict(settings)
    # Forced on every turn, a tool would be called until max_turns: force it once.
    if values.get("tool_choice") not in (None, *_FORCING):
        values.setdefault("reset_tool_choice", "auto")
    return values
