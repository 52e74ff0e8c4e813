"""``deja proxy --mcp URL``: an MCP client in another language, recorded, replayed and
forked through the proxy.

The client is examples/mcp-node-agent, on the official TypeScript MCP SDK over Streamable
HTTP; the server is the MCP tests' ledger (tests/mcp/ledger_server.py), a real process
answering with event streams, or with JSON bodies (json_ledger.py). The client is pointed
at the proxy's ``/mcp``: its requests are recorded as the in-process capture records them
(a ``tools/call`` a ``tool`` line with an ``mcp`` field, any other request an ``mcp``
line, no JSON-RPC or session id anywhere), replayed with the server stopped (the client
gets the same answers, byte for byte), refused as a JSON-RPC error where the recording
does not hold a call, and forked at a tool's result: the side-effecting refund is not
run unless named live, then exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import pytest
from mcp_proxy_helpers import (
    MCP_AGENT_DIR,
    LedgerServer,
    mcp_agent,
    read_answers,
    start_ledger,
)
from node_helpers import ensure_node_modules, node_missing
from proxy_helpers import ProxyProcess, cassettes, lines, load_verified, run_proxy
from test_proxy_then_live import MODEL, SCRIPT, TOOLS  # search, then fetch, then an answer

from recorder.testing.server import StubServer

Proxy = Callable[..., ProxyProcess]

SAID = ["tools: lookup, refund, summarize, confirm",
        "lookup: order A-1: 40.00 EUR paid, 0.00 EUR refunded",
        "progress: 0.5/1 writing the ledger",
        "log: refunding 40.00 EUR on A-1",
        "progress: 1/1 done",
        "refund: refunded 40.00 EUR on A-1",
        "policy: Refunds up to 50 EUR need no approval."]
EDITED = "order A-1: 40.00 EUR paid, 15.00 EUR refunded"


@pytest.fixture(scope="module", autouse=True)
def _node_modules() -> None:
    assert node_missing() is None, node_missing()
    ensure_node_modules(MCP_AGENT_DIR)


@pytest.fixture
def ledger(tmp_path: Path) -> Any:
    servers: list[LedgerServer] = []

    def start(name: str = "ledger", *, json_response: bool = False) -> LedgerServer:
        server = start_ledger(tmp_path / f"{name}.db", json_response=json_response)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def record(proxy: Proxy, server: LedgerServer, tmp_path: Path) -> tuple[Path, str, Path]:
    """The Node client recorded through a proxy in front of ``server``: the cassette, what
    the client printed, and the answers it dumped. The client's DELETE ends the run."""
    directory = tmp_path / "recorded"
    recording = proxy("--mcp", server.url, "--dir", str(directory))
    dump = tmp_path / "record.dump"
    run = mcp_agent(f"{recording.url}/mcp", "--dump", str(dump))
    assert run.returncode == 0, run.stderr
    status, log = recording.stop()
    assert status == 0, log
    [cassette] = cassettes(directory)
    return cassette, run.stdout, dump


def test_a_node_mcp_client_is_recorded_and_replayed_byte_for_byte_with_the_server_stopped(
        proxy: Proxy, ledger: Callable[..., LedgerServer], tmp_path: Path) -> None:
    server = ledger()
    cassette, said, dump = record(proxy, server, tmp_path)
    assert said.splitlines() == SAID
    assert server.rows() == [("A-1", 40.0)]

    recorded = load_verified(cassette)
    steps = lines(recorded)
    assert [(o["kind"], o.get("name") or o.get("event") or o["mcp"]["method"])
            for o in steps] == [
        ("mcp", "initialize"), ("mcp", "tools/list"), ("tool", "lookup"),
        ("control", "sending"), ("tool", "refund"), ("mcp", "resources/read")]
    assert steps[3]["detail"]["tool"] == "refund"  # on disk before the refund was sent
    steps = [o for o in steps if o["kind"] != "control"]
    assert {json.dumps(o["mcp"]["server"]) for o in steps} == {json.dumps(
        {"transport": "http", "url": server.url, "name": "ledger", "version": "1.4.2"})}
    lookup, refund = steps[2], steps[3]
    assert lookup["args"] == {"order": "A-1"} and "destructive" not in lookup["mcp"]
    assert refund["args"] == {"order": "A-1", "amount": 40} and refund["mcp"]["destructive"]
    assert [n["method"] for n in refund["mcp"]["notifications"]] == [
        "notifications/progress", "notifications/message", "notifications/progress"]
    assert refund["result"]["content"][0]["text"] == "refunded 40.00 EUR on A-1"
    assert recorded.end is not None and recorded.end["status"] == "completed"
    assert recorded.header["proxy"]["mcp"] == server.url
    text = cassette.read_text().lower()
    assert "mcp-session-id" not in text and '"id"' not in text and "jsonrpc" not in text

    server.stop()  # nothing listens at its URL any more
    replaying = proxy("--replay", str(cassette))
    again = tmp_path / "replay.dump"
    run = mcp_agent(f"{replaying.url}/mcp", "--dump", str(again))
    assert run.returncode == 0, run.stderr
    assert run.stdout == said
    assert again.read_bytes() == dump.read_bytes()
    assert [a["what"] for a in read_answers(again)] == ["tools/list", "lookup", "refund",
                                                         "policy"]
    status, log = replaying.stop()
    assert status == 0, log
    assert "identical" in log and "6/6 served" in log, log
    assert "POST /mcp 200" in log and "(replayed)" in log


