"""What the framework tests share: the stub's script, a function that records an
unmodified framework agent (tests/frameworks/agents) under ``deja record`` and replays it
under ``deja replay`` as real processes, and one that imports the agent with its tool
under ``@recorder.tool`` (``AGENT_TOOL_STEPS=1``) for a test to record in process.

The processes are what these tests cost (a framework takes one to three seconds to import),
so each agent runs under the CLI three times only (recorded, replayed, replayed with a
changed question), and the variant under ``@recorder.tool`` is recorded and replayed in
this process, where the framework is imported once.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import recorder
import replayer
from recorder.cassette import load
from recorder.testing.server import StubServer

AGENTS = Path(__file__).resolve().parent / "agents"

PROMPT = "What does 'deja' mean?"
CHANGED = "What does 'vu' mean?"
TEXTS = ["Let me look that up.", "It means 'already'."]
ANSWER = f"answer: {TEXTS[1]}"
TOOL_ARGS = {"word": "deja"}
TOOL_RESULT = "deja: French for 'already'"
# Answered in order: the tool runner continues a server-side thread by the id of the last
# reply (``thread.previous_message_id``), which a conversation-position script cannot place.
SCRIPT = {"select": "sequence", "turns": [
    {"text": TEXTS[0], "tool_use": {"name": "lookup", "input": TOOL_ARGS}},
    {"text": TEXTS[1]}]}
KEY = "test-key-0123456789abcdef"  # tests/conftest.py's: the tests read the cassettes
OFFLINE = "http://127.0.0.1:9"  # nothing listens there: a replay must need no server
TIMEOUT = 120


@dataclass
class Runs:
    """The cassette of one agent recorded unmodified, and the processes that made and
    replayed it."""

    plain: Path
    requests: list[dict[str, Any]]  # what the stub received
    recorded: subprocess.CompletedProcess[str]
    replayed: dict[str, subprocess.CompletedProcess[str]]  # plain, changed, and the others


def deja(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``deja ARGS`` as a real process."""
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True,
                          text=True, timeout=TIMEOUT, env=env, cwd=cwd)


def base_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of a run: this one's, with its own key home and signing key, and
    none of the provider settings a developer's shell may hold."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANTHROPIC_", "OPENAI_", "DEJA_", "AGENT_", "LANGSMITH_",
                                "LANGCHAIN_", "LOGFIRE_"))}
    env.update(DEJA_HOME=str(home), DEJA_KEY=KEY, **extra)
    return env


def run_cli(agent: str, workdir: Path, url_var: str, url_suffix: str = "", *,
            replays: dict[str, dict[str, str]] | None = None, **extra: str) -> Runs:
    """``deja record -o plain.jsonl -- python agents/AGENT`` against a stub, the stub
    stopped, then ``deja replay`` of the cassette as it is and with the question changed
    (side by side), and with each environment of ``replays`` (by name). ``url_var`` is the
    environment variable that points the framework's client at a server (``url_suffix`` is
    added to the stub's URL); ``extra`` is more of the environment (the key, a framework's
    switches)."""
    env = base_env(workdir / "home", **extra)
    plain = workdir / "plain.jsonl"
    with StubServer(SCRIPT) as server:
        recorded = deja("record", "-o", str(plain), "--", "python", str(AGENTS / agent),
                        cwd=workdir, env={**env, url_var: server.url + url_suffix})
        requests = server.received()
    offline = {**env, url_var: OFFLINE + url_suffix}  # the stub is gone: replays need none
    envs = {"plain": offline, "changed": {**offline, "AGENT_PROMPT": CHANGED},
            **{name: {**offline, **more} for name, more in (replays or {}).items()}}
    replayed = _parallel({name: partial(deja, "replay", str(plain), env=env, cwd=workdir)
                          for name, env in envs.items()})
    return Runs(plain, requests, recorded, replayed)


