"""A throwaway PostgreSQL server for the durable-runs tests.

``PostgresServer`` builds a cluster in a fresh temporary directory from Debian's binaries
(``/usr/lib/postgresql/<version>/bin``, the newest version; ``make postgres`` installs
them), starts it on a free port of 127.0.0.1 with its socket inside that directory, and
removes everything on ``stop()``. The cluster Debian's package may start on port 5432 is
never touched. initdb and postgres refuse to run as root, so under root both run as the
``postgres`` system user, which owns the directory.

The server is for tests only: ``fsync=off``, trust authentication, one superuser
``postgres``. Each test gets an empty database of its own::

    from pg_server import postgres_server_fixture, postgres_url_fixture  # noqa: F401

    def test_x(postgres_url: str) -> None:
        with psycopg.connect(postgres_url) as conn: ...

``postgres_server`` is one server for the whole session; ``postgres_url`` is the
``postgresql://postgres@127.0.0.1:PORT/NAME`` URL of a database created for the test
and dropped after it (psycopg, SQLAlchemy and DBOS all take that URL as it is).
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import psycopg
import pytest
from psycopg import sql

PG_ROOT = Path("/usr/lib/postgresql")
SYSTEM_USER = "postgres"
DATABASE = "deja_test"
START_TIMEOUT = 30.0

# Settings for a server that only lives as long as a test session: nothing is made
# durable, nothing listens beyond loopback, little memory.
SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
    "shared_buffers": "32MB",
    "max_wal_size": "256MB",
    "logging_collector": "off",
    "log_min_messages": "warning",
}


class PostgresNotAvailable(RuntimeError):
    """The PostgreSQL binaries or the system user to run them as are missing."""


class PostgresStartError(RuntimeError):
    """The server did not start; the message carries the tail of its log."""


def find_binaries() -> Path:
    """The ``bin`` directory of the newest PostgreSQL under /usr/lib/postgresql that has
    initdb, pg_ctl and postgres."""
    found: list[tuple[tuple[int, ...], Path]] = []
    for version_dir in PG_ROOT.glob("*"):
        bin_dir = version_dir / "bin"
        if not all((bin_dir / name).is_file() for name in ("initdb", "pg_ctl", "postgres")):
            continue
        try:
            version = tuple(int(part) for part in version_dir.name.split("."))
        except ValueError:
            continue
        found.append((version, bin_dir))
    if not found:
        raise PostgresNotAvailable(
            f"no PostgreSQL server binaries (initdb, pg_ctl, postgres) under {PG_ROOT}/*/bin; "
            "run `make postgres` to install Debian's postgresql"
        )
    return max(found)[1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reachable_by(path: Path, uid: int) -> bool:
    """Whether user ``uid`` (not root) can enter every directory down to ``path``."""
    for directory in (path, *path.parents):
        st = directory.stat()
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


class PostgresServer:
    """One throwaway PostgreSQL server; ``start()`` (or ``with``) brings it up with the
    database ``deja_test``, ``stop()`` shuts it down at once and removes its directory."""

    def __init__(self) -> None:
        self.bin_dir = find_binaries()
        self.port = 0
        self.root: Path | None = None
        self.startup_seconds = 0.0
        self._user: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            try:
                self._user = pwd.getpwnam(SYSTEM_USER)
            except KeyError:
                raise PostgresNotAvailable(
                    f"running as root, and there is no {SYSTEM_USER!r} system user to run "
                    "initdb and postgres as; run `make postgres` (Debian's package creates it)"
                ) from None
        self._names = itertools.count(1)

    # -- paths and URLs --------------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        return self._root() / "data"

    @property
    def socket_dir(self) -> Path:
        return self._root() / "run"

    @property
    def log_file(self) -> Path:
        return self._root() / "postgres.log"

    @property
    def url(self) -> str:
        """The URL of the database ``deja_test``."""
        return self.url_for(DATABASE)

    def url_for(self, database: str) -> str:
        if not self.port:
            raise RuntimeError("the PostgreSQL server is not started; call start() first")
        return f"postgresql://{SYSTEM_USER}@127.0.0.1:{self.port}/{database}"

    def _root(self) -> Path:
        if self.root is None:
            raise RuntimeError("the PostgreSQL server is not started; call start() first")
        return self.root

    # -- life cycle ------------------------------------------------------------------

    def start(self) -> PostgresServer:
        if self.root is not None:
            raise RuntimeError(f"the PostgreSQL server in {self.root} is already started")
        began = time.monotonic()
        self.root = self._make_root()
        try:
            self._initdb()
            self._start_postgres()
            self._create(DATABASE)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stop the server at once (``pg_ctl stop -m immediate``) and remove its
        directory; safe to call twice."""
        root, self.root = self.root, None
        if root is None:
            return
        if (root / "data" / "postmaster.pid").exists():
            self._run(["pg_ctl", "stop", "-D", str(root / "data"), "-m", "immediate", "-w"],
                      cwd=root)
        shutil.rmtree(root, ignore_errors=True)
        self.port = 0

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- databases -------------------------------------------------------------------

    def create_database(self) -> str:
        """Create a new empty database and return its URL."""
        name = f"{DATABASE}_{next(self._names)}"
        self._create(name)
        return self.url_for(name)

    def drop_database(self, url: str) -> None:
        """Drop the database of ``url``, closing whatever connections it still has."""
        name = url.rsplit("/", 1)[1]
        with self._admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))

    def _create(self, name: str) -> None:
        with self._admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def _admin(self) -> psycopg.Connection:
        return psycopg.connect(self.url_for("postgres"), autocommit=True, connect_timeout=10)

    # -- steps of start() ------------------------------------------------------------

    def _make_root(self) -> Path:
        base = Path(tempfile.gettempdir())
        if self._user is not None and not _reachable_by(base, self._user.pw_uid):
            base = Path("/tmp")  # TMPDIR is private to root; postgres could not enter it
        root = Path(tempfile.mkdtemp(prefix="deja-pg-", dir=base))
        (root / "run").mkdir()
        if self._user is not None:
            for path in (root, root / "run"):
                os.chown(path, self._user.pw_uid, self._user.pw_gid)
        return root

    def _initdb(self) -> None:
        result = self._run(
            ["initdb", "-D", str(self.data_dir), "-U", SYSTEM_USER, "-A", "trust",
             "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"],
            cwd=self._root())
        if result.returncode != 0:
            raise PostgresStartError(
                f"initdb failed (exit {result.returncode}) in {self.data_dir}:\n"
                f"{result.stdout}{result.stderr}".rstrip())
        settings = {**SETTINGS, "unix_socket_directories": f"'{self.socket_dir}'"}
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write("\n# deja tests (tests/pg_server.py)\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())

    def _start_postgres(self) -> None:
        """Start on a free port; a port taken between choosing and binding it is
        retried on another."""
        for _ in range(3):
            self.port = _free_port()
            result = self._run(
                ["pg_ctl", "start", "-D", str(self.data_dir), "-l", str(self.log_file),
                 "-p", str(self.bin_dir / "postgres"), "-o", f"-p {self.port}",
                 "-w", "-t", str(int(START_TIMEOUT))],
                cwd=self._root())
            if result.returncode == 0:
                self._wait_ready()
                return
            if "already in use" not in self._log_tail():
                break
        raise PostgresStartError(
            f"PostgreSQL did not start on 127.0.0.1:{self.port} (pg_ctl exit "
            f"{result.returncode}: {(result.stdout + result.stderr).strip()}); "
            f"the end of the server's log:\n{self._log_tail()}")

    def _wait_ready(self) -> None:
        """pg_ctl -w saw the server ready; wait until a client really gets in."""
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with self._admin() as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as e:
                if time.monotonic() > deadline:
                    raise PostgresStartError(
                        f"PostgreSQL on 127.0.0.1:{self.port} accepts no connection ({e}); "
                        f"the end of the server's log:\n{self._log_tail()}") from e
                time.sleep(0.05)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log written)"
        return "\n".join(text.splitlines()[-lines:])

    def _run(self, argv: list[str], *, cwd: Path) -> subprocess.CompletedProcess[str]:
        """Run a PostgreSQL program from ``bin_dir``, as the postgres user under root,
        with no PG* variable of the caller's environment steering it elsewhere."""
        command = [str(self.bin_dir / argv[0]), *argv[1:]]
        if self._user is not None:
            command = ["runuser", "-u", SYSTEM_USER, "--", *command]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=START_TIMEOUT + 30, check=False)


# Each fixture is defined under a name of its own so that a test module importing it can
# take ``postgres_url`` as a parameter without ruff's F811 (redefinition of an import).
@pytest.fixture(scope="session", name="postgres_server")
def postgres_server_fixture() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the whole test session."""
    with PostgresServer() as server:
        yield server


@pytest.fixture(name="postgres_url")
def postgres_url_fixture(postgres_server: PostgresServer) -> Iterator[str]:
    """The URL of a new empty database, dropped when the test ends."""
    url = postgres_server.create_database()
    yield url
    postgres_server.drop_database(url)


# The same fixtures under their own names; importing these works for pytest, but ruff then
# reports F811 at every test parameter of that name.
postgres_server = postgres_server_fixture
postgres_url = postgres_url_fixture
