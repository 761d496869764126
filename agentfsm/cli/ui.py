"""`agentfsm ui`: serve the live view of a durable store's loops.

```sh
agentfsm ui loops.db                       # http://127.0.0.1:8765/?token=...
agentfsm ui postgresql://app@db/app --port 9000 --as alice
```

The store is read through a read-only handle, as `agentfsm loops` opens it;
what a person does from a page (approve, deny, cancel...) is stored as a
request in the decision inbox through a second, writable handle, opened at
the first such request and used for nothing else (`--read-only`: none, the
pages only show). Each request names `--as` (default: the OS user). The server
binds 127.0.0.1 unless `--host` names another address, which it does only
with `--allow-remote` (and says so): the token is then all that stands
between the network and what the loops said.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
import socket
import sys
from typing import Any

from agentfsm._text import printable
from agentfsm.exceptions import AgentFSMError
from agentfsm.store import SQLiteStore, SQLStore

from .loops import add_store_arguments, is_store_url, open_store, with_store

__all__ = ("add_parser", "run")

_DEFAULT_PORT = 8765

_TOKEN = re.compile(r"[A-Za-z0-9._~-]{16,}")
"""A token the printed URL carries as it is (RFC 3986's unreserved
characters): a `+`, `&`, `#` or `%` would read back as another token."""


def add_parser(commands: Any) -> None:
    """Register `ui` and its arguments."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "ui",
        help="serve a live view of a durable store's loops (a local web page)",
        description=(
            "Serve a live view of the loops a durable store holds, on "
            "127.0.0.1, with a random access token in the URL it prints. A "
            "person acts on a loop from its page: each action is stored as a "
            "request for the runtime holding the loop to apply (Runtime("
            "requests=True)); nothing else is written. Needs the ui extra: pip "
            "install 'agentfsm[ui]'. "
            "Exit 1: the store cannot be opened or the address cannot be bound; "
            "2: bad arguments."
        ),
    )
    add_store_arguments(parser)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1; another one needs "
        "--allow-remote)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=_DEFAULT_PORT,
        help=f"the port (default {_DEFAULT_PORT}; 0: any free port)",
    )
    parser.add_argument(
        "--token",
        help="the access token: 16 or more letters, digits, '-', '.', '_' or "
        "'~' (default: a new random one each start)",
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="listen on an address other machines can reach",
    )
    parser.add_argument(
        "--as",
        dest="user",
        metavar="NAME",
        help="who acts from the pages: each request (and the decision it makes) "
        "names them (default: the OS user)",
    )
    parser.add_argument(
        "--read-only",
        action="store_true",
        help="show only: no action is offered, and the store is never opened to write",
    )
    parser.add_argument(
        "--poll",
        type=float,
        default=0.2,
        help="seconds between two reads of the store per open page (default 0.2)",
    )
    parser.set_defaults(handler=run)


async def _loop_ids(store: SQLStore[Any]) -> list[str]:
    return await store.loop_ids()


def _writer(target: str, schema: str) -> SQLStore[Any]:
    """A writable handle of the store at `target`, for the requests a person
    submits (the app opens it at the first one)."""
    if is_store_url(target):
        from agentfsm.store.postgres import PostgresStore

        return PostgresStore(target, schema=schema)
    return SQLiteStore(target)


def _local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C)."""
    try:
        import uvicorn

        from agentfsm import ui
    except ImportError as exc:
        print(f"agentfsm ui: error: {exc}", file=sys.stderr)
        return 1
    if not _local(args.host) and not args.allow_remote:
        print(
            f"agentfsm ui: error: --host {args.host} can be reached from other "
            "machines: add --allow-remote if that is what you want",
            file=sys.stderr,
        )
        return 2
    if args.token is not None and not _TOKEN.fullmatch(args.token):
        print(
            "agentfsm ui: error: --token needs 16 characters or more, each an "
            "ASCII letter, a digit, '-', '.', '_' or '~' (it goes in a URL as "
            "it is)",
            file=sys.stderr,
        )
        return 2
    try:
        # Opened once here, so that a store that cannot be read is an error
        # now, not a server that starts and then fails.
        with_store(args.store, args.schema, _loop_ids)
        store = open_store(args.store, args.schema)
        writer = None if args.read_only else _writer(args.store, args.schema)
        app = ui.app(
            store, token=args.token, poll=args.poll, user=args.user, writer=writer
        )
    except (AgentFSMError, OSError) as exc:
        print(f"agentfsm ui: error: {printable(str(exc))}", file=sys.stderr)
        return 1
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        # Listening before the URL is printed: a browser (or a script) that
        # opens it at once waits in the backlog until the server takes it.
        sock.listen(128)
    except OSError as exc:
        sock.close()
        print(
            f"agentfsm ui: error: cannot listen on {args.host}:{args.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    port = sock.getsockname()[1]
    shown = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    if not _local(args.host):
        print(
            f"agentfsm ui: warning: listening on {args.host}, reachable from other "
            "machines; anyone with the token sees every loop",
            file=sys.stderr,
        )
    acts = "shows only" if args.read_only else f"acts as {printable(app.state.user)}"
    print(f"agentfsm ui: {shown}:{port} serves {printable(args.store)}; {acts}")
    print(f"open http://{shown}:{port}/?token={app.state.token}", flush=True)
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