def test_a_server_that_answers_with_json_is_recorded_and_replayed(
        proxy: Proxy, ledger: Callable[..., LedgerServer], tmp_path: Path) -> None:
    server = ledger(json_response=True)
    cassette, said, dump = record(proxy, server, tmp_path)
    assert "refund: refunded 40.00 EUR on A-1" in said.splitlines()
    assert server.rows() == [("A-1", 40.0)]
    steps = lines(load_verified(cassette))
    assert [o["kind"] for o in steps] == ["mcp", "mcp", "tool", "control", "tool", "mcp"]
    server.stop()
    replaying = proxy("--replay", str(cassette))
    again = tmp_path / "replay.dump"
    run = mcp_agent(f"{replaying.url}/mcp", "--dump", str(again))
    assert run.returncode == 0 and run.stdout == said, run.stderr
    assert again.read_bytes() == dump.read_bytes()
    assert replaying.stop()[0] == 0


def test_a_call_the_recording_does_not_hold_is_a_json_rpc_error_naming_it(
        proxy: Proxy, ledger: Callable[..., LedgerServer], tmp_path: Path) -> None:
    server = ledger()
    cassette, _, _ = record(proxy, server, tmp_path)
    server.stop()
    replaying = proxy("--replay", str(cassette))
    run = mcp_agent(f"{replaying.url}/mcp", "--order", "B-7")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "MCP error: MCP error -32000: deja replay: the request diverged from the " \
           "recording at step 2 (tool, different arguments)" in run.stderr, run.stderr
    assert 'server ledger, tool lookup, arguments {"order":"B-7"}' in run.stderr
    status, log = replaying.stop()
    assert status == 1, log  # the replay diverged
    assert "different arguments" in log


@pytest.mark.parametrize("live", [False, True])
def test_a_fork_at_a_tool_result_runs_the_refund_only_when_named_live(
        proxy: Proxy, ledger: Callable[..., LedgerServer], tmp_path: Path,
        live: bool) -> None:
    recorded_on = ledger("recorded")
    cassette, _, _ = record(proxy, recorded_on, tmp_path)
    recorded_on.stop()
    at = next(o["seq"] for o in lines(load_verified(cassette)) if o.get("name") == "lookup")
    server = ledger("forked")  # an empty ledger: what the fork writes, if anything
    out = tmp_path / "fork.jsonl"
    forking = proxy("--fork", str(cassette), "--at", str(at), "--set", f"result={EDITED}",
                    "-o", str(out), "--mcp", server.url,
                    *(["--live-tool", "refund"] if live else []))
    run = mcp_agent(f"{forking.url}/mcp")
    assert run.returncode == 0, run.stderr
    status, log = forking.stop()
    assert status == 0, log
    said = run.stdout.splitlines()
    assert f"lookup: {EDITED}" in said  # the edited result, served
    fork = lines(load_verified(out))
    refund = next(o for o in fork if o.get("name") == "refund")
    assert refund["args"] == {"order": "A-1", "amount": 25}
    if live:
        assert "refund: refunded 25.00 EUR on A-1" in said
        assert server.rows() == [("A-1", 25.0)]  # run once
        assert "policy" not in refund and refund["mcp"]["destructive"]
    else:
        assert "refund refused: tool 'refund' was not run: it has side effects and is never " \
               "run live here unless named (--live-tool refund runs it" in run.stdout
        assert server.rows() == []  # never run
        assert refund["policy"] == "refuse"
    # the policy read, after the fork step, went to the server started then
    assert "policy: Refunds up to 50 EUR need no approval." in said
    assert fork[-1]["mcp"]["method"] == "resources/read" and "result" in fork[-1]
    assert "the handshake it was served was said to the server" in log, log


