"""The cassette format ``deja/2`` and the compaction that came with it, end to end.

``deja/2`` signs each line's exact bytes, and a model line refers back rather than repeat
itself: a request names the earlier line whose response message it resends (``"reply"``),
and a line whose URL, request headers and response headers are those of one earlier line
says so once (``"like"``). That is only worth having if what comes back out is exactly
what went in, so these tests hold the round trip against what the real SDK sent to the stub
server, also through the paths that rebuild a line from somewhere else: a fork's copied
prefix (its response bodies are text, so the reader works the reply out on demand) and a
resumed ``deja/1`` cassette (which must go on in ``deja/1``, with neither field). Then: the
bytes a signature covers are the bytes on disk (one byte changed, a line re-spaced, a
``key_id`` edited and moved are all refused); line endings a checkout converts to CR LF
still read; values a cassette cannot hold are refused before anything is written; and the
incremental request reader gives exactly what a full parse gives, so that a fingerprint
never depends on which path read its request.

That the golden ``deja/1`` cassette loads, verifies and replays is asserted in
``test_cassette.py`` (``test_golden_v1_cassette_loads_and_verifies`` and
``test_golden_v1_cassette_replays_identically_offline``).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, cast

import anthropic
import pytest
from conftest import MODEL, golden_agent

import recorder
import replayer
from recorder.canonical import Parts, canonical, model_fingerprint
from recorder.capture.exchange import RequestReader, json_body
from recorder.cassette import CassetteWriter, load
from recorder.cassette.keys import Keyring
from recorder.errors import SignatureError, UnserializableValue
from recorder.testing.server import StubServer

KEY = b"test-key-0123456789abcdef"  # the DEJA_KEY that conftest sets for every test
GOLDEN = Path(__file__).parents[1] / "golden"
GOLDEN_KEY = "golden-key-deja-v1"
CLOSED_PORT_URL = "http://127.0.0.1:9"  # nothing listens there: a replay must not need it

# ---------------------------------------------------------------------------- the agent

TOOLS: list[Any] = [{
    "name": "lookup",
    "description": "How often a word occurs.",
    "input_schema": {"type": "object", "properties": {"q": {"type": "string"},
                                                      "n": {"type": "integer"}},
                     "required": ["q"]},
}]
FINAL = "Found alpha, beta and gamma."
# Answered by the number of assistant messages in the request: four model turns, three tools.
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Looking up alpha.",
     "tool_use": {"id": "toolu_v2_01", "name": "lookup", "input": {"q": "alpha"}}},
    {"text": "Now beta.",
     "tool_use": {"id": "toolu_v2_02", "name": "lookup", "input": {"q": "beta"}}},
    {"text": "And gamma.",
     "tool_use": {"id": "toolu_v2_03", "name": "lookup", "input": {"q": "gamma", "n": 1}}},
    {"text": FINAL},
]}


@recorder.tool
def lookup(q: str, n: int = 0) -> dict[str, Any]:
    return {"q": q, "hits": len(q) + n}


def _block(block: Any) -> dict[str, Any]:
    """An assistant content block as the conversation resends it (as the API sent it)."""
    if block.type == "tool_use":
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    return {"type": "text", "text": block.text}


def tool_agent(base_url: str) -> str:
    """Ask, run the tools the model asks for, resend the whole history; the final text."""
    client = anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count alpha, beta, gamma."}]
    try:
        while True:
            reply = client.messages.create(model=MODEL, max_tokens=256, tools=TOOLS,
                                           messages=cast(Any, messages))
            messages.append({"role": "assistant", "content": [_block(b) for b in reply.content]})
            uses = [block for block in reply.content if block.type == "tool_use"]
            if not uses:
                return "".join(block.text for block in reply.content if block.type == "text")
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id,
                 "content": json.dumps(lookup(**cast(dict[str, Any], use.input)))}
                for use in uses]})
    finally:
        client.close()


# ---------------------------------------------------------------------------- helpers


def record_tool_agent(path: Path, server: StubServer) -> Path:
    with recorder.record(path):
        assert tool_agent(server.url) == FINAL
    return path


def parsed(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def ring(*keys: bytes | str) -> Keyring:
    return Keyring.of(*keys)


def sent_bodies(server: StubServer) -> list[Any]:
    return [r["body"] for r in server.received()]


def assert_same_request(got: Any, want: Any, where: str) -> None:
    """Equal as values, and with the same types (``1``, ``1.0`` and ``true`` apart)."""
    assert got == want, where
    assert canonical(got) == canonical(want), where


def replay_tool_agent(path: Path) -> replayer.ReplayResult:
    with replayer.replay(path, require_signature=True) as run:
        assert tool_agent(CLOSED_PORT_URL) == FINAL
    assert run.result is not None
    return run.result



# ---------------------------------------------------------------------------- reply and like


def test_a_tool_conversation_is_stored_with_reply_and_like_and_comes_back_exactly(
        tmp_path: Path, stub: Any) -> None:
    server = stub(SCRIPT)
    path = record_tool_agent(tmp_path / "run.jsonl", server)

    lines = parsed(path)
    assert lines[0]["format"] == "deja/2"
    models = [line for line in lines[1:] if line["kind"] == "model"]
    assert [m["seq"] for m in models] == [0, 2, 4, 6]
    assert "body" in models[0]["request"] and "like" not in models[0]
    for before, line in itertools.pairwise(models):
        stored = line["request"]
        assert stored["base"] == before["seq"]
        assert stored["reply"] == before["seq"]  # the assistant message is not stored again
        assert [m["role"] for m in stored["messages"]] == ["user"]  # only the tool result
        assert line["like"] == before["seq"]
        assert "url" not in line and "request_headers" not in line
        assert "headers_base" not in line["response"]

    cassette = load(path, keyring=ring(KEY), require_signature=True, allow_incomplete=False)
    assert cassette.verified
    sent = sent_bodies(server)
    assert len(sent) == 4
    for line, body in zip(models, sent, strict=True):
        assert_same_request(cassette.request_of(line["seq"]), body, f"seq {line['seq']}")
    steps = cast(list[dict[str, Any]], list(cassette.observations))
    first = steps[0]
    for line in models[1:]:  # the references restored to what they stand for
        obs = steps[line["seq"]]
        assert obs["url"] == first["url"] == f"{server.url}/v1/messages"
        assert obs["request_headers"] == first["request_headers"]
        assert isinstance(obs["request_headers"], list)
        assert all(isinstance(pair, list) for pair in obs["response"]["headers"])
        assert "like" not in obs

    result = replay_tool_agent(path)
    assert result.identical and result.verified
    assert result.steps_served == result.steps_recorded == 7


def test_a_fork_after_a_reply_rebuilds_the_parents_requests(tmp_path: Path, stub: Any) -> None:
    parent_path = record_tool_agent(tmp_path / "parent.jsonl", stub(SCRIPT))
    assert parsed(parent_path)[3]["request"]["reply"] == 0  # seq 2 resends seq 0's reply
    parent = load(parent_path, keyring=ring(KEY), require_signature=True)

    live = stub(SCRIPT)
    out = tmp_path / "fork.jsonl"
    edited = {"q": "beta", "hits": 0}
    with replayer.fork(parent_path, at=3, out=out, replace={"result": edited}):
        assert tool_agent(live.url) == FINAL

    copied = parsed(out)[1:4]  # seq 0-2, copied as the parent's reader restored them
    assert [line["seq"] for line in copied] == [0, 1, 2]
    assert copied[2]["request"]["reply"] == 0
    for line in (copied[0], copied[2]):  # bodies as text: no body_json to take a reply from
        assert "body" in line["response"] and "body_json" not in line["response"]

    fork = load(out, keyring=ring(KEY), require_signature=True, allow_incomplete=False)
    assert fork.verified
    for seq in (0, 2):
        assert_same_request(fork.request_of(seq), parent.request_of(seq), f"seq {seq}")
    tool = cast(dict[str, Any], fork.observations[3])
    assert tool["result"] == edited and tool["edited"] is True
    after = [o["seq"] for o in fork if o["kind"] == "model" and o["seq"] > 3]
    sent = sent_bodies(live)
    assert len(after) == len(sent) == 2
    for seq, body in zip(after, sent, strict=True):
        assert_same_request(fork.request_of(seq), body, f"seq {seq}")
    assert json.loads(sent[0]["messages"][-1]["content"][0]["content"]) == edited

    result = replay_tool_agent(out)
    assert result.identical and result.verified


# ---------------------------------------------------------------------------- deja/1 goes on


RESUME_SCRIPT = {"select": "conversation", "turns": [
    {"text": "never asked: the golden cassette answers the first turn"},
    {"text": "Checking once more.",
     "tool_use": {"id": "toolu_golden_02", "name": "get_weather", "input": {"city": "Paris"}}},
    {"text": "It is 18 degrees and clear in Paris."},
]}


@pytest.mark.parametrize("keep", [3, 5], ids=["after-the-first-model-turn", "before-the-end"])
def test_resuming_a_v1_cassette_goes_on_in_v1_without_reply_or_like(
        tmp_path: Path, stub: Any, monkeypatch: pytest.MonkeyPatch, keep: int) -> None:
    monkeypatch.setenv("DEJA_KEY", GOLDEN_KEY)
    golden = (GOLDEN / "v1_tool_agent.jsonl").read_bytes().splitlines(keepends=True)
    assert len(golden) == 6 and json.loads(golden[-1])["kind"] == "end"
    path = tmp_path / "resumed.jsonl"
    path.write_bytes(b"".join(golden[:keep]))  # the header and seq 0..keep-2
    server = stub(RESUME_SCRIPT)
    agent = golden_agent()
    with replayer.resume(path):
        answer = agent.agent(server.url)
    assert answer == "It is 18 degrees and clear in Paris."

    written = path.read_bytes().splitlines(keepends=True)
    assert written[:keep] == golden[:keep]  # the header (deja/1) and kept lines untouched
    new = [json.loads(line) for line in written[keep:]]
    assert new[-1]["kind"] == "end" and new[-1]["status"] == "completed"
    for line in new:
        assert "like" not in line, line["seq"]
        assert "reply" not in (line.get("request") or {}), line["seq"]

    cassette = load(path, keyring=ring(GOLDEN_KEY), require_signature=True,
                    allow_incomplete=False)
    assert cassette.verified and cassette.header["format"] == "deja/1"
    live = [line for line in new if line["kind"] == "model"]
    sent = sent_bodies(server)
    assert len(live) == len(sent) == (2 if keep == 3 else 0)
    for line, body in zip(live, sent, strict=True):
        assert_same_request(cassette.request_of(line["seq"]), body, f"seq {line['seq']}")
    if live:
        first, second = live
        # deja/2 would store "reply": 1 here; deja/1 stores the assistant message itself
        assert first["request"]["base"] == 1
        assert [m["role"] for m in first["request"]["messages"]] == ["assistant", "user"]
        # and "like" here: deja/1 has the three references it stands for
        assert second["url"] == second["request_headers"] == first["seq"]
        assert second["response"]["headers_base"] == first["seq"]

    with replayer.replay(path, require_signature=True) as run:
        assert agent.agent(CLOSED_PORT_URL) == answer
    assert run.result is not None and run.result.identical and run.result.verified


# ---------------------------------------------------------------------------- exact bytes


def _edit_line(path: Path, seq: int, old: bytes, new: bytes) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    line = lines[seq + 1]
    assert json.loads(line)["seq"] == seq and old in line
    lines[seq + 1] = line.replace(old, new, 1)
    path.write_bytes(b"".join(lines))


@pytest.mark.parametrize(("seq", "old", "new"), [
    (1, b'"hits":5', b'"hits":6'),  # a tool result
    (2, b'"Now beta."', b'"Now bets."'),  # a model response held as JSON
    (2, b'"reply":0', b'"reply":1'),  # a compact reference
], ids=["tool-result", "model-body", "reference"])
def test_one_byte_changed_in_a_signed_value_is_refused_at_its_seq(
        tmp_path: Path, stub: Any, seq: int, old: bytes, new: bytes) -> None:
    path = record_tool_agent(tmp_path / "run.jsonl", stub(SCRIPT))
    before = path.read_bytes()
    _edit_line(path, seq, old, new)
    after = path.read_bytes()
    assert len(after) == len(before) and after != before
    assert [json.loads(line) for line in after.splitlines()]  # still valid JSON
    with pytest.raises(SignatureError) as info:
        load(path, keyring=ring(KEY))
    assert info.value.seq == seq
    assert f"seq {seq} (line {seq + 2})" in str(info.value)


@pytest.mark.parametrize(("old", "new"), [
    (b',"kind":', b', "kind":'),
    (b',"sig":"', b', "sig":"'),
    (b'"seq":2,', b'"seq": 2,'),
], ids=["between-fields", "before-the-sig", "after-a-colon"])
def test_a_re_spaced_line_is_refused_at_its_seq(tmp_path: Path, stub: Any, old: bytes,
                                                new: bytes) -> None:
    path = record_tool_agent(tmp_path / "run.jsonl", stub(SCRIPT))
    value = parsed(path)[3]
    _edit_line(path, 2, old, new)
    assert parsed(path)[3] == value  # the same JSON value, spaced otherwise
    with pytest.raises(SignatureError) as info:
        load(path, keyring=ring(KEY))
    assert info.value.seq == 2
    assert "seq 2 (line 4)" in str(info.value)


def _re_spaced(raw: bytes, how: str) -> bytes:
    """``raw`` with ``", "`` between its fields: all of them (``json.dumps``' own spacing,
    the sig field's included), or all but the sig field, which stays as the writer wrote it."""
    if how == "all":
        return json.dumps(json.loads(raw)).encode()
    body, tail = raw[:-53], raw[-53:]  # ',"sig":"' + 43 characters + '"}'
    assert tail.startswith(b',"sig":"') and tail.endswith(b'"}')
    return body.replace(b',"', b', "') + tail


@pytest.mark.parametrize("how", ["all", "sig-as-written"])
@pytest.mark.parametrize("header_sig", ["kept", "forged"])
def test_a_moved_and_edited_key_id_is_refused_even_with_every_line_re_spaced(
        tmp_path: Path, stub: Any, header_sig: str, how: str) -> None:
    """The header's ``key_id`` edited to one nobody has (so that a naive reader skips
    verification), and moved: the header, restored, or the lines after it, still chain to
    this machine's key, and the file is called what it is, tampered. With the header's sig
    forged too, only the lines can tell; re-spacing them does not change what they say."""
    path = record_tool_agent(tmp_path / "run.jsonl", stub(SCRIPT))
    header_raw, *lines = path.read_bytes().splitlines()
    header = json.loads(header_raw)
    assert list(header)[-2:] == ["key_id", "sig"]
    forged = {"key_id": "k_000000000000", **{k: v for k, v in header.items() if k != "key_id"}}
    if header_sig == "forged":
        forged["sig"] = "A" * 43
    spaced = [_re_spaced(raw, how) for raw in lines]
    assert [json.loads(raw) for raw in spaced] == [json.loads(raw) for raw in lines]
    path.write_bytes(b"".join(raw + b"\n" for raw in [json.dumps(forged).encode(), *spaced]))
    with pytest.raises(SignatureError, match="key_id was edited") as info:
        load(path, keyring=ring(KEY), allow_unverified=True)
    assert info.value.seq is None
    assert "names key 'k_000000000000'" in str(info.value)


# ---------------------------------------------------------------------------- CR LF


def test_a_cassette_with_crlf_line_endings_loads_verified_and_replays(
        tmp_path: Path, stub: Any) -> None:
    path = record_tool_agent(tmp_path / "run.jsonl", stub(SCRIPT))
    as_written = load(path, keyring=ring(KEY), require_signature=True)
    data = path.read_bytes()
    assert b"\r" not in data
    path.write_bytes(data.replace(b"\n", b"\r\n"))  # as a checkout with autocrlf writes it
    cassette = load(path, keyring=ring(KEY), require_signature=True, allow_incomplete=False)
    assert cassette.verified
    assert cassette.observations == as_written.observations
    assert cassette.requests == as_written.requests
    result = replay_tool_agent(path)
    assert result.identical and result.verified


def test_a_v1_cassette_with_crlf_line_endings_verifies(tmp_path: Path) -> None:
    path = tmp_path / "golden-crlf.jsonl"
    path.write_bytes((GOLDEN / "v1_tool_agent.jsonl").read_bytes().replace(b"\n", b"\r\n"))
    cassette = load(path, keyring=ring(GOLDEN_KEY), require_signature=True,
                    allow_incomplete=False)
    assert cassette.verified and len(cassette) == 4


# ---------------------------------------------------------------------------- refused values


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_a_header_with_keys_that_are_not_strings_is_refused_and_leaves_no_file(
        tmp_path: Path) -> None:
    labels: Any = {1: "a", "1": "b"}  # json.dumps would write the key "1" twice
    folder = tmp_path / "cassettes"
    with pytest.raises(UnserializableValue, match="nothing was written"), \
            recorder.record(folder / "run.jsonl", labels=labels):
        pytest.fail("the run must not start")
    assert _files(tmp_path) == []
    with pytest.raises(UnserializableValue, match="nothing was written"):
        CassetteWriter(folder / "writer.jsonl", {"run": "r_keys", "labels": labels}, KEY)
    assert _files(tmp_path) == []


@pytest.mark.parametrize(("bad", "why"), [
    ({"kind": "tool", "name": 5}, "'name' must be a string"),
    ({"kind": "effect", "name": "uuid", "t": "now"}, "'t' must be"),
    ({"kind": "control", "event": "note", "detail": ["not", "an", "object"]},
     "'detail' must be an object or null"),
    ({"kind": "tool"}, "has no 'name' field"),
], ids=["tool-name", "time", "detail", "missing-name"])
def test_a_line_with_a_wrong_field_type_is_refused_and_the_file_stays_valid(
        tmp_path: Path, bad: dict[str, Any], why: str) -> None:
    path = tmp_path / "run.jsonl"
    writer = CassetteWriter(path, {"run": "r_types"}, KEY, "sync")
    writer.append({"kind": "effect", "name": "uuid", "value": "v-0"})
    writer.append({"kind": "tool", "name": "lookup", "args": {"q": "a"}, "result": {"hits": 1}})
    before = path.read_bytes()
    with pytest.raises(UnserializableValue, match=why) as info:
        writer.append(bad)
    assert "nothing was written" in str(info.value)
    assert path.read_bytes() == before
    partial = load(path, keyring=ring(KEY), require_signature=True)
    assert partial.verified and partial.end is None
    assert [o["seq"] for o in partial] == [0, 1]

    # the writer goes on at the seq it refused: the chain has no gap
    assert writer.append({"kind": "effect", "name": "uuid", "value": "v-2"})["seq"] == 2
    writer.close({"status": "completed"})
    full = load(path, keyring=ring(KEY), require_signature=True, allow_incomplete=False)
    assert [o["seq"] for o in full] == [0, 1, 2] and full.end is not None
    assert full.end["seq"] == 3


def test_a_refused_small_integer_is_named_as_what_it_is(tmp_path: Path) -> None:
    """The refusal says what the value is: 5 is an integer, well within what deja writes."""
    writer = CassetteWriter(tmp_path / "run.jsonl", {"run": "r_types"}, KEY, "sync")
    with pytest.raises(UnserializableValue, match="'name' must be a string") as info:
        writer.append({"kind": "tool", "name": 5})
    writer.close({"status": "completed"})
    assert "beyond any number deja writes" not in str(info.value)
    assert "not int" in str(info.value)


# ---------------------------------------------------------------------------- RequestReader

U1 = '{"role":"user","content":"Count alpha."}'
A1 = ('{"role":"assistant","content":[{"type":"text","text":"Looking."},{"type":"tool_use",'
      '"id":"toolu_1","name":"lookup","input":{"q":"alpha","n":1}}]}')
R1 = '{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"6"}]}'
A2 = '{"role":"assistant","content":[{"type":"text","text":"Six."}]}'
U2 = '{"role":"user","content":"And beta?"}'
HEAD = '"model":"claude-sonnet-4-6","max_tokens":64'


def chat(*messages: str, head: str = HEAD, tail: str = "") -> bytes:
    return ("{" + head + ',"messages":[' + ",".join(messages) + "]" + tail + "}").encode()


SPACED = (b'{ "model" : "claude-sonnet-4-6" ,\n\t"max_tokens": 64,\r\n "messages" : [ '
          + U1.encode() + b' ,\n  ' + A1.encode() + b' , ' + R1.encode() + b' ] }\n')

# One reader reads these in order, as a recording reads its requests: each body is compared
# with the few before it, and the messages of one whose text it starts with are taken over.
BODIES: list[tuple[str, bytes]] = [
    ("first turn", chat(U1)),
    ("grown", chat(U1, A1, R1)),
    ("grown again", chat(U1, A1, R1, A2, U2)),
    ("edited in the middle", chat(U1, A1.replace("Looking.", "Looking!"), R1, A2, U2)),
    ("1 as 1.0", chat(U1, A1.replace('"n":1}', '"n":1.0}'), R1, A2, U2)),
    ("1 as true", chat(U1, A1.replace('"n":1}', '"n":true}'), R1, A2, U2)),
    ("1 as 10", chat(U1, A1.replace('"n":1}', '"n":10}'), R1, A2, U2)),
    ("grown again, once more", chat(U1, A1, R1, A2, U2)),
    ("a field changed", chat(U1, A1, R1, A2, U2, head=HEAD.replace("64", "64.0"))),
    ("fields after the messages", chat(U1, A1, R1, tail=',"stream":false,"temperature":1')),
    ("messages twice", chat(U1, tail=',"messages":[' + U2 + "]")),
    ("messages twice after a known prefix", chat(U1, A1, R1, tail=',"messages":[]')),
    ("a field twice", chat(U1, A1, tail=',"model":"claude-opus-4-1"')),
    ("a key twice in a message", chat(U1, A1, R1.replace('"content":"6"', '"content":"6",'
                                                          '"content":"7"'))),
    ("spaced", SPACED),
    ("spaced, grown", SPACED.rstrip(b"} \n")[:-1] + b", " + A2.encode() + b"]}"),
    ("trailing whitespace", chat(U1, A1) + b" \n"),
    ("messages first", ('{"messages":[' + U1 + "," + A1 + '],"model":"m"}').encode()),
    ("empty messages", b'{"model":"m","messages":[ ]}'),
    ("messages not a list", b'{"model":"m","messages":{"role":"user"}}'),
    ("no messages", b'{"model":"m","max_tokens":1}'),
    ("empty object", b"{}"),
    ("number messages", chat("1", "2")),
    ("number messages extended", chat("1", "23")),
    ("number message as a float", chat("1", "2.5")),
    ("number message with an exponent", chat("1", "2e3")),
    ("not an object: a list", b"[1,2]"),
    ("not an object: a string", b'"text"'),
    ("not an object: null", b"null"),
    ("empty body", b""),
    ("leading space", b" " + chat(U1)),
    ("NaN", chat('{"n":NaN}')),
    ("Infinity in a field", chat(U1, head='"model":"m","temperature":Infinity')),
    ("not UTF-8", chat(U1, head='"model":"m\xff"').replace(b"\xc3\xbf", b"\xff")),
    ("a lone surrogate", chat('{"t":"\\ud800"}')),
    ("a surrogate pair", chat('{"t":"\\ud83d\\ude00"}')),
    ("cut short", chat(U1, A1)[:-3]),
    ("garbage after it", chat(U1) + b"x"),
    ("nested too deeply", chat("[" * 5000 + "]" * 5000)),
    ("the conversation again", chat(U1, A1, R1, A2, U2, U1)),
]


def _same_json(a: Any, b: Any) -> bool:
    """The same value, key order and types included."""
    return json.dumps(a) == json.dumps(b)


def test_request_reader_reads_exactly_what_a_full_parse_reads() -> None:
    reader, parts = RequestReader(), Parts()
    not_json = json_body(b"")[0]
    url = "http://127.0.0.1:1/v1/messages"
    read: dict[str, Any] = {}
    fps: dict[str, str] = {}
    for name, data in BODIES:
        body, problem, texts = reader.read(data)
        want, why = json_body(data)
        assert problem == why, name
        if want is not_json:
            assert body is not_json and texts is None, name
            continue
        assert _same_json(body, want), name
        read[name] = body
        if texts is not None:  # the exact text of each part, as the body holds it
            fields, items = texts
            assert all(_same_json(json.loads(t), body[k]) for k, t in fields.items()), name
            assert set(fields) == set(body) - {"messages"}, name
            if items:
                assert _same_json([json.loads(t) for t in items], body["messages"]), name
        fps[name] = model_fingerprint("POST", url, body, parts, texts)
        assert fps[name] == model_fingerprint("POST", url, want), name

    # the incremental path was taken: a grown body's history is the earlier body's objects
    assert read["grown"]["messages"][0] is read["first turn"]["messages"][0]
    assert read["grown again"]["messages"][2] is read["grown"]["messages"][2]
    for name in ("grown", "grown again", "spaced", "fields after the messages"):
        assert reader.read(dict(BODIES)[name])[2] is not None, name
    variants = [fps[n] for n in ("grown again", "1 as 1.0", "1 as true", "1 as 10")]
    assert len(set(variants)) == 4
    assert fps["grown again, once more"] == fps["grown again"]
    assert fps["a field changed"] != fps["grown again"]
    assert fps["edited in the middle"] != fps["grown again"]
