"""Images as the views show them (issue 31): `agentfsm inspect` and the
timeline by reference, `--html` as thumbnails; `agentfsm run --image`;
`agentfsm ui` by reference, with each image's bytes served by its digest;
OTel spans by reference, never the bytes.

The loops run on real runtimes over scripted providers, writing real event
logs and SQLite stores; the UI is called through httpx's ASGI transport (as
tests/test_ui.py does) and, for one thumbnail, in Debian's chromium (as
tests/test_ui_browser.py does).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest

from agentfsm import (
    FunctionProvider,
    ImageBlock,
    ImageNotSupported,
    InferenceInput,
    InferenceOutput,
    LoopStatus,
    ModelContext,
    Runtime,
    ToolResult,
    UserMessage,
    tool,
)
from agentfsm.cli import main
from agentfsm.cli import run as run_command
from agentfsm.cli.run import _request, _watch, message_of
from agentfsm.eventlog import read_events
from agentfsm.inference import NO_IMAGES, ImageSupport
from agentfsm.messages import MAX_IMAGE_BYTES, TextBlock
from agentfsm.store import SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from agentfsm.timeline import build_timeline, render_html
from tests.helpers import needs_dot
from tests.test_cli_loops import counter_ids
from tests.test_ui import AUTH, TOKEN, client


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A real PNG of one colour (a browser decodes it)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    row = b"\x00" + bytes(rgb) * width
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(row * height))
        + chunk(b"IEND", b"")
    )


RED = ImageBlock.from_bytes(png(24, 16, (220, 30, 30)))
"""The image the user sends."""
BLUE = ImageBlock.from_bytes(png(8, 8, (30, 30, 220)))
"""The image the tool returns."""
QUESTION = "what is on screen?"


def b64(image: ImageBlock) -> str:
    assert image.data is not None
    return base64.b64encode(image.data).decode()


def no_bytes(text: str) -> None:
    """`text` holds neither image's bytes, as base64 or as a data: URL."""
    for image in (RED, BLUE):
        assert b64(image) not in text
        assert b64(image)[:40] not in text


@tool
async def screenshot() -> ToolResult:
    """The screen as it is now."""
    return ToolResult(output="the screen", images=[BLUE])


def script() -> ScriptedProvider:
    """Calls `screenshot`, then answers; the answer's request sent the tool's
    image as text (as Chat Completions does)."""
    answer = text("a red square").model_copy(
        update={"images_described": (BLUE.digest,)}
    )
    return ScriptedProvider([calls(call("screenshot", call_id="c1")), answer])


def message() -> UserMessage:
    return UserMessage(content=[QUESTION, RED])


async def one_loop(runtime: Runtime) -> str:
    request = InferenceInput(model="s:m", context=ModelContext(), tools=(screenshot,))
    loop_id = runtime.run_loop("looker", message(), request)
    assert (await runtime.wait(loop_id)).outcome == "answered"
    return loop_id


async def fill_log(path: Path) -> None:
    async with Runtime(
        providers={"s": script()}, event_log=path, ids=counter_ids()
    ) as runtime:
        await one_loop(runtime)


async def fill_store(path: Path, *, events: bool) -> None:
    """loop-1 is the loop with images; loop-2 one without."""
    store = SQLiteStore(path, events=events)
    plain = ScriptedProvider([text("nothing to see")])
    async with Runtime(
        providers={"s": script(), "p": plain}, store=store, ids=counter_ids()
    ) as runtime:
        await one_loop(runtime)
        request = InferenceInput(model="p:m", context=ModelContext())
        await runtime.wait(runtime.run_loop("plain", "hello", request))


@pytest.fixture
def log(tmp_path: Path, anyio_backend: str) -> Path:
    path = tmp_path / "events.jsonl"
    anyio.run(fill_log, path, backend=anyio_backend)
    return path


@pytest.fixture
def db(tmp_path: Path, anyio_backend: str) -> Path:
    path = tmp_path / "loops.db"
    anyio.run(lambda: fill_store(path, events=True), backend=anyio_backend)
    return path


