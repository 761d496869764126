"""The activities: each model request, each tool body, each I/O handler.

They run in the worker's ordinary event loop (not in workflow code), so they
may do anything: call the provider, run the tool, reach a database. A model
call heartbeats while it works, and so does a tool that opted in (its
`ToolActivityOptions.heartbeat_timeout`), so that a lost worker is noticed
within the heartbeat timeout and the attempt runs again on another worker; a
tool's progress reports are heartbeats too.
"""

from __future__ import annotations

import contextvars
import copy
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol, TypeVar, runtime_checkable

import anyio
from pydantic import TypeAdapter
from temporalio import activity
from temporalio.exceptions import ApplicationError

from agentfsm._errors import error_text
from agentfsm._loop.bounds import checked_tool_images, checked_tool_output
from agentfsm._loop.intercept import call_handler
from agentfsm.events import ToolSpec
from agentfsm.exceptions import ProviderError
from agentfsm.inference import (
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
    UsageUpdate,
)
from agentfsm.interception import Decision, PendingTransition
from agentfsm.messages import (
    ContextItem,
    FunctionCallOutputItem,
    ImageBlock,
    ModelContext,
)
from agentfsm.options import LoopOptions
from agentfsm.providers import Provider, ProviderRegistry
from agentfsm.tools import (
    Tool,
    ToolCallContext,
    ToolDefinition,
    ToolResult,
)

from ._agent import LocalActivityHandler, TemporalAgent
from ._contexts import StoreContexts
from ._rebuild import carried_prefix, history_prefix, holds
from ._wire import (
    CONTEXT_MISSING,
    IMAGE_MISSING,
    MAX_ERROR_TEXT,
    MAX_MODEL_OUTPUT,
    MAX_PAYLOAD,
    MAX_PROGRESS,
    NOT_SHARED,
    OUTPUT_MISSING,
    CarriedArgs,
    CarriedPage,
    ContextArgs,
    ErrorData,
    ImagesArgs,
    ImagesHeld,
    InferArgs,
    InferResult,
    ToolArgs,
    ToolOutcome,
    clipped,
    dump,
    images_of,
    output_reference,
    payload_size,
    referenced,
    with_images,
)

__all__ = (
    "Chunk",
    "ContextStore",
    "ImageStore",
    "MemoryContextStore",
    "SharedContextStore",
    "activities_for",
)

T = TypeVar("T")


class ContextStore(Protocol):
    """Where inference activities keep each loop's context between requests,
    so that a request carries only the items added since the last one.

    A store every worker reads (a database) does not miss when the server
    dispatches a loop's requests to several workers; a store of one worker's
    own misses each time another worker served the loop's previous request,
    and the worker then reads the workflow's history to rebuild the prefix.
    Either way a miss is only slower, never wrong: a prefix is used only when
    its digest matches.
    """

    async def get(self, loop_id: str) -> tuple[list[ContextItem], list[str]] | None:
        """The items held for the loop and the chain digest after each."""
        ...

    async def put(
        self, loop_id: str, items: list[ContextItem], digests: list[str]
    ) -> None:
        """Hold `items` (and their digests) as the loop's context."""
        ...


class MemoryContextStore:
    """A `ContextStore` in the worker's memory, the most recent `max_loops`
    loops.

    With several workers, the server dispatches each request to any of them,
    so a worker misses whenever another served the loop's previous request
    (often: half a loop's requests with two workers), not once per worker and
    loop; after a restart it misses each loop's next request. A miss is
    rebuilt from the workflow's history (read backwards, only as far as what
    this store still holds of the loop: `rebuild.history_prefix`), and only
    when that fails is it refused, so that the workflow sends the whole
    context. `StoreContexts`, which every worker reads, does not miss.
    """

    def __init__(self, max_loops: int = 1_000) -> None:
        self.max_loops = max_loops
        self._loops: OrderedDict[str, tuple[list[ContextItem], list[str]]] = (
            OrderedDict()
        )
        self.misses = 0
        """How many requests referred to a prefix this store did not hold."""
        self.rebuilt = 0
        """How many of those misses were rebuilt from the workflow's history
        (the others were refused: the workflow sent the whole context)."""

    async def get(self, loop_id: str) -> tuple[list[ContextItem], list[str]] | None:
        entry = self._loops.get(loop_id)
        if entry is not None:
            self._loops.move_to_end(loop_id)
        return entry

    async def put(
        self, loop_id: str, items: list[ContextItem], digests: list[str]
    ) -> None:
        self._loops[loop_id] = (items, digests)
        self._loops.move_to_end(loop_id)
        while len(self._loops) > self.max_loops:
            self._loops.popitem(last=False)