def test_model_calls_and_an_mcp_session_of_one_agent_are_one_run(
        proxy: Proxy, ledger: Callable[..., LedgerServer], stub: Callable[[dict], StubServer],
        tmp_path: Path) -> None:
    """An agent that opens its MCP session, then asks the model: one cassette holds both."""
    server = ledger()
    model = stub({"default": {"text": "Refund 40 EUR on A-1."}})
    directory = tmp_path / "both"
    recording = proxy("--mcp", server.url, "--upstream", model.url, "--dir", str(directory))
    hello = {"jsonrpc": "2.0", "id": 7, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "curl", "version": "1"}}}
    answer = subprocess.run(["curl", "-sS", "-i", f"{recording.url}/mcp",
                             "-H", "content-type: application/json",
                             "-H", "accept: application/json, text/event-stream",
                             "-d", json.dumps(hello)], capture_output=True, text=True,
                            timeout=60, check=True).stdout
    assert '"id":7' in answer.replace(" ", "") and '"serverInfo"' in answer, answer
    assert "mcp-session-id:" in answer.lower()
    client = anthropic.Anthropic(base_url=recording.url, api_key="sk-test", max_retries=0)
    client.messages.create(model="claude-sonnet-4-6", max_tokens=64,
                           messages=[{"role": "user", "content": "Settle A-1"}])
    status, log = recording.stop()
    assert status == 0, log
    [cassette] = cassettes(directory)
    assert [o["kind"] for o in lines(load_verified(cassette))] == ["mcp", "model"]


def test_the_tool_policy_goes_with_fork_and_then_live_only(tmp_path: Path) -> None:
    done = run_proxy(tmp_path, "--tool", "refund=refuse")
    assert done.returncode == 2
    assert "--tool and --live-tool go with --replay CASSETTE --then live, or with --fork " \
           "CASSETTE" in done.stderr, done.stderr
    done = run_proxy(tmp_path, "--mcp", "ledger:9000")
    assert done.returncode == 2
    assert "--mcp must be an MCP server's http:// or https:// URL" in done.stderr, done.stderr


# -- the tool policy of a fork through the proxy, over the agent's own tools ---------------


def results_for(message: anthropic.types.Message, fetch_fails: bool) -> list[dict[str, Any]]:
    """The agent's results for the tools ``message`` asks for: its fetch fails when told
    to, and says so (``is_error``)."""
    return [{"type": "tool_result", "tool_use_id": b.id,
             **({"content": "fetch failed", "is_error": True}
                if fetch_fails and b.name == "fetch" else {"content": f"a result of {b.name}"})}
            for b in message.content if b.type == "tool_use"]


def tool_loop(url: str, *, fetch_fails: bool = False) -> str:
    """A tool loop on the Python SDK, its tools run here, in the agent."""
    messages: list[Any] = [{"role": "user", "content": "Find x"}]
    with anthropic.Anthropic(base_url=url, api_key="sk-test", max_retries=0) as client:
        while len(messages) < 10:
            message = client.messages.create(model=MODEL, max_tokens=256, tools=TOOLS,
                                             messages=messages)
            results = results_for(message, fetch_fails)
            if not results:
                return message.content[0].text  # type: ignore[union-attr]
            messages += [{"role": "assistant", "content": [
                b.model_dump(mode="json", exclude_none=True) for b in message.content]},
                {"role": "user", "content": results}]
    raise AssertionError("no final answer")


def test_a_fork_gives_the_model_a_static_answer_as_no_error_whatever_the_agent_sent(
        proxy: Proxy, stub: Callable[[dict], StubServer], tmp_path: Path) -> None:
    """``deja proxy --fork --tool fetch=static:...``: the agent's fetch ran (the proxy
    cannot stop it, and says so), failed, and the model is given the static value in its
    place, as a result that is no error."""
    recording = proxy("--upstream", stub(SCRIPT).url, "--dir", str(tmp_path / "runs"))
    assert tool_loop(recording.url).startswith("Done: ")
    assert recording.stop()[0] == 0
    [parent] = cassettes(tmp_path / "runs")
    live = stub(SCRIPT)
    out = tmp_path / "fork.jsonl"
    forking = proxy("--fork", str(parent), "--at", "1", "--set", "result=9 results for x",
                    "-o", str(out), "--upstream", live.url, "--tool", 'fetch=static:{"hit": 1}')
    assert tool_loop(forking.url, fetch_fails=True).startswith("Done: ")
    status, log = forking.stop()
    assert status == 0, log
    given = [b for m in live.requests[-1]["body"]["messages"] if m["role"] == "user"
             and isinstance(m["content"], list) for b in m["content"]]
    assert given[-1]["content"] == '{"hit": 1}' and "is_error" not in given[-1], given
    assert given[0]["content"] == "9 results for x"  # the fork's edit
    assert "deja: tool fetch ran in the agent: the proxy cannot stop an agent's own tool (" \
           "step " in log and 'rule static:{"hit": 1}); the model was given the static ' \
           "value instead" in log, log
    fetch = next(o for o in lines(load_verified(out)) if o.get("name") == "fetch")
    assert (fetch["result"], fetch["policy"], fetch.get("is_error")) == (
        '{"hit": 1}', "static", None)


