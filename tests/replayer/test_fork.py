"""deja fork: re-run an agent with one step edited, then live.

Real anthropic SDK against the stub server, real HTTP clients against a local server, real
files and real `deja` processes; nothing is mocked. The steps before the fork step must
come from the parent (the stub that recorded them is gone), the fork step must reach the
agent edited, and what follows must go live into a new cassette that names its parent.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
import requests
from click.testing import CliRunner
from conftest import MODEL, read_lines

import recorder
import replayer
from deja.cli import main as cli
from recorder.cassette import load
from recorder.errors import (
    Divergence,
    EditError,
    NoSuchStep,
    PathTaken,
    SignatureError,
    UnverifiedCassette,
)
from recorder.providers._anthropic_sse import assemble
from recorder.testing.server import StubServer

ROOT = Path(__file__).resolve().parents[2]
SPIRAL = ROOT / "examples" / "retry_spiral.py"
SPIRAL_SCRIPT = json.loads((ROOT / "examples" / "retry_spiral.stub.json").read_text())
STREAMING = ROOT / "examples" / "streaming_agent.py"
STREAMING_SCRIPT = {"turns": [  # the example's script without its pauses between events
    {k: v for k, v in turn.items() if k != "event_delay_ms"}
    for turn in json.loads((ROOT / "examples" / "streaming_agent.stub.json").read_text())["turns"]]}

# What the search tool should have returned: well-formed JSON text (the tool returns a str).
GOOD = json.dumps({"results": [{"path": "auth/session.py",
                                "snippet": "def refresh_token(self): ..."}]})
FOUND = "Found it: auth/session.py defines refresh_token. Refactoring it now."
# The model after the fork: the request after one assistant reply (conversation position 1)
# gets the final answer. Position 0 must never be asked live: it is the parent's step 0.
AFTER_FORK = {"select": "conversation",
              "turns": [{"text": "position 0 must be replayed, not asked"}, {"text": FOUND}]}


def _load(path: Path, name: str) -> Any:
    """An example script as a module, to run its main() in this process."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


spiral = _load(SPIRAL, "deja_test_fork_spiral")


