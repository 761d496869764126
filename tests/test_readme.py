"""The README's quick start runs as written and prints what the README says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    """The first python block of the README prints the text block after it."""
    text = README.read_text(encoding="utf-8")
    quick_start = text[text.index("## Quick start") :]
    code = re.search(r"```python\n(.*?)```", quick_start, re.DOTALL)
    printed = re.search(r"It prints:\n\n```text\n(.*?)```", quick_start, re.DOTALL)
    assert code is not None
    assert printed is not None
    script = tmp_path / "quick_start.py"
    script.write_text(code.group(1), encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == printed.group(1)


REPOSITORY = "https://github.com/agentfsm/agentfsm"
"""The repository the README's links point into (pyproject's `Source`)."""
RAW = "https://raw.githubusercontent.com/agentfsm/agentfsm/main/"
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)")
DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
HTML = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)""")


def _targets(text: str) -> list[str]:
    """The targets of the README's links and images, outside code blocks."""
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return [
        target
        for pattern in (INLINE, DEFINITION, HTML)
        for target in pattern.findall(prose)
    ]


def test_every_link_and_image_is_absolute() -> None:
    """PyPI shows the README away from the repository: a relative link or
    image (`docs/x.md`, `bench/peers.png`) is broken there."""
    targets = _targets(README.read_text(encoding="utf-8"))
    assert targets, "the README has links: the patterns must find them"
    relative = [t for t in targets if not t.startswith("https://")]
    assert relative == []


def test_the_repository_links_name_files_that_exist() -> None:
    """A link into the repository names a file or directory of this checkout,
    so a renamed page breaks this test, not the README."""
    root = README.parent
    paths = []
    for target in _targets(README.read_text(encoding="utf-8")):
        for prefix in (f"{REPOSITORY}/blob/main/", f"{REPOSITORY}/tree/main/", RAW):
            if target.startswith(prefix):
                paths.append(target.removeprefix(prefix).split("#")[0])
    assert "bench/peers.png" in paths  # the image, through raw.githubusercontent
    missing = [path for path in paths if not (root / path).exists()]
    assert missing == []


def test_the_patterns_find_every_kind_of_link() -> None:
    """The check above sees inline links, images, reference definitions and
    HTML, and skips code (a relative path in a shell example is no link)."""
    sample = (
        "[a](docs/a.md) ![b](b.png) <img src='c.png'> <a href=\"d.md\">d</a>\n"
        "[e]: e.md\n`[f](f.md)`\n```text\n[g](g.md)\n```\n"
    )
    assert _targets(sample) == ["docs/a.md", "b.png", "e.md", "c.png", "d.md"]
