"""What the loop workflow sends out as activities: each model request
(`ActivityProvider`), each tool body (`ToolActivities`, the innermost tool
wrapper) and each handler marked `local_activity` (`local_handler`).

Each is awaited through `_run`, so that a cancelled loop leaves at once; the
workflow (`workflow.py`) plugs them into its unchanged `Runtime`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from temporalio import workflow
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    TimeoutError,
    TimeoutType,
)

from agentfsm._bus.started import request_data
from agentfsm._keys import idempotency_key
from agentfsm.exceptions import ProviderError, ToolTimeout
from agentfsm.inference import (
    ImageSupport,
    InferenceInput,
    InferenceOutput,
    OutputCompleted,
)
from agentfsm.interception import Decision, Pause, PendingTransition
from agentfsm.messages import ContextItem, ImageBlock
from agentfsm.states import LoopState
from agentfsm.tools import ToolCall, ToolNext, ToolResult, running_call

from ._agent import LocalActivityHandler, TemporalAgent
from ._wire import (
    CONTEXT_MISSING,
    IMAGE_MISSING,
    MAX_PAYLOAD,
    NOT_SHARED,
    OUTPUT_MISSING,
    ContextArgs,
    ImagesArgs,
    ImagesHeld,
    InferArgs,
    InferResult,
    ToolArgs,
    ToolOutcome,
    chain_digest,
    dump,
    images_of,
    payload_size,
    with_images,
)

if TYPE_CHECKING:
    from ._workflow import LoopWorkflow

__all__ = ("ActivityProvider", "ToolActivities", "local_handler", "run_activity")

_decisions: TypeAdapter[Decision] = TypeAdapter(Decision)
_ANY_IMAGE = ImageSupport()


async def run_activity(handle: Any) -> Any:
    """Await an activity's handle so that a cancellation ends the wait at once.

    anyio cancels a task by calling `cancel()` on it again at each turn of the
    event loop until it exits; awaiting the handle itself, the task would wait
    for Temporal to confirm the activity's cancellation, which needs the
    workflow to yield first, so the loop would spin until Temporal's deadlock
    detector fails the workflow task. Shielded, the task leaves at once, and
    the handle, cancelled, asks Temporal to cancel the activity.
    """
    import asyncio  # noqa: TID251 - workflow code runs on asyncio only

    try:
        return await asyncio.shield(handle)
    except asyncio.CancelledError:
        handle.cancel()
        # Nobody awaits the handle any more: retrieve its outcome, so that
        # asyncio does not report an exception that was never retrieved.
        handle.add_done_callback(lambda f: f.cancelled() or f.exception())
        raise


class _ContextRef:
    """Which prefix of the context the inference activities' store holds: the
    items sent so far (by identity: items are frozen, an edit replaces one)
    and their chain digests."""

    __slots__ = ("digests", "sent")

    def __init__(self) -> None:
        self.sent: list[ContextItem] = []
        self.digests: list[str] = []

    def split(
        self,
        items: Sequence[ContextItem],
        whole: bool,
        wire: Callable[[Sequence[ContextItem]], list[ContextItem]],
    ) -> tuple[int, str, tuple[ContextItem, ...], tuple[str, ...]]:
        """`(base, base_digest, new items, their digests)` of a request: the
        new items as they cross (`wire`), digested so."""
        base = 0
        if not whole:
            sent = self.sent
            limit = min(len(sent), len(items))
            while base < limit and items[base] is sent[base]:
                base += 1
        digests = self.digests[:base]
        previous = digests[-1] if digests else ""
        fresh = tuple(wire(items[base:]))
        for item in fresh:
            previous = chain_digest(previous, item)
            digests.append(previous)
        self.sent = list(items)
        self.digests = digests
        return (
            base,
            (self.digests[base - 1] if base else ""),
            fresh,
            tuple(digests[base:]),
        )


class Images:
    """The images of the workflow's context whose bytes the inference
    activities' context store holds, so that they cross as references
    (`ImageBlock.as_reference`), never inline; when the store keeps no images
    (a worker's own store), they cross inline.

    An image the workflow holds the bytes of (a start's message, a signal's, a
    tool's with a store of the worker's own) is handed to the store by the
    `images` activity before the first payload that would carry it; one that
    arrived as a reference (a tool's, a carried context's) is one already.
    """

    def __init__(self, provider: ActivityProvider) -> None:
        self.provider = provider
        self.held: set[str] = set()
        """Digests of images the store holds (checked or kept by this run)."""
        self.inline = False
        """The store keeps no images (so the `images` activity said): they
        cross inline for the rest of the run."""

    async def keep(self, items: Sequence[ContextItem]) -> bool:
        """Hand the store the images of `items` it may not hold yet: asked
        by digest first, so that an image it holds costs no bytes. Whether
        there were any (and so activities ran).

        Raises:
            ProviderError: the `images` activity failed, or an image does not
                fit in a payload.
        """
        if self.inline:
            return False
        new: dict[str, ImageBlock] = {}
        for item in items:
            for block in images_of(item):
                digest = block.digest
                if block.data is not None and digest and digest not in self.held:
                    new.setdefault(digest, block)
        if not new:
            return False
        held = await self._call(
            ImagesArgs(loop_id=self.provider.owner.loop_id, digests=tuple(new)),
            len(new),
        )
        if not held.keeps:
            self.inline = True
            return True
        self.held.update(held.held)
        missing = [b for d, b in new.items() if d not in self.held]
        while missing:
            part = [missing.pop(0)]
            while missing and _images_size(part + missing[:1]) <= MAX_PAYLOAD:
                part.append(missing.pop(0))
            args = ImagesArgs(loop_id=self.provider.owner.loop_id, images=tuple(part))
            size = payload_size(dump(args))
            if size > MAX_PAYLOAD:
                raise ProviderError(
                    f"image {part[0].digest} of loop {args.loop_id} is {size:,} "
                    f"bytes as JSON, over the {MAX_PAYLOAD:,} bytes one Temporal "
                    "payload may carry",
                    retryable=False,
                )
            await self._call(args, len(part))
            self.held.update(b.digest for b in part if b.digest is not None)
        return True

    def wire(self, items: Sequence[ContextItem]) -> list[ContextItem]:
        """`items` as they cross: each image the store holds as its reference."""
        held = self.held

        def swap(block: ImageBlock) -> ImageBlock:
            if block.data is not None and block.digest in held:
                return block.as_reference()
            return block

        return with_images(items, swap) if held else list(items)

    async def _call(self, args: ImagesArgs, count: int) -> ImagesHeld:
        provider = self.provider
        what = "looked for" if args.digests else "kept"
        try:
            raw = await run_activity(
                workflow.start_activity(
                    f"agentfsm.{provider.agent.name}.images",
                    dump(args),
                    start_to_close_timeout=provider.timeout,
                    retry_policy=provider.agent.model_retry,
                    summary=f"{count} image(s) {what}",
                )
            )
        except ActivityError as exc:
            raise ProviderError(
                f"loop {args.loop_id}: images could not be handed to the context "
                f"store: {exc.cause or exc}",
                retryable=False,
            ) from exc
        return ImagesHeld.model_validate(raw)


def _images_size(blocks: list[ImageBlock]) -> int:
    """About the bytes `blocks` take in an `ImagesArgs` payload."""
    return sum(4 * ((b.size or 0) + 2) // 3 + 400 for b in blocks) + 200


class ActivityProvider:
    """The workflow's provider: each request is an inference activity."""

    def __init__(self, agent: TemporalAgent, owner: LoopWorkflow) -> None:
        self.agent = agent
        self.owner = owner
        self.context = _ContextRef()
        self.images = Images(self)
        self.requests = 0
        options = agent.options
        timeout = options.get("inference_timeout")
        self.timeout = (
            timedelta(seconds=timeout) if timeout is not None else agent.no_timeout
        )

    def image_support(self, model: str) -> ImageSupport:
        """Where the agent's model takes images (`TemporalAgent.images`): the
        loop asks it before a message enters the context. The agent's, not
        the worker's provider's, so that every worker and every replay decide
        alike; every image when the agent does not say (the worker's provider
        then refuses the request)."""
        images = self.agent.images
        return _ANY_IMAGE if images is None else images

    async def complete(self, request: InferenceInput, /) -> InferenceOutput:
        return await self._infer(request, streaming=False)

    @asynccontextmanager
    async def stream(
        self, request: InferenceInput, /
    ) -> AsyncIterator[AsyncIterator[OutputCompleted]]:
        # The activity consumes the stream (its chunks go to the worker's
        # `on_chunk`); the loop gets the completed output only.
        output = await self._infer(request, streaming=True)

        async def one() -> AsyncIterator[OutputCompleted]:
            yield OutputCompleted(output=output)

        yield one()

    async def _infer(
        self, request: InferenceInput, *, streaming: bool
    ) -> InferenceOutput:
        self.requests += 1
        data = request_data(request)
        schema = request.structured_output
        if isinstance(schema, type):
            schema = schema.model_json_schema()
        settings = dict(data.settings)
        settings.pop("streaming", None)
        items = request.context.items
        await self.images.keep(items)  # so that its images cross as references
        whole = False
        while True:
            base, digest, fresh, digests = self.context.split(
                items, whole, self.images.wire
            )
            args = InferArgs(
                loop_id=self.owner.loop_id,
                request=self.requests,
                model=request.model,
                settings=settings,
                tools=data.tools,
                structured_output=schema,
                instructions=request.context.instructions,
                streaming=streaming,
                base=base,
                base_digest=digest,
                items=fresh,
                digests=digests,
            )
            try:
                sent = dump(args)
                size = payload_size(sent)
                if size > MAX_PAYLOAD and fresh:
                    # Too large to go inline: the items go to the context
                    # store first, and the request refers to all of them.
                    await self._hand_over(args, size)
                    args = args.model_copy(
                        update={
                            "base": base + len(fresh),
                            "base_digest": digests[-1],
                            "items": (),
                            "digests": (),
                        }
                    )
                    sent = dump(args)
                    size = payload_size(sent)
                if size > MAX_PAYLOAD:
                    raise ProviderError(
                        f"a request to {request.model!r} would carry {size:,} bytes "
                        f"besides its context (tools, settings, instructions), over "
                        f"the {MAX_PAYLOAD:,} bytes one Temporal payload may carry",
                        retryable=False,
                    )
                raw = await run_activity(
                    workflow.start_activity(
                        f"agentfsm.{self.agent.name}.infer",
                        sent,
                        start_to_close_timeout=self.timeout,
                        heartbeat_timeout=self.agent.model_heartbeat,
                        retry_policy=self.agent.model_retry,
                        summary=f"request {self.requests}",
                    )
                )
            except ActivityError as exc:
                cause = exc.cause
                if (
                    isinstance(cause, ApplicationError)
                    and cause.type == CONTEXT_MISSING
                    and not whole
                ):
                    whole = True  # that worker's store lacks the prefix: send it all
                    continue
                if isinstance(cause, ApplicationError) and cause.type in (
                    NOT_SHARED,
                    OUTPUT_MISSING,
                    IMAGE_MISSING,
                ):
                    raise ProviderError(cause.message, retryable=False) from exc
                raise ProviderError(
                    f"the inference activity for {request.model!r} failed: "
                    f"{cause or exc}",
                    retryable=False,
                ) from exc
            break
        result = InferResult.model_validate(raw)
        if result.error is not None:
            error = result.error
            raise ProviderError(
                error.message,
                retryable=error.retryable,
                status_code=error.status_code,
            )
        assert result.output is not None
        return result.output

    async def _hand_over(self, args: InferArgs, size: int) -> None:
        """Hand a request's new items to the context store in parts that each
        fit in a payload (the `context` activity), so that the request can
        refer to them; an `ActivityError` says the store refused them."""
        items, digests = args.items, args.digests

        def part(start: int, end: int) -> dict[str, Any]:
            return dump(
                ContextArgs(
                    loop_id=args.loop_id,
                    base=args.base + start,
                    base_digest=digests[start - 1] if start else args.base_digest,
                    items=items[start:end],
                    digests=digests[start:end],
                    size=size,
                )
            )

        # A part's own fields; a later part's base and digest are longer.
        envelope = payload_size(part(0, 0)) + 64
        # An item's share of a part: its JSON, its digest, two commas.
        sizes = [
            payload_size(dump(item)) + len(digests[n]) + 4
            for n, item in enumerate(items)
        ]
        start = 0
        while start < len(items):
            if envelope + sizes[start] > MAX_PAYLOAD:
                raise ProviderError(
                    f"context item {args.base + start + 1} of loop {args.loop_id} "
                    f"is {sizes[start]:,} bytes as JSON, over the {MAX_PAYLOAD:,} "
                    "bytes one Temporal payload may carry",
                    retryable=False,
                )
            end, total = start + 1, envelope + sizes[start]
            while end < len(items) and total + sizes[end] <= MAX_PAYLOAD:
                total += sizes[end]
                end += 1
            await run_activity(
                workflow.start_activity(
                    f"agentfsm.{self.agent.name}.context",
                    part(start, end),
                    start_to_close_timeout=self.timeout,
                    retry_policy=self.agent.model_retry,
                    summary=f"request {self.requests}: context items "
                    f"{args.base + start + 1}-{args.base + end}",
                )
            )
            start = end


class ToolActivities:
    """The workflow's tool layer (inside the agent's tool wrappers): runs a
    call's tool body as an activity."""

    def __init__(self, agent: TemporalAgent, owner: LoopWorkflow) -> None:
        self.agent = agent
        self.owner = owner
        self.lost: list[tuple[str, str]] = []
        """`(call_id, tool)` of `on_crash="pause"` calls whose one attempt was
        lost: the loop pauses at its next transition (`pause_after_lost`)."""

    async def __call__(self, call: ToolCall, next_: ToolNext) -> ToolResult:
        tool = call.tool
        if tool is None or self.agent.tool(tool.name) is not tool:
            # Not one of the agent's tools (an unknown name; a tool a wrapper
            # or handler made up): the loop's own handling, in the workflow.
            return await next_(call)
        item = call.call
        # The loop's own record of the call (request number, position, key):
        # the activity's tool sees the same `current_call()` as in a process.
        running = running_call()
        if running is not None and running.call_id == item.call_id:
            request, position = running.request, running.position
            key = running.idempotency_key
            if call.arguments != item.arguments:  # a wrapper changed them
                key = idempotency_key(
                    call.loop_id, request, position, item.name, call.arguments
                )
        else:  # a wrapper of ours called from elsewhere: the same rule
            request, position = self.owner.provider.requests, 0
            key = idempotency_key(
                call.loop_id, request, position, item.name, call.arguments
            )
        args = ToolArgs(
            loop_id=call.loop_id,
            agent_id=call.agent_id,
            call_id=item.call_id,
            name=tool.name,
            arguments=call.arguments,
            request=request,
            position=position,
            idempotency_key=key,
        )
        retry = tool.on_crash == "retry"
        options = self.agent.activity_options(tool)
        policy = options.retry_policy
        assert policy is not None  # activity_options always gives one
        try:
            raw = await run_activity(
                workflow.start_activity(
                    f"agentfsm.{self.agent.name}.tool.{tool.name}",
                    dump(args),
                    task_queue=options.task_queue,
                    start_to_close_timeout=options.start_to_close_timeout,
                    schedule_to_close_timeout=options.schedule_to_close_timeout,
                    schedule_to_start_timeout=options.schedule_to_start_timeout,
                    heartbeat_timeout=options.heartbeat_timeout,
                    retry_policy=policy,
                    summary=f"{tool.name} {item.call_id}",
                )
            )
        except ActivityError as exc:
            cause = exc.cause
            if (
                isinstance(cause, TimeoutError)
                and cause.type is TimeoutType.SCHEDULE_TO_START
            ):
                # No worker took the call: it never ran, nothing to pause for.
                queue = options.task_queue or workflow.info().task_queue
                raise ToolTimeout(
                    f"tool {tool.name!r}: no worker of task queue {queue!r} took "
                    f"the call within {options.schedule_to_start_timeout} (its "
                    "schedule_to_start_timeout), so it did not run: is a worker "
                    f"polling {queue!r} (worker(..., task_queue={queue!r}, "
                    "workflows=False))?",
                    tool=tool.name,
                ) from exc
            if not retry:
                self.lost.append((item.call_id, tool.name))
            if isinstance(cause, TimeoutError):
                raise ToolTimeout(
                    f"tool {tool.name!r}: its activity timed out "
                    f"({cause.type.name if cause.type else 'timeout'}) "
                    + (
                        "and was not retried (on_crash='pause')"
                        if not retry
                        else f"after {policy.maximum_attempts} attempts"
                        if policy.maximum_attempts
                        else "and its attempts ran out of time"
                    ),
                    tool=tool.name,
                ) from exc
            return ToolResult.error(
                f"tool {tool.name!r}: its activity failed: {cause or exc}"
            )
        outcome = ToolOutcome.model_validate(raw)
        return ToolResult(
            output=outcome.output,
            is_error=outcome.is_error,
            terminate=outcome.terminate,
            images=outcome.images,
        )

    def pause_after_lost(self, pending: PendingTransition) -> Decision | None:
        """Pause a loop whose `on_crash="pause"` call was lost, before it goes
        on: a person decides (resume goes on; the model sees the call's error)."""
        if not self.lost or pending.source is not LoopState.function_call:
            return None
        lost, self.lost = self.lost, []
        names = ", ".join(f"{tool} ({call_id})" for call_id, tool in lost)
        return Pause(
            f"tool call {names} was lost with its worker or timed out and is "
            "not retried (on_crash='pause'): it may or may not have run"
        )


def local_handler(
    agent: TemporalAgent, marked: LocalActivityHandler
) -> Callable[..., Any]:
    """A `local_activity` handler as the loop calls it: a local activity."""

    async def decide(pending: PendingTransition) -> Decision | None:
        sent = pending
        if isinstance(pending.payload, InferenceInput):
            sent = pending.model_copy(update={"payload": None})
        raw = await run_activity(
            workflow.start_local_activity(
                f"agentfsm.{agent.name}.handler.{marked.name}",
                sent.model_dump(mode="json", exclude={"metadata"}),
                start_to_close_timeout=marked.timeout,
            )
        )
        return None if raw is None else _decisions.validate_python(raw)

    decide.__qualname__ = decide.__name__ = marked.name
    return decide
