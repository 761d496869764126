"""`agentfsm ui`: a local, live view of the loops a durable store holds
(`pip install 'agentfsm[ui]'`).

```sh
agentfsm ui loops.db                      # a SQLite store
agentfsm ui postgresql://app@db/app       # a PostgreSQL store
```

It serves on 127.0.0.1 with a random access token in the URL it prints,
reads the store (the processes that run the loops write it), and updates
each page as the loops move: the loops with their status, state, owner and
why they wait; one loop's path drawn over the machine, its timeline (every
interception decision a row), its tool-call ledger, its decisions and its
context. Everything it serves ships in the package: nothing is fetched from
anywhere else.

A person acts from a loop's page: approves, denies or edits each call a
paused loop waits on, settles a call whose outcome a crash left uncertain,
proceeds or aborts, cancels, forks a loop at a seq (with another model, say),
replays an ended loop from its recording to see where it first diverges. Each action is stored as a request in the
loop's store (the decision inbox, `agentfsm.store.Requests`), naming the
UI's user; the runtime that holds the loop (`Runtime(requests=True)`)
applies it, once.

To mount it inside a service of your own, beside a runtime with a durable
store: `app.mount("/agentfsm", agentfsm.ui.app(runtime))`.
"""

from __future__ import annotations

import getpass
import secrets
from typing import TYPE_CHECKING, Any

try:
    import sse_starlette  # noqa: F401 - only to say which extra is missing
    import starlette  # noqa: F401
except ImportError as exc:
    raise ImportError(
        "agentfsm.ui needs Starlette: pip install 'agentfsm[ui]'"
    ) from exc

from agentfsm._logging import get_logger
from agentfsm._runtime.runtime import Runtime, bound_callables
from agentfsm.exceptions import ConfigurationError
from agentfsm.store import SQLStore

from ._actions import Actions
from ._app import build_app
from ._replays import Replays

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from agentfsm.store import LoopStore

__all__ = ("app", "new_token")

_log = get_logger()


def new_token() -> str:
    """A random access token (as `agentfsm ui` makes one per start)."""
    return secrets.token_urlsafe(24)


def app(
    source: Runtime | LoopStore,
    *,
    token: str | None = None,
    poll: float = 0.2,
    user: str | None = None,
    writer: LoopStore | None = None,
    replay_timeout: float = 60.0,
) -> Starlette:
    """The UI as an ASGI app, over a runtime's durable store or a store.

    ```python
    ui = agentfsm.ui.app(runtime, token=os.environ["AGENTFSM_UI_TOKEN"], user="ops")
    service = Starlette(routes=[Mount("/agentfsm", app=ui)])
    ```

    Args:
        source: a `Runtime` made with a `SQLiteStore` or `PostgresStore` (the
            runtime opens and closes it; a request stored from a page pokes
            it, `Runtime.poke_requests`, so that it applies it at once), or
            such a store (the app opens it at its startup and closes it at
            its shutdown).
        token: the access token every request must carry: 16 or more
            printable ASCII characters, no space (default: a new random one:
            read it back as `app.state.token`). A request that acts also
            carries the form token, `app.state.form_token`, in an
            `X-AgentFSM-Form` header (the pages read it from a `<meta>`).
        poll: how often, in seconds, each open page's stream reads the store.
        user: who acts from the pages: each request names them (`by`), and
            so does the decision it makes (default: the OS user's name).
        writer: where requests are stored when `source` is a store opened
            `read_only=True`: a writable store of the same data (the app
            opens it at the first request and closes it at its shutdown).
            Without one, such a UI only shows.
        replay_timeout: seconds a replay asked from a loop's page may take
            (it replays with the runtime's handlers, mounted beside one; with
            none, over a store).

    Raises:
        ConfigurationError: the source keeps no loops the UI can list (a
            runtime without a store, the memory store), `poll` is not a
            positive number, `user` is empty (or not given, and the OS user
            has no name), or `writer` is not a writable SQL store.
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
    if writer is not None and (not isinstance(writer, SQLStore) or writer.read_only):
        raise ConfigurationError(
            "writer must be a SQLiteStore or PostgresStore opened to write, "
            f"got {type(writer).__name__}"
            + (" opened read_only=True" if isinstance(writer, SQLStore) else "")
        )
    if isinstance(source, Runtime) and not source.watches_requests:
        # Its page still stores requests: for another runtime, or for later.
        _log.warning(
            "ui_runtime_applies_no_requests",
            hint="a request stored from a page stays pending until a runtime "
            "watching the store applies it: Runtime(store=..., requests=True)",
        )
    actions = Actions(
        store,
        user=_user(user),
        writer=writer,
        poke=source.poke_requests if isinstance(source, Runtime) else None,
    )
    if type(replay_timeout) not in (int, float) or replay_timeout <= 0:
        raise ConfigurationError(
            f"replay_timeout must be a positive number of seconds, got {replay_timeout!r}"
        )
    replays = Replays(
        store,
        callables=bound_callables(source) if isinstance(source, Runtime) else None,
        timeout=float(replay_timeout),
    )
    token = token if token is not None else new_token()
    built = build_app(
        store,
        token=token,
        actions=actions,
        poll=float(poll),
        owns_store=owns,
        replays=replays,
    )
    built.state.token = token
    built.state.user = actions.user
    return built


def _default_user() -> str:
    """The OS user's name (`getpass.getuser`).

    Raises:
        ConfigurationError: the OS names no user (say who acts instead).
    """
    try:
        return getpass.getuser()
    except (KeyError, OSError, ImportError) as exc:
        raise ConfigurationError(
            f"the OS user has no name ({exc}): say who acts from the UI "
            "(agentfsm.ui.app(..., user=...), agentfsm ui --as NAME)"
        ) from None


def _user(user: object) -> str:
    if user is None:
        return _default_user()
    if not isinstance(user, str) or not user.strip():
        raise ConfigurationError(
            f"user must name who acts from the UI (a non-empty str), got {user!r}"
        )
    return user
