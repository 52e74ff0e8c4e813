"""Agents whose tools come from the ledger MCP server through a framework, unmodified:
Pydantic AI's ``MCPToolset`` (FastMCP's client over stdio), LangChain's ``langchain.mcp``
(``MCPAdapter``, FastMCP's client too) under ``create_agent``, and the OpenAI Agents SDK's
``MCPServerStdio``, each against the stub model. Recorded with the server running, replayed
bit for bit with the server's command and the model gone, forked at the lookup's result:
the model is asked again and calls the refund, which the fork does not run unless named
live (the server annotated it ``destructiveHint``).

The output is read with ``capfd``: FastMCP's stdio transport hands the server the
process's ``sys.stderr`` to write to, which must be a real file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from mcp_helpers import (  # noqa: F401
    AGENTS,
    Ledger,
    ledger_fixture,
    load_agent,
    seq_of,
    steps,
)

import recorder
import replayer
from recorder.testing.server import StubServer

OFFLINE = "http://127.0.0.1:9"  # nothing listens there: a replay must need no server
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Let me look.", "tool_use": {"name": "lookup", "input": {"order": "A-1"}}},
    {"text": "Refunding.", "tool_use": {"name": "refund", "input": {"order": "A-1",
                                                                   "amount": 40}}},
    {"text": "Refunded 40 EUR on A-1."}]}
ANSWER = "answer: Refunded 40 EUR on A-1.\n"
EDITED = "order A-1: 40.00 EUR paid, nothing refunded (checked by hand)"
FRAMEWORKS = {
    "pydantic_ai_agent": ("ANTHROPIC_BASE_URL", "", {"ANTHROPIC_API_KEY": "sk-ant-test"}),
    "langchain_agent": ("ANTHROPIC_BASE_URL", "", {"ANTHROPIC_API_KEY": "sk-ant-test"}),
    "openai_agents_agent": ("OPENAI_BASE_URL", "/v1", {
        "OPENAI_API_KEY": "sk-openai-test", "OPENAI_AGENTS_DISABLE_TRACING": "1"}),
}


@pytest.fixture(params=sorted(FRAMEWORKS))
def framework(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
              stub: Callable[[dict], StubServer]) -> Callable[[], StubServer]:
    """The agent's name; ``start()`` points it at a new stub model."""
    name = request.param
    var, suffix, env = FRAMEWORKS[name]
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def start() -> StubServer:
        server = stub(SCRIPT)
        monkeypatch.setenv(var, server.url + suffix)
        return server

    start.name = name  # type: ignore[attr-defined]
    start.offline = lambda: monkeypatch.setenv(var, OFFLINE + suffix)  # type: ignore[attr-defined]
    return start


def test_recorded_replayed_without_the_server_and_forked_without_the_refund(
        framework: Callable[[], StubServer], ledger: Ledger, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    agent = load_agent(framework.name)  # type: ignore[attr-defined]
    model = framework()
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        agent.main()
    assert capfd.readouterr().out == ANSWER
    assert ledger.rows() == [("A-1", 40.0)]
    lines = steps(path)
    tools = [o for o in lines if o["kind"] == "tool"]
    assert [(o["name"], o["args"]) for o in tools] == [
        ("lookup", {"order": "A-1"}), ("refund", {"order": "A-1", "amount": 40})]
    assert all(o["mcp"]["server"]["name"] == "ledger" for o in tools)
    assert [o["mcp"].get("destructive") for o in tools] == [None, True]  # the server's hints
    assert [o["kind"] for o in lines].count("model") == 3

    model.stop()
    framework.offline()  # type: ignore[attr-defined]
    ledger.remove()
    with replayer.replay(path) as run:
        agent.main()
    assert run.result is not None and run.result.identical, run.result.report()
    assert capfd.readouterr().out == ANSWER

    ledger.install()  # the fork's live part may start the server
    at = seq_of(path, "tool", "lookup")
    for live, rows in (((), [("A-1", 40.0)]), (("refund",), [("A-1", 40.0)] * 2)):
        model = framework()
        fork = tmp_path / f"fork-{len(live)}.jsonl"
        with replayer.fork(path, at=at, sets=[f"result={EDITED}"], out=fork,
                           live_tools=live):
            agent.main()
        assert capfd.readouterr().out == ANSWER
        assert EDITED in json.dumps(model.received()[0]["body"])  # the model saw the edit
        assert ledger.rows() == rows  # the refund ran only when named live
        refund = next(o for o in steps(fork) if o.get("name") == "refund")
        assert refund.get("policy") == (None if live else "recorded")
        assert refund["mcp"]["server"]["name"] == "ledger"


def cli(*args: str, cwd: Path) -> str:
    """``deja ARGS`` as a user runs it, in ``cwd``; its stdout and stderr, once it
    succeeded."""
    done = subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.parametrize("name", ["langchain_agent", "pydantic_ai_agent"])
def test_a_fastmcp_agent_under_the_command_line(
        name: str, ledger: Ledger, stub: Callable[[dict], StubServer], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent whose MCP client is FastMCP's (LangChain's ``langchain.mcp``, Pydantic AI's
    ``MCPToolset``), unmodified, in a fresh process under ``deja record``: FastMCP looks
    the MCP SDK up before it imports it, and the capture must still patch it at the import.
    Then ``deja replay`` with the server's command and the model gone, and ``deja fork`` at
    the lookup: the refund served unless ``--live-tool refund``."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", stub(SCRIPT).url)
    agent = str(AGENTS / f"{name}.py")
    assert ANSWER in cli("record", "-o", "run.jsonl", "--", "python", agent, cwd=tmp_path)
    assert ledger.rows() == [("A-1", 40.0)]
    refund = next(o for o in steps(tmp_path / "run.jsonl") if o.get("name") == "refund")
    assert refund["mcp"]["destructive"] is True

    ledger.remove()
    monkeypatch.setenv("ANTHROPIC_BASE_URL", OFFLINE)
    assert ": identical" in cli("replay", "run.jsonl", cwd=tmp_path)

    monkeypatch.setenv("ANTHROPIC_BASE_URL", stub(SCRIPT).url)
    at = str(seq_of(tmp_path / "run.jsonl", "tool", "lookup"))
    fork = ("fork", "run.jsonl", "--at", at, "--set", f"result={EDITED}")
    served = cli(*fork, "-o", "fork.jsonl", cwd=tmp_path)
    assert "tool 'refund' not run: served the recorded answer" in served
    assert ledger.rows() == [("A-1", 40.0)]
    ledger.install()
    cli(*fork, "-o", "live.jsonl", "--live-tool", "refund", cwd=tmp_path)
    assert ledger.rows() == [("A-1", 40.0)] * 2
