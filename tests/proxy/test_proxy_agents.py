"""Acceptance tests of ``deja proxy`` with clients deja did not write.

The official TypeScript SDK (examples/node-agent), curl and the Python SDK talk to the
proxy as they would talk to the API: a run is recorded against the stub, then served
offline by ``deja proxy --replay`` byte for byte, a changed request is refused with the
step it diverged at, a fork through the proxy edits a tool result or a model reply, and
``deja diff`` compares a proxied recording with an in-process one of the same agent.
Everything runs as real processes on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import pytest
from anthropic.lib.streaming import MessageStream
from click.testing import CliRunner
from node_helpers import (
    API_ERROR_EXIT,
    SNOW_ANSWER,
    STUB_ANSWER,
    STUB_SCRIPT,
    ensure_node_modules,
    node_agent,
    node_missing,
    read_dump,
)
from proxy_helpers import ProxyProcess, cassettes, lines, load_verified

from deja.cli import main
from recorder.cassette import Cassette
from recorder.testing.server import StubServer

MODEL = "claude-sonnet-4-6"
Proxy = Callable[..., ProxyProcess]
Stub = Callable[[dict], StubServer]

CHANGED_PROMPT = "What's the weather in Oslo, in Fahrenheit?"
SNOWY_RESULT = "Paris: -2°C, heavy snow"


@pytest.fixture(scope="module", autouse=True)
def _node_modules() -> None:
    assert node_missing() is None, node_missing()
    ensure_node_modules()


# -- helpers ------------------------------------------------------------------------------


def deja(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """``deja ARGS`` run in this process (click's runner), with the test's key home."""
    argv = [str(a) for a in args]
    result = CliRunner().invoke(main, argv)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(argv, result.exit_code, result.stdout, result.stderr)


def start_python(*args: str | Path, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """``python ARGS`` as a process of its own, with ``env`` over the test's environment."""
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **env})


def finish(process: subprocess.Popen[str]) -> str:
    """Wait for ``process``; its stdout, once it exited 0."""
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return out


def weather_stub(stub: Stub) -> StubServer:
    return stub(json.loads(STUB_SCRIPT.read_text(encoding="utf-8")))


