from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog
from structlog.typing import EventDict

# The `postgres_server` fixture (a PostgreSQL server started once per session).
pytest_plugins = ("tests.postgres_server",)


@pytest.fixture(
    params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")]
)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test runs on asyncio and on trio (pinned, so trio is never skipped)."""
    return str(request.param)


@pytest.fixture(name="log_output")
def _log_output() -> Iterator[list[EventDict]]:
    with structlog.testing.capture_logs() as logs:
        yield logs
