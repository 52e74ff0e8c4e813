"""``deja proxy --replay`` matches under the policy a replay builds: the
``[tool.deja.match]`` of the project it runs in, what each provider declares volatile, and
``--ignore``/``--normalise``. A run recorded through the proxy with today's date in its
system prompt is served on another day in a project that declares the date volatile, and
diverges in one that does not. Real ``deja proxy`` processes, the real anthropic SDK.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anthropic
import pytest
from proxy_helpers import ProxyProcess, cassettes

from recorder.testing.server import StubServer

Proxy = Callable[..., ProxyProcess]
MODEL = "claude-sonnet-4-6"
MATCH = "[tool.deja.match]\nnormalise = ['[0-9]{4}-[0-9]{2}-[0-9]{2}=DATE']\n"


def ask(url: str, today: str) -> anthropic.types.Message | anthropic.APIStatusError:
    """One billing question with ``today`` in the system prompt; the reply or the error."""
    with anthropic.Anthropic(base_url=url, api_key="sk-ant-proxy-match",
                             max_retries=0) as client:
        try:
            return client.messages.create(
                model=MODEL, max_tokens=64,
                system=f"Today is {today}. You are a billing assistant.",
                messages=[{"role": "user", "content": "What is due?"}])
        except anthropic.APIStatusError as exc:
            return exc


@pytest.fixture
def recorded(proxy: Proxy, stub: Callable[[dict], StubServer], tmp_path: Path) -> Path:
    """A run recorded through the proxy on 2026-12-01."""
    upstream = stub({"default": {"text": "INV-7 is due."}})
    recording = proxy("--upstream", upstream.url, "--dir", str(tmp_path / "runs"))
    reply = ask(recording.url, "2026-12-01")
    assert isinstance(reply, anthropic.types.Message), reply
    code, log = recording.stop()
    assert code == 0, log
    [path] = cassettes(tmp_path / "runs")
    return path


def project(root: Path, match: str) -> Path:
    root.mkdir()
    (root / "pyproject.toml").write_text(f"[project]\nname = 'billing'\n\n{match}")
    return root


def test_the_projects_match_rules_let_another_day_replay(proxy: Proxy, recorded: Path,
                                                         tmp_path: Path) -> None:
    replaying = proxy("--replay", str(recorded), workdir=project(tmp_path / "declared", MATCH))
    reply = ask(replaying.url, "2027-03-04")
    assert isinstance(reply, anthropic.types.Message), reply
    assert reply.content[0].text == "INV-7 is due."  # type: ignore[union-attr]
    code, log = replaying.stop()
    assert code == 0, log
    assert ": equivalent: identical but for declared-volatile fields" in log, log
    assert "differing only in /system" in log, log


def test_without_the_rules_another_day_diverges(proxy: Proxy, recorded: Path,
                                                tmp_path: Path) -> None:
    replaying = proxy("--replay", str(recorded), workdir=project(tmp_path / "plain", ""))
    reply = ask(replaying.url, "2027-03-04")
    assert isinstance(reply, anthropic.APIStatusError) and reply.status_code == 400, reply
    code, log = replaying.stop()
    assert code == 1, log
    assert "DIVERGED" in log and "changed_request (prompt)" in log, log


def test_a_normaliser_given_on_the_command_line_adds_to_the_projects(
        proxy: Proxy, recorded: Path, tmp_path: Path) -> None:
    replaying = proxy("--replay", str(recorded),
                      "--normalise", "[0-9]{4}-[0-9]{2}-[0-9]{2}=DATE",
                      workdir=project(tmp_path / "plain", ""))
    reply = ask(replaying.url, "2027-03-04")
    assert isinstance(reply, anthropic.types.Message), reply
    code, log = replaying.stop()
    assert code == 0 and ": equivalent" in log, log