@runtime_checkable
class SharedContextStore(ContextStore, Protocol):
    """A `ContextStore` every worker reads (`StoreContexts`): large values go
    through it by reference instead of inline in Temporal's payloads. A store
    of one worker's own must not have these members: a reference it wrote
    could not be read on another worker."""

    by_reference: int
    """Tool outputs larger than this many bytes (as JSON) go by reference."""

    async def put_output(self, key: str, output: str) -> None:
        """Keep a tool output under `key` (writing it again is harmless)."""
        ...

    async def output(self, key: str) -> str | None:
        """The tool output kept under `key`, or None."""
        ...


@runtime_checkable
class ImageStore(Protocol):
    """A `SharedContextStore` that keeps images (`StoreContexts`): each
    image's bytes are kept once, by their digest, and the workflow's payloads
    carry a reference instead (`ImageBlock.as_reference`). With any other
    store, images go inline, in the payloads that first carry them."""

    async def put_image(self, block: ImageBlock) -> None:
        """Keep a block's bytes under its digest (writing it again is harmless)."""
        ...

    async def image(self, digest: str) -> ImageBlock | None:
        """The image kept under `digest`, or None."""
        ...


def _image_store(store: ContextStore) -> ImageStore | None:
    """`store`, when it keeps images for every worker."""
    if isinstance(store, SharedContextStore) and isinstance(store, ImageStore):
        return store
    return None


class Chunk(Protocol):
    """Called with each streamed delta of a model request, in the activity.

    `attempt` is the activity's attempt number: a retried request streams its
    chunks again, from index 0, with a higher attempt.
    """

    def __call__(
        self, loop_id: str, request: int, attempt: int, index: int, delta: Any
    ) -> object: ...


def _spec_tool(spec: ToolSpec) -> Tool:
    """A stand-in `Tool` that only describes itself: what a provider reads
    (the model sees its name, description and schema). Its body never runs
    here; the workflow runs calls as their own activities."""
    return Tool.from_definition(
        ToolDefinition(
            name=spec.name, description=spec.description, parameters=spec.parameters
        ),
        _never_here,
        timeout=spec.timeout,
        execution_mode=spec.execution_mode,
    )


async def _never_here(**arguments: Any) -> Any:
    raise AssertionError("a stand-in tool never runs in the activity")


async def _context(args: InferArgs, store: ContextStore) -> list[ContextItem]:
    """The request's whole context: the prefix the store holds, then the
    items sent. A prefix the store does not hold is rebuilt from the
    workflow's history; the request is refused (the workflow then sends the
    whole context) only when that fails too."""
    if args.base == 0:
        items, digests = list(args.items), list(args.digests)
    else:
        held = await store.get(args.loop_id)
        if not _continues(held, args):
            counted = (
                store if isinstance(store, MemoryContextStore | StoreContexts) else None
            )
            if counted is not None:
                counted.misses += 1
            held = await history_prefix(args, held)
            if not _continues(held, args):
                raise ApplicationError(
                    f"loop {args.loop_id}: this worker's context store does not "
                    f"hold the request's first {args.base} items",
                    type=CONTEXT_MISSING,
                    non_retryable=True,
                )
            if counted is not None:
                counted.rebuilt += 1
        assert held is not None
        items = held[0][: args.base] + list(args.items)
        digests = held[1][: args.base] + list(args.digests)
    await store.put(args.loop_id, items, digests)
    return items


def _continues(
    held: tuple[list[ContextItem], list[str]] | None, args: InferArgs
) -> bool:
    """Whether `held` is (or starts with) the prefix the request refers to."""
    return holds(held, args.base, args.base_digest)


