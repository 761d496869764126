"""Built-in provider prefixes, and the vendor SDKs staying optional."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from agentfsm import ConfigurationError, ProviderRegistry
from agentfsm import providers as providers_module
from agentfsm.exceptions import UnknownProvider
from agentfsm.providers.anthropic import AnthropicProvider
from agentfsm.providers.function import FunctionProvider
from agentfsm.providers.openai import OpenAIChatProvider, OpenAIResponsesProvider
from agentfsm.testing import text

SDKS = ("openai", "anthropic", "httpx2", "llama_cpp")


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_import_agentfsm_imports_no_vendor_sdk() -> None:
    """`import agentfsm` (and its core modules) imports none of the vendor SDKs."""
    result = run_python(
        f"""
        import sys
        import agentfsm, agentfsm.providers, agentfsm.providers.function
        import agentfsm.testing, agentfsm.events
        registry = agentfsm.ProviderRegistry()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {SDKS!r})
        print(loaded)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_missing_sdk_says_which_extra_to_install(sdk: str) -> None:
    """Without the SDK, importing its provider raises an ImportError naming the extra."""
    result = run_python(
        f"""
        import sys
        sys.modules[{sdk!r}] = None  # as if it were not installed
        try:
            import agentfsm.providers.{sdk}
        except ImportError as exc:
            print(exc)
        """
    )
    assert result.returncode == 0, result.stderr
    assert f"pip install 'agentfsm[{sdk}]'" in result.stdout


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


@pytest.mark.usefixtures("keys")
@pytest.mark.parametrize(
    ("model", "kind"),
    [
        pytest.param("openai:gpt-4.1-mini", OpenAIResponsesProvider, id="openai"),
        pytest.param("openai-chat:qwen2.5:7b", OpenAIChatProvider, id="openai-chat"),
        pytest.param("anthropic:claude-sonnet-4-6", AnthropicProvider, id="anthropic"),
    ],
)
def test_builtin_prefixes_resolve_to_default_providers(model: str, kind: type) -> None:
    """An unregistered built-in prefix gets a default provider, made once."""
    registry = ProviderRegistry()
    provider = registry.resolve(model)
    assert isinstance(provider, kind)
    prefix = model.partition(":")[0]
    assert registry.resolve(f"{prefix}:another-model") is provider
    assert registry.prefixes == []


@pytest.mark.usefixtures("keys")
def test_registered_provider_wins_over_the_builtin() -> None:
    """Registering a built-in prefix replaces its default provider."""
    mine = FunctionProvider(lambda request: text("hi"))
    registry = ProviderRegistry({"openai": mine})
    assert registry.resolve("openai:gpt-4.1-mini") is mine


def test_builtin_without_credentials_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A default provider that cannot be configured says what to set."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with pytest.raises(ConfigurationError, match="OPENAI_API_KEY"):
        ProviderRegistry().resolve("openai:gpt-4.1-mini")


def test_builtin_whose_module_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in prefix whose module is not there is an UnknownProvider."""
    monkeypatch.setitem(
        providers_module._BUILTIN_PROVIDERS,
        "local",
        ("agentfsm.providers._not_installed", "LocalProvider"),
    )
    with pytest.raises(UnknownProvider, match="not part of this agentfsm installation"):
        ProviderRegistry().resolve("local:smollm2")


def test_builtin_whose_sdk_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A built-in prefix whose SDK is missing is an UnknownProvider naming the extra."""
    monkeypatch.setitem(sys.modules, "anthropic", None)
    monkeypatch.delitem(sys.modules, "agentfsm.providers.anthropic")
    with pytest.raises(UnknownProvider, match=r"pip install 'agentfsm\[anthropic\]'"):
        ProviderRegistry().resolve("anthropic:claude-sonnet-4-6")


def test_unknown_prefix_lists_the_builtins() -> None:
    """An unknown prefix names the registered and the built-in ones."""
    with pytest.raises(
        UnknownProvider, match="prefix 'nope' is not registered"
    ) as caught:
        ProviderRegistry().resolve("nope:model")
    assert "built in: openai, openai-chat, anthropic, local" in str(caught.value)


@pytest.mark.usefixtures("keys")
async def test_runtime_closes_the_builtin_providers_it_created() -> None:
    """Leaving a runtime closes the default providers its registry made, not yours."""
    closed: list[str] = []

    class Mine(FunctionProvider):
        async def aclose(self) -> None:
            closed.append("mine")

    from agentfsm import Runtime

    async with Runtime(providers={"mine": Mine(lambda request: text("hi"))}) as runtime:
        builtin = runtime.providers.resolve("openai:gpt-4.1-mini")
        assert isinstance(builtin, OpenAIResponsesProvider)
        client = builtin._client
    assert client.is_closed()
    assert closed == []
    # A later lookup makes a fresh default provider.
    assert runtime.providers.resolve("openai:gpt-4.1-mini") is not builtin
