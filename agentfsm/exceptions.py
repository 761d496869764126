"""Errors raised by agentfsm.

```text
AgentFSMError                  base for everything raised by agentfsm
├── ConfigurationError         the developer's mistake: bad table, duplicate tool, bad option
├── NoRuntimeError             agentfsm.run_loop() outside `async with Runtime()`
├── NoToolCallError            agentfsm.current_call() outside a tool call
├── UnknownLoopError           no loop with that id (never started, or forgotten)
├── LoopStateError             the call does not fit the loop's status (resume a running loop)
├── TemporalTimeout            a `LoopClient` call got no answer in time (no worker polls the queue)
├── TransitionError            carries loop_id, source, trigger
│   └── TransitionRejected     an interception Rewrite named an illegal edge or payload
├── LoopAborted                an interception handler returned Abort(reason)
├── LoopFailedError            a failed loop: Agent.run(), LoopResult.raise_for_outcome()
├── LoopTimeout                the loop ran past its deadline
├── TurnLimitExceeded          a handler took the loop past `max_turns`
├── StructuredOutputError      the answer kept failing `structured_output`
├── ToolError                  carries the tool name
│   ├── UnknownTool            the model asked for a tool the request does not offer
│   ├── ToolArgumentsError     the arguments did not validate
│   ├── ToolTimeout            the tool ran past its timeout
│   └── ToolCancelled          the call was interrupted: ToolCallContext.raise_if_cancelled()
├── ProviderError              the model provider failed
│   ├── UnknownProvider        no provider registered for a `provider:model` prefix
│   ├── OutputLimitExceeded    a model's output went past a loop limit (names it)
│   └── ProviderTimeout
├── BusFull                    publish_nowait() would have to wait for a backpressure subscriber
├── BusClosed                  subscribing to a closed bus
├── EventLogError              an event log could not be written, or holds a line that is no event
├── GraphvizError              graphviz's `dot` (SVG/PNG diagrams) is not installed or failed
└── StoreError                 a durable store could not be read or written (names it and the cause)
    ├── StoreSchemaError       not an agentfsm store, or one of another layout
    ├── LoopIdTakenError       a new loop's id is a stored loop's
    ├── LoopLockedError        another runtime holds the loop's lease
    │   └── LeaseLostError     this runtime's lease is stale: another took the loop, or it ended
    └── LoopDetachedError      `wait()`: the loop stopped in this runtime without ending
```

Errors inside a loop never escape into the runtime's task group: the loop takes
its `fail` edge to `idle`, and its result carries the error type and message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .states import LoopState, Trigger

if TYPE_CHECKING:
    from .results import ErrorInfo, LoopResult

__all__ = (
    "AgentFSMError",
    "BusClosed",
    "BusFull",
    "ConfigurationError",
    "EventLogError",
    "GraphvizError",
    "LeaseLostError",
    "ImageMissing",
    "ImageNotSupported",
    "LoopDetachedError",
    "LoopIdTakenError",
    "LoopLockedError",
    "LoopAborted",
    "LoopFailedError",
    "LoopStateError",
    "LoopTimeout",
    "TurnLimitExceeded",
    "NoRuntimeError",
    "NoToolCallError",
    "OutputLimitExceeded",
    "ProviderError",
    "ProviderTimeout",
    "StoreError",
    "StoreSchemaError",
    "StructuredOutputError",
    "ToolArgumentsError",
    "ToolCancelled",
    "ToolError",
    "ToolTimeout",
    "TransitionError",
    "TemporalTimeout",
    "TransitionRejected",
    "UnknownLoopError",
    "UnknownProvider",
    "UnknownTool",
)


class AgentFSMError(Exception):
    """Base class for every error agentfsm raises."""


class ConfigurationError(AgentFSMError):
    """The developer's mistake: an invalid table, option, tool or handler."""


