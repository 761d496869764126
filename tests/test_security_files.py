"""The files agentfsm creates hold prompts and tool outputs: they are readable by
their owner only (0600) unless the user asks for another mode, and a file that
exists keeps its own.

- `SQLiteStore`: the database, the `-wal` and `-shm` files SQLite makes beside
  it (SQLite gives them the database's mode) and `<path>-owners`.
- The event log (`Runtime(event_log=...)`, `EventLogWriter`).
- The page `agentfsm inspect --html` writes, which quotes the log.

Each test runs under the umask most systems default to (022), under which a
file created without a mode is 0644: readable by every user of the host.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agentfsm import Runtime
from agentfsm.cli import main
from agentfsm.eventlog import EventLogWriter, read_events
from agentfsm.exceptions import ConfigurationError
from agentfsm.store.sqlite import SQLiteStore
from agentfsm.testing import ScriptedProvider, text
from tests.helpers import needs_dot, request

SQLITE_FILES = ("", "-wal", "-shm", "-owners")
"""The files of a SQLite store at a path, by suffix (the WAL and shared-memory
files exist while a connection is open)."""


@pytest.fixture(autouse=True)
def _umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def modes(db: Path) -> dict[str, int]:
    """The mode of each of the store's files, by suffix."""
    return {suffix: mode(f"{db}{suffix}") for suffix in SQLITE_FILES}


async def run_a_loop(store: SQLiteStore, db: Path) -> dict[str, int]:
    """Run one loop to its end on `store`; the modes of its files meanwhile."""
    async with Runtime(
        providers={"scripted": ScriptedProvider([text("hello")])}, store=store
    ) as runtime:
        await runtime.wait(runtime.run_loop("agent", "hi", request()))
        return modes(db)


class TestSQLiteStore:
    async def test_its_files_are_readable_by_their_owner_only(
        self, tmp_path: Path
    ) -> None:
        db = tmp_path / "loops.db"
        assert await run_a_loop(SQLiteStore(db), db) == dict.fromkeys(
            SQLITE_FILES, 0o600
        )

    async def test_a_mode_asked_for_is_honoured(self, tmp_path: Path) -> None:
        db = tmp_path / "loops.db"
        store = SQLiteStore(db, file_mode=0o640)
        assert await run_a_loop(store, db) == dict.fromkeys(SQLITE_FILES, 0o640)

    async def test_an_existing_file_keeps_its_mode(self, tmp_path: Path) -> None:
        """An empty file is a new database to SQLite: the store makes it one,
        and leaves its mode, which SQLite gives its WAL and shm files."""
        db = tmp_path / "loops.db"
        db.touch()
        db.chmod(0o644)
        assert await run_a_loop(SQLiteStore(db), db) == {
            "": 0o644,
            "-wal": 0o644,
            "-shm": 0o644,
            "-owners": 0o600,  # (not the database: a file of its own)
        }

    @pytest.mark.parametrize(
        ("given", "message"),
        [
            ("0600", "file_mode must be an int, got str '0600'"),
            (True, "file_mode must be an int, got bool True"),
            (0o1777, "file_mode must be permission bits within 0 and 0o777"),
            (-1, "file_mode must be permission bits"),
        ],
    )
    def test_a_mode_that_is_not_permission_bits_is_refused(
        self, tmp_path: Path, given: object, message: str
    ) -> None:
        with pytest.raises(ConfigurationError, match=message):
            SQLiteStore(tmp_path / "loops.db", file_mode=given)  # type: ignore[arg-type]


class TestEventLog:
    async def test_the_runtime_s_log_is_readable_by_its_owner_only(
        self, tmp_path: Path
    ) -> None:
        log = tmp_path / "events.jsonl"
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hello")])}, event_log=log
        ) as runtime:
            await runtime.wait(runtime.run_loop("agent", "hi", request()))
        assert mode(log) == 0o600
        assert [e.type for e in read_events(log)][-1] == "loop.idle"

    @pytest.mark.parametrize("file_mode", [0o600, 0o640])
    async def test_a_writer_creates_its_file_with_the_mode_asked_for(
        self, tmp_path: Path, file_mode: int
    ) -> None:
        log = tmp_path / "events.jsonl"
        runtime = Runtime(providers={"scripted": ScriptedProvider([text("hello")])})
        async with EventLogWriter(runtime.bus, log, file_mode=file_mode), runtime:
            await runtime.wait(runtime.run_loop("agent", "hi", request()))
        assert mode(log) == file_mode

    async def test_an_existing_log_keeps_its_mode(self, tmp_path: Path) -> None:
        log = tmp_path / "events.jsonl"
        log.touch()
        log.chmod(0o644)
        async with Runtime(
            providers={"scripted": ScriptedProvider([text("hello")])}, event_log=log
        ) as runtime:
            await runtime.wait(runtime.run_loop("agent", "hi", request()))
        assert mode(log) == 0o644
        assert read_events(log)

    def test_a_mode_that_is_not_permission_bits_is_refused(
        self, tmp_path: Path
    ) -> None:
        runtime = Runtime()
        with pytest.raises(ConfigurationError, match="file_mode must be an int"):
            EventLogWriter(runtime.bus, tmp_path / "e.jsonl", file_mode=0.5)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="within 0 and 0o777"):
            EventLogWriter(runtime.bus, tmp_path / "e.jsonl", file_mode=0o10000)


@needs_dot
class TestInspectHtml:
    """`agentfsm inspect --html` writes a page that quotes the log."""

    @pytest.fixture
    def log(self, tmp_path: Path) -> Path:
        log = tmp_path / "events.jsonl"

        async def record() -> None:
            async with Runtime(
                providers={"scripted": ScriptedProvider([text("hello")])},
                event_log=log,
            ) as runtime:
                await runtime.wait(runtime.run_loop("agent", "hi", request()))

        anyio.run(record)
        return log

    def test_the_page_is_readable_by_its_owner_only(
        self, log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        page = tmp_path / "loop.html"
        assert main(["inspect", str(log), "--html", str(page)]) == 0, (
            capsys.readouterr()
        )
        assert mode(page) == 0o600
        assert "hello" in page.read_text(encoding="utf-8")

    @pytest.mark.parametrize("suffix", ["mermaid", "dot"])
    def test_a_drawing_is_readable_by_its_owner_only(
        self, log: Path, tmp_path: Path, suffix: str
    ) -> None:
        """A drawing of a log names its agents and quotes its pauses."""
        target = tmp_path / f"path.{suffix}"
        argv = ["diagram", "--events", str(log), "--format", suffix, "-o", str(target)]
        assert main(argv) == 0
        assert mode(target) == 0o600

    def test_an_existing_page_keeps_its_mode(
        self, log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        page = tmp_path / "loop.html"
        page.write_text("old")
        page.chmod(0o644)
        assert main(["inspect", str(log), "--html", str(page)]) == 0, (
            capsys.readouterr()
        )
        assert mode(page) == 0o644
        assert "hello" in page.read_text(encoding="utf-8")
