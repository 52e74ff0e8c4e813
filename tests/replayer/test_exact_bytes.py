"""A request sent again exactly as recorded is matched by its bytes, without reading it;
any other is read and judged as before, and a request redaction changed never is.

Each test records the real anthropic SDK against the stub server, stops the stub and
replays; ``exact_bytes.hits`` counts the calls answered by their bytes alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import MODEL
from record_replay_helpers import sync_client

import recorder
import replayer
from recorder.errors import CorruptCassette
from replayer.verdicts import Change
from tests.recorder.test_cassette_size import KEY
from tests.tamper import join, resign


def _converse(url: str, first: dict[str, Any], *, stream: bool = False) -> list[str]:
    """Two turns of one conversation (the second resends the first and its answer); the
    answers' texts."""
    messages: list[dict[str, Any]] = [first]
    texts = []
    with sync_client(url) as client:
        for follow_up in ("and then?", None):
            if stream:
                with client.messages.stream(model=MODEL, max_tokens=32,
                                            messages=list(messages)) as events:
                    text = events.get_final_message().content[0].text
            else:
                text = client.messages.create(model=MODEL, max_tokens=32,
                                              messages=list(messages)).content[0].text
            texts.append(text)
            if follow_up is not None:
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": follow_up}]
    return texts


def _record(stub, path: Path, first: dict[str, Any], **kwargs: Any) -> tuple[str, list[str]]:
    server = stub({"turns": [{"text": "first answer"}, {"text": "second answer"}]})
    stream = kwargs.pop("stream", False)
    with recorder.record(path, **kwargs):
        texts = _converse(server.url, first, stream=stream)
    server.stop()
    return server.url, texts


USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_sent_as_recorded_is_matched_by_its_bytes(stub, tmp_path: Path,
                                                            stream: bool) -> None:
    path = tmp_path / "run.jsonl"
    server = stub({"turns": [{"text": "first answer"}, {"text": "second answer"}]})
    with recorder.record(path):
        recorded = _converse(server.url, USER, stream=stream)
    server.stop()
    with replayer.replay(path) as session:
        replayed = _converse(server.url, USER, stream=stream)
    assert replayed == recorded == ["first answer", "second answer"]
    assert session.exact_bytes.hits == 2
    assert session.result is not None and session.result.identical
    assert session.result.grades["exact"] == 2


