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
