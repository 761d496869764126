"""`PostgresStore` at its trust boundaries.

- **Its password is never shown**: not in an error (a malformed URI's, a failed
  connection's, or an exception they chain), a log line, the store's `repr` or
  its thread's name; whatever part of a URI libpq reads a password as.
- **Text it cannot hold as it is**: PostgreSQL's `text` refuses NUL (`\\x00`).
  Model text (call ids, tool names, arguments, outputs, answers) reaches the
  store as JSON, where a NUL is `\\u0000`; the ids a text column holds (the
  loop's, the agent's, a shared context's) are escaped by the store. So a
  loop whose ids and texts hold NULs is stored as it ran, on SQLite and
  PostgreSQL alike, and `recover()` never runs it again.

The tests use a real server (tests/postgres_server.py), but those of messages
that need none.
"""

from __future__ import annotations

import json
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.typing import EventDict

from agentfsm import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InferenceInput,
    ModelContext,
    Outcome,
    Proceed,
    Runtime,
    tool,
)
from agentfsm.exceptions import ConfigurationError, StoreError
from agentfsm.results import LoopStatus
from agentfsm.store.sqlite import SQLiteStore
from agentfsm.testing import ScriptedProvider, call, calls, text
from tests.helpers import wait_until
from tests.postgres_server import PostgresServer, free_port

psycopg = pytest.importorskip("psycopg", reason="pip install 'agentfsm[postgres]'")

from agentfsm.store.postgres import PostgresStore

Stores = SQLiteStore | PostgresStore

PASSWORD = "s3cret-Pw"


# ------------------------------------------------------------------ passwords


