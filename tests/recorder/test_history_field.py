"""A conversation's history, in whichever field its provider names, is read, hashed and
stored by what each request adds: the Messages API's ``messages``, the Responses API's
``input`` items and Gemini's ``contents`` alike.

The request reader parses only what a body adds to a recent one, and gives exactly what a
full parse gives; a fingerprint hashes each item of the history once per conversation (a
request costs its settings and the items it adds, however long the conversation), and is
the same whether computed from the bytes as received, from a cassette's shared objects or
from scratch; a body without such a list is hashed whole, as it always was. A Gemini run
recorded through the google-genai SDK is stored as deltas, loads with the fingerprints a
replay computes, and replays; the golden cassettes' fingerprints (Gemini's too) are those
a replay computes from the requests they hold.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_provider_gemini import agent as gemini_loop

import recorder
import replayer
from recorder import providers
from recorder.canonical import Parts, digest
from recorder.capture.exchange import (
    RequestReader,
    classify_texts,
    json_body,
    request_fingerprint,
)
from recorder.capture.redact import Redaction
from recorder.cassette import load
from recorder.cassette._delta import DeltaEncoder, decode
from recorder.cassette.keys import Keyring
from recorder.testing.server import StubServer

GOLDEN = Path(__file__).parents[1] / "golden"
GOLDEN_KEY = "golden-key-deja-v1"
CLOSED_PORT_URL = "http://127.0.0.1:9"  # nothing listens there: a replay must not need it
Stub = Callable[[dict], StubServer]


# One conversation per provider: its URL, the field its history is in, an item of turn i,
# and the request's other fields.
def _responses_item(i: int) -> dict[str, Any]:
    return [{"role": "user", "content": [{"type": "input_text", "text": f"Turn {i}."}]},
            {"type": "function_call", "call_id": f"call_{i}", "name": "lookup",
             "arguments": json.dumps({"n": i})},
            {"type": "function_call_output", "call_id": f"call_{i}", "output": f"{i * 7}"}
            ][i % 3]


def _gemini_item(i: int) -> dict[str, Any]:
    return [{"role": "user", "parts": [{"text": f"Turn {i}."}]},
            {"role": "model", "parts": [{"functionCall": {"name": "lookup", "args": {"n": i}}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "lookup",
                                                             "response": {"n": i * 7}}}]}
            ][i % 3]


def _messages_item(i: int) -> dict[str, Any]:
    return {"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}."}


CASES = {
    "responses": ("http://127.0.0.1:1/v1/responses", "input", _responses_item,
                  {"model": "gpt-4.1", "instructions": "Be brief.",
                   "tools": [{"type": "function", "name": "lookup"}]}),
    "gemini": ("http://127.0.0.1:1/v1beta/models/gemini-2.5-flash:generateContent",
               "contents", _gemini_item,
               {"systemInstruction": {"parts": [{"text": "Be brief."}]},
                "tools": [{"functionDeclarations": [{"name": "lookup"}]}],
                "generationConfig": {"maxOutputTokens": 64}}),
    "messages": ("http://127.0.0.1:1/v1/messages", "messages", _messages_item,
                 {"model": "claude-sonnet-4-6", "max_tokens": 64, "system": "Be brief."}),
}
NEW_HISTORIES = pytest.mark.parametrize("case", ["responses", "gemini"])
ALL = pytest.mark.parametrize("case", list(CASES))


def body_of(case: str, items: list[Any], **changes: Any) -> dict[str, Any]:
    """The request of ``case`` with history ``items``, the settings around it (some
    before the history and some after, as an SDK lays them out)."""
    _, field, _, settings = CASES[case]
    head = dict(list(settings.items())[:1])
    return {**head, field: items, **{k: v for k, v in settings.items() if k not in head},
            **changes}


def items_of(case: str, n: int) -> list[Any]:
    return [CASES[case][2](i) for i in range(n)]


def wire(body: Any) -> bytes:
    """The bytes an SDK sends (compact JSON)."""
    return json.dumps(body, separators=(",", ":")).encode()


def same_json(a: Any, b: Any) -> bool:
    """The same value, key order and types included."""
    return json.dumps(a) == json.dumps(b)


class CountingParts(Parts):
    """Parts that count the parts they are asked to digest: what a request costs."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def of(self, value: Any, text: str | None = None) -> str:
        self.asked += 1
        return super().of(value, text)


