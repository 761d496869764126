"""`agentfsm ui` attacked: what a hostile store, a hostile URL or a hostile
client does to the live view.

The store is made by a real runtime on scripted providers whose every text a
page shows carries markup, script, a `javascript:` URL, control characters,
a bidi override and a NUL: the agent id, the user message, call ids, tool
names, arguments, outputs, error messages, a handler's name, a pause reason,
who resumed a loop; beside loops of odd ids (a `/`, dots, `%2F`, `?` and `#`,
quotes, a NUL, a CR, a newline) and one of a megabyte of text. The server is
the real `agentfsm ui` command (a subprocess), read with httpx2, raw sockets
(for what a client library would refuse to send) and Playwright driving
Debian's chromium.

A test marked `xfail(strict=True)` shows a weakness found (its reason says
which); it passes, and must then lose its mark, once the UI is mended. The
others are the attacks the UI resists, kept as regression tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import anyio
import httpx2
import pytest

from agentfsm import LoopStatus, Pause, PendingTransition, Runtime, Trigger, tool
from agentfsm._text import printable
from agentfsm.store import SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.ui import app
from tests.helpers import request, wait_until
from tests.test_cli_loops import spoil
from tests.test_ui import AUTH, TOKEN, served

pytestmark = [pytest.mark.e2e]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("AGENTFSM_REQUIRE_CHROMIUM") != "1",
    reason="chromium is not installed (apt-get install chromium)",
)

H = (
    '<img src=x onerror="alert(1)"><script>alert(2)</script>'
    '<a href="javascript:alert(3)">l</a><style>*{display:none}</style>'
    "\x1b[31m\u202e\x00\x07"
)
"""What a hostile model or tool writes: if any of it ran or became markup,
the page would show an image, run a script, link to script or hide itself."""
LONE = "\ud800"
"""A lone surrogate, which no store can write: the runtime keeps it escaped
(`agentfsm._text.encodable`), and the page shows the escape."""

PAUSED = 'p"><script>alert(5)</script>/x'
"""The loop full of hostile text, left paused (its id is markup and holds a
`/`)."""
FAILED = "failed"
"""Paused, resumed by a hostile `by`, then failed with a hostile message."""
HUGE = "huge"
"""A loop whose tool output and answer are each a megabyte."""
MEGA = "<b>x</b>" * 131_072  # 1 MiB

ODD_IDS = {
    "slash": "a/b",
    "leading-slash": "/lead",
    "trailing-slash": "trail/",
    "percent-2F": "%2F",
    "query-and-fragment": "q?x=1#f",
    "spaces-and-quotes": " sp \"q' ",
    "markup": "<b>x</b>",
    "bidi": "\u202eevil",
    "tab": "tab\tid",
    "backslash": "back\\slash",
    "plus-and-amp": "a+b&c=d",
    "dot": ".",
    "dot-dot": "..",
    "nul": "nul\x00id",
    "cr": "cr\rid",
    "newline": "nl\nid",
}
"""Loop ids a user's `ids=` may give (any non-empty str without a lone
surrogate), each a loop that answers."""

_T = TypeVar("_T")


def in_thread(fn: Callable[..., Awaitable[_T]], *args: Any) -> _T:
    """`anyio.run(fn, *args)` in a thread of its own: Playwright's sync API
    runs an event loop in the test's thread, and a module-scoped browser
    outlives one test."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, fn, *args).result()


# --------------------------------------------------------------- the store


@tool
async def echo(s: str) -> str:
    """Return `s`, marked as the tool's output."""
    return "out:" + s


@tool
async def boom(s: str) -> str:
    """Fail, quoting `s` in the error."""
    raise RuntimeError("err:" + s)


def pausing_at(batch: int) -> Callable[[PendingTransition], Pause | None]:
    """A handler (named with markup) pausing before the `batch`-th tool batch
    of its loop, with a hostile reason."""
    seen = 0

    def handler(pending: PendingTransition) -> Pause | None:
        nonlocal seen
        if pending.trigger is Trigger.call_tools:
            seen += 1
            if seen == batch:
                return Pause("reason:" + H + LONE)
        return None

    handler.__qualname__ = "h<script>alert(4)</script>"
    return handler


async def fill(path: Path) -> None:
    ids = iter([PAUSED, FAILED, HUGE, *ODD_IDS.values()])
    scripted = {
        "hostile": ScriptedProvider(
            [
                calls(
                    call("echo", call_id="c<1>" + H, s=H),
                    call("boom", call_id="c2" + H, s=H),
                    call("nope" + H, call_id="c3", s=H),
                    text="text:" + H,
                ),
                calls(call("echo", call_id="c4", s=H)),
            ]
        ),
        "failing": ScriptedProvider(
            [calls(call("echo", call_id="f1", s="x")), RuntimeError("model:" + H)]
        ),
        "huge": ScriptedProvider(
            [calls(call("echo", call_id="m1", s=MEGA)), text(MEGA)]
        ),
        "ok": ScriptedProvider([text("ok")]),
    }
    store = SQLiteStore(path, events=True)
    async with Runtime(providers=scripted, store=store, ids=lambda: next(ids)) as rt:
        paused = rt.run_loop(
            "agent:" + H,
            "user:" + H + LONE,
            request(echo, boom, model="hostile:m"),
            pausing_at(2),
        )
        failed = rt.run_loop(
            "failing", "go", request(echo, model="failing:m"), pausing_at(1)
        )
        await wait_until(lambda: rt.get(failed).status is LoopStatus.paused)
        rt.resume(failed, None, by="by:" + H)
        huge = rt.run_loop("huge", "go", request(echo, model="huge:m"))
        for _ in ODD_IDS:
            await rt.wait(rt.run_loop("odd", "hi", request(model="ok:m")))
        await rt.wait(failed)
        await rt.wait(huge)
        await wait_until(lambda: rt.get(paused).status is LoopStatus.paused)


