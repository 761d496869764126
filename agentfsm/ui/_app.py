"""The UI's ASGI app: its pages, its JSON reads and its live streams.

```
GET /                          the loops (static page; loops.js draws it)
GET /loop/{loop_id}            one loop (static page; loop.js draws it)
GET /api/loops                 the loops list as JSON (?status=&agent=)
GET /api/loops/{loop_id}       one loop's page as JSON (?after=&items=)
GET /api/loops/{id}/requests   the loop's requests (the decision inbox)
GET /api/loops/{id}/images/sha256:<hex>
                               the bytes of an image the loop holds (its
                               pages show images by reference, this by digest)
POST /api/loops/{id}/requests  act on the loop: store a request (202), which
                               the runtime holding the loop applies
POST /api/loops/{id}/replay    replay the ended loop from its recording: its
                               first divergence, or none (see `_replays`)
GET /api/breakpoints           the active stored breakpoints (?loop=&agent=)
POST /api/breakpoints          set one (201): {"loop_id"|"agent_id", "state"|"every"}
DELETE /api/breakpoints/{id}   remove one (200; 404: no active one of that id)
GET /api/stream/loops          server-sent events: the list, each time it changes
GET /api/stream/loops/{id}     server-sent events: what the loop's page lacks,
                               each time the loop changes; each event's id is
                               `<seq>:<items>`, so a reconnecting EventSource
                               (Last-Event-ID) resumes with no gap
```

A loop id is one percent-encoded segment (it may hold any character, a `/`
or a newline among them), or, for `.` and `..`, which URLs resolve away as
dot segments, `?id=` after the route's `/` (`/loop/?id=..`,
`/api/loops//requests?id=..`). A loop's requests are the literal tail
`/requests` after its id's segment: an id ending in `/requests` is written
`%2Frequests` (`raw_path` tells the two apart); so is an image's tail.

The store is polled (every `poll` seconds, per open stream): a SQLite store
written by another process says nothing when it changes, and polling one
indexed read is cheap. A store that cannot be read is answered 503 with
JSON naming why; a stream says it as a `store-error` event and goes on
polling, so that a page shows the cause and recovers with the store.
"""

from __future__ import annotations

import contextlib
import html
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from agentfsm.exceptions import StoreError
from agentfsm.results import LoopStatus
from agentfsm.store import SQLStore

from ._actions import MAX_BODY, ActionError, Actions
from ._breaks import Breaks
from ._replays import Replays
from ._security import Guard
from ._source import StoreSource, data_of

__all__ = ("build_app",)

STATIC: Final = Path(__file__).parent / "static"

_PAGES: Final = {
    name: (STATIC / f"{name}.html").read_text(encoding="utf-8")
    for name in ("index", "loop")
}
"""The two pages, with `{{root}}` (where the app is mounted, escaped),
`{{loop}}` (the loop's id, percent-encoded: an HTML parser would turn a NUL
or a CR in an attribute into another character) and `{{form}}` (the form
token a request that acts carries: hex digits) to fill in."""

_REQUESTS: Final = "/requests"
"""The tail of a loop's address that names its requests."""

_REPLAY: Final = "/replay"
"""The tail of a loop's address that replays it."""

_IMAGE: Final = re.compile(r"(.*)/images/(sha256:[0-9a-f]{64})", re.DOTALL)
"""A loop's address that names one of its images, by digest."""

_IMAGE_RAW: Final = re.compile(rb"/images/sha256(?::|%3[aA])[0-9a-f]{64}\Z")
"""The same tail as the raw path has it (a page may percent-encode the `:`)."""

_IMAGE_CSP: Final = "default-src 'none'; sandbox"
"""An image opened by itself runs nothing and loads nothing."""

_REFRESH: Final = 5.0
"""Seconds after which the loops list is read whole even if the store's
change mark says nothing moved (lease lapses, ages)."""

_STATUSES: Final = frozenset(s.value for s in LoopStatus)

_COUNT: Final = re.compile(r"[0-9]{1,18}")
"""A count as a query or an event id gives it: ASCII digits only (`str.isdigit`
takes `²`, which `int` refuses), few enough to be an int64."""


class _App(Starlette):
    """Starlette with the guard outside everything, its error answers too."""

    def __init__(self, guard: Guard, **options: Any) -> None:
        self._guard = guard
        super().__init__(**options)

    def build_middleware_stack(self) -> ASGIApp:
        return self._guard.middleware(super().build_middleware_stack())


