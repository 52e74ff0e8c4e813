"""Shared fixtures: an isolated key home per test and the stub Anthropic server."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from recorder.testing.server import StubServer

# A model the SDK knows and does not warn about (warnings are errors in this suite).
MODEL = "claude-sonnet-4-6"
API_KEY = "sk-ant-test-SECRET-4f1c9e"
TEST_KEY = "test-key-0123456789abcdef"  # every test's signing key (DEJA_KEY)
# Where deja's commands look for deja serve unless a test starts one: the discard port,
# which nothing here serves. (The default port is the one the docs' blocks serve on while
# other tests run beside them.)
NO_SERVER = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def deja_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own key home, a fixed signing key and no deja serve."""
    home = tmp_path_factory.mktemp("deja-home")
    monkeypatch.setenv("DEJA_HOME", str(home))
    monkeypatch.setenv("DEJA_KEY", TEST_KEY)
    monkeypatch.setenv("DEJA_SERVER", NO_SERVER)
    monkeypatch.delenv("DEJA_OLD_KEYS", raising=False)
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    return home


@pytest.fixture(scope="module")
def module_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment for what a module-scoped fixture records once for all the module's
    tests: a key home of its own and every test's signing key, so that what it records
    verifies in each test. (A module's fixtures are made before a test's own key home is
    set: they must give this environment to what they start.)"""
    env = {k: v for k, v in os.environ.items() if k not in ("DEJA_OLD_KEYS", "ANTHROPIC_API_KEY")}
    env.update(DEJA_HOME=str(tmp_path_factory.mktemp("deja-home-module")), DEJA_KEY=TEST_KEY,
               DEJA_SERVER=NO_SERVER)
    return env


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
    _collect_clients()


@contextlib.contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A plain HTTP server on 127.0.0.1 answering with ``handler``, in threads of its
    own, for the block: its base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@dataclass
class Served:
    """A server :func:`serve` started: the URL of its Messages endpoint, and its stop."""

    url: str
    stop: Callable[[], None]


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    """Start plain HTTP servers on 127.0.0.1 that answer every POST with the body given
    (JSON unless ``content_type`` says otherwise, and ``status``): for bodies the stub
    would not send. All stop when the test ends."""
    servers: list[ThreadingHTTPServer] = []

    def start(payload: bytes, status: int = 200,
              content_type: str = "application/json") -> Served:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)

        def stop() -> None:
            if httpd in servers:
                servers.remove(httpd)
                httpd.shutdown()
                httpd.server_close()

        return Served(f"http://127.0.0.1:{httpd.server_address[1]}/v1/messages", stop)

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(autouse=True, scope="module")
def _collect_clients_after_module() -> Iterator[None]:
    yield
    _collect_clients()
    gc.freeze()  # what outlived the module: see pytest_collection_finish


# The files that take longest, about longest first. `make test` runs the suite in two
# processes that take whole files in the order they are collected (--dist loadfile
# --no-loadscope-reorder): a long file taken last would run on while the other process
# sits idle, so these are collected first, and the many short files fill in at the end.
SLOWEST_FIRST = (
    "tests/replayer/test_crash_resume.py",
    "tests/replayer/test_tamper.py",
    "tests/replayer/test_sweep.py",
    "tests/viewer/test_viewer_browser.py",
    "tests/runs/test_suite_workers.py",
    "tests/cli/test_install.py",
    "tests/replayer/test_pytest_plugin.py",
    "tests/cli/test_docs.py",
    "tests/runs/test_worker_death.py",
    "tests/cli/test_integrity.py",
    "tests/replayer/test_counts.py",
    "tests/cli/test_first_use.py",
    "tests/replayer/test_suite.py",
    "tests/viewer/test_viewer_diff_many.py",
    "tests/mcp/test_mcp_frameworks.py",
    "tests/cli/test_replay_ci.py",
    "tests/replayer/test_drift.py",
    "tests/replayer/test_diff_many.py",
    "tests/cli/test_edges.py",
    "tests/cli/test_cli.py",
    "tests/replayer/test_fork.py",
    "tests/runs/test_chaos.py",
    "tests/runs/test_runs_cli.py",
    "tests/proxy/test_proxy_agents.py",
    "tests/recorder/test_stubserver_cli.py",
    "tests/runs/test_agent_death.py",
    "tests/replayer/test_signal_cuts.py",
    "tests/viewer/test_viewer_safety.py",
    "tests/runs/test_schedules.py",
    "tests/viewer/test_viewer_app.py",
    "tests/viewer/test_viewer_submitted_open.py",
    "tests/frameworks/test_openai_agents.py",
    "tests/runs/test_fault_edges.py",
    "tests/runs/test_api.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of SLOWEST_FIRST first, in its order; the rest as collected. A file's
    tests keep their order."""
    rank = {path: n for n, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


def pytest_collectstart(collector: pytest.Collector) -> None:
    """What the modules collected so far imported is left out of Python's own full
    collections while the next one imports more (see pytest_collection_finish)."""
    if isinstance(collector, pytest.Module):
        gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Leave the objects that exist now out of every later full collection.

    Collecting imports every SDK, Streamlit, pandas and the rest: some 600,000 objects
    that live as long as the process, which each ``gc.collect()`` (one per test that starts
    a stub, and Python's own full collections) would otherwise walk again, for most of a
    second each time. Objects made later, by the tests, are collected as before; the same
    is done again after each module, for what its tests imported.
    """
    gc.unfreeze()  # what the imports left as garbage goes now, then the rest is set aside
    gc.collect()
    gc.freeze()


def _collect_clients() -> None:
    """Collect the SDK clients a test left open now, quietly.

    Tests make anthropic clients and drop them; their pooled connections to a stub that is
    gone would otherwise be collected during some later test, where the socket's
    ResourceWarning (an error in this suite) fails a test that has nothing to do with it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


GOLDEN = Path(__file__).parent / "golden"


def golden_agent() -> ModuleType:
    """tests/golden/agent.py, the agent the golden cassettes were recorded with, loaded
    once under one name for every test that replays them."""
    name = "deja_golden_agent"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, GOLDEN / "agent.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The figures of the tamper suite (tests/replayer/test_tamper.py), when it ran."""
    tamper = sys.modules.get("tamper")
    for line in getattr(tamper, "SUMMARY", ()):
        terminalreporter.write_line(line)


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytest's own, whose runs in a subprocess leave out LangSmith's pytest plugin.

    LangGraph brings LangSmith into this suite's virtualenv, and with it a pytest plugin
    that takes most of a second to import in every pytest process started; it has nothing
    to do with deja's plugin, which those runs test. (Pytester clears PYTEST_ADDOPTS when
    it starts; this sets it again, for the test's duration.)
    """
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:langsmith_plugin")
    return pytester


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``proxy(*args, env=None, workdir=None)`` starts ``deja proxy ARGS`` as a real process
    (in ``tmp_path`` unless told otherwise) and returns its ``ProxyProcess``
    (tests/proxy/proxy_helpers.py); every proxy still running when the test ends is
    killed."""
    from proxy_helpers import ProxyProcess, start_proxy  # tests/proxy, on the path there

    started: list[ProxyProcess] = []

    def start(*args: str, env: dict[str, str] | None = None,
              workdir: Path | None = None) -> ProxyProcess:
        p = start_proxy(workdir or tmp_path, *args, env=env)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.process.poll() is None:
            p.stop(signal.SIGKILL)
