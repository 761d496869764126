"""Every name in `__all__` exists, and public modules export what they define."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

import agentfsm

PUBLIC_MODULES = (
    "agentfsm.agent",
    "agentfsm.inference",
    "agentfsm.events",
    "agentfsm.interception",
    "agentfsm.tools",
    "agentfsm.providers",
    "agentfsm.providers.function",
    "agentfsm.providers.openai",
    "agentfsm.providers.anthropic",
    "agentfsm.exceptions",
    "agentfsm.testing",
    "agentfsm.states",
    "agentfsm.messages",
    "agentfsm.results",
    "agentfsm.diagrams",
    "agentfsm.eventlog",
    "agentfsm.timeline",
    "agentfsm.replay",
    "agentfsm.breakpoints",
    "agentfsm.reconcile",
    "agentfsm.extensions",
)


def public_module(name: str) -> ModuleType:
    return importlib.import_module(name)


def test_package_all_names_exist() -> None:
    """Every name in `agentfsm.__all__` is an attribute of the package."""
    missing = [name for name in agentfsm.__all__ if not hasattr(agentfsm, name)]
    assert missing == []


def test_names_loaded_on_first_use_are_listed_and_reachable() -> None:
    """The event classes load on first use, yet `dir(agentfsm)` lists them and
    `agentfsm.events` is there after `import agentfsm`, as before."""
    names = dir(agentfsm)
    assert {"AgentEvent", "AgentEventAdapter", "events", "Runtime"} <= set(names)
    assert agentfsm.events is importlib.import_module("agentfsm.events")
    assert agentfsm.AgentEventAdapter is agentfsm.events.AgentEventAdapter
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        agentfsm.nope  # noqa: B018 - the lookup is the test


def test_package_all_is_unique_tuple() -> None:
    """`agentfsm.__all__` is a tuple without duplicates."""
    assert isinstance(agentfsm.__all__, tuple)
    assert len(set(agentfsm.__all__)) == len(agentfsm.__all__)


def test_package_reexports_are_the_originals() -> None:
    """Names re-exported by the package are the objects of their public modules."""
    for name in agentfsm.__all__:
        obj = getattr(agentfsm, name)
        module = getattr(obj, "__module__", None)
        if module in PUBLIC_MODULES:
            assert getattr(public_module(module), name) is obj, name


def test_package_exports_core_errors() -> None:
    """The package exports the base error and every error a caller catches first."""
    from agentfsm import exceptions

    names = ("AgentFSMError", "ConfigurationError", "ToolError", "ProviderError")
    for name in (*names, "LoopFailedError"):  # (`Agent.run` raises it)
        assert getattr(agentfsm, name) is getattr(exceptions, name)


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_module_all(name: str) -> None:
    """The module's `__all__` is a tuple of unique names that all exist."""
    module = public_module(name)
    exported = module.__all__
    assert isinstance(exported, tuple)
    assert len(set(exported)) == len(exported)
    assert [n for n in exported if not hasattr(module, n)] == []


def defined_names(module: ModuleType) -> set[str]:
    """Public names a module's own top-level statements bind (not imports)."""
    tree = ast.parse(inspect.getsource(module))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_module_exports_what_it_defines(name: str) -> None:
    """Each public class, function and constant a module defines is in its `__all__`."""
    module = public_module(name)
    assert defined_names(module) - set(module.__all__) == set()


DOCUMENTED_ELSEWHERE = (
    "agentfsm.options",
    "agentfsm.record",
    "agentfsm.otel",
    "agentfsm.mcp",
    "agentfsm.store",
    "agentfsm.store.postgres",
    "agentfsm.temporal",
)
"""Public modules outside `PUBLIC_MODULES` (their extras, or no `__all__`
check yet) that have a reference page all the same."""


@pytest.mark.parametrize("name", PUBLIC_MODULES + DOCUMENTED_ELSEWHERE)
def test_module_has_a_reference_page_in_the_nav(name: str) -> None:
    """Each public module is rendered (`::: module`) on a reference page the
    site's navigation lists: the how-to pages send readers to them."""
    root = Path(__file__).resolve().parent.parent
    directive = re.compile(rf"^::: {re.escape(name)}$", re.MULTILINE)
    pages = [
        page
        for page in sorted((root / "docs" / "reference").glob("*.md"))
        if directive.search(page.read_text(encoding="utf-8"))
    ]
    assert pages, f"no docs/reference page renders {name}"
    nav = (root / "mkdocs.yml").read_text(encoding="utf-8")
    assert any(f"reference/{page.name}" in nav for page in pages)
