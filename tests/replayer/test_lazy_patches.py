"""A replay patches the SDKs the program imports, when it imports them, and no others.

Importing the Anthropic and OpenAI SDKs costs a fresh interpreter over a second; a replay
that imported both up front to silence their retry sleeps made every ``deja replay`` (and
every incident of a suite) pay it, whatever the program used. These tests run real
``deja record`` / ``deja replay`` processes on programs that import an SDK after the
session started, or none at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from recorder.testing.server import StubServer

SDKS = ("anthropic", "openai", "google.genai", "mcp")

# Uses only deja's own tool seam: no SDK.
PLAIN = f'''\
import json, sys
import recorder

@recorder.tool
def add(a: int, b: int) -> int:
    return a + b

print("sum", add(2, 3))
print("loaded", json.dumps(sorted(m for m in {SDKS!r} if m in sys.modules)))
'''

# Imports the SDK only once deja's session is running (as any program does), with
# ``time.sleep`` replaced first by a stand-in that notes each wait instead of sleeping: the
# SDK's retry backoff goes through it unless the replay has silenced it.
RETRYING = '''\
import json, time
waits = []
time.sleep = waits.append

import anthropic

client = anthropic.Anthropic(max_retries=2)
reply = client.messages.create(model="claude-sonnet-4-5", max_tokens=32,
                               messages=[{"role": "user", "content": "hi"}])
print("text", reply.content[0].text)
print("waits", json.dumps(waits))
'''


def _deja(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120)


def _said(out: str, key: str) -> str:
    lines = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(key + " ")]
    assert lines, f"the program did not print {key!r}: {out!r}"
    return lines[-1]


@pytest.fixture
def run(tmp_path: Path, deja_home: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    env = {**os.environ, "ANTHROPIC_API_KEY": "sk-test", "PYTHONUNBUFFERED": "1"}

    def deja(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        done = _deja(*args, cwd=tmp_path, env={**env, **extra})
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    return deja


def test_a_replay_imports_no_sdk_the_program_does_not(tmp_path: Path, run) -> None:
    (tmp_path / "plain.py").write_text(PLAIN)
    recorded = run("record", "-o", "plain.jsonl", "--", "python", "plain.py")
    replayed = run("replay", "plain.jsonl")
    assert _said(replayed.stdout, "sum") == "5"
    assert json.loads(_said(recorded.stdout, "loaded")) == []
    assert json.loads(_said(replayed.stdout, "loaded")) == []


def test_an_sdk_imported_after_the_replay_started_has_its_backoff_silenced(
        tmp_path: Path, run) -> None:
    (tmp_path / "retrying.py").write_text(RETRYING)
    script = {"turns": [{"error": {"status": 529, "retry_after": 3}}, {"text": "after"}]}
    with StubServer(script) as server:
        recorded = run("record", "-o", "retry.jsonl", "--", "python", "retrying.py",
                       ANTHROPIC_BASE_URL=server.url)
    # Recording: the SDK really got the 529 and waited what it said (noted, not slept).
    assert 3.0 in json.loads(_said(recorded.stdout, "waits"))
    replayed = run("replay", "retry.jsonl")
    assert _said(replayed.stdout, "text") == "after"
    assert 3.0 not in json.loads(_said(replayed.stdout, "waits"))
