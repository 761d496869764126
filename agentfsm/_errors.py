"""An exception as text, whatever the exception does.

User code (tools, handlers, providers, wrappers, stop conditions) may raise an
exception whose `str()` raises in turn. The loop that ran it fails or records
an error output with a readable message; the runtime and other loops never see
the second exception.
"""

from __future__ import annotations

from ._text import encodable

__all__ = ("error_text",)


def error_text(exc: BaseException) -> str:
    """`str(exc)` (made `encodable`: an `OSError` names a file as the OS
    spelled it), or a description of it when `str()` itself raises."""
    try:
        return encodable(str(exc))
    except Exception as inner:  # noqa: BLE001 - the text of any error, even a broken one
        return f"<{type(exc).__name__} whose str() raised {type(inner).__name__}>"
