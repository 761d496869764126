"""`agentfsm ui`'s acting half, over HTTP: the requests a page submits (the
decision inbox), the decisions the server builds from them, the form token
and the origin check (the browser tests are in tests/test_ui_actions_browser.py).

The app is called in this process through httpx2's ASGI transport, mounted
beside a runtime that holds the loops (`Runtime(requests=3600)`: it applies a
request only when poked, which the app does after storing one); and the real
`agentfsm ui` command (a subprocess: a read-only store and a writer) for the
standalone path.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
import structlog.testing

from agentfsm import LoopStatus, Outcome, Runtime, tool
from agentfsm.breakpoints import Break
from agentfsm.exceptions import ConfigurationError
from agentfsm.messages import FunctionCallOutputItem
from agentfsm.store import SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.tools import Tool
from agentfsm.ui import app
from agentfsm.ui._actions import Actions
from agentfsm.ui._source import StoreSource
from tests.helpers import request, wait_until
from tests.test_cli_loops import counter_ids
from tests.ui_actions_child import TOOLS, markers

TOKEN = "actions-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CHILD = Path(__file__).with_name("ui_actions_child.py")
ROOT = Path(__file__).parent.parent

Runs = list[tuple[str, str]]


def sender(runs: Runs) -> Tool:
    @tool(needs_approval=True)
    async def send(to: str, text: str) -> str:
        """Send a message (each run is recorded in `runs`)."""
        runs.append((to, text))
        return f"sent {text!r} to {to}"

    return send


@tool
async def wait_here() -> str:
    """Wait until the loop is cancelled."""
    await anyio.sleep_forever()
    return "never"


def scripted() -> dict[str, ScriptedProvider]:
    """`sends:` asks for three sends (each needs approval), then answers;
    `waits:` asks for `wait_here`; `answers:` answers at once."""
    return {
        "sends": ScriptedProvider(
            [
                calls(
                    call("send", call_id="c1", to="ada", text="hi ada"),
                    call("send", call_id="c2", to="bob", text="hi bob"),
                    call("send", call_id="c3", to="cy", text="hi cy"),
                ),
                text("done"),
            ]
        ),
        "waits": ScriptedProvider([calls(call("wait_here", call_id="w1"))]),
        "answers": ScriptedProvider([text("4")]),
    }


async def stored_as(store: Any, loop_id: str, status: LoopStatus) -> Any:
    """The loop's stored record once the store holds it with `status` (the
    runtime writes its commits in the background)."""
    with anyio.fail_after(30):
        while True:
            stored = await store.load(loop_id)
            if stored is not None and stored.record.status is status:
                return stored.record
            await anyio.sleep(0.01)  # a write in the store's thread


async def recovered(runtime: Runtime) -> str:
    """The one loop `runtime` takes up paused (a dead owner's lease is taken
    once the store can tell it is dead)."""
    with anyio.fail_after(60):
        while True:
            report = await runtime.recover()
            assert not report.failed, report.failed
            if report.paused:
                (loop_id,) = report.paused
                return loop_id
            await anyio.sleep(0.1)  # a lease the store still calls live


@contextlib.asynccontextmanager
async def mounted(
    runtime: Runtime, **options: Any
) -> AsyncIterator[tuple[httpx2.AsyncClient, dict[str, str]]]:
    """The UI mounted beside `runtime`, acting as alice: a client and the
    headers a page's request carries (the token, the form token)."""
    ui = app(runtime, token=TOKEN, user="alice", **options)
    async with ui.router.lifespan_context(ui):
        transport = httpx2.ASGITransport(app=ui)
        async with httpx2.AsyncClient(
            transport=transport, base_url="http://127.0.0.1"
        ) as http:
            yield http, {**AUTH, "x-agentfsm-form": ui.state.form_token}


