"""What crosses Temporal's boundary: the workflow's start, the activities'
arguments and results, as JSON data (plain dicts for Temporal's default
converter, so no client needs a custom data converter).

The model request's context goes by reference (`InferArgs.base`,
`InferArgs.base_digest`): only the items the activity's context store has not
seen are sent, so each context item enters the workflow's history once, not
once per model request (temporalio/sdk-python#1890: the history, and the
payloads, would otherwise grow quadratically with the number of requests).

An image goes by reference too, once a context store that keeps images
(`StoreContexts`) holds its bytes: the block without them
(`ImageBlock.as_reference`: its digest, media type and size), which the
inference activity puts back as its bytes read from the store by digest
(`ImageBlock.with_data`). A reference validates wherever the workflow's data
is read back (a start, a record, a transcript); a provider refuses one whose
bytes were not read back (`ImageMissing`), so none reaches a model.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Final, Self

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from agentfsm._models import read_fields_fast
from agentfsm.events import ToolSpec
from agentfsm.inference import InferenceOutput
from agentfsm.messages import (
    ContextItem,
    FunctionCallOutputItem,
    ImageBlock,
    ModelContext,
    UserMessage,
)
from agentfsm.record import LoopRecord
from agentfsm.results import LoopResult

__all__ = (
    "CONTEXT_MISSING",
    "IMAGE_MISSING",
    "Carried",
    "CarriedArgs",
    "CarriedPage",
    "MAX_PAYLOAD",
    "MAX_MODEL_OUTPUT",
    "MAX_PROGRESS",
    "NOT_SHARED",
    "OUTPUT_MISSING",
    "ContextArgs",
    "MAX_ERROR_TEXT",
    "MAX_RESULT",
    "ErrorData",
    "ImagesArgs",
    "ImagesHeld",
    "InferArgs",
    "InferResult",
    "StartLoop",
    "ToolArgs",
    "ToolOutcome",
    "chain_digest",
    "clipped",
    "dump",
    "fitted_result",
    "images_of",
    "output_reference",
    "payload_size",
    "referenced",
    "with_images",
)

CONTEXT_MISSING: Final = "agentfsm.ContextMissing"
"""The `ApplicationError` type an inference activity raises when its context
store does not hold the prefix a request refers to (another worker's store, or
an evicted entry): the workflow then sends the whole context."""

NOT_SHARED: Final = "agentfsm.ContextStoreNotShared"
"""The `ApplicationError` type of a `context` activity whose worker's context
store is its own (`MemoryContextStore`): items too large to go inline cannot
go by reference either, since the next request may run on another worker."""
OUTPUT_MISSING: Final = "agentfsm.OutputMissing"
"""The `ApplicationError` type an inference activity raises when the context
store does not hold a tool output its context refers to, or cannot read it (a
store of the worker's own: the output was stored by a worker with
`StoreContexts`); the loop fails, saying so."""

IMAGE_MISSING: Final = "agentfsm.ImageMissing"
"""The `ApplicationError` type an inference activity raises when its context
store does not hold the bytes of an image the context holds by reference
(`ImageBlock.as_reference`), or keeps no images (a store of the worker's own);
the loop fails, saying so (as a provider's `ImageMissing` would)."""

MAX_PAYLOAD: Final = 2_000_000
"""The most bytes agentfsm puts in one Temporal payload (an activity's
arguments or result): under the server's default error limit
(`limit.blobSize.error`, 2 MiB = 2,097,152 bytes), with room for the
payload's metadata. Over it, the workflow task (arguments) or the activity's
completion (result) would fail."""
MAX_MODEL_OUTPUT: Final = MAX_PAYLOAD // 2
"""The most bytes of one model output: the loop's result (the workflow's)
carries an answer twice, as `answer` and as `output`."""

MAX_ERROR_TEXT: Final = 64 * 1024
"""The most bytes (as JSON) of an error's text that agentfsm carries in a
payload (a provider's error, the loop's error, a failed workflow's message):
some providers echo the whole request in theirs, and the loop's result carries
its error more than once. Longer text is cut, saying how long it was
(`clipped`)."""
MAX_PROGRESS: Final = 64 * 1024
"""The most bytes of one progress report of a tool on Temporal (a heartbeat's
details, sent again with each beat of the heartbeat's timer); a larger one is
refused (`report_progress` returns False)."""
MAX_RESULT: Final = 2 * 1024 * 1024 - 32 * 1024
"""The most bytes of what a loop's workflow ends with (its result, a failed
loop's failure, a cancelled loop's memo): the server's limit (2 MiB) less
room for the payload's metadata or the failure's stack trace. Over the limit,
the workflow task completing it would fail on every attempt; the result is
made to fit instead (`fitted_result`)."""

_FROZEN = ConfigDict(frozen=True, extra="forbid")

_REFERENCE = re.compile(
    r"\A\[agentfsm: a tool output of (\d+) bytes, stored by reference "
    r"\(([0-9a-f]{64})\); the model receives it whole\]"
)
_PREVIEW = 1000


def payload_size(data: Any) -> int:
    """The bytes `data` takes as a payload of Temporal's default converter
    (compact JSON, non-ASCII escaped)."""
    return len(json.dumps(data, separators=(",", ":")))


def clipped(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """`text` when it takes at most `limit` bytes as JSON; else its beginning
    and how long it was, within `limit`."""
    if payload_size(text) <= limit:
        return text
    note = f"...({len(text.encode()):,} bytes in all)"
    budget = max(limit - payload_size(note), 0)
    n = min(len(text), budget)
    while n and (size := payload_size(text[:n])) > budget:
        n = min(n - 1, n * budget // size)  # escaped text takes more bytes
    return text[:n] + note


def fitted_result(result: LoopResult, limit: int) -> tuple[LoopResult, list[str]]:
    """`result` made to take at most `limit` bytes as JSON, and what was left
    out to fit (nothing, for a result of any usual size). First its texts are
    cut (`clipped`), then its answer and output go if they alone are too
    large, then its path's earliest steps; what was left out is said at the end of its `reason` too, so that
    whoever reads the result sees it."""

    def size(r: LoopResult) -> int:
        return payload_size(r.model_dump(mode="json"))

    if size(result) <= limit:
        return result, []
    room = limit - 1024  # for the note `reason` ends with
    dropped: list[str] = []
    texts: dict[str, Any] = {}
    for name in ("reason", "agent_id"):
        value = getattr(result, name)
        if value is not None and (cut := clipped(value)) != value:
            texts[name] = cut
            dropped.append(f"the end of its {name}")
    error = result.error
    if error is not None and (cut := clipped(error.message)) != error.message:
        texts["error"] = error.model_copy(update={"message": cut})
        dropped.append("the end of its error's message")
    result = result.model_copy(update=texts)
    path = result.path
    if size(result.model_copy(update={"path": ()})) > room and (
        result.answer is not None or result.output is not None
    ):
        result = result.model_copy(update={"answer": None, "output": None})
        dropped.append("its answer and output (the loop's transcript has the answer)")
    if size(result) > room and path:
        bare = size(result.model_copy(update={"path": ()}))
        each = -(-(size(result) - bare) // len(path))  # a step's bytes, rounded up
        keep = min(len(path), max((room - bare) // each, 0))
        while keep and size(result.model_copy(update={"path": path[-keep:]})) > room:
            keep -= 1  # steps differ by a few bytes: a few rounds at most
        result = result.model_copy(update={"path": path[len(path) - keep :]})
        dropped.append(
            f"the first {len(path) - keep:,} of its {len(path):,} path steps"
        )
    note = (
        f"the result left out {', '.join(dropped)} to fit in {limit:,} bytes "
        "(what one Temporal payload may carry)"
    )
    reason = f"{result.reason}; {note}" if result.reason else note
    return result.model_copy(update={"reason": reason}), dropped


def output_reference(key: str, output: str) -> str:
    """The text that stands in the workflow for a tool output the context
    store holds under `key`: its size, its key and its beginning, so that
    handlers, the transcript and the loop's result show what it was."""
    size = len(output.encode())
    head = output[:_PREVIEW]
    more = "..." if len(output) > _PREVIEW else ""
    return (
        f"[agentfsm: a tool output of {size} bytes, stored by reference ({key}); "
        f"the model receives it whole]\n{head}{more}"
    )


def referenced(text: str) -> str | None:
    """The store's key when `text` stands for a tool output stored by
    reference (made by `output_reference`), else None."""
    found = _REFERENCE.match(text)
    return None if found is None else found.group(2)


def images_of(item: ContextItem) -> tuple[ImageBlock, ...]:
    """The image blocks of a context item (a user message's, a tool output's)."""
    if type(item) is UserMessage:
        return item.images
    if type(item) is FunctionCallOutputItem:
        return item.images
    return ()


def with_images(
    items: Sequence[ContextItem], swap: Callable[[ImageBlock], ImageBlock]
) -> list[ContextItem]:
    """`items` with each image block replaced by `swap(block)`; an item none
    of whose blocks changed is itself (a copy is made without validation:
    `swap` gives valid blocks)."""
    swapped: list[ContextItem] = []
    for item in items:
        if type(item) is UserMessage and type(item.content) is tuple:
            content = item.content
            blocks = tuple(swap(b) if type(b) is ImageBlock else b for b in content)
            if any(a is not b for a, b in zip(blocks, content, strict=True)):
                item = item.model_copy(update={"content": blocks})
        elif type(item) is FunctionCallOutputItem and item.images:
            images = tuple(swap(b) for b in item.images)
            if any(a is not b for a, b in zip(images, item.images, strict=True)):
                item = item.model_copy(update={"images": images})
        swapped.append(item)
    return swapped


def dump(model: BaseModel) -> dict[str, Any]:
    """A model as the JSON data Temporal's default converter carries."""
    return model.model_dump(mode="json")


def chain_digest(previous: str, item: ContextItem) -> str:
    """The digest of a context prefix ending with `item`: the previous prefix's
    digest chained with the item's JSON. The workflow and the activity's store
    compare these to agree on a prefix without sending it; both digest the
    items as they crossed (an image by reference as its reference)."""
    text = previous + item.model_dump_json()
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class Carried(BaseModel):
    """A loop a run of its workflow hands to the next (continue-as-new): its
    record, its context's items, and where the inference activities' context
    store stood, so the next request still sends only what is new.

    The items go inline when they fit in the next run's input; else the
    first `base` of them (those the store was sent) go by reference, as a
    request's do (`InferArgs.base`), and the next run reads them back from
    the store (the `carried` activity, `CarriedArgs`) before it takes the
    loop up.
    """

    model_config = _FROZEN

    record: LoopRecord
    base: int = Field(default=0, ge=0)
    """How many of the context's first items are not in `items`: the context
    store holds them (the run before sent them), under the loop's id."""
    base_digest: str = ""
    """The chain digest of those `base` items ("" when `base` is 0)."""
    items: tuple[ContextItem, ...] = ()
    """The loop's context from item `base` on (the record refers to the
    whole context by position)."""
    sent: int = Field(default=0, ge=0)
    """How many of the context's items, from its first, the context store was
    sent already (`base` at least)."""
    requests: int = Field(default=0, ge=0)
    """How many inference activities the loop ran (request numbers go on)."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.base == 0) != (self.base_digest == ""):
            raise ValueError("base_digest is given if and only if base is above 0")
        if not self.base <= self.sent <= self.base + len(self.items):
            raise ValueError(
                f"sent ({self.sent}) must be between base ({self.base}) and "
                f"base plus the carried items ({self.base + len(self.items)})"
            )
        return self


class StartLoop(BaseModel):
    """The workflow's input: which agent, the loop's id and first message.

    Checked where it arrives (an extra field, a missing or empty `agent` or
    `loop_id` fail the workflow `agentfsm.BadStart`, naming the field), since
    clients that never import agentfsm start loops too.
    """

    model_config = _FROZEN

    agent: str = Field(min_length=1)
    """The `TemporalAgent`'s name."""
    loop_id: str = Field(min_length=1)
    """The loop's id (its workflow's id is `agentfsm/<loop_id>`)."""
    message: UserMessage | None = None
    """The first message (`None` starts on the agent's context alone)."""
    agent_id: str | None = None
    """Who the loop runs for (default: the agent's name)."""
    context: ModelContext | None = None
    """A prior conversation the loop starts on (`LoopClient.start(context=)`);
    the agent's instructions, when it has some, replace the context's."""
    carried: Carried | None = None
    """The loop itself, when this run goes on with it from the run before
    (continue-as-new, `agentfsm.temporal._carry`); `message` is then None.
    Its record's `loop_id` is `loop_id` (the workflow's signals, updates and
    queries name the loop by it)."""

    @model_validator(mode="after")
    def _carried_is_this_loop(self) -> Self:
        carried = self.carried
        if carried is not None and carried.record.loop_id != self.loop_id:
            raise ValueError(
                f"carried.record.loop_id ({carried.record.loop_id!r}) is not "
                f"loop_id ({self.loop_id!r}): a run goes on with its own loop only"
            )
        return self

    def seeded(self) -> ModelContext:
        """A new context holding `context`'s items, for the loop to append to
        (an empty one without `context`)."""
        seed = self.context
        if seed is None:
            return ModelContext()
        return ModelContext(instructions=seed.instructions, items=list(seed.items))


class CarriedArgs(BaseModel):
    """A page of the context items a run carried by reference (`Carried.base`),
    read back from the context store by the `carried` activity."""

    model_config = _FROZEN

    loop_id: str
    base: int = Field(ge=1)
    """How many of the context's first items went by reference."""
    base_digest: str
    """Their chain digest."""
    first: int = Field(ge=0)
    """The page's first item (0-based); the page holds as many items from it
    as fit in a payload, one at least."""


class CarriedPage(BaseModel):
    """The `carried` activity's result: items `first` on of the prefix."""

    model_config = _FROZEN

    items: tuple[ContextItem, ...]


class InferArgs(BaseModel):
    """One model request, as the inference activity receives it."""

    model_config = _FROZEN

    loop_id: str
    request: int
    """The loop's request number (1 for its first)."""
    model: str
    settings: dict[str, JsonValue] = Field(default_factory=dict)
    tools: tuple[ToolSpec, ...] = ()
    structured_output: dict[str, JsonValue] | None = None
    instructions: str | None = None
    streaming: bool = False
    base: int = 0
    """How many of the context's first items the activity's store holds already."""
    base_digest: str = ""
    """The chain digest of those `base` items ("" when `base` is 0)."""
    items: tuple[ContextItem, ...] = ()
    """The context's items from `base` on."""
    digests: tuple[str, ...] = ()
    """The chain digest after each of `items`."""


class ContextArgs(BaseModel):
    """Context items the workflow hands to the context store ahead of a
    request whose arguments they would make too large (the `context`
    activity): the request then refers to them (`InferArgs.base`)."""

    model_config = _FROZEN

    loop_id: str
    base: int
    """How many of the context's first items the store holds already."""
    base_digest: str
    """The chain digest of those `base` items ("" when `base` is 0)."""
    items: tuple[ContextItem, ...]
    """The context's items from `base` on."""
    digests: tuple[str, ...]
    """The chain digest after each of `items`."""
    size: int
    """The bytes the whole request would have carried inline (for the error
    a store of the worker's own gives)."""


class ImagesArgs(BaseModel):
    """Images of the workflow's context handed to the context store (the
    `images` activity), so that requests carry references to them: `digests`
    to look for, `images` to keep. The activity answers `ImagesHeld`."""

    model_config = _FROZEN

    loop_id: str
    digests: tuple[str, ...] = ()
    """Images to look for in the store (their bytes are not sent)."""
    images: tuple[ImageBlock, ...] = ()
    """Images to keep (the bytes, which the store did not hold)."""


class ImagesHeld(BaseModel):
    """The `images` activity's result."""

    model_config = _FROZEN

    keeps: bool
    """Whether the worker's context store keeps images at all (False: a store
    of the worker's own, or one without `put_image` and `image`); the
    workflow then sends images inline."""
    held: tuple[str, ...] = ()
    """The digests of `ImagesArgs.digests` the store holds."""


class ErrorData(BaseModel):
    """A provider error, carried back as data so that the loop's own retry
    rules (`max_retries`, `retryable`) decide, not Temporal's retry policy
    (which is for lost workers and timeouts)."""

    model_config = _FROZEN

    type: str
    message: str
    retryable: bool = False
    status_code: int | None = None


class InferResult(BaseModel):
    """The inference activity's result: the output, or the provider's error."""

    model_config = _FROZEN

    output: InferenceOutput | None = None
    error: ErrorData | None = None


class ToolArgs(BaseModel):
    """One tool call, as the tool activity receives it."""

    model_config = _FROZEN

    loop_id: str
    agent_id: str
    call_id: str
    name: str
    arguments: str
    request: int
    """The loop's request number whose output asked for the call."""
    position: int
    """The call's position in that output's batch."""
    idempotency_key: str
    """The same for the same call of the same loop, whatever the attempt (the
    loop's own, `agentfsm.current_call().idempotency_key`): a tool with side
    effects passes it on (a payment API's idempotency header, say)."""


class ToolOutcome(BaseModel):
    """What a tool activity returns (a raising tool is an error output, as in
    a loop outside Temporal: Temporal retries lost workers, not tool errors)."""

    model_config = _FROZEN

    output: str
    """The tool's output, or, when `stored` is set, the text standing for it
    (`output_reference`): the context store holds the output itself."""
    is_error: bool = False
    terminate: bool = False
    stored: int | None = None
    """The size in bytes of the output the context store holds, when it went
    by reference (too large to carry inline)."""
    images: tuple[ImageBlock, ...] = Field(default=(), exclude_if=lambda v: not v)
    """The tool's images: references to those the context store keeps
    (`ImageBlock.as_reference`), or the bytes, with a store of the worker's
    own."""


read_fields_fast(globals())
