"""The library's logger. agentfsm never configures structlog; applications do.

Until the application configures structlog (`structlog.is_configured()`), the
library says nothing below warning, and what it says goes to stderr: structlog's
defaults would print every info line of every loop to stdout, into the
program's own output. Once structlog is configured, its configuration decides.

structlog is imported on first use, not with agentfsm: importing it costs about
40 ms, and `import agentfsm` (a CLI's `agentfsm diagram`, say) need not pay it.
"""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

__all__ = ("bind_loop_ids", "get_logger")

_logger: FilteringBoundLogger | None = None
_structlog: Any = None  # the module, once imported
_loop_vars: tuple[ContextVar[Any], ContextVar[Any]] | None = None


def get_logger() -> FilteringBoundLogger:
    """The `agentfsm` logger, as structlog is configured now.

    Configured: structlog's lazy proxy (it follows later configuration).
    Unconfigured: a logger that drops everything below warning and writes the
    rest to the current `sys.stderr`. Callers ask for it when they log (a loop
    when it starts), so configuring structlog later takes effect then.
    """
    global _logger, _structlog
    if _logger is None:
        import structlog

        _structlog = structlog
        _logger = structlog.get_logger("agentfsm")
    structlog = _structlog  # an `import` statement per loop cost ~1,500 instructions
    assert structlog is not None
    if structlog.is_configured():
        return _logger
    quiet: FilteringBoundLogger = structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_name="agentfsm",
        processors=_quiet_processors(),
    )
    return quiet


_processors: list[Any] | None = None


def _quiet_processors() -> list[Any]:
    """One that makes every value printable (what agentfsm logs may quote a
    model or a server, and it goes to a terminal), then structlog's processors
    as configured when the line is logged (a module's logger, made before the
    application configured structlog, follows it so). Made once: a loop asks
    for its logger as it starts."""
    global _processors
    if _processors is None:
        from ._text import printable_log

        def configured(logger: Any, method: str, event: Any) -> Any:
            for processor in _structlog.get_config()["processors"]:
                event = processor(logger, method, event)
            return event

        _processors = [printable_log, configured]
    return _processors


def bind_loop_ids(loop_id: str, agent_id: str) -> None:
    """Bind `loop_id` and `agent_id` in structlog's context variables (for
    every log line of this task, a tool's own included).

    The first call binds through structlog and keeps the two variables its
    tokens name (`Token.var`); later calls set those: structlog's
    `bind_contextvars` builds a dict of keywords, a name per key and a dict of
    tokens each time (~7,000 instructions a loop, `make bench-instructions`;
    tests/test_logging.py checks structlog reads what is set).
    """
    global _loop_vars
    if _loop_vars is None:
        import structlog.contextvars

        tokens = structlog.contextvars.bind_contextvars(
            loop_id=loop_id, agent_id=agent_id
        )
        _loop_vars = (tokens["loop_id"].var, tokens["agent_id"].var)
        return
    loop_var, agent_var = _loop_vars
    loop_var.set(loop_id)
    agent_var.set(agent_id)