# ------------------------------------------------------------ inspect, timeline


def test_inspect_shows_each_image_by_its_reference(
    log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(log)]) == 0
    table = capsys.readouterr().out
    assert f"{QUESTION} [image:" in table  # the question's cell, cut
    no_bytes(table)

    assert main(["inspect", str(log), "--loop", "loop-1", "--width", "200"]) == 0
    shown = capsys.readouterr().out
    no_bytes(shown)
    rows = [line.split(None, 2)[1:] for line in shown.splitlines() if "+" in line]
    assert ["started", f'"{QUESTION} {RED.reference}" on s:m'] in rows
    tool_row = next(r for r in rows if r[0] == "tool")
    assert tool_row[1].startswith(f"screenshot({{}}) -> the screen {BLUE.reference}  [")
    inference = [r[1] for r in rows if r[0] == "inference"]
    assert "1 image sent as text" in inference[1]
    assert "image" not in inference[0]


def test_the_timeline_rows_hold_the_images_they_refer_to(log: Path) -> None:
    events = list(read_events(log))
    timeline = build_timeline(events, "loop-1")
    with_images = {row.kind: row.images for row in timeline.rows if row.images}
    assert with_images == {"started": (RED,), "tool": (BLUE,)}
    assert with_images["started"][0].data == RED.data  # the bytes, read back


def test_the_page_shows_thumbnails(log: Path) -> None:
    timeline = build_timeline(list(read_events(log)), "loop-1", width=400)
    page = render_html(timeline, "<svg></svg>")
    for image in (RED, BLUE):
        thumbnail = (
            f'<img src="data:image/png;base64,{b64(image)}" '
            f'alt="{image.reference}" title="{image.reference}">'
        )
        assert page.count(thumbnail) == 1
    assert "max-width: 160px" in page
    # The references are the rows' text as well, escaped as text.
    assert f"{QUESTION} {RED.reference}" in page


