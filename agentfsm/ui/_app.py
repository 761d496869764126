"""The UI's ASGI app: its pages, its JSON reads and its live streams.

```
GET /                          the loops (static page; loops.js draws it)
GET /loop/{loop_id}            one loop (static page; loop.js draws it)
GET /api/loops                 the loops list as JSON (?status=&agent=)
GET /api/loops/{loop_id}       one loop's page as JSON (?after=&items=)
GET /api/stream/loops          server-sent events: the list, each time it changes
GET /api/stream/loops/{id}     server-sent events: what the loop's page lacks,
                               each time the loop changes; each event's id is
                               `<seq>:<items>`, so a reconnecting EventSource
                               (Last-Event-ID) resumes with no gap
```

The store is polled (every `poll` seconds, per open stream): a SQLite store
written by another process says nothing when it changes, and polling one
indexed read is cheap.
"""

from __future__ import annotations

import contextlib
import html
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from agentfsm.results import LoopStatus
from agentfsm.store._sql import SQLStore

from ._security import Guard
from ._source import StoreSource

__all__ = ("build_app",)

STATIC: Final = Path(__file__).parent / "static"

_PAGES: Final = {
    name: (STATIC / f"{name}.html").read_text(encoding="utf-8")
    for name in ("index", "loop")
}
"""The two pages, with `{{root}}` (where the app is mounted) and `{{loop}}`
(the loop's id) to fill in, escaped."""

_REFRESH: Final = 5.0
"""Seconds after which the loops list is read whole even if the store's
change mark says nothing moved (lease lapses, ages)."""

_STATUSES: Final = frozenset(s.value for s in LoopStatus)


def build_app(
    store: SQLStore[Any],
    *,
    token: str,
    poll: float = 0.2,
    owns_store: bool = True,
) -> Starlette:
    """The UI over `store`; `owns_store`: the app opens and closes it (the
    standalone server), else its runtime does (an app mounted beside one)."""
    source = StoreSource(store)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if owns_store:
            async with store:
                yield
        else:
            yield

    async def page(request: Request) -> Response:
        loop_id = request.path_params.get("loop_id")
        template = _PAGES["index" if loop_id is None else "loop"]
        root = html.escape(request.scope.get("root_path", ""), quote=True)
        text = template.replace("{{root}}", root).replace(
            "{{loop}}", html.escape(loop_id or "", quote=True)
        )
        return HTMLResponse(text, headers={"cache-control": "no-store"})

    async def loops(request: Request) -> Response:
        status, agent = _filters(request)
        return _json(await source.loops(status, agent))

    async def loop(request: Request) -> Response:
        loop_id = request.path_params["loop_id"]
        after, items = _marks(request)
        found = await source.loop(loop_id, after=after, items=items)
        if found is None:
            return _json({"error": f"the store holds no loop {loop_id!r}"}, 404)
        return _json(found.data)

    async def stream_loops(request: Request) -> Response:
        status, agent = _filters(request)

        async def changes() -> AsyncIterator[ServerSentEvent]:
            last = None
            mark: tuple[Any, ...] | None = None
            read_at = 0.0
            while True:
                # Read whole when the store moved, and now and then anyway
                # (leases lapse and ages grow without a write).
                seen, now = await source.mark(), time.monotonic()
                if seen != mark or now - read_at >= _REFRESH:
                    mark, read_at = seen, now
                    data = await source.loops(status, agent)
                    stamp = data.pop("now")
                    text = json.dumps(data, sort_keys=True)
                    if text != last:
                        last = text
                        data["now"] = stamp
                        yield ServerSentEvent(json.dumps(data), event="loops")
                await anyio.sleep(poll)

        return _events(changes())

    async def stream_loop(request: Request) -> Response:
        loop_id = request.path_params["loop_id"]
        after, items = _marks(request)
        resumed = request.headers.get("last-event-id")
        if resumed:
            after, items = _resume_marks(resumed, after, items)

        async def changes() -> AsyncIterator[ServerSentEvent]:
            nonlocal after, items
            version: tuple[int, str] | None = None
            missing = False
            mark: tuple[Any, ...] | None = None
            while True:
                seen = await source.mark(loop_id)
                if seen == mark and seen:
                    await anyio.sleep(poll)
                    continue
                mark = seen
                found = await source.loop(loop_id, after=after, items=items)
                if found is None:
                    # Said once; a loop whose first commit has not landed yet
                    # (or a loop id from elsewhere) shows when it does.
                    if not missing:
                        missing = True
                        error = f"the store holds no loop {loop_id!r} (yet)"
                        yield ServerSentEvent(
                            json.dumps({"error": error}), event="missing"
                        )
                elif (
                    found.version != version or found.seq > after or found.items > items
                ):
                    version = found.version
                    after = max(after, found.seq)
                    items = found.items
                    yield ServerSentEvent(
                        json.dumps(found.data), event="loop", id=f"{after}:{items}"
                    )
                await anyio.sleep(poll)

        return _events(changes())

    guard = Guard(token)
    app = Starlette(
        routes=[
            Route("/", page),
            Route("/loop/{loop_id:path}", page),
            Route("/api/loops", loops),
            Route("/api/loops/{loop_id:path}", loop),
            Route("/api/stream/loops", stream_loops),
            Route("/api/stream/loops/{loop_id:path}", stream_loop),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        lifespan=lifespan,
        exception_handlers={_BadRequest: _bad_request},
    )
    app.add_middleware(guard.middleware)
    return app


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
    if not text.isdigit() or len(text) > 18:
        raise _BadRequest(f"{name} must be a count (0 or more), got {text!r}")
    return int(text)


def _resume_marks(text: str, after: int, items: int) -> tuple[int, int]:
    """The marks of a stream's last event id (`<seq>:<items>`), as its
    EventSource sends it when it reconnects; an id that is not one is ignored
    (the stream starts from the query's marks)."""
    seq, _, count = text.partition(":")
    if seq.isdigit() and count.isdigit() and len(text) < 40:
        return int(seq), int(count)
    return after, items


class _BadRequest(Exception):
    """A query parameter that is not what its route takes (answered 400)."""


async def _bad_request(request: Request, exc: Exception) -> Response:
    return _json({"error": str(exc)}, 400)