# ---------------------------------------------------------------------------- the reader


def reader_bodies(case: str) -> Iterator[tuple[str, bytes]]:
    """Bodies one reader reads in turn, as a recording does: a conversation growing, and
    the texts a full parse must be taken for."""
    _, field, _, settings = CASES[case]
    three, five = items_of(case, 3), items_of(case, 5)
    yield "first turn", wire(body_of(case, items_of(case, 1)))
    yield "grown", wire(body_of(case, three))
    yield "grown again", wire(body_of(case, five))
    edited = json.loads(json.dumps(five))
    edited[1]["edited"] = True
    yield "edited in the middle", wire(body_of(case, edited))
    weighed = [*five[:-1], {**five[-1], "weight": 1}]
    yield "weight 1", wire(body_of(case, weighed))
    yield "weight 1.0", wire(body_of(case, weighed)).replace(b'"weight":1}', b'"weight":1.0}')
    yield "grown again, once more", wire(body_of(case, five))
    yield "a setting changed", wire(body_of(case, five, extra=1.0))
    yield "history twice", wire(body_of(case, five))[:-1] + f',"{field}":[]}}'.encode()
    yield "a setting twice", wire(body_of(case, five))[:-1] + b',"extra":2}'
    yield "history first", wire({field: three, **settings})
    yield "history last", wire({**settings, field: three})
    yield "spaced", json.dumps(body_of(case, three), indent=2).encode() + b"\n"
    yield "spaced, grown", json.dumps(body_of(case, five), indent=2).encode()
    yield "empty history", wire(body_of(case, []))
    yield "history not a list", wire(body_of(case, {"role": "user"}))  # type: ignore[arg-type]
    yield "no history", wire(settings)
    yield "nested too deeply", wire(body_of(case, [])).replace(b"[]", b"[" * 5000 + b"]" * 5000)


@ALL
def test_the_reader_parses_what_a_full_parse_does_for_each_providers_history(
        case: str) -> None:
    url, field, _, _ = CASES[case]
    seam = providers.for_url("POST", url)
    assert seam is not None and seam.history_field(body_of(case, [])) == field
    reader = RequestReader()
    read: dict[str, Any] = {}
    for name, data in reader_bodies(case):
        body, problem, texts = reader.read(data, seam.history_field)
        want, why = json_body(data)
        assert problem == why, name
        if why is not None:  # no JSON a cassette holds: refused alike
            assert body is want and texts is None, name
            continue
        assert same_json(body, want), name
        read[name] = body
        if texts is not None:  # the exact text of each part, as the body holds it
            settings = {k: v for k, v in body.items() if k != field}
            assert json.dumps({k: json.loads(t) for k, t in texts[0].items()},
                              sort_keys=True) == json.dumps(settings, sort_keys=True), name
            assert same_json([json.loads(t) for t in texts[1]], body[field]), name
    # the incremental path was taken: a grown body's history is the earlier body's objects
    assert read["grown"][field][0] is read["first turn"][field][0]
    assert read["grown again"][field][2] is read["grown"][field][2]
    assert read["spaced, grown"][field][2] is read["spaced"][field][2]
    for name, data in reader_bodies(case):
        texts = RequestReader().read(data, seam.history_field)[2]
        assert (texts is not None) == (name not in ("history twice", "history not a list",
                                                    "no history", "nested too deeply")), name