def build_app(
    store: SQLStore[Any],
    *,
    token: str,
    actions: Actions,
    poll: float = 0.2,
    owns_store: bool = True,
    replays: Replays | None = None,
) -> Starlette:
    """The UI over `store`; `owns_store`: the app opens and closes it (the
    standalone server), else its runtime does (an app mounted beside one);
    `actions`: what a person may do, and where requests are written;
    `replays`: how a loop is replayed (default: with no handlers)."""
    source = StoreSource(store, actions)
    replaying = replays if replays is not None else Replays(store)
    guard = Guard(token)
    breaks = Breaks(actions)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            if owns_store:
                async with store:
                    yield
            else:
                yield
        finally:
            with anyio.CancelScope(shield=True):
                await actions.close()

    async def page(request: Request) -> Response:
        one = "loop_id" in request.path_params
        template = _PAGES["loop" if one else "index"]
        root = html.escape(request.scope.get("root_path", ""), quote=True)
        loop_id = _loop_id(request) if one else ""
        text = (
            template.replace("{{root}}", root)
            .replace("{{loop}}", quote(loop_id, safe="", errors="replace"))
            .replace("{{form}}", guard.form)
        )
        return HTMLResponse(text, headers={"cache-control": "no-store"})

    async def loops(request: Request) -> Response:
        status, agent = _filters(request)
        return _json(await source.loops(status, agent))

    async def loop_or_requests(request: Request) -> Response:
        imaged = _image_of(request)
        if imaged is not None and request.method != "POST":
            loop_id, digest = imaged
            block = await source.image(loop_id, digest)
            if block is None or block.data is None:
                error = f"the loop {loop_id!r} holds no image {digest}"
                return _json({"error": error}, 404)
            return Response(
                block.data,
                media_type=block.media_type,
                headers={
                    # Images are the loop's content: kept out of the disk
                    # cache, as every answer of the UI is.
                    "cache-control": "no-store",
                    "content-security-policy": _IMAGE_CSP,
                    "x-content-type-options": "nosniff",
                },
            )
        replayed = _tailed(request, _REPLAY)
        if replayed is not None:
            if request.method != "POST":
                error = "a replay is asked with POST (it runs the loop again)"
                return _json({"error": error}, 405)
            return _json(await replaying.replay(replayed))
        asking = _tailed(request, _REQUESTS)
        if asking is not None:
            if request.method == "POST":
                stored = await actions.submit(asking, await _limited_body(request))
                return _json(data_of(stored), 202)
            asked = await actions.requests(asking)
            return _json({"requests": [data_of(r) for r in asked]})
        if request.method == "POST":
            error = "a loop's address takes no POST: act through its /requests"
            return _json({"error": error}, 405)
        loop_id = _loop_id(request)
        after, items = _marks(request)
        found = await source.loop(loop_id, after=after, items=items)
        if found is None:
            return _json({"error": f"the store holds no loop {loop_id!r}"}, 404)
        return _json(found.data)

    async def breakpoints(request: Request) -> Response:
        if request.method == "POST":
            made = await breaks.add(await _limited_body(request))
            return _json(made.model_dump(mode="json"), 201)
        loop_id = request.query_params.get("loop") or None
        agent_id = request.query_params.get("agent") or None
        found = await breaks.active(loop_id, agent_id)
        return _json({"breakpoints": [b.model_dump(mode="json") for b in found]})

    async def breakpoint_removed(request: Request) -> Response:
        removed = await breaks.remove(request.path_params["breakpoint_id"])
        return _json(removed.model_dump(mode="json"))

    async def stream_loops(request: Request) -> Response:
        status, agent = _filters(request)

        async def changes() -> AsyncIterator[ServerSentEvent]:
            last = None
            mark: tuple[Any, ...] | None = None
            read_at = 0.0
            due: float | None = None
            failed = _Failed()
            while True:
                try:
                    # Read whole when the store moved, when a lease shown live
                    # has lapsed, and now and then anyway (ages grow without
                    # a write).
                    seen, now = await source.mark(), time.monotonic()
                    if seen != mark or now - read_at >= _REFRESH or _past(due):
                        mark, read_at = seen, now
                        data = await source.loops(status, agent)
                        due = _lease_due(data["loops"])
                        stamp = data.pop("now")
                        text = json.dumps(data, sort_keys=True)
                        if text != last:
                            last = text
                            data["now"] = stamp
                            yield ServerSentEvent(json.dumps(data), event="loops")
                    failed.clear()
                except StoreError as exc:
                    last = mark = None  # sent whole once the store answers
                    if said := failed.news(exc):
                        yield said
                await anyio.sleep(poll)

        return _events(changes())

    async def stream_loop(request: Request) -> Response:
        loop_id = _loop_id(request)
        after, items = _marks(request)
        resumed = request.headers.get("last-event-id")
        if resumed:
            after, items = _resume_marks(resumed, after, items)

        async def changes() -> AsyncIterator[ServerSentEvent]:
            nonlocal after, items
            version: tuple[Any, ...] | None = None
            missing = False
            mark: tuple[Any, ...] | None = None
            due: float | None = None
            failed = _Failed()
            while True:
                try:
                    # Read whole when the loop's mark moved (a commit, its
                    # owner), when the lease it showed live has lapsed (which
                    # writes nothing), and while the store holds no such loop.
                    seen = await source.mark(loop_id)
                    if seen != mark or not seen or _past(due):
                        mark = seen
                        found = await source.loop(loop_id, after=after, items=items)
                        if found is None:
                            # Said once; a loop whose first commit has not
                            # landed yet (or an id from elsewhere) shows when
                            # it does.
                            if not missing:
                                missing = True
                                error = f"the store holds no loop {loop_id!r} (yet)"
                                yield ServerSentEvent(
                                    json.dumps({"error": error}), event="missing"
                                )
                        else:
                            due = found.lease_due
                            if (
                                found.version != version
                                or found.seq > after
                                or found.items > items
                            ):
                                version = found.version
                                after = max(after, found.seq)
                                items = found.items
                                yield ServerSentEvent(
                                    json.dumps(found.data),
                                    event="loop",
                                    id=f"{after}:{items}",
                                )
                    failed.clear()
                except StoreError as exc:
                    # Everything is said again once the store answers.
                    version = mark = None
                    missing = False
                    if said := failed.news(exc):
                        yield said
                await anyio.sleep(poll)

        return _events(changes())

    app = _App(
        guard,
        routes=[
            Route("/", page),
            _any_id("/loop/{loop_id:path}", page),
            Route("/api/loops", loops),
            _any_id("/api/loops/{loop_id:path}", loop_or_requests, ["GET", "POST"]),
            Route("/api/breakpoints", breakpoints, methods=["GET", "POST"]),
            Route(
                "/api/breakpoints/{breakpoint_id:int}",
                breakpoint_removed,
                methods=["DELETE"],
            ),
            Route("/api/stream/loops", stream_loops),
            _any_id("/api/stream/loops/{loop_id:path}", stream_loop),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        lifespan=lifespan,
        exception_handlers={
            _BadRequest: _bad_request,
            ActionError: _refused,
            StoreError: _store_error,
            Exception: _unexpected,
        },
    )
    app.state.form_token = guard.form
    return app


def _any_id(
    path: str, endpoint: Callable[[Request], Any], methods: list[str] | None = None
) -> Route:
    """A route whose `{loop_id:path}` matches any loop id: Starlette's `.*`
    stops at a newline, which a loop id may hold."""
    route = Route(path, endpoint, methods=methods)
    route.path_regex = re.compile(route.path_regex.pattern, re.DOTALL)
    return route


def _loop_id(request: Request) -> str:
    """The loop a route names: its path's last part, or `?id=` after the
    route's `/` (for `.` and `..`, which no URL keeps as a segment)."""
    loop_id: str = request.path_params["loop_id"]
    return loop_id or request.query_params.get("id", "")


async def _limited_body(request: Request) -> bytes:
    """The request's body, refused past `MAX_BODY` bytes (before it is read
    when its length says so).

    Raises:
        ActionError: 413, the body is too big.
    """
    too_big = ActionError(413, f"the request's body is over {MAX_BODY} bytes", "body")
    length = request.headers.get("content-length", "")
    if _COUNT.fullmatch(length) and int(length) > MAX_BODY:
        raise too_big
    body = bytearray()
    async with contextlib.aclosing(request.stream()) as chunks:
        async for chunk in chunks:
            body += chunk
            if len(body) > MAX_BODY:
                raise too_big
    return bytes(body)


def _tailed(request: Request, tail: str) -> str | None:
    """The loop an `/api/loops/...` address names if it ends with the literal
    `tail` (`/requests`, `/replay`: as the raw path has it, where an id's own `/`
    is percent-encoded), else None."""
    loop_id: str = request.path_params["loop_id"]
    raw = request.scope.get("raw_path")
    if not loop_id.endswith(tail) or (
        isinstance(raw, bytes) and not raw.endswith(tail.encode())
    ):
        return None
    return loop_id[: -len(tail)] or request.query_params.get("id", "")


def _image_of(request: Request) -> tuple[str, str] | None:
    """The loop and the digest an `/api/loops/<id>/images/sha256:<hex>`
    address names (its `/images/` literal in the raw path, as `_tailed`
    reads a tail), else None."""
    found = _IMAGE.fullmatch(request.path_params["loop_id"])
    raw = request.scope.get("raw_path")
    if found is None or (isinstance(raw, bytes) and not _IMAGE_RAW.search(raw)):
        return None
    loop_id, digest = found.groups()
    return loop_id or request.query_params.get("id", ""), digest


def _past(due: float | None) -> bool:
    return due is not None and time.time() >= due


def _lease_due(loops: Iterable[dict[str, Any]]) -> float | None:
    """When the first lease shown live lapses (seconds since the epoch, as
    the store keeps leases), or None: none is live."""
    times = [
        datetime.fromisoformat(loop["lease_until"]).timestamp()
        for loop in loops
        if loop.get("lease_live") and loop.get("lease_until")
    ]
    return min(times, default=None)


class _Failed:
    """What a stream last said of a store that failed: an error is said once,
    and again only once it has changed or the store answered in between."""

    def __init__(self) -> None:
        self.said: str | None = None

    def news(self, exc: StoreError) -> ServerSentEvent | None:
        text = str(exc)
        if text == self.said:
            return None
        self.said = text
        return ServerSentEvent(json.dumps({"error": text}), event="store-error")

    def clear(self) -> None:
        self.said = None


def _json(data: Any, status: int = 200) -> Response:
    return JSONResponse(data, status_code=status, headers={"cache-control": "no-store"})


def _events(source: AsyncIterator[ServerSentEvent]) -> Response:
    return EventSourceResponse(source, ping=15, headers={"cache-control": "no-store"})


def _filters(request: Request) -> tuple[str | None, str | None]:
    status = request.query_params.get("status") or None
    agent = request.query_params.get("agent") or None
    if status is not None and status not in _STATUSES:
        raise _BadRequest(f"status must be one of {sorted(_STATUSES)}, got {status!r}")
    return status, agent


def _marks(request: Request) -> tuple[int, int]:
    return _count(request, "after"), _count(request, "items")


def _count(request: Request, name: str) -> int:
    text = request.query_params.get(name, "0")
    if not _COUNT.fullmatch(text):
        raise _BadRequest(f"{name} must be a count (0 or more), got {text!r}")
    return int(text)


def _resume_marks(text: str, after: int, items: int) -> tuple[int, int]:
    """The marks of a stream's last event id (`<seq>:<items>`), as its
    EventSource sends it when it reconnects; an id that is not one is ignored
    (the stream starts from the query's marks)."""
    seq, _, count = text.partition(":")
    if _COUNT.fullmatch(seq) and _COUNT.fullmatch(count):
        return int(seq), int(count)
    return after, items


class _BadRequest(Exception):
    """A query parameter that is not what its route takes (answered 400)."""


async def _bad_request(request: Request, exc: Exception) -> Response:
    return _json({"error": str(exc)}, 400)


async def _refused(request: Request, exc: Exception) -> Response:
    """A request to act that the UI refuses (see `ActionError`)."""
    assert isinstance(exc, ActionError)
    return _json(exc.data(), exc.status)


async def _store_error(request: Request, exc: Exception) -> Response:
    """A store that cannot be read (a loop's data unreadable, its file
    deleted, its connection lost): 503, saying why (the store's message)."""
    return _json({"error": str(exc)}, 503)


async def _unexpected(request: Request, exc: Exception) -> Response:
    """A bug: 500, as JSON (the server's log has the traceback)."""
    error = f"the UI failed ({type(exc).__name__}); its server's log says where"
    return _json({"error": error}, 500)
