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
from collections.abc import Callable
from pathlib import Path

import pytest
from mcp_helpers import Ledger, ledger_fixture, load_agent, seq_of, steps  # noqa: F401

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
