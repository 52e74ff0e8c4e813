"""The cassette format, its signature chain, the keys that sign it, and the golden files.

Every cassette here is a real file made through the real path: ``CassetteWriter`` directly,
or ``recorder.record(...)`` around the real anthropic SDK talking to the stub server.
"""

from __future__ import annotations

import json
import math
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic
import pytest
from conftest import golden_agent

import recorder
import replayer
from recorder import values as _values
from recorder.cassette import CassetteWriter, load
from recorder.cassette.keys import Keyring, key_id, load_keyring
from recorder.errors import (
    CassetteNotFound,
    ConfigError,
    CorruptCassette,
    PathTaken,
    SessionError,
    SignatureError,
    TornCassette,
    UnserializableValue,
    UnsupportedFormat,
    UnverifiedCassette,
)

MODEL = "claude-sonnet-4-6"
KEY = b"test-key-0123456789abcdef"  # the DEJA_KEY that conftest sets for every test
GOLDEN = Path(__file__).parents[1] / "golden"
GOLDEN_KEY = "golden-key-deja-v1"
CLOSED_PORT_URL = "http://127.0.0.1:9"  # nothing listens there: a replay must not need it


# ---------------------------------------------------------------------------- helpers


def write_cassette(path: Path, key: bytes = KEY, n: int = 5, *, end: bool = True,
                   fsync: str = "turn") -> Path:
    """A cassette of ``n`` observations (effects, a tool, model turns) and an end line."""
    writer = CassetteWriter(path, {"run": "r_test", "labels": {"case": "cassette"}}, key,
                            fsync)
    messages: list[dict[str, Any]] = []
    for i in range(n):
        if i % 3 == 0:
            writer.append({"kind": "effect", "name": "uuid", "value": f"value-{i}"})
        elif i % 3 == 1:
            writer.append({"kind": "tool", "name": "lookup", "args": {"q": i},
                           "result": {"answer": i * 10}})
        else:
            messages = [*messages, {"role": "user", "content": f"question {i}"}]
            writer.append({"kind": "model", "provider": "anthropic", "fp": f"fp{i}",
                           "response": {"status": 200, "body": f"answer {i}"}},
                          request_body={"model": MODEL, "max_tokens": 16,
                                        "messages": list(messages)},
                          has_request=True)
    if end:
        writer.close({"status": "completed"})
    else:
        writer.abandon()
    return path


def raw_lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def put_lines(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"".join(lines))


def ring(*keys: bytes | str) -> Keyring:
    return Keyring.of(*keys)


def new_client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)


# ---------------------------------------------------------------------------- round trip


def test_round_trip_header_dense_seq_end_and_verified(tmp_path: Path) -> None:
    path = write_cassette(tmp_path / "run.jsonl", n=6)
    lines = raw_lines(path)
    assert lines[0].startswith(b'{"format":"deja/2"')
    body = [json.loads(line) for line in lines[1:]]
    assert [line["seq"] for line in body] == list(range(7))
    assert body[-1]["kind"] == "end" and body[-1]["status"] == "completed"
    assert all(line.endswith(b"\n") for line in lines)
    assert all("sig" in json.loads(line) for line in lines)

    cassette = load(path, keyring=ring(KEY))
    assert cassette.verified is True
    assert cassette.verify_note == f"verified with key {key_id(KEY)}"
    assert [o["seq"] for o in cassette.observations] == list(range(6))
    assert [o["kind"] for o in cassette] == ["effect", "tool", "model"] * 2
    assert cassette.observations[1]["result"] == {"answer": 10}
    assert cassette.end is not None and cassette.end["seq"] == 6
    assert cassette.run == "r_test"
    assert cassette.header["labels"] == {"case": "cassette"}
    assert "sig" not in cassette.observations[0]
    assert cassette.request_of(5)["messages"] == [
        {"role": "user", "content": "question 2"}, {"role": "user", "content": "question 5"}]


