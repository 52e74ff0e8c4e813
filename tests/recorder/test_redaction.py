"""Secrets never reach disk: the redaction rules, status records and the index.

The scan of everything deja writes is ``tests/recorder/test_secret_scan.py``.
"""

from __future__ import annotations

import base64
import gzip
import json
import logging
import random
import stat
import string
import sys
from pathlib import Path
from typing import Any

import anthropic
import pytest
from click.testing import CliRunner
from conftest import API_KEY, MODEL

import recorder
import replayer
from deja.cli import main
from recorder.canonical import fingerprint
from recorder.capture._secrets import _NAME_WORDS, _Scanner
from recorder.capture.exchange import classify
from recorder.capture.redact import REDACTED, RULES, Redaction
from recorder.cassette import load
from recorder.errors import ConfigError
from recorder.harness.progress import Progress, request_cancel, runs_dir, status_path
from recorder.harness.settings import resolve as resolve_settings
from viewer.index import RunIndex, index_path

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "tests" / "secret_agent.py"
USER = [{"role": "user", "content": "hi"}]


# ------------------------------------------------------------------------ the rules


def _rand(rng: random.Random, n: int, alphabet: str = string.ascii_letters + string.digits
          ) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


SHAPES = {
    "anthropic": "sk-ant-api03-" + "Ab9" * 10,
    "openai": "sk-proj-" + "Zq7Xw2" * 5,
    "openai_legacy": "sk-" + "T3BlbkFJ" * 4,
    "aws_key_id": "AKIAIOSFODNN7EXAMPLE",
    "aws_session_key_id": "ASIAY34FZKBOKMUTVV7A",
    "github": "ghp_" + "a1B2c3D4e5" * 4,
    "github_oauth": "gho_" + "Q9w8E7r6T5" * 4,
    "github_pat": "github_pat_11ABCDEFG0" + "x1Y2z3" * 8,
    "google": "AIzaSyD-" + "9tSrke72" * 4 + "abc",
    "slack": "xoxb-123456789012-1234567890123-" + "AbCdEfGh" * 3,
    "stripe": "sk_live_" + "51HqZ2" * 5,
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9Pl",
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_secret_shapes_are_found_anywhere(name: str) -> None:
    secret = SHAPES[name]
    r = Redaction()
    for text in (secret, f"key: {secret}.", f'{{"v": "{secret}"}}', f"a\\n{secret}\\n",
                 f"x={secret}&y=1", f"({secret})"):
        out = r.text(text)
        assert secret not in out, (text, out)
        assert REDACTED in out
        assert r.text(out) == out  # idempotent
        assert r.data(text.encode()) == out.encode()  # bytes and text agree


def test_named_values_userinfo_and_prefixes_kept() -> None:
    r = Redaction()
    cases = {
        "https://user:hunter2@db.example/x": "https://%5Bredacted%5D@db.example/x",
        "https://api.example/v1?key=abc123&lang=en": "https://api.example/v1?key=[redacted]&lang=en",
        "https://s3.example/o?X-Amz-Signature=f00d&X-Amz-Credential=AK%2F1":
            "https://s3.example/o?X-Amz-Signature=[redacted]&X-Amz-Credential=[redacted]",
        "grant_type=password&password=hunter2": "grant_type=password&password=[redacted]",
        "password=hunter2&user=ada": "password=[redacted]&user=ada",
        "Authorization: Bearer abc123def456ghi789": "Authorization: Bearer [redacted]",
        "aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY":
            "aws_secret_access_key = [redacted]",
        '{"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}':
            '{"AWS_SECRET_ACCESS_KEY": "[redacted]"}',
        "-----BEGIN RSA PRIVATE KEY-----\\nMIIEow\\n-----END RSA PRIVATE KEY-----": "[redacted]",
    }
    for text, expected in cases.items():
        assert r.text(text) == expected
    # Prose and identifiers that merely look alike are left alone.
    for text in ("Bearer authentication is common", "the task-force-multiplier-subsystem",
                 "sorted(items, key=len)", "monkey=3", "https://example.com/a@b",
                 "ASIA is a continent", "max_tokens=1024"):
        assert r.text(text) == text


def test_redacting_json_text_keeps_it_valid_json() -> None:
    rng = random.Random(7)
    secrets = [*SHAPES.values(), "https://u:p@h/x", "?token=abc", "Bearer abcdefgh12345678"]
    r = Redaction()
    for _ in range(300):
        doc: Any = {"messages": [{"role": "user", "content": " ".join(
            rng.choice([*secrets, "word", "\n", '"q"', "\\", "é", "tab\t"])
            for _ in range(rng.randint(1, 12)))} for _ in range(rng.randint(1, 4))]}
        for text in (json.dumps(doc), json.dumps(doc, ensure_ascii=False),
                     json.dumps(json.dumps(doc))):  # JSON inside a JSON string, escaped twice
            out = r.data(text.encode()).decode()
            json.loads(out)
            assert r.data(out.encode()).decode() == out
            assert not any(s in out for s in SHAPES.values())


def test_a_body_that_extends_an_earlier_one_is_redacted_as_a_full_scan_would() -> None:
    """The scanner reuses what it found in the prefix a body shares with a recent one."""
    rng = random.Random(11)
    words = ["the", "token", "x-y", "max_tokens", "a_b", "Bearer", "https://u:p@h", "?key=v",
             "&sig=s", '\\"', *SHAPES.values()]
    full = _Scanner(Redaction().query)
    for trial in range(150):
        scanner = _Scanner(Redaction().query)
        msgs = [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(40))}
                for _ in range(rng.randint(10, 60))]
        for _turn in range(4):
            body = json.dumps({"max_tokens": 9, "messages": msgs, "model": MODEL}).encode()
            expected = full.data(body)  # every pass, from the start
            assert scanner.data(body, remember=True) == expected, trial
            choice = rng.random()
            if choice < 0.6:  # the conversation grows
                msgs = [*msgs, {"role": "assistant", "content": rng.choice(words) * 3}]
            elif choice < 0.85:  # an earlier message changes
                i = rng.randrange(len(msgs))
                msgs = [*msgs[:i], {"role": "user", "content": rng.choice(words)}, *msgs[i + 1:]]
            else:  # it is cut back
                msgs = msgs[:rng.randrange(1, len(msgs) + 1)]


