"""The pytest plugin's record modes, its deja_config fixture and the network it blocks.

Each test writes a small project (the count agent and a marked test of it) and runs pytest
on it in process (pytester's own run: a session of its own, its modules let go after),
against the stub model on 127.0.0.1 when it records.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from recorder.cassette import load
from recorder.testing.server import StubServer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from count_agent import SCRIPT  # noqa: E402

MODES = ("none", "once", "new_episodes", "all", "rewrite")
OFFLINE = "http://127.0.0.1:9"  # nothing listens here
TEST = """
import os, pytest
import agent

@pytest.mark.deja("cassettes/agent.jsonl"{kwargs})
def test_agent():
    assert agent.main() == 0
    assert not os.environ.get("FAIL_TEST"), "the test's own failure"
"""


@pytest.fixture(autouse=True)
def _mode_not_set_from_outside(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("CI", "DEJA_RECORD_MODE", "DEJA_ALLOW_UNVERIFIED", "AGENT_TURNS",
                "AGENT_PROMPT", "FAIL_TEST"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def live(stub: Callable[[dict], StubServer], monkeypatch: pytest.MonkeyPatch) -> StubServer:
    server = stub(SCRIPT)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    return server


def project(pytester: pytest.Pytester, marker_kwargs: str = "") -> Path:
    """The count agent and a marked test of it; its cassette's path."""
    pytester.makepyfile(agent=(ROOT / "tests" / "count_agent.py").read_text())
    pytester.makepyfile(test_agent=TEST.format(kwargs=marker_kwargs))
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    return pytester.path / "cassettes" / "agent.jsonl"


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)


def header(cassette: Path) -> dict:
    return json.loads(cassette.read_text().splitlines()[0])


def lines(cassette: Path) -> list[dict]:
    return [json.loads(line) for line in cassette.read_text().splitlines()]


def only_the_cassette(cassette: Path) -> None:
    """No file beside the cassette: no new recording, no lock left behind."""
    assert sorted(p.name for p in cassette.parent.iterdir()) == [cassette.name]


# -- the modes


def test_none_replays_and_a_missing_cassette_fails_saying_how_to_record(
        pytester: pytest.Pytester, live: StubServer) -> None:
    cassette = project(pytester)
    result = run(pytester, "--deja-record-mode=none")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([
        "*CassetteNotFound: cassettes/agent.jsonl does not exist, and the record mode is "
        "none (given by --deja-record-mode)*pytest --deja-record-mode=once "
        "test_agent.py::test_agent*"])
    assert not cassette.exists() and live.served == 0

    run(pytester, "--deja-record-mode=once").assert_outcomes(passed=1)
    recorded, served = cassette.read_bytes(), live.served
    assert served > 0
    run(pytester, "--deja-record-mode=none").assert_outcomes(passed=1)
    assert cassette.read_bytes() == recorded and live.served == served


@pytest.mark.parametrize(("ci", "records"), [("1", False), ("true", False),
                                              ("false", True), ("0", True), ("", True)])
def test_the_default_is_none_on_ci_and_once_elsewhere(
        pytester: pytest.Pytester, live: StubServer, monkeypatch: pytest.MonkeyPatch,
        ci: str, records: bool) -> None:
    cassette = project(pytester)
    monkeypatch.setenv("CI", ci)
    result = run(pytester)
    if records:
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines(["*deja: cassettes written*",
                                     "test_agent.py::test_agent: cassettes/agent.jsonl: "
                                     "recorded"])
        assert header(cassette)["argv"] == ["python", "-m", "pytest",
                                            "test_agent.py::test_agent"]
    else:
        result.assert_outcomes(errors=1)
        result.stdout.fnmatch_lines(["*CassetteNotFound: *the record mode is none (the "
                                     "default on CI, where CI is set)*"])
        assert not cassette.exists() and live.served == 0


def test_the_environment_sets_the_mode_and_the_flag_overrides_it(
        pytester: pytest.Pytester, live: StubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    cassette = project(pytester)
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("DEJA_RECORD_MODE", "once")  # over the default on CI
    run(pytester).assert_outcomes(passed=1)
    first = header(cassette)["run"]

    monkeypatch.setenv("DEJA_RECORD_MODE", "all")
    run(pytester, "--deja-record-mode=none").assert_outcomes(passed=1)  # the flag wins
    assert header(cassette)["run"] == first
    run(pytester).assert_outcomes(passed=1)  # the environment's mode: recorded anew
    assert header(cassette)["run"] != first

    monkeypatch.setenv("DEJA_RECORD_MODE", "sometimes")
    result = run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*DEJA_RECORD_MODE: record mode 'sometimes' is not one of "
                                 "none, once, new_episodes, all, rewrite*"])
    monkeypatch.delenv("DEJA_RECORD_MODE")
    result = run(pytester, "--deja-record", "--deja-rerecord")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--deja-record (once), --deja-rerecord (all) ask for "
                                 "different record modes*"])


