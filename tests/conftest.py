"""Shared fixtures: an isolated key home per test and the stub Anthropic server."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from recorder.stubserver import StubServer

# A model the SDK knows and does not warn about (warnings are errors in this suite).
MODEL = "claude-sonnet-4-6"
API_KEY = "sk-ant-test-SECRET-4f1c9e"


@pytest.fixture(autouse=True)
def deja_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own key home and a fixed signing key."""
    home = tmp_path_factory.mktemp("deja-home")
    monkeypatch.setenv("DEJA_HOME", str(home))
    monkeypatch.setenv("DEJA_KEY", "test-key-0123456789abcdef")
    monkeypatch.delenv("DEJA_OLD_KEYS", raising=False)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    return home


@pytest.fixture
def stub() -> Iterator[Callable[[dict], StubServer]]:
    """Start stub servers from scripts; all are stopped when the test ends."""
    servers: list[StubServer] = []

    def start(script: dict) -> StubServer:
        server = StubServer(script).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The figures of the tamper suite (tests/test_tamper.py), when it ran."""
    tamper = sys.modules.get("tamper")
    for line in getattr(tamper, "SUMMARY", ()):
        terminalreporter.write_line(line)
