"""The recorder never writes a line its reader refuses for nesting too deep.

A cassette's reader takes lines nested at most ``LINE_DEPTH`` (200) levels deep: its
readers recurse, and a cassette is untrusted input. Everything the recorder puts in a line
is kept ``BODY_DEPTH`` (190) levels deep or less, a line putting it a few levels down:

- a model request nested deeper is refused before it is sent, as NaN is, whether it is
  read whole or from where it repeats the conversation's last request;
- a response body nested deeper, or a plain HTTP request's, is kept as its exact text
  rather than as JSON;
- a tool result or effect value nested deeper as stored (each tag a level, so a tuple
  takes two) is refused, and the refusal is written as the step's error;
- an MCP line whose params or notifications nest deeper likewise;
- a header (its labels) nested too deep is refused before its file is made, and a line
  copied from a loaded cassette (a fork's prefix) is held to the bound as any other.

Each case at the bound and past it, recorded with the real SDK against the stub (or a
real HTTP server), loaded back, and replayed. The reader itself bounds a line's depth
before the json module, which recurses on the C stack, reads it.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest
from conftest import API_KEY, MODEL

import recorder
import replayer
from recorder import _fastjson, effects
from recorder._fastjson import BODY_DEPTH, LINE_DEPTH, nests_deeper, openers
from recorder.capture.mcp import McpCall, McpReply
from recorder.capture.session import Timing
from recorder.cassette import _validate, load
from recorder.errors import EditError, UnserializableValue


def chain(levels: int, inner: Any = 1) -> Any:
    """``inner`` within ``levels`` lists: ``levels`` deep (one more for a list ``inner``)."""
    doc = inner
    for _ in range(levels):
        doc = [doc]
    return doc


def depth(doc: Any) -> int:
    """The reference: the deepest list or dict, counted from 1 at the outermost."""
    if isinstance(doc, dict):
        return 1 + max((depth(v) for v in doc.values()), default=0)
    if isinstance(doc, list):
        return 1 + max((depth(v) for v in doc), default=0)
    return 0


def text_depth(data: bytes) -> int:
    deepest = level = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            escaped, in_string = (False, True) if escaped else (byte == 0x5C, byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            level += 1
            deepest = max(deepest, level)
        elif byte in b"]}":
            level -= 1
    return deepest


# ---------------------------------------------------------------------------- measuring


def _random_doc(rng: random.Random, levels: int) -> Any:
    if levels == 0 or rng.random() < 0.15:
        return rng.choice([1, 2**70, -0.5, None, True, "[{", '"]}\\', "plain"])
    # one item goes on down, the others stop within a few levels: wide and deep both
    inner = [_random_doc(rng, levels - 1 if i == 0 else min(levels - 1, 3))
             for i in range(rng.randint(0, 3))]
    rng.shuffle(inner)
    return inner if rng.random() < 0.5 else {f"k{i}[": v for i, v in enumerate(inner)}


def test_nesting_is_measured_as_a_walk_of_the_document_measures_it() -> None:
    rng = random.Random(7)
    for _ in range(1500):
        doc = _random_doc(rng, rng.choice([4, 40, 260]))
        deepest = depth(doc)
        for limit in {1, max(deepest - 1, 1), deepest, deepest + 1, LINE_DEPTH}:
            assert nests_deeper(doc, limit) == (deepest > limit), (deepest, limit)
        if str(2**70) not in repr(doc):
            text = json.dumps(doc).encode()
            assert text_depth(text) == deepest and openers(text) >= deepest
    for levels in (1, 199, 200, 201, 253, 254, 255, 900):
        doc = chain(levels - 1, [])
        assert nests_deeper(doc, levels - 1) and not nests_deeper(doc, levels)
        # an integer orjson does not write: the walk decides
        doc = chain(levels - 1, [2**70])
        assert nests_deeper(doc, levels - 1) and not nests_deeper(doc, levels)
    assert not nests_deeper("[[[[", 0) and nests_deeper({}, 0) and not nests_deeper({}, 1)


def test_the_reader_takes_lines_200_levels_deep_and_refuses_deeper_ones() -> None:
    assert LINE_DEPTH == _validate.MAX_DEPTH == 200
    at = json.dumps({"kind": "x", "v": chain(LINE_DEPTH - 2, [])}).encode()
    assert text_depth(at) == LINE_DEPTH
    assert _validate.decode(at) == json.loads(at)
    for deeper in (LINE_DEPTH, 600, 5000):  # one level under the line itself
        raw = b'{"kind":"x","v":' + b"[" * deeper + b"]" * deeper + b"}"
        with pytest.raises(_validate.BadLine, match="nests deeper than 200 levels"):
            _validate.decode(raw)
    # brackets in strings do not count: a shallow line full of them is read
    shallow = json.dumps({"kind": "x", "text": "[{" * 5000 + '\\"]' * 100}).encode()
    assert _validate.decode(shallow)["text"].startswith("[{[{")
    assert _validate.decode_trusted(shallow, Path("c.jsonl"), "line 2", 1) \
        == json.loads(shallow)


@pytest.mark.parametrize(("levels", "stack_kib"), [(500_000, 0), (5_000, 128)],
                         ids=["a raised recursion limit", "a 128 KiB thread stack"])
def test_a_line_thousands_of_levels_deep_is_refused_before_a_reader_recurses_into_it(
        levels: int, stack_kib: int) -> None:
    """json's reader recurses on the C stack, bounded by the interpreter's recursion limit
    only: a hostile line it read first could crash the process rather than be refused
    (orjson's reader, which reads first, stops at 1,024 levels)."""
    script = textwrap.dedent(f"""
        import sys, threading
        from recorder.cassette import _validate
        levels = {levels}
        raw = b'{{"kind":"x","v":' + b"[" * levels + b"]" * levels + b"}}"
        def read():
            for decode in (_validate.decode,
                           lambda r: _validate.decode_trusted(r, "c.jsonl", "line 2", 1)):
                try:
                    decode(raw)
                    print("read")
                except Exception as exc:
                    print(type(exc).__name__, exc)
        if not {stack_kib}:
            sys.setrecursionlimit(1_000_000)
            read()
        else:
            threading.stack_size({stack_kib} * 1024)
            thread = threading.Thread(target=read)
            thread.start()
            thread.join()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.splitlines() == [
        "BadLine nests deeper than 200 levels; deja never writes such a line",
        "CorruptCassette c.jsonl: line 2 nests deeper than 200 levels; deja never writes "
        "such a line"], done.stdout


# ---------------------------------------------------------------------------- model requests


def _body(metadata: Any = None, content: Any = "hi", more: tuple[Any, ...] = ()) -> bytes:
    messages = [{"role": "user", "content": content}, *more]
    doc: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "messages": messages}
    if metadata is not None:
        doc["metadata"] = metadata
    return json.dumps(doc, separators=(",", ":")).encode()


def _member(levels: int) -> bytes:
    """A request ``levels`` deep by a member that is not its history."""
    body = _body(metadata={"x": chain(levels - 3, [])})
    assert text_depth(body) == levels
    return body


def _item(levels: int) -> bytes:
    """A request ``levels`` deep by an item of its history."""
    block = {"type": "text", "text": "hi", "x": chain(levels - 6, [])}
    body = _body(content=[block])
    assert text_depth(body) == levels
    return body


def _post(url: str, bodies: list[bytes]) -> list[str]:
    seen = []
    with anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0) as client:
        for body in bodies:
            try:
                reply = client.post("/v1/messages", cast_to=httpx2.Response, content=body,
                                    options={"headers": {"content-type": "application/json"}})
                seen.append(f"sent: {reply.json()['content'][0]['text']}")
            except UnserializableValue as exc:
                seen.append(f"refused: {exc}")
    return seen


def _record_and_replay(stub: Any, tmp_path: Path, bodies: list[bytes]) -> tuple[list[str], Any]:
    server = stub({"model": MODEL, "default": {"text": "fine"}})
    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        recorded = _post(server.url, bodies)
    sent = [r["body"] for r in server.received()]
    cassette = load(path, require_signature=True)  # whatever was recorded loads
    server.stop()
    with replayer.replay(path) as run:
        replayed = _post(server.url, bodies)
    assert run.result is not None and run.result.identical
    # the same answers and refusals, the port in a URL aside
    assert [_hostname(r) for r in replayed] == [_hostname(r) for r in recorded]
    return recorded, (sent, cassette)


def _hostname(said: str) -> str:
    return re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1", said)


@pytest.mark.parametrize("where", [_member, _item], ids=["member", "history item"])
def test_a_request_at_the_bound_is_recorded_and_a_deeper_one_refused_before_it_is_sent(
        stub: Any, tmp_path: Path, where: Any) -> None:
    bodies = [where(BODY_DEPTH), where(BODY_DEPTH + 1), where(LINE_DEPTH + 60)]
    recorded, (sent, cassette) = _record_and_replay(stub, tmp_path, bodies)
    assert recorded[0] == "sent: fine"
    for refusal in recorded[1:]:
        assert refusal.startswith("refused: model request POST ")
        assert "nested too deeply for a cassette line (more than 190 levels" in refusal
    assert sent == [json.loads(bodies[0])]  # the deeper ones never left
    (line,) = cassette.observations
    assert line["kind"] == "model"


def test_a_conversation_read_from_where_it_repeats_is_held_to_the_bound_too(
        stub: Any, tmp_path: Path) -> None:
    """The items a request repeats were checked with the request before; the new ones
    and the members read again are checked as they come."""
    first = {"role": "user", "content": [{"type": "text", "text": "a",
                                          "x": chain(BODY_DEPTH - 6, [])}]}
    deep = {"role": "user", "content": [{"type": "text", "text": "b",
                                         "x": chain(BODY_DEPTH - 5, [])}]}
    plain = [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "more"}]
    bodies = [_body(content=first["content"]),
              _body(content=first["content"], more=(*plain, deep)),
              _body(content=first["content"], more=tuple(plain)),
              _body(content=first["content"], more=tuple(plain),
                    metadata={"x": chain(BODY_DEPTH - 2, [])})]
    recorded, (sent, cassette) = _record_and_replay(stub, tmp_path, bodies)
    assert [r.split(":")[0] for r in recorded] == ["sent", "refused", "sent", "refused"]
    assert len(sent) == 2 and len(cassette.observations) == 2


# ---------------------------------------------------------------------------- responses


@pytest.mark.parametrize("levels", [BODY_DEPTH, BODY_DEPTH + 1, 300])
def test_a_response_body_nested_deeper_than_the_bound_is_kept_as_its_text(
        serve: Any, tmp_path: Path, levels: int) -> None:
    payload = json.dumps({"id": "msg_1", "type": "message", "content": [],
                          "x": chain(levels - 2, [])}, separators=(",", ":")).encode()
    assert text_depth(payload) == levels
    url = serve(payload).url
    request = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    path = tmp_path / "deep-response.jsonl"
    with recorder.record(path):
        assert httpx2.post(url, json=request, timeout=5).content == payload
    (line,) = load(path, require_signature=True).observations
    as_json = b"body_json" in path.read_bytes()
    assert as_json == (levels <= BODY_DEPTH)
    if not as_json:
        assert line["response"]["body"] == payload.decode()
    with replayer.replay(path) as run:
        assert httpx2.post(url, json=request, timeout=5).content == payload
    assert run.result is not None and run.result.identical


@pytest.mark.parametrize("levels", [BODY_DEPTH, BODY_DEPTH + 1])
def test_a_plain_http_body_nested_deeper_than_the_bound_is_kept_as_its_text(
        serve: Any, tmp_path: Path, levels: int) -> None:
    url = serve(b'{"ok":true}').url.replace("/v1/messages", "/api/orders")
    sent = json.dumps({"order": chain(levels - 2, [])}, separators=(",", ":")).encode()
    assert text_depth(sent) == levels
    path = tmp_path / "http.jsonl"
    headers = {"content-type": "application/json"}
    with recorder.record(path):
        assert httpx2.post(url, content=sent, headers=headers, timeout=5).json() == {"ok": True}
    (line,) = load(path, require_signature=True).observations
    assert line["kind"] == "http"
    stored = line["request"]["body"]
    assert stored == (json.loads(sent) if levels <= BODY_DEPTH
                      else {"text": sent.decode(), "body_encoding": "text"})
    with replayer.replay(path) as run:
        assert httpx2.post(url, content=sent, headers=headers, timeout=5).json() == {"ok": True}
    assert run.result is not None and run.result.identical


def test_a_fork_copies_a_line_whose_error_message_is_nested_deep_and_still_loads(
        serve: Any, tmp_path: Path) -> None:
    """A 400 whose error message is an array 205 deep: the body is kept as text, and the
    error read from it, which a copied line carries, as the message's JSON text."""
    message = chain(205, [])
    payload = json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                     "message": message}}).encode()
    url = serve(payload, status=400).url
    request = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}

    def agent() -> int:
        status = httpx2.post(url, json=request, timeout=5).status_code
        return status + effects.value("n", lambda: 1)

    path = tmp_path / "parent.jsonl"
    with recorder.record(path):
        assert agent() == 401
    parent = load(path, require_signature=True).observations[0]
    assert parent["api_error"]["message"] == json.dumps(message, separators=(",", ":"))
    out = tmp_path / "fork.jsonl"
    with replayer.fork(path, at=1, patch=[{"op": "replace", "path": "/value", "value": 2}],
                       out=out):
        assert agent() == 402
    fork = load(out, require_signature=True)
    assert fork.observations[0]["api_error"] == parent["api_error"]
    assert fork.observations[1]["value"] == 2


