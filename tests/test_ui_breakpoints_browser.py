"""Breakpoints from `agentfsm ui` in a real browser: Playwright driving Debian's
chromium (by its `executable_path`) against the `agentfsm ui` command (a
subprocess, acting as alice), while the loop lives in ANOTHER process
(tests/ui_breakpoints_child.py: a runtime watching its store).

The screenshot goes to the test's directory, or to `docs/images/` when
`AGENTFSM_UI_SCREENSHOTS` names that directory. Without chromium the test is
skipped, unless `AGENTFSM_REQUIRE_CHROMIUM=1`: then it fails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, expect, sync_playwright

from agentfsm.breakpoints import BREAKPOINT_HANDLER
from tests.test_ui_actions_browser import (
    in_thread,
    open_loop,
    read_line,
    served,
    sqlite_place,
)
from tests.test_ui_browser import ARGS, CHROMIUM

CHILD = Path(__file__).with_name("ui_breakpoints_child.py")
ROOT = Path(__file__).parent.parent

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

if CHROMIUM is None and os.environ.get("AGENTFSM_REQUIRE_CHROMIUM") != "1":
    pytestmark.append(
        pytest.mark.skip(reason="chromium is not installed (apt-get install chromium)")
    )


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


@contextlib.contextmanager
def child(db: Path, folder: Path) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, str(CHILD), str(db), str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


def test_a_breakpoint_set_from_the_page_pauses_the_loop_of_another_process(
    browser: Browser, tmp_path: Path, shots: Path
) -> None:
    """Set from the loop's page while the child's loop runs its first tool:
    the child's runtime sets it (from the store), the loop pauses before its
    next tool call, the page shows why; removed and resumed from the page,
    the loop ends answered, the resume's decision naming alice."""
    place = sqlite_place(tmp_path)
    flags = tmp_path / "flags"
    flags.mkdir()
    with child(Path(place.child), flags) as process:
        loop_id = read_line(process)["loop_id"]
        assert read_line(process) == {"synced": []}
        with served(place) as base:
            page, dialogs = open_loop(browser, base, loop_id)
            expect(page.locator("#break-form")).to_be_visible(timeout=30_000)
            expect(page.locator("#no-breaks")).to_be_visible()
            page.locator("#break-state").select_option("function_call")
            page.locator("#break-add").click()
            rows = page.locator("#breaks tr.break")
            expect(rows).to_have_count(1, timeout=30_000)
            expect(page.locator("#break-status")).to_contain_text("set")
            expect(rows.locator("td.by")).to_have_text("alice")
            expect(rows.locator("td.state")).to_have_text("function_call")
            expect(rows.locator("td.scope")).to_have_text("this loop")
            break_id = int(rows.get_attribute("data-break") or "0")
            assert read_line(process) == {"synced": [break_id]}
            (flags / "go").write_text("go")  # the first tool returns
            body = page.locator("body")
            expect(body).to_have_attribute("data-status", "paused", timeout=60_000)
            expect(page.locator("#pause-reason")).to_contain_text(
                f"breakpoint #{break_id} before function_call, set by alice"
            )
            page.screenshot(path=shots / "ui-breakpoints.png", full_page=True)
            rows.locator("button.remove").click()
            expect(rows).to_have_count(0, timeout=30_000)
            assert read_line(process) == {"synced": []}
            # The paused batch needs no approval: submitted as it is, it runs.
            page.locator("#submit-calls").click()
            expect(body).to_have_attribute("data-status", "done", timeout=60_000)
            expect(page.locator("#break-form")).to_be_hidden()
            assert dialogs == []
            page.close()
        ended = read_line(process)
    assert ended == {"outcome": "answered", "answer": "all done"}

    async def read() -> list[tuple[str | None, str | None, str]]:
        async with place.open() as store:
            return [
                (d.handler, d.by, d.decision.kind)
                for d in await store.decisions(loop_id)
            ]

    decisions = in_thread(read)
    assert (BREAKPOINT_HANDLER, None, "pause") in decisions
    assert decisions[-1][1:] == ("alice", "rewrite")
