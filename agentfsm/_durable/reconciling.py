"""Asking tools' `reconcile` functions about calls in flight at a crash.

Recovery (`Keeper._recover`) calls `reconcile_calls` for a loop taken up in
`function_call`, before the state's `recover` decides which calls are in
doubt: each call the ledger holds as started (no output) whose tool has a
`reconcile` function is asked about, all of a batch's at once, each bounded by
its tool's timeout. An answer becomes a ledger entry (`done` with the output
found, or `retry`) that the keeper stores before the loop goes on, so a crash
right after never asks again, nor runs a call that was found to have run; a
call with no answer (None, an error, a timeout, a wrong type) stays in doubt,
and the note saying why goes into the pause's reason.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from agentfsm._errors import error_text
from agentfsm._loop.batch import plan_of
from agentfsm._loop.bounds import checked_tool_output
from agentfsm.events import ReconciledCall
from agentfsm.interception import ToolBatch
from agentfsm.messages import FunctionCallOutputItem
from agentfsm.reconcile import Reconciled
from agentfsm.record import callable_name
from agentfsm.tools import DEFAULT_TOOL_TIMEOUT

if TYPE_CHECKING:
    from collections.abc import Mapping

    from agentfsm._loop.batch import PlannedCall
    from agentfsm._loop.loop import Loop
    from agentfsm.store import CallRecord
    from agentfsm.tools import Tool

__all__ = ("Reconciliation", "reconcile_calls")


@dataclass
class Reconciliation:
    """What the reconcile functions of a loop's calls in flight answered."""

    calls: list[ReconciledCall] = field(default_factory=list)
    """Each call asked about, and the answer (for `loop.recovered`)."""
    entries: list[CallRecord] = field(default_factory=list)
    """The ledger entries the answers make (to store before the loop acts)."""
    notes: dict[str, str] = field(default_factory=dict)
    """Why a call is still in doubt, by key (for the pause's reason)."""


class _Failed(Exception):
    """Asking a reconcile function gave no usable answer (the message says why)."""


async def reconcile_calls(
    loop: Loop, ledger: Mapping[str, CallRecord]
) -> Reconciliation | None:
    """Ask the reconcile functions of the loop's calls in flight (started in
    the ledger, no output) about them; None if no such call has one."""
    step = loop.step
    batch = step[1] if step is not None else None
    if not isinstance(batch, ToolBatch):
        return None
    asked: list[tuple[PlannedCall, Tool, CallRecord]] = []
    for planned in plan_of(loop, batch).calls:
        tool = planned.tool
        if not planned.runs or tool is None or tool.reconcile is None:
            continue
        entry = ledger.get(planned.key(loop))
        if entry is None or entry.status in ("done", "retry"):
            continue  # not started, or settled: nothing to ask
        asked.append((planned, tool, entry))
    if not asked:
        return None
    answers: list[Reconciled | _Failed | None] = [None] * len(asked)

    async def ask_one(index: int, tool: Tool, entry: CallRecord) -> None:
        try:
            answers[index] = await _ask(tool, entry, asked[index][0])
        except _Failed as exc:
            answers[index] = exc

    async with anyio.create_task_group() as tg:
        for index, (_, tool, entry) in enumerate(asked):
            tg.start_soon(ask_one, index, tool, entry)
    found = Reconciliation()
    for (planned, tool, entry), answer in zip(asked, answers, strict=True):
        _record(loop, found, planned, tool, entry, answer)
    return found


async def _ask(
    tool: Tool, entry: CallRecord, planned: PlannedCall
) -> Reconciled | None:
    """The answer of the tool's reconcile function about the call.

    Raises:
        _Failed: the arguments do not validate, or the function raised, timed
            out or returned neither a `Reconciled` nor None.
    """
    fn = tool.reconcile
    assert fn is not None
    try:
        arguments = tool.validate_arguments(planned.call.arguments)
    except Exception as exc:  # (told in the pause's reason)
        raise _Failed(error_text(exc)) from exc
    limit = tool.timeout if tool.timeout is not None else DEFAULT_TOOL_TIMEOUT
    try:
        with anyio.fail_after(limit):
            if inspect.iscoroutinefunction(fn):
                answer: Any = await fn(entry.key, arguments)
            else:
                # A sync lookup may block (a request to another system): off
                # the event loop, and abandoned at the timeout.
                answer = await anyio.to_thread.run_sync(
                    partial(fn, entry.key, arguments), abandon_on_cancel=True
                )
                if inspect.isawaitable(answer):
                    answer = await answer
    except TimeoutError as exc:
        raise _Failed(f"it did not answer within {limit:g}s") from exc
    except Exception as exc:  # (told in the pause's reason)
        raise _Failed(f"it raised {type(exc).__name__}: {error_text(exc)}") from exc
    if answer is not None and not isinstance(answer, Reconciled):
        raise _Failed(
            f"it returned a {type(answer).__name__}, not a Reconciled "
            "(Reconciled.ran(output), Reconciled.not_run()) or None"
        )
    return answer


def _record(
    loop: Loop,
    found: Reconciliation,
    planned: PlannedCall,
    tool: Tool,
    entry: CallRecord,
    answer: Reconciled | _Failed | None,
) -> None:
    """Record one call's answer in `found`."""
    call = planned.call
    named = f"{call.call_id} ({call.name})"
    by = f"reconcile:{callable_name(tool.reconcile)}"
    if isinstance(answer, _Failed):
        error = str(answer)
        found.notes[entry.key] = f"asking reconcile about {named} failed: {error}"
        found.calls.append(_reported(entry, "failed", error=error))
    elif answer is None:
        found.notes[entry.key] = f"reconcile did not know whether {named} ran"
        found.calls.append(_reported(entry, "unknown"))
    elif answer.result is None:  # not run: it runs now, with the same key
        found.entries.append(entry.model_copy(update={"status": "retry", "by": by}))
        found.calls.append(_reported(entry, "not_run"))
    else:
        result = answer.result
        text, is_error = checked_tool_output(
            call.name, result.output, result.is_error, loop.options
        )
        output = FunctionCallOutputItem(
            call_id=call.call_id, output=text, is_error=is_error
        )
        done = {
            "status": "done",
            "output": output,
            "terminate": result.terminate,
            "by": by,
        }
        found.entries.append(entry.model_copy(update=done))
        found.calls.append(_reported(entry, "ran", output=output))


def _reported(entry: CallRecord, answer: Any, **fields: Any) -> ReconciledCall:
    return ReconciledCall(
        call_id=entry.call_id,
        tool=entry.tool,
        idempotency_key=entry.key,
        answer=answer,
        **fields,
    )
