"""No object that holds a signing key shows it: reprs, str, f-strings and tracebacks.

Keys are ``SecretKey`` bytes whose ``repr`` and ``str`` are ``<key k_...>``; a ``Keyring``
shows key ids. The decisive check is a real pytest run with ``--showlocals`` whose
failures have keys, keyrings, writers, sessions and fork plans among their locals, in
test frames and deep inside deja's own: the key text appears nowhere in its output.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import pytest

import recorder
import replayer
from recorder.cassette import CassetteWriter, sign
from recorder.cassette.keys import Keyring, SecretKey, key_id, load_keyring

KEY = "test-key-0123456789abcdef"  # conftest's DEJA_KEY


def _forms(key: str) -> list[str]:
    raw = key.encode()
    return [key, repr(raw), raw.hex()]


def test_keys_and_keyrings_show_ids_only(tmp_path: Path) -> None:
    ring = load_keyring()
    key = ring.signing
    assert isinstance(key, SecretKey) and key == KEY.encode()
    kid = key_id(key)
    for shown in (repr(key), str(key), f"{key}", "%s" % key, repr([key]), repr(ring),  # noqa: UP031
                  str(ring), repr(Keyring.of("another-key", KEY))):
        assert not any(form in shown for form in _forms(KEY)), shown
    assert repr(key) == f"<key {kid}>" and kid in repr(ring)
    # Still bytes for everything that uses a key.
    assert hmac.digest(key, b"m", hashlib.sha256) == hmac.digest(KEY.encode(), b"m",
                                                                   hashlib.sha256)
    assert sign(key, "", {"a": 1}) == sign(KEY.encode(), "", {"a": 1})
    writer = CassetteWriter(tmp_path / "w.jsonl", {"run": "r_w"}, key)
    with recorder.record(tmp_path / "r.jsonl") as rec:
        recorder.value("x", lambda: 1)
    plan = replayer.plan_fork(tmp_path / "r.jsonl", 0, sets=["/value=2"])
    for obj in (writer, rec, plan, plan.parent):
        assert not any(form in repr(obj) for form in _forms(KEY)), type(obj)


def test_a_showlocals_traceback_shows_no_key(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner='''
        import recorder, replayer
        from recorder.cassette import CassetteWriter
        from recorder.cassette.keys import load_keyring

        def test_key_in_the_test_frame(tmp_path):
            ring = load_keyring()
            key = ring.signing
            writer = CassetteWriter(tmp_path / "c.jsonl", {"run": "r_1"}, key)
            assert writer is None

        def test_key_in_deja_frames(tmp_path):
            ring = load_keyring()
            (tmp_path / "c.jsonl").write_text("taken")
            CassetteWriter(tmp_path / "c.jsonl", {"run": "r_2"}, ring.signing)

        def test_sessions_and_plans(tmp_path):
            with recorder.record(tmp_path / "r.jsonl", keyring=load_keyring()) as rec:
                recorder.value("x", lambda: 1)
            plan = replayer.plan_fork(tmp_path / "r.jsonl", 0, sets=["/value=2"],
                                              keyring=load_keyring())
            assert (rec, plan) is None
    ''')
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    result = pytester.runpytest_inprocess("--showlocals", "--tb=long", "-p",
                                          "no:cacheprovider")
    result.assert_outcomes(failed=3)
    out = result.stdout.str() + result.stderr.str()
    assert "<key k_" in out and "Keyring(signing=k_" in out  # the locals were shown
    for form in _forms(KEY):
        assert form not in out, form
