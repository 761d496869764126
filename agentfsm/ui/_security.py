"""Who may use the UI, and what its pages may do.

- A token on every request: the URL `agentfsm ui` prints carries it once
  (`?token=`), the answer puts it in an HttpOnly, SameSite=Strict cookie and
  sends the browser on without it (so it stays out of the address bar and
  of the history); a program may send `Authorization: Bearer <token>`.
- Headers on every answer: a content security policy that allows scripts,
  styles, images and connections from the UI's own origin only (no inline
  script, so text from a model that slips into the page as markup runs
  nothing), no framing, no referrer, no MIME sniffing.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final
from urllib.parse import parse_qsl, urlencode

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ("CSP", "Guard")

CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)

_HEADERS: Final = (
    ("content-security-policy", CSP),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
    ("x-frame-options", "DENY"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
)

_REFUSED: Final = (
    b"agentfsm ui: this address needs the access token: open the URL "
    b"`agentfsm ui` printed (it ends in ?token=...)\n"
)


class Guard:
    """The token check and the headers, as ASGI middleware (`middleware`)."""

    def __init__(self, token: str) -> None:
        if not token or not token.isascii() or len(token) < 16:
            raise ValueError("the UI's token must be at least 16 ASCII characters")
        self.token = token
        # One cookie per token: two UIs on one host (different ports share
        # cookies) keep theirs apart.
        digest = hashlib.sha256(token.encode()).hexdigest()[:12]
        self.cookie = f"agentfsm_ui_{digest}"

    def middleware(self, app: ASGIApp) -> ASGIApp:
        guard = self

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            with_headers = _with_headers(send)
            query = scope.get("query_string", b"").decode("latin-1")
            pairs = parse_qsl(query, keep_blank_values=True)
            given = [v for k, v in pairs if k == "token"]
            if given:
                await guard._enter(scope, pairs, given[-1], with_headers)
                return
            if not guard._allowed(scope):
                await _answer(with_headers, 401, _REFUSED)
                return
            await app(scope, receive, with_headers)

        return guarded

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and self._is_token(given.strip()):
                    return True
            elif name == b"cookie":
                for part in value.decode("latin-1").split(";"):
                    key, _, given = part.strip().partition("=")
                    if key == self.cookie and self._is_token(given):
                        return True
        return False

    def _is_token(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self.token.encode())

    async def _enter(
        self, scope: Scope, pairs: list[tuple[str, str]], given: str, send: Send
    ) -> None:
        """A request carrying `?token=`: the right one sets the cookie and
        goes on to the same address without it; a wrong one is refused."""
        if not self._is_token(given):
            await _answer(send, 401, _REFUSED)
            return
        rest = urlencode([(k, v) for k, v in pairs if k != "token"])
        raw = scope.get("raw_path") or scope["path"].encode("utf-8")
        path = scope.get("root_path", "") + raw.decode("latin-1")
        location = path + (f"?{rest}" if rest else "")
        cookie = f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict"
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", location.encode("latin-1", "replace")),
                    (b"set-cookie", cookie.encode()),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})


def _with_headers(send: Send) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            for name, value in _HEADERS:
                headers.setdefault(name, value)
        await send(message)

    return sending


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
