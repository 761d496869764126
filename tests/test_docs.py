"""The docs' runnable examples run as written (no network: scripted models)."""

from __future__ import annotations

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
