"""The context an inference activity's store missed, rebuilt from the
workflow's history (`history_prefix`).

Each inference activity's arguments (and each `context` activity's) continue
the context before them from their `base`, so the context a request refers to
is in the history, spread over the arguments before it. It is read backwards,
from the request to the nearest point it can start from: what the store still
holds of the loop (its prefix up to an earlier request, when another worker
served the requests since), a request that sent the whole context, or the
run's start (a run that continued as new starts on the items its input
carried). A miss on a worker's own store (`MemoryContextStore`) then reads
about the events since that worker's last request of the loop, not the whole
history each time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryReverseRequest
from temporalio.client import Client

from agentfsm._errors import error_text
from agentfsm.messages import ContextItem

from .wire import ContextArgs, InferArgs, StartLoop, chain_digest

__all__ = ("history_prefix",)

_SCHEDULED = EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
_STARTED = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED
_PAGE = 128
"""Events per page read: a miss usually needs the last turn or two."""

Context = tuple[list[ContextItem], list[str]]
"""A context's items and the chain digest after each."""


async def history_prefix(args: InferArgs, held: Context | None) -> Context | None:
    """The context as the workflow sent it up to this request (`args`, the
    running activity's), rebuilt from the run's history on top of `held`
    (what the store holds of the loop, if anything); None when the history
    cannot be read (no client: a `def` activity, a test environment; an RPC
    error) or does not hold it."""
    info = activity.info()
    if info.workflow_id is None or info.workflow_run_id is None:
        return None
    agent = info.activity_type.removesuffix(".infer")
    kinds: dict[str, type[InferArgs | ContextArgs]] = {
        info.activity_type: InferArgs,
        f"{agent}.context": ContextArgs,
    }
    sent: list[InferArgs | ContextArgs] = []  # the latest first
    start: Context | None = None
    try:
        client = activity.client()
        mine = False
        async for event in _backwards(client, info.workflow_id, info.workflow_run_id):
            if event.event_type == _STARTED:
                start = await _carried(client, event)
                break
            if event.event_type != _SCHEDULED:
                continue
            scheduled = event.activity_task_scheduled_event_attributes
            if not mine:  # what comes after this request is not its context
                mine = scheduled.activity_id == info.activity_id
                continue
            kind = kinds.get(scheduled.activity_type.name)
            if kind is None:
                continue
            (data,) = await client.data_converter.decode(scheduled.input.payloads)
            earlier = kind.model_validate(data)
            sent.append(earlier)
            if earlier.base == 0:
                start = [], []
                break
            if _holds(held, earlier.base, earlier.base_digest):
                start = held
                break
    except Exception as exc:  # noqa: BLE001 - any failure: the workflow sends it whole
        activity.logger.warning(
            "loop %s: the context could not be rebuilt from the history: %s",
            args.loop_id,
            error_text(exc),
        )
        return None
    if start is None:
        return None
    items, digests = start
    for earlier in reversed(sent):
        if earlier.base and not _holds(
            (items, digests), earlier.base, earlier.base_digest
        ):
            return None  # not the context the run holds: a gap
        items = items[: earlier.base] + list(earlier.items)
        digests = digests[: earlier.base] + list(earlier.digests)
    return items, digests


def _holds(held: Context | None, base: int, digest: str) -> bool:
    """Whether `held` is (or starts with) the prefix of `base` items whose
    chain digest is `digest`."""
    return held is not None and len(held[1]) >= base and held[1][base - 1] == digest


async def _backwards(
    client: Client, workflow_id: str, run_id: str
) -> AsyncIterator[HistoryEvent]:
    """The run's history events, the latest first."""
    token = b""
    while True:
        page = await client.workflow_service.get_workflow_execution_history_reverse(
            GetWorkflowExecutionHistoryReverseRequest(
                namespace=client.namespace,
                execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id),
                maximum_page_size=_PAGE,
                next_page_token=token,
            ),
            retry=True,
        )
        for event in page.history.events:
            yield event
        token = page.next_page_token
        if not token:
            return


async def _carried(client: Client, event: HistoryEvent) -> Context:
    """What the context store held when the run began: the items its input
    carried that the run before had sent (none for a loop's first run)."""
    started = event.workflow_execution_started_event_attributes
    (data,) = await client.data_converter.decode(started.input.payloads)
    carried = StartLoop.model_validate(data).carried
    items: list[ContextItem] = []
    digests: list[str] = []
    if carried is not None:
        previous = ""
        for item in carried.items[: carried.sent]:
            previous = chain_digest(previous, item)
            items.append(item)
            digests.append(previous)
    return items, digests