@contextlib.asynccontextmanager
async def paused_batch(
    tmp_path: Path, runs: Runs, **options: Any
) -> AsyncIterator[tuple[Runtime, str, int]]:
    """A runtime (applying requests when poked) holding loop-1 paused for
    approval of three sends, stored as paused: `(runtime, loop id, seq)`."""
    store = SQLiteStore(tmp_path / "loops.db", events=True)
    async with Runtime(
        providers=scripted(), store=store, ids=counter_ids(), requests=3600.0
    ) as rt:
        loop_id = rt.run_loop("actor", "send", request(sender(runs), model="sends:m"))
        record = await stored_as(store, loop_id, LoopStatus.paused)
        yield rt, loop_id, record.pause.seq


def url(loop_id: str) -> str:
    return f"/api/loops/{loop_id}/requests"


# -------------------------------------------------------- acting on a pause


async def test_each_call_is_approved_denied_or_edited_and_the_decision_names_who(
    tmp_path: Path,
) -> None:
    """One request settles each call of the batch; the runtime (poked by the
    app) applies it: the approved call runs as it was, the edited one with
    its new arguments, the denied one not at all (its output gives the
    reason); the decision entry names the UI's user."""
    runs: Runs = []
    async with (
        paused_batch(tmp_path, runs) as (rt, loop_id, seq),
        mounted(rt) as (
            http,
            form,
        ),
    ):
        page = (await http.get(f"/api/loops/{loop_id}", headers=AUTH)).json()
        offered = page["actions"]["resume"]
        assert offered["seq"] == seq
        assert [(c["call_id"], c["awaiting"]) for c in offered["calls"]] == [
            ("c1", True),
            ("c2", True),
            ("c3", True),
        ]
        assert page["user"] == "alice"
        body = {
            "kind": "resume",
            "seq": seq,
            "decision": "calls",
            "calls": {
                "c1": {"action": "approve"},
                "c2": {"action": "deny", "reason": "bob <b>asked</b> not to be"},
                "c3": {"action": "edit", "arguments": {"to": "cy", "text": "edited"}},
            },
        }
        answer = await http.post(url(loop_id), json=body, headers=form)
        assert answer.status_code == 202, answer.text
        asked = answer.json()
        assert (asked["kind"], asked["seq"], asked["by"], asked["status"]) == (
            "resume",
            seq,
            "alice",
            "pending",
        )
        batch = asked["decision"]["payload"]
        assert batch["denied"] == {"c2": "bob <b>asked</b> not to be"}
        assert batch["awaiting_approval"] == ["c2"]  # denied: it never runs
        with anyio.fail_after(30):
            result = await rt.wait(loop_id)
        assert result.outcome is Outcome.answered
        assert runs == [("ada", "hi ada"), ("cy", "edited")]
        assert rt.store is not None
        await stored_as(rt.store, loop_id, LoopStatus.done)
        stored = await rt.store.load(loop_id)
        assert stored is not None
        outputs = {
            i.call_id: i for i in stored.items if isinstance(i, FunctionCallOutputItem)
        }
        assert outputs["c2"].is_error
        assert "bob <b>asked</b> not to be" in outputs["c2"].output
        last = (await rt.store.decisions(loop_id))[-1]
        assert (last.by, last.decision.kind, last.seq) == ("alice", "rewrite", seq)
        listed = (await http.get(url(loop_id), headers=AUTH)).json()["requests"]
        assert [(r["id"], r["status"]) for r in listed] == [(asked["id"], "applied")]
        # Ended: nothing more is offered, and acting is refused.
        page = (await http.get(f"/api/loops/{loop_id}", headers=AUTH)).json()
        assert page["actions"] is None
        assert [r["status"] for r in page["requests"]] == ["applied"]
        late = await http.post(url(loop_id), json=body, headers=form)
        assert late.status_code == 409
        assert "ended" in late.json()["error"]


