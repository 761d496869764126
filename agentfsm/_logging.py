"""The library's logger. agentfsm never configures structlog; applications do."""

from __future__ import annotations

import structlog
from structlog.typing import FilteringBoundLogger

logger: FilteringBoundLogger = structlog.get_logger("agentfsm")