def test_configured_patterns_query_names_and_body_paths() -> None:
    r = Redaction.of(patterns=[r"corp-[0-9a-f]{8}", r"tenant=(\w+)"], query=["session_ref"],
                     body_paths=["/metadata/user_id"], headers=["X-Tenant"])
    assert r.text("id corp-deadbeef!") == "id [redacted]!"
    assert r.text("tenant=acme42 rest") == "tenant=[redacted] rest"  # only the group
    assert r.text("/x?session_ref=abc&y=2") == "/x?session_ref=[redacted]&y=2"
    assert r.body({"metadata": {"user_id": "u-1"}, "x": 1}) == {
        "metadata": {"user_id": REDACTED}, "x": 1}
    assert r.header_pairs([("x-tenant", "t"), ("accept", "*/*")]) == [
        ["x-tenant", REDACTED], ["accept", "*/*"]]
    header = r.to_header()
    assert header == {"headers": ["x-tenant"], "body_paths": ["/metadata/user_id"],
                      "patterns": ["corp-[0-9a-f]{8}", r"tenant=(\w+)"],
                      "query": ["session_ref"], "rules": RULES}
    assert Redaction.from_header(header) == r
    # A header from before the built-in shapes: only secret headers are redacted.
    old = Redaction.from_header({"headers": [], "body_paths": []})
    assert old.rules == 0 and old.text(SHAPES["github"]) == SHAPES["github"]
    for bad in ([r"("], [""], [3]):
        with pytest.raises(ConfigError, match="redact pattern"):
            Redaction.of(patterns=bad)
    with pytest.raises(ConfigError, match="JSON pointer"):
        Redaction.of(body_paths=["metadata.user_id"])
    with pytest.raises(ConfigError, match="not known to this deja"):
        Redaction.from_header({"rules": RULES + 1})