async def _heartbeating(
    work: Awaitable[T],
    every: float | None,
    beat: Callable[[], None] = activity.heartbeat,
) -> T:
    """Await `work`, calling `beat` (a heartbeat) every `every` seconds
    meanwhile (a cancellation of the activity, which Temporal delivers with a
    heartbeat's answer, cancels `work`)."""
    if every is None:
        return await work
    outcome: list[T] = []
    failure: list[BaseException] = []

    async def run() -> None:
        try:
            outcome.append(await work)
        except Exception as exc:  # noqa: BLE001 - re-raised below, not as a group
            failure.append(exc)
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        while True:
            await anyio.sleep(every)
            beat()
    if failure:
        raise failure[0]
    return outcome[0]


def _beat(timeout: timedelta | None) -> float | None:
    return None if timeout is None else max(timeout.total_seconds() / 3, 0.05)


class _Beats:
    """A tool activity's heartbeats: each progress report the tool makes is
    one, with the progress as its details (the `_Publisher` a
    `ToolCallContext` reports through); a timer's beat repeats the last
    report's details, since each heartbeat replaces the details Temporal
    holds.

    A report the worker's converter cannot encode, or over `MAX_PROGRESS`
    bytes, is refused where it is made (`report_progress` returns False, the
    activity's log says why once): a heartbeat that fails to encode would
    cancel the activity, and with it the call."""

    __slots__ = ("_context", "_warned", "details")

    def __init__(self) -> None:
        # The activity's context: a report hopping from a sync tool's thread
        # runs in the event loop outside it, where `heartbeat()` cannot run.
        self._context = contextvars.copy_context()
        self._warned = False
        self.details: tuple[Any, ...] = ()

    def beat(self) -> None:
        self._context.run(activity.heartbeat, *self.details)

    def emit(self, event_type: Any, /, **fields: Any) -> bool:
        progress = fields["progress"]
        problem = self._context.run(_unsendable, progress)
        if problem is not None:
            if not self._warned:
                self._warned = True
                self._context.run(
                    activity.logger.warning,
                    "a progress report of tool call %s was refused (and any "
                    "later one like it): %s",
                    fields.get("call_id"),
                    problem,
                )
            return False
        self.details = (progress,)
        self.beat()
        return True


def _unsendable(progress: Any) -> str | None:
    """Why `progress` cannot be a heartbeat's details (None: it can)."""
    try:
        (payload,) = activity.payload_converter().to_payloads([progress])
    except Exception as exc:  # noqa: BLE001 - any converter's refusal
        return (
            f"the worker's converter cannot encode a {type(progress).__name__} "
            f"(progress must be JSON data): {clipped(error_text(exc), 500)}"
        )
    size = payload.ByteSize()
    if size > MAX_PROGRESS:
        return f"it takes {size:,} bytes, over the {MAX_PROGRESS:,} bytes allowed"
    return None


def activities_for(
    agents: Mapping[str, TemporalAgent],
    providers: ProviderRegistry,
    store: ContextStore,
    on_chunk: Chunk | None,
    *,
    task_queue: str | None = None,
    workflows: bool = True,
) -> list[Callable[..., Any]]:
    """The activities the agents' workflows call (named after the agent) that
    a worker polling `task_queue` runs: with `workflows`, the model calls,
    the handlers and the tools on the loops' own queue; and the tools routed
    to `task_queue` by their options (None: every tool, whatever its queue)."""
    found: list[Callable[..., Any]] = []
    for agent in agents.values():
        if workflows:
            found.append(_infer(agent, providers, store, on_chunk))
            found.append(_hand_over(agent, store))
            found.append(_carried(agent, store))
            found.append(_images(agent, store))
        for t in agent.tools:
            routed = agent.activity_options(t).task_queue
            if (
                task_queue is None
                or routed == task_queue
                or (routed is None and workflows)
            ):
                found.append(_tool(agent, t, store))
        if workflows:
            found.extend(
                _handler(agent, h)
                for h in agent.handlers
                if isinstance(h, LocalActivityHandler)
            )
    return found