async def test_abort_and_a_stale_seq(tmp_path: Path) -> None:
    """A request for another pause than the loop's is a 409 (nothing stored);
    abort ends the loop `aborted` with the reason."""
    runs: Runs = []
    async with (
        paused_batch(tmp_path, runs) as (rt, loop_id, seq),
        mounted(rt) as (
            http,
            form,
        ),
    ):
        stale = {"kind": "resume", "seq": seq - 1, "decision": "proceed"}
        answer = await http.post(url(loop_id), json=stale, headers=form)
        assert answer.status_code == 409
        assert answer.json()["field"] == "seq"
        assert f"paused at seq {seq}, not at seq {seq - 1}" in answer.json()["error"]
        aborting = {"kind": "resume", "seq": seq, "decision": "abort", "reason": "no"}
        assert (
            await http.post(url(loop_id), json=aborting, headers=form)
        ).status_code == 202
        with anyio.fail_after(30):
            result = await rt.wait(loop_id)
        assert (result.outcome, result.reason) == (Outcome.aborted, "no")
        assert runs == []
        listed = (await http.get(url(loop_id), headers=AUTH)).json()["requests"]
        assert [(r["decision"]["kind"], r["status"]) for r in listed] == [
            ("abort", "applied")
        ]


async def test_the_text_of_a_paused_answer_is_rewritten(tmp_path: Path) -> None:
    """A loop paused before its answer (a breakpoint) offers the answer's
    text; the text given goes on as the loop's answer, and the decision
    (a rewrite, by alice) is what the store keeps."""
    store = SQLiteStore(tmp_path / "loops.db", events=True)
    async with (
        Runtime(
            providers=scripted(),
            store=store,
            ids=counter_ids(),
            requests=3600.0,
            breakpoints=[Break("model_message")],
        ) as rt,
        mounted(rt) as (http, form),
    ):
        loop_id = rt.run_loop("actor", "what is 2 + 2?", request(model="answers:m"))
        record = await stored_as(store, loop_id, LoopStatus.paused)
        page = (await http.get(f"/api/loops/{loop_id}", headers=AUTH)).json()
        offered = page["actions"]["resume"]
        assert offered["text"] == {"of": "model_message", "content": "4"}
        assert offered["calls"] is None
        body = {
            "kind": "resume",
            "seq": record.pause.seq,
            "decision": "text",
            "text": "four <b>exactly</b>",
        }
        assert (
            await http.post(url(loop_id), json=body, headers=form)
        ).status_code == 202
        with anyio.fail_after(30):
            result = await rt.wait(loop_id)
        assert result.outcome is Outcome.answered
        assert result.answer is not None
        assert result.answer.content == "four <b>exactly</b>"
        (entry,) = [d for d in await store.decisions(loop_id) if d.by is not None]
        assert (entry.by, entry.decision.kind) == ("alice", "rewrite")


async def test_cancel_a_running_loop(tmp_path: Path) -> None:
    """A running loop is cancelled with the reason; its page offers cancel
    only; the request is applied by the loop's ending."""
    store = SQLiteStore(tmp_path / "loops.db", events=True)
    async with (
        Runtime(
            providers=scripted(), store=store, ids=counter_ids(), requests=3600.0
        ) as rt,
        mounted(rt) as (http, form),
    ):
        with rt.bus.subscribe("function_call.started") as started:
            loop_id = rt.run_loop("actor", "wait", request(wait_here, model="waits:m"))
            with anyio.fail_after(30):
                await started.receive()
        await stored_as(store, loop_id, LoopStatus.running)
        page = (await http.get(f"/api/loops/{loop_id}", headers=AUTH)).json()
        assert page["actions"] == {"cancel": True, "resume": None}
        resume = {"kind": "resume", "seq": 1, "decision": "proceed"}
        refused = await http.post(url(loop_id), json=resume, headers=form)
        assert refused.status_code == 409
        assert "not paused" in refused.json()["error"]
        cancel = {"kind": "cancel", "reason": "enough <i>waiting</i>"}
        answer = await http.post(url(loop_id), json=cancel, headers=form)
        assert answer.status_code == 202
        with anyio.fail_after(30):
            result = await rt.wait(loop_id)
        assert (result.outcome, result.reason) == (
            Outcome.cancelled,
            "enough <i>waiting</i>",
        )
        with anyio.fail_after(30):
            while True:
                listed = (await http.get(url(loop_id), headers=AUTH)).json()
                if listed["requests"][0]["status"] != "pending":
                    break
                await anyio.sleep(0.01)  # the ending's commit, in the background
        assert listed["requests"][0]["status"] == "applied"