def test_argv_options_named_like_secrets() -> None:
    r = Redaction()
    assert r.argv(["python", "agent.py", "--api-key", "plain1", "--token=plain2",
                   "--max-tokens", "100", "DB_PASSWORD=plain3", "--github-token", "plain4",
                   "--auth", "u:p", "--token-file", "t.txt", SHAPES["anthropic"]]) == [
        "python", "agent.py", "--api-key", REDACTED, f"--token={REDACTED}", "--max-tokens",
        "100", f"DB_PASSWORD={REDACTED}", "--github-token", REDACTED, "--auth", REDACTED,
        "--token-file", "t.txt", "sk-[redacted]"]


def test_values_tools_see_are_redacted_keys_and_bytes_included() -> None:
    r = Redaction()
    value = {"k": [SHAPES["github"], {"$bytes": base64.b64encode(
        f"raw {SHAPES['slack']} bytes".encode()).decode()}], SHAPES["jwt"]: 1}
    out = r.value(value)
    assert SHAPES["github"] not in json.dumps(out) and SHAPES["jwt"] not in json.dumps(out)
    assert SHAPES["slack"].encode() not in base64.b64decode(out["k"][1]["$bytes"])
    untouched = {"a": [1, 2.5, "plain"], "b": None}
    assert r.value(untouched) is untouched


def _sse(pieces: list[str]) -> bytes:
    events = [("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": MODEL,
        "stop_reason": None, "usage": {"input_tokens": 1, "output_tokens": 1}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}})]
    events += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": p}})
               for p in pieces]
    events += [("content_block_stop", {"type": "content_block_stop", "index": 0}),
               ("message_stop", {"type": "message_stop"})]
    return "".join(f"event: {n}\ndata: {json.dumps(d, separators=(',', ':'))}\n\n"
                   for n, d in events).encode()


def test_a_secret_streamed_in_pieces_is_taken_out_of_every_piece() -> None:
    from recorder.providers._anthropic_sse import assemble

    secret = SHAPES["anthropic"]
    pieces = ["Your key is ", secret[:5], secret[5:9], secret[9:20], secret[20:] + " ok", "."]
    body = _sse(pieces)
    headers = [("content-type", "text/event-stream"), ("content-length", str(len(body)))]
    stored, fixed = Redaction().response_body(body, headers)
    assert secret[:9].encode() not in stored and secret[9:20].encode() not in stored
    text = assemble(stored.decode())["content"][0]["text"]
    assert text == "Your key is sk-[redacted] ok."
    assert dict(fixed)["content-length"] == str(len(stored))


def test_gzip_bodies_are_redacted_decoded_and_stored_encoded() -> None:
    secret = SHAPES["github"]
    body = gzip.compress(json.dumps({"token": secret}).encode())
    stored, headers = Redaction().response_body(
        body, [("content-encoding", "gzip"), ("content-length", str(len(body)))])
    assert json.loads(gzip.decompress(stored)) == {"token": "[redacted]"}  # by its name
    assert dict(headers)["content-length"] == str(len(stored))
    plain = gzip.compress(b'{"nothing": "secret"}')
    assert Redaction().response_body(plain, [("content-encoding", "gzip")])[0] is plain


