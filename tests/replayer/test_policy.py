"""The replay policy: what may differ between a recording and its replay, and the nearest
recorded request when nothing matches.

The real anthropic SDK against the stub server records a run whose system prompt holds
the date and whose metadata holds a user id; it is replayed with another date and another
user, through ``replayer.replay``, the pytest marker in a real pytest process, ``deja
replay`` running a program and ``deja proxy --replay``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anthropic
import pytest
from conftest import MODEL

import recorder
import replayer
from recorder.errors import ConfigError, Divergence
from replayer.policy import ReplayPolicy, nearest


def agent(base_url: str, *, date: str, user: str, question: str = "What is due?") -> str:
    with anthropic.Anthropic(base_url=base_url, api_key="sk-stub", max_retries=0) as client:
        reply = client.messages.create(
            model=MODEL, max_tokens=64, system=f"Today is {date}. You are a billing assistant.",
            metadata={"user_id": user}, messages=[{"role": "user", "content": question}])
    return reply.content[0].text  # type: ignore[union-attr]


@pytest.fixture
def cassette(stub: Any, tmp_path: Path) -> Path:
    server = stub({"default": {"text": "INV-7 is due."}})
    path = tmp_path / "dated.jsonl"
    with recorder.record(path):
        assert agent(server.url, date="2026-12-01", user="u-1") == "INV-7 is due."
    server.stop()
    return path


DATES = ReplayPolicy.parse(normalise=[r"\d{4}-\d{2}-\d{2}=DATE"])
USERS = ReplayPolicy(ignore=("/metadata/user_id",))


def test_without_a_policy_another_date_diverges_and_names_the_nearest_request(
        cassette: Path) -> None:
    with pytest.raises(Divergence) as diverged, replayer.replay(cassette):
        agent("http://127.0.0.1:9", date="2026-12-03", user="u-1")
    assert diverged.value.info.nearest == \
        "nearest recorded request: step 0, which differs in system"
    assert "nearest recorded request: step 0, which differs in system" in str(diverged.value)


def test_a_normalised_date_and_an_ignored_user_replay_identically(cassette: Path) -> None:
    both = ReplayPolicy(ignore=USERS.ignore, normalise=DATES.normalise)
    with replayer.replay(cassette, policy=both) as run:
        assert agent("http://127.0.0.1:9", date="2027-01-15", user="u-2") == "INV-7 is due."
    assert run.result is not None and run.result.identical
    with pytest.raises(Divergence) as diverged, replayer.replay(cassette, policy=DATES):
        agent("http://127.0.0.1:9", date="2027-01-15", user="u-2")  # the user still counts
    assert diverged.value.info.nearest is not None
    assert diverged.value.info.nearest.endswith("differs in metadata")
    with pytest.raises(Divergence), replayer.replay(cassette, policy=both):  # the question does
        agent("http://127.0.0.1:9", date="2027-01-15", user="u-2", question="Pay it?")


def test_the_marker_carries_the_policy_into_a_test(pytester: pytest.Pytester,
                                                    cassette: Path) -> None:
    pytester.makepyfile(textwrap.dedent(f"""
        import anthropic, pytest

        def ask():
            client = anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key="k",
                                         max_retries=0)
            reply = client.messages.create(
                model={MODEL!r}, max_tokens=64,
                system="Today is 2031-06-30. You are a billing assistant.",
                metadata={{"user_id": "someone-else"}},
                messages=[{{"role": "user", "content": "What is due?"}}])
            return reply.content[0].text

        @pytest.mark.deja({str(cassette)!r}, ignore=["/metadata/user_id"],
                          normalise=[r"\\d{{4}}-\\d{{2}}-\\d{{2}}=DATE"])
        def test_tolerant():
            assert ask() == "INV-7 is due."

        @pytest.mark.deja({str(cassette)!r})
        def test_strict():
            ask()
    """))
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_strict*", "*nearest recorded request: step 0, "
                                 "which differs in metadata, system"])


def test_a_policy_refuses_what_it_cannot_read() -> None:
    with pytest.raises(ConfigError, match="starts with /"):
        ReplayPolicy(ignore=("metadata/user_id",))
    with pytest.raises(ConfigError, match="not a regular expression"):
        ReplayPolicy.parse(normalise=["([0-9]=X"])
    with pytest.raises(ConfigError, match="PATTERN=REPLACEMENT"):
        ReplayPolicy.parse(normalise=["no-equals-sign"])


def test_ignore_takes_a_wildcard_and_leaves_the_original_alone() -> None:
    body = {"messages": [{"role": "user", "content": "a", "id": 1},
                         {"role": "assistant", "content": "b", "id": 2}], "keep": True}
    read = ReplayPolicy(ignore=("/messages/*/id",)).request(body)
    assert read == {"messages": [{"role": "user", "content": "a"},
                                 {"role": "assistant", "content": "b"}], "keep": True}
    assert body["messages"][0]["id"] == 1  # a copy was changed, not the request


def test_nearest_ranks_by_fields_equal_then_recorded_order() -> None:
    sent = {"model": "m", "system": "s2", "messages": ["q1", "q2"]}
    candidates = [(3, {"model": "m", "system": "s1", "messages": ["q1", "x"]}),
                  (5, {"model": "m", "system": "s1", "messages": ["q1", "q2"]}),
                  (7, {"model": "m", "system": "s9", "messages": ["q1", "q2"]})]
    assert nearest(sent, candidates) == (5, ["system"])
    assert nearest(sent, []) is None


AGENT_FILE = f'''\
import os, anthropic
client = anthropic.Anthropic(base_url="http://127.0.0.1:9", api_key="k", max_retries=0)
reply = client.messages.create(
    model={MODEL!r}, max_tokens=64,
    system=f"Today is {{os.environ['AGENT_DATE']}}. You are a billing assistant.",
    metadata={{"user_id": os.environ["AGENT_USER"]}},
    messages=[{{"role": "user", "content": "What is due?"}}])
print(reply.content[0].text)
'''
POLICY_FLAGS = ["--normalise", "[0-9]{4}-[0-9]{2}-[0-9]{2}=DATE", "--ignore", "/metadata/user_id"]


def _deja(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=120, env={**os.environ, **env})


def test_deja_replay_takes_the_policy_into_the_program(cassette: Path, tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text(AGENT_FILE)
    later = {"AGENT_DATE": "2027-02-02", "AGENT_USER": "u-9"}
    strict = _deja("replay", str(cassette), "--", sys.executable, "agent.py", cwd=tmp_path,
                   **later)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "nearest recorded request: step 0, which differs in metadata, system" in strict.stdout
    tolerant = _deja("replay", str(cassette), *POLICY_FLAGS, "--", sys.executable, "agent.py",
                     cwd=tmp_path, **later)
    assert tolerant.returncode == 0, tolerant.stdout + tolerant.stderr
    assert "INV-7 is due." in tolerant.stderr + tolerant.stdout and ": identical" in tolerant.stdout
    bad = _deja("replay", str(cassette), "--ignore", "metadata", "--", sys.executable,
                "agent.py", cwd=tmp_path, **later)
    assert bad.returncode == 2 and "starts with /" in bad.stderr, bad.stderr
    assert "INV-7" not in bad.stdout + bad.stderr  # refused before the program ran


def test_the_proxy_replays_under_the_policy(cassette: Path, tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proxy = subprocess.Popen([sys.executable, "-m", "deja", "proxy", "--replay", str(cassette),
                              *POLICY_FLAGS, "--port", "0", "--ready-file", str(ready), "-q"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.is_file():
            assert proxy.poll() is None and time.monotonic() < deadline, "no proxy"
            time.sleep(0.02)
        url = json.loads(ready.read_text())["url"]
        assert agent(url, date="2028-03-03", user="u-3") == "INV-7 is due."
    finally:
        proxy.terminate()
        out, _ = proxy.communicate(timeout=60)
    assert ": identical" in out, out
