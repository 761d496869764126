"""The library's logger. agentfsm never configures structlog; applications do.

structlog is imported on first use, not with agentfsm: importing it costs about
40 ms, and `import agentfsm` (a CLI's `agentfsm diagram`, say) need not pay it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = ("bind_contextvars", "get_logger")

_logger: FilteringBoundLogger | None = None
_bind: Callable[..., Any] | None = None


def get_logger() -> FilteringBoundLogger:
    """The `agentfsm` logger (structlog's lazy proxy: it follows later configuration)."""
    global _logger
    if _logger is None:
        import structlog

        _logger = structlog.get_logger("agentfsm")
    return _logger


def bind_contextvars(**values: Any) -> None:
    """Bind `values` in structlog's context variables (for every log line of this task)."""
    global _bind
    if _bind is None:
        import structlog.contextvars

        _bind = structlog.contextvars.bind_contextvars
    _bind(**values)
