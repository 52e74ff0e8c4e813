"""Offline replay needs no API key: an agent that builds its client the usual way
(``anthropic.Anthropic()``, which refuses to start without ``ANTHROPIC_API_KEY``) replays
in CI, where no key is set, in process, through ``deja replay`` and under the pytest
plugin; and a test that fails before its first call is reported as that, not as a change.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import anthropic
import pytest

import recorder
import replayer
from recorder.providers import PLACEHOLDER_KEY
from recorder.testing.server import StubServer

AGENT = """\
import anthropic

client = anthropic.Anthropic()  # the key from the environment, as real agents do
reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=32,
                               messages=[{"role": "user", "content": "hi"}])
print(reply.content[0].text)
"""

KEY_VARS = ("ANTHROPIC_API_KEY", "OPENAI_API_KEY")


def _without_keys() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in KEY_VARS}


@pytest.fixture(scope="module")
def recorded_once(tmp_path_factory: pytest.TempPathFactory,
                  module_env: dict[str, str]) -> tuple[Path, str]:
    """A run of AGENT recorded through ``deja record`` with a key, once for the module;
    the stub's URL (nothing listens there any more)."""
    folder = tmp_path_factory.mktemp("placeholder-keys")
    (folder / "agent.py").write_text(AGENT)
    without_keys = {k: v for k, v in module_env.items() if k not in KEY_VARS}
    with StubServer({"default": {"text": "hello"}}) as server:
        done = subprocess.run(
            [sys.executable, "-m", "deja", "record", "-o", "run.jsonl", "--", "python",
             "agent.py"], cwd=folder, capture_output=True, text=True, timeout=120,
            env={**without_keys, "ANTHROPIC_API_KEY": "sk-real-looking",
                 "ANTHROPIC_BASE_URL": server.url})
    assert done.returncode == 0, done.stderr
    return folder / "run.jsonl", server.url


@pytest.fixture
def recorded(tmp_path: Path, recorded_once: tuple[Path, str]) -> tuple[Path, str]:
    """The recorded run and its agent, copied into this test's folder; the stub's URL."""
    path, url = recorded_once
    for name in ("agent.py", "run.jsonl"):
        shutil.copyfile(path.parent / name, tmp_path / name)
    return tmp_path / "run.jsonl", url


def test_deja_replay_runs_an_agent_without_a_key(recorded: tuple[Path, str]) -> None:
    path, url = recorded
    done = subprocess.run([sys.executable, "-m", "deja", "replay", str(path)],
                          cwd=path.parent, capture_output=True, text=True, timeout=120,
                          env={**_without_keys(), "ANTHROPIC_BASE_URL": url})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hello" in done.stderr + done.stdout and "identical" in done.stdout, done.stdout


def test_an_in_process_replay_sets_a_placeholder_only_while_it_lasts(
        recorded: tuple[Path, str], monkeypatch: pytest.MonkeyPatch) -> None:
    path, url = recorded
    for var in KEY_VARS:
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(TypeError, match="authentication"):  # what CI sees without deja
        anthropic.Anthropic(base_url=url).messages.create(
            model="claude-sonnet-4-6", max_tokens=32,
            messages=[{"role": "user", "content": "hi"}])
    with replayer.replay(path) as replaying:
        assert {os.environ[v] for v in KEY_VARS} == {PLACEHOLDER_KEY}
        client = anthropic.Anthropic(base_url=url)
        reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=32,
                                       messages=[{"role": "user", "content": "hi"}])
        client.close()
    assert reply.content[0].text == "hello"
    assert replaying.result is not None and replaying.result.identical
    assert not [v for v in KEY_VARS if v in os.environ]  # taken out again


def test_a_key_that_is_set_is_left_as_it_is(recorded: tuple[Path, str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = recorded
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-mine")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with replayer.replay(path, raise_on_divergence=False):  # no call made: just the keys
        assert os.environ["ANTHROPIC_API_KEY"] == "sk-mine"
        assert os.environ["OPENAI_API_KEY"] == PLACEHOLDER_KEY
    assert os.environ["ANTHROPIC_API_KEY"] == "sk-mine" and "OPENAI_API_KEY" not in os.environ


def test_the_pytest_plugin_replays_without_a_key_and_names_an_early_failure(
        recorded: tuple[Path, str], pytester: pytest.Pytester) -> None:
    path, url = recorded
    pytester.makepyfile(f"""
        import anthropic, pytest

        def ask():
            client = anthropic.Anthropic(base_url={url!r})
            return client.messages.create(model="claude-sonnet-4-6", max_tokens=32,
                                          messages=[{{"role": "user", "content": "hi"}}])

        @pytest.mark.deja({str(path)!r})
        def test_incident():
            assert ask().content[0].text == "hello"

        @pytest.mark.deja({str(path)!r})
        def test_broken_before_its_first_call():
            raise RuntimeError("the fixture data is missing")
    """)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    env = {"DEJA_HOME": os.environ["DEJA_HOME"], "DEJA_KEY": os.environ["DEJA_KEY"]}
    with pytest.MonkeyPatch.context() as mp:
        for var in KEY_VARS:
            mp.delenv(var, raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "RuntimeError: the fixture data is missing" in out, out
    assert "before its first recorded call" in out, out
    assert "code or inputs changed" not in out, out


def test_recording_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No placeholder while recording: a missing key is the SDK's own error, at once."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with recorder.record(tmp_path / "r.jsonl"):
        assert "ANTHROPIC_API_KEY" not in os.environ
        with pytest.raises(TypeError, match="authentication"):
            anthropic.Anthropic(base_url="http://127.0.0.1:9").messages.create(
                model="claude-sonnet-4-6", max_tokens=32,
                messages=[{"role": "user", "content": "hi"}])


def test_deja_replay_names_a_program_that_fails_before_its_first_call(
        tmp_path: Path) -> None:
    """Not a divergence of the agent's code: the program stopped before it asked for
    anything (here a setting the recording had and CI has not)."""
    (tmp_path / "agent.py").write_text('import os\nos.environ["AGENT_CONFIG"]\n' + AGENT)
    with StubServer({"default": {"text": "hello"}}) as server:
        env = {**_without_keys(), "ANTHROPIC_BASE_URL": server.url}
        done = subprocess.run(
            [sys.executable, "-m", "deja", "record", "-o", "run.jsonl", "--", "python",
             "agent.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
            env={**env, "ANTHROPIC_API_KEY": "sk-test", "AGENT_CONFIG": "prod"})
        assert done.returncode == 0, done.stderr
    replayed = subprocess.run([sys.executable, "-m", "deja", "replay", "run.jsonl"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env=env)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    report = replayed.stdout
    assert ": FAILED BEFORE ITS FIRST CALL" in report, report
    assert "  recorded:   completed, exit status 0" in report, report
    assert "  replayed:   exit status 1 (KeyError: 'AGENT_CONFIG')" in report, report
    assert "nothing was compared" in report and "code or inputs changed" not in report, report
