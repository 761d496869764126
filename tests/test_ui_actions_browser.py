"""Acting from `agentfsm ui` in a real browser: Playwright driving Debian's
chromium (by its `executable_path`) against the `agentfsm ui` command (a
subprocess, acting as alice), while the loops live in ANOTHER process
(tests/ui_actions_child.py: a runtime watching its store's requests).

The screenshots go to the test's directory, or to `docs/images/` when
`AGENTFSM_UI_SCREENSHOTS` names that directory. Without chromium the tests
are skipped, unless `AGENTFSM_REQUIRE_CHROMIUM=1`: then they fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import anyio
import pytest
from playwright.sync_api import Browser, Dialog, Page, expect, sync_playwright

from agentfsm.messages import FunctionCallOutputItem
from agentfsm.store import SQLiteStore
from agentfsm.store._sql import SQLStore
from tests.test_ui_browser import ARGS, CHROMIUM
from tests.ui_actions_child import markers

TOKEN = "actions-browser-token-0123"
CHILD = Path(__file__).with_name("ui_actions_child.py")
ROOT = Path(__file__).parent.parent
HOSTILE_REASON = '<img src=x onerror="alert(1)"> bob \u202esaid no'

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

if CHROMIUM is None and os.environ.get("AGENTFSM_REQUIRE_CHROMIUM") != "1":
    pytestmark.append(
        pytest.mark.skip(reason="chromium is not installed (apt-get install chromium)")
    )

_T = TypeVar("_T")


@dataclass(frozen=True)
class Place:
    """Where a test's loops live: the store as the child, the `agentfsm ui`
    command and this process name it."""

    kind: str
    child: str
    """The child's WHERE (see tests/ui_actions_child.py)."""
    ui: list[str]
    """`agentfsm ui`'s arguments naming the store."""
    open: Callable[[], SQLStore[Any]]
    """A new read-only store object on it."""


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


