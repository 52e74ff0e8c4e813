"""A replay parses its lines and writes JSON bodies back, and a recording reads response
bodies, with orjson where that gives exactly what the standard library gives
(``recorder._fastjson``): these tests hold that claim against the orjson installed, over
every character, integers and floats of every magnitude, and the inputs orjson refuses or
reads its own way; then end to end, a body holding floats in the one form the two write
apart is recorded and served byte for byte as the stub sent it."""

from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import MODEL
from record_replay_helpers import sync_client

import recorder
import replayer
from recorder import _fastjson
from recorder.cassette import compact, load


def _floats(n: int, seed: int) -> list[float]:
    """Floats from random bit patterns (every magnitude) and decimals as an API writes
    them (a few digits, scaled by 1e-12 .. 1e20)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        f = struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        if f == f and abs(f) != float("inf"):
            out.append(f)
        out.append(round(rng.uniform(-1000, 1000), rng.randint(0, 9))
                   * 10.0 ** rng.randint(-12, 20))
    return out


def test_every_character_is_written_as_the_standard_library_writes_it() -> None:
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for block in range(0, len(chars), 4096):  # an escape depends on its character alone
        text = "".join(chars[block:block + 4096])
        assert _fastjson.dumps_compact_fast(text) == _fastjson.dumps_compact(text)
    doc = {"k\u2028": ["\x00\x1f\x7f\"\\/", "é😀", 2**63, -2**63, 0, True, None]}
    assert _fastjson.dumps_compact_fast(doc) == _fastjson.dumps_compact(doc)


def test_a_float_is_written_alike_unless_its_bytes_say_e_0() -> None:
    apart = 0
    for f in _floats(200_000, seed=7):
        text = _fastjson.dumps_compact(f)
        if _fastjson.exact_for(text.encode()):
            assert _fastjson.dumps_compact_fast(f) == text, text
        elif _fastjson.dumps_compact_fast(f) != text:
            apart += 1
    assert apart > 1000  # the guard is needed: those floats are written apart
    for f in (1e-05, 2.5e-07, 9.99e-09):
        assert not _fastjson.exact_for(_fastjson.dumps_compact({"p": f}).encode())
    for f in (1e-10, 5e-324, 1e+16, 1.7976931348623157e+308, -0.0, 0.0001, 123456.5):
        assert _fastjson.dumps_compact_fast([f]) == _fastjson.dumps_compact([f])


def test_an_integer_beyond_64_bits_is_written_by_the_standard_library() -> None:
    doc = {"n": 2**70, "m": -(2**65)}
    assert _fastjson.dumps_compact_fast(doc) == '{"n":1180591620717411303424,' \
                                                '"m":-36893488147419103232}'


def _same(a: Any, b: Any) -> bool:
    """Equal values of equal types (1 is not 1.0, -0.0 is not 0.0), keys in order."""
    return repr(a) == repr(b)


def _docs(n: int, seed: int, *, with_floats: bool = True) -> list[dict[str, Any]]:
    """Documents as JSON parsing gives them: integers of 1 to 80 bits, strings from every
    plane, nesting, ``null``; floats of every magnitude unless ``with_floats`` is off."""
    rng = random.Random(seed)
    floats = _floats(n * 10, seed=seed + 1) if with_floats else []
    return [{"seq": i, "f": floats[i * 10:i * 10 + 10],
             "int": rng.getrandbits(rng.randint(1, 80 if with_floats else 62))
             * rng.choice((1, -1)),
             "s": "".join(chr(rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xD7FF),
                                          rng.randint(0xE000, 0x10FFFF)]))
                          for _ in range(20)),
             "nested": {"a": [{"b": None, "c": False}], "a2": -0.0 if with_floats else 0,
                        "dup": 1}}
            for i in range(n)]


def test_a_line_is_parsed_as_the_standard_library_parses_it() -> None:
    for doc in _docs(2_000, seed=3):
        for text in (json.dumps(doc), json.dumps(doc, ensure_ascii=False),
                     _fastjson.dumps_compact(doc)):
            assert _same(_fastjson.loads(text.encode()), json.loads(text))
            assert _same(_fastjson.loads_utf8(text.encode(), text), json.loads(text))
            assert _same(_fastjson.loads_text(text), json.loads(text))  # a stream's event


def test_a_body_json_may_find_too_deep_is_read_as_json_reads_it() -> None:
    """orjson reads 1,024 levels; json as many as the stack it is called from leaves it:
    a body with more brackets than :data:`SHALLOW` is read by json, as it was."""
    for depth in (_fastjson.SHALLOW // 2, 1_000):
        text = "[" * depth + "]" * depth
        data = text.encode()
        try:
            want: Any = json.loads(text)
        except RecursionError:
            want = RecursionError
        for read, args in ((_fastjson.loads_utf8, (data, text)),
                           (_fastjson.loads_text, (text,))):
            try:
                got: Any = read(*args)  # type: ignore[operator]
            except RecursionError:
                got = RecursionError
            assert got == want
    assert _fastjson.loads_utf8(b"[" * 1_000 + b"]" * 1_000, "[]") == []  # json's read


def _exact_reference(text: str) -> Any:
    """What the standard library alone says: the body, when its compact JSON is
    ``text`` exactly (NaN and infinities have none)."""
    def no_constant(name: str) -> Any:
        raise ValueError(name)
    try:
        doc = json.loads(text, parse_constant=no_constant)
    except (ValueError, RecursionError):
        return None
    return doc if _fastjson.dumps_compact(doc) == text else None


def test_a_body_is_kept_as_json_exactly_when_the_standard_library_would_keep_it() -> None:
    texts = []
    for doc in _docs(1_000, seed=13):
        texts += [_fastjson.dumps_compact(doc), json.dumps(doc),
                  json.dumps(doc, separators=(",", ":"))]  # the last with \u escapes
    texts += ['{"n":18446744073709551616}', '{"x":NaN}', '{"e":1e400}', '{"s":"\ud800"}',
              '{"a":1,"a":2}', '{"f":1.0}', '{"f":1.00}', '{"f":1E+16}', '{"f":1e+16}',
              '{"t":"\u00e9"}', '[1,2]', '[1, 2]', '{"a":1} ', "[" * 1100 + "]" * 1100,
              "[" * 1000 + "]" * 1000]  # deeper than json reads here, not than orjson
    kept = 0
    for text in texts:
        got, want = compact._exact_json(text), _exact_reference(text)
        assert _same(got, want), text[:80]
        kept += want is not None
    assert kept > 1_000


@pytest.mark.parametrize("text", [
    '{"n": 123456789012345678901234567890}',  # beyond 64 bits: orjson reads a float
    '{"n": -9223372036854775809, "m": 18446744073709551616}',  # just beyond, each way
    '{"n": 18446744073709551615, "m": -9223372036854775808}',  # the edges of 64 bits
    '{"x": NaN, "y": -Infinity}',  # json's constants
    '{"s": "\\ud800 alone"}',  # an escaped lone surrogate
    '{"e": 1e400}',  # beyond a double
])
def test_what_orjson_refuses_or_reads_apart_is_read_as_json_reads_it(text: str) -> None:
    assert _same(_fastjson.loads(text.encode()), json.loads(text))
    assert _same(_fastjson.loads_text(text), json.loads(text))
    assert _fastjson.read(text.encode())[1] is False  # and is never written back by orjson


def test_the_parts_of_a_stream_are_read_as_json_reads_them() -> None:
    """parts_reader checks a stream once for what loads_text checks of each event."""
    docs = [json.dumps(doc) for doc in _docs(300, seed=5)]
    odd = ['{"n": 123456789012345678901234567890}', '{"x": NaN}', '{"s": "\\ud800"}',
           '{"s": "' + chr(0xD800) + '"}', "[" * 500 + "]" * 500, '{"a": 1} {"b": 2}']
    for extra in [None, *odd]:
        parts = docs[:20] + ([extra] if extra else [])
        read = _fastjson.parts_reader("\n\n".join(parts))
        for part in parts:
            try:
                want: Any = json.loads(part)
            except (ValueError, RecursionError) as exc:
                want = type(exc)
            try:
                got: Any = read(part)
            except (ValueError, RecursionError) as exc:
                got = type(exc)
            assert _same(got, want), part[:60]


def test_a_signed_line_is_read_as_json_reads_its_text() -> None:
    """A line whose signature holds is read by orjson where it reads as json does; the
    rest by the strict decoder, and what is not UTF-8, not JSON or not JSON deja writes
    (``NaN``, a lone surrogate: a signature is only as sound as the key) refused as
    corrupt."""
    from recorder.cassette import _validate
    from recorder.errors import CorruptCassette

    lines = [_fastjson.dumps_compact(doc).encode() for doc in _docs(300, seed=17)]
    lines += [b'{"n": 123456789012345678901234567890, "m": -9223372036854775809}',
              b'{"a": 1, "a": 2}', b'{"e": 1e400, "f": 1e-05}', b' {"pad": true} ']
    for raw in lines:
        got = _validate.decode_trusted(raw, Path("c.jsonl"), "line 2", 1)
        assert _same(got, json.loads(raw.decode("utf-8"))), raw[:80]
    for bad in (b'{"a": "\xff"}', b"\x00{}", b'\xef\xbb\xbf{"bom": 1}', b'{"a": 1} {"b": 2}',
                b'{"x": NaN, "y": -Infinity}', b'{"s": "\\ud800"}', b'{"s": "\\udc00\\ud800"}'):
        with pytest.raises(CorruptCassette):
            _validate.decode_trusted(bad, Path("c.jsonl"), "line 2", 1)


def test_an_event_with_a_lone_surrogate_is_read_as_json_reads_it() -> None:
    text = '{"s": "' + chr(0xD800) + '"}'  # the character itself
    assert _same(_fastjson.loads_text(text), json.loads(text))
    with pytest.raises(ValueError):
        _fastjson.loads_text('{"s": ')  # what json refuses, refused alike


def test_a_duplicated_key_reads_its_last_value_as_json_reads_it() -> None:
    assert _fastjson.read(b'{"a": 1, "b": 0, "a": 2}') == ({"a": 2, "b": 0}, True)


def test_a_line_nested_deeper_than_orjson_reads_is_read_as_json_reads_it() -> None:
    text = "[" * 1100 + "]" * 1100  # orjson stops at 1,024 levels
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 2_000)  # for json's parser, in this test only
    try:
        assert _fastjson.read(text.encode()) == (json.loads(text), False)
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize("number", [
    "1e-05", "1e-5", "1E-05", "0.00001", "10e-6", "1.0e-7", "-2.5e-08", "0.000099"])
def test_a_small_float_however_written_is_written_back_by_json(number: str) -> None:
    line = f'{{"response":{{"body_json":{{"p":{number}}}}},"text":"re-run"}}'.encode()
    assert not _fastjson.exact_for(line)
    assert _fastjson.exact_for(b'{"text":"a re-run of a pre-existing E-mail","p":0.0001}')


TOOL_INPUTS = [  # floats in the form the two write apart, then none of it
    {"q": "alpha", "weight": 1e-05, "scale": 2.5e-07, "tiny": 1e-10, "p": 0.5},
    {"q": "beta", "big": 1e+16, "huge": 1.5e+300, "p": 0.25, "n": 2**40},
]


def test_a_body_with_such_floats_is_served_byte_for_byte(stub, tmp_path: Path) -> None:
    server = stub({"turns": [
        {"text": "a", "tool_use": {"id": f"toolu_f{i}", "name": "lookup", "input": inp}}
        for i, inp in enumerate(TOOL_INPUTS)]})
    path = tmp_path / "floats.jsonl"

    def calls() -> list[bytes]:
        bodies = []
        with sync_client(server.url) as client:
            for i in range(len(TOOL_INPUTS)):
                raw = client.messages.with_raw_response.create(
                    model=MODEL, max_tokens=32,
                    messages=[{"role": "user", "content": f"call {i}"}])
                bodies.append(raw.http_response.content)
        return bodies

    with recorder.record(path):
        live = calls()
    server.stop()
    assert [json.loads(b)["content"][1]["input"] for b in live] == TOOL_INPUTS
    lines = path.read_bytes().splitlines()[1:1 + len(TOOL_INPUTS)]
    assert all(b'"body_json"' in line for line in lines)  # stored parsed: written back
    assert [_fastjson.exact_for(line) for line in lines] == [False, True]

    with replayer.replay(path):
        served = calls()
    assert served == live
    assert load(path).observations[0]["response"]["body"].encode() == live[0]