def record_node_run(proxy: Proxy, upstream: StubServer, tmp_path: Path,
                    *flags: str) -> tuple[Path, list[dict]]:
    """Record the Node agent through a proxy in front of ``upstream``; the proxy is stopped
    (exit 0) before this returns the cassette and the agent's dump."""
    directory = tmp_path / "recorded"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    dump = tmp_path / "record.dump"
    run = node_agent(*flags, "--dump", str(dump), env={"ANTHROPIC_BASE_URL": recording.url})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == STUB_ANSWER
    status, log = recording.stop()
    assert status == 0, log
    [cassette] = cassettes(directory)
    return cassette, read_dump(dump)


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    """The events of an SSE body as (event name, data), checking its framing: every event
    is an ``event:`` line and a ``data:`` line holding JSON of the same type."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), text[-200:]
    events = []
    for block in text.strip("\n").split("\n\n"):
        parts = block.split("\n")
        assert len(parts) == 2 and parts[0].startswith("event: ") \
            and parts[1].startswith("data: "), block
        name, data = parts[0][len("event: "):], json.loads(parts[1][len("data: "):])
        assert data["type"] == name, block
        events.append((name, data))
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop", events
    return events


def streamed_text(raw: bytes, index: int = 0) -> str:
    return "".join(data["delta"]["text"] for name, data in sse_events(raw)
                   if name == "content_block_delta" and data["index"] == index
                   and data["delta"]["type"] == "text_delta")


def tool_steps(cassette: Cassette) -> list[dict[str, Any]]:
    return [o for o in lines(cassette) if o["kind"] == "tool"]


def parent_of(cassette: Cassette) -> dict[str, Any]:
    parent = cassette.header.get("parent")
    assert isinstance(parent, dict), cassette.header
    return dict(parent)


# -- 1. the official TypeScript SDK --------------------------------------------------------


@pytest.mark.parametrize("mode", ["stream", "json"])
def test_node_agent_records_replays_byte_for_byte_and_refuses_a_changed_prompt(
        proxy: Proxy, stub: Stub, tmp_path: Path, mode: str) -> None:
    flags = ("--json",) if mode == "json" else ()
    upstream = weather_stub(stub)
    cassette_path, recorded = record_node_run(proxy, upstream, tmp_path, *flags)
    upstream.stop()
    assert len(upstream.requests) == 3
    assert [d["status"] for d in recorded] == [200, 200, 200]
    assert [d["retry_count"] for d in recorded] == [0, 0, 0]

    # the cassette verifies, with the model calls and the tool results the proxy saw
    verified = deja("verify", cassette_path)
    assert verified.returncode == 0, verified.stderr
    assert "end: completed" in verified.stdout
    cassette = load_verified(cassette_path)
    assert cassette.end is not None and cassette.end["status"] == "completed"
    assert [o["kind"] for o in lines(cassette)] == \
        ["model", "tool", "model", "tool", "model"]
    tools = tool_steps(cassette)
    assert [(t["name"], t["args"], t["result"], t["call_id"], t["observed"]) for t in tools] \
        == [("get_weather", {"city": "Paris"}, "Paris: 18°C, light rain", "toolu_weather_01",
             "proxy"),
            ("convert", {"celsius": 18}, "18°C is 64.4°F", "toolu_convert_01", "proxy")]
    for seq in (0, 2, 4):
        body = cassette.request_of(seq)
        assert body["model"] == MODEL
        assert (body.get("stream") is True) == (mode == "stream")
    content_types = [dict(o["response"]["headers"])["content-type"]
                     for o in lines(cassette) if o["kind"] == "model"]
    assert len(content_types) == 3 and all(
        ct.startswith("text/event-stream" if mode == "stream" else "application/json")
        for ct in content_types), content_types

    shown = deja("show", "--json", cassette_path)
    assert shown.returncode == 0, shown.stderr
    assert [(s["kind"], s["name"]) for s in json.loads(shown.stdout)["steps"]] == [
        ("model", MODEL), ("tool", "get_weather"), ("model", MODEL), ("tool", "convert"),
        ("model", MODEL)]
    table = deja("show", cassette_path)
    assert "get_weather" in table.stdout and "convert" in table.stdout

    # --replay, with no upstream: the same program gets the same bytes
    replaying = proxy("--replay", str(cassette_path))
    dump = tmp_path / "replay.dump"
    again = node_agent(*flags, "--dump", str(dump), env={"ANTHROPIC_BASE_URL": replaying.url})
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == STUB_ANSWER
    replayed = read_dump(dump)
    assert [d["body"] for d in replayed] == [d["body"] for d in recorded]
    assert [d["status"] for d in replayed] == [200, 200, 200]
    status, log = replaying.stop()
    assert status == 0, log
    assert ": identical" in log and "steps:      5/5 served" in log, log
    assert len(upstream.requests) == 3  # nothing went to the stub

    # a changed prompt: one attempt, an API error naming the step, exit 1 with the diff
    replaying = proxy("--replay", str(cassette_path))
    dump = tmp_path / "diverged.dump"
    changed = node_agent(*flags, "--dump", str(dump), CHANGED_PROMPT,
                         env={"ANTHROPIC_BASE_URL": replaying.url})
    assert changed.returncode == API_ERROR_EXIT, (changed.stdout, changed.stderr)
    assert changed.stdout == ""
    assert "error: 400 deja replay: the request diverged from the recording at step 0" \
        in changed.stderr, changed.stderr
    assert "attempts: 1" in changed.stderr.splitlines(), changed.stderr
    [attempt] = read_dump(dump)
    assert (attempt["attempt"], attempt["retry_count"], attempt["status"]) == (1, 0, 400)
    assert json.loads(attempt["body"])["error"]["type"] == "invalid_request_error"
    status, log = replaying.stop()
    assert status == 1, log
    assert "DIVERGED" in log and "divergence: step 0 (model)" in log, log
    assert "--- recorded" in log and "+++ replayed" in log
    assert f'+      "content": "{CHANGED_PROMPT}",' in log, log
    assert "-      \"content\": \"What's the weather in Paris, in Fahrenheit?\"," in log, log


# -- 2. curl ------------------------------------------------------------------------------


CURL_BODY = {"model": MODEL, "max_tokens": 64,
             "messages": [{"role": "user", "content": "Say hello in French."}]}


def curl(url: str, body: Path, headers: Path, *extra: str) -> bytes:
    done = subprocess.run(
        ["curl", "-sS", "-X", "POST", f"{url}/v1/messages", "-H", "content-type: application/json",
         "-H", "x-api-key: sk-test", "-H", "anthropic-version: 2023-06-01", "-D", str(headers),
         *extra, "-d", f"@{body}"], capture_output=True, timeout=60, cwd=body.parent)
    assert done.returncode == 0, done.stderr
    return done.stdout


def response_headers(path: Path) -> dict[str, str]:
    lines = path.read_text(encoding="latin-1").splitlines()
    assert lines[0].startswith("HTTP/1.1 "), lines
    return {k.strip().lower(): v.strip() for k, _, v in
            (line.partition(":") for line in lines[1:] if line)} | {"status": lines[0]}


def test_curl_json_and_sse_record_then_replay_byte_identical(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    assert shutil.which("curl") is not None, "curl is not installed (apt-get install curl)"
    upstream = stub({"select": "conversation", "turns": [{"text": "Bonjour, le monde !"}]})
    json_body, sse_body = tmp_path / "body.json", tmp_path / "stream.json"
    json_body.write_text(json.dumps(CURL_BODY))
    sse_body.write_text(json.dumps({**CURL_BODY, "stream": True}))
    directory = tmp_path / "curl-cassettes"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    as_json = curl(recording.url, json_body, tmp_path / "json.headers")
    as_sse = curl(recording.url, sse_body, tmp_path / "sse.headers", "-N")
    status, log = recording.stop()
    assert status == 0, log

    json_headers = response_headers(tmp_path / "json.headers")
    sse_headers = response_headers(tmp_path / "sse.headers")
    assert " 200 " in json_headers["status"] and " 200 " in sse_headers["status"]
    assert json_headers["content-type"] == "application/json"
    assert sse_headers["content-type"].startswith("text/event-stream")
    message = json.loads(as_json)
    assert message["content"] == [{"type": "text", "text": "Bonjour, le monde !"}]
    names = [name for name, _ in sse_events(as_sse)]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert b"\nevent: content_block_delta\ndata: {" in as_sse
    assert streamed_text(as_sse) == "Bonjour, le monde !"

    runs = {json_headers["x-deja-run-id"], sse_headers["x-deja-run-id"]}
    assert len(runs) == 2  # the same conversation again after a success is a new run
    assert {p.stem for p in cassettes(directory)} == runs
    upstream.stop()

    for body, headers, recorded, extra in (
            (json_body, json_headers, as_json, ()), (sse_body, sse_headers, as_sse, ("-N",))):
        cassette = directory / f"{headers['x-deja-run-id']}.jsonl"
        assert [o["kind"] for o in lines(load_verified(cassette))] == ["model"]
        replaying = proxy("--replay", str(cassette))
        served_headers = tmp_path / "served.headers"
        assert curl(replaying.url, body, served_headers, *extra) == recorded
        served = response_headers(served_headers)
        for name in ("content-type", "request-id", "date", "x-deja-run-id"):
            assert served[name] == headers[name], name
        if "content-length" in headers:
            assert served["content-length"] == headers["content-length"] == str(len(recorded))
        status, log = replaying.stop()
        assert status == 0, log
        assert ": identical" in log, log


# -- 3. the Python SDK pointed at the proxy -----------------------------------------------


PY_TOOLS = [{"name": "lookup", "description": "Look a word up in the dictionary.",
             "input_schema": {"type": "object", "properties": {"word": {"type": "string"}},
                              "required": ["word"]}}]
PY_TEXTS = ["Let me look that up.",
            "It means 'already': a deja vu is the feeling of having seen it already."]
PY_SCRIPT = {"select": "conversation", "turns": [
    {"text": PY_TEXTS[0], "tool_use": {"name": "lookup", "input": {"word": "deja"}}},
    {"text": PY_TEXTS[1]}]}


def lookup(word: str) -> str:
    return f"{word}: French for 'already'"


def python_tool_loop(url: str, how: str, tool: Callable[..., str] = lookup,
                     max_retries: int = 0) -> tuple[list[bytes], list[dict[str, Any]]]:
    """Run a 2-turn tool loop with the Python SDK; the raw response bodies (none for the
    stream helper, which keeps no bytes) and the final messages of each turn."""
    bodies: list[bytes] = []
    finals: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What does 'deja' mean?"}]
    with anthropic.Anthropic(base_url=url, api_key="sk-test",
                             max_retries=max_retries) as client:
        for _ in range(4):
            params: dict[str, Any] = {"model": MODEL, "max_tokens": 256, "tools": PY_TOOLS,
                                      "messages": messages}
            if how == "json":
                raw = client.messages.with_raw_response.create(**params)
                bodies.append(raw.http_response.content)
                message: Any = raw.parse()
            elif how == "sse":
                with client.messages.with_streaming_response.create(**params,
                                                                    stream=True) as r:
                    bodies.append(r.read())
                    message = MessageStream(r.parse(),
                                            output_format=anthropic.NOT_GIVEN).get_final_message()
            else:
                with client.messages.stream(**params) as s:
                    message = s.get_final_message()
            finals.append(message.model_dump(mode="json"))
            messages.append({"role": "assistant", "content": [
                b.model_dump(mode="json", exclude_none=True, exclude={"parsed_output"})
                for b in message.content]})
            if message.stop_reason != "tool_use":
                return bodies, finals
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id, "content": tool(**b.input)}
                for b in message.content if b.type == "tool_use"]})
    raise AssertionError("no final answer")


@pytest.mark.parametrize("how", ["json", "sse", "stream-helper"])
def test_python_sdk_tool_loop_records_and_replays_the_same_bytes(
        proxy: Proxy, stub: Stub, tmp_path: Path, how: str) -> None:
    upstream = stub(PY_SCRIPT)
    directory = tmp_path / "py-cassettes"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    bodies, finals = python_tool_loop(recording.url, how)
    status, log = recording.stop()
    assert status == 0, log
    upstream.stop()
    assert len(finals) == 2 and finals[-1]["stop_reason"] == "end_turn"
    assert finals[-1]["content"][0]["text"] == PY_TEXTS[1]
    if how == "json":
        assert [json.loads(b)["id"] for b in bodies] == [f["id"] for f in finals]
    elif how == "sse":
        assert [streamed_text(b) for b in bodies] == PY_TEXTS

    [cassette_path] = cassettes(directory)
    cassette = load_verified(cassette_path)
    assert [o["kind"] for o in lines(cassette)] == ["model", "tool", "model"]
    [tool] = tool_steps(cassette)
    assert (tool["name"], tool["args"], tool["result"], tool["observed"]) == \
        ("lookup", {"word": "deja"}, "deja: French for 'already'", "proxy")

    replaying = proxy("--replay", str(cassette_path))
    replayed_bodies, replayed_finals = python_tool_loop(replaying.url, how)
    status, log = replaying.stop()
    assert status == 0, log
    assert ": identical" in log and "steps:      3/3 served" in log, log
    assert replayed_bodies == bodies
    assert replayed_finals == finals


def test_python_sdk_changed_tool_result_diverges_at_the_tool_step(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    upstream = stub(PY_SCRIPT)
    directory = tmp_path / "py-cassettes"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    python_tool_loop(recording.url, "json")
    status, log = recording.stop()
    assert status == 0, log
    upstream.stop()
    [cassette_path] = cassettes(directory)

    replaying = proxy("--replay", str(cassette_path))
    with pytest.raises(anthropic.BadRequestError) as refused:
        # the SDK's retries are on: the divergence must not be retried
        python_tool_loop(replaying.url, "json", tool=lambda word: f"{word}: no idea",
                         max_retries=2)
    message = refused.value.body["error"]["message"]  # type: ignore[index]
    # the tool's own step, as deja diff names it, not the model request carrying it
    assert message.startswith("deja replay: the request diverged from the recording at "
                              "step 1 (tool)"), message
    assert "'lookup' returned something other than the recorded result" in message
    assert refused.value.response.headers["x-should-retry"] == "false"
    status, log = replaying.stop()
    assert status == 1, log
    assert log.count("POST /v1/messages 400") == 1, log  # one attempt, no retry
    assert log.count("POST /v1/messages 200") == 1, log  # step 0 was served
    assert "divergence: step 1 (tool)" in log
    assert '-  "result": "deja: French for \'already\'"' in log, log
    assert '+  "result": "deja: no idea"' in log, log


# -- 4. forks through the proxy -----------------------------------------------------------


def test_fork_at_the_weather_tool_step_through_the_proxy(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    upstream = weather_stub(stub)
    parent_path, _ = record_node_run(proxy, upstream, tmp_path)
    parent = load_verified(parent_path)
    [at] = [o["seq"] for o in lines(parent)
            if o["kind"] == "tool" and o["name"] == "get_weather"]
    seen = len(upstream.requests)

    out = tmp_path / "fork.jsonl"
    forking = proxy("--fork", str(parent_path), "--at", str(at), "--set",
                    f"/result={SNOWY_RESULT}", "--upstream", upstream.url, "-o", str(out))
    run = node_agent(env={"ANTHROPIC_BASE_URL": forking.url})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == SNOW_ANSWER
    status, log = forking.stop()
    assert status == 0, log
    assert f"the fork was written to {out}" in log, log

    # the first model step was served; the next request went upstream with the edit in it
    live = upstream.requests[seen:]
    assert len(live) == 1
    results = [b for m in live[0]["body"]["messages"] if m["role"] == "user"
               and isinstance(m["content"], list) for b in m["content"]]
    assert [b["content"] for b in results] == [SNOWY_RESULT]

    fork = load_verified(out)
    assert parent_of(fork)["run"] == parent.run
    assert parent_of(fork)["step"] == at
    assert fork.end is not None and fork.end["status"] == "completed"
    edited = lines(fork)[at]
    assert (edited["kind"], edited["name"], edited["result"], edited.get("edited")) == \
        ("tool", "get_weather", SNOWY_RESULT, True)

    compared = deja("diff", "--json", parent_path, out)
    assert compared.returncode == 1, compared.stderr
    report = json.loads(compared.stdout)
    assert report["same"] is False
    assert report["first_divergence"] == at and report["same_prefix"] == at
    first = report["steps"][0]
    assert first["seq"] == at and (first["kind_a"], first["kind_b"]) == ("tool", "tool")
    assert [c["path"] for c in first["changes"]] == ["/result"]
    text = deja("diff", parent_path, out)
    assert f"first divergence: step {at}" in text.stdout, text.stdout


@pytest.mark.parametrize("which", ["first", "last"])
def test_fork_at_a_model_step_serves_the_edited_text_as_a_valid_stream(
        proxy: Proxy, stub: Stub, tmp_path: Path, which: str) -> None:
    upstream = weather_stub(stub)
    parent_path, recorded = record_node_run(proxy, upstream, tmp_path)
    parent = load_verified(parent_path)
    models = [o["seq"] for o in lines(parent) if o["kind"] == "model"]
    at = models[0] if which == "first" else models[-1]
    shown = deja("fork", parent_path, "--at", str(at), "--show-document")
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert document["content"][0]["type"] == "text"
    assert document["stop_reason"] == ("tool_use" if which == "first" else "end_turn")
    edited_text = f"EDITED ({which}): a reply nobody recorded."
    seen = len(upstream.requests)

    out = tmp_path / "fork.jsonl"
    forking = proxy("--fork", str(parent_path), "--at", str(at), "--set",
                    f"content.0.text={edited_text}", "--upstream", upstream.url,
                    "-o", str(out))
    dump = tmp_path / "fork.dump"
    run = node_agent("--dump", str(dump), env={"ANTHROPIC_BASE_URL": forking.url})
    assert run.returncode == 0, run.stderr
    status, log = forking.stop()
    assert status == 0, log
    served = read_dump(dump)
    index = models.index(at)
    assert len(served) == len(recorded)
    assert [d["body"] for d in served[:index]] == [d["body"] for d in recorded[:index]]
    assert streamed_text(served[index]["body"]) == edited_text
    assert served[index]["body"] != recorded[index]["body"]
    if which == "first":
        # the SDK assembled the edited message and the agent sent it back, live
        assert run.stdout.strip() == STUB_ANSWER
        assert len(upstream.requests) - seen == 2
        history = upstream.requests[seen]["body"]["messages"]
        assert history[1]["role"] == "assistant"
        assert history[1]["content"][0] == {"type": "text", "text": edited_text}
        assert history[1]["content"][1]["name"] == "get_weather"
    else:
        assert run.stdout.strip() == edited_text
        assert len(upstream.requests) == seen  # every step was served from the parent
    fork = load_verified(out)
    assert parent_of(fork) == {**parent_of(fork), "run": parent.run, "step": at}


# -- 5. deja diff: a proxied and an in-process recording of the same agent ----------------


PY_AGENT = '''
import os

import anthropic

import recorder

TOOLS = [
    {"name": "get_weather", "description": "The current weather in a city.",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"]}},
    {"name": "convert", "description": "Convert a temperature from Celsius to Fahrenheit.",
     "input_schema": {"type": "object", "properties": {"celsius": {"type": "number"}},
                      "required": ["celsius"]}},
]


def get_weather(city):
    return f"{city}: 18°C, light rain"


def convert(celsius):
    return f"{celsius}°C is {celsius * 9 / 5 + 32:.1f}°F"


if os.environ.get("AGENT_DECORATE") == "1":
    get_weather = recorder.tool(get_weather)
    convert = recorder.tool(convert)
HANDLERS = {"get_weather": get_weather, "convert": convert}

messages = [{"role": "user", "content": "What's the weather in Paris, in Fahrenheit?"}]
with anthropic.Anthropic(max_retries=0) as client:
    for _ in range(5):
        reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=1024,
                                       tools=TOOLS, messages=messages)
        messages.append({"role": "assistant", "content": [
            b.model_dump(mode="json", exclude_none=True) for b in reply.content]})
        if reply.stop_reason != "tool_use":
            print("".join(b.text for b in reply.content if b.type == "text"))
            break
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": HANDLERS[b.name](**b.input)}
            for b in reply.content if b.type == "tool_use"]})
'''


def test_diff_of_a_proxied_and_an_in_process_recording(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    """The same agent through the proxy, and under ``deja record`` with its tools decorated
    with @recorder.tool and without (outside a recording the decorator changes nothing, so
    one proxied run stands for both); all three recorded at the same time."""
    upstream = weather_stub(stub)
    (tmp_path / "agent.py").write_text(PY_AGENT, encoding="utf-8")
    env = {"ANTHROPIC_API_KEY": "sk-test"}
    directory = tmp_path / "proxied"
    recording = proxy("--upstream", upstream.url, "--dir", str(directory))
    proxied_run = start_python("agent.py", cwd=tmp_path,
                               env={**env, "ANTHROPIC_BASE_URL": recording.url})
    in_process = {decorate: tmp_path / f"in-process-{decorate}.jsonl" for decorate in "10"}
    recorded = [start_python("-m", "deja", "record", "-o", path, "--", sys.executable,
                             "agent.py", cwd=tmp_path,
                             env={**env, "ANTHROPIC_BASE_URL": upstream.url,
                                  "AGENT_DECORATE": decorate})
                for decorate, path in in_process.items()]
    for process in (proxied_run, *recorded):
        assert finish(process).strip() == STUB_ANSWER
    status, log = recording.stop()
    assert status == 0, log
    [proxied] = cassettes(directory)
    assert [o["kind"] for o in lines(load_verified(proxied))] == \
        ["model", "tool", "model", "tool", "model"]

    # @recorder.tool in process, observed tool results through the proxy: the same steps
    compared = deja("diff", "--json", in_process["1"], proxied)
    report = json.loads(compared.stdout)
    assert compared.returncode == 0, compared.stdout
    assert report["same"] is True and report["steps"] == []
    assert (report["steps_a"], report["steps_b"]) == (5, 5)
    text = deja("diff", in_process["1"], proxied)
    assert text.returncode == 0 and "same: every step means the same" in text.stdout

    # a plain function leaves no tool step in process: the runs part at the first tool,
    # a step only the proxied run has; the model steps after it still line up
    compared = deja("diff", "--json", in_process["0"], proxied)
    report = json.loads(compared.stdout)
    assert compared.returncode == 1, compared.stdout
    assert (report["steps_a"], report["steps_b"]) == (3, 5)
    assert report["first_divergence"] == 1
    first = report["steps"][0]
    assert (first["seq"], first["kind_a"], first["kind_b"]) == (1, None, "tool")
    assert [(s["kind_a"], s["kind_b"]) for s in report["steps"]] == [
        (None, "tool"), (None, "tool"), ("end", "end")]  # its totals count the tools
    text = deja("diff", in_process["0"], proxied)
    assert text.returncode == 1 and "first divergence: step 1" in text.stdout


# -- 6. a compressed upstream answer ------------------------------------------------------


class _GzipHandler(BaseHTTPRequestHandler):
    """Forwards a POST to ``server.target`` and answers with its body gzip-encoded, as the
    API does for a client that sends ``accept-encoding: gzip`` (every SDK does)."""

    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("host", "accept-encoding", "connection")}
        request = urllib.request.Request(self.server.target + self.path, data=body,
                                         headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            data, status = gzip.compress(answer.read()), answer.status
            content_type = answer.headers["content-type"]
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-encoding", "gzip")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextlib.contextmanager
def gzip_upstream(target: str) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _GzipHandler)
    server.daemon_threads = True
    server.target = target  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_gzip_encoded_upstream_answer_is_recorded_readable(
        proxy: Proxy, stub: Stub, tmp_path: Path) -> None:
    upstream = stub(PY_SCRIPT)
    directory = tmp_path / "gzip-cassettes"
    with gzip_upstream(upstream.url) as zipped:
        recording = proxy("--upstream", zipped, "--dir", str(directory))
        bodies, finals = python_tool_loop(recording.url, "json")
        status, log = recording.stop()
    assert status == 0, log
    assert finals[-1]["stop_reason"] == "end_turn"  # the SDK decoded every answer
    [cassette_path] = cassettes(directory)
    cassette = load_verified(cassette_path)
    assert [o["kind"] for o in lines(cassette)] == ["model", "tool", "model"]

    # what the proxy read of each answer: its usage and its stop reason
    shown = json.loads(deja("show", "--json", cassette_path).stdout)
    assert [(s["input_tokens"], s["output_tokens"]) for s in shown["steps"]
            if s["kind"] == "model"] == [
        (f["usage"]["input_tokens"], f["usage"]["output_tokens"]) for f in finals]
    assert cassette.end is not None and cassette.end["status"] == "completed", cassette.end

    replaying = proxy("--replay", str(cassette_path))
    replayed_bodies, replayed_finals = python_tool_loop(replaying.url, "json")
    status, log = replaying.stop()
    assert status == 0, log
    assert replayed_bodies == bodies and replayed_finals == finals