def test_the_reader_takes_the_history_its_provider_names() -> None:
    """A body with two lists: the provider's rule says which is the conversation (OpenAI's
    ``messages`` before ``input``); without a rule, the registered providers'."""
    data = wire({"input": [{"role": "user", "content": "a"}], "messages": [{"n": 1}]})
    for rule, field in ((providers.get("openai").history_field, "messages"),
                        (lambda body: "input", "input"), (None, "messages")):
        body, _, texts = RequestReader().read(data, rule)
        assert texts is not None and set(texts[0]) == {"input", "messages"} - {field}
        assert [json.loads(t) for t in texts[1]] == body[field]
    assert RequestReader().read(data, lambda body: None)[2] is None


# ---------------------------------------------------------------------------- fingerprints


def conversation(case: str, turns: int) -> Iterator[tuple[int, bytes]]:
    """The requests of a conversation that adds two items a turn, as sent."""
    for turn in range(1, turns + 1):
        yield turn, wire(body_of(case, items_of(case, 2 * turn)))


@ALL
def test_each_request_hashes_only_its_settings_and_the_items_it_adds(case: str) -> None:
    """However long the conversation, a replayed request costs the same: its settings'
    digests (known by their text) and one per item it adds."""
    url = CASES[case][0]
    reader, parts, redaction = RequestReader(), CountingParts(), Redaction()
    for turn, data in conversation(case, 60):
        kind, provider, body, texts, _ = classify_texts("POST", url, data, redaction, reader)
        assert texts is not None
        parts.asked = 0
        fp = request_fingerprint(kind, provider, "POST", url, body, parts, texts)
        settings = len(body) - 1
        assert parts.asked == settings + 2, turn
        assert fp == providers.get(provider).fingerprint("POST", url, json.loads(data)), turn


@ALL
def test_a_cassettes_requests_hash_only_what_each_adds(case: str) -> None:
    """A reader rebuilds each request from its delta, sharing the history of its base
    object for object: its fingerprint hashes the items the delta adds."""
    url, field, _, _ = CASES[case]
    seam = providers.for_url("POST", url)
    assert seam is not None
    encoder, bodies, parts = DeltaEncoder(), {}, CountingParts()
    for turn, data in conversation(case, 40):
        sent = json.loads(data)
        stored = json.loads(json.dumps(encoder.encode(turn, sent)))  # as on disk
        encoder.written(turn, sent)
        assert set(stored) == ({"body"} if turn == 1 else {"base", "keep", field})
        parts.asked = 0
        bodies[turn] = body = decode(stored, bodies, {}, parts)
        assert body == sent  # (a rebuilt request's history comes after its settings)
        fp = seam.fingerprint("POST", url, body, parts)
        assert parts.asked == (len(body) - 1) + 2, turn  # the settings, the two it adds
        assert fp == seam.fingerprint("POST", url, sent)


@NEW_HISTORIES
def test_a_fingerprint_is_the_same_however_it_is_computed(case: str) -> None:
    """From the bytes as received (incrementally), from objects, from scratch: the same;
    and a change anywhere, even 1 for 1.0, is another fingerprint."""
    url = CASES[case][0]
    seam = providers.for_url("POST", url)
    assert seam is not None
    reader, parts, by_objects = RequestReader(), Parts(), Parts()
    fps: dict[str, str] = {}
    for name, data in reader_bodies(case):
        body, _, texts = reader.read(data, seam.history_field)
        if not isinstance(body, dict):
            continue
        fps[name] = seam.fingerprint("POST", url, body, parts, texts)
        assert fps[name] == seam.fingerprint("POST", url, json.loads(data)), name
        assert fps[name] == seam.fingerprint("POST", url, body, by_objects), name
    named = ["grown again", "edited in the middle", "weight 1", "weight 1.0",
             "a setting changed", "history twice", "grown"]
    assert len({fps[n] for n in named}) == len(named)
    assert fps["grown again, once more"] == fps["grown again"]
    assert fps["spaced"] == fps["history first"] == fps["history last"] == fps["grown"]