# ------------------------------------------------------ bad forms, conflicts

BAD = [
    pytest.param(b"{not json", "body", id="not-json"),
    pytest.param(b"[1]", "body", id="not-an-object"),
    pytest.param(b'{"kind": "resume", "kind": "cancel"}', "body", id="repeated-key"),
    pytest.param({"kind": "pause"}, "kind", id="kind"),
    pytest.param({"kind": "resume", "decision": "proceed"}, "seq", id="no-seq"),
    pytest.param(
        {"kind": "resume", "seq": True, "decision": "proceed"}, "seq", id="bool-seq"
    ),
    pytest.param(
        {"kind": "resume", "seq": "S", "decision": "go"}, "decision", id="decision"
    ),
    pytest.param(
        {"kind": "resume", "seq": "S", "decision": "abort"}, "reason", id="abort-why"
    ),
    pytest.param(
        {"kind": "resume", "seq": "S", "decision": "calls"}, "calls", id="no-calls"
    ),
    pytest.param(
        {"kind": "resume", "seq": "S", "decision": "text"}, "text", id="no-text"
    ),
    pytest.param(
        {"kind": "resume", "seq": "S", "decision": "text", "text": " "},
        "text",
        id="blank-text",
    ),
    pytest.param(
        {"kind": "resume", "seq": "S", "decision": "proceed", "text": "x"},
        "text",
        id="text-with-proceed",
    ),
    pytest.param(
        {"kind": "resume", "seq": "S", "decision": "text", "text": "x"},
        "decision",
        id="text-over-a-batch",
    ),
    pytest.param(
        {"kind": "resume", "seq": "S", "decision": "proceed", "calls": {}},
        "calls",
        id="calls-with-proceed",
    ),
    pytest.param(
        {
            "kind": "resume",
            "seq": "S",
            "decision": "calls",
            "calls": {"c1": {"action": "approve"}},
        },
        "calls.c2",
        id="call-left-out",
    ),
    pytest.param(
        {
            "kind": "resume",
            "seq": "S",
            "decision": "calls",
            "calls": {"c1": {"action": "approve"}, "c9": {"action": "approve"}},
        },
        "calls.c9",
        id="no-such-call",
    ),
    pytest.param(
        {
            "kind": "resume",
            "seq": "S",
            "decision": "calls",
            "calls": {"c1": {"action": "deny", "reason": " "}},
        },
        "calls.c1.reason",
        id="deny-why",
    ),
    pytest.param(
        {
            "kind": "resume",
            "seq": "S",
            "decision": "calls",
            "calls": {"c1": {"action": "edit", "arguments": "[1, 2]"}},
        },
        "calls.c1.arguments",
        id="edit-not-object",
    ),
    pytest.param(
        {
            "kind": "resume",
            "seq": "S",
            "decision": "calls",
            "calls": {"c1": {"action": "edit", "arguments": "{nope"}},
        },
        "calls.c1.arguments",
        id="edit-not-json",
    ),
    pytest.param(
        {
            "kind": "resume",
            "seq": "S",
            "decision": "calls",
            "calls": {"c1": {"action": "run"}},
        },
        "calls.c1.action",
        id="action",
    ),
    pytest.param(
        {
            "kind": "resume",
            "seq": "S",
            "decision": "calls",
            "calls": {"c1": {"action": "approve", "reason": "x"}},
        },
        "calls.c1.reason",
        id="field-not-taken",
    ),
    pytest.param({"kind": "cancel"}, "reason", id="cancel-why"),
    pytest.param({"kind": "cancel", "reason": "x", "seq": 3}, "seq", id="cancel-seq"),
]


