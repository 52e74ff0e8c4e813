"""The throwaway PostgreSQL server of the durable-runs tests (tests/pg_server.py): a real
server on 127.0.0.1, one empty database per test."""

from __future__ import annotations

import psycopg
from pg_server import PostgresServer, postgres_server_fixture, postgres_url_fixture  # noqa: F401


def test_database_round_trips_a_row(postgres_url: str, postgres_server: PostgresServer) -> None:
    assert postgres_url.startswith(f"postgresql://postgres@127.0.0.1:{postgres_server.port}/")
    with psycopg.connect(postgres_url) as conn:
        conn.execute("CREATE TABLE steps (id serial PRIMARY KEY, name text NOT NULL)")
        conn.execute("INSERT INTO steps (name) VALUES (%s)", ("fetch-weather",))
        conn.commit()
    with psycopg.connect(postgres_url) as conn:
        rows = conn.execute("SELECT id, name FROM steps").fetchall()
        assert rows == [(1, "fetch-weather")]
        assert conn.execute("SHOW fsync").fetchone() == ("off",)
        assert conn.execute("SHOW listen_addresses").fetchone() == ("127.0.0.1",)


def test_each_url_is_its_own_database(postgres_url: str,
                                      postgres_server: PostgresServer) -> None:
    other = postgres_server.create_database()
    try:
        assert other != postgres_url
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute("CREATE TABLE only_here (x int)")
            conn.execute("INSERT INTO only_here VALUES (1)")
        with psycopg.connect(other, autocommit=True) as conn:
            found = conn.execute("SELECT to_regclass('only_here')").fetchone()
            assert found == (None,)
            conn.execute("CREATE TABLE only_here (x int)")
            assert conn.execute("SELECT count(*) FROM only_here").fetchone() == (0,)
        with psycopg.connect(postgres_url) as conn:
            assert conn.execute("SELECT count(*) FROM only_here").fetchone() == (1,)
    finally:
        postgres_server.drop_database(other)