class ImageNotSupported(ConfigurationError):
    """A model cannot take an image where a message puts it.

    Raised before the message enters the context: nothing is appended and
    nothing is sent.

    Attributes:
        model: the model that cannot take the image.
        capability: what it lacks (`images in user messages`, `images by URL`,
            `images over 5,242,880 bytes`).
        block: which block, as text shows it (`content[1] [image: image/png, ...]`).
    """

    def __init__(
        self, message: str, *, model: str, capability: str, block: str
    ) -> None:
        super().__init__(message)
        self.model = model
        self.capability = capability
        self.block = block


class ImageMissing(AgentFSMError):
    """A request holds an image by reference (`ImageBlock.as_reference`) whose
    bytes were not read back: it cannot be sent. The message names the image."""


class NoRuntimeError(AgentFSMError):
    """`agentfsm.run_loop()` was called outside `async with Runtime()`."""


class NoToolCallError(AgentFSMError, LookupError):
    """`agentfsm.current_call()` was called outside a tool call."""


class UnknownLoopError(AgentFSMError, KeyError):
    """No loop with that id is known to the runtime."""

    def __init__(self, loop_id: str) -> None:
        super().__init__(f"no loop {loop_id!r} in this runtime")
        self.loop_id = loop_id

    def __str__(self) -> str:
        return str(self.args[0])


class LoopStateError(AgentFSMError):
    """The call does not fit the loop's current status."""


class TemporalTimeout(AgentFSMError, TimeoutError):
    """A `LoopClient` call got no answer within the client's `timeout`.

    Queries (`get`, `transcript`) and updates (`resume`, `approve`) are
    answered by a worker of the loop's task queue: this error says none polled
    it in time (none is up, or all are busy). Signals and starts need only the
    server: for them, it did not answer.

    Attributes:
        loop_id: the loop the call was about.
        call: the `LoopClient` method.
        timeout: the seconds it waited.
    """

    def __init__(
        self, message: str, *, loop_id: str, call: str, timeout: float
    ) -> None:
        super().__init__(message)
        self.loop_id = loop_id
        self.call = call
        self.timeout = timeout


class TransitionError(AgentFSMError):
    """A transition could not be taken."""

    def __init__(
        self, message: str, *, loop_id: str, source: LoopState, trigger: Trigger
    ) -> None:
        super().__init__(message)
        self.loop_id = loop_id
        self.source = source
        self.trigger = trigger


class TransitionRejected(TransitionError):
    """An interception `Rewrite` named an edge or a payload the machine does not allow."""

    def __init__(
        self,
        message: str,
        *,
        loop_id: str,
        source: LoopState,
        trigger: Trigger,
        dest: LoopState,
    ) -> None:
        super().__init__(message, loop_id=loop_id, source=source, trigger=trigger)
        self.dest = dest


class LoopAborted(AgentFSMError):
    """An interception handler returned `Abort(reason)`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LoopFailedError(AgentFSMError):
    """A loop failed: raised by `Agent.run` and `LoopResult.raise_for_outcome()`."""

    def __init__(
        self, loop_id: str, error: ErrorInfo, *, result: LoopResult | None = None
    ) -> None:
        super().__init__(f"loop {loop_id} failed: {error.type}: {error.message}")
        self.loop_id = loop_id
        self.error = error
        """The type and message of the error the loop failed with."""
        self.result = result
        """The loop's result (its path, usage, ...), when the raiser had it."""


class ToolError(AgentFSMError):
    """A tool call failed; inside a loop it becomes an error output."""

    def __init__(self, message: str, *, tool: str) -> None:
        super().__init__(message)
        self.tool = tool


class UnknownTool(ToolError):
    """The model asked for a tool that the request does not offer."""


class ToolArgumentsError(ToolError):
    """The arguments of a tool call did not validate."""


class ToolTimeout(ToolError):
    """A tool call ran past its timeout."""


class ToolCancelled(ToolError):
    """The tool call was interrupted (its loop was cancelled, or it ran past its
    timeout): raised by `ToolCallContext.raise_if_cancelled()`, so that a sync
    tool's thread, which runs on after the interruption, can stop."""


