"""What the MCP tests share: the ledger server (``ledger_server.py``) behind a command of
its own on ``PATH``, its SQLite ledger, the agents under ``agents/`` loaded by path, and the
server over Streamable HTTP as a real process on 127.0.0.1. A test module imports the
fixtures it uses, ``ledger_fixture``, ``http_ledger_fixture`` and ``sse_ledger_fixture``,
which pytest knows as ``ledger``, ``http_ledger`` and ``sse_ledger``.

The command ``ledger-server`` is a wrapper script in a temporary bin directory: a test
removes it before a replay, so that a replay that tried to start the server would fail.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import mcp.client.stdio  # noqa: F401  imported at collection: its stderr default is the real one
import pytest

from recorder.cassette import load

HERE = Path(__file__).resolve().parent
SERVER = HERE / "ledger_server.py"
AGENTS = HERE / "agents"
COMMAND = "ledger-server"
TIMEOUT = 60


@dataclass
class Ledger:
    """The ledger server's command and database for one test."""

    bin: Path
    db: Path

    @property
    def script(self) -> Path:
        return self.bin / COMMAND

    def install(self) -> None:
        """Put ``ledger-server`` on ``PATH`` (a script that runs the server)."""
        self.script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{SERVER}" "$@"\n')
        self.script.chmod(0o755)

    def remove(self) -> None:
        """Take the command away: nothing can start the server any more."""
        self.script.unlink()
        assert shutil.which(COMMAND) is None

    def rows(self) -> list[tuple[str, float]]:
        """The refunds the ledger holds."""
        if not self.db.exists():
            return []
        with sqlite3.connect(self.db) as conn:
            return [tuple(row) for row in conn.execute("select ord, amount from refunds")]


@pytest.fixture(name="ledger")
def ledger_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    """``ledger-server`` on ``PATH`` and an empty ledger (``LEDGER_DB``)."""
    found = Ledger(tmp_path / "bin", tmp_path / "ledger.db")
    found.bin.mkdir()
    found.install()
    monkeypatch.setenv("PATH", f"{found.bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("LEDGER_DB", str(found.db))
    for name in ("LEDGER_URL", "LEDGER_SSE_URL", "LEDGER_ORDER", "LEDGER_TOOL",
                 "LEDGER_APPROVE"):
        monkeypatch.delenv(name, raising=False)
    return found


def load_agent(name: str) -> ModuleType:
    """``agents/NAME.py`` imported under a name of its own."""
    module_name = f"deja_mcp_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, AGENTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def steps(path: Path) -> list[dict[str, Any]]:
    return [dict(obs) for obs in load(path)]


def seq_of(path: Path, kind: str, name: str) -> int:
    """The step of the first ``kind`` line named ``name`` (a tool) or of that method."""
    return next(o["seq"] for o in steps(path) if o["kind"] == kind
                and name in (o.get("name"), (o.get("mcp") or {}).get("method")))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve(transport: str) -> tuple[subprocess.Popen, int]:
    """The ledger server over ``transport`` (``--http``, ``--sse``), a real process on
    127.0.0.1, once it listens; and its port."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(SERVER), transport, str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + TIMEOUT
    while True:  # poll until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert process.poll() is None, "the ledger server exited"
            assert time.monotonic() < deadline, "the ledger server never listened"
            time.sleep(0.05)
    return process, port


@pytest.fixture(name="http_ledger")
def http_ledger_fixture(ledger: Ledger,
                        monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen]:
    """The ledger server over Streamable HTTP, its URL in ``LEDGER_URL``; stopped when the
    test ends (a test may stop it sooner)."""
    process, port = serve("--http")
    monkeypatch.setenv("LEDGER_URL", f"http://127.0.0.1:{port}/mcp")
    yield process
    stop(process)


@pytest.fixture(name="sse_ledger")
def sse_ledger_fixture(ledger: Ledger,
                       monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen]:
    """The ledger server over the legacy SSE transport, its URL in ``LEDGER_SSE_URL``;
    stopped when the test ends (a test may stop it sooner)."""
    process, port = serve("--sse")
    monkeypatch.setenv("LEDGER_SSE_URL", f"http://127.0.0.1:{port}/sse")
    yield process
    stop(process)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        process.wait(timeout=TIMEOUT)