@pytest.fixture(params=["sqlite", "postgres"])
def place(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "sqlite":
        return sqlite_place(tmp_path)
    from agentfsm.store.postgres import PostgresStore

    server: Any = request.getfixturevalue("postgres_server")
    schema = f"t_{uuid.uuid4().hex}"
    url = f"postgresql://agentfsm@127.0.0.1:{server.port}/agentfsm_test"
    return Place(
        "postgres",
        f"{server.conninfo()} {schema}",
        [url, "--schema", schema],
        lambda: PostgresStore(server.conninfo(), schema=schema, read_only=True),
    )


def sqlite_place(tmp_path: Path) -> Place:
    db = tmp_path / "loops.db"
    return Place(
        "sqlite",
        str(db),
        [str(db)],
        lambda: SQLiteStore(db, events=True, read_only=True),
    )


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    """Where the children's tools record each run (a file per run)."""
    folder = tmp_path / "runs"
    folder.mkdir()
    return folder


def in_thread(fn: Callable[[], Awaitable[_T]]) -> _T:
    """`anyio.run(fn)` in a thread of its own: Playwright's event loop runs
    in this one."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, fn).result()


def read_line(process: subprocess.Popen[str], timeout: float = 120) -> dict[str, Any]:
    """The next JSON line the process prints (a hang guard of `timeout`)."""
    assert process.stdout is not None
    with ThreadPoolExecutor(1) as pool:
        line = pool.submit(process.stdout.readline).result(timeout=timeout)
    assert line, process.stderr and process.stderr.read()
    found: dict[str, Any] = json.loads(line)
    return found


@contextlib.contextmanager
def child(mode: str, place: Place, runs: Path) -> Iterator[subprocess.Popen[str]]:
    """tests/ui_actions_child.py in `mode` on the place's store."""
    process = subprocess.Popen(
        [sys.executable, str(CHILD), mode, place.kind, place.child, str(runs)],
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


@contextlib.contextmanager
def served(place: Place) -> Iterator[str]:
    """`agentfsm ui` on the place's store, acting as alice: its base URL."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentfsm",
            "ui",
            *place.ui,
            "--port",
            "0",
            "--token",
            TOKEN,
            "--as",
            "alice",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        assert "acts as alice" in first, (first, process.communicate(timeout=30))
        match = re.search(r"http://127\.0\.0\.1:(\d+)/", process.stdout.readline())
        assert match, process.communicate(timeout=30)
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        process.terminate()
        process.communicate(timeout=30)


def open_loop(browser: Browser, base: str, loop_id: str) -> tuple[Page, list[str]]:
    """The loop's page (entered with the token); the dialogs it opened."""
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    dialogs: list[str] = []

    def dialog(shown: Dialog) -> None:
        dialogs.append(shown.message)
        shown.dismiss()

    page.on("dialog", dialog)
    page.goto(f"{base}/loop/{quote(loop_id, safe='')}?token={TOKEN}")
    assert "token=" not in page.url
    return page, dialogs


def stored(place: Place, loop_id: str) -> dict[str, Any]:
    """What the store holds of the loop: its decisions, ledger, context items
    and requests."""

    async def read() -> dict[str, Any]:
        async with place.open() as store:
            loaded = await store.load(loop_id)
            assert loaded is not None
            return {
                "status": loaded.record.status,
                "decisions": await store.decisions(loop_id),
                "calls": await store.calls(loop_id),
                "items": loaded.items,
                "requests": await store.requests(loop_id),
            }

    return in_thread(read)


def test_a_paused_batch_is_approved_denied_and_edited_from_the_page(
    browser: Browser, place: Place, runs: Path, shots: Path
) -> None:
    """Each call separately: c1 approved, c2 denied with a reason, c3 run
    with arguments edited in the page. The child's runtime applies the
    request: each tool runs exactly once, as decided; the denied call's
    output carries the reason; the decision entry names alice."""
    with child("approve", place, runs) as process:
        loop_id = read_line(process)["loop_id"]
        with served(place) as base:
            page, dialogs = open_loop(browser, base, loop_id)
            rows = page.locator("#calls-form tr.call-form")
            expect(rows).to_have_count(3, timeout=30_000)
            expect(page.locator("#acting-as")).to_have_text("as alice")
            expect(page.locator("#proceed")).to_be_hidden()
            c1, c2, c3 = (
                page.locator(f'tr.call-form[data-call="c{n}"]') for n in (1, 2, 3)
            )
            c1.locator('input[value="approve"]').check()
            c2.locator('input[value="deny"]').check()
            c2.locator("input.reason").fill(HOSTILE_REASON)
            c3.locator('input[value="edit"]').check()
            edited = c3.locator("textarea.arguments")
            assert json.loads(edited.input_value()) == {"to": "cy", "text": "hi cy"}
            edited.fill('{"to": "cy", "text": "edited in the page"}')
            page.screenshot(path=shots / "ui-actions-approval.png", full_page=True)
            page.locator("#submit-calls").click()
            expect(page.locator("#action-status")).to_contain_text("stored")
            expect(page.locator("body")).to_have_attribute(
                "data-status", "done", timeout=60_000
            )
            request_row = page.locator("#requests tr.request")
            expect(request_row).to_have_count(1)
            expect(request_row.locator("td.status")).to_have_text("applied")
            expect(request_row.locator("td.by")).to_have_text("alice")
            # The reason is text: shown with its controls escaped, run as nothing.
            expect(request_row.locator("summary")).to_contain_text(
                '<img src=x onerror="alert(1)"> bob \\u202esaid no'
            )
            expect(page.locator("#actions")).to_be_hidden()
            assert page.locator("main img").count() == 0
            assert dialogs == []
            page.close()
        ended = read_line(process)
    assert ended["outcome"] == "answered"
    ran = sorted((m["arguments"] for m in markers(runs)), key=lambda a: a["to"])
    assert ran == [
        {"to": "ada", "text": "hi ada"},
        {"to": "cy", "text": "edited in the page"},
    ]
    assert {m["pid"] for m in markers(runs)} == {process.pid}
    found = stored(place, loop_id)
    last = found["decisions"][-1]
    assert (last.by, last.decision.kind) == ("alice", "rewrite")
    (denied,) = [
        i
        for i in found["items"]
        if isinstance(i, FunctionCallOutputItem) and i.call_id == "c2"
    ]
    assert denied.is_error
    assert HOSTILE_REASON in denied.output
    assert [(r.by, r.status) for r in found["requests"]] == [("alice", "applied")]


def test_a_running_loop_is_cancelled_from_the_page(
    browser: Browser, tmp_path: Path, runs: Path
) -> None:
    place = sqlite_place(tmp_path)
    with child("run", place, runs) as process:
        loop_id = read_line(process)["loop_id"]
        with served(place) as base:
            page, _ = open_loop(browser, base, loop_id)
            expect(page.locator("#actions")).to_be_visible(timeout=30_000)
            expect(page.locator("#resume-form")).to_be_hidden()
            page.locator("#cancel").click()  # no reason: said in the page, not sent
            expect(page.locator("#action-status")).to_contain_text("why")
            page.locator("#cancel-reason").fill("the user left")
            page.locator("#cancel").click()
            expect(page.locator("body")).to_have_attribute(
                "data-status", "done", timeout=60_000
            )
            expect(page.locator("#requests tr.request td.status")).to_have_text(
                "applied", timeout=30_000
            )
            page.close()
        ended = read_line(process)
    assert (ended["outcome"], ended["reason"]) == ("cancelled", "the user left")
    found = stored(place, loop_id)
    assert [(r.kind, r.by, r.status) for r in found["requests"]] == [
        ("cancel", "alice", "applied")
    ]


def test_an_uncertain_call_is_settled_from_the_page(
    browser: Browser, tmp_path: Path, runs: Path, shots: Path
) -> None:
    """A child killed (SIGKILL) while `charge` ran; another recovers the loop,
    paused over the uncertain call. "It ran: record this output" from the
    page: the output is recorded, and `charge` never runs again."""
    place = sqlite_place(tmp_path)
    with child("crash", place, runs) as crashed:
        loop_id = read_line(crashed)["loop_id"]
        os.kill(crashed.pid, signal.SIGKILL)
        crashed.wait(timeout=30)
    assert [m["tool"] for m in markers(runs)] == ["charge"]
    with child("recover", place, runs) as process:
        assert read_line(process)["loop_id"] == loop_id
        with served(place) as base:
            page, _ = open_loop(browser, base, loop_id)
            row = page.locator('tr.call-form.uncertain[data-call="k1"]')
            expect(row).to_have_count(1, timeout=30_000)
            expect(row.locator("label.choice")).to_have_text(
                ["it ran: record this output", "it did not: run it", "deny"]
            )
            expect(
                page.locator('#ledger tr.call[data-call="k1"] td.status')
            ).to_have_text("uncertain")
            page.locator("#submit-calls").click()  # nothing chosen: said, not sent
            expect(row.locator("p.field-error")).to_be_visible()
            row.locator('input[value="answer"]').check()
            row.locator("textarea.output").fill("charged 5 (receipt 42)")
            page.screenshot(path=shots / "ui-actions-uncertain.png", full_page=True)
            page.locator("#submit-calls").click()
            expect(page.locator("body")).to_have_attribute(
                "data-status", "done", timeout=60_000
            )
            expect(
                page.locator('#ledger tr.call[data-call="k1"] td.status')
            ).to_have_text("done")
            page.close()
        ended = read_line(process)
    assert ended["outcome"] == "answered"
    assert [m["tool"] for m in markers(runs)] == ["charge"]  # the killed run only
    (entry,) = stored(place, loop_id)["calls"]
    assert (entry.status, entry.by) == ("done", "alice")
    assert entry.output is not None
    assert entry.output.output == "charged 5 (receipt 42)"


class _Attacker(BaseHTTPRequestHandler):
    """A page of another origin (another port of the same host, to which the
    UI's cookie is sent too) that tries to act on the loop."""

    target = ""

    def do_GET(self) -> None:
        script = f"""
        const target = {json.dumps(self.target)};
        const body = JSON.stringify({{kind: "cancel", reason: "forged"}});
        Promise.allSettled([
          fetch(target, {{method: "POST", mode: "no-cors", credentials: "include",
                          headers: {{"content-type": "text/plain"}}, body}}),
          fetch(target, {{method: "POST", credentials: "include",
                          headers: {{"content-type": "application/json",
                                     "x-agentfsm-form": "0".repeat(64)}}, body}}),
        ]).then(() => {{ document.title = "tried"; }});
        """
        page = f"<!doctype html><title>attacker</title><script>{script}</script>"
        data = page.encode()
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_page_of_another_origin_cannot_act(
    browser: Browser, tmp_path: Path, runs: Path
) -> None:
    """The browser holds the UI's cookie and sends it to the UI from a page
    of another port: that page's POST is refused (no form token, a foreign
    Origin: tests/test_ui_actions.py checks each), its CORS one never leaves
    (the preflight is refused), and nothing is stored: the fetches settle
    once the server has answered, so the store is read after them."""
    place = sqlite_place(tmp_path)
    with child("approve", place, runs) as process:
        loop_id = read_line(process)["loop_id"]
        with served(place) as base:
            page, _ = open_loop(browser, base, loop_id)
            expect(page.locator("#calls-form tr.call-form")).to_have_count(
                3, timeout=30_000
            )
            _Attacker.target = f"{base}/api/loops/{quote(loop_id, safe='')}/requests"
            evil = ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)
            serving = threading.Thread(target=evil.serve_forever, daemon=True)
            serving.start()
            failed: list[str] = []
            page.on(
                "requestfailed",
                lambda r: (
                    failed.append(f"{r.method} {r.failure}")
                    if "/requests" in r.url
                    else None
                ),
            )
            try:
                page.goto(f"http://127.0.0.1:{evil.server_address[1]}/")
                expect(page).to_have_title("tried", timeout=30_000)
                # The no-cors POST was answered (the answer then withheld from
                # the page: Cross-Origin-Resource-Policy); the CORS one never
                # left (its preflight, without the cookie, was refused).
                assert any("BLOCKED_BY_RESPONSE" in f for f in failed), failed
            finally:
                evil.shutdown()
                evil.server_close()
                serving.join(timeout=30)
            page.close()
        found = stored(place, loop_id)
        assert found["requests"] == []
        assert str(found["status"]) == "paused"
        assert process.poll() is None  # still holding the loop, paused
    assert markers(runs) == []
