"""Who may use the UI, and what its pages may do.

- A token on every request: the URL `agentfsm ui` prints carries it once
  (`?token=`), the answer trades it for an HttpOnly, SameSite=Strict cookie
  and sends the browser on, to an address of this server, without it (so it
  stays out of the address bar and of the history); a program may send
  `Authorization: Bearer <token>`. The cookie holds a key derived from the
  token, not the token: cookies do not keep the ports of a host apart, so
  every other server of the host the browser visits is sent it.
- A form token on every request that acts (any method but GET and HEAD):
  an `X-AgentFSM-Form` header carrying an HMAC of the cookie's key, which
  the pages read from their `<meta name="agentfsm-form">` (a page of another
  origin cannot read it), and no `Origin` (nor `Sec-Fetch-Site`) naming
  another site: cookies do not keep the ports of a host apart, so the
  cookie alone would let any local page act.
- Headers on every answer, errors included (the guard wraps the whole app):
  a content security policy that allows scripts, styles, images and
  connections from the UI's own origin only (no inline script, so text from
  a model that slips into the page as markup runs nothing), no framing, no
  referrer, no MIME sniffing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from typing import Final
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ("CSP", "FORM_HEADER", "Guard")

FORM_HEADER: Final = "x-agentfsm-form"
"""The header a request that acts carries the form token in."""

_SAFE_METHODS: Final = frozenset({"GET", "HEAD"})

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


_PATH_SAFE: Final = "/!$&'()*+,;=:@"
"""What a path of the redirect keeps as it is (RFC 3986 pchar and `/`): the
rest, `%` and `\\` among them, is percent-encoded."""

_COOKIE_PATH: Final = re.compile(r"/[A-Za-z0-9._~!$&'()*+,=:@/%-]*")
"""A mount prefix the cookie's `Path` may name (no `;`, space or control)."""


class Guard:
    """The token check and the headers, as ASGI middleware (`middleware`)."""

    def __init__(self, token: str) -> None:
        if len(token) < 16 or not all("!" <= c <= "~" for c in token):
            raise ValueError(
                "the UI's token must be at least 16 ASCII characters, "
                "none a space or a control"
            )
        self.token = token
        # The cookie's value: a key of its own, so that the token (which
        # also opens the UI by URL or bearer header) never leaves in a cookie.
        self.key = hmac.new(
            token.encode(), b"agentfsm ui cookie", hashlib.sha256
        ).hexdigest()
        # What a request that acts carries besides the cookie: a page of this
        # origin reads it from its <meta>; a page of another origin (another
        # port of the host, whose requests the cookie follows) cannot.
        self.form = hmac.new(
            self.key.encode(), b"agentfsm ui form", hashlib.sha256
        ).hexdigest()

    def cookie(self, scope: Scope) -> str:
        """The cookie's name: one per port (two UIs on one host share their
        cookies, whatever their ports), so a UI started again on its port
        replaces its old cookie and one on another port keeps its own."""
        server = scope.get("server")
        if not server or server[1] is None:
            return "agentfsm_ui"  # a Unix socket: no port to tell apart
        return f"agentfsm_ui_{int(server[1])}"

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
            if scope.get("method", "GET") not in _SAFE_METHODS:
                refused = guard._forged(scope)
                if refused is not None:
                    body = json.dumps({"error": refused}).encode()
                    await _answer(with_headers, 403, body, b"application/json")
                    return
            await app(scope, receive, with_headers)

        return guarded

    def _allowed(self, scope: Scope) -> bool:
        cookie = self.cookie(scope)
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, given = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and self._is_token(given.strip()):
                    return True
            elif name == b"cookie":
                for part in value.decode("latin-1").split(";"):
                    key, _, given = part.strip().partition("=")
                    if key == cookie and _same(given, self.key):
                        return True
        return False

    def _forged(self, scope: Scope) -> str | None:
        """Why a request that acts is refused (None: it is not): no form
        token or a wrong one, or sent by a page of another origin."""
        headers = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
        }
        host = headers.get("host", "").lower()
        origin = headers.get("origin")
        if origin is not None and (not host or _netloc(origin) != host):
            return "refused: this request comes from a page of another origin"
        site = headers.get("sec-fetch-site")
        if site is not None and site != "same-origin":
            return f"refused: this request comes from another site ({site})"
        given = headers.get(FORM_HEADER)
        if given is None:
            return (
                "refused: a request that acts carries the page's form token in "
                'an X-AgentFSM-Form header (<meta name="agentfsm-form">)'
            )
        if not _same(given, self.form):
            return "refused: the form token is not this server's (reload the page)"
        return None

    def _is_token(self, given: str) -> bool:
        return _same(given, self.token)

    async def _enter(
        self, scope: Scope, pairs: list[tuple[str, str]], given: str, send: Send
    ) -> None:
        """A request carrying `?token=`: the right one sets the cookie and
        goes on to the same address without it; a wrong one is refused."""
        if not self._is_token(given):
            await _answer(send, 401, _REFUSED)
            return
        rest = urlencode([(k, v) for k, v in pairs if k != "token"])
        location = _same_path(scope) + (f"?{rest}" if rest else "")
        root = scope.get("root_path", "")
        where = root if _COOKIE_PATH.fullmatch(root) else "/"
        cookie = (
            f"{self.cookie(scope)}={self.key}; Path={where}; HttpOnly; SameSite=Strict"
        )
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", location.encode("ascii")),
                    (b"set-cookie", cookie.encode()),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})


def _netloc(url: str) -> str:
    """The host and port an `Origin` names (`""`: none, or not a URL)."""
    try:
        return urlsplit(url).netloc.lower()
    except ValueError:
        return ""


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode())


def _same_path(scope: Scope) -> str:
    """The address the request named, as a path of this server: the whole
    path (a mount's prefix once; Starlette and uvicorn keep it in `path`),
    percent-encoded, with one leading `/` (`//evil.com/` or `/\\evil.com/`
    would be another host to a browser)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if not path.startswith(root):
        path = root + path  # a server that leaves the prefix out of `path`
    encoded = quote(path, safe=_PATH_SAFE, errors="replace")
    return "/" + encoded.lstrip("/")


def _with_headers(send: Send) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            for name, value in _HEADERS:
                headers.setdefault(name, value)
        await send(message)

    return sending


async def _answer(
    send: Send, status: int, body: bytes, kind: bytes = b"text/plain; charset=utf-8"
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", kind),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