def _filled(body: Any, seq: int) -> bytes:
    if isinstance(body, bytes):
        return body
    return json.dumps(body).replace('"S"', str(seq)).encode()


@pytest.mark.parametrize(("body", "field"), BAD)
async def test_a_bad_form_is_a_400_naming_its_field_and_nothing_is_stored(
    tmp_path: Path, body: Any, field: str
) -> None:
    async with (
        paused_batch(tmp_path, []) as (rt, loop_id, seq),
        mounted(rt) as (
            http,
            form,
        ),
    ):
        answer = await http.post(
            url(loop_id),
            content=_filled(body, seq),
            headers={**form, "content-type": "application/json"},
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["field"] == field
        assert answer.json()["error"].startswith(f"{field}: ")
        assert (await http.get(url(loop_id), headers=AUTH)).json()["requests"] == []
        assert rt.get(loop_id).status is LoopStatus.paused


async def test_no_such_loop_and_a_body_too_large(tmp_path: Path) -> None:
    async with (
        paused_batch(tmp_path, []) as (rt, loop_id, _),
        mounted(rt) as (
            http,
            form,
        ),
    ):
        cancel = {"kind": "cancel", "reason": "x"}
        missing = await http.post(url("loop-9"), json=cancel, headers=form)
        assert missing.status_code == 404
        assert "loop-9" in missing.json()["error"]
        big = b'{"kind": "cancel", "reason": "' + b"x" * (1 << 20) + b'"}'
        too_big = await http.post(url(loop_id), content=big, headers=form)
        assert too_big.status_code == 413
        on_loop = await http.post(f"/api/loops/{loop_id}", json=cancel, headers=form)
        assert on_loop.status_code == 405
        assert (await http.get(url(loop_id), headers=AUTH)).json()["requests"] == []


# ----------------------------------------------------------------- forgery


async def test_a_request_without_the_form_token_or_from_elsewhere_is_refused(
    tmp_path: Path,
) -> None:
    """403 and nothing stored: no form token, a wrong one (the access token,
    the cookie's key), a foreign Origin, a cross-site fetch; 401 without the
    access token. The page carries the form token in its <meta>."""
    async with (
        paused_batch(tmp_path, []) as (rt, loop_id, _),
        mounted(rt) as (
            http,
            form,
        ),
    ):
        cancel = {"kind": "cancel", "reason": "forged"}
        token = form["x-agentfsm-form"]
        page = await http.get(f"/loop/{loop_id}", headers=AUTH)
        assert f'<meta name="agentfsm-form" content="{token}">' in page.text
        assert re.fullmatch(r"[0-9a-f]{64}", token)
        entered = await http.get(f"/?token={TOKEN}")
        key = entered.headers["set-cookie"].split("=", 1)[1].split(";", 1)[0]
        http.cookies.clear()  # each request below carries what it says only
        assert token not in (TOKEN, key)
        forged = [
            AUTH,
            {**AUTH, "x-agentfsm-form": "0" * 64},
            {**AUTH, "x-agentfsm-form": TOKEN},
            {**AUTH, "x-agentfsm-form": key},
            {**form, "origin": "http://127.0.0.1:9999"},
            {**form, "origin": "http://evil.example"},
            {**form, "origin": "null"},
            {**form, "sec-fetch-site": "same-site"},
            {**form, "sec-fetch-site": "cross-site"},
        ]
        for headers in forged:
            answer = await http.post(url(loop_id), json=cancel, headers=headers)
            assert answer.status_code == 403, headers
            assert answer.json()["error"].startswith("refused")
            assert "content-security-policy" in answer.headers
        no_token = {k: v for k, v in form.items() if k != "authorization"}
        assert (
            await http.post(url(loop_id), json=cancel, headers=no_token)
        ).status_code == 401
        assert (await http.get(url(loop_id), headers=AUTH)).json()["requests"] == []
        assert rt.get(loop_id).status is LoopStatus.paused
        # The same origin, as a browser says it, is let through.
        own = {**form, "origin": "http://127.0.0.1", "sec-fetch-site": "same-origin"}
        assert (
            await http.post(url(loop_id), json=cancel, headers=own)
        ).status_code == 202


# --------------------------------------------------------- odd loop ids


async def test_odd_loop_ids_address_their_requests(tmp_path: Path) -> None:
    """A loop whose id ends in `/requests` and one named `..`: each one's
    requests by its own address (`%2F` is the id's, a literal `/requests`
    the route's; `..` by `?id=`)."""
    ids = iter(["x/requests", ".."])
    store = SQLiteStore(tmp_path / "loops.db", events=True)
    async with (
        Runtime(
            providers={
                "a": ScriptedProvider([text("4")]),
                "b": ScriptedProvider([text("5")]),
            },
            store=store,
            ids=lambda: next(ids),
        ) as rt,
        mounted(rt) as (http, form),
    ):
        slashed = rt.run_loop("a", "hi", request(model="a:m"))
        dots = rt.run_loop("b", "hi", request(model="b:m"))
        await rt.wait(slashed)
        await rt.wait(dots)
        await stored_as(store, slashed, LoopStatus.done)
        await stored_as(store, dots, LoopStatus.done)
        # Ended loops: the request is refused, naming the loop (the route found it).
        cancel = {"kind": "cancel", "reason": "x"}
        answer = await http.post(
            "/api/loops/x%2Frequests/requests", json=cancel, headers=form
        )
        assert answer.status_code == 409
        assert "x/requests" in answer.json()["error"]
        answer = await http.post(
            "/api/loops//requests?id=..", json=cancel, headers=form
        )
        assert answer.status_code == 409
        assert "loop .. has ended" in answer.json()["error"]
        page = await http.get("/api/loops/x%2Frequests", headers=AUTH)
        assert page.json()["summary"]["loop_id"] == "x/requests"
        listed = await http.get("/api/loops/x%2Frequests/requests", headers=AUTH)
        assert listed.json() == {"requests": []}
        # `x` itself has no such loop: a literal tail is the route's.
        missing = await http.post("/api/loops/x/requests", json=cancel, headers=form)
        assert missing.status_code == 404
        assert "'x'" in missing.json()["error"]


# --------------------------------------------------- the store's read-only side


async def test_a_read_only_store_acts_through_its_writer_and_a_page_sees_it(
    tmp_path: Path,
) -> None:
    """The standalone shape: the UI reads a read-only handle and stores
    requests through a writer; a loop no runtime holds keeps its request
    pending (the page's mark moves with it) until a runtime recovers the
    loop and applies it. Without a writer, nothing is offered and a request
    is a 503."""
    path = tmp_path / "loops.db"
    runs: Runs = []
    send = sender(runs)
    async with Runtime(
        providers=scripted(), store=SQLiteStore(path, events=True), ids=counter_ids()
    ) as rt:
        loop_id = rt.run_loop("actor", "send", request(send, model="sends:m"))
        await wait_until(lambda: rt.get(loop_id).status is LoopStatus.paused)
    # Its runtime has exited: the loop is paused in the store, held by none.
    reader = SQLiteStore(path, events=True, read_only=True)
    async with contextlib.AsyncExitStack() as stack:
        bare = app(
            SQLiteStore(path, events=True, read_only=True), token=TOKEN, user="x"
        )
        await stack.enter_async_context(bare.router.lifespan_context(bare))
        http = await stack.enter_async_context(
            httpx2.AsyncClient(
                transport=httpx2.ASGITransport(app=bare), base_url="http://h"
            )
        )
        page = (await http.get(f"/api/loops/{loop_id}", headers=AUTH)).json()
        assert page["actions"] is None
        form = {**AUTH, "x-agentfsm-form": bare.state.form_token}
        cancel = {"kind": "cancel", "reason": "x"}
        refused = await http.post(url(loop_id), json=cancel, headers=form)
        assert refused.status_code == 503
        assert "writer" in refused.json()["error"]

    writer = SQLiteStore(path)
    ui = app(reader, token=TOKEN, user="bob", writer=writer)
    async with ui.router.lifespan_context(ui):
        transport = httpx2.ASGITransport(app=ui)
        async with httpx2.AsyncClient(transport=transport, base_url="http://h") as http:
            form = {**AUTH, "x-agentfsm-form": ui.state.form_token}
            page = (await http.get(f"/api/loops/{loop_id}", headers=AUTH)).json()
            seq = page["actions"]["resume"]["seq"]
            source = StoreSource(reader, Actions(reader, user="bob", writer=writer))
            before = await source.mark(loop_id)
            body = {
                "kind": "resume",
                "seq": seq,
                "decision": "calls",
                "calls": {
                    "c1": {"action": "approve"},
                    "c2": {"action": "deny", "reason": "no"},
                    "c3": {"action": "deny", "reason": "no"},
                },
            }
            answer = await http.post(url(loop_id), json=body, headers=form)
            assert answer.status_code == 202, answer.text
            assert answer.json()["by"] == "bob"
            # The reader sees the request (the page's stream compares it).
            assert await source.mark(loop_id) != before
            page = (await http.get(f"/api/loops/{loop_id}", headers=AUTH)).json()
            assert [(r["by"], r["status"]) for r in page["requests"]] == [
                ("bob", "pending")
            ]
            async with Runtime(
                providers={"sends": ScriptedProvider([text("done")])},
                store=SQLiteStore(path, events=True),
                tools=[send],
                requests=0.05,
            ) as again:
                assert await recovered(again) == loop_id
                with anyio.fail_after(30):
                    await again.wait(loop_id)
            assert runs == [("ada", "hi ada")]
            listed = (await http.get(url(loop_id), headers=AUTH)).json()["requests"]
            assert [r["status"] for r in listed] == ["applied"]
            decisions = await reader.decisions(loop_id)
            assert decisions[-1].by == "bob"


def test_the_user_must_be_named_and_the_writer_writable(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "x.db", read_only=True)
    with pytest.raises(ConfigurationError, match="user"):
        app(store, user=" ")
    with pytest.raises(ConfigurationError, match="writer"):
        app(store, writer=SQLiteStore(tmp_path / "x.db", read_only=True))
    assert app(store).state.user  # the OS user's name by default


# -------------------------------------------------------- uncertain calls


def _env(markers_dir: Path) -> dict[str, str]:
    return {**os.environ, "UI_MARKERS": str(markers_dir), "PYTHONUNBUFFERED": "1"}


def killed_mid_tool(db: Path, markers_dir: Path) -> str:
    """A child's loop killed (SIGKILL) while `charge` runs: its id."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), "crash", "sqlite", str(db), str(markers_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, child.communicate(timeout=30)
        loop_id: str = json.loads(line)["loop_id"]
        assert [m["tool"] for m in markers(markers_dir)] == ["charge"]
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.communicate(timeout=30)
    return loop_id


async def test_an_uncertain_call_is_settled_as_having_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop recovered over a call a crash left uncertain: the page offers
    'it ran' / 'it did not' / deny for it; "it ran" records the output, and
    the tool is never run again."""
    db, runs_dir = tmp_path / "loops.db", tmp_path / "runs"
    runs_dir.mkdir()
    loop_id = await anyio.to_thread.run_sync(killed_mid_tool, db, runs_dir)
    monkeypatch.setenv("UI_MARKERS", str(runs_dir))
    monkeypatch.setenv("UI_MODE", "recover")
    store = SQLiteStore(db, events=True)
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("charged once")])},
        store=store,
        tools=TOOLS,
        requests=3600.0,
    ) as rt:
        assert await recovered(rt) == loop_id
        record = await stored_as(store, loop_id, LoopStatus.paused)
        async with mounted(rt) as (http, form):
            page = (await http.get(f"/api/loops/{loop_id}", headers=AUTH)).json()
            (offered,) = page["actions"]["resume"]["calls"]
            assert (offered["call_id"], offered["uncertain"]) == ("k1", True)
            # Said nothing of, it is a 400: its outcome must be said.
            proceed = {"kind": "resume", "seq": record.pause.seq, "decision": "calls"}
            left_out = await http.post(
                url(loop_id), json={**proceed, "calls": {}}, headers=form
            )
            assert left_out.status_code == 400
            ran = {"k1": {"action": "answer", "output": "charged 5 (receipt 42)"}}
            answer = await http.post(
                url(loop_id), json={**proceed, "calls": ran}, headers=form
            )
            assert answer.status_code == 202, answer.text
            with anyio.fail_after(30):
                result = await rt.wait(loop_id)
    assert result.outcome is Outcome.answered
    assert [m["tool"] for m in markers(runs_dir)] == ["charge"]  # the killed run only
    async with SQLiteStore(db, read_only=True) as reader:
        (entry,) = await reader.calls(loop_id)
        assert entry.status == "done"
        assert entry.output is not None
        assert entry.output.output == "charged 5 (receipt 42)"
        assert entry.by == "alice"


