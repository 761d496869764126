"""Fork and replay from `agentfsm ui` in a real browser: Playwright driving
Debian's chromium (by its `executable_path`) against the `agentfsm ui`
command (a subprocess, acting as alice), while the loops are recorded and
forked in OTHER processes (tests/ui_fork_child.py: one records a loop; two
runtimes watch the store's requests, with the loop's tools).

The screenshots go to the test's directory, or to `docs/images/` when
`AGENTFSM_UI_SCREENSHOTS` names that directory. Without chromium the tests
are skipped, unless `AGENTFSM_REQUIRE_CHROMIUM=1`: then they fail.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, expect

from agentfsm.events import LoopStarted
from agentfsm.replay.inbox import fork_id
from tests.test_ui_actions_browser import (
    Place,
    browser,
    in_thread,
    open_loop,
    place,
    read_line,
    runs,
    served,
    shots,
    sqlite_place,
)
from tests.test_ui_browser import CHROMIUM
from tests.test_ui_fork import alter_answer
from tests.ui_actions_child import markers, store_of

__all__ = ("browser", "place", "runs", "shots")  # the fixtures used here

ROOT = Path(__file__).parent.parent

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

if CHROMIUM is None and os.environ.get("AGENTFSM_REQUIRE_CHROMIUM") != "1":
    pytestmark.append(
        pytest.mark.skip(reason="chromium is not installed (apt-get install chromium)")
    )


@contextlib.contextmanager
def child(mode: str, place: Place, runs: Path) -> Iterator[subprocess.Popen[str]]:
    """tests/ui_fork_child.py in `mode` on the place's store."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.ui_fork_child",
            mode,
            place.kind,
            place.child,
            str(runs),
        ],
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


def recorded(place: Place, runs: Path) -> str:
    """A loop recorded (run to its end) by a child process: its id."""
    with child("record", place, runs) as process:
        loop_id: str = read_line(process)["loop_id"]
    return loop_id


def store_view(place: Place, loop_id: str, fork: str) -> dict[str, Any]:
    """The source's requests and the fork's first event, as stored."""

    async def read() -> dict[str, Any]:
        store: Any = store_of(place.kind, place.child)  # (keeping events)
        async with store:
            events = await store.events(fork)
            return {"requests": await store.requests(loop_id), "first": events[0]}

    return in_thread(read)


def test_a_loop_is_forked_from_its_page_with_another_model(
    browser: Browser, place: Place, runs: Path, shots: Path
) -> None:
    """Forked from the page at its second model request with another model;
    of two runtimes watching the store, one runs the fork, once; the fork's
    page links its source and draws both paths side by side; the source's
    page lists the fork."""
    loop_id = recorded(place, runs)
    with (
        child("watch", place, runs) as first,
        child("watch", place, runs) as second,
        served(place) as base,
    ):
        watchers = {read_line(first)["watching"], read_line(second)["watching"]}
        page, dialogs = open_loop(browser, base, loop_id)
        expect(page.locator("#fork-form")).to_be_visible(timeout=30_000)
        options = page.locator("#fork-at option")
        expect(options).to_have_count(2)
        at = int(options.nth(1).get_attribute("value") or "")
        page.locator("#fork-at").select_option(str(at))
        page.locator("#fork-model").fill("scripted:other")
        page.locator("#fork").click()
        expect(page.locator("#fork-status")).to_contain_text("stored")
        row = page.locator("#forks tr.fork")
        expect(row).to_have_count(1)
        expect(row.locator("td.status")).to_have_text("applied", timeout=60_000)
        link = row.locator("a.fork-loop")
        request_id = int(row.get_attribute("data-request") or "")
        fork = fork_id(request_id, loop_id)
        expect(link).to_have_text(fork)
        page.screenshot(path=shots / "ui-fork-source.png", full_page=True)
        link.click()
        expect(page.locator("body")).to_have_attribute(
            "data-status", "done", timeout=60_000
        )
        expect(page.locator("#fork-of")).to_be_visible(timeout=30_000)
        expect(page.locator("#fork-source")).to_have_text(loop_id)
        expect(page.locator("#fork-seq-of")).to_have_text(str(at))
        for drawing in ("#source-diagram", "#fork-diagram"):
            expect(page.locator(f"{drawing} g.node")).not_to_have_count(0)
            expect(page.locator(f"{drawing} path.edge.taken")).not_to_have_count(0)
        expect(page.locator("#answer")).to_have_text("10")
        page.screenshot(path=shots / "ui-fork.png", full_page=True)
        page.locator("#fork-source").click()
        expect(page.locator("#forks tr.fork a.fork-loop")).to_have_text(
            fork, timeout=30_000
        )
        assert dialogs == []
        page.close()
    ran = [(m["arguments"], m["pid"]) for m in markers(runs)]
    forked = [pid for arguments, pid in ran if arguments == {"a": 5, "b": 5}]
    assert len(forked) == 1  # the fork's tool ran once, in one watcher
    assert forked[0] in watchers
    assert [arguments for arguments, _ in ran].count({"a": 1, "b": 2}) == 1
    found = store_view(place, loop_id, fork)
    ((kind, model, by, status),) = [
        (r.kind, r.model, r.by, r.status) for r in found["requests"]
    ]
    assert (kind, model, by, status) == ("fork", "scripted:other", "alice", "applied")
    first_event = found["first"]
    assert isinstance(first_event, LoopStarted)
    assert first_event.model == "scripted:other"
    assert first_event.forked_from is not None
    assert (first_event.forked_from.loop_id, first_event.forked_from.seq) == (
        loop_id,
        at,
    )


def test_a_replay_shows_no_divergence_then_an_altered_recordings(
    browser: Browser, tmp_path: Path, runs: Path, shots: Path
) -> None:
    """A clean loop replays with no divergence; once its recorded answer is
    changed in the store, the replay shows where it first differs."""
    place = sqlite_place(tmp_path)
    loop_id = recorded(place, runs)
    with served(place) as base:
        page, dialogs = open_loop(browser, base, loop_id)
        expect(page.locator("#replay-box")).to_be_visible(timeout=30_000)
        page.locator("#replay").click()
        expect(page.locator("#replay-status")).to_have_text(
            "no divergence (handlers: none)", timeout=60_000
        )
        expect(page.locator("#replay-result")).to_contain_text("no divergence")
        expect(page.locator("#replay-differences")).to_be_hidden()
        seq = alter_answer(tmp_path / "loops.db", loop_id, "<b>4</b>")
        page.locator("#replay").click()
        expect(page.locator("#replay-status")).to_have_text(
            "diverged (handlers: none)", timeout=60_000
        )
        expect(page.locator("#replay-result")).to_contain_text(f"diverged at seq {seq}")
        difference = page.locator("#replay-differences tr.difference")
        expect(difference).to_have_count(1)
        expect(difference.locator("td").nth(1)).to_have_text('"<b>4</b>"')
        expect(difference.locator("td").nth(2)).to_have_text('"3"')
        assert page.locator("main b").count() == 0  # shown as text
        page.screenshot(path=shots / "ui-replay-divergence.png", full_page=True)
        assert dialogs == []
        page.close()
    assert [m["arguments"] for m in markers(runs)] == [{"a": 1, "b": 2}]