def load_agent(agent: str, monkeypatch: pytest.MonkeyPatch, **env: str) -> ModuleType:
    """``agents/AGENT`` imported under a name of its own, after ``env`` is set, with its tool
    under ``@recorder.tool`` (``AGENT_TOOL_STEPS=1``): the frameworks read their settings
    when the agent is built, at import."""
    for name, value in {**env, "AGENT_TOOL_STEPS": "1"}.items():
        monkeypatch.setenv(name, value)
    name = f"deja_framework_{Path(agent).stem}"
    spec = importlib.util.spec_from_file_location(name, AGENTS / agent)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parallel(jobs: dict[str, Callable[[], subprocess.CompletedProcess[str]]]
              ) -> dict[str, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def steps(path: Path) -> list[dict[str, Any]]:
    """The cassette's steps."""
    return [dict(o) for o in load(path)]


def bodies(path: Path) -> list[dict[str, Any]]:
    """The request body of each model step, whole (a cassette stores most as what they add
    to an earlier one), as a replay compares them."""
    cassette = load(path)
    return [cassette.request_of(o["seq"]) for o in cassette if o["kind"] == "model"]


def assert_recorded_and_replayed(runs: Runs, provider: str, secret: str) -> None:
    """The recording completed with the agent's answer; the cassette holds the two model
    calls the stub received and nothing else (no tool step: the framework runs the tool
    where deja does not see it), and not the API key; the replay is identical and prints
    the same answer."""
    assert runs.recorded.returncode == 0, output(runs.recorded)
    assert ANSWER in runs.recorded.stdout, output(runs.recorded)
    lines = steps(runs.plain)
    assert [(o["kind"], o["provider"]) for o in lines] == [("model", provider)] * 2
    assert len(runs.requests) == 2
    assert secret not in runs.plain.read_text()
    proc = runs.replayed["plain"]
    assert proc.returncode == 0, output(proc)
    assert ": identical" in proc.stdout and ANSWER in proc.stdout, output(proc)
    assert "2/2 served" in proc.stdout, output(proc)


def assert_changed_prompt_diverges(runs: Runs) -> None:
    """The cassette replayed with another question: exit 1 at step 0, with a diff that
    shows both questions."""
    proc = runs.replayed["changed"]
    assert proc.returncode == 1, output(proc)
    assert "DIVERGED" in proc.stdout and "divergence: step 0 (model)" in proc.stdout, \
        output(proc)
    assert PROMPT in proc.stdout and CHANGED in proc.stdout, output(proc)


def assert_tool_steps(path: Path, plain: Path) -> None:
    """With ``@recorder.tool`` under the framework's own tool decorator, the framework's
    call of the tool is a tool step between the two model calls, and the model was sent
    the same first request as without it (the decorator keeps the signature and the
    docstring the framework builds the tool's schema from)."""
    lines = steps(path)
    assert [o["kind"] for o in lines] == ["model", "tool", "model"]
    tool = lines[1]
    assert (tool["name"], tool["args"], tool["result"]) == ("lookup", TOOL_ARGS, TOOL_RESULT)
    assert bodies(path)[0] == bodies(plain)[0]


@contextmanager
def own_loop() -> Iterator[None]:
    """A new default event loop for the thread, closed after: Pydantic AI's and the Agents
    SDK's ``run_sync`` run on the thread's default loop, and the Agents SDK shuts down its
    async generators after each run (agents/run.py), so a second run on that loop, in
    this test or a later one, warns (an error in this suite)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        asyncio.set_event_loop(None)


def record_and_replay_in_process(agent: ModuleType, path: Path, server: StubServer,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Record ``agent.main()`` into ``path`` against ``server``, stop the server, replay it:
    identical, the tool served from the cassette, the same answer printed both times."""
    with recorder.record(path), own_loop():
        agent.main()
    server.stop()
    with replayer.replay(path) as run, own_loop():
        agent.main()
    assert run.result is not None and run.result.identical, run.result and run.result.report()
    assert capsys.readouterr().out == f"{ANSWER}\n" * 2