def test_the_history_field_is_part_of_the_fingerprint() -> None:
    """The same items under another field of the same endpoint are another request."""
    openai = providers.get("openai")
    url = CASES["responses"][0]
    items = items_of("messages", 2)
    fps = {openai.fingerprint("POST", url, {"model": "m", field: items})
           for field in ("input", "messages")}
    assert len(fps) == 2


@pytest.mark.parametrize("case, body", [
    ("responses", {"model": "gpt-4.1", "input": "One string, no list."}),
    ("gemini", {"generationConfig": {"maxOutputTokens": 8}}),
    ("messages", {"model": "claude-sonnet-4-6", "messages": "not a list"}),
])
def test_a_body_without_a_history_list_is_hashed_whole(case: str, body: Any) -> None:
    url = CASES[case][0]
    seam = providers.for_url("POST", url)
    assert seam is not None
    path = "/" + url.split("/", 3)[3]
    whole = digest(["model", "POST", path, body])
    assert seam.fingerprint("POST", url, body) == whole
    assert seam.fingerprint("POST", url, body, Parts(), ({}, [])) == whole


# ---------------------------------------------------------------------------- cassettes


def test_a_gemini_run_is_stored_as_deltas_with_the_fingerprints_a_replay_computes(
        stub: Stub, tmp_path: Path) -> None:
    server = stub({"select": "conversation",
                   "rules": [{"when": {"position": 6}, "text": "Sunny all week."}],
                   "default": {"tool_use": {"name": "get_weather",
                                            "input": {"city": "Paris"}}}})
    path = tmp_path / "gemini.jsonl"
    with recorder.record(path):
        recorded = gemini_loop(server.url)
    server.stop()
    received = [r["body"] for r in server.requests]
    assert len(received) > 5 and len(recorded) == len(received)

    on_disk = [line["request"] for line in map(json.loads, path.read_bytes().splitlines()[1:])
               if line.get("kind") == "model"]
    assert set(on_disk[0]) == {"body"}
    assert all(set(stored) - {"reply", "shape"} == {"base", "keep", "contents"}
               for stored in on_disk[1:])
    cassette = load(path)
    seam = providers.get("gemini")
    reader, parts = RequestReader(), Parts()
    for line, body in zip([o for o in cassette if o["kind"] == "model"], received,
                          strict=True):
        assert cassette.request_of(line["seq"]) == body
        # the fingerprint the reader derives is the one a replay computes from the bytes
        live = reader.read(wire(body), seam.history_field)
        assert line["fp"] == seam.fingerprint("POST", line["url"], live[0], parts, live[2])

    with replayer.replay(path) as run:
        replayed = gemini_loop(CLOSED_PORT_URL)
    assert run.result is not None and run.result.identical, run.result.report()
    assert replayed == recorded


@pytest.mark.parametrize("name", ["v1_tool_agent.jsonl", "v2_tool_agent.jsonl",
                                  "v2_responses_agent.jsonl", "v2_gemini_agent.jsonl"])
def test_a_golden_cassettes_fingerprints_are_those_a_replay_computes(name: str) -> None:
    """A model line's fingerprint is never stored: the reader derives it from the request,
    as a replay does from the request it receives, and the two agree."""
    path = GOLDEN / name
    assert all('"fp"' not in line for line in path.read_text().splitlines()
               if '"kind":"model"' in line)
    cassette = load(path, keyring=Keyring.of(GOLDEN_KEY), require_signature=True,
                    allow_incomplete=False)
    assert cassette.verified
    reader, parts, redaction = RequestReader(), Parts(), Redaction()
    models = [o for o in cassette if o["kind"] == "model"]
    assert models
    for line in models:
        request = cassette.request_of(line["seq"])
        kind, provider, body, texts, _ = classify_texts("POST", line["url"], wire(request),
                                                     redaction, reader)
        assert provider == line["provider"]
        assert line["fp"] == request_fingerprint(kind, provider, "POST", line["url"], body,
                                                 parts, texts)