def test_a_fork_at_a_step_whose_document_is_nested_too_deep_is_refused_before_it_begins(
        serve: Any, tmp_path: Path) -> None:
    """A reply 230 levels deep is kept as text; a fork at it would have to write it as a
    document in its ``fork_edit`` line, so it is refused, and nothing is created."""
    reply = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
             "content": [{"type": "tool_use", "id": "tu_1", "name": "f",
                          "input": {"x": chain(230, [])}}],
             "stop_reason": "tool_use", "usage": {"input_tokens": 1, "output_tokens": 1}}
    url = serve(json.dumps(reply, separators=(",", ":")).encode()).url
    request = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    path = tmp_path / "parent.jsonl"
    with recorder.record(path):
        httpx2.post(url, json=request, timeout=5)
    load(path, require_signature=True)
    out = tmp_path / "fork.jsonl"
    with pytest.raises(EditError, match="nests deeper than the 200 levels"):
        with replayer.fork(path, at=0, patch=[{"op": "replace", "path": "/id",
                                               "value": "msg_2"}], out=out):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parent.jsonl"]


@pytest.mark.parametrize("edit", ["patch of tuples", "replacement"])
def test_a_fork_whose_edit_nests_too_deep_is_refused_before_it_begins(
        tmp_path: Path, edit: str) -> None:
    """The edit is written twice: in the edited step and, as given (tuples are lists
    there), in the fork_edit line."""
    path = tmp_path / "parent.jsonl"
    with recorder.record(path):
        effects.value("n", lambda: 1)
    deep: Any = "x"
    for _ in range(LINE_DEPTH):
        deep = (deep,) if edit == "patch of tuples" else [deep]
    change: dict[str, Any] = (
        {"patch": [{"op": "add", "path": "/note", "value": deep}]}
        if edit == "patch of tuples" else {"replace": {"value": 2, "note": deep}})
    with pytest.raises(EditError, match="nests deeper than the 200 levels"):
        with replayer.fork(path, at=0, out=tmp_path / "fork.jsonl", **change):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parent.jsonl"]


