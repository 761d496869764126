"""The docs' runnable examples run as written (no network: scripted models)."""

from __future__ import annotations

import ast
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKED = re.compile(r"<!-- test: runs -->\n```python\n(.*?)```", re.DOTALL)


def _examples() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        if page.is_symlink() or "diagrams" in page.parts:
            continue
        for n, code in enumerate(MARKED.findall(page.read_text(encoding="utf-8"))):
            found.append((f"{page.relative_to(DOCS)}#{n + 1}", code))
    return found


EXAMPLES = _examples()


def test_the_docs_have_runnable_examples() -> None:
    """Each concept and how-to with a marked example keeps it (the marker matters)."""
    pages = {name.split("#")[0] for name, _ in EXAMPLES}
    assert {
        "getting-started.md",
        "concepts/interception.md",
        "concepts/contexts.md",
        "how-to/approval.md",
        "how-to/budgets.md",
        "how-to/streaming.md",
        "how-to/images.md",
        "durability.md",
    } <= pages


BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def test_no_example_sets_a_sampling_setting_anthropic_leaves_out() -> None:
    """An example on an `anthropic:` model sets no `temperature`, `top_p` or
    `seed`: the Messages API takes none, so the provider drops them unsaid."""
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    found = [
        f"{page.relative_to(ROOT)}: {setting}"
        for page in pages
        if not page.is_symlink()
        for block in BLOCK.findall(page.read_text(encoding="utf-8"))
        if '"anthropic:' in block
        for setting in ("temperature", "top_p", "seed")
        if f'"{setting}"' in block
    ]
    assert found == []


@pytest.mark.parametrize(
    "code", [pytest.param(code, id=name) for name, code in EXAMPLES]
)
def test_example_runs(code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


DOC_PATH = re.compile(r"(?<![\w/.-])docs/[\w/.-]+\.md")
"""A page named by its path in the repository (`docs/x.md`): dead text on the
site, and a relative link to it is broken there too (docstrings are rendered
apart from the page's own links)."""


def _docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    nodes = list(ast.walk(tree))
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = [
        (getattr(node, "lineno", 1), doc)
        for node in nodes
        if isinstance(node, kinds) and (doc := ast.get_docstring(node)) is not None
    ]
    # An attribute's docstring: the string statement after an assignment.
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for before, after in itertools.pairwise(body):
            if (
                isinstance(before, ast.Assign | ast.AnnAssign)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                found.append((after.lineno, after.value.value))
    return found


def test_docstrings_link_to_pages_instead_of_naming_their_files() -> None:
    """A docstring that sends the reader to a page links it (autorefs'
    `[Durable loops][durable-loops]`), which works on the docs site; a bare
    `docs/durability.md` is dead text there and on PyPI. The command line's
    own modules are not in the reference and are exempt."""
    package = ROOT / "agentfsm"
    found = [
        f"{path.relative_to(ROOT)}:{line}: {match}"
        for path in sorted(package.rglob("*.py"))
        if "cli" not in path.relative_to(package).parts
        for line, doc in _docstrings(ast.parse(path.read_text(encoding="utf-8")))
        for match in DOC_PATH.findall(doc)
    ]
    assert found == []


def test_the_docstring_pattern_finds_plain_paths_only() -> None:
    """The check above catches a path, bare or as a relative link, and not a
    URL nor an autorefs link."""
    text = "see docs/a.md, [b](docs/how-to/b.md), https://x.io/docs/c.md, [d][d]"
    assert DOC_PATH.findall(text) == ["docs/a.md", "docs/how-to/b.md"]
    tree = ast.parse('"""see docs/a.md"""\nX = 1\n"""and docs/b.md"""\n')
    assert [doc for _, doc in _docstrings(tree)] == ["see docs/a.md", "and docs/b.md"]