def _infer(
    agent: TemporalAgent,
    providers: ProviderRegistry,
    store: ContextStore,
    on_chunk: Chunk | None,
) -> Callable[..., Any]:
    every = _beat(agent.model_heartbeat)

    async def infer(data: dict[str, Any]) -> dict[str, Any]:
        args = InferArgs.model_validate(data)
        items = await _resolve(await _context(args, store), args.loop_id, store)
        items = await _with_bytes(items, args.loop_id, store)
        request = InferenceInput(
            model=args.model,
            context=ModelContext(instructions=args.instructions, items=items),
            tools=tuple(_spec_tool(s) for s in args.tools),
            structured_output=args.structured_output,
            streaming=args.streaming,
            **args.settings,  # type: ignore[arg-type]
        )
        try:
            provider = providers.resolve(args.model)
            if args.streaming:
                work = _stream(provider, request, args, on_chunk)
            else:
                work = provider.complete(request)
            output = await _heartbeating(work, every)
        except ProviderError as exc:
            # Bounded: the loop's result and a failed workflow carry it again.
            error = ErrorData(
                type=type(exc).__name__,
                message=clipped(error_text(exc)),
                retryable=exc.retryable,
                status_code=exc.status_code,
            )
            return dump(InferResult(error=error))
        except Exception as exc:
            # Any other error fails the attempt (Temporal retries it by
            # `model_retry`); its text bounded too, which the SDK's would not be.
            message = error_text(exc)
            if payload_size(message) <= MAX_ERROR_TEXT:
                raise
            raise ApplicationError(clipped(message), type=type(exc).__name__) from None
        result = dump(InferResult(output=output))
        size = payload_size(result)
        if size > MAX_MODEL_OUTPUT:
            # Refused here, before it enters the history: the loop's result
            # carries an answer twice, and must fit in one payload.
            error = ErrorData(
                type="PayloadTooLarge",
                message=(
                    f"the output of {args.model!r} is {size:,} bytes as JSON, over "
                    f"the {MAX_MODEL_OUTPUT:,} bytes a model output may take on "
                    f"Temporal (the loop's result carries an answer twice, and "
                    f"a payload may carry {MAX_PAYLOAD:,} bytes)"
                ),
            )
            return dump(InferResult(error=error))
        return result

    return activity.defn(name=f"agentfsm.{agent.name}.infer")(infer)


async def _stream(
    provider: Provider,
    request: InferenceInput,
    args: InferArgs,
    on_chunk: Chunk | None,
) -> InferenceOutput:
    """Consume the stream here, in the activity: its chunks go to `on_chunk`
    (with the attempt number), only the output goes back to the workflow."""
    attempt = activity.info().attempt
    output: InferenceOutput | None = None
    index = 0
    async with provider.stream(request) as deltas:
        async for delta in deltas:
            if isinstance(delta, OutputCompleted):
                output = delta.output
                continue
            if isinstance(delta, UsageUpdate):
                continue  # a chunk's usage is the output's, sent back whole
            if on_chunk is not None:
                on_chunk(args.loop_id, args.request, attempt, index, delta)
            index += 1
    if output is None:
        raise ProviderError(
            f"the stream from {args.model!r} ended without a completed output"
        )
    return output


def _tool(agent: TemporalAgent, tool: Tool, store: ContextStore) -> Callable[..., Any]:
    limits = LoopOptions.of(dict(agent.options))  # type: ignore[arg-type]
    every = _beat(agent.activity_options(tool).heartbeat_timeout)
    # The tool's timeout is the activity's start-to-close timeout (Temporal
    # ends the attempt, and retries it by the tool's crash policy): the copy
    # run here has none of its own, which would end the call first, as an
    # error output that no retry policy sees.
    tool = copy.copy(tool)
    tool.timeout = None

    async def run(data: dict[str, Any]) -> dict[str, Any]:
        args = ToolArgs.model_validate(data)
        # What `agentfsm.current_call()` says in the tool, as in a process:
        # the loop's call, its idempotency key; its progress reports are
        # heartbeats, the progress in their details (the loop is in the
        # workflow, which publishes no event for them).
        running = ToolCallContext(
            args.loop_id,
            args.agent_id,
            args.call_id,
            args.name,
            args.request,
            args.position,
            args.arguments,
            args.idempotency_key,
        )
        beats = _Beats()
        token = running.activate(beats)
        returned = False
        try:
            result = await _heartbeating(tool.invoke(args.arguments), every, beats.beat)
            returned = True
        except Exception as exc:  # noqa: BLE001 - a raising tool is an error output
            returned = True
            result = ToolResult.error(
                f"tool {args.name!r} raised {type(exc).__name__}: {error_text(exc)}"
            )
        finally:
            # A late report is dropped, not a beat; cancelled, a sync tool's
            # thread may run on, and is told.
            running.deactivate(token, returned=returned)
        output, is_error, images = result.output, result.is_error, result.images
        if images:  # checked here too: they cross the boundary before the loop's check
            output, is_error, images = checked_tool_images(
                args.name, output, is_error, images
            )
        try:
            images = await _referred(images, store)
        except Exception as exc:  # noqa: BLE001 - the model sees why, the loop goes on
            # Not raised: a retried activity would run the tool again.
            output = (
                f"tool {args.name!r} returned {len(images)} image(s), which could "
                f"not be stored by reference: {clipped(error_text(exc))}"
            )
            is_error, images = True, ()
        outcome = ToolOutcome(
            output=output, is_error=is_error, terminate=result.terminate, images=images
        )
        fitted = await _fit(outcome, args, store, limits)
        return fitted.model_dump(mode="json", exclude_none=True)

    return activity.defn(name=f"agentfsm.{agent.name}.tool.{tool.name}")(run)