# ------------------------------------------------------- the command line


def test_the_command_acts_as_its_user_or_shows_only(tmp_path: Path) -> None:
    """`agentfsm ui --as carol` stores requests by carol (through a writer of
    its own: the store it reads is read-only); `--read-only` offers nothing
    and stores nothing."""
    path = tmp_path / "loops.db"

    async def fill() -> str:
        async with Runtime(
            providers=scripted(), store=SQLiteStore(path, events=True)
        ) as rt:
            loop_id = rt.run_loop("actor", "send", request(sender([]), model="sends:m"))
            await wait_until(lambda: rt.get(loop_id).status is LoopStatus.paused)
            return loop_id

    loop_id = anyio.run(fill)
    cancel = {"kind": "cancel", "reason": "not today"}
    for more, acts in ((["--as", "carol"], True), (["--read-only"], False)):
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "agentfsm",
                "ui",
                str(path),
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
            assert ("acts as carol" if acts else "shows only") in first, first
            match = re.search(r"http://127\.0\.0\.1:(\d+)/", process.stdout.readline())
            assert match
            base = f"http://127.0.0.1:{match.group(1)}"
            with httpx2.Client(base_url=base, timeout=30) as http:
                page = http.get(f"/loop/{loop_id}", headers=AUTH).text
                found = re.search(r'name="agentfsm-form" content="([0-9a-f]+)"', page)
                assert found
                form = {**AUTH, "x-agentfsm-form": found.group(1)}
                answer = http.post(url(loop_id), json=cancel, headers=form)
                listed = http.get(url(loop_id), headers=AUTH).json()["requests"]
        finally:
            process.terminate()
            process.communicate(timeout=30)
        if acts:
            assert answer.status_code == 202, answer.text
            assert [(r["by"], r["reason"]) for r in listed] == [("carol", "not today")]
        else:
            assert answer.status_code == 503
            assert len(listed) == 1  # carol's, from before


async def test_mounted_over_a_runtime_that_applies_no_requests_it_warns(
    tmp_path: Path,
) -> None:
    """Mounted beside a runtime made without `requests=`, the app says once
    that the requests its pages store stay pending; beside one made with it,
    it says nothing."""
    for requests, warned in ((False, True), (3600.0, False)):
        store = SQLiteStore(tmp_path / f"loops-{requests}.db")
        async with Runtime(
            providers=scripted(), store=store, requests=requests
        ) as runtime:
            assert runtime.watches_requests is (not warned)
            with structlog.testing.capture_logs() as logs:
                app(runtime, token=TOKEN, user="alice")
        said = [e for e in logs if e["event"] == "ui_runtime_applies_no_requests"]
        assert len(said) == (1 if warned else 0)
        if warned:
            assert "requests=True" in said[0]["hint"]