def test_recording_and_replay_fingerprint_the_same_redacted_request() -> None:
    r = Redaction()
    a = json.dumps({"model": MODEL, "messages": [{"role": "user",
                                                  "content": f"{SHAPES['openai']}"}]}).encode()
    b = json.dumps({"model": MODEL, "messages": [{"role": "user",
                                                  "content": "sk-[redacted]"}]}).encode()
    kind, _, body = classify("POST", "http://h/v1/messages?key=k1", a, r)
    assert kind == "model" and SHAPES["openai"] not in json.dumps(body)
    other = classify("POST", "http://h/v1/messages", b, r)[2]
    assert fingerprint("model", "POST", "/v1/messages", body) == fingerprint(
        "model", "POST", "/v1/messages", other)


# ------------------------------------------------------- rules from every entry point


def test_pyproject_redact_table_is_checked(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pyproject = tmp_path / "pyproject.toml"
    monkeypatch.setenv("DEJA_CONFIG", str(pyproject))
    pyproject.write_text('[tool.deja.redact]\nheaders = ["x-a"]\nbody_paths = ["/m/u"]\n'
                         'patterns = ["p-[0-9]+"]\nquery = ["sess"]\n')
    rules = resolve_settings(redact_patterns=["q-[0-9]+"]).redaction
    assert rules.to_header()["patterns"] == ["p-[0-9]+", "q-[0-9]+"]  # both apply
    assert rules.to_header()["headers"] == ["x-a"] and rules.body_paths == ("/m/u",)
    bad = {'patterns = ["("]': "redact.patterns: redact pattern '\\('",
           'patterns = "x"': "redact.patterns must be a list",
           'body_paths = ["m/u"]': "redact.body_paths",
           'colour = ["red"]': "unknown key"}
    for line, message in bad.items():
        pyproject.write_text(f"[tool.deja.redact]\n{line}\n")
        with pytest.raises(ConfigError, match=message) as info:
            recorder.record(tmp_path / "never.jsonl")
        assert str(pyproject) in str(info.value)
    assert not (tmp_path / "never.jsonl").exists()


def test_a_bad_pattern_stops_deja_record_before_the_program_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    result = CliRunner().invoke(main, ["record", "-o", str(tmp_path / "c.jsonl"),
                                       "--redact-pattern", "(unclosed", "--", sys.executable,
                                       "-c", f"open({str(marker)!r}, 'w')"])
    assert result.exit_code == 2, result.output
    assert "not a valid regular expression" in result.output
    assert not marker.exists() and not (tmp_path / "c.jsonl").exists()


def test_a_replay_applies_the_rules_the_recording_used(stub, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The header carries the rules; the replaying machine's own settings do not matter."""
    server = stub({"turns": [{"text": "ok"}]})
    path = tmp_path / "rules.jsonl"

    def agent(secret: str) -> str:
        with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as c:
            return c.messages.create(model=MODEL, max_tokens=8, messages=[
                {"role": "user", "content": f"order {secret}"}]).content[0].text

    with recorder.record(path, redact_patterns=(r"ord-[0-9]{6}",)):
        agent("ord-123456")
    assert "ord-123456" not in path.read_text()
    assert load(path).header["redact"]["patterns"] == [r"ord-[0-9]{6}"]
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[tool.deja.redact]\npatterns = ["order"]\n')
    monkeypatch.setenv("DEJA_CONFIG", str(pyproject))  # would change the body if applied
    with replayer.replay(path) as run:
        # another order number redacts to the same request, so it is served
        assert agent("ord-654321") == "ok"
    assert run.result is not None and run.result.identical
    with pytest.raises(recorder.Divergence):
        with replayer.replay(path):
            agent("ord-12345")  # not the shape: a different request


def test_an_echoed_secret_replays_with_a_consistent_content_length(stub,
                                                                   tmp_path: Path) -> None:
    secret = SHAPES["openai"]
    server = stub({"turns": [{"text": "You said: {echo}"}]})
    path = tmp_path / "echo.jsonl"

    def agent() -> str:
        with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as c:
            return c.messages.create(model=MODEL, max_tokens=64, messages=[
                {"role": "user", "content": f"repeat {secret}"}]).content[0].text

    with recorder.record(path):
        assert secret in agent()
    server.stop()
    (obs,) = load(path).observations
    headers = dict(obs["response"]["headers"])
    assert int(headers["content-length"]) == len(obs["response"]["body"].encode())
    with replayer.replay(path) as run:
        assert agent() == "You said: repeat sk-[redacted]"
    assert run.result is not None and run.result.identical


# ------------------------------------------------------------------ status records


def test_status_records_and_cancel_flags_are_private(stub, tmp_path: Path) -> None:
    server = stub({"turns": [{"text": "ok"}]})
    with recorder.record(tmp_path / "p.jsonl") as rec:
        with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0) as c:
            c.messages.create(model=MODEL, max_tokens=8, messages=USER)
        flag = request_cancel(rec.run_id, f"stop, key {SHAPES['github']}")
    assert stat.S_IMODE(runs_dir().stat().st_mode) == 0o700
    for path in (status_path(rec.run_id), flag):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert SHAPES["github"] not in flag.read_text()
    assert [p.name for p in runs_dir().iterdir() if p.name.endswith(".tmp")] == []


def test_an_unwritable_deja_home_does_not_stop_a_run(stub, tmp_path: Path, deja_home: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """``runs`` is a file where a folder should be: no status record can be written (what a
    read-only or full DEJA_HOME amounts to); the run and its cassette go on regardless."""
    (deja_home / "runs").write_text("not a folder")
    server = stub({"turns": [{"text": "one"}, {"text": "two"}]})
    path = tmp_path / "ro.jsonl"
    with caplog.at_level(logging.WARNING, logger="deja.recorder"):
        with recorder.record(path):
            with anthropic.Anthropic(base_url=server.url, api_key=API_KEY,
                                     max_retries=0) as c:
                texts = [c.messages.create(model=MODEL, max_tokens=8, messages=USER)
                         .content[0].text for _ in range(2)]
    assert texts == ["one", "two"]
    cassette = load(path, allow_incomplete=False)
    assert cassette.end is not None and cassette.end["status"] == "completed"
    warnings = [r for r in caplog.records if "status record" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_a_status_record_that_cannot_be_replaced_is_skipped(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    status_path("r_blocked").mkdir(parents=True)  # writing it fails
    with caplog.at_level(logging.WARNING, logger="deja.recorder"):
        progress = Progress("r_blocked", {}, interval=0)
        progress.update(step="one", force=True)
        progress.update(step="two", force=True)
    assert len([r for r in caplog.records if "r_blocked" in r.getMessage()]) == 1
    assert list(runs_dir().glob("*.tmp")) == []


def test_deja_cancel_says_why_when_the_flag_cannot_be_written() -> None:
    Progress("r_stuck", {})
    (runs_dir() / "r_stuck.cancel").mkdir()  # the flag's place is taken
    result = CliRunner().invoke(main, ["cancel", "r_stuck"])
    assert result.exit_code == 2
    assert "cannot ask run r_stuck to stop" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(ConfigError, match="DEJA_HOME"):
        request_cancel("r_stuck")


# ------------------------------------------------------------------- the index


def _index_bytes(folder: Path) -> bytes:
    db = index_path(folder)
    return b"".join(p.read_bytes() for p in db.parent.iterdir()
                    if p.is_file() and p.name.startswith(db.name))


def test_the_index_forgets_what_its_cassettes_forget(tmp_path: Path) -> None:
    folder = tmp_path / "runs"

    def run(name: str, word: str, n: int = 30, force: bool = False) -> None:
        with recorder.record(folder / name, overwrite=force):
            for _ in range(n):
                recorder.value("note", lambda: f"{word} " * 20)

    run("gone.jsonl", "FORGOTTENWORD")
    run("kept.jsonl", "KEPTWORD")
    run("rewritten.jsonl", "OLDWORD")
    with RunIndex(folder) as index:
        assert index.refresh()["compacted"] == 0
    assert stat.S_IMODE(index_path(folder).stat().st_mode) == 0o600
    data = _index_bytes(folder)
    assert b"FORGOTTENWORD" in data and b"OLDWORD" in data

    (folder / "gone.jsonl").unlink()
    run("rewritten.jsonl", "NEWWORD", n=5, force=True)
    with RunIndex(folder) as index:
        stats = index.refresh()
        assert stats["removed"] == 1 and stats["compacted"] == 1
        assert {r["path"].rsplit("/", 1)[1] for r in index.runs()} == {"kept.jsonl",
                                                                      "rewritten.jsonl"}
    data = _index_bytes(folder)
    assert b"FORGOTTENWORD" not in data and b"OLDWORD" not in data
    assert b"KEPTWORD" in data and b"NEWWORD" in data
    assert stat.S_IMODE(index_path(folder).stat().st_mode) == 0o600

    # A file that grows (a live run) is re-read without compacting: nothing is forgotten.
    path = folder / "live.jsonl"
    rec = recorder.start(path)
    recorder.value("note", lambda: "first")
    with RunIndex(folder) as index:
        index.refresh()
        recorder.value("note", lambda: "second")
        rec.close()
        stats = index.refresh()
    assert stats["indexed"] == 1 and stats["compacted"] == 0


def test_a_bearer_token_is_redacted_whatever_the_case() -> None:
    from recorder.capture.redact import DEFAULT

    text = "auth: bearer abcdefghijklmnopqrstuvwxyz0123 / Bearer ZYXWVUTSRQPONMLKJIHGFEDCBA98"
    out = DEFAULT.text(text)
    assert "abcdefghijklmnopqrstuvwxyz0123" not in out and "ZYXWVUTSRQPONMLKJIHGFEDCBA98" not in out
    assert out == "auth: bearer [redacted] / Bearer [redacted]"


# ------------------------------------------------------------------- rules 2


def test_values_named_like_secrets_in_any_case_style() -> None:
    r = Redaction()
    cases = {
        '{"SecretAccessKey": "wJalrXUtnFEMIK7MDENG"}': '{"SecretAccessKey": "[redacted]"}',
        '{"password": "hunter2"}': '{"password": "[redacted]"}',
        '{"client_secret":"two words"}': '{"client_secret":"[redacted]"}',
        '{"token": "tok_abcdefgh1234"}': '{"token": "[redacted]"}',
        '{"accessToken": "abc"}': '{"accessToken": "[redacted]"}',
        '{"API_KEY": "abc"}': '{"API_KEY": "[redacted]"}',
        "{'password': 'hunter2'}": "{'password': '[redacted]'}",
        '"{\\"apiKey\\": \\"abc\\"}"': '"{\\"apiKey\\": \\"[redacted]\\"}"',
        "login failed: password=S3cretpw!": "login failed: password=[redacted]",
        "PGPASSWORD=abc123 psql": "PGPASSWORD=[redacted] psql",
        'password = "hunter2"': 'password = "[redacted]"',
        "Authorization: Basic dXNlcjpwYXNz": "Authorization: Basic [redacted]",
        "?access_key=abcd&x=1": "?access_key=[redacted]&x=1",
        "xapp-1-A0123456789-1234567890123-abcdef01": "xapp-[redacted]",
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2": "whsec_[redacted]",
        "ya29.a0AfH6SMBx1234567890abcdefghij": "ya29.[redacted]",
        "hf_abcdefghijklmnopqrstuvwxyzABCDEFGH": "hf_[redacted]",
        "npm_abcdefghijklmnopqrstuvwxyzABCDEFGH12": "npm_[redacted]",
    }
    for text, expected in cases.items():
        assert r.text(text) == expected, text
        assert r.text(expected) == expected  # idempotent
        assert r.data(text.encode()) == expected.encode()
    # Usage counts, tokenizer settings, page cursors, code and prose are left alone.
    for text in ('{"max_tokens": 1024, "input_tokens": 5, "output_tokens": 7}',
                 '{"token_limit": 4, "tokens": "abcdefghij"}', '{"token": "Hello"}',
                 '{"eos_token": "<|endoftext|>", "next_page_token": "abcdefghijklmnop"}',
                 '{"password": null, "signature": "EqQBCkYIBxgCKkB"}',
                 "def f(password: str, token: str) -> None:", "token = get_token()",
                 "the secret: practice.", "Basic Instructions", "the max token: 4096",
                 '{"key": "value", "monkey": "abcdef123"}'):
        assert r.text(text) == text, text
    # A cassette recorded with rules 1 is matched (and continued) by rules 1.
    old = Redaction.from_header({"rules": 1})
    assert old.text('{"password": "hunter2"}') == '{"password": "hunter2"}'
    assert "access_key" not in old.query and old.to_header()["query"] == []


def test_every_name_of_a_secret_is_found_in_every_case_and_form() -> None:
    """The second pass looks at a separator only when the letters before it can end one of
    these names: each is found, in any case, however it is quoted or separated."""
    r = Redaction()
    value = "abcDEF123456ghiJKL"
    quoted = ('{"%s": "%s"}', "{'%s': '%s'}", '"{\\"%s\\": \\"%s\\"}"', '%s = "%s"')
    for word in _NAME_WORDS:
        name = "api_key" if word == "key" else word  # a bare key is no secret's name
        # a cookie's value is read as a header's: name=value pairs, or quoted in JSON
        forms = quoted if word == "cookie" else (*quoted, "%s=%s", "%s: %s")
        for spelled in (name, name.upper(), name.capitalize()):
            for form in forms:
                text = form % (spelled, value)
                assert value not in r.text(text), text
                assert value.encode() not in r.data(text.encode()), text


def test_dash_p_is_a_password_when_it_looks_like_one() -> None:
    assert Redaction().argv(["mysql", "-u", "root", "-p", "hunt3r22", "-pS3cretx9", "-p",
                             "8080:80", "-p", "no:cacheprovider", "-p", "4", "ssh", "-p",
                             "22"]) == [
        "mysql", "-u", "root", "-p", REDACTED, f"-p{REDACTED}", "-p", "8080:80", "-p",
        "no:cacheprovider", "-p", "4", "ssh", "-p", "22"]


def _chat(pieces: list[str]) -> bytes:
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o"}
    chunks = [{**head, "choices": [{"index": 0, "delta": {"content": p}}]} for p in pieces]
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def test_an_openai_chat_stream_in_three_character_pieces() -> None:
    from recorder.providers import get

    secret = SHAPES["openai"]
    text = f"key {secret} and {{\"password\": \"hunter2xyz\"}} ok"
    body = _chat([text[i:i + 3] for i in range(0, len(text), 3)])
    stored, _ = Redaction().response_body(body, [("content-type", "text/event-stream")])
    said = get("openai").assemble(stored.decode())["choices"][0]["message"]["content"]
    assert said == 'key sk-[redacted] and {"password": "[redacted]"} ok'
    assert b"hunter2" not in stored and secret[3:9].encode() not in stored


def test_redaction_time_grows_linearly() -> None:
    """Long runs around every rule's anchor: no input makes a rule backtrack without end."""
    import time

    def took(make: Any) -> float:
        r = Redaction()
        best = float("inf")
        for _ in range(3):
            data = make(200_000)
            start = time.perf_counter()
            r.data(data)
            best = min(best, time.perf_counter() - start)
        return best

    for make in (lambda n: b'"token": "' + b"a" * n, lambda n: b"a=" * (n // 2),
                 lambda n: b"password" + b":" * n, lambda n: b"Basic " + b"QUFB" * (n // 4),
                 lambda n: b'{"password": "' + b"\\\\" * (n // 2), lambda n: b"ya29." * (n // 5)):
        assert took(make) < 3.0  # ~0.1 s here; a quadratic rule takes minutes
