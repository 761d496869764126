"""The context an inference activity's store missed, rebuilt from the
workflow's history (`history_prefix`); and the context a run carried by
reference when it continued as new (`carried_prefix`).

Each inference activity's arguments (and each `context` activity's) continue
the context before them from their `base`, so the context a request refers to
is in the history, spread over the arguments before it. It is read backwards,
from the request to the nearest point it can start from: what the store still
holds of the loop (its prefix up to an earlier request, when another worker
served the requests since), a request that sent the whole context, or the
run's start (a run that continued as new starts on the items its input
carried). A miss on a worker's own store (`MemoryContextStore`) then reads
about the events since that worker's last request of the loop, not the whole
history each time. A run whose input carried its context's first items by
reference (too large to go inline, `Carried.base`) starts on the run before's
context: that run's history is read too, from its end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryReverseRequest
from temporalio.client import Client

from agentfsm._errors import error_text
from agentfsm.messages import ContextItem

from ._wire import (
    Carried,
    CarriedArgs,
    ContextArgs,
    InferArgs,
    StartLoop,
    chain_digest,
)

__all__ = ("carried_prefix", "history_prefix", "holds")

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
    return await _rebuilt(args.loop_id, ".infer", held)


async def carried_prefix(args: CarriedArgs, held: Context | None) -> Context | None:
    """The context a run's start carried by reference (`Carried.base`), as
    the run before left it, rebuilt from that run's history (and, when it too
    began on a prefix carried by reference, from the runs before); None as
    for `history_prefix`."""
    return await _rebuilt(args.loop_id, ".carried", held)


async def _rebuilt(loop_id: str, suffix: str, held: Context | None) -> Context | None:
    """The context up to the running activity of type `<agent>` + `suffix`,
    read from the history, its run's and, where a run began on a prefix
    carried by reference, the run before's (read from its end)."""
    info = activity.info()
    if info.workflow_id is None or info.workflow_run_id is None:
        return None
    agent = info.activity_type.removesuffix(suffix)
    kinds: dict[str, type[InferArgs | ContextArgs]] = {
        f"{agent}.infer": InferArgs,
        f"{agent}.context": ContextArgs,
    }
    runs: list[_Run] = []  # the running activity's run first
    run_id: str = info.workflow_run_id
    after: str | None = info.activity_id
    try:
        client = activity.client()
        while True:  # a loop, not recursion: a loop may go on for many runs
            run = await _read(client, info.workflow_id, run_id, kinds, held, after)
            runs.append(run)
            carried = run.carried
            if run.start is not None or carried is None:
                break
            if holds(held, carried.base, carried.base_digest):
                assert held is not None
                run.start = _went_on(held, carried)
                break
            run_id, after = run.before, None  # the run before, from its end
    except Exception as exc:  # noqa: BLE001 - any failure: the workflow sends it whole
        activity.logger.warning(
            "loop %s: the context could not be rebuilt from the history: %s",
            loop_id,
            error_text(exc),
        )
        return None
    context: Context | None = None
    for run in reversed(runs):  # the earliest run read first
        if run.start is None:
            # It began on the run before's context, carried by reference.
            carried = run.carried
            if carried is None or not holds(context, carried.base, carried.base_digest):
                return None
            assert context is not None
            run.start = _went_on(context, carried)
        context = run.replayed(run.start)
        if context is None:
            return None
    return context


class _Run:
    """What one run's history holds of the context, read backwards: the
    arguments that sent items (the latest first) and the context they start
    from (`start`); or, when that is the run's start and it carried a prefix
    by reference (`carried`), the run to read it from (`before`)."""

    def __init__(self) -> None:
        self.sent: list[InferArgs | ContextArgs] = []
        self.start: Context | None = None
        self.carried: Carried | None = None
        self.before = ""

    def replayed(self, start: Context) -> Context | None:
        """The context after this run's arguments, on top of `start`; None
        where they do not chain."""
        items, digests = start
        for earlier in reversed(self.sent):
            if earlier.base and not holds(
                (items, digests), earlier.base, earlier.base_digest
            ):
                return None  # not the context the run holds: a gap
            items = items[: earlier.base] + list(earlier.items)
            digests = digests[: earlier.base] + list(earlier.digests)
        return items, digests


async def _read(
    client: Client,
    workflow_id: str,
    run_id: str,
    kinds: dict[str, type[InferArgs | ContextArgs]],
    held: Context | None,
    after: str | None,
) -> _Run:
    """One run's history read backwards, from the activity `after` (None:
    from its end), only as far as a point the context can start from."""
    run = _Run()
    mine = after is None
    async for event in _backwards(client, workflow_id, run_id):
        if event.event_type == _STARTED:
            started = event.workflow_execution_started_event_attributes
            (data,) = await client.data_converter.decode(started.input.payloads)
            carried = StartLoop.model_validate(data).carried
            if carried is not None and carried.base:
                run.carried = carried
                run.before = started.continued_execution_run_id
            else:
                run.start = _extended(
                    ([], []), () if carried is None else carried.items[: carried.sent]
                )
            return run
        if event.event_type != _SCHEDULED:
            continue
        scheduled = event.activity_task_scheduled_event_attributes
        if not mine:  # what comes after this request is not its context
            mine = scheduled.activity_id == after
            continue
        kind = kinds.get(scheduled.activity_type.name)
        if kind is None:
            continue
        (data,) = await client.data_converter.decode(scheduled.input.payloads)
        earlier = kind.model_validate(data)
        run.sent.append(earlier)
        if earlier.base == 0:
            run.start = [], []
            return run
        if holds(held, earlier.base, earlier.base_digest):
            run.start = held
            return run
    return run


def _went_on(before: Context, carried: Carried) -> Context:
    """The context a run began on: the prefix of `before` it carried by
    reference, then the items it carried inline that the store was sent."""
    prefix = before[0][: carried.base], before[1][: carried.base]
    return _extended(prefix, carried.items[: carried.sent - carried.base])


def _extended(context: Context, items: Sequence[ContextItem]) -> Context:
    """`context` with `items` appended, their chain digests too."""
    found, digests = list(context[0]), list(context[1])
    previous = digests[-1] if digests else ""
    for item in items:
        previous = chain_digest(previous, item)
        found.append(item)
        digests.append(previous)
    return found, digests


def holds(held: Context | None, base: int, digest: str) -> bool:
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
