"""An HTTP mock for the vendor SDKs: canned wire payloads, recorded requests.

The SDKs run for real; only their transport is replaced, so each test sees the
request body the SDK sent and the SDK parses the answer exactly as it would
parse the real API's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Self, cast

import anyio
import httpx2

from agentfsm import InferenceOutput

Answer = httpx2.Response | Callable[[httpx2.Request], httpx2.Response]


def json_response(body: dict[str, Any], status: int = 200) -> httpx2.Response:
    """A JSON answer."""
    return httpx2.Response(status, json=body)


def sse_response(
    events: Sequence[dict[str, Any]], *, named: bool = True, done: bool = False
) -> httpx2.Response:
    """A `text/event-stream` answer: one SSE event per payload.

    Args:
        events: the `data:` payloads, in order.
        named: write an `event:` line with each payload's `type` (the Responses
            and Messages APIs do; Chat Completions does not).
        done: end with `data: [DONE]` (Chat Completions does).
    """
    return httpx2.Response(
        200,
        headers={"content-type": "text/event-stream"},
        content=sse_bytes(events, named=named, done=done),
    )


def raw_of(output: InferenceOutput) -> dict[str, Any]:
    """An output's `raw_response`, which must be a JSON object."""
    raw = output.raw_response
    assert isinstance(raw, dict)
    return cast("dict[str, Any]", raw)


class HangingBody:
    """A streamed body that sends its first bytes and then never ends.

    A class rather than an async generator: an abandoned generator would be
    reported on trio when it is collected.
    """

    def __init__(self, first: bytes) -> None:
        self._first: bytes | None = first

    def __aiter__(self) -> HangingBody:
        return self

    async def __anext__(self) -> bytes:
        first, self._first = self._first, None
        if first is not None:
            return first
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


def sse_bytes(
    events: Sequence[dict[str, Any]], *, named: bool = True, done: bool = False
) -> bytes:
    """SSE text for the payloads (see `sse_response`)."""
    lines: list[str] = []
    for event in events:
        if named:
            lines.append(f"event: {event['type']}\n")
        lines.append(f"data: {json.dumps(event)}\n\n")
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def hanging_sse(
    events: Sequence[dict[str, Any]], *, named: bool = True
) -> httpx2.Response:
    """A `text/event-stream` answer sending `events`, then nothing, forever."""
    return httpx2.Response(
        200,
        headers={"content-type": "text/event-stream"},
        content=HangingBody(sse_bytes(events, named=named)),
    )


class MockAPI:
    """Serves queued answers in order and records every request.

    Use as `async with MockAPI(answer, ...) as api:`; `api.http` is the
    `httpx2.AsyncClient` to give the SDK client.
    """

    def __init__(self, *answers: Answer) -> None:
        self._answers = list(answers)
        self.requests: list[httpx2.Request] = []
        self.responses: list[httpx2.Response] = []
        """The answers served, in order (to check they were closed)."""
        self.http = httpx2.AsyncClient(transport=httpx2.MockTransport(self._handle))

    def _handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(request)
        assert self._answers, f"unexpected request: {request.method} {request.url}"
        answer = self._answers.pop(0)
        response = answer if isinstance(answer, httpx2.Response) else answer(request)
        self.responses.append(response)
        return response

    @property
    def bodies(self) -> list[dict[str, Any]]:
        """The JSON body of each request, in order."""
        return [json.loads(r.content) for r in self.requests]

    @property
    def body(self) -> dict[str, Any]:
        """The JSON body of the only request."""
        assert len(self.requests) == 1, f"{len(self.requests)} requests"
        return self.bodies[0]

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.http.aclose()
        assert not self._answers or exc_info[0] is not None, "answers left unserved"