def everything_shown(exc: BaseException) -> str:
    """All an error can show: its traceback with every exception it chains
    (shown or not), their reprs and their attributes' reprs (psycopg's keep
    the connection's parameters)."""
    shown = ["".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        shown.append(repr(current))
        shown.extend(repr(value) for value in vars(current).values())
        shown.extend(repr(getattr(current, name, None)) for name in ("pgconn",))
        todo.extend([current.__cause__, current.__context__])
    return "\n".join(shown)


def assert_no_password(shown: str, password: str = PASSWORD) -> None:
    for piece in {password, *password.split("/")} - {""}:
        at = shown.find(piece)
        assert at < 0, f"{piece!r} in: ...{shown[max(at - 200, 0) : at + 100]}..."


@pytest.fixture
def logs() -> Iterator[list[EventDict]]:
    with structlog.testing.capture_logs() as captured:
        yield captured


MALFORMED = [
    # libpq reads each of these, but not as its writer meant.
    pytest.param(f"postgresql://user:{PASSWORD}@host:notaport/db", id="bad-port"),
    pytest.param(f"postgresql://user:{PASSWORD}/db", id="no-host"),
    pytest.param("postgresql://user:s3cr/et-Pw@host/db", id="slash-in-password"),
    pytest.param(f"postgresql://user:{PASSWORD}@h1,h2:x/db", id="bad-ports"),
    pytest.param(f"host=h password={PASSWORD} port=abc", id="keywords"),
]
UNREADABLE = [
    # libpq cannot read these: its message quotes them.
    pytest.param(f"postgresql://user:{PASSWORD}@[::1/db", id="open-bracket"),
    pytest.param(f"postgresql://user:{PASSWORD}@host/db?nope=1", id="bad-query"),
    pytest.param(f"postgresql://us%zzer:{PASSWORD}@host/db", id="bad-escape"),
]


class TestThePasswordIsNeverShown:
    @pytest.mark.parametrize("conninfo", UNREADABLE)
    def test_a_conninfo_libpq_cannot_read(self, conninfo: str) -> None:
        with pytest.raises(ConfigurationError, match="conninfo is not a libpq") as info:
            PostgresStore(conninfo)
        assert_no_password(everything_shown(info.value))
        # (Not even chained where a traceback does not show it.)
        assert info.value.__context__ is None
        assert info.value.__cause__ is None

    @pytest.mark.parametrize("conninfo", MALFORMED)
    def test_a_malformed_uri_is_not_named_by_its_password(self, conninfo: str) -> None:
        store = PostgresStore(conninfo)
        password = "s3cr/et-Pw" if "s3cr/" in conninfo else PASSWORD
        assert_no_password(f"{store!r} {store.where}", password)

    @pytest.mark.parametrize(
        "conninfo",
        [
            f"postgresql://user:{PASSWORD}@127.0.0.1:{{port}}/db",
            f"postgresql://user:{PASSWORD}@127.0.0.1:notaport/db",
            f"host=127.0.0.1 port={{port}} user=me password={PASSWORD}",
            f"postgresql://user:{PASSWORD}@127.0.0.1:{{port}},127.0.0.1:x/db",
        ],
    )
    async def test_a_failed_connection(
        self, conninfo: str, logs: list[EventDict]
    ) -> None:
        """Refused (nothing listens on the port), or a port libpq refuses: the
        error, what it chains and the log hold no password."""
        store = PostgresStore(conninfo.format(port=free_port()), connect_timeout=2)
        with pytest.raises(StoreError, match="cannot connect to postgresql") as info:
            async with Runtime(store=store):
                pass
        assert_no_password(everything_shown(info.value))
        assert_no_password(repr(logs))

    async def test_a_server_refusing_the_connection(
        self, postgres_server: PostgresServer, logs: list[EventDict]
    ) -> None:
        """The server answers (its database does not exist): the driver's
        error keeps the parameters, password included; the store's does not."""
        port = postgres_server.port
        conninfo = f"postgresql://agentfsm:{PASSWORD}@127.0.0.1:{port}/no_such_db"
        store = PostgresStore(conninfo)
        with pytest.raises(StoreError, match="no_such_db") as info:
            async with Runtime(store=store):
                pass
        assert_no_password(everything_shown(info.value))
        assert_no_password(repr(logs))
        assert_no_password(" ".join(t.name for t in threading.enumerate()))


# ------------------------------------------------------- text PostgreSQL refuses


@tool
async def echo(word: str) -> str:
    """Say the word back."""
    return f"got {word}\x00!"


@tool(needs_approval=True)
async def pay(amount: int) -> str:
    """Pay an amount."""
    return f"paid {amount}\x00"


def request_with(*tools: Any) -> InferenceInput:
    return InferenceInput(model="scripted:m", context=ModelContext(), tools=list(tools))


def ids_of(*ids: str) -> Callable[[], str]:
    """A `Runtime(ids=...)` giving these loop ids, in order."""
    given = iter(ids)
    return lambda: next(given)


@pytest.fixture(params=["sqlite", "postgres"])
def store_of(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], Stores]:
    """New stores on one database, of each kind (they must agree)."""
    if request.param == "sqlite":
        return lambda: SQLiteStore(tmp_path / "loops.db", events=True)
    server: PostgresServer = request.getfixturevalue("postgres_server")
    schema = f"t_{uuid.uuid4().hex}"
    return lambda: PostgresStore(server.conninfo(), schema=schema, events=True)