# A Python agent that talks to the model and to the ledger's MCP server, both through one
# proxy (its model traffic at the proxy's root, its MCP session at /mcp), without deja in
# its process: the model asks for lookup, the agent calls it over MCP and sends the result
# back.
MODEL_AND_MCP_AGENT = '''\
import os
import anthropic
import anyio
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

async def main():
    proxy = os.environ["PROXY_URL"]
    model = anthropic.AsyncAnthropic(base_url=proxy, api_key="sk-test", max_retries=0)
    async with streamable_http_client(proxy + "/mcp") as (read, write), \\
            ClientSession(read, write) as mcp:
        await mcp.initialize()
        listed = await mcp.list_tools()
        tools = [{"name": t.name, "description": t.description or "",
                  "input_schema": t.input_schema} for t in listed.tools if t.name == "lookup"]
        messages = [{"role": "user", "content": "What was paid for order A-1?"}]
        while True:
            reply = await model.messages.create(model="claude-sonnet-4-6", max_tokens=64,
                                                tools=tools, messages=messages)
            messages.append({"role": "assistant", "content": [
                b.model_dump(exclude_none=True) for b in reply.content]})
            calls = [b for b in reply.content if b.type == "tool_use"]
            if not calls:
                print("answer:", reply.content[-1].text)
                return
            results = []
            for call in calls:
                got = await mcp.call_tool(call.name, call.input)
                print(call.name + ":", got.content[0].text)
                results.append({"type": "tool_result", "tool_use_id": call.id,
                                "content": got.content[0].text})
            messages.append({"role": "user", "content": results})

anyio.run(main)
'''
LOOKUP_SCRIPT = {"select": "conversation", "turns": [
    {"text": "Looking it up.", "tool_use": {"name": "lookup", "input": {"order": "A-1"}}},
    {"text": "A-1: 40.00 EUR paid."}]}


def test_a_tool_called_over_mcp_is_one_step_not_two(
        proxy: Proxy, ledger: Callable[..., LedgerServer], tmp_path: Path) -> None:
    """The model's tool call answered over the proxy's MCP endpoint is the MCP call's
    step; the result the next model request carries is not logged again as an agent's
    own tool step, and the run replays with both servers gone."""
    server = ledger()
    agent = tmp_path / "agent.py"
    agent.write_text(MODEL_AND_MCP_AGENT)
    directory = tmp_path / "recorded"
    with StubServer(LOOKUP_SCRIPT) as stub:
        recording = proxy("--mcp", server.url, "--upstream", stub.url, "--dir", str(directory))
        run = subprocess.run([sys.executable, str(agent)], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PROXY_URL": recording.url})
        assert run.returncode == 0, run.stderr
        status, log = recording.stop()
    assert status == 0, log
    said = run.stdout.splitlines()
    assert said == ["lookup: order A-1: 40.00 EUR paid, 0.00 EUR refunded",
                    "answer: A-1: 40.00 EUR paid."]
    [cassette] = cassettes(directory)
    steps = [(o["kind"], o.get("name") or o.get("mcp", {}).get("method"))
             for o in lines(load_verified(cassette))]
    assert steps == [("mcp", "initialize"), ("mcp", "tools/list"), ("model", None),
                     ("tool", "lookup"), ("model", None)], steps

    server.stop()
    replaying = proxy("--replay", str(cassette))
    again = subprocess.run([sys.executable, str(agent)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PROXY_URL": replaying.url})
    assert again.returncode == 0, again.stderr
    assert again.stdout == run.stdout
    status, log = replaying.stop()
    assert status == 0, log
    assert "identical" in log, log
