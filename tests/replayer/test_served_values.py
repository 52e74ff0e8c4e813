"""A signed response no HTTP client could have received is refused when the cassette loads,
naming its line: served, it would hang the proxy's client (a header its server cannot
write, a status line it has none for), put a header of its own into requests' response (a
line break in a value), poison the next response on the connection (a body on a 204) or
serve the wrong bytes (a body encoding deja never writes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import replayer
from recorder.cassette import load
from recorder.errors import CorruptCassette
from tests.recorder.test_cassette_size import KEY
from tests.replayer.test_exact_bytes import USER, _converse, _record
from tests.tamper import join, resign

Edit = Callable[[dict[str, Any]], None]


def _header(name: str, value: str) -> Edit:
    def edit(line: dict[str, Any]) -> None:
        line["response"]["headers"].append([name, value])
    return edit


def _field(**fields: Any) -> Edit:
    def edit(line: dict[str, Any]) -> None:
        line["response"].update(fields)
    return edit


def _empty_204(line: dict[str, Any]) -> None:
    line["response"].update(status=204, body="")
    line["response"].pop("body_json", None)


def _no_response(line: dict[str, Any]) -> None:
    del line["response"]


def _edit_with_newline(line: dict[str, Any]) -> None:
    """seq 1 stores its headers as edits of seq 0's: a new value with a line break."""
    edits = line["response"]["headers"]
    at = next(i for i, step in enumerate(edits) if isinstance(step, str))
    edits[at] = edits[at] + "\r\nset-cookie: session=evil"


REFUSED: dict[str, tuple[int, Edit]] = {
    "status 0": (0, _field(status=0)),
    "status 600": (0, _field(status=600)),
    "status 99": (0, _field(status=99)),
    "line break in a value": (0, _header("x-note", "ok\r\nset-cookie: session=evil")),
    "NUL in a value": (0, _header("x-note", "a\x00b")),
    "name with a space": (0, _header("x note", "v")),
    "name with a colon": (0, _header("x-note:", "v")),
    "reason on two lines": (0, _field(reason="OK\r\nx-injected: 1")),
    "body on a 204": (0, _field(status=204)),
    "body on a 101": (0, _field(status=101)),
    "encoding hex": (0, _field(encoding="hex")),
    "an edit with a line break": (1, _edit_with_newline),
}


def _docs(stub, tmp_path: Path) -> tuple[str, list[dict[str, Any]]]:
    path = tmp_path / "run.jsonl"
    url, _ = _record(stub, path, USER)
    return url, [json.loads(raw) for raw in path.read_bytes().splitlines()]


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_a_signed_response_no_client_could_receive_is_refused_at_load(
        stub, tmp_path: Path, case: str) -> None:
    seq, edit = REFUSED[case]
    url, docs = _docs(stub, tmp_path)
    edit(docs[seq + 1])
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(join(resign(docs, KEY)))
    with pytest.raises(CorruptCassette, match=f"seq {seq} ") as caught:
        load(bad)
    assert caught.value.seq == seq
    with pytest.raises(CorruptCassette, match=f"seq {seq} "), replayer.replay(bad):
        _converse(url, USER)


def test_an_exchange_with_neither_a_response_nor_an_error_is_refused_when_served(
        stub, tmp_path: Path) -> None:
    """Served, it would be a status 0 response, which no client takes (the proxy's server
    refuses to start it and its client waits)."""
    url, docs = _docs(stub, tmp_path)
    _no_response(docs[2])
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(join(resign(docs, KEY)))
    with pytest.raises(CorruptCassette, match="seq 1: its response cannot be served"), \
            replayer.replay(bad):
        _converse(url, USER)


def test_what_a_client_receives_still_loads_and_replays(stub, tmp_path: Path) -> None:
    """A tab, text that is not ASCII, every token character in a name, an empty 204 and
    a status of 599 are headers and statuses servers send."""
    url, docs = _docs(stub, tmp_path)
    docs[1]["response"]["headers"] += [["x-note", "a\tb café €"],
                                       ["x-!#$%&'*+.^_`|~09azAZ-", "v"]]
    docs[1]["response"]["reason"] = "OK"
    ok = tmp_path / "ok.jsonl"
    ok.write_bytes(join(resign(docs, KEY)))
    assert load(ok).observations[0]["response"]["headers"][-1] == [
        "x-!#$%&'*+.^_`|~09azAZ-", "v"]
    with replayer.replay(ok):
        assert _converse(url, USER) == ["first answer", "second answer"]
    for status, edit in ((204, _empty_204), (599, _field(status=599))):
        docs_again = [dict(d) for d in docs]
        docs_again[2] = json.loads(json.dumps(docs[2]))
        edit(docs_again[2])
        other = tmp_path / f"status-{status}.jsonl"
        other.write_bytes(join(resign(docs_again, KEY)))
        assert load(other).observations[1]["response"]["status"] == status