class ProviderError(AgentFSMError):
    """The model provider failed.

    Attributes:
        retryable: whether retrying the same request may succeed (rate limits,
            timeouts, 5xx).
        status_code: the HTTP status the provider answered with, when there was one.
    """

    def __init__(
        self, message: str, *, retryable: bool = False, status_code: int | None = None
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status_code = status_code


class OutputLimitExceeded(ProviderError):
    """A model's output went past one of the loop's limits (`LoopOptions`:
    `max_output_calls`, `max_output_chars`, `max_stream_seconds`).

    Attributes:
        limit: the name of the limit.
    """

    def __init__(self, message: str, *, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class UnknownProvider(ProviderError):
    """No provider is registered for the prefix of a `provider:model` string."""


class ProviderTimeout(ProviderError):
    """The provider did not answer in time."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class BusClosed(AgentFSMError):
    """The bus was closed (the runtime exited)."""


class BusFull(AgentFSMError):
    """`publish_nowait()` would have to wait for a backpressure subscriber."""


class LoopTimeout(AgentFSMError):
    """The loop ran past its `deadline`."""


class TurnLimitExceeded(AgentFSMError):
    """A handler took the loop on to a model request past its `max_turns`.

    `max_turns` counts every model request, whatever edge led to it: the loop
    stops by itself when it reaches the limit, and a handler that rewrites the
    transitions after that (a `finish` into `context_update`, a `stop` into
    `inference`) fails it here instead of making the request. For a limit a
    handler may lift, use a stop condition (`stop_when`).
    """


class StructuredOutputError(AgentFSMError):
    """The model's answer did not validate against `structured_output`, retries included."""


class EventLogError(AgentFSMError):
    """An event log could not be written, or holds a line that is not an event."""


class GraphvizError(AgentFSMError):
    """Graphviz's `dot` program, which renders SVG and PNG diagrams, is missing or failed."""


class StoreError(AgentFSMError):
    """A durable store could not be read or written. The message names the
    store (its file or server) and the cause."""


class StoreSchemaError(StoreError):
    """The store was written by another version of agentfsm's store layout, or
    is not an agentfsm store at all (it is left as it was)."""


class LoopIdTakenError(StoreError):
    """A new loop's id is a loop's the store holds already (an id source,
    `Runtime(ids=...)`, gave it again): the new loop fails, and the store's
    loop is left as it was."""

    def __init__(self, loop_id: str) -> None:
        super().__init__(
            f"loop id {loop_id!r} is a loop's the store holds already: loop ids "
            "must be unique across runtimes and restarts (an id source, "
            "Runtime(ids=...), gave it again)"
        )
        self.loop_id = loop_id


class LoopLockedError(StoreError):
    """Another runtime holds the loop's lease: two runtimes never run one loop."""

    def __init__(self, loop_id: str, owner: str, message: str | None = None) -> None:
        super().__init__(
            message
            or (
                f"loop {loop_id} is owned by another runtime ({owner}); it runs "
                "there until that runtime exits or its lease expires"
            )
        )
        self.loop_id = loop_id
        self.owner = owner


class LeaseLostError(LoopLockedError):
    """This runtime's lease on the loop is stale: another runtime took the loop
    since (its epoch grew), or the loop ended. The loop stops in this process
    and writes nothing more; it goes on (or went on) where it was taken."""

    def __init__(self, loop_id: str, owner: str, why: str) -> None:
        super().__init__(
            loop_id,
            owner,
            f"this runtime's lease on loop {loop_id} is stale: {why}; the loop "
            "stopped here and writes nothing more",
        )


class LoopDetachedError(StoreError):
    """`Runtime.wait` (and `get`) of a durable loop that stopped in this runtime
    without ending: its store could not take a write (`cause` is the store's
    error, naming the store and why), another runtime took it (`cause` is a
    `LeaseLostError`), or the runtime closed while it ran (`cause` None). The
    store keeps the loop as of its last commit; `Runtime.recover` (here or in
    another process) goes on from there. Never an outcome the store does not
    hold."""

    def __init__(self, loop_id: str, reason: str, cause: StoreError | None) -> None:
        super().__init__(
            f"loop {loop_id} stopped in this runtime without ending: {reason}; its "
            "store keeps it as of its last commit, and recover() goes on from there"
        )
        self.loop_id = loop_id
        self.reason = reason
        self.cause = cause