def test_keys_in_another_order_are_read_and_still_exact(stub, tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    url, recorded = _record(stub, path, USER)
    # The same message, its keys written in another order: other bytes, the same request.
    with replayer.replay(path) as session:
        replayed = _converse(url, {"content": "hi", "role": "user"})
    assert replayed == recorded
    assert session.exact_bytes.hits == 0  # neither request is byte for byte the recorded one
    assert session.result is not None and session.result.identical
    assert session.result.grades["exact"] == 2


def test_a_request_one_byte_off_diverges_as_before(stub, tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    url, _ = _record(stub, path, USER)
    with pytest.raises(recorder.Divergence) as info, replayer.replay(path) as session:
        _converse(url, {"role": "user", "content": "hj"})
    assert session.exact_bytes.hits == 0
    assert info.value.info.category == Change.CHANGED_REQUEST
    assert info.value.info.step == 0


def test_calls_out_of_recorded_order_are_matched_by_their_bytes(stub, tmp_path: Path) -> None:
    server = stub({"turns": [{"text": "to a"}, {"text": "to b"}]})
    path = tmp_path / "run.jsonl"

    def ask(order: tuple[str, ...]) -> dict[str, str]:
        with sync_client(server.url) as client:
            return {p: client.messages.create(
                model=MODEL, max_tokens=32, messages=[{"role": "user", "content": p}]
            ).content[0].text for p in order}

    with recorder.record(path):
        recorded = ask(("a", "b"))
    server.stop()
    with replayer.replay(path) as session:
        replayed = ask(("b", "a"))
    assert replayed == recorded
    assert session.exact_bytes.hits == 2
    assert session.result is not None and session.result.identical


def test_a_request_redaction_changed_is_never_matched_by_its_bytes(stub,
                                                                   tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    first = {"role": "user", "content": "user u-7f3a-SECRET asks"}
    url, recorded = _record(stub, path, first, redact_patterns=(r"u-7f3a-\w+",))
    lines = path.read_bytes().split(b"\n", 1)[1]  # the header names the pattern
    assert b"u-7f3a-SECRET" not in lines and b"[redacted]" in lines
    # no digest of bytes that held a secret (a guess at the secret could be checked by it)
    assert [("sent" in json.loads(raw)) for raw in lines.splitlines()[:-1]] == [False, False]
    # The agent sends the secret again: read, redacted as recorded, and matched exactly.
    with replayer.replay(path) as session:
        assert _converse(url, first) == recorded
    assert session.exact_bytes.hits == 0
    assert session.result is not None and session.result.identical
    # Sending the stored (redacted) text itself takes the same road, and matches too.
    with replayer.replay(path) as session:
        _converse(url, {"role": "user", "content": "user [redacted] asks"})
    assert session.exact_bytes.hits == 0
    assert session.result is not None and session.result.identical


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_sent_again_is_known_by_its_digest_and_its_request_is_not_restored(
        stub, tmp_path: Path, stream: bool) -> None:
    """Each model line keeps the digest of its request's bytes as sent; a replay finds the
    line by it and serves the response alone, without rebuilding the request (nor, for a
    stream, assembling the answer the next request resends)."""
    path = tmp_path / "run.jsonl"
    url, recorded = _record(stub, path, USER, stream=stream)
    lines = [json.loads(raw) for raw in path.read_bytes().splitlines()[1:-1]]
    assert [line["kind"] for line in lines] == ["model", "model"]
    assert all(len(line["sent"]) == 22 for line in lines)
    with replayer.replay(path) as session:
        store = session.cassette.observations._store
        rebuilt: list[int] = []
        request = store.request

        def counting(seq: int, stored: Any = None) -> Any:
            rebuilt.append(seq)
            return request(seq, stored)

        store.request = counting
        assert _converse(url, USER, stream=stream) == recorded
        assert rebuilt == []
    assert session.exact_bytes.hits == 2
    assert session.result is not None and session.result.identical
    assert session.result.grades["exact"] == 2
    # read whole afterwards, the lines are the lines: served ones were not kept half-restored
    assert [line["stream"] for line in session.cassette.observations] == [stream] * 2


def test_a_line_without_a_digest_is_matched_by_its_request_written_again(
        stub, tmp_path: Path) -> None:
    """A cassette whose lines keep no digest (written before lines had one) is matched by
    each request written again as the SDK writes it, as before."""
    path = tmp_path / "run.jsonl"
    url, recorded = _record(stub, path, USER)
    docs = [json.loads(raw) for raw in path.read_bytes().splitlines()]
    for doc in docs:
        doc.pop("sent", None)
    old = tmp_path / "old.jsonl"
    old.write_bytes(join(resign(docs, KEY)))
    with replayer.replay(old) as session:
        assert _converse(url, USER) == recorded
    assert session.exact_bytes.hits == 2
    assert session.result is not None and session.result.identical


def test_a_conversations_requests_are_written_once_item_by_item() -> None:
    """Each request of a conversation holds the items of the one before, object for object:
    only the items it adds are written, and every text is the body's compact JSON."""
    from replayer._exact import _ENCODE, _Texts

    written: list[Any] = []

    class Counting(_Texts):
        def of(self, value: Any) -> str:
            written.append(value)
            return super().of(value)

    texts = Counting()
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    for turn in range(30):
        messages = [*messages, {"role": "assistant", "content": [{"type": "text",
                                                                  "text": f"a{turn}"}]},
                    {"role": "user", "content": f"q{turn}"}]
        body = {"model": MODEL, "max_tokens": 32, "messages": messages}
        assert texts.body(body) == _ENCODE(body)
    items = [value for value in written if isinstance(value, dict)]
    assert len(items) == 1 + 2 * 30  # each message once, not once per request holding it

    # the same items, equal but not the same objects (keys in another order): written anew
    reordered = [{"content": m["content"], "role": m["role"]} for m in messages]
    body = {"model": MODEL, "max_tokens": 32, "messages": reordered}
    assert texts.body(body) == _ENCODE(body) != _ENCODE({**body, "messages": messages})


@pytest.mark.parametrize(("seq", "edit"), [
    (1, {"body": 5}), (0, {"headers": [["content-type"]]}), (0, {"headers": [5]}),
    (1, {"status": "200"})], ids=["body", "header-pair", "header", "status"])
def test_a_signed_response_of_a_type_deja_never_writes_is_refused_as_corrupt(
        stub, tmp_path: Path, seq: int, edit: dict[str, Any]) -> None:
    """A line served by its digest is checked as a line restored whole is: a response
    field of a type deja never writes is a CorruptCassette naming the line, never a
    traceback from inside the SDK."""
    path = tmp_path / "run.jsonl"
    url, _ = _record(stub, path, USER)
    docs = [json.loads(raw) for raw in path.read_bytes().splitlines()]
    response = docs[seq + 1]["response"]
    if "body" in edit:
        response.pop("body_json")
    response.update(edit)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(join(resign(docs, KEY)))
    with pytest.raises(CorruptCassette, match=f"seq {seq}"), replayer.replay(bad):
        _converse(url, USER)