async def _referred(
    images: tuple[ImageBlock, ...], store: ContextStore
) -> tuple[ImageBlock, ...]:
    """A tool's images as they cross to the workflow: kept in a store that
    keeps images, and references to them returned; as they are, otherwise."""
    keeper = _image_store(store)
    if keeper is None or not images:
        return images
    for block in images:
        if block.data is not None:
            await keeper.put_image(block)
    return tuple(block.as_reference() for block in images)


async def _fit(
    outcome: ToolOutcome, args: ToolArgs, store: ContextStore, limits: LoopOptions
) -> ToolOutcome:
    """The outcome as it can cross Temporal's boundary: its output kept in a
    store every worker reads, and a reference to it returned, when it is over
    the store's `by_reference` or its outcome would not fit in a payload; an
    error output naming the size and the limit when it does not fit and no
    such store is configured."""
    size = payload_size(outcome.output)
    fits = payload_size(dump(outcome)) <= MAX_PAYLOAD  # the outcome, as returned
    if isinstance(store, SharedContextStore) and (
        size > store.by_reference or not fits
    ):
        # The loop's own checks, here: the workflow sees only the reference.
        output, is_error = checked_tool_output(
            args.name, outcome.output, outcome.is_error, limits
        )
        checked = ToolOutcome(
            output=output,
            is_error=is_error,
            terminate=outcome.terminate,
            images=outcome.images,
        )
        if payload_size(output) <= store.by_reference and (
            payload_size(dump(checked)) <= MAX_PAYLOAD
        ):  # replaced by the check's error
            return checked
        key = hashlib.sha256(f"{args.loop_id}\0{output}".encode()).hexdigest()
        try:
            await store.put_output(key, output)
        except Exception as exc:  # noqa: BLE001 - the model sees why, the loop goes on
            return ToolOutcome(
                output=f"tool {args.name!r} returned {size:,} bytes, which could not "
                f"be stored by reference: {clipped(error_text(exc))}",
                is_error=True,
            )
        return ToolOutcome(
            output=output_reference(key, output),
            is_error=is_error,
            terminate=outcome.terminate,
            stored=len(output.encode()),
            images=outcome.images,
        )
    if fits:
        return outcome
    if (
        outcome.images
        and payload_size(dump(outcome.model_copy(update={"images": ()}))) <= MAX_PAYLOAD
    ):
        pictured = sum(b.size or 0 for b in outcome.images)
        return ToolOutcome(
            output=f"tool {args.name!r} returned {len(outcome.images)} image(s) of "
            f"{pictured:,} bytes in all, over the {MAX_PAYLOAD:,} bytes one "
            "Temporal payload may carry with its output; the images were "
            "dropped. With a context store every worker reads (StoreContexts), "
            "images go by reference instead.",
            is_error=True,
        )
    return ToolOutcome(
        output=f"tool {args.name!r} returned {size:,} bytes (as JSON), over the "
        f"{MAX_PAYLOAD:,} bytes one Temporal payload may carry; the output was "
        "dropped. With a context store every worker reads (StoreContexts), a "
        "large output goes by reference instead.",
        is_error=True,
    )


