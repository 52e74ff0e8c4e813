"""Where runs live: the database URL and the cassette directory, from the environment.

- ``DEJA_DATABASE_URL``: the runs database. Default: an embedded SQLite file,
  ``$DEJA_HOME/runs.sqlite`` (an absolute path: the engine's own default is relative to
  the current directory). ``postgresql://user@host:5432/deja`` for many machines.
- ``DEJA_CASSETTE_DIR``: where submitted runs write their cassettes. Default
  ``$DEJA_HOME/cassettes``. With many machines it must be one directory every worker
  reaches at the same path (see README, "Many machines").
- ``DEJA_SERVER``: the address of ``deja serve`` for the command-line clients. Default
  ``http://127.0.0.1:8977``. ``DEJA_TOKEN`` is the bearer token to send it; without it,
  a server on this machine gets the install's token (:mod:`deja.runs.auth`).
"""

from __future__ import annotations

import os
from pathlib import Path

from recorder.cassette.keys import deja_home

DEFAULT_PORT = 8977


def database_url() -> str:
    url = os.environ.get("DEJA_DATABASE_URL")
    if url:
        return url
    return f"sqlite:///{(deja_home() / 'runs.sqlite').resolve()}"


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def sqlite_path(url: str) -> Path:
    """The file of a ``sqlite:///`` URL."""
    return Path(url.split("sqlite:///", 1)[1])


def sqlalchemy_url(url: str) -> str:
    """The URL for SQLAlchemy: Postgres through psycopg 3 (the driver the engine ships)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def safe_url(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    head, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    auth, _, host = rest.rpartition("@")
    user = auth.split(":", 1)[0]
    return f"{head}://{user}:***@{host}" if ":" in auth else url


def cassette_dir() -> Path:
    given = os.environ.get("DEJA_CASSETTE_DIR")
    return (Path(given) if given else deja_home() / "cassettes").resolve()


def server_url() -> str:
    return (os.environ.get("DEJA_SERVER") or f"http://127.0.0.1:{DEFAULT_PORT}").rstrip("/")
