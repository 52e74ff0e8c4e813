"""``deja import``: a vcrpy cassette of real SDK calls becomes a signed deja cassette.

The Anthropic cassette is recorded here by vcrpy itself (``use_cassette(record_mode="all")``
around the real anthropic SDK talking to the stub server, no deja session active), then
imported with the CLI. The import must verify, hold model lines with usage, cost and stop
reason and no API key, and replay bit for bit in process; a changed prompt diverges.
The OpenAI cassette is written by hand (one chat completion, its body gzip-compressed and
stored as ``!!binary`` as vcrpy stores bytes), imported, and replayed with the openai SDK.
"""

from __future__ import annotations

import base64
import email.utils
import gzip
import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest
import requests
import vcr
import yaml
from click.testing import CliRunner
from conftest import API_KEY, MODEL, http_server

import recorder
import replayer
from deja.cli import main
from recorder.capture import session

SCRIPT = {"turns": [
    {"text": "Hello there."},
    {"text": "one two three four five"},
    {"text": "Let me look.", "tool_use": {"name": "weather", "input": {"city": "Paris"}}},
    {"text": "It is sunny in Paris."},
]}
TOOLS = [{"name": "weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]


def agent(url: str, prompt: str = "hi") -> list[bytes]:
    """A sync JSON call, a streamed call and a two-turn tool conversation; the raw
    response bodies the SDK got, in order."""
    bodies = []
    with anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0) as client:
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=32, messages=[{"role": "user", "content": prompt}])
        bodies.append(raw.http_response.content)
        with client.messages.with_streaming_response.create(
                model=MODEL, max_tokens=32, stream=True,
                messages=[{"role": "user", "content": "stream please"}]) as response:
            bodies.append(b"".join(response.iter_bytes()))
        history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=64, tools=TOOLS, messages=history)
        bodies.append(first.http_response.content)
        message = first.parse()
        call = next(block for block in message.content if block.type == "tool_use")
        history += [{"role": "assistant", "content": [b.model_dump() for b in message.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": "sunny, 24 C"}]}]
        second = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=64, tools=TOOLS, messages=history)
        bodies.append(second.http_response.content)
    return bodies


def deja(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def recorded(stub, tmp_path: Path) -> tuple[Path, str, list[bytes]]:
    """A vcrpy cassette of :func:`agent` against the stub (stopped afterwards): its path,
    the stub's URL and the bodies the SDK got."""
    server = stub(SCRIPT)
    path = tmp_path / "agent.yaml"
    assert session.active() is None  # vcrpy alone patches the SDK's transport here
    with vcr.VCR().use_cassette(str(path), record_mode="all") as cassette:
        bodies = agent(server.url)
    server.stop()
    assert len(cassette.data) == 4 and len(server.requests) == 4
    assert API_KEY in path.read_text()  # the key is there to be redacted
    return path, server.url, bodies


def test_import_verifies_and_holds_model_lines_without_the_key(recorded, tmp_path: Path) -> None:
    source, _, bodies = recorded
    out = tmp_path / "run.jsonl"
    result = deja("import", str(source), "-o", str(out), "--label", "team=evals")
    assert result.exit_code == 0, result.output
    assert "imported 4 interactions (4 model calls)" in result.output
    assert str(out) in result.output
    checked = deja("verify", str(out))
    assert checked.exit_code == 0, checked.output
    assert "verified" in checked.output

    text = out.read_text()
    assert API_KEY not in text and "SECRET" not in text
    run = recorder.load(out, require_signature=True)
    assert run.header["labels"] == {"team": "evals"}
    assert run.header["imported"] == {"from": "vcrpy", "cassette": "agent.yaml",
                                      "interactions": 4}
    assert run.header["argv"] == []
    assert run.end is not None and run.end["status"] == "completed"
    assert run.end["totals"]["model_calls"] == 4
    lines = [o for o in run.observations if o["kind"] == "model"]
    assert len(lines) == 4
    assert [o["stop_reason"] for o in lines] == ["end_turn", "end_turn", "tool_use", "end_turn"]
    for line, body in zip(lines, bodies, strict=True):
        assert line["provider"] == "anthropic"
        assert line["usage"]["input_tokens"] > 0 and line["usage"]["output_tokens"] > 0
        assert line["cost_usd"] > 0
        assert line["ms"] is None  # vcrpy keeps no durations
        date = dict((k.lower(), v) for k, v in line["response"]["headers"])["date"]
        assert line["t"] == email.utils.parsedate_to_datetime(date).timestamp()
        assert line["response"]["body"].encode() == body
        headers = dict(line["request_headers"])
        assert headers["authorization"] == "[redacted]"
    last = run.request_of(lines[3]["seq"])
    assert last["messages"][2]["content"][0]["type"] == "tool_result"


def test_import_replays_bit_for_bit_and_a_changed_prompt_diverges(recorded,
                                                                   tmp_path: Path) -> None:
    source, url, bodies = recorded
    out = tmp_path / "run.jsonl"
    assert deja("import", str(source), "-o", str(out)).exit_code == 0

    ctx = replayer.replay(out, require_signature=True)
    with ctx:
        replayed = agent(url)
    assert replayed == bodies
    assert ctx.result is not None and ctx.result.identical, ctx.result.report()
    assert ctx.result.verified
    assert ctx.result.steps_served == ctx.result.steps_recorded == 4

    with pytest.raises(recorder.Divergence) as info, replayer.replay(out):
        agent(url, prompt="something else")
    assert "something else" in str(info.value)


def test_import_into_a_directory_names_the_file_by_its_run(recorded, tmp_path: Path) -> None:
    source, _, _ = recorded
    folder = tmp_path / "cassettes"
    folder.mkdir()
    result = deja("import", str(source), "-o", str(folder))
    assert result.exit_code == 0, result.output
    (written,) = folder.glob("*.jsonl")
    assert recorder.load(written).run == written.stem


# ---------------------------------------------------------------------------------- OpenAI

OPENAI_KEY = "sk-proj-vcrImportSECRET0123456789abcdef"
OPENAI_MODEL = "gpt-4.1"
COMPLETION = {
    "id": "chatcmpl-vcr1", "object": "chat.completion", "created": 1764600000,
    "model": OPENAI_MODEL,
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "Hi there!", "refusal": None}}],
    "usage": {"prompt_tokens": 320, "completion_tokens": 5, "total_tokens": 325,
              "prompt_tokens_details": {"cached_tokens": 300}},
}
REQUEST = {"messages": [{"role": "user", "content": "Say hi"}], "model": OPENAI_MODEL}


