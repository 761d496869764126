"""`agentfsm ui`: a local, live view of the loops a durable store holds
(`pip install 'agentfsm[ui]'`).

```sh
agentfsm ui loops.db                      # a SQLite store
agentfsm ui postgresql://app@db/app       # a PostgreSQL store
```

It serves on 127.0.0.1 with a random access token in the URL it prints,
reads the store only (the processes that run the loops write it), and
updates each page as the loops move: the loops with their status, state,
owner and why they wait; one loop's path drawn over the machine, its
timeline (every interception decision a row), its tool-call ledger, its
decisions and its context. Everything it serves ships in the package:
nothing is fetched from anywhere else.

To mount it inside a service of your own, beside a runtime with a durable
store: `app.mount("/agentfsm", agentfsm.ui.app(runtime))`.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

try:
    import sse_starlette  # noqa: F401 - only to say which extra is missing
    import starlette  # noqa: F401
except ImportError as exc:
    raise ImportError(
        "agentfsm.ui needs Starlette: pip install 'agentfsm[ui]'"
    ) from exc

from agentfsm._runtime.runtime import Runtime
from agentfsm.exceptions import ConfigurationError
from agentfsm.store._sql import SQLStore

from ._app import build_app

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from agentfsm.store import LoopStore

__all__ = ("app", "new_token")


def new_token() -> str:
    """A random access token (as `agentfsm ui` makes one per start)."""
    return secrets.token_urlsafe(24)


def app(
    source: Runtime | LoopStore,
    *,
    token: str | None = None,
    poll: float = 0.2,
) -> Starlette:
    """The UI as an ASGI app, over a runtime's durable store or a store.

    Args:
        source: a `Runtime` made with a `SQLiteStore` or `PostgresStore` (the
            runtime opens and closes it), or such a store (the app opens it
            at its startup and closes it at its shutdown).
        token: the access token every request must carry: 16 or more
            printable ASCII characters, no space (default: a new random one:
            read it back as `app.state.token`).
        poll: how often, in seconds, each open page's stream reads the store.

    Raises:
        ConfigurationError: the source keeps no loops the UI can list (a
            runtime without a store, the memory store), or `poll` is not a
            positive number.
        ValueError: the token is too short or holds a character other than
            printable ASCII.
    """
    owns = not isinstance(source, Runtime)
    store: Any = source.store if isinstance(source, Runtime) else source
    if not isinstance(store, SQLStore):
        what = (
            "a runtime without a durable store"
            if store is None
            else type(store).__name__
        )
        raise ConfigurationError(
            f"agentfsm.ui reads a SQLiteStore or a PostgresStore, got {what}"
        )
    if type(poll) not in (int, float) or poll <= 0:
        raise ConfigurationError(
            f"poll must be a positive number of seconds, got {poll!r}"
        )
    token = token if token is not None else new_token()
    built = build_app(store, token=token, poll=float(poll), owns_store=owns)
    built.state.token = token
    return built