def test_new_episodes_records_what_the_cassette_does_not_hold(
        pytester: pytest.Pytester, live: StubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    cassette = project(pytester)
    monkeypatch.setenv("AGENT_TURNS", "2")
    run(pytester, "--deja-record-mode=once").assert_outcomes(passed=1)
    old = header(cassette)
    assert [o.get("kind") for o in lines(cassette)].count("model") == 2
    before = live.served

    monkeypatch.setenv("AGENT_TURNS", "4")  # the agent now goes on for two more turns
    result = run(pytester, "--deja-record-mode=new_episodes")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*cassettes/agent.jsonl: grew: * steps replayed, then new "
                                 "calls recorded live*"])
    assert live.served - before == 2  # the recorded turns were replayed, not sent again
    grown = load(cassette)
    assert grown.verified and grown.run != old["run"]
    assert [o["kind"] for o in grown.observations].count("model") == 4
    assert grown.end is not None and grown.end["status"] == "completed"
    assert header(cassette)["argv"] == old["argv"] and header(cassette)["cassette"] == \
        "cassettes/agent.jsonl"
    only_the_cassette(cassette)

    monkeypatch.setenv("ANTHROPIC_BASE_URL", OFFLINE)  # the whole run replays offline
    run(pytester, "--deja-record-mode=none").assert_outcomes(passed=1)
    kept = cassette.read_bytes()
    run(pytester, "--deja-record-mode=new_episodes").assert_outcomes(passed=1)
    assert cassette.read_bytes() == kept  # nothing new asked: the file is left alone