async def _resolve(
    items: list[ContextItem], loop_id: str, store: ContextStore
) -> list[ContextItem]:
    """The context with each tool output stored by reference put back whole,
    as the model is to see it (the store keeps the references: the chain
    digests are the workflow's, over the items it holds).

    Never the stand-in text in place of an output: a reference this worker
    cannot read (its store is its own, the tool ran on a worker with
    `StoreContexts`; the store lost it) fails the request, saying why."""
    resolved: list[ContextItem] = []
    for item in items:
        if isinstance(item, FunctionCallOutputItem) and (
            key := referenced(item.output)
        ):
            if not isinstance(store, SharedContextStore):
                raise ApplicationError(
                    f"loop {loop_id}: the output of call {item.call_id!r} was "
                    f"stored by reference ({key}) by a worker with a shared "
                    f"context store, but this worker's store is its own "
                    f"({type(store).__name__}), which cannot read it: give every "
                    "worker of the loop's agent the same StoreContexts",
                    type=OUTPUT_MISSING,
                    non_retryable=True,
                )
            output = await store.output(key)
            if output is None:
                raise ApplicationError(
                    f"loop {loop_id}: the context store does not hold the output "
                    f"of call {item.call_id!r}, stored by reference ({key})",
                    type=OUTPUT_MISSING,
                    non_retryable=True,
                )
            item = item.model_copy(update={"output": output})
        resolved.append(item)
    return resolved


async def _with_bytes(
    items: list[ContextItem], loop_id: str, store: ContextStore
) -> list[ContextItem]:
    """The context with each image by reference (`ImageBlock.as_reference`)
    put back as its bytes (`ImageBlock.with_data`), read from the store by
    digest (the store keeps the references, as it keeps the items the
    workflow sent).

    Never the reference in place of the image: one this worker cannot read
    (its store keeps no images; the store lost it, or its bytes no longer
    match the reference) fails the request, naming the image, as a
    provider's `ImageMissing` would."""
    wanted = dict.fromkeys(
        block for item in items for block in images_of(item) if block.is_reference
    )
    if not wanted:
        return items
    keeper = _image_store(store)
    if keeper is None:
        first = next(iter(wanted))
        raise ApplicationError(
            f"loop {loop_id}: the context holds {len(wanted)} image(s) by "
            f"reference ({first.reference}, ...), whose bytes were not read back: "
            f"this worker's store ({type(store).__name__}) keeps no images, so "
            "the request cannot send them; give every worker of the loop's agent "
            "the same StoreContexts",
            type=IMAGE_MISSING,
            non_retryable=True,
        )
    read: dict[str, bytes] = {}
    found: dict[ImageBlock, ImageBlock] = {}
    for reference in wanted:
        digest = reference.digest
        assert digest is not None  # a reference validates with its digest
        data = read.get(digest)
        if data is None:
            data = await _image_bytes(keeper, reference, digest, loop_id)
            read[digest] = data
        try:
            found[reference] = reference.with_data(data)
        except ValueError as exc:
            raise ApplicationError(
                f"loop {loop_id}: the bytes the context store holds for image "
                f"{digest} are not those of {reference.reference}, so the "
                f"request cannot send it: {clipped(error_text(exc), 2000)}",
                type=IMAGE_MISSING,
                non_retryable=True,
            ) from None
    return with_images(items, lambda b: found.get(b, b) if b.is_reference else b)


async def _image_bytes(
    keeper: ImageStore, reference: ImageBlock, digest: str, loop_id: str
) -> bytes:
    """The bytes `keeper` holds under `digest`, or the request's failure
    (IMAGE_MISSING, non-retryable) naming the image."""
    try:
        block = await keeper.image(digest)
    except Exception as exc:  # noqa: BLE001 - named with the image, not retried
        raise ApplicationError(
            f"loop {loop_id}: the context holds {reference.reference} by "
            f"reference, and image {digest} could not be read from the context "
            f"store: {clipped(error_text(exc), 2000)}",
            type=IMAGE_MISSING,
            non_retryable=True,
        ) from None
    if block is None or block.data is None:
        raise ApplicationError(
            f"loop {loop_id}: the context holds {reference.reference} by "
            f"reference, but the context store does not hold image {digest}: its "
            "bytes were not read back, so the request cannot send it",
            type=IMAGE_MISSING,
            non_retryable=True,
        )
    return block.data


