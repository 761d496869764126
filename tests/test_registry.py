"""Wrong types given for providers fail at once, saying what was wrong."""

from __future__ import annotations

from typing import Any

import pytest

from agentfsm import ConfigurationError, FunctionProvider, ProviderRegistry, Runtime
from agentfsm.testing import text

provider = FunctionProvider(lambda request: text("hi"))


@pytest.mark.parametrize(
    ("providers", "message"),
    [
        pytest.param(
            [provider],
            r"providers must map model prefixes to providers, e.g\. "
            r"providers=\{'scripted': provider\}, got a list",
            id="list",
        ),
        pytest.param(
            provider,
            "providers must map model prefixes to providers.*got a FunctionProvider",
            id="one-provider",
        ),
        pytest.param(
            "openai", "providers must map.*got str 'openai'", id="a-model-prefix"
        ),
        pytest.param(
            {"fn": FunctionProvider},
            r"provider for 'fn' must be an instance, got the class FunctionProvider "
            r"\(call it: FunctionProvider\(\.\.\.\)\)",
            id="a-class",
        ),
        pytest.param(
            {"fn": "openai:gpt-4.1"},
            r"provider for 'fn' must have complete\(\) and stream\(\), "
            r"got str 'openai:gpt-4.1'",
            id="a-model-name",
        ),
        pytest.param(
            {1: provider},
            "a provider prefix must be a str .*got int 1",
            id="a-non-str-prefix",
        ),
    ],
)
def test_runtime_rejects_wrong_provider_types(providers: Any, message: str) -> None:
    """`Runtime(providers=...)` names what it got and what it wants."""
    with pytest.raises(ConfigurationError, match=message):
        Runtime(providers=providers)
    with pytest.raises(ConfigurationError, match=message):
        ProviderRegistry(providers)


def test_a_short_value_is_shown() -> None:
    with pytest.raises(ConfigurationError, match=r"got list \['openai'\]$"):
        ProviderRegistry(["openai"])  # type: ignore[arg-type]


def test_a_mapping_of_providers_is_accepted() -> None:
    registry = ProviderRegistry({"fn": provider})
    assert registry.resolve("fn:any") is provider