def deja(*args: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run the installed CLI as a user would."""
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=120)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture
def spiral_parent(tmp_path: Path, stub: Any, monkeypatch: pytest.MonkeyPatch,
                  capsys: pytest.CaptureFixture) -> Path:
    """The retry-spiral example recorded in-process; its stub is stopped afterwards."""
    runs = tmp_path / "runs"
    runs.mkdir()
    parent = runs / "spiral.jsonl"
    server = stub(SPIRAL_SCRIPT)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
    with recorder.record(parent):
        spiral.main()
    server.stop()
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    out = capsys.readouterr().out
    assert out.count("search failed: malformed response") >= 2, out  # the spiral
    kinds = [o["kind"] for o in load(parent).observations]
    assert kinds[:4] == ["model", "tool", "model", "tool"]
    return parent


# ------------------------------------------------------------------ the seed-000 story


def test_fork_the_retry_spiral_end_to_end_through_the_cli(tmp_path: Path, stub: Any) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    parent = runs / "spiral.jsonl"
    with StubServer(SPIRAL_SCRIPT) as server:
        recorded = deja("record", "-o", str(parent), "--", "python", str(SPIRAL),
                        env={"ANTHROPIC_BASE_URL": server.url})
    assert parent.exists(), recorded.stderr
    assert recorded.stdout.count("search failed: malformed response") >= 2, recorded.stdout
    parent_lines = read_lines(parent)
    parent_hash = sha(parent)

    # The README's command: the value is well-formed JSON; the step held a string, so the
    # agent receives it as a string (its json.loads must work on it).
    live = stub(AFTER_FORK)
    fork_path = runs / "fixed.jsonl"
    forked = deja("fork", str(parent), "--at", "1", "--set", f"result={GOOD}",
                  "-o", str(fork_path), "--", "python", str(SPIRAL),
                  env={"ANTHROPIC_BASE_URL": live.url})
    assert forked.returncode == 0, forked.stdout + forked.stderr
    assert "turn 1: tool_use: I'll search for the session refresh code." in forked.stdout
    assert '-> [{"path": "auth/session.py", "snippet": "def refresh_token' in forked.stdout
    assert f"turn 2: end_turn: {FOUND}" in forked.stdout
    assert "search failed" not in forked.stdout
    assert "forked run" in forked.stderr and f"deja diff {parent} {fork_path}" in forked.stderr
    # Only the turn after the fork went live; step 0 came from the parent.
    assert len(live.requests) == 1
    sent = live.requests[0]["body"]["messages"]
    assert sent[2]["content"][0]["content"] == json.dumps(json.loads(GOOD)["results"])
    assert sent[2]["content"][0]["is_error"] is False
    live.stop()

    assert sha(parent) == parent_hash  # the parent is never written

    lines = read_lines(fork_path)
    header = lines[0]
    assert header["parent"]["run"] == parent_lines[0]["run"]
    assert header["parent"]["step"] == 1
    assert header["parent"]["prefix_sig"] == parent_lines[1]["sig"]  # the parent's seq 0
    assert header["run"] != parent_lines[0]["run"]
    assert [(line["seq"], line["kind"]) for line in lines[1:]] == [
        (0, "model"), (1, "tool"), (2, "control"), (3, "model"), (4, "end")]
    assert lines[2]["edited"] is True and lines[2]["result"] == GOOD
    assert lines[3]["event"] == "fork_edit"
    assert lines[3]["detail"]["patch"] == [{"op": "replace", "path": "/result", "value": GOOD}]
    assert lines[3]["detail"]["original"] == {"result": parent_lines[2]["result"]}
    assert parent_lines[2]["result"] != GOOD  # what the parent recorded, not the edit
    assert lines[-1]["status"] == "completed" and lines[-1]["exit_code"] == 0
    fork, original = load(fork_path), load(parent)
    assert fork.observations[0] == original.observations[0]  # step 0: a copy, in meaning
    assert fork.requests[0] == original.requests[0]

    diff = CliRunner().invoke(cli, ["diff", str(parent), str(fork_path)])
    assert diff.exit_code == 1, diff.output
    assert "step 0: identical" in diff.output
    assert "first divergence: step 1" in diff.output
    assert "step 1 (tool):" in diff.output and "/result:" in diff.output
    as_json = json.loads(CliRunner().invoke(cli, ["diff", str(parent), str(fork_path),
                                                  "--json"]).output)
    assert as_json["first_divergence"] == 1 and as_json["same_prefix"] == 1
    change = as_json["steps"][0]["changes"][0]
    assert change["path"] == "/result" and change["b"] == GOOD
    assert change["a"] == parent_lines[2]["result"]

    # The stub is gone: the fork replays on its own, bit for bit.
    replayed = deja("replay", str(fork_path))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "identical" in replayed.stdout and "verified with key" in replayed.stdout
    assert f"turn 2: end_turn: {FOUND}" in replayed.stdout

    ls = CliRunner().invoke(cli, ["ls", str(runs), "--json"])
    assert ls.exit_code == 0, ls.output
    rows = {Path(r["path"]).name: r for r in json.loads(ls.output)}
    assert rows["fixed.jsonl"]["parent_run"] == parent_lines[0]["run"]
    assert not rows["spiral.jsonl"]["parent_run"]
    table = CliRunner().invoke(cli, ["ls", str(runs)])
    assert table.exit_code == 0 and "parent" in table.output and "@1" in table.output
    assert sha(parent) == parent_hash


def test_fork_header_cwd_points_where_the_parent_ran(tmp_path: Path, stub: Any,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    """A fork written to another folder replays its recorded command from the parent's
    working directory (headers store cwd relative to the cassette's own folder)."""
    project = tmp_path / "project"
    (project / "cassettes" / "demo").mkdir(parents=True)
    (project / "agent.py").write_text(SPIRAL.read_text())
    parent = project / "cassettes" / "spiral.jsonl"
    with StubServer(SPIRAL_SCRIPT) as server, monkeypatch.context() as inside:
        inside.chdir(project)  # as `cd project && deja record -- python agent.py` records
        inside.setenv("ANTHROPIC_BASE_URL", server.url)
        session = recorder.RecordSession("cassettes/spiral.jsonl",
                                         argv=["python", "agent.py"]).start()
        try:
            spiral.main()  # agent.py's code, run here
        finally:
            session.close()
    assert read_lines(parent)[0]["cwd"] == ".."
    assert read_lines(parent)[0]["argv"] == ["python", "agent.py"]
    monkeypatch.setenv("ANTHROPIC_BASE_URL", stub(AFTER_FORK).url)
    out = project / "cassettes" / "demo" / "fixed.jsonl"
    with replayer.fork(parent, at=1, out=out, sets=[f"/result={GOOD}"]):
        assert spiral.main() == 0  # the same agent, in this process
    capsys.readouterr()
    assert read_lines(out)[0]["cwd"] == "../.."
    replayed = deja("replay", str(out), cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert FOUND in replayed.stdout


# ------------------------------------------------------------------ the library API


def test_fork_in_process_with_a_patch(spiral_parent: Path, stub: Any, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture) -> None:
    before = sha(spiral_parent)
    live = stub(AFTER_FORK)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", live.url)
    out = tmp_path / "patched.jsonl"
    with replayer.fork(spiral_parent, at=1, out=out,
                       patch=[{"op": "replace", "path": "/result", "value": GOOD}]) as run:
        assert spiral.main() == 0
    printed = capsys.readouterr().out
    assert "auth/session.py" in printed and FOUND in printed
    assert "search failed" not in printed
    assert len(live.requests) == 1
    assert run.run_id == load(out).run
    fork = load(out, keyring=recorder.load_keyring(), require_signature=True)
    assert fork.end is not None and fork.end["status"] == "completed"
    assert fork.header["parent"]["run"] == load(spiral_parent).run
    assert [o["kind"] for o in fork.observations] == ["model", "tool", "control", "model"]
    assert sha(spiral_parent) == before


def test_fork_in_process_replacing_the_whole_document(spiral_parent: Path, stub: Any,
                                                      tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    live = stub(AFTER_FORK)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", live.url)
    out = tmp_path / "replaced.jsonl"
    with replayer.fork(spiral_parent, at=1, out=out, replace={"result": GOOD}):
        assert spiral.main() == 0
    assert FOUND in capsys.readouterr().out
    lines = read_lines(out)
    assert lines[2]["result"] == GOOD and lines[2]["edited"] is True
    # The control line holds the patch that turns the old document into the new one.
    assert lines[3]["detail"]["patch"] == [{"op": "replace", "path": "/result", "value": GOOD}]


def test_fork_in_process_with_a_dotted_set_path(spiral_parent: Path, stub: Any, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    """Fork at the model step: the agent sees the edited text; the tool then runs live."""
    live = stub(AFTER_FORK)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", live.url)
    out = tmp_path / "dotted.jsonl"
    with replayer.fork(spiral_parent, at=0, out=out,
                       sets=["content.0.text=Searching the auth module first."]):
        assert spiral.main() == 0
    printed = capsys.readouterr().out
    assert "turn 1: tool_use: Searching the auth module first." in printed
    assert f"turn 2: end_turn: {FOUND}" in printed
    sent = live.requests[0]["body"]["messages"]
    assert sent[1]["content"][0]["text"] == "Searching the auth module first."
    assert sent[1]["content"][1]["name"] == "search"  # the rest of the message is kept
    kinds = [(line["seq"], line["kind"]) for line in read_lines(out)[1:]]
    assert kinds == [(0, "model"), (1, "control"), (2, "tool"), (3, "model"), (4, "end")]


def test_set_values_keep_a_string_field_a_string(spiral_parent: Path) -> None:
    """--set VALUE is JSON, or else a string; a field that holds a string stays one."""
    runs = spiral_parent.parent
    before = listing(runs)
    for value in (GOOD, json.dumps(GOOD)):  # raw JSON text, or a JSON string literal
        plan = replayer.plan_fork(spiral_parent, 1, sets=[f"/result={value}"])
        assert plan.edited["result"] == GOOD
    plan = replayer.plan_fork(spiral_parent, 0, sets=["/content/1/input={\"query\": \"x\"}"])
    assert assemble_or_json(plan.edited)["content"][1]["input"] == {"query": "x"}
    assert listing(runs) == before  # planning writes nothing


def assemble_or_json(obs: dict[str, Any]) -> dict[str, Any]:
    body = obs["response"]["body"]
    return assemble(body) if body.startswith("event:") else json.loads(body)


# ------------------------------------------------------------------ streamed model calls

WEATHER = [{"name": "get_weather", "description": "Current weather for a city.",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}}]
WEATHER_SCRIPT = {"select": "conversation", "turns": [
    {"text": "Let me check the weather in Lyon first.",
     "tool_use": {"name": "get_weather", "input": {"city": "Lyon"}}},
    {"text": "Overcast and 14 C: take the umbrella."}]}
weather_calls: list[str] = []


@recorder.tool
def get_weather(city: str) -> dict:
    weather_calls.append(city)
    return {"city": city, "temp_c": 14, "sky": "overcast"}


def streaming_agent(base_url: str) -> list[dict[str, Any]]:
    """examples/streaming_agent.py's loop, returning what the agent received per turn."""
    client = anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Umbrella in Lyon today?"}]
    turns = []
    for _ in range(3):
        with client.messages.stream(model=MODEL, max_tokens=256, tools=WEATHER,
                                    messages=messages) as stream:
            chunks = list(stream.text_stream)
            reply = stream.get_final_message()
        content = [b.model_dump(exclude_none=True) for b in reply.content]
        turns.append({"chunks": chunks, "content": content, "stop_reason": reply.stop_reason})
        messages.append({"role": "assistant", "content": content})
        if reply.stop_reason != "tool_use":
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id,
             "content": json.dumps(get_weather(**b.input))}
            for b in reply.content if b.type == "tool_use"]})
    return turns