@pytest.mark.parametrize("nest", [list, tuple], ids=["lists", "tuples"])
def test_a_header_nested_too_deep_is_refused_before_anything_is_created(
        tmp_path: Path, nest: Any) -> None:
    labels: Any = "x"
    for _ in range(LINE_DEPTH):
        labels = nest([labels])
    path = tmp_path / "labels.jsonl"
    with pytest.raises(UnserializableValue, match="nests deeper than the 200 levels"):
        with recorder.record(path, labels={"deep": labels}):
            pass
    assert list(tmp_path.iterdir()) == []  # no file, no lock: the path is free
    with recorder.record(path, labels={"deep": "no"}):
        pass
    assert load(path, require_signature=True).header["labels"] == {"deep": "no"}


# ---------------------------------------------------------------------------- values


def tuples(levels: int) -> Any:
    """Tuples within tuples, ``levels`` deep as stored: each tuple takes two."""
    value: Any = "leaf"
    for _ in range(levels // 2):
        value = (value,)
    return value


def test_a_value_at_the_bound_as_stored_is_kept_and_a_deeper_one_refused_as_its_step(
        tmp_path: Path) -> None:
    @recorder.tool
    def fetch(levels: int) -> Any:
        return tuples(levels)

    def agent() -> list[Any]:
        seen: list[Any] = []
        for levels in (BODY_DEPTH, BODY_DEPTH + 2):
            try:
                seen.append(fetch(levels))
            except UnserializableValue as exc:
                seen.append(f"refused: {exc}")
            try:
                seen.append(effects.value("blob", lambda n=levels: {"v": [tuples(n - 2)]}))
            except UnserializableValue as exc:
                seen.append(f"refused: {exc}")
        return seen

    path = tmp_path / "values.jsonl"
    with recorder.record(path):
        recorded = agent()
    assert recorded[0] == tuples(BODY_DEPTH) and recorded[1] == {"v": [tuples(BODY_DEPTH - 2)]}
    assert all(r.startswith("refused: ") and f"more than {BODY_DEPTH} levels" in r
               for r in recorded[2:])
    lines = load(path, require_signature=True).observations
    assert [("error" in line) for line in lines] == [False, False, True, True]
    with replayer.replay(path) as run:
        assert agent() == recorded
    assert run.result is not None and run.result.identical


def test_an_mcp_line_too_deep_is_written_as_its_refusal(tmp_path: Path) -> None:
    server = {"transport": "stdio", "command": "ledger"}
    deep = chain(LINE_DEPTH, [])
    cases = [
        (McpCall(server, "resources/read", {"uri": "x"}),
         McpReply(result={"contents": []}, notifications=[{"method": "n", "params": deep}])),
        (McpCall(server, "resources/read", {"uri": deep}), McpReply(result={"contents": []})),
        (McpCall(server, "tools/call", {"name": "lookup", "arguments": {}}),
         McpReply(result={"content": deep})),
        (McpCall(server, "tools/call", {"name": "lookup", "arguments": {}}),
         McpReply(result={"content": chain(BODY_DEPTH - 3, [])})),
    ]
    path = tmp_path / "mcp.jsonl"
    refused = []
    with recorder.record(path) as session:
        for call, reply in cases:
            try:
                session.mcp_log(call, reply, Timing(start=1.0, ms=1.0))
                refused.append(None)
            except UnserializableValue as exc:
                refused.append(str(exc))
    assert [r is not None for r in refused] == [True, True, True, False]
    assert "resources/read (step 0)" in str(refused[0]) and "levels deep" in str(refused[0])
    lines = load(path, require_signature=True).observations
    assert [line.get("error", {}).get("type") for line in lines] == \
        ["UnserializableValue"] * 3 + [None]
    assert "notifications" not in lines[0]["mcp"] and lines[1]["params"] == {}
    assert lines[3]["result"] == {"content": chain(BODY_DEPTH - 3, [])}


def test_the_writer_refuses_any_other_line_a_reader_would_refuse(tmp_path: Path) -> None:
    """The last bound: a line built around the checks above is refused, not written."""
    path = tmp_path / "last.jsonl"
    with recorder.record(path) as session:
        assert session.writer is not None
        with pytest.raises(UnserializableValue, match="nests deeper than the 200 levels"):
            session.writer.append({"kind": "effect", "name": "x",
                                   "value": chain(LINE_DEPTH, [])})
        session.writer.append({"kind": "effect", "name": "y",
                               "value": chain(LINE_DEPTH - 3, [])})
    (line,) = load(path, require_signature=True).observations
    assert line["name"] == "y"
    assert _fastjson.LINE_DEPTH - BODY_DEPTH == 10