@pytest.fixture(scope="module")
def hostile_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adversarial") / "loops.db"
    in_thread(fill, path)
    return path


@pytest.fixture(scope="module")
def base(hostile_db: Path) -> Iterator[str]:
    """`agentfsm ui` serving the hostile store: its base URL."""
    with served(hostile_db) as url:
        yield url


@pytest.fixture
def copy_db(hostile_db: Path, tmp_path: Path) -> Path:
    """A copy of the hostile store, for a test to spoil."""
    path = tmp_path / "copy.db"
    shutil.copy(hostile_db, path)
    return path


# ------------------------------------------------------------------ clients


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name]


def raw(
    base: str,
    target: bytes | str,
    headers: bytes = b"",
    *,
    auth: bool = True,
    head_only: bool = False,
) -> Answer:
    """One request as written (no client library's checks or normalizing);
    read until the server closes the connection, or (`head_only`, for a
    stream) until the answer's head has come."""
    if isinstance(target, str):
        target = target.encode("latin-1")
    where = urlsplit(base)
    assert where.hostname is not None
    assert where.port is not None
    bearer = f"Authorization: Bearer {TOKEN}\r\n".encode() if auth else b""
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(
            b"GET "
            + target
            + b" HTTP/1.1\r\nHost: "
            + where.netloc.encode()
            + b"\r\nConnection: close\r\n"
            + bearer
            + headers
            + b"\r\n"
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            if head_only and b"\r\n\r\n" in data:
                break
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    pairs = []
    for line in lines:
        name, _, value = line.partition(": ")
        pairs.append((name, value))
    return Answer(int(status.split()[1]), pairs, body)


Next = Callable[..., tuple[str, str, dict[str, Any]]]


@contextlib.contextmanager
def sse(
    http: httpx2.Client, url: str, headers: dict[str, str] | None = None
) -> Iterator[Next]:
    """A stream of server-sent events: a function giving the next one as
    `(event, id, data)` (as tests/test_ui.py reads them, without a loop)."""
    with http.stream("GET", url, headers={**AUTH, **(headers or {})}) as answer:
        assert answer.status_code == 200, answer.read()
        lines = answer.iter_lines()

        def next_event(within: float = 30) -> tuple[str, str, dict[str, Any]]:
            # The server's pings (every 15 s) keep a read from timing out: the
            # deadline is checked at each line.
            deadline = time.monotonic() + within
            event, ident, data = "message", "", ""
            for line in lines:
                if time.monotonic() > deadline:
                    raise AssertionError(f"no event from {url} in {within} s")
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("id:"):
                    ident = line[3:].strip()
                elif line.startswith("data:"):
                    data += line[5:].strip()
                elif not line and data:
                    return event, ident, json.loads(data)
            raise AssertionError(f"the stream of {url} ended")

        yield next_event


def path_of(loop_id: str) -> str:
    """A loop id as the end of an address, as the loops page writes it: one
    percent-encoded segment, or `?id=` for the dot segments `.` and `..`
    (which URLs resolve away, even written `%2E`)."""
    if loop_id in (".", ".."):
        return "?id=" + quote(loop_id, safe="")
    return quote(loop_id, safe="")


@contextlib.contextmanager
def in_process(
    db: Path, *, mount: str | None = None, extra: Any = None
) -> Iterator[Callable[..., Any]]:
    """The app in this process (in a thread of its own), through httpx2's
    ASGI transport: a function that runs `GET path` and gives its response;
    `mount`: the app mounted at that prefix of a Starlette app of the user's;
    `extra`: a route added to the app's own."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    ui = app(SQLiteStore(db, events=True, read_only=True), token=TOKEN)
    if extra is not None:
        ui.router.routes.append(extra)
    host = ui if mount is None else Starlette(routes=[Mount(mount, app=ui)])

    def get(path: str, **options: Any) -> httpx2.Response:
        async def one() -> httpx2.Response:
            async with ui.router.lifespan_context(ui):
                transport = httpx2.ASGITransport(app=host, raise_app_exceptions=False)
                async with httpx2.AsyncClient(
                    transport=transport, base_url="http://127.0.0.1"
                ) as http:
                    answer = await http.get(path, **options)
                    await answer.aread()
                    return answer

        return in_thread(one)

    yield get


# ------------------------------------------------------------------ the token


def test_the_entry_redirect_never_leaves_the_host(base: str) -> None:
    """The ?token= entry redirects to a path of this server: a request path
    of `//evil.com/` or `/\\evil.com/` (which browsers read as another host)
    is not written back as it came."""
    for target in (f"//evil.com/?token={TOKEN}", f"/\\evil.com/?token={TOKEN}"):
        entered = raw(base, target, auth=False)
        assert entered.status == 303
        (location,) = entered.header("location")
        assert location.startswith("/")
        assert not location.startswith(("//", "/\\")), location


def test_the_entry_redirect_keeps_what_it_was_given_encoded(base: str) -> None:
    """A CR LF in the query cannot add a header to the redirect: the query is
    written back percent-encoded, the token left out."""
    target = f"/loop/x?a=%0d%0aSet-Cookie:%20evil=1&token={TOKEN}&b=%3Cs%3E"
    entered = raw(base, target, auth=False)
    assert entered.status == 303
    assert entered.header("location") == [
        "/loop/x?a=%0D%0ASet-Cookie%3A+evil%3D1&b=%3Cs%3E"
    ]
    (cookie,) = entered.header("set-cookie")
    assert "evil" not in cookie
    # Answered as every answer is: its policy on it.
    assert entered.header("content-security-policy")


def test_cookies_missing_empty_forged_or_of_another_ui(base: str) -> None:
    entered = raw(base, f"/?token={TOKEN}", auth=False)
    name, _, rest = entered.header("set-cookie")[0].partition("=")
    key = rest.split(";", 1)[0]
    # Named after the port (one cookie per UI of the host); holding a key
    # derived from the token, not the token.
    assert name == f"agentfsm_ui_{urlsplit(base).port}"
    assert TOKEN not in key
    refused = {
        "none": b"",
        "empty": f"Cookie: {name}=\r\n".encode(),
        "the token itself": f"Cookie: {name}={TOKEN}\r\n".encode(),
        "prefix": f"Cookie: {name}={key[:-1]}\r\n".encode(),
        "longer": f"Cookie: {name}={key}x\r\n".encode(),
        "quoted": f'Cookie: {name}="{key}"\r\n'.encode(),
        "another ui's name": f"Cookie: agentfsm_ui_1={key}\r\n".encode(),
        "bearer of another scheme": f"Authorization: Basic {TOKEN}\r\n".encode(),
        "empty bearer": b"Authorization: Bearer \r\n",
        "the key as a bearer": f"Authorization: Bearer {key}\r\n".encode(),
        "non-ascii": f"Cookie: {name}=".encode() + b"\xe9" * 21 + b"\r\n",
    }
    for why, headers in refused.items():
        answer = raw(base, "/api/loops", headers, auth=False)
        assert answer.status == 401, why
        assert b"loop_id" not in answer.body, why
    allowed = {
        "the cookie": f"Cookie: {name}={key}\r\n".encode(),
        "among others, twice": (
            f"Cookie: a=1; {name}=wrong; {name}={key}; b=2\r\n".encode()
        ),
        "bearer, any case": f"Authorization: bEaReR {TOKEN}\r\n".encode(),
    }
    for why, headers in allowed.items():
        assert raw(base, "/api/loops", headers, auth=False).status == 200, why
    # A wrong ?token= is refused even beside a good cookie: it is an entry.
    wrong = raw(base, "/api/loops?token=nope", allowed["the cookie"], auth=False)
    assert wrong.status == 401


def test_the_token_in_an_api_query_is_traded_and_left_out(base: str) -> None:
    entered = raw(base, f"/api/loops?status=paused&token={TOKEN}", auth=False)
    assert entered.status == 303
    assert entered.header("location") == ["/api/loops?status=paused"]
    assert entered.header("cache-control") == ["no-store"]
    assert b"loop_id" not in entered.body


# ----------------------------------------------------------- static and paths


def test_static_files_stay_in_their_directory(base: str) -> None:
    for target in (
        "/static/../_app.py",
        "/static/%2e%2e/_app.py",
        "/static/..%2f_app.py",
        "/static/%2e%2e%2f__init__.py",
        "/static/..%5c_app.py",
        "/static/%2fetc%2fpasswd",
        "/static//etc/passwd",
        "/static/ui.js%00.html",
        "/static/%2e%2e/%2e%2e/cli/ui.py",
    ):
        answer = raw(base, target)
        assert answer.status == 404, target
        assert b"import" not in answer.body, target
        assert b"root:" not in answer.body, target
    script = raw(base, "/static/ui.js")
    assert script.status == 200
    assert script.header("x-content-type-options") == ["nosniff"]


def test_a_count_that_is_not_one_is_a_400(base: str) -> None:
    """Digits `int()` does not read (`²`, which `str.isdigit()` takes) are a
    400 like any other count that is not one."""
    for query in ("after=%C2%B2", "items=%C2%B9"):
        answer = raw(base, f"/api/loops/{path_of(HUGE)}?{query}")
        assert answer.status == 400, (query, answer.status)
        assert b"must be a count" in answer.body


def test_counts_out_of_range_are_answered(base: str) -> None:
    with httpx2.Client(base_url=base, headers=AUTH, timeout=30) as http:
        far = http.get(f"/api/loops/{path_of(HUGE)}?after=999999999999999999")
        assert far.status_code == 200
        assert far.json()["rows"] == []  # nothing past it
        many = http.get(f"/api/loops/{path_of(HUGE)}?items=999999999999999999")
        assert many.json()["items_from"] == 0  # more than it holds: all of them
        for query in (
            "after=-1",
            "after=1e3",
            "after=0x10",
            "after=1000000000000000000",
        ):
            bad = http.get(f"/api/loops/{path_of(HUGE)}?{query}")
            assert bad.status_code == 400, query
            assert "must be a count" in bad.json()["error"]


def test_a_last_event_id_of_superscript_digits_is_ignored(base: str) -> None:
    """A Last-Event-ID of digits `int()` does not read is ignored, as any
    other id that is not one."""
    answer = raw(
        base,
        f"/api/stream/loops/{path_of(HUGE)}",
        b"Last-Event-ID: \xb2:0\r\n",
        head_only=True,
    )
    assert answer.status == 200


def test_a_last_event_id_that_is_not_one_is_ignored(base: str) -> None:
    """The stream starts from the query's marks (all rows), as if none was
    sent."""
    with httpx2.Client(timeout=30) as http:
        url = f"{base}/api/stream/loops/{path_of(HUGE)}"
        with sse(http, url) as fresh:
            _, _, whole = fresh()
        for sent in ("x:y", "-1:0", "1:-1", "1", ":", "9" * 40 + ":1", "1:2:3"):
            with sse(http, url, {"last-event-id": sent}) as stream:
                event, _, page = stream()
            assert event == "loop", sent
            assert page["rows"] == whole["rows"], sent
            assert page["items_from"] == 0, sent


def test_what_an_answer_echoes_is_never_a_page(base: str) -> None:
    """The errors that quote what they were given (a status, a loop id) are
    JSON that browsers must not sniff as a page."""
    markup = quote("<script>alert(1)</script>", safe="")
    for target in (
        f"/api/loops?status={markup}",
        f"/api/stream/loops?status={markup}",
        f"/api/loops/{markup}",
    ):
        answer = raw(base, target)
        assert answer.status in (400, 404), target
        assert answer.header("content-type") == ["application/json"], target
        assert answer.header("x-content-type-options") == ["nosniff"], target
        assert b"<script>" in answer.body  # quoted as it is, as JSON text


# -------------------------------------------------------------- the loop ids


ODD = [pytest.param(loop_id, id=name) for name, loop_id in ODD_IDS.items()]


@pytest.mark.parametrize("loop_id", ODD)
def test_each_loop_id_reads_back_by_its_address(base: str, loop_id: str) -> None:
    """The API, the page and the stream at the address the loops page links
    to (the id as one percent-encoded segment) are of that loop."""
    with httpx2.Client(base_url=base, headers=AUTH, timeout=30) as http:
        listed = [loop["loop_id"] for loop in http.get("/api/loops").json()["loops"]]
        assert loop_id in listed
        read = http.get(f"/api/loops/{path_of(loop_id)}")
        assert read.status_code == 200, read.text
        assert read.json()["summary"]["loop_id"] == loop_id
        page = http.get(f"/loop/{path_of(loop_id)}")
        assert page.status_code == 200
        assert 'name="agentfsm-loop"' in page.text
        with sse(http, f"{base}/api/stream/loops/{path_of(loop_id)}") as stream:
            event, _, data = stream()
        assert event == "loop", data
        assert data["summary"]["loop_id"] == loop_id


# ------------------------------------------------------------ the browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    from tests.test_ui_browser import ARGS

    assert CHROMIUM is not None, "chromium is required (AGENTFSM_REQUIRE_CHROMIUM=1)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield launched
        launched.close()


@dataclass
class Watched:
    """A page and what it did: the hosts it asked, the dialogs it opened, the
    console's complaints (a refused inline script or style among them) and
    its uncaught errors."""

    page: Any
    hosts: set[str]
    dialogs: list[str]
    complaints: list[str]


@contextlib.contextmanager
def watched(browser: Any, base: str) -> Iterator[Watched]:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    seen = Watched(page, set(), [], [])
    page.on("request", lambda r: seen.hosts.add(urlsplit(r.url).netloc or r.url))

    def dialog(shown: Any) -> None:
        seen.dialogs.append(shown.message)
        shown.dismiss()

    def console(message: Any) -> None:
        # A stream closed by leaving the page is not a complaint.
        if message.type in ("error", "warning") and "/api/stream/" not in (
            message.location or {}
        ).get("url", ""):
            seen.complaints.append(message.text)

    page.on("dialog", dialog)
    page.on("console", console)
    page.on("pageerror", lambda error: seen.complaints.append(f"uncaught: {error}"))
    page.goto(f"{base}/?token={TOKEN}")
    try:
        yield seen
    finally:
        page.close()


def no_markup_ran(seen: Watched) -> None:
    """Nothing the store said became an element, a dialog or a request."""
    page = seen.page
    injected = page.locator(
        "main img, main script, main style, main a[href^='javascript'], "
        "main [onerror], main b, main i"
    )
    assert injected.count() == 0
    assert seen.dialogs == []
    assert seen.complaints == [], seen.complaints
    assert len(seen.hosts) == 1, seen.hosts
    shown = page.locator("body").inner_text()
    for raw_char in ("\x00", "\x1b", "\u202e", "\x07"):
        assert raw_char not in shown, repr(raw_char)


@needs_chromium
def test_hostile_text_in_every_field_stays_text(browser: Any, base: str) -> None:
    from playwright.sync_api import expect

    with watched(browser, base) as seen:
        page = seen.page
        row = page.locator("tr.loop.paused")
        expect(row.locator("td.why")).to_contain_text(
            printable("reason:" + H), timeout=30_000
        )
        expect(row.locator("td.id")).to_have_text(PAUSED)
        agents = page.locator("#agent option").all_text_contents()
        assert printable("agent:" + H) in agents
        no_markup_ran(seen)

        row.locator("a").click()
        expect(page.locator("body")).to_have_attribute("data-status", "paused")
        expect(page.locator("#loop-id")).to_have_text(PAUSED)
        expect(page.locator("#pause-reason")).to_contain_text(
            printable("reason:" + H + LONE)
        )
        expect(page.locator("#summary")).to_contain_text(printable("agent:" + H))
        ledger = page.locator("#ledger tbody tr")
        expect(ledger).to_have_count(2)
        assert ledger.nth(0).locator("td").nth(0).text_content() == printable(
            "c<1>" + H
        )
        assert printable("err:" + H) in (
            ledger.nth(1).locator("td.output").text_content() or ""
        )
        decisions = page.locator("#decisions tbody tr")
        expect(decisions.last).to_contain_text("h<script>alert(4)</script>")
        items = page.locator("#items li pre").all_text_contents()
        assert items[0] == printable("user:" + H + LONE)
        unknown_tool = printable(f'nope{H}({{"s":')
        assert any(item.startswith(unknown_tool) for item in items)
        assert printable("text:" + H) in items
        expect(page.locator("#timeline tbody tr").last).to_contain_text(
            "before inference --call_tools--> function_call: reason:<img"
        )
        # Every event's JSON opened, as a person reading it would.
        for summary in page.locator("#timeline details summary").all():
            summary.click()
        expect(page.locator("#timeline details[open]").first).to_contain_text("onerror")
        no_markup_ran(seen)

        page.goto(f"{base}/loop/{path_of(FAILED)}")
        expect(page.locator("body")).to_have_attribute("data-status", "done")
        expect(page.locator("#error")).to_contain_text("RuntimeError: model:")
        assert page.locator("#error").text_content() == printable(
            "RuntimeError: model:" + H
        )
        expect(page.locator("#decisions tbody")).to_contain_text(printable("by:" + H))
        no_markup_ran(seen)

        # Filters in the list's own address are only read as values.
        hostile = quote('<img src=x onerror="alert(9)">', safe="")
        page.goto(f"{base}/?status={hostile}&agent={hostile}")
        expect(page.locator("#live")).to_have_class(re.compile(r"\bon\b"))
        assert page.locator("#status").input_value() == ""
        no_markup_ran(seen)


@needs_chromium
def test_a_megabyte_of_text_is_shown_whole(browser: Any, base: str) -> None:
    from playwright.sync_api import expect

    with watched(browser, base) as seen:
        page = seen.page
        page.goto(f"{base}/loop/{HUGE}")
        expect(page.locator("body")).to_have_attribute(
            "data-status", "done", timeout=30_000
        )
        assert page.locator("#answer").text_content() == MEGA
        assert page.locator("#ledger td.output pre").text_content() == "out:" + MEGA
        no_markup_ran(seen)


@needs_chromium
@pytest.mark.parametrize("loop_id", ODD)
def test_the_link_of_each_loop_id_opens_that_loop(
    browser: Any, base: str, loop_id: str
) -> None:
    from playwright.sync_api import expect

    with watched(browser, base) as seen:
        page = seen.page
        links = page.locator("tr.loop td.id a")
        expect(links).to_have_count(len(ODD_IDS) + 3, timeout=30_000)
        index = (
            page.locator("tr.loop")
            .evaluate_all("rows => rows.map(r => r.dataset.loop)")
            .index(loop_id)
        )
        links.nth(index).click()
        # Whatever the link led to: the loop, a loop missing, a stream
        # refused, the list, a 404 (which chromium shows in a <pre>).
        page.locator(
            "body[data-status], #summary:has-text('holds no loop'), #live.off, "
            "#loops, body > pre"
        ).first.wait_for(timeout=30_000)
        assert page.locator("body").get_attribute("data-status") == "done"
        assert page.locator("#loop-id").text_content() == printable(loop_id)
        assert seen.complaints == []


@needs_chromium
def test_a_page_says_why_its_stream_cannot_go_on(browser: Any, copy_db: Path) -> None:
    """A loop that cannot be read: the page says why, live. A stream refused
    (a 401: the server has a new token): the page stops and says what to do,
    instead of showing 'reconnecting' for ever."""
    from playwright.sync_api import expect

    spoil(copy_db, PAUSED)
    with served(copy_db) as url, watched(browser, url) as seen:
        page = seen.page
        page.goto(f"{url}/loop/{path_of(PAUSED)}")
        expect(page.locator("#problem")).to_contain_text(
            "cannot be read", timeout=30_000
        )
        expect(page.locator("#live")).to_have_text("store error")
        assert seen.complaints == []
        page.goto(f"{url}/loop/{path_of(HUGE)}")
        expect(page.locator("body")).to_have_attribute(
            "data-status", "done", timeout=30_000
        )
        expect(page.locator("#problem")).to_be_hidden()

        page.route(
            "**/api/**",
            lambda route: route.fulfill(status=401, body="refused"),
        )
        page.reload()
        expect(page.locator("#live")).to_have_text("stopped", timeout=30_000)
        expect(page.locator("#problem")).to_contain_text(
            "access token is no longer valid"
        )


@needs_chromium
def test_the_token_reaches_no_other_server_of_the_host(browser: Any, base: str) -> None:
    """Cookies do not keep the ports of a host apart: another server on
    127.0.0.1 the browser visits gets the UI's cookie, which holds a key
    derived from the token, never the token."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    cookies: list[str | None] = []

    class Other(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            cookies.append(self.headers.get("cookie"))
            self.send_response(200)
            self.send_header("content-type", "text/plain")
            self.end_headers()
            self.wfile.write(b"another server")

        def log_message(self, *args: Any) -> None:
            pass

    with HTTPServer(("127.0.0.1", 0), Other) as other:
        thread = threading.Thread(target=other.serve_forever)
        thread.start()
        try:
            with watched(browser, base) as seen:
                seen.page.locator("tr.loop").first.wait_for(timeout=30_000)
                seen.page.goto(f"http://127.0.0.1:{other.server_port}/")
        finally:
            other.shutdown()
            thread.join()
    assert cookies
    assert not any(TOKEN in (cookie or "") for cookie in cookies), cookies


# --------------------------------------------------------------- the streams


def test_many_streams_and_one_that_never_reads(base: str) -> None:
    """Forty streams at once (of loops that never exist) and one of the
    megabyte loop whose client reads nothing: each stream says its loop is
    missing, and the server goes on answering."""
    where = urlsplit(base)
    assert where.hostname is not None
    assert where.port is not None
    with contextlib.ExitStack() as stack:
        stalled = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((where.hostname, where.port))
        stalled.sendall(
            f"GET /api/stream/loops/{HUGE} HTTP/1.1\r\nHost: {where.netloc}\r\n"
            f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
        )
        http = stack.enter_context(httpx2.Client(timeout=30))
        streams = [
            stack.enter_context(sse(http, f"{base}/api/stream/loops/never-{n}"))
            for n in range(40)
        ]
        for n, stream in enumerate(streams):
            event, _, data = stream()
            assert event == "missing"
            assert f"never-{n}" in data["error"]
        listed = http.get(f"{base}/api/loops", headers=AUTH)
        assert listed.status_code == 200
        assert len(listed.json()["loops"]) == len(ODD_IDS) + 3


def test_the_loop_page_follows_its_owner_and_lease(copy_db: Path) -> None:
    """A runtime taking a paused loop up (a lease, no commit) and its lease
    running out (nothing written) are streamed to the loop's page."""
    with (
        served(copy_db) as url,
        httpx2.Client(timeout=30) as http,
        sse(http, f"{url}/api/stream/loops/{path_of(PAUSED)}") as stream,
    ):
        _, _, first = stream()
        assert first["summary"]["owner"] is None
        # A runtime takes the loop up (waiting for its decision) and dies: its
        # lease runs out, and nothing is written.
        with contextlib.closing(sqlite3.connect(copy_db)) as conn, conn:
            conn.execute(
                "UPDATE loops SET owner = 'crashed', lease_until = ? WHERE loop_id = ?",
                (time.time() + 8, PAUSED),
            )
        _, _, held = stream(within=10)
        assert (held["summary"]["owner"], held["summary"]["lease_live"]) == (
            "crashed",
            True,
        )
        _, _, lapsed = stream(within=25)
        assert lapsed["summary"]["lease_live"] is False


# ------------------------------------------------------------ a store in trouble


def test_an_unreadable_loop_is_listed_with_why(copy_db: Path) -> None:
    spoil(copy_db, PAUSED)
    with in_process(copy_db) as get:
        listed = get("/api/loops", headers=AUTH).json()
    assert [u["loop_id"] for u in listed["unreadable"]] == [PAUSED]
    assert "cannot be read" in listed["unreadable"][0]["reason"]
    assert PAUSED not in [loop["loop_id"] for loop in listed["loops"]]
    assert len(listed["loops"]) == len(ODD_IDS) + 2


def test_an_unreadable_loop_page_says_why(copy_db: Path) -> None:
    """An unreadable loop's page is a JSON error saying why (a 503), not a
    bare 500; its stream says it as an event (and stays open: an EventSource
    whose stream ends reconnects for ever)."""
    spoil(copy_db, PAUSED)
    with in_process(copy_db) as get:
        read = get(f"/api/loops/{path_of(PAUSED)}", headers=AUTH)
    assert read.status_code == 503
    assert read.headers["content-type"] == "application/json"
    assert "cannot be read" in read.json()["error"]
    with (
        served(copy_db) as url,
        httpx2.Client(timeout=30) as http,
        sse(http, f"{url}/api/stream/loops/{path_of(PAUSED)}") as stream,
    ):
        event, _, data = stream()
        assert event == "store-error"
        assert "cannot be read" in data["error"]


def test_one_record_not_utf8_leaves_the_others_listed(copy_db: Path) -> None:
    """A record of bytes that are not UTF-8 (sqlite3 fails to decode it)
    makes its loop unreadable, listed with why, and the others are listed."""
    with contextlib.closing(sqlite3.connect(copy_db)) as conn, conn:
        (number,) = conn.execute(
            "SELECT number FROM loops WHERE loop_id = ?", (HUGE,)
        ).fetchone()
        conn.execute(
            "UPDATE log SET record = CAST(X'7B22C328' AS TEXT) WHERE record IS NOT"
            " NULL AND id BETWEEN ? AND ?",
            (number << 32, (number << 32) + 0xFFFFFFFF),
        )
    with in_process(copy_db) as get:
        listed = get("/api/loops", headers=AUTH)
    assert listed.status_code == 200
    assert [u["loop_id"] for u in listed.json()["unreadable"]] == [HUGE]


def test_a_store_deleted_while_served_says_so(copy_db: Path) -> None:
    """A store deleted while served is refused (no stale loops), answered
    as JSON that says why."""
    with (
        served(copy_db) as url,
        httpx2.Client(timeout=30) as http,
        sse(http, f"{url}/api/stream/loops") as stream,
    ):
        assert raw(url, "/api/loops").status == 200
        assert stream()[0] == "loops"
        for path in copy_db.parent.glob(f"{copy_db.name}*"):
            path.unlink()
        answer = raw(url, "/api/loops")
        assert answer.status == 503
        assert answer.header("content-type") == ["application/json"]
        assert b"loop_id" not in answer.body  # nothing stale
        assert b"deleted or replaced" in answer.body
        # The open page's stream says so, rather than ending.
        event, _, data = stream()
        assert event == "store-error"
        assert "deleted or replaced" in data["error"]


def test_an_unexpected_error_is_answered_with_the_headers(hostile_db: Path) -> None:
    """A bug's 500 carries the security headers: the guard wraps Starlette's
    error middleware too."""
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def broken(request: Request) -> Response:
        raise RuntimeError("a bug")

    with in_process(hostile_db, extra=Route("/api/broken", broken)) as get:
        answer = get("/api/broken", headers=AUTH)
        refused = get("/api/broken")
    assert refused.status_code == 401  # the route is behind the token
    assert answer.status_code == 500
    assert answer.headers["content-security-policy"]
    assert answer.headers["x-content-type-options"] == "nosniff"


# ------------------------------------------------------------- mounted


def test_mounted_the_entry_stays_under_its_prefix(hostile_db: Path) -> None:
    """Mounted under a prefix, the ?token= entry redirects under it, once."""
    with in_process(hostile_db, mount="/debug") as get:
        entered = get(f"/debug/loop/{HUGE}?token={TOKEN}")
    assert entered.status_code == 303
    assert entered.headers["location"] == f"/debug/loop/{HUGE}"


# ------------------------------------------------------------- PostgreSQL


PG_IDS = ("nul\x00id", "\x01escaped", "%00", "%25", "\x01%00")
"""Ids the PostgreSQL store keeps escaped (a NUL; one starting with its
escape mark) and ids that look like their escapes."""


@contextlib.contextmanager
def serving(target: str, *more: str, token: str = TOKEN) -> Iterator[str]:
    """`agentfsm ui TARGET` in a subprocess (a PostgreSQL URL, or a SQLite
    file): the URL it prints, to open the UI with `token`."""
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "agentfsm", "ui", target),
            *("--port", "0", "--token", token, *more),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        process.stdout.readline()
        match = re.search(
            r"open (http://127\.0\.0\.1:\d+/.*)$", process.stdout.readline()
        )
        assert match, process.communicate(timeout=30)
        yield match.group(1)
    finally:
        process.terminate()
        process.communicate(timeout=30)


def base_of(url: str) -> str:
    where = urlsplit(url)
    return f"{where.scheme}://{where.netloc}"


@pytest.fixture
def postgres(postgres_server: Any) -> tuple[str, str]:
    """A PostgreSQL store (URL, schema) holding a loop of each of `PG_IDS`."""
    from agentfsm.store.postgres import PostgresStore

    url = f"postgresql://agentfsm@127.0.0.1:{postgres_server.port}/agentfsm_test"
    schema = f"t_{uuid.uuid4().hex}"

    async def fill() -> None:
        ids = iter(PG_IDS)
        store = PostgresStore(url, schema=schema, events=True)
        scripted = {"ok": ScriptedProvider([text("ok")])}
        async with Runtime(
            providers=scripted, store=store, ids=lambda: next(ids)
        ) as rt:
            for _ in PG_IDS:
                await rt.wait(rt.run_loop("odd", "hi", request(model="ok:m")))

    in_thread(fill)
    return url, schema


def test_postgres_ids_it_escapes_read_back_by_their_address(
    postgres: tuple[str, str],
) -> None:
    url, schema = postgres
    with (
        serving(url, "--schema", schema) as printed,
        httpx2.Client(base_url=base_of(printed), headers=AUTH, timeout=30) as http,
    ):
        base = base_of(printed)
        listed = [loop["loop_id"] for loop in http.get("/api/loops").json()["loops"]]
        assert sorted(listed) == sorted(PG_IDS)
        for loop_id in PG_IDS:
            read = http.get(f"/api/loops/{path_of(loop_id)}")
            assert read.status_code == 200, (loop_id, read.text)
            assert read.json()["summary"]["loop_id"] == loop_id
            with sse(http, f"{base}/api/stream/loops/{path_of(loop_id)}") as stream:
                event, _, data = stream()
            assert event == "loop"
            assert data["summary"]["loop_id"] == loop_id
            assert [row["kind"] for row in data["rows"]][-1] == "idle"


def test_a_postgres_connection_that_breaks_is_taken_again(
    postgres: tuple[str, str],
) -> None:
    """The server ends the UI's connection (as a restart would): the page's
    stream and the API answer again, from a new connection."""
    import psycopg

    url, schema = postgres
    clients = (
        "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
        " AND datname = current_database() AND backend_type = 'client backend'"
    )
    with psycopg.connect(url, autocommit=True) as admin:
        before = [pid for (pid,) in admin.execute(clients).fetchall()]
        with (
            serving(url, "--schema", schema) as printed,
            httpx2.Client(base_url=base_of(printed), headers=AUTH, timeout=30) as http,
        ):
            base = base_of(printed)
            assert http.get("/api/loops").status_code == 200
            ended = admin.execute(
                f"SELECT pg_terminate_backend(pid) FROM ({clients}) AS c"
                " WHERE NOT pid = ANY(%s)",
                (before,),
            ).fetchall()
            assert ended == [(True,)]  # the UI's one connection
            answers = []
            for _ in range(3):  # the first read on the broken one may fail
                answers.append(http.get("/api/loops").status_code)
                if answers[-1] == 200:
                    break
            assert answers[-1] == 200, answers
            with sse(http, f"{base}/api/stream/loops") as stream:
                event, _, data = stream()
            assert event == "loops"
            assert len(data["loops"]) == len(PG_IDS)


def test_a_postgres_read_that_fails_says_why(postgres: tuple[str, str]) -> None:
    """The read that meets a broken PostgreSQL connection answers the
    store's error as JSON (the next read reconnects)."""
    import psycopg

    url, schema = postgres
    clients = (
        "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
        " AND datname = current_database() AND backend_type = 'client backend'"
    )
    with psycopg.connect(url, autocommit=True) as admin:
        before = [pid for (pid,) in admin.execute(clients).fetchall()]
        with serving(url, "--schema", schema) as printed:
            base = base_of(printed)
            assert raw(base, "/api/loops").status == 200
            admin.execute(
                f"SELECT pg_terminate_backend(pid) FROM ({clients}) AS c"
                " WHERE NOT pid = ANY(%s)",
                (before,),
            )
            failed = raw(base, "/api/loops")
    assert failed.status >= 500
    assert failed.header("content-type") == ["application/json"]
    assert schema in json.loads(failed.body)["error"]  # the store's message


# ------------------------------------------------------------- the command


@pytest.mark.parametrize(
    "token",
    [
        pytest.param("abcd+efgh+ijkl+mnop", id="plus"),
        pytest.param("abcd&efgh#ijkl%mnop", id="amp-hash-percent"),
    ],
)
def test_the_printed_url_opens_the_ui_or_the_token_is_refused(
    hostile_db: Path, token: str
) -> None:
    """A `--token` the printed URL could not carry as it is (a `+`, `&`, `#`
    or `%`) is refused as a bad argument, or the printed URL opens the UI."""
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "agentfsm", "ui", str(hostile_db)),
            *("--port", "0", "--token", token),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        if not process.stdout.readline():  # refused as a bad argument: fine
            _, err = process.communicate(timeout=30)
            assert process.returncode == 2
            assert err.startswith("agentfsm ui: error: ")
            return
        printed = process.stdout.readline().removeprefix("open ").strip()
        with httpx2.Client(timeout=30) as http:
            entered = http.get(printed)
        assert entered.status_code == 303, entered.text
    finally:
        if process.poll() is None:
            process.terminate()
        process.communicate(timeout=30)


def test_a_token_that_is_not_ascii_is_a_bad_argument(hostile_db: Path) -> None:
    """A `--token` that is not ASCII is a bad argument: an error line, exit
    2, no traceback."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "agentfsm", "ui", str(hostile_db)),
            *("--port", "0", "--token", "\u00e9" * 16),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("agentfsm ui: error: ")
    assert done.returncode == 2