@needs_dot
def test_inspect_html_writes_the_thumbnails(
    log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "loop.html"
    assert main(["inspect", str(log), "--loop", "loop-1", "--html", str(out)]) == 0
    page = out.read_text()
    assert page.count('<img src="data:image/png;base64,') == 2
    assert f'alt="{BLUE.reference}"' in page
    no_bytes(capsys.readouterr().out)


def test_a_store_without_events_shows_the_tool_outputs_images(
    tmp_path: Path, anyio_backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "loops.db"
    anyio.run(lambda: fill_store(db, events=False), backend=anyio_backend)
    assert main(["inspect", str(db), "--loop", "loop-1"]) == 0
    shown = capsys.readouterr().out
    no_bytes(shown)
    [row] = [line for line in shown.splitlines() if "[c1]" in line]
    assert row.endswith(f"-> the screen {BLUE.reference}")

    if shutil.which("dot") is None:
        return
    out = tmp_path / "loop.html"
    assert main(["inspect", str(db), "--loop", "loop-1", "--html", str(out)]) == 0
    page = out.read_text()
    assert page.count(f'<img src="data:image/png;base64,{b64(BLUE)}"') == 1


# ------------------------------------------------------------------------ run


def _args(*argv: str) -> argparse.Namespace:
    """The parsed arguments of `agentfsm run ...`."""
    parser = argparse.ArgumentParser()
    run_command.add_parser(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    red, blue = tmp_path / "red.png", tmp_path / "blue.img"
    assert RED.data is not None
    assert BLUE.data is not None
    red.write_bytes(RED.data)
    blue.write_bytes(BLUE.data)  # the bytes say what it is, not its name
    return red, blue


async def test_run_sends_the_images_after_the_question(
    files: tuple[Path, Path],
) -> None:
    """`--image` twice: the message is the text, then the images in order,
    byte-equal; the tool's image is shown by its reference."""
    red, blue = files
    args = _args(QUESTION, "--model", "s:m", "--image", str(red), "--image", str(blue))
    sent: list[UserMessage] = []
    played = script()

    async def model(request: InferenceInput) -> InferenceOutput:
        sent.extend(i for i in request.context.items if isinstance(i, UserMessage))
        return await played.complete(request)

    out = io.StringIO()
    async with Runtime(providers={"s": FunctionProvider(model)}) as runtime:
        result = await _watch(runtime, args, _request(args, [screenshot]), out)
    assert result.outcome == "answered"
    assert sent[0].content == (TextBlock(text=QUESTION), RED, BLUE)
    assert [i.data for i in sent[0].images] == [RED.data, BLUE.data]
    shown = out.getvalue()
    assert re.search(
        rf"^  screenshot -> the screen {re.escape(BLUE.reference)} \(\d+ ms\)$",
        shown,
        re.MULTILINE,
    )
    no_bytes(shown)


def test_an_image_alone_is_a_message(files: tuple[Path, Path]) -> None:
    red, _ = files
    assert message_of(_args("", "--image", str(red))) == UserMessage(content=[RED])
    assert message_of(_args("hi")) == "hi"


async def test_a_model_that_takes_no_image_refuses_the_message_first(
    files: tuple[Path, Path],
) -> None:
    red, _ = files
    args = _args(QUESTION, "--model", "s:m", "--image", str(red))
    asked: list[InferenceInput] = []

    class Blind(FunctionProvider):
        """A text-only model."""

        __slots__ = ()

        def image_support(self, model: str) -> ImageSupport:
            return NO_IMAGES

    def model(request: InferenceInput) -> InferenceOutput:
        asked.append(request)
        return text("I see nothing")

    async with Runtime(providers={"s": Blind(model)}) as runtime:
        with pytest.raises(ImageNotSupported, match="s:m") as raised:
            await _watch(runtime, args, _request(args, []), io.StringIO())
    assert RED.reference in raised.value.block
    assert asked == []


def _bad_files(tmp_path: Path) -> list[tuple[Path, str]]:
    text_file = tmp_path / "notes.png"
    text_file.write_text("hello, not a picture")
    bmp = tmp_path / "old.bmp"
    bmp.write_bytes(b"BM" + bytes(60))
    huge = tmp_path / "huge.png"
    with huge.open("wb") as file:  # sparse: no 20 MiB written
        file.write(b"\x89PNG\r\n\x1a\n")
        file.truncate(MAX_IMAGE_BYTES + 1)
    return [
        (
            text_file,
            (
                "not an image: the data is bytes that are no PNG, JPEG, GIF or "
                "WebP image (starting 68 65 6c 6c)"
            ),
        ),
        (bmp, "not an image: the data is bytes that are no PNG"),
        (huge, f"has {MAX_IMAGE_BYTES + 1:,} bytes, more than MAX_IMAGE_BYTES"),
        (tmp_path / "missing.png", "cannot be read: No such file or directory"),
        (tmp_path, "cannot be read: Is a directory"),
    ]


def test_a_bad_image_file_exits_2_naming_it_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path, why in _bad_files(tmp_path):
        with pytest.raises(SystemExit) as exited:
            # An unknown prefix would fail the run: the image fails it first.
            main(["run", QUESTION, "--model", "nope:x", "--image", str(path)])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --image: {path}" in err or f"'{path}'" in err, err
        assert why in err, err
        assert "nope" not in err


# ------------------------------------------------------------------------- ui


async def test_the_ui_reads_images_by_reference(db: Path) -> None:
    async with client(db) as http:
        answer = await http.get("/api/loops/loop-1", headers=AUTH)
    assert answer.status_code == 200
    no_bytes(answer.text)
    page = answer.json()
    reference = {
        "type": "image",
        "data": None,
        "media_type": "image/png",
        "url": None,
        "digest": RED.digest,
        "size": RED.size,
    }
    assert page["items"][0]["content"] == [
        {"type": "text", "text": QUESTION},
        reference,
    ]
    [output] = [i for i in page["items"] if i["type"] == "function_call_output"]
    assert [i["digest"] for i in output["images"]] == [BLUE.digest]
    assert page["ledger"][0]["output"]["images"][0]["data"] is None
    rows = {row["kind"]: row["images"] for row in page["rows"] if row["images"]}
    assert rows == {"started": [reference], "tool": [output["images"][0]]}


async def test_the_ui_serves_an_images_bytes_by_digest(db: Path) -> None:
    async with client(db) as http:
        for digest in (RED.digest, "sha256%3A" + str(BLUE.digest)[7:]):
            got = await http.get(f"/api/loops/loop-1/images/{digest}", headers=AUTH)
            assert got.status_code == 200, got.text
            expected = RED if digest == RED.digest else BLUE
            assert got.content == expected.data
            assert got.headers["content-type"] == "image/png"
            assert got.headers["x-content-type-options"] == "nosniff"
            assert got.headers["content-security-policy"] == (
                "default-src 'none'; sandbox"
            )
            assert got.headers["cache-control"] == "no-store"

        unknown = "sha256:" + hashlib.sha256(b"never sent").hexdigest()
        for path in (
            f"/api/loops/loop-1/images/{unknown}",
            f"/api/loops/loop-2/images/{RED.digest}",  # another loop's image
            f"/api/loops/loop-9/images/{RED.digest}",  # no such loop
        ):
            missing = await http.get(path, headers=AUTH)
            assert missing.status_code == 404, path
            assert "error" in missing.json()
            no_bytes(missing.text)
        refused = await http.get(f"/api/loops/loop-1/images/{RED.digest}")
        assert refused.status_code == 401
        # An id whose own text ends like an image's address is that loop's id.
        encoded = f"/api/loops/loop-1%2Fimages%2F{RED.digest}"
        assert (await http.get(encoded, headers=AUTH)).status_code == 404


async def test_a_paused_messages_text_is_rewritten_and_its_images_kept(
    tmp_path: Path,
) -> None:
    """Paused before its message enters the context, a loop offers the
    message's text; the text given replaces it, the image stays; every read
    of the page and of its requests holds the image by reference."""
    from agentfsm.breakpoints import Break
    from tests.test_ui_actions import AUTH as ACTING
    from tests.test_ui_actions import mounted, stored_as, url

    store = SQLiteStore(tmp_path / "loops.db", events=True)
    sent: list[UserMessage] = []

    def model(request: InferenceInput) -> InferenceOutput:
        sent.extend(i for i in request.context.items if isinstance(i, UserMessage))
        return text("red")

    async with (
        Runtime(
            providers={"s": FunctionProvider(model)},
            store=store,
            ids=counter_ids(),
            requests=3600.0,
            breakpoints=[Break("context_update")],
        ) as runtime,
        mounted(runtime) as (http, form),
    ):
        request = InferenceInput(model="s:m", context=ModelContext())
        loop_id = runtime.run_loop("looker", message(), request)
        record = await stored_as(store, loop_id, LoopStatus.paused)
        page = await http.get(f"/api/loops/{loop_id}", headers=ACTING)
        no_bytes(page.text)
        offered = page.json()["actions"]["resume"]
        assert offered["text"] == {"of": "user_message", "content": QUESTION}
        body = {
            "kind": "resume",
            "seq": record.pause.seq,
            "decision": "text",
            "text": "what colour is it?",
        }
        stored = await http.post(url(loop_id), json=body, headers=form)
        assert stored.status_code == 202, stored.text
        no_bytes(stored.text)
        with anyio.fail_after(30):
            result = await runtime.wait(loop_id)
        listed = await http.get(url(loop_id), headers=ACTING)
        no_bytes(listed.text)
    assert result.outcome == "answered"
    assert sent[0].content == (TextBlock(text="what colour is it?"), RED)
    assert sent[0].images[0].data == RED.data
    # The request refers to the image; the runtime took its bytes from the
    # paused message (the requests table holds no copy of them).
    import base64
    import sqlite3

    decisions = sqlite3.connect(tmp_path / "loops.db").execute(
        "select decision from requests"
    )
    (decision,) = [row[0] for row in decisions]
    assert RED.digest in decision
    assert base64.b64encode(RED.data or b"").decode() not in decision


# ----------------------------------------------------------------------- otel


def _attributes(traces: Any) -> list[dict[str, Any]]:
    """Every attribute of every span and span event, as dicts."""
    found = []
    for span in traces.spans:
        found.append(dict(span.attributes or {}))
        found.extend(dict(e.attributes or {}) for e in span.events)
    return found


@pytest.mark.parametrize("capture", [True, False], ids=["capture", "no-capture"])
async def test_spans_hold_references_never_bytes(capture: bool) -> None:
    from tests.test_otel import Traces

    traces = Traces()
    try:
        async with Runtime(
            providers={"s": script()},
            extensions=[traces.instrument(capture_content=capture)],
        ) as runtime:
            await one_loop(runtime)
        every = json.dumps(_attributes(traces), default=str)
        no_bytes(every)
        if not capture:
            assert str(RED.digest) not in every
            assert str(BLUE.digest) not in every
            return
        red = {
            "type": "file",
            "modality": "image",
            "mime_type": "image/png",
            "file_id": RED.digest,
            "size": RED.size,
        }
        blue = {**red, "file_id": BLUE.digest, "size": BLUE.size}
        started = json.loads(
            str(traces.one("invoke_agent looker").attributes["gen_ai.input.messages"])  # type: ignore[index]
        )
        assert started == [
            {"role": "user", "parts": [{"type": "text", "content": QUESTION}, red]}
        ]
        chats = traces.named("chat")
        last = json.loads(str(chats[-1].attributes["gen_ai.input.messages"]))  # type: ignore[index]
        assert last[0]["parts"][1] == red
        assert last[-1] == {
            "role": "tool",
            "parts": [
                {"type": "tool_call_response", "id": "c1", "response": "the screen"},
                blue,
            ],
        }
        executed = traces.one("execute_tool screenshot").attributes
        assert executed is not None
        assert json.loads(str(executed["agentfsm.tool.call.images"])) == [blue]
        assert executed["gen_ai.tool.call.result"] == "the screen"
    finally:
        traces.provider.shutdown()


# -------------------------------------------------------------------- browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def ui_server(tmp_path: Path) -> Iterator[str]:
    """`agentfsm ui` over a store holding the loop with images (filled before
    the test starts Playwright, whose event loop runs in this thread)."""
    db = tmp_path / "loops.db"
    anyio.run(lambda: fill_store(db, events=True))
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
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        process.terminate()
        process.communicate(timeout=30)


@pytest.mark.e2e
@pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("AGENTFSM_REQUIRE_CHROMIUM") != "1",
    reason="chromium is not installed (apt-get install chromium)",
)
def test_a_thumbnail_renders_in_the_page(ui_server: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    from tests.test_ui_browser import ARGS

    assert CHROMIUM is not None
    hosts: set[str] = set()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page()
            page.on("request", lambda r: hosts.add(urlsplit(r.url).netloc or r.url))
            page.goto(f"{ui_server}/loop/loop-1?token={TOKEN}")
            expect(page.locator("body")).to_have_attribute(
                "data-status", "done", timeout=30_000
            )
            thumbnail = page.locator("#items li.user_message img")
            expect(thumbnail).to_have_count(1)
            thumbnail.scroll_into_view_if_needed()  # loading=lazy
            expect(thumbnail).to_have_attribute("alt", RED.reference)
            page.wait_for_function(
                "img => img.complete && img.naturalWidth > 0",
                arg=thumbnail.element_handle(),
                timeout=30_000,
            )
            assert thumbnail.evaluate(
                "img => [img.naturalWidth, img.naturalHeight]"
            ) == [24, 16]
            link = page.locator("#items li.user_message a.thumb")
            assert str(link.get_attribute("href")).endswith(
                f"/images/sha256%3A{str(RED.digest)[7:]}"
            )
            # The tool's image, in the context and the ledger.
            expect(page.locator(f'img[alt="{BLUE.reference}"]')).to_have_count(3)
            assert hosts == {urlsplit(ui_server).netloc}
        finally:
            browser.close()
