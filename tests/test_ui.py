"""`agentfsm.ui`: the live view's server, read over HTTP (the browser tests are
in tests/test_ui_browser.py).

The stores are made by real runtimes on scripted providers (as in
tests/test_cli_loops.py). The app is called in this process through httpx's
ASGI transport; its live streams through the real `agentfsm ui` command in a
subprocess (uvicorn, a socket on 127.0.0.1), read as server-sent events while
a runtime in this process moves a loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterator,
)
from pathlib import Path
from typing import Any, cast

import anyio
import httpx2
import pytest

from agentfsm import LoopStatus, Rewrite, Runtime, ToolBatch
from agentfsm.diagrams import path_graph
from agentfsm.exceptions import ConfigurationError
from agentfsm.store import MemoryStore, SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.ui import app
from tests.helpers import request, wait_until
from tests.test_cli_loops import add, counter_ids, pay, providers

TOKEN = "test-token-0123456789"
HOSTILE = '<img src=x onerror="alert(1)"><script>alert(2)</script>\x1b[31m'


async def fill(path: Path) -> None:
    """loop-1 (calculator) answers after `add`; loop-2 (payer) is paused for
    approval of `pay` when its runtime exits; loop-3 (hostile) answers with
    markup and control characters."""
    more = {"hostile": ScriptedProvider([text(HOSTILE)])}
    store = SQLiteStore(path, events=True)
    async with Runtime(
        providers=providers(**more), store=store, ids=counter_ids()
    ) as rt:
        await rt.wait(
            rt.run_loop("calculator", "2+3?", request(add, model="answers:m"))
        )
        paused = rt.run_loop("payer", "pay 5", request(pay, model="pays:m"))
        await wait_until(lambda: rt.get(paused).status is LoopStatus.paused)
        await rt.wait(rt.run_loop("hostile", HOSTILE, request(add, model="hostile:m")))


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "loops.db"
    anyio.run(fill, path)
    return path


@contextlib.asynccontextmanager
async def client(db: Path, **options: Any) -> AsyncIterator[httpx2.AsyncClient]:
    """The UI over `db` (read-only), called in this process; the lifespan
    (which opens the store) runs around the client."""
    ui = app(SQLiteStore(db, events=True, read_only=True), token=TOKEN, **options)
    async with ui.router.lifespan_context(ui):
        transport = httpx2.ASGITransport(app=ui)
        async with httpx2.AsyncClient(
            transport=transport, base_url="http://127.0.0.1"
        ) as http:
            yield http


AUTH = {"authorization": f"Bearer {TOKEN}"}


# ------------------------------------------------------------------ the token


async def test_every_address_needs_the_token(db: Path) -> None:
    async with client(db) as http:
        for path in (
            "/",
            "/loop/loop-1",
            "/api/loops",
            "/api/loops/loop-1",
            "/static/ui.js",
        ):
            refused = await http.get(path)
            assert refused.status_code == 401, path
            assert "token" in refused.text
            wrong = await http.get(
                path, headers={"authorization": "Bearer nope-nope-nope-nope"}
            )
            assert wrong.status_code == 401, path
        assert (await http.get("/api/loops", headers=AUTH)).status_code == 200


async def test_the_token_in_the_url_becomes_a_cookie_and_leaves_the_url(
    db: Path,
) -> None:
    async with client(db) as http:
        entered = await http.get(f"/loop/loop-1?token={TOKEN}&x=1")
        assert entered.status_code == 303
        assert entered.headers["location"] == "/loop/loop-1?x=1"
        cookie = entered.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        assert "Path=/;" in cookie
        name, _, rest = cookie.partition("=")
        key = rest.split(";", 1)[0]
        assert name.startswith("agentfsm_ui")  # the port's, where a server says it
        assert TOKEN not in key  # a key of its own: cookies reach every port
        page = await http.get("/loop/loop-1", headers={"cookie": f"{name}={key}"})
        assert page.status_code == 200
        forged = await http.get("/loop/loop-1", headers={"cookie": f"{name}=x{key}"})
        assert forged.status_code == 401
        token = await http.get("/loop/loop-1", headers={"cookie": f"{name}={TOKEN}"})
        assert token.status_code == 401
        assert (await http.get(f"/?token=wrong{TOKEN}")).status_code == 401


async def test_every_answer_forbids_inline_scripts_and_framing(db: Path) -> None:
    async with client(db) as http:
        for path in ("/", "/api/loops", "/static/loop.js", "/api/loops/none"):
            answer = await http.get(path, headers=AUTH)
            csp = answer.headers["content-security-policy"]
            assert "script-src 'self'" in csp
            assert "unsafe-inline" not in csp
            assert "frame-ancestors 'none'" in csp
            assert answer.headers["x-content-type-options"] == "nosniff"
        refused = await http.get("/")
        assert "content-security-policy" in refused.headers


def test_a_token_too_short_or_a_store_without_loops_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="16"):
        app(SQLiteStore(tmp_path / "x.db"), token="short")
    with pytest.raises(ValueError, match="space"):  # a header could not carry it
        app(SQLiteStore(tmp_path / "x.db"), token="sixteen chars and a space")
    with pytest.raises(ConfigurationError, match="MemoryStore"):
        app(MemoryStore())
    with pytest.raises(ConfigurationError, match="without a durable store"):
        app(Runtime())
    with pytest.raises(ConfigurationError, match="poll"):
        app(SQLiteStore(tmp_path / "x.db"), poll=0)


# ------------------------------------------------------------------- the reads


async def test_the_loops_list_counts_filters_and_orders(db: Path) -> None:
    async with client(db) as http:
        every = (await http.get("/api/loops", headers=AUTH)).json()
        assert every["counts"] == {"running": 0, "paused": 1, "done": 2}
        assert every["agents"] == ["calculator", "hostile", "payer"]
        assert [loop["loop_id"] for loop in every["loops"]] == [
            "loop-3",
            "loop-2",
            "loop-1",
        ]
        paused = every["loops"][1]
        assert paused["pause_reason"] == "approval required: pay"
        assert paused["pending_calls"] == ["pay"]
        only = (await http.get("/api/loops?status=paused", headers=AUTH)).json()
        assert [loop["loop_id"] for loop in only["loops"]] == ["loop-2"]
        assert only["counts"] == every["counts"]  # counts are over every loop
        agent = (await http.get("/api/loops?agent=calculator", headers=AUTH)).json()
        assert [loop["loop_id"] for loop in agent["loops"]] == ["loop-1"]
        bad = await http.get("/api/loops?status=sleeping", headers=AUTH)
        assert bad.status_code == 400
        assert "sleeping" in bad.json()["error"]


async def test_one_loop_has_its_path_timeline_ledger_and_context(db: Path) -> None:
    async with client(db) as http:
        page = (await http.get("/api/loops/loop-1", headers=AUTH)).json()
        assert page["summary"]["outcome"] == "answered"
        assert page["answer"] == "5"
        taken = [e["label"] for e in page["graph"]["edges"] if e["kind"] == "taken"]
        assert taken == [
            "start (#1)",
            "infer (#2)",
            "call_tools (#3)",
            "answer (#5)",
            "infer (#4)",
            "finish (#6)",
        ]
        assert page["graph"]["nodes"]["idle_end"] == "current"
        kinds = [row["kind"] for row in page["rows"]]
        assert kinds[0] == "started"
        assert kinds[-1] == "idle"
        assert [row["seq"] for row in page["rows"]] == sorted(
            r["seq"] for r in page["rows"]
        )
        (entry,) = page["ledger"]
        assert (entry["tool"], entry["status"], entry["output"]["output"]) == (
            "add",
            "done",
            "5",
        )
        assert [i["type"] for i in page["items"]] == [
            "user_message",
            "function_call",
            "function_call_output",
            "model_message",
        ]
        later = (
            await http.get(
                f"/api/loops/loop-1?after={page['rows'][2]['seq']}&items=3",
                headers=AUTH,
            )
        ).json()
        assert later["rows"] == page["rows"][3:]
        assert later["items_from"] == 3
        assert len(later["items"]) == 1
        past = (await http.get("/api/loops/loop-1?items=99", headers=AUTH)).json()
        assert past["items_from"] == 0
        assert len(past["items"]) == 4
        missing = await http.get("/api/loops/loop-9", headers=AUTH)
        assert missing.status_code == 404
        assert "loop-9" in missing.json()["error"]
        bad = await http.get("/api/loops/loop-1?after=-1", headers=AUTH)
        assert bad.status_code == 400


async def test_a_paused_loop_shows_its_pending_edge_and_the_decision(db: Path) -> None:
    async with client(db) as http:
        page = (await http.get("/api/loops/loop-2", headers=AUTH)).json()
        pending = [e for e in page["graph"]["edges"] if e["kind"] == "pending"]
        assert [(e["source"], e["dest"]) for e in pending] == [
            ("inference", "function_call")
        ]
        assert page["graph"]["nodes"]["inference"] == "paused"
        assert page["pause"]["reason"] == "approval required: pay"
        (decision,) = page["decisions"]
        assert decision["decision"]["kind"] == "pause"


async def test_page_text_is_the_stores_escaped_where_it_enters_markup(db: Path) -> None:
    """The pages put the store's text in as text (loop.js); the one place the
    server writes it into HTML, the loop id in a meta tag, is percent-encoded
    (which an HTML parser keeps as it is, where it would turn a NUL or a CR
    of an escaped attribute into another character)."""
    async with client(db) as http:
        data = (await http.get("/api/loops/loop-3", headers=AUTH)).json()
        assert data["answer"] == HOSTILE  # the JSON carries the text as it is
        hostile_id = 'x"><script>alert(3)</script>'
        page = await http.get(f"/loop/{hostile_id}", headers=AUTH)
        assert "<script>alert(3)" not in page.text
        assert 'content="x%22%3E%3Cscript%3Ealert%283%29%3C%2Fscript%3E"' in page.text
        assert not re.search(
            r"<script>(?!\s*</script>)", page.text.replace("defer></script>", "")
        )


async def test_mounted_under_a_prefix_the_pages_point_under_it(db: Path) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    ui = app(SQLiteStore(db, events=True, read_only=True), token=TOKEN)
    host = Starlette(routes=[Mount("/debug", app=ui)])
    async with ui.router.lifespan_context(ui):
        transport = httpx2.ASGITransport(app=host)
        async with httpx2.AsyncClient(transport=transport, base_url="http://h") as http:
            page = await http.get("/debug/", headers=AUTH)
            assert page.status_code == 200
            assert 'href="/debug/static/ui.css"' in page.text
            assert 'content="/debug"' in page.text
            script = await http.get("/debug/static/loop.js", headers=AUTH)
            assert script.status_code == 200
            assert "drawGraph" in script.text
            # The entry stays under the prefix, and so does its cookie.
            entered = await http.get(f"/debug/loop/loop-1?token={TOKEN}")
            assert entered.headers["location"] == "/debug/loop/loop-1"
            assert "; Path=/debug;" in entered.headers["set-cookie"]


# ------------------------------------------------------------ the live streams


@contextlib.contextmanager
def served(db: Path, *more: str) -> Iterator[str]:
    """`agentfsm ui db` in a subprocess; its base URL."""
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
            *more,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        second = process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/\?token=", second)
        assert match, (first, second, process.stderr and process.stderr.read())
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        process.terminate()
        process.communicate(timeout=30)


Next = Callable[[], Awaitable[tuple[str, str, dict[str, Any]]]]


@contextlib.asynccontextmanager
async def sse(
    http: httpx2.AsyncClient, url: str, headers: dict[str, str] | None = None
) -> AsyncIterator[Next]:
    """A stream of server-sent events: a function giving the next one as
    `(event, id, data)`."""
    async with http.stream("GET", url, headers={**AUTH, **(headers or {})}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        body = cast("AsyncGenerator[str]", answer.aiter_lines())
        async with contextlib.aclosing(body) as lines:

            async def next_event() -> tuple[str, str, dict[str, Any]]:
                event, ident, data = "message", "", ""
                async for line in lines:
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


# asyncio only: httpcore2 leaves the generator of a streamed body that is
# closed before its end (an endless stream, closed) to the garbage collector,
# which trio reports as a ResourceWarning. The server is its own process.
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_streams_follow_a_loop_another_process_moves(tmp_path: Path) -> None:
    """The UI (its own process) streams the loops list and one loop's page as
    a runtime (this process) pauses a loop and then resumes it; a stream
    opened again with the last event id sends only what came after."""
    path = tmp_path / "live.db"
    store = SQLiteStore(path, events=True)
    scripted = {
        "pays": ScriptedProvider(
            [calls(call("pay", call_id="c1", amount=7)), text("paid")]
        )
    }
    async with Runtime(providers=scripted, store=store, ids=counter_ids()) as rt:
        loop_id = "loop-1"  # the runtime's first id (counter_ids)
        with served(path) as base:
            async with httpx2.AsyncClient(timeout=30) as http:
                with anyio.fail_after(30):
                    async with (
                        sse(http, f"{base}/api/stream/loops") as listed,
                        sse(http, f"{base}/api/stream/loops/{loop_id}") as stream,
                    ):
                        # A page opened before its loop exists says so once,
                        # then shows the loop when its first commit lands.
                        event, _, empty = await listed()
                        assert empty["loops"] == []
                        event, _, missing = await stream()
                        assert event == "missing"
                        assert loop_id in missing["error"]
                        assert (
                            rt.run_loop("payer", "pay 7", request(pay, model="pays:m"))
                            == loop_id
                        )
                        await wait_until(
                            lambda: rt.get(loop_id).status is LoopStatus.paused
                        )
                        while True:
                            event, _, first = await listed()
                            if first["loops"][0]["status"] == "paused":
                                break
                        assert event == "loops"
                        assert [
                            (l["loop_id"], l["status"]) for l in first["loops"]
                        ] == [(loop_id, "paused")]
                        seen: list[int] = []
                        while True:
                            event, ident, page = await stream()
                            assert event == "loop"
                            seen += [row["seq"] for row in page["rows"]]
                            if page["summary"]["status"] == "paused":
                                break
                        # The id: the last kept event's seq (a row's or a
                        # later one's) and how many context items were sent.
                        last, items = map(int, ident.split(":"))
                        assert last >= seen[-1]
                        assert items == page["items_from"] + len(page["items"])
                        assert seen == sorted(set(seen))

                        pending = rt.get(loop_id).pending
                        assert pending is not None
                        assert isinstance(pending.payload, ToolBatch)
                        rt.resume(
                            loop_id, Rewrite(payload=pending.payload.approve("c1"))
                        )
                        await rt.wait(loop_id)

                        while True:  # the list says done once the store does
                            event, _, later = await listed()
                            if later["loops"][0]["status"] == "done":
                                break
                        rows: list[int] = []
                        while True:
                            event, ident, update = await stream()
                            assert update["rows"], update  # only news is sent
                            rows += [row["seq"] for row in update["rows"]]
                            if update["summary"]["status"] == "done":
                                break
                        assert min(rows) > seen[-1]  # nothing sent twice

                    resumed_from = {"last-event-id": f"{seen[-1]}:1"}
                    url = f"{base}/api/stream/loops/{loop_id}"
                    async with sse(http, url, resumed_from) as again:
                        _, _, resumed = await again()
                    assert [row["seq"] for row in resumed["rows"]] == sorted(set(rows))
                    assert resumed["items_from"] == 1


def test_the_command_refuses_a_remote_address_unless_allowed(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    done = subprocess.run(
        [sys.executable, "-m", "agentfsm", "ui", str(path), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--allow-remote" in done.stderr


def test_path_graph_groups_the_error_edges_like_the_dot_drawing() -> None:
    graph = path_graph()
    ended = graph["ended"]
    rows = graph["rows"]
    assert isinstance(ended, dict)
    assert isinstance(rows, list)
    assert rows[0] == ["idle"]
    assert rows[-1] == ["idle_end"]
    assert ended["label"] == "abort | fail | cancel"
    assert "context_update" in ended["sources"]
    edges = graph["edges"]
    assert isinstance(edges, list)
    to_end = {(e["source"], e["label"]) for e in edges if e["dest"] == "idle_end"}
    assert to_end == {("function_call", "stop"), ("model_message", "finish")}
    assert not any("abort" in e["label"] for e in edges)


# ------------------------------------------------------- the store's change mark


@pytest.fixture(params=["sqlite", "postgres"])
def event_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Any]:
    """A new store object that keeps events, on the same data each call."""
    if request.param == "postgres":
        from agentfsm.store.postgres import PostgresStore

        server: Any = request.getfixturevalue("postgres_server")
        schema = f"t_{uuid.uuid4().hex}"
        return lambda: PostgresStore(server.conninfo(), schema=schema, events=True)
    return lambda: SQLiteStore(tmp_path / "loops.db", events=True)


async def landed(store: Any, loop_id: str, status: LoopStatus) -> None:
    """Until `store` (another connection) holds the loop with `status`."""
    with anyio.fail_after(30):
        while [s.status for s in await store.loops(loop_id=loop_id)] != [status]:  # noqa: ASYNC110 - a write elsewhere
            await anyio.sleep(0.01)


async def test_the_change_mark_moves_with_what_a_reader_should_see(
    event_store: Callable[[], Any],
) -> None:
    """What the UI polls before reading a page whole: the store's mark moves
    with each commit of any loop, a loop's only with its own."""
    scripted = {
        "pays": ScriptedProvider([calls(call("pay", call_id="c1", amount=7))]),
        "answers": ScriptedProvider([text("4")]),
    }
    async with (
        event_store() as reader,
        Runtime(providers=scripted, store=event_store(), ids=counter_ids()) as rt,
    ):
        assert await reader.change_mark("loop-1") == ()  # no such loop yet
        paused = rt.run_loop("payer", "pay 7", request(pay, model="pays:m"))
        await landed(reader, paused, LoopStatus.paused)
        whole, mine = await reader.change_mark(), await reader.change_mark(paused)
        assert mine != ()
        assert await reader.change_mark() == whole  # nothing moved: the same
        assert await reader.change_mark(paused) == mine
        await rt.wait(rt.run_loop("adder", "2+2?", request(add, model="answers:m")))
        assert await reader.change_mark() != whole  # another loop committed
        assert await reader.change_mark(paused) == mine  # not this one
        rt.cancel(paused, "enough")
        await rt.wait(paused)
        assert await reader.change_mark(paused) != mine