def _images(agent: TemporalAgent, store: ContextStore) -> Callable[..., Any]:
    """The `images` activity: which of the images the workflow holds the
    bytes of the store holds already, and those it did not, kept
    (`ImagesArgs`), so that requests carry references to them."""

    async def images(data: dict[str, Any]) -> dict[str, Any]:
        args = ImagesArgs.model_validate(data)
        keeper = _image_store(store)
        if keeper is None:
            return dump(ImagesHeld(keeps=False))
        for block in args.images:
            await keeper.put_image(block)
        held = [d for d in args.digests if await keeper.image(d) is not None]
        return dump(ImagesHeld(keeps=True, held=tuple(held)))

    return activity.defn(name=f"agentfsm.{agent.name}.images")(images)


def _hand_over(agent: TemporalAgent, store: ContextStore) -> Callable[..., Any]:
    """The `context` activity: context items handed to the store ahead of a
    request whose arguments they would make too large (`ContextArgs`)."""

    async def context(data: dict[str, Any]) -> int:
        args = ContextArgs.model_validate(data)
        if not isinstance(store, SharedContextStore):
            raise ApplicationError(
                f"loop {args.loop_id}: a model request would carry "
                f"{args.size:,} bytes of context inline, over the {MAX_PAYLOAD:,} "
                "bytes one Temporal payload may carry, and this worker's context "
                "store is its own (a reference written on one worker cannot be "
                "read on another): configure StoreContexts",
                type=NOT_SHARED,
                non_retryable=True,
            )
        items, digests = list(args.items), list(args.digests)
        if args.base:
            held = await store.get(args.loop_id)
            if (
                held is None
                or len(held[1]) < args.base
                or held[1][args.base - 1] != args.base_digest
            ):
                raise ApplicationError(
                    f"loop {args.loop_id}: the context store does not hold the "
                    f"context's first {args.base} items",
                    type=CONTEXT_MISSING,
                    non_retryable=True,
                )
            items = held[0][: args.base] + items
            digests = held[1][: args.base] + digests
        await store.put(args.loop_id, items, digests)
        return len(items)

    return activity.defn(name=f"agentfsm.{agent.name}.context")(context)


def _carried(agent: TemporalAgent, store: ContextStore) -> Callable[..., Any]:
    """The `carried` activity: a page of the context items a run's input
    carried by reference (`CarriedArgs`), read back from the store (or, on a
    miss, rebuilt from the histories of the runs before)."""

    async def carried(data: dict[str, Any]) -> dict[str, Any]:
        args = CarriedArgs.model_validate(data)
        held = await store.get(args.loop_id)
        if not holds(held, args.base, args.base_digest):
            counted = (
                store if isinstance(store, MemoryContextStore | StoreContexts) else None
            )
            if counted is not None:
                counted.misses += 1
            held = await carried_prefix(args, held)
            if not holds(held, args.base, args.base_digest):
                raise ApplicationError(
                    f"loop {args.loop_id}: the context store does not hold the "
                    f"first {args.base} items of the context the run before "
                    "carried by reference, and they could not be rebuilt from "
                    "the workflow's history",
                    type=CONTEXT_MISSING,
                    non_retryable=True,
                )
            if counted is not None:
                counted.rebuilt += 1
            assert held is not None
            # Kept, so that the run's next request finds its prefix.
            await store.put(args.loop_id, held[0][: args.base], held[1][: args.base])
        assert held is not None
        return dump(CarriedPage(items=tuple(_page(held[0], args))))

    return activity.defn(name=f"agentfsm.{agent.name}.carried")(carried)


def _page(items: list[ContextItem], args: CarriedArgs) -> list[ContextItem]:
    """Items `first` on of the prefix, as many as fit in a payload (one at
    least: each went through a payload already)."""
    room = MAX_PAYLOAD - payload_size(dump(CarriedPage(items=()))) - 64
    page: list[ContextItem] = []
    for item in items[args.first : args.base]:
        room -= payload_size(dump(item)) + 1  # and a comma
        if page and room < 0:
            break
        page.append(item)
    return page


_decisions: TypeAdapter[Decision] = TypeAdapter(Decision)


def _handler(agent: TemporalAgent, marked: LocalActivityHandler) -> Callable[..., Any]:
    async def decide(data: dict[str, Any]) -> dict[str, Any] | None:
        pending = PendingTransition.model_validate(data)
        decision = await call_handler(marked.handler, pending)
        if decision is None:
            return None
        dumped: dict[str, Any] = _decisions.dump_python(decision, mode="json")
        return dumped

    return activity.defn(name=f"agentfsm.{agent.name}.handler.{marked.name}")(decide)
