"""deja's commands run warm (as forks of a fork server, as a suite runs its incidents): the
program deja launches is itself a fork, and records, replays and stops as it does cold.

Real processes throughout: a fork server (:class:`recorder.harness.warm_pool.WarmPool`)
that has imported deja and the Anthropic SDK, ``deja record`` / ``deja replay`` started
through it, the stub server, and signals sent to real pids.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from recorder.harness.warm_pool import WarmChild, WarmPool
from recorder.testing.server import StubServer

AGENT = '''\
import json, os, sys, time
import anthropic
import recorder

@recorder.tool
def search(query: str) -> str:
    return "results for " + query

client = anthropic.Anthropic(max_retries=0)
reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=32,
                               messages=[{"role": "user", "content": "hi"}])
print("warm", json.dumps("warm_marker" in sys.modules), flush=True)
if os.environ.get("AGENT_HOLD"):
    open(os.environ["AGENT_HOLD"], "w").write(str(os.getpid()))
    for _ in range(3000):  # short sleeps: a signal landing just before one is acted on
        time.sleep(0.02)
print(reply.content[0].text, search("session"), flush=True)
'''


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WarmPool]:
    lib = tmp_path_factory.mktemp("marker")
    (lib / "warm_marker.py").write_text("")  # imported by the server only
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(lib), saved) if p)
    try:
        with WarmPool(["deja.cli", "deja.boot", "replayer.replay", "anthropic",
                       "warm_marker"]) as server:
            yield server
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved


@pytest.fixture
def project(tmp_path: Path, deja_home: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    (tmp_path / "agent.py").write_text(AGENT)
    with StubServer({"default": {"text": "ok"}}) as server:
        yield tmp_path, {**os.environ, "ANTHROPIC_BASE_URL": server.url,
                         "ANTHROPIC_API_KEY": "sk-test", "PYTHONUNBUFFERED": "1"}


def _deja(pool: WarmPool, cwd: Path, env: dict[str, str], *args: str) -> WarmChild:
    err = (cwd / "stderr.txt").open("w+b")
    child = pool.start([sys.executable, "-m", "deja", *args], cwd=str(cwd), stderr=err,
                       env=env)
    err.close()  # the child has its own copy
    assert child is not None
    return child


def _end(path: Path) -> dict:
    return json.loads(path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1])


def _wait_for(path: Path) -> int:
    deadline = time.monotonic() + 120
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return int(path.read_text())


def test_a_warm_record_and_replay_match_and_the_program_is_a_warm_fork(pool, project) -> None:
    root, env = project
    recorded = _deja(pool, root, env, "record", "-o", "run.jsonl", "--", "python", "agent.py")
    out, _ = recorded.communicate()
    assert recorded.returncode == 0, (root / "stderr.txt").read_text()
    assert out.decode().splitlines() == ["warm true", "ok results for session"]
    assert _end(root / "run.jsonl")["status"] == "completed"
    replayed = _deja(pool, root, {**env, "ANTHROPIC_BASE_URL": "http://127.0.0.1:9"},
                     "replay", "run.jsonl")
    out, _ = replayed.communicate()
    assert replayed.returncode == 0, (root / "stderr.txt").read_text()
    assert out.decode().splitlines()[:2] == ["warm true", "ok results for session"]
    assert "identical" in (root / "stderr.txt").read_text() + out.decode()


@pytest.mark.parametrize("to", ["deja", "program"])
def test_a_warm_run_stopped_by_sigterm_ends_interrupted(pool, project, to: str) -> None:
    """SIGTERM to ``deja record`` is passed on to the program; to the program alone, it
    ends the run too: either way the end line says interrupted, and the status is 143."""
    root, env = project
    held = root / "held.pid"
    run = _deja(pool, root, {**env, "AGENT_HOLD": str(held)}, "record", "-o", "run.jsonl",
                "--", "python", "agent.py")
    program = _wait_for(held)
    assert program != run.pid
    os.kill(run.pid if to == "deja" else program, signal.SIGTERM)
    run.communicate()
    assert run.returncode == 128 + signal.SIGTERM, (root / "stderr.txt").read_text()
    end = _end(root / "run.jsonl")
    assert (end["status"], end["exit_code"]) == ("interrupted", 128 + signal.SIGTERM)
