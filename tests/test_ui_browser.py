"""`agentfsm ui` in a real browser: Playwright driving Debian's chromium
(launched by its `executable_path`: no browser is downloaded), against the
`agentfsm ui` command serving a SQLite store that another process's runtime
writes (tests/ui_loop_child.py).

The screenshots go to the test's directory, or to `docs/images/` when
`AGENTFSM_UI_SCREENSHOTS` names that directory (`make ui-screenshots`).
Without chromium the tests are skipped, unless `AGENTFSM_REQUIRE_CHROMIUM=1`
(set by `.ci/run`, which installs it): then they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import pytest
from playwright.sync_api import Browser, Dialog, expect, sync_playwright

from agentfsm._text import printable
from agentfsm.store import SQLiteStore
from tests.ui_loop_child import HOSTILE

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TOKEN = "browser-token-0123456789"
CHILD = Path(__file__).with_name("ui_loop_child.py")

pytestmark = [pytest.mark.e2e]

if CHROMIUM is None and os.environ.get("AGENTFSM_REQUIRE_CHROMIUM") != "1":
    pytestmark.append(
        pytest.mark.skip(reason="chromium is not installed (apt-get install chromium)")
    )


# As the machine's own probe starts it: no sandbox (root), and none of the
# background connections a closed network refuses.
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert CHROMIUM is not None, "chromium is required (AGENTFSM_REQUIRE_CHROMIUM=1)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield launched
        launched.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    wanted = os.environ.get("AGENTFSM_UI_SCREENSHOTS")
    return Path(wanted) if wanted else tmp_path


async def create(db: Path) -> None:
    async with SQLiteStore(db, events=True):
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`agentfsm ui` on a new, empty store: `(base URL, the store's path)`."""
    db = tmp_path / "loops.db"
    # In a thread of its own: Playwright's event loop runs in this one.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(anyio.run, create, db).result()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentfsm",
            "ui",
            str(db),
            "--port",
            "0",
            "--token",
            TOKEN,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/", process.stdout.readline())
        assert match, process.communicate(timeout=30)
        yield f"http://127.0.0.1:{match.group(1)}", db
    finally:
        process.terminate()
        process.communicate(timeout=30)


@pytest.fixture
def child(server: tuple[str, Path]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A process running one loop on the store; `(process, loop id)`: its
    loop waits in `function_call` until a line is written to its stdin."""
    process = subprocess.Popen(
        [sys.executable, str(CHILD), str(server[1])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    try:
        assert process.stdout is not None
        loop_id = process.stdout.readline().strip()
        assert loop_id, process.communicate(timeout=30)
        yield process, loop_id
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


def open_gate(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.write("the gate is open\n")
    process.stdin.flush()
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "done"


def test_a_loop_of_another_process_shows_live_and_its_text_stays_text(
    browser: Browser,
    server: tuple[str, Path],
    child: tuple[subprocess.Popen[str], str],
    shots: Path,
) -> None:
    base, _ = server
    process, loop_id = child
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    hosts: set[str] = set()
    dialogs: list[str] = []
    page.on("request", lambda r: hosts.add(urlsplit(r.url).netloc or r.url))

    def dialog(shown: Dialog) -> None:
        dialogs.append(shown.message)
        shown.dismiss()

    page.on("dialog", dialog)

    page.goto(f"{base}/?token={TOKEN}")
    assert "token=" not in page.url  # traded for a cookie
    row = page.locator(f'tr.loop[data-loop="{loop_id}"]')
    expect(row.locator("td.status")).to_have_text("running", timeout=30_000)
    expect(row.locator("td.state")).to_have_text("function_call", timeout=30_000)
    page.screenshot(path=shots / "ui-loops.png", full_page=True)

    row.locator("a").click()
    expect(page.locator("body")).to_have_attribute("data-state", "function_call")
    expect(
        page.locator('#diagram .node.current[data-state="function_call"]')
    ).to_have_count(1)
    expect(page.locator("tr.call.started td.status")).to_have_text("started")
    page.screenshot(path=shots / "ui-loop-running.png", full_page=True)

    open_gate(process)
    expect(page.locator("body")).to_have_attribute(
        "data-status", "done", timeout=30_000
    )
    # As text, its controls escaped as the library's `printable` writes them.
    expect(page.locator("#answer")).to_have_text(printable(HOSTILE))
    expect(page.locator("#diagram .node.current")).to_have_attribute(
        "data-state", "idle_end"
    )
    rows = page.locator("#timeline tbody tr")
    expect(rows.last).to_have_class(re.compile(r"\bidle\b"))
    page.screenshot(path=shots / "ui-loop-done.png", full_page=True)

    # The model's text is in the page as text: no element it names, no dialog.
    assert (
        page.locator(
            "main img, main script:not([src]), main a[href^=javascript]"
        ).count()
        == 0
    )
    shown = page.locator("#items li").first.locator("pre").inner_text()
    assert shown == printable(HOSTILE)
    assert "\\x1b[31m red \\u202e" in shown
    assert dialogs == []

    # Reloaded, the page has every row once, in order, as the API has them.
    live_rows = [int(s) for s in rows.evaluate_all("rs => rs.map(r => r.dataset.seq)")]
    page.reload()
    expect(page.locator("body")).to_have_attribute(
        "data-status", "done", timeout=30_000
    )
    expect(rows).to_have_count(len(live_rows))
    reloaded = [int(s) for s in rows.evaluate_all("rs => rs.map(r => r.dataset.seq)")]
    api = page.request.get(f"{base}/api/loops/{loop_id}")
    assert api.ok
    assert reloaded == live_rows == [r["seq"] for r in json.loads(api.text())["rows"]]
    assert len(set(reloaded)) == len(reloaded)

    # Nothing was asked of any host but the UI's own.
    assert hosts == {urlsplit(base).netloc}
    page.close()


def test_a_page_without_the_token_shows_nothing(
    browser: Browser, server: tuple[str, Path]
) -> None:
    base, _ = server
    page = browser.new_page()
    answer = page.goto(f"{base}/")
    assert answer is not None
    assert answer.status == 401
    assert "token" in page.locator("body").inner_text()
    page.close()