def sse_blocks(body: str) -> list[tuple[str, dict[str, Any]]]:
    """Every event of an SSE body, checked to be well formed: `event:` then JSON `data:`."""
    assert body.endswith("\n\n")
    out = []
    for block in body[:-2].split("\n\n"):
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        doc = json.loads(data[len("data: "):])
        assert doc["type"] == event[len("event: "):]
        out.append((doc["type"], doc))
    return out


def test_fork_a_streamed_model_call(tmp_path: Path, stub: Any) -> None:
    parent = tmp_path / "stream.jsonl"
    recording = stub(WEATHER_SCRIPT)
    weather_calls.clear()
    with recorder.record(parent):
        recorded = streaming_agent(recording.url)
    recording.stop()
    assert weather_calls == ["Lyon"] and len(recorded) == 2
    parent_line = read_lines(parent)[1]
    assert parent_line["response"]["body"].startswith("event: message_start")

    text = "Checking Paris instead, as you asked."
    live = stub(WEATHER_SCRIPT)
    weather_calls.clear()
    out = tmp_path / "stream-fork.jsonl"
    patch = [{"op": "replace", "path": "/content/0/text", "value": text},
             {"op": "replace", "path": "/content/1/input", "value": {"city": "Paris"}}]
    with replayer.fork(parent, at=0, out=out, patch=patch):
        turns = streaming_agent(live.url)
    live.stop()

    # The agent received the edit through the stream: deltas, final message, tool input.
    first = turns[0]
    assert "".join(first["chunks"]) == text
    assert first["content"][0] == {"type": "text", "text": text}
    assert first["content"][1]["input"] == {"city": "Paris"}
    assert first["content"][1]["id"] == recorded[0]["content"][1]["id"]
    assert first["stop_reason"] == "tool_use"
    assert weather_calls == ["Paris"]  # after the fork the tool runs live, with the edit
    assert len(live.requests) == 1
    sent = live.requests[0]["body"]["messages"]
    assert sent[1]["content"] == first["content"]
    assert json.loads(sent[2]["content"][0]["content"])["city"] == "Paris"
    assert turns[1]["content"][0]["text"] == "Overcast and 14 C: take the umbrella."

    # The edited line holds a valid event stream that assembles to the edited message.
    expected = assemble(parent_line["response"]["body"])
    expected["content"][0]["text"] = text
    expected["content"][1]["input"] = {"city": "Paris"}
    edited_line = read_lines(out)[1]
    assert edited_line["edited"] is True
    body = edited_line["response"]["body"]
    events = sse_blocks(body)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    assert [e for e, _ in events].count("content_block_start") == 2
    assert assemble(body) == expected
    assert edited_line["stop_reason"] == "tool_use"
    assert edited_line["usage"]["output_tokens"] == expected["usage"]["output_tokens"]
    ctype = [v for k, v in edited_line["response"]["headers"] if k.lower() == "content-type"]
    assert ctype and "text/event-stream" in ctype[0]

    # Offline, the fork replays the synthesised stream exactly as the agent first got it.
    weather_calls.clear()
    with replayer.replay(out) as run:
        again = streaming_agent(live.url)
    assert run.result.identical and again == turns and weather_calls == []


