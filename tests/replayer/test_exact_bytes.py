"""A request sent again exactly as recorded is matched by its bytes, without reading it;
any other is read and judged as before, and a request redaction changed never is.

Each test records the real anthropic SDK against the stub server, stops the stub and
replays; ``exact_bytes.hits`` counts the calls answered by their bytes alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import MODEL
from record_replay_helpers import sync_client

import recorder
import replayer
from replayer.verdicts import Change


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
    with recorder.record(path, **kwargs):
        texts = _converse(server.url, first, stream=kwargs.pop("stream", False))
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