def openai_cassette(path: Path) -> bytes:
    """A vcrpy cassette of one chat completion, as vcrpy writes one: headers as lists,
    the gzip-compressed response body as ``!!binary``; returns the decoded body."""
    body = json.dumps(COMPLETION, separators=(",", ":")).encode()
    packed = base64.encodebytes(gzip.compress(body, mtime=0)).decode()
    path.write_text(
        "interactions:\n"
        "- request:\n"
        f"    body: '{json.dumps(REQUEST, separators=(',', ':'))}'\n"
        "    headers:\n"
        "      accept: [application/json]\n"
        f"      authorization: [Bearer {OPENAI_KEY}]\n"
        "      content-type: [application/json]\n"
        "    method: POST\n"
        "    uri: https://api.openai.com/v1/chat/completions\n"
        "  response:\n"
        "    body:\n"
        "      string: !!binary |\n"
        + "".join(f"        {row}\n" for row in packed.splitlines()) +
        "    headers:\n"
        "      content-encoding: [gzip]\n"
        "      content-type: [application/json]\n"
        "      date: ['Mon, 01 Dec 2025 12:00:00 GMT']\n"
        "    status: {code: 200, message: OK}\n"
        "version: 1\n")
    return body


def test_an_openai_chat_completion_imports_as_an_openai_model_line(tmp_path: Path) -> None:
    source = tmp_path / "openai.yaml"
    body = openai_cassette(source)
    out = tmp_path / "openai.jsonl"
    result = deja("import", str(source), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "imported 1 interaction (1 model call)" in result.output
    assert OPENAI_KEY not in out.read_text()

    (line,) = recorder.load(out, require_signature=True).observations
    assert line["kind"] == "model" and line["provider"] == "openai"
    assert line["usage"] == {"input_tokens": 20, "output_tokens": 5,
                             "cache_read_input_tokens": 300}
    assert line["stop_reason"] == "stop"
    assert line["cost_usd"] == round((20 * 2.0 + 5 * 8.0 + 300 * 0.5) / 1_000_000, 8)
    assert line["t"] == 1764590400.0  # the response's date header

    ctx = replayer.replay(out, require_signature=True)
    with ctx, openai.OpenAI(api_key="sk-other", max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(
            model=OPENAI_MODEL, messages=[{"role": "user", "content": "Say hi"}])
    assert raw.http_response.content == body
    assert raw.parse().choices[0].message.content == "Hi there!"
    assert ctx.result is not None and ctx.result.identical, ctx.result.report()


class _Gzipped(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = gzip.compress(b'{"note": "hello"}')
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-encoding", "gzip")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_body_vcrpy_kept_decoded_imports_as_the_wire_had_it(tmp_path: Path) -> None:
    """vcrpy keeps the body requests decoded, under its gzip header: imported, it is
    compressed again, and httpx (which decodes it itself) replays it as requests does."""
    source, out = tmp_path / "requests.yaml", tmp_path / "requests.jsonl"
    with http_server(_Gzipped) as base:
        with vcr.use_cassette(str(source), record_mode="all"):
            assert requests.get(base + "/data", timeout=30).json() == {"note": "hello"}
        assert "hello" in source.read_text()  # vcrpy's copy: the decoded text
        result = deja("import", str(source), "-o", str(out))
        assert result.exit_code == 0, result.output
        (line,) = recorder.load(out, require_signature=True).observations
        stored = base64.b64decode(line["response"]["body"])
        assert gzip.decompress(stored) == b'{"note": "hello"}'
        for get in (lambda u: httpx2.get(u, timeout=30).json(),
                    lambda u: requests.get(u, timeout=30).json()):
            with replayer.replay(out, require_signature=True):
                assert get(base + "/data") == {"note": "hello"}


# ------------------------------------------------------------------------------ bad input


def test_a_file_that_is_not_a_vcrpy_cassette_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    for name, text, says in [
        ("config.yaml", "name: deja\nversion: 3\n", "has no 'interactions' list"),
        ("list.yaml", "- 1\n- 2\n", "has no 'interactions' list"),
        ("broken.yaml", "interactions: [unclosed\n", "does not load as YAML"),
        ("blank.yaml", "", "has no 'interactions' list"),
        ("empty.yaml", "interactions: []\nversion: 1\n", "no interactions"),
    ]:
        source = tmp_path / name
        source.write_text(text)
        result = deja("import", str(source), "-o", str(out))
        assert result.exit_code == 2, (name, result.output)
        assert "NotAVcrCassette" in result.output and says in result.output, result.output
        assert str(source) in result.output
        assert not out.exists()


def test_an_interaction_it_cannot_convert_is_named_by_index_and_uri(tmp_path: Path) -> None:
    source = tmp_path / "openai.yaml"
    openai_cassette(source)
    data = yaml.safe_load(source.read_text())
    second = json.loads(json.dumps(data["interactions"][0], default=str))
    second["request"]["uri"] = "https://api.openai.com/v1/chat/completions?api_key=sk-leak"
    del second["response"]["status"]
    data["interactions"].append(second)
    source.write_text(yaml.safe_dump(data))
    out = tmp_path / "run.jsonl"
    result = deja("import", str(source), "-o", str(out))
    assert result.exit_code == 2, result.output
    assert "CannotConvert" in result.output
    assert "interaction 1 (POST https://api.openai.com/v1/chat/completions" in result.output
    assert "status" in result.output and "sk-leak" not in result.output
    assert not out.exists()


def test_a_model_request_the_recorder_refuses_leaves_no_partial_output(tmp_path: Path) -> None:
    source = tmp_path / "openai.yaml"
    openai_cassette(source)
    text = source.read_text()
    first = text.split("interactions:\n", 1)[1].split("version: 1", 1)[0]
    source.write_text("interactions:\n" + first
                      + first.replace('"Say hi"}]', '"Say hi"}],"temperature":NaN')
                      + "version: 1\n")
    out = tmp_path / "run.jsonl"
    result = deja("import", str(source), "-o", str(out))
    assert result.exit_code == 2, result.output
    assert "CannotConvert" in result.output and "interaction 1 (POST" in result.output
    assert "NaN" in result.output and "Nothing was written" in result.output
    assert not out.exists()


def test_an_existing_output_needs_force(tmp_path: Path) -> None:
    source = tmp_path / "openai.yaml"
    openai_cassette(source)
    out = tmp_path / "run.jsonl"
    out.write_text("keep me\n")
    result = deja("import", str(source), "-o", str(out))
    assert result.exit_code == 2
    assert "already exists" in result.output and "--force" in result.output
    assert out.read_text() == "keep me\n"
    forced = deja("import", str(source), "-o", str(out), "--force")
    assert forced.exit_code == 0, forced.output
    assert recorder.load(out, require_signature=True).end is not None


def test_import_has_help() -> None:
    result = deja("import", "--help")
    assert result.exit_code == 0
    assert "vcrpy" in result.output and "--output" in result.output
    assert "import" in deja("--help").output