def test_fork_a_raw_stream_created_with_stream_true(tmp_path: Path) -> None:
    def agent(base_url: str) -> list[Any]:
        client = anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)
        return list(client.messages.create(model=MODEL, max_tokens=64, stream=True,
                                           messages=[{"role": "user", "content": "hi"}]))

    parent = tmp_path / "raw.jsonl"
    with StubServer({"turns": [{"text": "Hello there, how can I help?"}]}) as server:
        with recorder.record(parent):
            agent(server.url)
    out = tmp_path / "raw-fork.jsonl"
    with replayer.fork(parent, at=0, out=out, sets=["content.0.text=Edited hello."]) as run:
        events = agent(server.url)  # closed: nothing after the fork step asks the network
    assert run.live  # the prefix was used up
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == \
        "Edited hello."
    assert events[-2].type == "message_delta" and events[-2].delta.stop_reason == "end_turn"
    fork = load(out, keyring=recorder.load_keyring(), require_signature=True)
    assert fork.end is not None and fork.end["status"] == "completed"


def test_fork_the_streaming_example_at_its_last_step_through_the_cli(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    example = _load(STREAMING, "deja_test_fork_streaming")
    parent = tmp_path / "stream.jsonl"
    with StubServer(STREAMING_SCRIPT) as server:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
        session = recorder.RecordSession(parent, argv=["python", str(STREAMING)]).start()
        try:
            assert example.main() == 0
        finally:
            session.close()
    assert "take the umbrella" in capsys.readouterr().out
    last = max(o["seq"] for o in load(parent).observations if o["kind"] == "model")
    # Nothing comes after the last model step: the fork needs no model at all, and runs
    # the recorded command.
    forked = deja("fork", str(parent), "--at", str(last), "--set",
                  "content.0.text=Dry all day in Lyon: leave the umbrella.",
                  "-o", str(tmp_path / "dry.jsonl"))
    assert forked.returncode == 0, forked.stdout + forked.stderr
    assert "Let me check the weather in Lyon first." in forked.stdout  # replayed
    assert forked.stdout.rstrip().endswith("Dry all day in Lyon: leave the umbrella.")
    assert "take the umbrella" not in forked.stdout


# ------------------------------------------------------------------ http, effect, tool steps


class _Inventory(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.hits += 1  # type: ignore[attr-defined]
        body = json.dumps({"status": "ok", "items": [1, 2]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def inventory() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Inventory)
    server.hits = 0  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


lookups: list[str] = []


@recorder.tool
def lookup(sku: str) -> dict:
    lookups.append(sku)
    return {"sku": sku, "stock": 7}


def shop_agent(url: str) -> dict[str, Any]:
    """requests, then httpx, then an effect, then a tool; each step's outcome returned."""
    a = requests.get(url, timeout=5)
    b = httpx.get(url, timeout=5)
    order = str(recorder.uuid4())
    try:
        found: Any = lookup("A-1")
    except TimeoutError as exc:
        found = f"lookup failed: {exc}"
    return {"requests": [a.status_code, a.json()], "httpx": [b.status_code, b.json()],
            "order": order, "lookup": found}


@pytest.fixture
def shop_parent(tmp_path: Path, inventory: ThreadingHTTPServer) -> tuple[Path, dict, str]:
    url = f"http://127.0.0.1:{inventory.server_address[1]}/stock"
    parent = tmp_path / "shop.jsonl"
    lookups.clear()
    with recorder.record(parent):
        result = shop_agent(url)
    assert [o["kind"] for o in load(parent).observations] == ["http", "http", "effect", "tool"]
    assert inventory.hits == 2  # type: ignore[attr-defined]
    inventory.hits = 0  # type: ignore[attr-defined]
    lookups.clear()
    return parent, result, url


def test_fork_an_http_step_made_with_requests(shop_parent: tuple[Path, dict, str],
                                              inventory: ThreadingHTTPServer,
                                              tmp_path: Path) -> None:
    parent, recorded, url = shop_parent
    out = tmp_path / "down.jsonl"
    with replayer.fork(parent, at=0, out=out, sets=["/status=503", "body.status=down"]):
        result = shop_agent(url)
    assert result["requests"] == [503, {"status": "down", "items": [1, 2]}]
    assert result["httpx"] == [200, {"status": "ok", "items": [1, 2]}]  # live again
    assert inventory.hits == 1  # type: ignore[attr-defined]
    assert result["order"] != recorded["order"] and lookups == ["A-1"]  # after: live
    line = read_lines(out)[1]
    assert line["edited"] is True and line["response"]["status"] == 503
    length = [v for k, v in line["response"]["headers"] if k.lower() == "content-length"]
    assert length == [str(len(line["response"]["body"].encode()))]


def test_fork_an_http_step_made_with_httpx(shop_parent: tuple[Path, dict, str],
                                           inventory: ThreadingHTTPServer,
                                           tmp_path: Path) -> None:
    """The requests call before the fork step is served from the parent, not sent."""
    parent, recorded, url = shop_parent
    with replayer.fork(parent, at=1, out=tmp_path / "empty.jsonl",
                       patch=[{"op": "replace", "path": "/body/items", "value": []}]):
        result = shop_agent(url)
    assert result["requests"] == recorded["requests"]
    assert result["httpx"] == [200, {"status": "ok", "items": []}]
    assert inventory.hits == 0  # type: ignore[attr-defined]


def test_fork_an_effect_step(shop_parent: tuple[Path, dict, str],
                             inventory: ThreadingHTTPServer, tmp_path: Path) -> None:
    parent, recorded, url = shop_parent
    order = "00000000-0000-4000-8000-000000000042"
    with replayer.fork(parent, at=2, out=tmp_path / "order.jsonl", sets=[f"value={order}"]):
        result = shop_agent(url)
    assert result["order"] == order
    assert result["requests"] == recorded["requests"] and result["httpx"] == recorded["httpx"]
    assert inventory.hits == 0  # type: ignore[attr-defined]
    assert lookups == ["A-1"]  # the step after the fork runs live


def test_fork_a_tool_step_into_an_error(shop_parent: tuple[Path, dict, str],
                                        inventory: ThreadingHTTPServer, tmp_path: Path) -> None:
    parent, recorded, url = shop_parent
    out = tmp_path / "timeout.jsonl"
    error = {"type": "TimeoutError", "module": "builtins", "message": "inventory timed out"}
    with replayer.fork(parent, at=3, out=out, replace={"error": error}):
        result = shop_agent(url)
    assert result["lookup"] == "lookup failed: inventory timed out"
    assert result["order"] == recorded["order"]
    assert lookups == [] and inventory.hits == 0  # type: ignore[attr-defined]
    line = read_lines(out)[4]
    assert line["error"] == error and "result" not in line and line["edited"] is True
    with replayer.replay(out) as run:  # the error replays as the same exception
        assert shop_agent(url)["lookup"] == "lookup failed: inventory timed out"
    assert run.result.identical


# ------------------------------------------------------------------ bad input: exit 2


def refused(parent: Path, args: list[str], *fragments: str, env: dict | None = None,
            at: str = "1") -> str:
    """`deja fork PARENT --at N ARGS` exits 2 with the fragments in its message and leaves the
    parent's directory exactly as it was."""
    directory = parent.parent
    before, parent_hash = listing(directory), sha(parent)
    result = CliRunner().invoke(cli, ["fork", str(parent), "--at", at, *args], env=env)
    assert result.exit_code == 2, result.output
    for fragment in fragments:
        assert fragment in result.output, result.output
    assert listing(directory) == before and sha(parent) == parent_hash
    return result.output


def test_step_out_of_range(spiral_parent: Path) -> None:
    n = len(load(spiral_parent).observations)
    refused(spiral_parent, ["--set", "result=x"], "fork step 99 is out of range",
            f"steps 0-{n - 1}", "deja show", at="99")
    with pytest.raises(NoSuchStep, match="out of range"):
        replayer.fork(spiral_parent, at=99, sets=["result=x"])
    # The end line is not a step that can be forked.
    refused(spiral_parent, ["--set", "status=completed"], "out of range", at=str(n))


def test_a_patch_that_does_not_apply(spiral_parent: Path, tmp_path: Path) -> None:
    refused(spiral_parent, ["--set", "results.0.path=x"], "does not apply to step 1",
            "/result")
    patch = tmp_path / "patch.json"
    patch.write_text(json.dumps([{"op": "replace", "path": "/content/7/text", "value": "x"}]))
    refused(spiral_parent, ["--patch", str(patch)], "does not apply to step 0",
            "/content/0/text", "/content/1/input/query", at="0")
    with pytest.raises(EditError, match="does not apply to step 1"):
        replayer.fork(spiral_parent, at=1, patch=[{"op": "remove", "path": "/nothing"}])


def test_a_tampered_parent(spiral_parent: Path) -> None:
    lines = spiral_parent.read_text().splitlines()
    assert "I'll search" in lines[1]
    lines[1] = lines[1].replace("I'll search", "I will search")
    spiral_parent.write_text("\n".join(lines) + "\n")
    refused(spiral_parent, ["--set", f"result={GOOD}"], "signature check failed at seq 0",
            "restore it")
    with pytest.raises(SignatureError) as info:
        replayer.fork(spiral_parent, at=1, sets=[f"result={GOOD}"])
    assert info.value.seq == 0


def test_a_missing_key(spiral_parent: Path, tmp_path: Path,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "empty-home"
    home.mkdir()
    env = {"DEJA_KEY": "a-different-key", "DEJA_HOME": str(home)}
    refused(spiral_parent, ["--set", f"result={GOOD}"], "signature cannot be checked",
            "not one of this machine's keys", "DEJA_KEY or DEJA_OLD_KEYS", env=env)
    assert list(home.iterdir()) == []
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UnverifiedCassette):
        replayer.fork(spiral_parent, at=1, sets=[f"result={GOOD}"])


def test_one_edit_exactly(spiral_parent: Path, tmp_path: Path) -> None:
    patch = tmp_path / "patch.json"
    patch.write_text(json.dumps([{"op": "replace", "path": "/result", "value": GOOD}]))
    replacement = tmp_path / "doc.json"
    replacement.write_text(json.dumps({"result": GOOD}))
    refused(spiral_parent, ["--set", "result=x", "--patch", str(patch)], "exactly one edit",
            "--set PATH=VALUE")
    refused(spiral_parent, ["--patch", str(patch), "--replace", str(replacement)],
            "exactly one edit")
    refused(spiral_parent, [], "exactly one edit", "--set PATH=VALUE")
    with pytest.raises(EditError, match="exactly one edit"):
        replayer.fork(spiral_parent, at=1)


def test_an_output_that_exists(spiral_parent: Path) -> None:
    taken = spiral_parent.parent / "taken.jsonl"
    taken.write_text("not mine\n")
    refused(spiral_parent, ["--set", f"result={GOOD}", "-o", str(taken)], "already exists",
            "choose another -o")
    assert taken.read_text() == "not mine\n"
    refused(spiral_parent, ["--set", f"result={GOOD}", "-o", str(spiral_parent)],
            "already exists")
    with pytest.raises(PathTaken, match="already exists"):
        replayer.fork(spiral_parent, at=1, sets=[f"result={GOOD}"], out=taken)


def test_a_control_step_cannot_be_forked(spiral_parent: Path, stub: Any,
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("ANTHROPIC_BASE_URL", stub(AFTER_FORK).url)
    first = spiral_parent.parent / "first-fork.jsonl"
    with replayer.fork(spiral_parent, at=1, out=first, sets=[f"result={GOOD}"]):
        spiral.main()
    control = next(o["seq"] for o in load(first).observations if o["kind"] == "control")
    refused(first, ["--set", "event=x"], f"step {control} is a 'control' line",
            "editable kinds are model, http, tool", at=str(control))
    with pytest.raises(EditError, match="'control' line"):
        replayer.fork(first, at=control, sets=["event=x"])


def test_show_document(spiral_parent: Path) -> None:
    before = listing(spiral_parent.parent)
    parent = load(spiral_parent)
    tool = CliRunner().invoke(cli, ["fork", str(spiral_parent), "--at", "1",
                                    "--show-document"])
    assert tool.exit_code == 0, tool.output
    assert json.loads(tool.output) == {"result": parent.observations[1]["result"]}
    model = CliRunner().invoke(cli, ["fork", str(spiral_parent), "--at", "0",
                                     "--show-document"])
    assert model.exit_code == 0, model.output
    message = json.loads(model.output)
    assert message["content"][0]["text"] == "I'll search for the session refresh code."
    assert message["content"][1]["input"] == {"query": "session refresh"}
    assert message["stop_reason"] == "tool_use" and message["usage"]["input_tokens"] == 412
    bad = CliRunner().invoke(cli, ["fork", str(spiral_parent), "--at", "99",
                                   "--show-document"])
    assert bad.exit_code == 2 and "out of range" in bad.output
    assert listing(spiral_parent.parent) == before


# ------------------------------------------------------------------ divergence before the fork step


def test_a_changed_agent_diverges_before_the_fork_step(spiral_parent: Path, stub: Any,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    live = stub(AFTER_FORK)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", live.url)
    changed = [{**spiral.TOOLS[0], "description": "Search the code base (v2)."}]
    monkeypatch.setattr(spiral, "TOOLS", changed)
    with pytest.raises(Divergence) as info:
        with replayer.fork(spiral_parent, at=1, out=tmp_path / "d.jsonl",
                           sets=[f"result={GOOD}"]):
            spiral.main()
    assert info.value.step == 0
    assert "Search the code base (v2)." in info.value.diff
    assert live.requests == []  # nothing went live

    agent = tmp_path / "changed_agent.py"
    agent.write_text(SPIRAL.read_text().replace("Find it first.", "Look in auth/ first."))
    proc = deja("fork", str(spiral_parent), "--at", "1", "--set", f"result={GOOD}",
                "-o", str(tmp_path / "d2.jsonl"), "--", "python", str(agent),
                env={"ANTHROPIC_BASE_URL": live.url})
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Divergence" in proc.stderr and "Look in auth/ first." in proc.stderr
    assert live.requests == []


def test_fork_then_replay_another_cassette(spiral_parent: Path, stub: Any, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """--then-replay: after the fork step, calls come from a second cassette, not live."""
    live = stub(AFTER_FORK)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", live.url)
    first = tmp_path / "first.jsonl"
    with replayer.fork(spiral_parent, at=1, out=first, sets=[f"result={GOOD}"]):
        spiral.main()
    live.stop()
    capsys.readouterr()
    second = tmp_path / "second.jsonl"
    with replayer.fork(spiral_parent, at=1, out=second, sets=[f"result={GOOD}"],
                       then_replay=first):
        assert spiral.main() == 0
    assert FOUND in capsys.readouterr().out
    assert len(live.requests) == 1  # only the first fork's live turn ever reached it
    first_model = load(first).observations[3]
    second_model = load(second).observations[3]
    assert second_model["response"] == first_model["response"]
    assert load(second).header["parent"]["step"] == 1


@pytest.mark.parametrize(("agent", "edit"), [
    ("tests/intent_agent.py", 'result={"i": 0, "square": 7}'),
    ("tests/async_intent_agent.py", 'result={"invoice": "INV-7", "due": 999}'),
], ids=["sync", "async"])
def test_fork_then_replay_copies_side_effects_with_their_outcomes(agent: str, edit: str,
                                                                  tmp_path: Path) -> None:
    """--then-replay over a side-effecting tool: the fork gets the intent and its outcome
    (pointing at the fork's own intent, under the key the body really ran with), and
    the fork replays identical."""
    parent = tmp_path / "parent.jsonl"
    recorded = deja("record", "-o", str(parent), "--", "python", agent)
    assert recorded.returncode == 0, recorded.stderr
    out = tmp_path / "fork.jsonl"
    forked = deja("fork", str(parent), "--at", "0", "--set", edit, "-o", str(out),
                  "--then-replay", str(parent))
    assert forked.returncode == 0, forked.stdout + forked.stderr
    # after the edited first line, the fork prints what the parent printed
    assert forked.stdout.splitlines()[1:] == recorded.stdout.splitlines()[1:]

    source, lines = read_lines(parent)[1:], read_lines(out)[1:]
    run = read_lines(out)[0]["run"]
    intents = [line for line in lines if line["kind"] == "intent"]
    assert [i["name"] for i in intents] == [
        line["name"] for line in source if line["kind"] == "intent"] != []
    for intent in intents:
        outcome = lines[intent["seq"] + 1]
        assert outcome["kind"] == "outcome" and outcome["intent"] == intent["seq"]
        original = next(line for line in source if line["kind"] == "outcome"
                        and line["name"] == intent["name"])
        assert outcome["key"] == original["key"] != f"{run}:{intent['seq']}"
        assert outcome.get("result") == original.get("result")
        assert outcome.get("error") == original.get("error")
    end = lines[-1]
    assert end["status"] == "completed"
    assert end["totals"]["tool_calls"] == source[-1]["totals"]["tool_calls"]

    replayed = deja("replay", str(out))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "identical" in replayed.stdout
    assert replayed.stdout.splitlines()[:len(forked.stdout.splitlines())] == \
        forked.stdout.splitlines()