def test_without_the_key_a_cassette_is_refused_unless_unverified_is_allowed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_cassette(tmp_path / "run.jsonl")
    with pytest.raises(UnverifiedCassette, match="no signing key on this machine") as info:
        load(path, keyring=Keyring(None, {}))
    assert key_id(KEY) in str(info.value) and "--allow-unverified" in str(info.value)
    cassette = load(path, keyring=Keyring(None, {}), allow_unverified=True)
    assert cassette.verified is False
    assert cassette.verify_note.startswith("NOT VERIFIED")
    assert key_id(KEY) in cassette.verify_note
    assert len(cassette) == 5  # still readable
    monkeypatch.setenv("DEJA_ALLOW_UNVERIFIED", "1")  # the environment's word counts too
    assert load(path, keyring=Keyring(None, {})).verified is False


@pytest.mark.parametrize("keyring", [None, Keyring(None, {}), Keyring.of(b"another key")])
def test_require_signature_without_the_key_refuses_even_when_unverified_is_allowed(
        tmp_path: Path, keyring: Keyring | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_KEY", "yet another key")
    path = write_cassette(tmp_path / "run.jsonl")
    with pytest.raises(UnverifiedCassette, match="signature cannot be checked"):
        load(path, keyring=keyring, require_signature=True, allow_unverified=True)
    assert load(path, keyring=ring(KEY), require_signature=True).verified


# ---------------------------------------------------------------------------- tampering


def _edit_value_seq2(lines: list[bytes]) -> list[bytes]:
    line = json.loads(lines[3])
    assert line["seq"] == 2
    line["response"]["body"] = "a forged answer"
    return [*lines[:3], (json.dumps(line) + "\n").encode(), *lines[4:]]


def _insert_copy(lines: list[bytes]) -> list[bytes]:
    return [*lines[:3], lines[2], *lines[3:]]  # seq 1 again where seq 2 belongs


def _delete_middle(lines: list[bytes]) -> list[bytes]:
    return [*lines[:3], *lines[4:]]  # seq 2 gone


def _swap(lines: list[bytes]) -> list[bytes]:
    return [*lines[:3], lines[4], lines[3], *lines[5:]]  # seq 3 before seq 2


@pytest.mark.parametrize("tamper", [_edit_value_seq2, _insert_copy, _delete_middle, _swap],
                         ids=["edit", "insert", "delete", "swap"])
def test_tampering_is_refused_at_the_first_bad_line(
        tmp_path: Path, tamper: Callable[[list[bytes]], list[bytes]]) -> None:
    path = write_cassette(tmp_path / "run.jsonl", n=6)
    assert load(path, keyring=ring(KEY)).verified
    put_lines(path, tamper(raw_lines(path)))
    with pytest.raises(SignatureError) as info:
        load(path, keyring=ring(KEY))
    assert info.value.seq == 2
    assert "seq 2 (line 4)" in str(info.value)
    assert info.value.path == str(path)
    with pytest.raises(SignatureError):  # a replay refuses it just the same
        with replayer.replay(path, keyring=ring(KEY)):
            pass


def test_an_edited_value_without_the_key_loads_unverified(tmp_path: Path) -> None:
    """The edit is only detectable with the key: without it the loader says so."""
    path = write_cassette(tmp_path / "run.jsonl", n=6)
    put_lines(path, _edit_value_seq2(raw_lines(path)))
    cassette = load(path, keyring=Keyring(None, {}), allow_unverified=True)
    assert cassette.verified is False
    assert cassette.observations[2]["response"]["body"] == "a forged answer"


def test_an_edited_header_is_refused(tmp_path: Path) -> None:
    path = write_cassette(tmp_path / "run.jsonl")
    lines = raw_lines(path)
    put_lines(path, [lines[0].replace(b'"r_test"', b'"r_fake"'), *lines[1:]])
    with pytest.raises(SignatureError, match="the header") as info:
        load(path, keyring=ring(KEY))
    assert info.value.seq is None


@pytest.mark.parametrize("cut", [1, 2])
def test_truncation_at_a_line_boundary_is_an_incomplete_cassette(
        tmp_path: Path, cut: int) -> None:
    path = write_cassette(tmp_path / "run.jsonl", n=5)  # seq 0..4, end line is seq 5
    put_lines(path, raw_lines(path)[:-cut])
    missing = 6 - cut  # the seq where the end line (or the next line) should have been
    with pytest.raises(CorruptCassette) as info:
        load(path, keyring=ring(KEY), allow_incomplete=False)
    assert type(info.value) is CorruptCassette
    assert info.value.seq == missing
    assert f"no end line after seq {missing - 1}" in str(info.value)

    with pytest.raises(CorruptCassette, match="no end line") as replay_info:
        with replayer.replay(path, keyring=ring(KEY)):  # allow_incomplete=False by default
            pass
    assert replay_info.value.seq == missing

    cassette = load(path, keyring=ring(KEY))  # the reader's default accepts it, flagged
    assert cassette.end is None and cassette.verified
    assert len(cassette) == missing


def test_torn_last_line_names_seq_and_offset(tmp_path: Path) -> None:
    path = write_cassette(tmp_path / "run.jsonl", n=4, end=False)  # seq 0..3, no end
    data = path.read_bytes()
    offset = data.rstrip(b"\n").rfind(b"\n") + 1  # where the last line (seq 3) starts
    path.write_bytes(data[: offset + 25])  # cut in the middle of seq 3
    with pytest.raises(TornCassette) as info:
        load(path, keyring=ring(KEY))
    assert info.value.seq == 3
    assert info.value.offset == offset
    assert f"seq 3, byte {offset}" in str(info.value)

    cassette = load(path, keyring=ring(KEY), allow_torn=True)
    assert cassette.torn_offset == offset
    assert cassette.verified
    assert [o["seq"] for o in cassette] == [0, 1, 2]

    with pytest.raises(TornCassette):
        with replayer.replay(path, keyring=ring(KEY), allow_incomplete=True):
            pass


def test_torn_header_line(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_bytes(b'{"format":"deja/1","run":"r_x"')
    with pytest.raises(TornCassette, match="header line is torn") as info:
        load(path)
    assert info.value.offset == 0


# ---------------------------------------------------------------------------- format checks


def test_unknown_format_version_says_which_versions_are_read(tmp_path: Path) -> None:
    path = write_cassette(tmp_path / "run.jsonl")
    lines = raw_lines(path)
    put_lines(path, [lines[0].replace(b'"deja/2"', b'"deja/99"'), *lines[1:]])
    with pytest.raises(UnsupportedFormat) as info:
        load(path, keyring=ring(KEY))
    message = str(info.value)
    assert "'deja/99'" in message
    assert "it reads deja/2, deja/1" in message


@pytest.mark.parametrize("content", [b"", b"hello, world\n", b"[1, 2, 3]\n",
                                     b'{"run": "r_1"}\n'],
                         ids=["empty", "not-json", "not-an-object", "no-format"])
def test_a_file_that_is_not_a_cassette_is_corrupt(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "run.jsonl"
    path.write_bytes(content)
    with pytest.raises(CorruptCassette) as info:
        load(path)
    assert type(info.value) is CorruptCassette
    assert "not a deja cassette" in str(info.value)


def test_a_missing_file_is_not_found_and_names_the_closest_files(tmp_path: Path) -> None:
    with pytest.raises(CassetteNotFound, match="holds no cassettes"):
        load(tmp_path / "nowhere.jsonl")
    write_cassette(tmp_path / "spiral.jsonl")
    write_cassette(tmp_path / "other.jsonl")
    (tmp_path / "spirals.jsonl").touch()  # an empty file: no cassette to suggest
    with pytest.raises(CassetteNotFound) as info:
        load(tmp_path / "spirl.jsonl")
    assert f"did you mean {tmp_path / 'spiral.jsonl'}?" in str(info.value)
    assert "other.jsonl" not in str(info.value)
    with pytest.raises(CassetteNotFound, match="does not exist"):
        load(tmp_path / "no-such-dir" / "run.jsonl")
    with pytest.raises(CassetteNotFound, match="is a directory"):
        load(tmp_path)


def test_a_line_that_is_not_json_names_its_seq(tmp_path: Path) -> None:
    path = write_cassette(tmp_path / "run.jsonl")
    lines = raw_lines(path)
    put_lines(path, [*lines[:3], b"{not json\n", *lines[4:]])
    with pytest.raises(CorruptCassette, match="seq 2") as info:
        load(path)
    assert info.value.seq == 2


# ---------------------------------------------------------------------------- keys


def test_first_use_creates_a_private_key_file_and_reuses_it(
        tmp_path: Path, deja_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEJA_KEY")
    key_file = deja_home / "key"
    assert not key_file.exists()

    with recorder.record(tmp_path / "one.jsonl"):
        recorder.uuid4()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_bytes().strip()
    assert len(key) >= 32

    with recorder.record(tmp_path / "two.jsonl"):
        recorder.uuid4()
    assert key_file.read_bytes().strip() == key  # reused, not replaced
    assert load_keyring().signing == key

    for name in ("one.jsonl", "two.jsonl"):
        path = tmp_path / name
        header = json.loads(raw_lines(path)[0])
        assert header["key_id"] == key_id(key)
        assert key not in path.read_bytes()  # the key itself never reaches the cassette
        assert key.decode() not in path.read_text()
        assert load(path, keyring=load_keyring(), require_signature=True).verified


def test_header_names_the_key_by_id_never_by_value(tmp_path: Path) -> None:
    path = write_cassette(tmp_path / "run.jsonl")
    header = json.loads(raw_lines(path)[0])
    assert header["key_id"] == key_id(KEY)
    assert header["key_id"].startswith("k_")
    assert KEY not in path.read_bytes()
    assert key_id(KEY) != key_id(b"another key")


@pytest.mark.parametrize("where", ["env", "file"])
def test_rotated_key_still_verifies_old_cassettes(
        tmp_path: Path, deja_home: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    monkeypatch.setenv("DEJA_KEY", "old-key-2024")
    path = tmp_path / "old.jsonl"
    with recorder.record(path):
        recorder.uuid4()

    monkeypatch.setenv("DEJA_KEY", "new-key-2025")
    with pytest.raises(UnverifiedCassette) as info:  # suspect: this machine has other keys
        load(path, keyring=load_keyring())
    assert key_id(b"old-key-2024") in str(info.value)
    assert key_id(b"new-key-2025") in str(info.value)

    if where == "env":
        monkeypatch.setenv("DEJA_OLD_KEYS", "older-key-2023, old-key-2024")
    else:
        (deja_home / "key.old").write_text("old-key-2024\n")
    keyring = load_keyring()
    assert keyring.signing == b"new-key-2025"  # new cassettes are signed with the new key
    cassette = load(path, keyring=keyring, require_signature=True)
    assert cassette.verified is True
    assert cassette.verify_note == f"verified with key {key_id(b'old-key-2024')}"


def test_a_cassette_signed_with_an_unknown_key_is_suspect(tmp_path: Path) -> None:
    path = write_cassette(tmp_path / "run.jsonl", key=b"a stranger's key")
    with pytest.raises(UnverifiedCassette, match="not one of this machine's keys"):
        load(path, keyring=load_keyring())
    cassette = load(path, keyring=load_keyring(), allow_unverified=True)
    assert cassette.verified is False
    assert key_id(b"a stranger's key") in cassette.verify_note
    with pytest.raises(UnverifiedCassette):
        load(path, keyring=load_keyring(), require_signature=True, allow_unverified=True)


def test_a_recording_signed_with_an_unknown_key_replays_only_when_allowed(
        tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with recorder.record(path, keyring=Keyring.of(b"a stranger's key")):
        recorded = recorder.uuid4()
    with pytest.raises(UnverifiedCassette):
        with replayer.replay(path):
            pass
    with replayer.replay(path, allow_unverified=True) as run:
        assert recorder.uuid4() == recorded
    assert run.result is not None
    assert run.result.identical and run.result.verified is False
    assert run.result.verify_note.startswith("NOT VERIFIED")
    assert "NOT VERIFIED" in run.result.report()
    with pytest.raises(UnverifiedCassette):
        with replayer.replay(path, require_signature=True, allow_unverified=True):
            pass


# ---------------------------------------------------------------------------- writer options


@pytest.mark.parametrize("policy", ["sync", "turn", "exit", recorder.Fsync.TURN])
def test_fsync_policies_are_accepted(tmp_path: Path, policy: str) -> None:
    path = write_cassette(tmp_path / "run.jsonl", fsync=policy)
    assert load(path, keyring=ring(KEY)).verified
    assert recorder.Fsync.parse(policy).value in ("sync", "turn", "exit")


def test_fsync_policy_decides_which_lines_are_forced_to_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_fsync = os.fsync
    counts: dict[tuple[str, str], int] = {}
    current: list[str] = []
    main = threading.get_ident()

    def counting_fsync(fd: int) -> None:  # counts by calling thread, then really syncs
        who = "call" if threading.get_ident() == main else "background"
        counts[current[0], who] = counts.get((current[0], who), 0) + 1
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    for policy in ("sync", "exit"):
        current[:] = [policy]
        write_cassette(tmp_path / f"{policy}.jsonl", n=6, fsync=policy)
    # 6 observations: 2 effects, 2 tools, 2 model turns; plus header and end
    assert counts == {("sync", "call"): 8, ("exit", "call"): 1}

    # "turn": a side effect and the end are forced on the caller's thread; the header and
    # a model line by the background group commit shortly after they are written, off the
    # agent's call.
    current[:] = ["turn"]
    writer = CassetteWriter(tmp_path / "turn.jsonl", {"run": "r_turn"}, KEY, "turn")
    writer.append({"kind": "effect", "name": "uuid", "value": "v"})
    writer.append({"kind": "model", "provider": "anthropic", "fp": "x",
                   "response": {"status": 200, "body": "a"}},
                  request_body={"model": MODEL, "messages": []}, has_request=True)
    deadline = time.monotonic() + 5
    while counts.get(("turn", "background"), 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert counts.get(("turn", "background"), 0) >= 1
    writer.append({"kind": "intent", "name": "pay", "args": {}, "fp": "y"})
    writer.close({"status": "completed"})
    assert counts[("turn", "call")] == 2  # intent, end


@pytest.mark.parametrize("policy", ["always", "", "SYNC", "never"])
def test_unknown_fsync_policy_is_a_config_error(tmp_path: Path, policy: str) -> None:
    with pytest.raises(ConfigError, match="valid: sync, turn, exit"):
        CassetteWriter(tmp_path / "run.jsonl", {}, KEY, policy)
    assert not (tmp_path / "run.jsonl").exists()
    with pytest.raises(ConfigError, match="valid: sync, turn, exit"):
        recorder.record(tmp_path / "run.jsonl", fsync=policy)


def test_writer_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    path = write_cassette(tmp_path / "run.jsonl")
    before = path.read_bytes()
    with pytest.raises(PathTaken, match="already exists"):
        CassetteWriter(path, {"run": "r_second"}, KEY)
    assert path.read_bytes() == before

    writer = CassetteWriter(path, {"run": "r_second"}, KEY, overwrite=True)
    writer.close({"status": "completed"})
    cassette = load(path, keyring=ring(KEY))
    assert cassette.run == "r_second" and len(cassette) == 0


def test_a_closed_writer_refuses_more_lines(tmp_path: Path) -> None:
    writer = CassetteWriter(tmp_path / "run.jsonl", {}, KEY)
    writer.close({"status": "completed"})
    with pytest.raises(SessionError, match="closed"):
        writer.append({"kind": "effect", "name": "x", "value": 1})


# ---------------------------------------------------------------------------- delta storage


def _converse(server_url: str, path: Path, turns: int) -> None:
    """A conversation of ``turns`` model calls, each resending all of the history."""
    padding = "lorem ipsum " * 16  # long messages make whole-body storage clearly quadratic
    client = new_client(server_url)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"turn 0 {padding}"}]
    with recorder.record(path):
        for i in range(turns):
            reply = client.messages.create(model=MODEL, max_tokens=64, messages=messages)
            messages = [*messages, {"role": "assistant", "content": reply.content[0].text},
                        {"role": "user", "content": f"turn {i + 1} {padding}"}]
    client.close()


def test_model_requests_are_stored_as_deltas(tmp_path: Path, stub: Any) -> None:
    script = {"default": {"text": "ok {echo}"}}
    long_server, short_server = stub(script), stub(script)
    long_path, short_path = tmp_path / "sixty.jsonl", tmp_path / "thirty.jsonl"
    _converse(long_server.url, long_path, 60)
    _converse(short_server.url, short_path, 30)

    # (a) after the first, each model line stores its base, the kept prefix and 2 messages
    model_lines = [line for line in map(json.loads, raw_lines(long_path)[1:])
                   if line["kind"] == "model"]
    assert len(model_lines) == 60
    assert "body" in model_lines[0]["request"]
    for turn, line in enumerate(model_lines[1:], start=1):
        stored = line["request"]
        assert "body" not in stored
        assert set(stored) == {"base", "keep", "messages"}
        assert stored["base"] == model_lines[turn - 1]["seq"]
        assert stored["keep"] == 2 * turn - 1
        assert [m["role"] for m in stored["messages"]] == ["assistant", "user"]

    # (b) every request decodes to exactly the body the server received
    cassette = load(long_path, keyring=ring(KEY), require_signature=True)
    received = [r["body"] for r in long_server.requests]
    assert len(received) == 60
    for line, body in zip(model_lines, received, strict=True):
        assert cassette.request_of(line["seq"]) == body
    assert len(received[-1]["messages"]) == 119

    # (c) linear growth: twice the turns, about twice the bytes (whole bodies: ~4x)
    long_size, short_size = long_path.stat().st_size, short_path.stat().st_size
    assert long_size < 2.6 * short_size
    whole = [len(json.dumps(b)) for b in received]  # what storing whole bodies would cost
    assert sum(whole) > 3.5 * sum(whole[:30])  # so the bound above does discriminate


def test_request_fields_that_change_are_stored_in_the_delta(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    writer = CassetteWriter(path, {}, KEY)
    first = {"model": MODEL, "max_tokens": 16, "tools": [{"name": "t"}],
             "messages": [{"role": "user", "content": "a"}]}
    second = {"model": MODEL, "max_tokens": 2048,
              "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    other = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "z"}]}
    for body in (first, other, second):
        writer.append({"kind": "model", "fp": "x"}, request_body=body, has_request=True)
    writer.close({"status": "completed"})
    stored = json.loads(raw_lines(path)[3])["request"]
    assert stored == {"base": 0, "keep": 1, "messages": [{"role": "user", "content": "b"}],
                      "set": {"max_tokens": 2048}, "unset": ["tools"]}
    cassette = load(path, keyring=ring(KEY))
    assert [cassette.request_of(s) for s in (0, 1, 2)] == [first, other, second]


# ---------------------------------------------------------------------------- values codec


@pytest.mark.parametrize("value", [
    b"\x00\xffbinary",
    bytearray(b"ab"),
    (1, "two", (3.5, None)),
    {"nested": [1, {"b": (b"x", True)}], "list": [(), []]},
    {"$bytes": "a dict that only looks tagged"},
    {"$tuple": [1]},
    float("inf"),
    float("-inf"),
    -0.5,
    "text",
    None,
], ids=lambda v: type(v).__name__)
def test_values_round_trip_through_json(value: Any) -> None:
    text = json.dumps(_values.encode(value), allow_nan=False)  # strict JSON on disk
    back = _values.decode(json.loads(text))
    expected = bytes(value) if isinstance(value, bytearray) else value
    assert back == expected
    assert type(back) is type(expected)


def test_nan_round_trips() -> None:
    text = json.dumps(_values.encode({"x": float("nan")}), allow_nan=False)
    back = _values.decode(json.loads(text))
    assert math.isnan(back["x"])


def test_nested_tuples_keep_their_type() -> None:
    back = _values.decode(json.loads(json.dumps(_values.encode({"k": [(1, (2, b"3"))]}))))
    assert back == {"k": [(1, (2, b"3"))]}
    assert type(back["k"][0][1]) is tuple and type(back["k"][0][1][1]) is bytes


@pytest.mark.parametrize("value", [object(), {"ok": [1, {2, 3}]}, {1: "int key"}])
def test_an_unrecordable_value_names_where(value: Any) -> None:
    with pytest.raises(UnserializableValue, match="result of tool 'lookup'"):
        _values.encode(value, where="result of tool 'lookup'")


def test_an_unrecordable_tool_result_fails_at_record_time(tmp_path: Path) -> None:
    class Handle:
        pass

    @recorder.tool
    def open_handle() -> Handle:
        return Handle()

    path = tmp_path / "run.jsonl"
    with pytest.raises(UnserializableValue, match=r"result of tool 'open_handle'.*Handle"):
        with recorder.record(path):
            open_handle()
    cassette = load(path, keyring=ring(KEY))
    assert cassette.end is not None and cassette.end["status"] == "error"
    assert cassette.end["error"]["type"] == "UnserializableValue"


def test_dict_key_order_survives_record_and_replay(tmp_path: Path) -> None:
    """Agents serialise tool results into their next prompt (``json.dumps(result)``): a
    replay must give back the keys in the recorded order, or that prompt diverges."""

    @recorder.tool
    def weather(city: str) -> dict[str, Any]:
        return {"zeta": city, "alpha": {"y": 2, "b": 3}, "mid": [{"k": 1, "c": 2}]}

    path = tmp_path / "run.jsonl"
    with recorder.record(path):
        recorded = json.dumps([weather("Paris"), recorder.value("cfg", {"b": 1, "a": 2})])
    with replayer.replay(path) as run:
        replayed = json.dumps([weather("Paris"), recorder.value("cfg", {"b": 1, "a": 2})])
    assert run.result is not None and run.result.identical
    assert replayed == recorded
    assert load(path, keyring=ring(KEY), require_signature=True).verified


# ---------------------------------------------------------------------------- golden cassettes
#
# tests/golden/v1_tool_agent.jsonl (format deja/1) and v2_tool_agent.jsonl (deja/2) were
# each recorded once, by tests/golden/make_golden.py. They are never re-recorded to make a
# test pass: they prove that a cassette written in each format keeps loading, verifying and
# replaying in later versions of deja. One variant of the agent must diverge from them, and
# is asserted to raise.
GOLDEN_FILES = pytest.mark.parametrize("name, version", [
    ("v1_tool_agent.jsonl", "deja/1"), ("v2_tool_agent.jsonl", "deja/2")])



@GOLDEN_FILES
def test_golden_cassette_loads_and_verifies(name: str, version: str) -> None:
    path = GOLDEN / name
    assert raw_lines(path)[0].startswith(b'{"format":"%s"' % version.encode())
    cassette = load(path, keyring=ring(GOLDEN_KEY), require_signature=True,
                    allow_incomplete=False)
    assert cassette.verified is True
    assert [o["kind"] for o in cassette] == ["effect", "model", "tool", "model"]
    assert cassette.end is not None and cassette.end["status"] == "completed"
    tool = cassette.observations[2]
    assert tool["name"] == "get_weather" and tool["args"] == {"city": "Paris"}
    with pytest.raises(UnverifiedCassette):  # signed with the golden key, not this test's
        load(path, keyring=load_keyring(), require_signature=True)


@GOLDEN_FILES
def test_golden_cassette_replays_identically_offline(
        name: str, version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_KEY", GOLDEN_KEY)
    agent = golden_agent()
    with replayer.replay(GOLDEN / name, require_signature=True) as run:
        answer = agent.agent(CLOSED_PORT_URL)
    assert answer == "It is 18 degrees and clear in Paris."
    result = run.result
    assert result is not None
    assert result.identical and result.verified
    assert result.steps_served == result.steps_recorded == 4
    assert result.recorded_status == "completed"


@GOLDEN_FILES
def test_golden_variant_with_another_prompt_diverges(
        name: str, version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEJA_KEY", GOLDEN_KEY)
    agent = golden_agent()
    path = GOLDEN / name
    first_model_step = next(o["seq"] for o in load(path) if o["kind"] == "model")
    with pytest.raises(recorder.Divergence) as info:
        with replayer.replay(path):
            agent.agent_changed_prompt(CLOSED_PORT_URL)
    assert info.value.step == first_model_step
    assert "Rome" in info.value.diff and "Paris" in info.value.diff
    assert "+" in info.value.diff and "-" in info.value.diff
    assert str(path) in str(info.value)