def test_new_episodes_keeps_the_cassette_when_the_test_fails(
        pytester: pytest.Pytester, live: StubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    cassette = project(pytester)
    monkeypatch.setenv("AGENT_TURNS", "2")
    run(pytester, "--deja-record-mode=once").assert_outcomes(passed=1)
    recorded, before = cassette.read_bytes(), live.served

    monkeypatch.setenv("AGENT_TURNS", "4")
    monkeypatch.setenv("FAIL_TEST", "1")
    result = run(pytester, "--deja-record-mode=new_episodes")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*cassettes/agent.jsonl: kept as it was (the test failed*"])
    assert live.served - before == 2  # it went live...
    assert cassette.read_bytes() == recorded  # ...and the cassette is as it was
    only_the_cassette(cassette)


def test_all_replaces_the_cassette_only_when_the_test_passes_and_rewrite_always(
        pytester: pytest.Pytester, live: StubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    cassette = project(pytester)
    run(pytester, "--deja-record-mode=once").assert_outcomes(passed=1)
    recorded, before = cassette.read_bytes(), live.served

    monkeypatch.setenv("FAIL_TEST", "1")
    for flag in ("--deja-record-mode=all", "--deja-rerecord"):  # the alias is the same mode
        run(pytester, flag).assert_outcomes(failed=1)
        assert cassette.read_bytes() == recorded, flag
        only_the_cassette(cassette)
    assert live.served > before  # recorded live, and thrown away

    result = run(pytester, "--deja-record-mode=rewrite")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*cassettes/agent.jsonl: deleted, then recorded anew*"])
    rewritten = load(cassette)  # the failing test's own recording
    assert rewritten.run != header_run(recorded) and rewritten.end is not None
    assert rewritten.end["status"] == "error"

    monkeypatch.delenv("FAIL_TEST")
    run(pytester, "--deja-record-mode=all").assert_outcomes(passed=1)
    anew = load(cassette)
    assert anew.verified and anew.run != rewritten.run and anew.end is not None
    assert anew.end["status"] == "completed"
    assert header(cassette)["cassette"] == "cassettes/agent.jsonl"
    only_the_cassette(cassette)


def header_run(cassette_bytes: bytes) -> str:
    return str(json.loads(cassette_bytes.splitlines()[0])["run"])


def test_no_mode_records_an_incident_again(pytester: pytest.Pytester, live: StubServer,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cassette = project(pytester)
    monkeypatch.setenv("AGENT_TURNS", "2")
    run(pytester, "--deja-record-mode=once").assert_outcomes(passed=1)
    project(pytester, ", record=False")  # kept from now on as it happened
    incident, before = cassette.read_bytes(), live.served
    for mode in MODES:
        run(pytester, f"--deja-record-mode={mode}").assert_outcomes(passed=1)
        assert cassette.read_bytes() == incident, mode
    monkeypatch.setenv("DEJA_RECORD_MODE", "rewrite")
    run(pytester).assert_outcomes(passed=1)
    assert cassette.read_bytes() == incident and live.served == before

    monkeypatch.setenv("AGENT_TURNS", "4")  # a new call: it fails, it never goes live
    result = run(pytester, "--deja-record-mode=new_episodes")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*replay of r_*DIVERGED*"])
    assert cassette.read_bytes() == incident and live.served == before
    only_the_cassette(cassette)


# -- deja_config


CONFTEST = """
import pytest

@pytest.fixture(scope="module")
def deja_config():
    return {"normalise": [r"session (refresh|renewal)=SESSION"], "record_mode": "none"}
"""


def test_deja_config_gives_the_marker_defaults_and_the_marker_wins(
        pytester: pytest.Pytester, live: StubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    cassette = project(pytester)
    run(pytester, "--deja-record-mode=once").assert_outcomes(passed=1)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_more="""
        import pytest
        import agent

        @pytest.mark.deja("cassettes/agent.jsonl", normalise=[])
        def test_marker_policy():
            agent.main()

        @pytest.mark.deja("cassettes/new.jsonl")
        def test_config_mode():
            agent.main()

        @pytest.mark.deja("cassettes/other.jsonl", record_mode="once")
        def test_marker_mode():
            assert agent.main() == 0
    """)
    monkeypatch.setenv("AGENT_PROMPT", "Where is the session renewal implemented?")
    result = run(pytester, "-rA")
    result.assert_outcomes(passed=2, failed=1, errors=1)
    out = result.stdout.str()
    assert "PASSED test_agent.py::test_agent" in out  # the config's policy matched it
    assert "FAILED test_more.py::test_marker_policy - Failed: replay of r_" in out
    assert "ERROR test_more.py::test_config_mode - recorder.errors.CassetteNotFound" in out
    result.stdout.fnmatch_lines(["*the record mode is none (from deja_config)*"])
    assert "PASSED test_more.py::test_marker_mode" in out
    assert (cassette.parent / "other.jsonl").exists()
    assert not (cassette.parent / "new.jsonl").exists()

    pytester.makeconftest("""
        import pytest

        @pytest.fixture
        def deja_config():
            return {"ignroe": ["/metadata"]}
    """)
    result = run(pytester, "test_agent.py")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*the deja_config fixture does not take ignroe; it takes "
                                 "record_mode, allow_unverified, ignore, normalise, "
                                 "allowed_hosts*"])


# -- the network during a replay


NETWORK_TESTS = """
import os, socket
import pytest
import agent

PORT = int(os.environ["HEALTH_PORT"])

def health():
    \"\"\"An HTTP exchange over a raw socket (deja captures HTTP clients, not sockets).\"\"\"
    with socket.create_connection(("127.0.0.1", PORT), timeout=30) as sock:
        sock.sendall(b"GET /_stub/health HTTP/1.0\\r\\nHost: 127.0.0.1\\r\\n\\r\\n")
        return sock.makefile("rb").readline().split()[1]

@pytest.mark.deja("cassettes/agent.jsonl")
def test_blocked():
    assert agent.main() == 0
    health()

@pytest.mark.deja("cassettes/agent.jsonl")
def test_swallowed():
    assert agent.main() == 0
    try:
        health()
    except Exception:
        pass

@pytest.mark.deja("cassettes/agent.jsonl", allowed_hosts=["127.0.0.1"])
def test_allowed():
    assert agent.main() == 0
    assert health() == b"200"
"""

BY_CONFIG = """
import pytest
import agent
from test_network import health

@pytest.fixture(scope="module")
def deja_config():
    return {"allowed_hosts": ["localhost"]}

@pytest.mark.deja("cassettes/agent.jsonl")
def test_allowed_by_name():
    assert agent.main() == 0
    assert health() == b"200"
"""


@pytest.fixture
def health_server(stub: Callable[[dict], StubServer]) -> StubServer:
    """A real server listening on 127.0.0.1, for the tests to connect to."""
    return stub({"default": {"text": "ok"}})


def test_a_replay_blocks_connections_to_hosts_not_allowed(
        pytester: pytest.Pytester, live: StubServer, health_server: StubServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    project(pytester)
    run(pytester, "--deja-record-mode=once").assert_outcomes(passed=1)  # recording: live
    pytester.makepyfile(test_network=NETWORK_TESTS, test_by_config=BY_CONFIG)
    port = health_server.url.rsplit(":", 1)[1].split("/")[0]
    monkeypatch.setenv("HEALTH_PORT", port)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", OFFLINE)
    result = run(pytester, "-rA", "test_network.py", "test_by_config.py")
    result.assert_outcomes(passed=2, failed=2)
    out = result.stdout.str()
    assert "PASSED test_network.py::test_allowed" in out
    assert "PASSED test_by_config.py::test_allowed_by_name" in out
    blocked = (f"a connection to 127.0.0.1:{port} was blocked: the test replays "
               "cassettes/agent.jsonl")
    for name in ("test_blocked", "test_swallowed"):
        line = next(x for x in out.splitlines() if x.startswith(f"FAILED test_network.py::"
                                                                f"{name}"))
        assert "NetworkBlocked" in line, line
    assert out.count(blocked) >= 2, out
    assert "allowed_hosts=['127.0.0.1']" in out
    assert "replayer/network.py" not in out  # the traceback ends in the test's own code