class TestNulBytes:
    async def test_a_loop_with_nuls_everywhere_is_stored_as_it_ran(
        self, store_of: Callable[[], Stores]
    ) -> None:
        """A NUL in the loop's id, the agent's, the user's message, the model's
        call id and arguments, the tool's output and the answer: the loop
        answers, the store holds it ended with every text as it was, and
        recovery finds nothing to run (the model is asked twice in all)."""
        provider = ScriptedProvider(
            [
                calls(call("echo", call_id="call\x00one", word="a\x00b")),
                text("done\x00"),
            ]
        )
        async with Runtime(
            providers={"scripted": provider},
            store=store_of(),
            tools=[echo],
            ids=ids_of("loop\x00one"),
        ) as runtime:
            loop_id = runtime.run_loop("agent\x00one", "hi\x00", request_with(echo))
            result = await runtime.wait(loop_id)
        assert result.outcome is Outcome.answered, result.error
        assert loop_id == "loop\x00one"

        store = store_of()
        async with store:
            stored = await store.load(loop_id)
            assert stored is not None
            record = stored.record
            assert (record.loop_id, record.agent_id) == ("loop\x00one", "agent\x00one")
            assert (record.status, record.outcome) == (
                LoopStatus.done,
                Outcome.answered,
            )
            (asked,) = [i for i in stored.items if isinstance(i, FunctionCallItem)]
            (output,) = [
                i for i in stored.items if isinstance(i, FunctionCallOutputItem)
            ]
            assert asked.call_id == output.call_id == "call\x00one"
            assert json.loads(asked.arguments) == {"word": "a\x00b"}
            assert output.output == "got a\x00b\x00!"
            assert [c.call_id for c in await store.calls(loop_id)] == ["call\x00one"]
            events = await store.events(loop_id)
            assert [e.seq for e in events] == list(range(1, len(events) + 1))
            assert events[-1].type == "loop.idle"
            assert await store.unfinished() == []

        async with Runtime(
            providers={"scripted": provider}, store=store_of(), tools=[echo]
        ) as runtime:
            report = await runtime.recover()
        assert (report.recovered, report.failed) == ([], {})
        assert len(provider.requests) == 2

    async def test_a_paused_loop_with_nuls_is_taken_up_by_its_id(
        self, store_of: Callable[[], Stores]
    ) -> None:
        """The loop pauses for approval and its runtime exits; another finds it
        by its id (NUL included), resumes it (the decision's author holds a
        NUL too), and it ends, once."""
        first = ScriptedProvider([calls(call("pay", call_id="c\x00", amount=5))])
        async with Runtime(
            providers={"scripted": first},
            store=store_of(),
            tools=[pay],
            ids=ids_of("pay\x00loop"),
        ) as runtime:
            loop_id = runtime.run_loop("agent", "pay", request_with(pay))
            await wait_until(lambda: runtime.get(loop_id).status is LoopStatus.paused)

        second = ScriptedProvider([text("paid")])
        store = store_of()
        async with Runtime(
            providers={"scripted": second}, store=store, tools=[pay]
        ) as runtime:
            report = await runtime.recover()
            assert report.paused == ["pay\x00loop"]
            runtime.resume(loop_id, Proceed(), by="ops\x00desk")
            result = await runtime.wait(loop_id)
            assert result.outcome is Outcome.answered, result.error
            _pause, resume = await store.decisions(loop_id)
            assert resume.by == "ops\x00desk"
            assert await store.unfinished() == []
        assert (len(first.requests), len(second.requests)) == (1, 1)

    async def test_an_escaped_id_is_never_another_s(
        self, store_of: Callable[[], Stores]
    ) -> None:
        """Ids that look like what PostgreSQL's store writes for a NUL are
        other loops: each is stored, and read back, as its own."""
        names = ["a\x00", "\x01a%00", "\x01a\x00", "a%00", "\x01\x01a"]
        provider = ScriptedProvider([text("done")])
        store = store_of()
        async with Runtime(
            providers={"scripted": provider}, store=store, ids=ids_of(*names)
        ) as runtime:
            loop_ids = [runtime.run_loop(n, "hi", request_with()) for n in names]
            for loop_id in loop_ids:
                assert (await runtime.wait(loop_id)).outcome is Outcome.answered
            for name in names:
                stored = await store.load(name)
                assert stored is not None
                assert (stored.record.loop_id, stored.record.agent_id) == (name, name)
        assert loop_ids == names

    async def test_a_shared_context_id_with_a_nul(
        self, store_of: Callable[[], Stores]
    ) -> None:
        store = store_of()
        item = FunctionCallOutputItem(call_id="c\x00", output="x\x00")
        async with store:
            await store.append_context("ctx\x00", 0, [item], ["d1"])
            assert await store.context("ctx\x00") == ([item], ["d1"])
            assert await store.context("ctx") is None
