"""A throwaway PostgreSQL server for the tests (a pytest plugin: tests/conftest.py
loads it).

The `postgres_server` fixture starts one server for the session, on first use:
`initdb` in a temporary directory, `pg_ctl start` listening on 127.0.0.1 only
(a free port) and on a unix socket in that directory, one database, and
`pg_ctl stop -m fast` at the end. The binaries are looked for in
`$AGENTFSM_PG_BIN`, on PATH, then in Debian's `/usr/lib/postgresql/*/bin`
(`.ci/run` installs Debian's `postgresql` package when they are missing).

`initdb` refuses to run as root (CI runs as root): there, the server's
commands run as the `postgres` user (`runuser -u postgres --`, which Debian's
package creates), in a directory owned by it. Where no server can be started
the tests that need one are skipped, with the reason naming what was missing;
with `AGENTFSM_REQUIRE_POSTGRES=1` (set by `.ci/run`) they fail instead, so a
CI run never passes without having tested the store.

`python -m tests.postgres_server` starts one and prints its conninfo until
interrupted (for trying the store by hand).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ("PostgresServer", "ServerUnavailable", "postgres_server")

DATABASE = "agentfsm_test"
USER = "agentfsm"

FAST = {
    # The tests never lose power: no fsync (a commit still goes through the
    # server's WAL, its locks and its transaction machinery).
    "fsync": "off",
    "full_page_writes": "off",
}


PREFIX = "agentfsm-pg-"
"""Of the temporary directories (each holds `owner.pid`: the test process's)."""


class ServerUnavailable(Exception):
    """No PostgreSQL server can be started here (the message says why)."""


def find_bin() -> Path:
    """The directory holding `initdb` and `pg_ctl` (of one installation)."""
    candidates: list[Path] = []
    if given := os.environ.get("AGENTFSM_PG_BIN"):
        candidates.append(Path(given))
    if on_path := shutil.which("pg_ctl"):
        # /usr/local/bin/pg_ctl may be a link into /usr/lib/postgresql/N/bin.
        candidates.append(Path(on_path).resolve().parent)
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    versions.sort(key=lambda p: int(Path(p).parent.name or 0), reverse=True)
    candidates.extend(Path(p) for p in versions)
    for directory in candidates:
        if (directory / "initdb").is_file() and (directory / "pg_ctl").is_file():
            return directory
    raise ServerUnavailable(
        "PostgreSQL's initdb and pg_ctl were not found (looked in "
        "$AGENTFSM_PG_BIN, on PATH and in /usr/lib/postgresql/*/bin): "
        "apt-get install postgresql"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PostgresServer:
    """One running server: `conninfo` reaches its test database."""

    bin: Path
    root: Path
    """The temporary directory: the data directory, the socket, the log."""
    port: int
    run_as: str | None
    """The user the server's commands run as (None: this process's user)."""

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def conninfo(self, dbname: str = DATABASE) -> str:
        return f"host=127.0.0.1 port={self.port} user={USER} dbname={dbname}"

    @classmethod
    def start(cls, settings: Mapping[str, str] = FAST) -> PostgresServer:
        """initdb, start, create the test database; raises ServerUnavailable."""
        bin_dir = find_bin()
        run_as = _server_user()
        _stop_stale(bin_dir, run_as)
        root = Path(tempfile.mkdtemp(prefix=PREFIX))
        (root / "owner.pid").write_text(str(os.getpid()))
        if run_as is not None:
            entry = pwd.getpwnam(run_as)
            os.chown(root, entry.pw_uid, entry.pw_gid)
        server = cls(bin_dir, root, 0, run_as)
        try:
            server._run(
                "initdb",
                "-D",
                str(server.data),
                "-U",
                USER,
                "--auth=trust",  # only 127.0.0.1 and a socket in a private dir
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            )
            server._start(settings)
            server._create_database()
        except BaseException:
            server.stop()
            raise
        return server

    def _start(self, settings: Mapping[str, str]) -> None:
        # A free port can be taken between finding it and binding it: try again.
        for attempt in range(3):
            self.port = free_port()
            options = [
                "-c listen_addresses=127.0.0.1",
                f"-c port={self.port}",
                f"-c unix_socket_directories={self.root}",
                *(f"-c {name}={value}" for name, value in settings.items()),
            ]
            try:
                self._run(
                    "pg_ctl",
                    "start",
                    "-w",
                    "-t",
                    "60",
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.log),
                    "-o",
                    " ".join(options),
                )
                return
            except ServerUnavailable:
                if attempt == 2:
                    raise

    def _create_database(self) -> None:
        import psycopg

        with psycopg.connect(self.conninfo("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")

    def stop(self) -> None:
        """Stop the server (if it runs) and remove its directory."""
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(ServerUnavailable):
                self._run("pg_ctl", "stop", "-m", "fast", "-w", "-D", str(self.data))
        shutil.rmtree(self.root, ignore_errors=True)

    def _run(self, program: str, *args: str) -> None:
        command = [str(self.bin / program), *args]
        if self.run_as is not None:
            command = ["runuser", "-u", self.run_as, "--", *command]
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=self.root,  # the user it runs as may not read our cwd
        )
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise ServerUnavailable(
                f"{program} failed ({done.returncode}): "
                f"{(done.stderr or done.stdout).strip()}\n{log[-2000:]}"
            )


def _stop_stale(bin_dir: Path, run_as: str | None) -> None:
    """Stop the servers of test runs that were killed before their teardown
    (their `owner.pid` is not running), and remove their directories."""
    for root in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            owner = int((root / "owner.pid").read_text())
            os.kill(owner, 0)
        except ProcessLookupError:
            stale = PostgresServer(bin_dir, root, 0, run_as)
            stale.stop()
        except (OSError, ValueError):
            continue  # another user's, or not written yet: not ours to stop


def _server_user() -> str | None:
    """Who runs initdb and the server: this user, or `postgres` for root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise ServerUnavailable(
            "running as root, and initdb refuses to: there is no 'postgres' "
            "user to run it as (Debian's postgresql package creates it)"
        ) from None
    if shutil.which("runuser") is None:
        raise ServerUnavailable(
            "running as root, and `runuser` (util-linux) is missing to run "
            "initdb as the 'postgres' user"
        )
    return "postgres"


def _unavailable(reason: str) -> None:
    if os.environ.get("AGENTFSM_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"no PostgreSQL server for the tests: {reason}", pytrace=False)
    pytest.skip(f"no PostgreSQL server for the tests: {reason}")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server for the session (started on first use)."""
    yield from a_server()


def a_server() -> Iterator[PostgresServer]:
    """A server started for a fixture and stopped after it; the test skips
    (fails, with AGENTFSM_REQUIRE_POSTGRES=1) if none can start."""
    try:
        import psycopg  # noqa: F401 - the store's driver: skip without it
    except ImportError:
        _unavailable("psycopg is not installed (pip install 'agentfsm[postgres]')")
    try:
        server = PostgresServer.start()
    except (ServerUnavailable, OSError, subprocess.SubprocessError) as exc:
        _unavailable(str(exc))
        raise  # (not reached: skip and fail raise)
    try:
        yield server
    finally:
        server.stop()


if __name__ == "__main__":
    running = PostgresServer.start({})
    print(running.conninfo(), flush=True)  # noqa: T201 - the point of it
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
