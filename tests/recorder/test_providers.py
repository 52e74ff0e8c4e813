"""The provider seam: the Anthropic provider on bodies the SDK really exchanged, and a made-up
provider that recording, replay, diff, edit and the viewer use with no other change."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from conftest import API_KEY, MODEL

import recorder
import replayer
from recorder import providers
from recorder.cassette import load
from recorder.errors import ConfigError
from recorder.providers import Carriage, Format, Headers, Provider, Summary, token_counts
from recorder.providers.anthropic import MessagesFormat
from recorder.providers.pricing import PriceTable
from replayer import diff, edit
from viewer import content

USAGE = {"input_tokens": 120, "output_tokens": 9, "cache_creation_input_tokens": 50,
         "cache_read_input_tokens": 300}
# claude-sonnet-4 prices: $3 in, $15 out, cache writes 1.25x and reads 0.1x the input price
COST = round((120 * 3 + 9 * 15 + 50 * 3.75 + 300 * 0.3) / 1_000_000, 8)


def _model_lines(path: Path) -> list[Any]:
    return [o for o in load(path) if o["kind"] == "model"]


def _body(obs: dict[str, Any]) -> bytes:
    return obs["response"]["body"].encode("utf-8")


# ------------------------------------------------------------------------ the registry


def test_the_builtin_endpoints_are_model_calls() -> None:
    assert providers.model_provider("POST", "https://api.anthropic.com/v1/messages") == "anthropic"
    assert providers.model_provider("post", "http://h/v1/messages/?beta=1") == "anthropic"
    assert providers.model_provider("GET", "http://h/v1/messages") is None
    assert providers.model_provider("POST", "http://h/v1/models") is None
    for path in ("/v1/chat/completions", "/v1/responses"):
        assert providers.model_provider("POST", f"http://h{path}") == "openai"
    found = providers.for_url("POST", "http://h/v1/messages")
    assert found is not None and isinstance(found.format, MessagesFormat)
    assert providers.get("anthropic") is providers.default()
    assert providers.for_line({"kind": "http"}) is providers.default()
    assert providers.for_line({"provider": "not-registered"}) is providers.default()
    with pytest.raises(ConfigError, match="no provider named 'nope'"):
        providers.get("nope")


def test_registration_refuses_what_would_be_ambiguous() -> None:
    with pytest.raises(ConfigError, match="already registered"):
        providers.register(Provider("anthropic", MessagesFormat(), Carriage(("/v1/x",))))
    clash = Provider("clash", ToyFormat(), Carriage(("/v1/messages",)))
    with pytest.raises(ConfigError, match="already belongs to 'anthropic'"):
        providers.register(clash)
    with pytest.raises(ConfigError, match=r"takes a recorder\.providers\.Provider"):
        providers.register(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot be unregistered"):
        providers.unregister("anthropic")
    assert "clash" not in providers.names()


def test_the_openai_endpoints_are_read_by_their_own_provider() -> None:
    """A chat completion's JSON usage and finish reason are read by the OpenAI provider
    (recorder/providers/openai.py), and its streams are OpenAI's, not Anthropic's."""
    openai = providers.get("openai")
    body = {"id": "chatcmpl-1", "model": "gpt-x", "choices": [{"finish_reason": "stop",
            "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
    summary = openai.summarize(200, [("content-type", "application/json")],
                               json.dumps(body).encode())
    assert summary == {"message_id": "chatcmpl-1", "model": "gpt-x", "stop_reason": "stop",
                       "usage": {"input_tokens": 7, "output_tokens": 3}}
    error = openai.summarize(429, [], b'{"error": {"type": "rate_limit", "message": "slow"}}')
    assert error == {"error": {"type": "rate_limit", "message": "slow"}}
    assert openai.synthesize({"choices": []}) == b"data: [DONE]\n\n"
    assert openai.synthesize({"choices": []}) != providers.default().synthesize({"content": []})


# ------------------------------------------------------------- the Anthropic provider


def _record_anthropic(stub: Any, path: Path) -> dict[str, Any]:
    server = stub({"turns": [
        {"text": "Plain JSON answer.", "usage": USAGE},
        {"text": "Streamed answer.", "thinking": "let me see", "usage": USAGE,
         "tool_use": {"name": "search", "input": {"query": "deja", "n": 3}}}]})
    with recorder.record(path), anthropic.Anthropic(base_url=server.url, api_key=API_KEY,
                                                    max_retries=0) as client:
        first = client.messages.create(model=MODEL, max_tokens=64,
                                       messages=[{"role": "user", "content": "one"}])
        with client.messages.stream(model=MODEL, max_tokens=64,
                                    messages=[{"role": "user", "content": "two"}]) as stream:
            second = stream.get_final_message()
    server.stop()
    return {"json": first.model_dump(), "stream": second.model_dump()}


def test_anthropic_reads_recorded_json_and_sse_bodies(stub, tmp_path: Path) -> None:
    sdk = _record_anthropic(stub, tmp_path / "a.jsonl")
    plain, streamed = _model_lines(tmp_path / "a.jsonl")
    seam = providers.for_line(plain)
    assert seam is providers.get("anthropic") is providers.for_line(streamed)
    assert not seam.is_stream(plain["response"]["headers"])
    assert seam.is_stream(streamed["response"]["headers"])

    for obs, message in ((plain, sdk["json"]), (streamed, sdk["stream"])):
        summary = seam.summarize(200, obs["response"]["headers"], _body(obs))
        assert summary["usage"] == USAGE  # cache read and creation tokens included
        assert summary["message_id"] == message["id"] == obs["message_id"]
        assert summary["stop_reason"] == message["stop_reason"] == obs["stop_reason"]
        assert obs["usage"] == USAGE
        assert obs["cost_usd"] == COST == seam.cost(MODEL, summary["usage"], PriceTable())
        got = seam.message(obs["response"]["headers"], obs["response"]["body"])
        assert [b["type"] for b in got["content"]] == [b["type"] for b in message["content"]]
        assert [b.get("text") for b in got["content"]] == [b.get("text")
                                                           for b in message["content"]]
        assert seam.usage(got) == USAGE
        assert seam.stop_reason(got) == message["stop_reason"]

    assembled = seam.assemble(streamed["response"]["body"])
    assert [b["type"] for b in assembled["content"]] == ["thinking", "text", "tool_use"]
    assert assembled["content"][2]["input"] == {"query": "deja", "n": 3}
    assert assembled["stop_reason"] == "tool_use"
    assert seam.assemble(seam.synthesize(assembled)) == assembled
    message = json.loads(plain["response"]["body"])
    assert seam.assemble(seam.synthesize(message)) == message


def test_anthropic_summary_never_raises_and_counts_only_counts() -> None:
    seam = providers.get("anthropic")
    sse = [("Content-Type", "text/event-stream; charset=utf-8")]
    assert seam.summarize(200, [], b"\xff\xfe") == {}
    assert seam.summarize(200, [], b"not json") == {}
    assert seam.summarize(200, [], b"[1, 2]") == {}
    cut = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"m1",'
           b'"model":"claude-x","usage":{"input_tokens":5,"output_tokens":"7",'
           b'"cache_read_input_tokens":-1}}}\n\nevent: error\ndata: {"type":"error",'
           b'"error":{"type":"overloaded_error","message":"busy"}}\n\n')
    assert seam.summarize(200, sse, cut) == {
        "usage": {"input_tokens": 5}, "message_id": "m1", "model": "claude-x",
        "error": {"type": "overloaded_error", "message": "busy"}}
    assert token_counts({"input_tokens": True, "output_tokens": 2**63}) == {}


# ------------------------------------------------------------------ a made-up provider


class ToyFormat(Format):
    """A wire format unlike Anthropic's: one JSON object, or newline-delimited JSON events
    when asked to stream; its token counts are ``in``, ``out`` and ``cached``; a request's
    ``nonce`` is noise."""

    volatile_message_keys = ("id", "served_at")

    def semantic_request(self, body: Any) -> Any:
        return {k: v for k, v in body.items() if k != "nonce"} if isinstance(body, dict) else body

    def assemble(self, text: str) -> dict[str, Any]:
        message: dict[str, Any] = {"text": ""}
        for line in text.splitlines():
            event = json.loads(line)
            if event["type"] == "start":
                message.update(id=event["id"], model=event["model"], tokens=event["tokens"])
            elif event["type"] == "delta":
                message["text"] += event["text"]
            elif event["type"] == "end":
                message["finish"] = event["finish"]
                message["tokens"] = {**message.get("tokens", {}), **event["tokens"]}
        return message

    def synthesize(self, message: dict[str, Any]) -> str:
        tokens = dict(message.get("tokens") or {})
        events = [{"type": "start", "id": message.get("id"), "model": message.get("model"),
                   "tokens": {k: v for k, v in tokens.items() if k != "out"}},
                  {"type": "delta", "text": message.get("text", "")},
                  {"type": "end", "finish": message.get("finish"),
                   "tokens": {"out": tokens.get("out", 0)}}]
        return "".join(json.dumps(e) + "\n" for e in events)

    def usage(self, message: Any) -> dict[str, int]:
        tokens = message.get("tokens") or {}
        return token_counts({"input_tokens": tokens.get("in"), "output_tokens": tokens.get("out"),
                             "cache_read_input_tokens": tokens.get("cached")})

    def stop_reason(self, message: Any) -> Any:
        return message.get("finish")

    def summarize_json(self, status: int, doc: Any) -> Summary:
        if not isinstance(doc, dict):
            return {}
        if status >= 400:
            return {"error": {"type": doc.get("code"), "message": doc.get("detail")}}
        return {"message_id": doc.get("id"), "model": doc.get("model"),
                "stop_reason": self.stop_reason(doc), "usage": self.usage(doc)}

    def summarize_stream(self, text: str) -> Summary:
        try:
            return self.summarize_json(200, self.assemble(text))
        except ValueError:
            return {}


class ToyCarriage(Carriage):
    """``POST /toy/v1/generate``; a stream is ``application/x-ndjson``."""

    def __init__(self) -> None:
        super().__init__(("/toy/v1/generate",))

    def is_stream(self, headers: Headers) -> bool:
        return any(k.lower() == "content-type" and v.startswith("application/x-ndjson")
                   for k, v in headers)


def toy_provider() -> Provider:
    return Provider("toy", ToyFormat(), ToyCarriage())


class _ToyHandler(BaseHTTPRequestHandler):
    served = 0

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        _ToyHandler.served += 1
        ident = f"gen_{uuid.uuid4().hex[:8]}"
        words = f"You said {request['prompt']}."
        if request.get("stream"):
            events = [{"type": "start", "id": ident, "model": "toy-1",
                       "tokens": {"in": 11, "cached": 4}}]
            events += [{"type": "delta", "text": w} for w in (words[:4], words[4:])]
            events.append({"type": "end", "finish": "done", "tokens": {"out": 5}})
            data, ctype = "".join(json.dumps(e) + "\n" for e in events), "application/x-ndjson"
        else:
            data = json.dumps({"id": ident, "model": "toy-1", "text": words, "finish": "done",
                               "tokens": {"in": 11, "out": 5, "cached": 4},
                               "served_at": time.time()})
            ctype = "application/json"
        raw = data.encode("utf-8")
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        return None


@pytest.fixture
def toy() -> Iterator[str]:
    """The toy provider registered, and a server speaking its format; yields its URL."""
    providers.register(toy_provider())
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ToyHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/toy/v1/generate"
    finally:
        server.shutdown()
        server.server_close()
        providers.unregister("toy")


def toy_agent(url: str) -> list[str]:
    """Two calls, each with a fresh nonce: only the seam knows the nonce does not count."""
    out = []
    with httpx.Client() as http:
        for prompt, stream in (("hello", False), ("again", True)):
            response = http.post(url, json={"model": "toy-1", "prompt": prompt,
                                            "stream": stream, "nonce": uuid.uuid4().hex})
            out.append(response.text)
    return out


TOY_PRICES = {"toy-1": {"input": 2.0, "output": 8.0, "cache_read": 0.5}}
TOY_USAGE = {"input_tokens": 11, "output_tokens": 5, "cache_read_input_tokens": 4}


def test_a_registered_provider_is_recorded_and_replayed_through_the_seam(
        toy: str, tmp_path: Path) -> None:
    path = tmp_path / "toy.jsonl"
    with recorder.record(path, prices=TOY_PRICES) as run:
        recorded = toy_agent(toy)
    assert run.totals["model_calls"] == 2 and run.totals["http_calls"] == 0
    assert run.totals["input_tokens"] == 22 and run.totals["output_tokens"] == 10

    lines = _model_lines(path)
    assert [o["provider"] for o in lines] == ["toy", "toy"]
    assert [o["stream"] for o in lines] == [False, True]
    assert [o["stop_reason"] for o in lines] == ["done", "done"]
    assert all(o["usage"] == TOY_USAGE for o in lines)
    assert all(o["cost_usd"] == round((11 * 2 + 5 * 8 + 4 * 0.5) / 1e6, 8) for o in lines)
    assert "ttft_ms" in lines[1] and "ttft_ms" not in lines[0]  # the toy's own stream rule
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    # not a built-in provider: named on every line, so a reader without it registered
    # does not take its lines for Anthropic's
    assert all(line["provider"] == "toy" for line in raw if line.get("kind") == "model")

    served = _ToyHandler.served
    with replayer.replay(path) as replay:  # new nonces; the server is never asked
        replayed = toy_agent(toy)
    result = replay.result
    assert result is not None
    assert result.identical, result.report()
    assert replayed == recorded and _ToyHandler.served == served

    again = tmp_path / "again.jsonl"
    with recorder.record(again, prices=TOY_PRICES):  # new ids and served_at in every body
        toy_agent(toy)
    assert diff.compare(load(path), load(again)).same

    streamed = lines[1]
    document = edit.view(streamed)
    assert document["text"] == "You said again." and document["tokens"]["cached"] == 4
    edited = edit.rebuild(streamed, {**document, "text": "Edited.",
                                     "tokens": {"in": 11, "out": 1, "cached": 4}},
                          PriceTable(TOY_PRICES))
    assert edited["response"]["body"].endswith('"finish": "done", "tokens": {"out": 1}}\n')
    assert edited["usage"] == {**TOY_USAGE, "output_tokens": 1}
    assert edited["cost_usd"] == round((11 * 2 + 1 * 8 + 4 * 0.5) / 1e6, 8)

    shown = content.response_message(streamed)
    assert shown is not None and shown["text"] == "You said again."
    assert content.is_streamed(streamed) and not content.is_streamed(lines[0])
    assert content.conversation({}, streamed, content.Clip())["response"]["stop_reason"] == "done"


def test_without_its_provider_the_endpoint_is_plain_http(tmp_path: Path) -> None:
    providers.register(toy_provider())
    providers.unregister("toy")
    assert providers.for_url("POST", "http://h/toy/v1/generate") is None
    assert providers.volatile_header("X-Stainless-Arch") and providers.volatile_header("Host")
    assert not providers.volatile_header("anthropic-version")


def _random_stream(rng: Any) -> str:
    """An Anthropic event stream with the events a summary reads and others that spell
    their names: in text, escaped, without an ``event:`` line, under another name."""
    words = ["ok", "error", "message_delta", '\\"error\\"', "\\u00e9", "message_", "é"]
    pool = [
        lambda: ("message_start", {"type": "message_start", "message": {
            "id": f"msg_{rng.randrange(99)}", "model": MODEL,
            "usage": {"input_tokens": rng.randrange(1000), "output_tokens": 1}}}),
        lambda: ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "text_delta", "text": " ".join(rng.choices(words, k=4))}}),
        lambda: ("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": rng.choice(["end_turn", "tool_use", None])},
            "usage": {"output_tokens": rng.randrange(500)}}),
        lambda: ("error", {"type": "error", "error": {"type": "overloaded_error",
                                                      "message": rng.choice(words)}}),
        lambda: (None, {"type": "message_delta", "usage": {"output_tokens": 7}}),
        lambda: ("ping", {"type": "ping", "note": rng.choice(words)}),
        lambda: ("message_delta", {"type": "content_block_stop", "index": 0}),
    ]
    blocks = []
    for _ in range(rng.randrange(1, 12)):
        event, data = rng.choice(pool)()
        text = json.dumps(data)
        if rng.random() < 0.2:  # spelled with an escape
            text = text.replace('"message_delta"', '"\\u006dessage_delta"')
        head = f"event: {event}\n" if event else ""
        blocks.append(head + f"data: {text}")
    if rng.random() < 0.2:
        blocks.append(": a comment")
    out = "\n\n".join(blocks) + "\n\n"
    return out.replace("\n", "\r\n") if rng.random() < 0.2 else out


def test_a_stream_summary_reads_every_event_that_may_hold_its_fields() -> None:
    """A summary skips a block without the words its events are named by: every block
    made to hold one (an SSE comment line, which no reader reads) gives the same summary."""
    import random

    rng = random.Random(7)
    fmt = MessagesFormat()
    for _ in range(3_000):
        text = _random_stream(rng)
        sep = "\r\n" if "\r\n" in text else "\n"
        every = (sep * 2).join(b + f"{sep}: message_" for b in text.split(sep * 2))
        assert fmt.summarize_stream(text) == fmt.summarize_stream(every), text


def _framed_reference(text: str) -> list[tuple[str, str]]:
    """The SSE framing read line by line: a blank line ends an event, ``event:`` names
    it, each ``data:`` line adds a line of its data."""
    out, event, data = [], "message", []
    for line in [*text.replace("\r\n", "\n").split("\n"), ""]:
        if line == "":
            if data:
                out.append((event, "\n".join(data)))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    return out


def test_an_event_streams_framing_is_read_line_by_line() -> None:
    import random

    from recorder.providers.base import sse_events

    rng = random.Random(11)
    kinds = ["event: message_delta", "event:ping", "event:  x  ", "data: {\"a\": 1}", "data:{}",
             "data:  two spaces", "data:", ": a comment", "id: 7", "retry: 10", "data: é"]
    for _ in range(3_000):
        blocks = ["\n".join(rng.choices(kinds, k=rng.randrange(0, 4)))
                  for _ in range(rng.randrange(1, 6))]
        text = "\n\n".join(blocks) + rng.choice(["", "\n\n"])
        if rng.random() < 0.3:
            text = text.replace("\n", "\r\n")
        assert list(sse_events(text)) == _framed_reference(text), text
