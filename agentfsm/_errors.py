"""What user code raised, made safe for the loop that ran it.

User code (tools, handlers, providers, wrappers, stop conditions) may raise an
exception whose `str()` raises in turn. The loop that ran it fails or records
an error output with a readable message; the runtime and other loops never see
the second exception (`error_text`).

It may also raise a cancellation that is not one: on asyncio, code that awaits
a task it cancelled itself gets that task's `CancelledError`, and letting it
go on would end the loop as if the runtime were closing it, and cancel the
runtime's task group with it. `cancelled_from_outside` tells the two apart.
"""

from __future__ import annotations

import asyncio  # noqa: TID251 - which `CancelledError` is a cancel of the task

from ._text import encodable

__all__ = ("cancelled_from_outside", "error_text")


def error_text(exc: BaseException) -> str:
    """`str(exc)` (made `encodable`: an `OSError` names a file as the OS
    spelled it), or a description of it when `str()` itself raises."""
    try:
        return encodable(str(exc))
    except Exception as inner:  # noqa: BLE001 - the text of any error, even a broken one
        return f"<{type(exc).__name__} whose str() raised {type(inner).__name__}>"


def cancelled_from_outside() -> bool:
    """Whether the cancellation exception being handled cancels the running
    task (a cancel scope, `Runtime.cancel`, the runtime closing), rather than
    being one that user code raised of its own.

    On asyncio, a cancel of the task is requested through `Task.cancel`
    (anyio's scopes do so too), which `Task.cancelling()` counts; a
    `CancelledError` raised while no cancel is pending came from elsewhere
    (a task the code cancelled and awaited). On trio only trio makes a
    `Cancelled`: always a cancel. Checked only once an exception is caught.
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no asyncio event loop running here: trio's
        return True
    return task is None or task.cancelling() > 0
