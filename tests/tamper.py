"""Mutations of a real cassette, for the tamper suite (``tests/replayer/test_tamper.py``).

A cassette is untrusted input, so the suite takes one real recording and breaks it in
every way someone could: each line edited, inserted, deleted, moved, duplicated or
spliced in from another run signed with the same key; header fields edited or removed;
the file cut at every byte of its last two lines; hostile JSON placed in a line; the
whole file, or only its header, re-signed with a key this machine does not have.

Each :class:`Mutant` carries what a correct deja must make of it (:class:`Expect`) and,
for the tampered ones, the line where the damage must be found. The mutations are made
from the bytes on disk: deja's writer dumps each line with compact separators and its
``sig`` last, so a parsed line dumped the same way gives back its exact bytes
(:class:`Source` checks this), and an edit changes only what it means to change.

Every mutation of the header also replaces the header's ``argv`` with a command that
creates a marker file: a command run from a tampered header leaves a file behind.
A generator that gives back the original file is no mutation: it is skipped and counted
(:class:`Mutations`), as is one that repeats an earlier mutant byte for byte.
"""

from __future__ import annotations

import base64
import copy
import enum
import hashlib
import hmac
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recorder.cassette.keys import key_id

SUMMARY: list[str] = []  # the suite's figures, printed at the end of the run (conftest)
ATTACKER_KEY = b"attacker-key-that-no-one-here-has-1f0e"
OTHER_KNOWN_KEY = "tamper-older-key-0123456789abcdef"  # given to the suite as DEJA_OLD_KEYS


class Expect(enum.StrEnum):
    """What a correct deja makes of a mutant."""

    REFUSED = "refused"  # tampered: every command refuses it with a named error
    TORN = "torn"  # cut inside one of the last two lines: reported torn where allowed
    INCOMPLETE = "incomplete"  # cut at a line boundary: whole lines and no end line
    UNVERIFIED = "unverified"  # re-signed whole by a key nobody here has


@dataclass(frozen=True)
class Mutant:
    kind: str  # edit, insert, delete, reorder, duplicate, splice, header, cut, hostile, foreign
    name: str
    data: bytes
    expect: Expect
    line: int | None = None  # the first bad line (0: the header), for a tampered mutant
    marker: str | None = None  # the marker file the header's argv would create


Line = dict[str, Any]
Path_ = tuple[str | int, ...]


def dump(doc: Any) -> bytes:
    """A line as deja's writer puts it on disk."""
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def join(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)


@dataclass(frozen=True)
class Source:
    """A recorded cassette as lines: raw bytes and parsed documents."""

    data: bytes
    raw: tuple[bytes, ...]
    docs: tuple[Line, ...]

    @classmethod
    def of(cls, data: bytes) -> Source:
        assert data.endswith(b"\n"), "the recording must end with a whole line"
        raw = tuple(data[:-1].split(b"\n"))
        docs = tuple(json.loads(line) for line in raw)
        for line, doc in zip(raw, docs, strict=True):
            assert dump(doc) == line, "a parsed line no longer dumps to its own bytes"
        assert docs[-1].get("kind") == "end", "the recording must be a finished run"
        return cls(data, raw, docs)

    def doc(self, index: int) -> Line:
        return copy.deepcopy(self.docs[index])

    def __len__(self) -> int:
        return len(self.raw)


# ------------------------------------------------------------------------ signing


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def resign(docs: list[Line], key: bytes) -> list[bytes]:
    """Sign every line again with ``key``, the way the README describes the chain: over
    each line's bytes as written without its ``sig`` (deja/2), or over its canonical JSON
    (deja/1)."""
    header = {**docs[0], "key_id": key_id(key)}
    signed = _canonical if header.get("format") == "deja/1" else dump
    out, prev = [], ""
    for doc in [header, *docs[1:]]:
        body = {k: v for k, v in doc.items() if k != "sig"}
        mac = hmac.digest(key, prev.encode("ascii") + signed(body), hashlib.sha256)
        prev = base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")
        out.append(dump({**body, "sig": prev}))
    return out


def fake_sig(rng: random.Random) -> str:
    return base64.urlsafe_b64encode(rng.randbytes(32)).rstrip(b"=").decode("ascii")


# ------------------------------------------------------------------------ paths


def paths(doc: Any, prefix: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """Every (path, value) below ``doc``, containers included, the root excluded."""
    items = (doc.items() if isinstance(doc, dict) else enumerate(doc)
             if isinstance(doc, list) else ())
    for key, value in items:
        path = (*prefix, key)
        yield path, value
        yield from paths(value, path)


def leaves(doc: Any) -> list[tuple[Path_, Any]]:
    return [(p, v) for p, v in paths(doc) if not isinstance(v, dict | list) and p != ("sig",)]


def get(doc: Any, path: Path_) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def put(doc: Any, path: Path_, value: Any) -> None:
    get(doc, path[:-1])[path[-1]] = value


def changed(value: Any) -> Any:
    """A value of the same type that means something else."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "x" if value else "x"
    return 0


# ------------------------------------------------------------------------ generators


Gen = Iterator[Mutant]


@dataclass
class Context:
    source: Source
    other: Source  # another recording, signed with the same key
    marker_dir: Path
    rng: random.Random
    _markers: int = 0

    def marker(self) -> tuple[list[str], str]:
        """A fresh ``argv`` that creates a marker file, and the marker's name."""
        self._markers += 1
        name = f"m{self._markers:05d}"
        target = str(self.marker_dir / name)
        return ["python", "-c", f"open({target!r}, 'w').close()"], name

    def header(self, edit: Callable[[Line], Any] | None = None) -> tuple[bytes, str]:
        """The header with a marker ``argv`` and ``edit`` applied, on disk; its marker."""
        doc = self.source.doc(0)
        doc["argv"], name = self.marker()
        if edit is not None:
            edit(doc)
        return dump(doc), name


def _edits(ctx: Context) -> Gen:
    src, rng = ctx.source, ctx.rng

    def variants(doc: Line) -> Iterator[tuple[str, Line]]:
        cands = [(p, v) for p, v in leaves(doc) if p[0] != "argv"]
        strings = [(p, v) for p, v in cands if isinstance(v, str)]
        numbers = [(p, v) for p, v in cands
                   if isinstance(v, int | float) and not isinstance(v, bool)]
        nested = [(p, v) for p, v in cands if len(p) >= 2]
        for what, pool in (("string", strings), ("number", numbers), ("nested", nested)):
            if pool:
                path, value = rng.choice(pool)
                new = copy.deepcopy(doc)
                put(new, path, changed(value))
                yield f"{what} {_show(path)}", new
        dicts = [(p, v) for p, v in paths(doc) if isinstance(v, dict) and p[:1] != ("argv",)]
        target_path, target = rng.choice([((), doc), *dicts])
        new = copy.deepcopy(doc)
        get(new, target_path)["tamper" if "tamper" not in target else "tamper_"] = "x"
        yield f"add field in {_show(target_path) or '/'}", new
        droppable = [(p, k) for p, v in [((), doc), *dicts] for k in v if (p, k) != ((), "sig")]
        where, key = rng.choice(droppable)
        new = copy.deepcopy(doc)
        del get(new, where)[key]
        yield f"drop field {_show((*where, key))}", new
        if "sig" in doc:
            new = copy.deepcopy(doc)
            new["sig"] = fake_sig(rng)
            yield "sig", new

    for index in range(len(src)):
        doc = src.doc(index)
        name = None
        if index == 0:
            doc["argv"], name = ctx.marker()
        for what, new in variants(doc):
            lines = list(src.raw)
            lines[index] = dump(new)
            yield Mutant("edit", f"line {index + 1}: {what}", join(lines), Expect.REFUSED,
                         index, name)


def _show(path: Path_) -> str:
    return "".join(f"/{p}" for p in path)


def _made_up(seq: int, rng: random.Random) -> bytes:
    return dump({"seq": seq, "kind": "tool", "name": "pay",
                 "args": {"invoice": "INV-9999", "amount": 99999},
                 "t": 1796115596.7, "ms": 0.1,
                 "result": {"invoice": "INV-9999", "status": "paid"}, "sig": fake_sig(rng)})


def _inserts(ctx: Context) -> Gen:
    src, rng = ctx.source, ctx.rng
    n = len(src)
    for pos in range(n + 1):
        donor = rng.choice([i for i in range(1, n) if i not in (pos - 1, pos)])
        for what, line in ((f"copy of line {donor + 1}", src.raw[donor]),
                           ("a made-up tool line", _made_up(max(pos - 1, 0), rng))):
            lines = list(src.raw)
            lines.insert(pos, line)
            yield Mutant("insert", f"before line {pos + 1}: {what}", join(lines),
                         Expect.REFUSED, pos)


def _deletes(ctx: Context) -> Gen:
    src = ctx.source
    n = len(src)
    for index in range(n):
        lines = list(src.raw)
        del lines[index]
        if index == n - 1:  # the end line: the file is cut at a line boundary
            yield Mutant("delete", "the end line", join(lines), Expect.INCOMPLETE)
        else:
            yield Mutant("delete", f"line {index + 1}", join(lines), Expect.REFUSED, index)


def _swap(src: Source, i: int, j: int) -> bytes:
    lines = list(src.raw)
    lines[i], lines[j] = lines[j], lines[i]
    return join(lines)


def _reorders(ctx: Context) -> Gen:
    src, rng = ctx.source, ctx.rng
    n = len(src)
    for i in range(n - 1):
        yield Mutant("reorder", f"swap lines {i + 1} and {i + 2}", _swap(src, i, i + 1),
                     Expect.REFUSED, i)
    for i in range(n):
        j = rng.choice([k for k in range(n) if abs(k - i) > 1])
        a, b = sorted((i, j))
        yield Mutant("reorder", f"swap lines {a + 1} and {b + 1}", _swap(src, a, b),
                     Expect.REFUSED, a)
    lines = [src.raw[0], *reversed(src.raw[1:])]
    yield Mutant("reorder", "observations reversed", join(lines), Expect.REFUSED, 1)
    for i in range(1, n - 1):  # one line moved to the end, after the end line
        if rng.random() < 0.2:
            lines = [*src.raw[:i], *src.raw[i + 1:], src.raw[i]]
            yield Mutant("reorder", f"line {i + 1} moved to the end", join(lines),
                         Expect.REFUSED, i)


def _duplicates(ctx: Context) -> Gen:
    src = ctx.source
    for index in range(len(src)):
        lines = list(src.raw)
        lines.insert(index + 1, src.raw[index])
        yield Mutant("duplicate", f"line {index + 1} twice", join(lines), Expect.REFUSED,
                     index + 1)


def _splices(ctx: Context) -> Gen:
    """Lines of another run signed with the same key: valid signatures, wrong chain."""
    src, other, rng = ctx.source, ctx.other, ctx.rng
    m = len(other)
    for k in range(m):  # the other run's line k at the same position (seq k - 1)
        lines = list(src.raw)
        lines[k] = other.raw[k]
        first = 1 if k == 0 else k  # the other run's header verifies; seq 0 does not
        yield Mutant("splice", f"line {k + 1} from the other run, same seq", join(lines),
                     Expect.REFUSED, first)
    for k in range(1, m):
        yield Mutant("splice", f"lines 1-{k} ours, the rest the other run's",
                     join([*src.raw[:k], *other.raw[k:]]), Expect.REFUSED, k)
        yield Mutant("splice", f"lines 1-{k} the other run's, the rest ours",
                     join([*other.raw[:k], *src.raw[k:]]), Expect.REFUSED, k)
        lines = list(src.raw)
        lines.insert(k, other.raw[k])
        yield Mutant("splice", f"the other run's line {k + 1} inserted at its seq",
                     join(lines), Expect.REFUSED, k)
        pos = rng.randrange(1, len(src))
        lines = list(src.raw)
        lines.insert(pos, other.raw[k])
        yield Mutant("splice", f"the other run's line {k + 1} inserted before line {pos + 1}",
                     join(lines), Expect.REFUSED, pos)
    yield Mutant("splice", "our header, the other run's observations",
                 join([src.raw[0], *other.raw[1:]]), Expect.REFUSED, 1)
    yield Mutant("splice", "the other run's end line instead of ours",
                 join([*src.raw[:-1], other.raw[-1]]), Expect.REFUSED, len(src) - 1)


def _headers(ctx: Context) -> Gen:
    """Header fields edited or removed one by one, each with a marker argv."""
    src, rng = ctx.source, ctx.rng
    header = src.docs[0]

    def setter(name: str, value: Any) -> Callable[[Line], None]:
        return lambda doc: doc.__setitem__(name, value)

    def remover(name: str) -> Callable[[Line], None]:
        return lambda doc: doc.pop(name, None)

    cases: list[tuple[str, Callable[[Line], Any] | None]] = [
        ("argv replaced", None),
        ("key_id to an unknown key", setter("key_id", "k_000000000000")),
        ("key_id to another key this machine has",
         setter("key_id", key_id(OTHER_KNOWN_KEY.encode()))),
        ("key_id to a list", setter("key_id", [header["key_id"]])),
        ("key_id to an empty string", setter("key_id", "")),
        ("key_id to null", setter("key_id", None)),
        ("key_id to a number", setter("key_id", 7)),
        ("key_id removed", remover("key_id")),
        ("run changed", setter("run", "r_" + "0" * 20)),
        ("run to a list", setter("run", [header["run"]])),
        ("run removed", remover("run")),
        ("argv to a string", setter("argv", "python -c pass")),
        ("argv to a list of numbers", setter("argv", [1, 2])),
        ("argv removed", remover("argv")),
        ("argv empty", setter("argv", [])),
        ("cwd changed", setter("cwd", str(ctx.marker_dir))),
        ("cwd to a number", setter("cwd", 3)),
        ("cwd removed", remover("cwd")),
        ("parent set", setter("parent", {"run": "r_" + "1" * 20, "step": 0})),
        ("parent to a string", setter("parent", "r_x")),
        ("parent with a non-integer step", setter("parent", {"run": "r_x", "step": "0"})),
        ("format to deja/2", setter("format", "deja/2")),
        ("format to a number", setter("format", 1)),
        ("format removed", remover("format")),
        ("created changed", setter("created", "2001-01-01T00:00:00.000Z")),
        ("labels added", setter("labels", {"team": "x"})),
        ("labels to a list", setter("labels", ["x"])),
        ("budgets raised", setter("budgets", {**(header.get("budgets") or {}),
                                              "turns": 10**6})),
        ("budgets removed", remover("budgets")),
        ("entry set", setter("entry", "os:system")),
        ("fsync changed", setter("fsync", "exit")),
        ("redact emptied", setter("redact", {})),
        ("versions to a string", setter("versions", "x")),
        ("sig removed", remover("sig")),
        ("sig garbled", setter("sig", fake_sig(rng))),
        ("key_id to an unknown key, sig garbled",
         lambda doc: doc.update(key_id="k_000000000000", sig=fake_sig(rng))),
        ("key_id removed, sig removed", lambda doc: [doc.pop("key_id"), doc.pop("sig")]),
    ]
    for what, edit in cases:
        line, name = ctx.header(edit)
        yield Mutant("header", what, join([line, *src.raw[1:]]), Expect.REFUSED, 0, name)
    argv, name = ctx.marker()
    line = resign([{**src.doc(0), "argv": argv}], ATTACKER_KEY)[0]
    yield Mutant("header", "argv replaced, header re-signed with a key nobody here has",
                 join([line, *src.raw[1:]]), Expect.REFUSED, 0, name)
    for what, body in (("no observations", []), ("only the end line", [src.raw[-1]])):
        line, name = ctx.header()
        yield Mutant("header", f"argv replaced, {what}", join([line, *body]), Expect.REFUSED,
                     0, name)
    for what, line in (("empty", b""), ("an empty object", b"{}"), ("a list", b"[]"),
                       ("null", b"null")):
        yield Mutant("header", f"header line {what}", join([line, *src.raw[1:]]),
                     Expect.REFUSED, 0)


def _cuts(ctx: Context) -> Gen:
    """The file cut at every byte of its last two lines."""
    src = ctx.source
    boundaries = {len(join(list(src.raw[:-2]))), len(join(list(src.raw[:-1])))}
    for offset in range(min(boundaries), len(src.data)):
        expect = Expect.INCOMPLETE if offset in boundaries else Expect.TORN
        yield Mutant("cut", f"cut at byte {offset}", src.data[:offset], expect)


# Hostile tokens put where a JSON value goes; and byte strings put inside a string.
_TOKENS: dict[str, bytes] = {
    "NaN": b"NaN", "Infinity": b"Infinity", "-Infinity": b"-Infinity",
    "1e400": b"1e400", "a 5,000-digit integer": b"1" + b"0" * 5000,
    "a lone surrogate": b'"\\ud800"', "a reversed surrogate pair": b'"\\udc00\\ud800"',
    "10,000-deep lists": b"[" * 10_000 + b"]" * 10_000,
    "10,000-deep objects": b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
    "an object": b"{}", "a list": b"[]",
}
_BYTES: dict[str, bytes] = {
    "byte 0xff": b"a\xffb", "an overlong slash": b"\xc0\xaf", "a truncated sequence": b"\xe2\x82",
    "an encoded surrogate": b"\xed\xa0\x80", "a raw control character": b"a\x01b",
}
_SENTINEL = "@@tamper@@"


def _hostiles(ctx: Context) -> Gen:
    src, rng = ctx.source, ctx.rng
    n = len(src)
    tool = next(i for i, d in enumerate(src.docs) if d.get("kind") == "tool")
    model = next(i for i, d in enumerate(src.docs[3:], 3) if d.get("kind") == "model")
    for index in (0, 1, tool, model, n // 2, n - 1):
        base = src.doc(index)
        name = None
        if index == 0:
            base["argv"], name = ctx.marker()
        numbers = [p for p, v in leaves(base)
                   if isinstance(v, int | float) and not isinstance(v, bool) and p[0] != "argv"]
        strings = [p for p, v in leaves(base) if isinstance(v, str) and p[0] != "argv"]

        def placed(path: Path_ | None, token: bytes, doc: Line = base) -> bytes:
            new = copy.deepcopy(doc)
            if path is None:
                new.pop("sig", None)
                new["tamper"] = _SENTINEL
                new["sig"] = doc.get("sig", "")
            else:
                put(new, path, _SENTINEL)
            return dump(new).replace(dump(_SENTINEL), token, 1)

        def emit(what: str, line: bytes, index: int = index, name: str | None = name
                 ) -> Mutant:
            lines = list(src.raw)
            lines[index] = line
            return Mutant("hostile", f"line {index + 1}: {what}", join(lines), Expect.REFUSED,
                          index, name)

        for what, token in _TOKENS.items():
            if numbers:
                path = rng.choice(numbers)
                yield emit(f"{what} for {_show(path)}", placed(path, token))
            yield emit(f"{what} in an added field", placed(None, token))
        for what, raw in _BYTES.items():
            path = rng.choice(strings)
            yield emit(f"{what} in {_show(path)}", placed(path, b'"' + raw + b'"'))
        line = dump(base)
        yield emit("a BOM before it", b"\xef\xbb\xbf" + line)
        yield emit("a NUL byte before it", b"\x00" + line)
        for what, raw in (("an empty line", b""), ("a list", b"[]"), ("a number", b"1"),
                          ("null", b"null"), ("a string", b'"x"')):
            yield emit(f"replaced by {what}", raw)
        # Duplicate keys in the line as signed: a second value for a key, before the
        # signed one (a reader that takes the first value sees it) and after it (one that
        # takes the last does). For the header, the second argv leaves a marker.
        signed_line, signed_doc = src.raw[index], src.docs[index]
        keys = ("argv", "key_id", "sig") if index == 0 else ("seq", "kind", "sig")
        for key in keys:
            mark = None
            if key == "argv":
                value, mark = ctx.marker()
            else:
                value = fake_sig(rng) if key == "sig" else changed(signed_doc[key])
            evil = dump({key: value})[1:-1]
            for where, line in (("before", b"{" + evil + b"," + signed_line[1:]),
                                ("after", signed_line[:-1] + b"," + evil + b"}")):
                lines = list(src.raw)
                lines[index] = line
                yield Mutant("hostile", f"line {index + 1}: duplicate key {key!r} {where} "
                             "the signed one", join(lines), Expect.REFUSED, index, mark)
    yield Mutant("hostile", "a BOM at the start of the file", b"\xef\xbb\xbf" + src.data,
                 Expect.REFUSED, 0)


# Values put in place of a field of a line re-signed with a key nobody here has.
_FUZZ: tuple[Any, ...] = ({}, [], "x", -1, None, True, 1e308, 2**70, [[1]], {"a": {}})


def _foreign(ctx: Context, per_path: int) -> Gen:
    """Re-signed by someone without this machine's key: unverified, whatever it holds.

    The file is re-signed whole (a forgery from scratch, or a cassette made elsewhere) and
    its fields are given values of every wrong type: refused unless unverified cassettes
    are allowed, and then marked NOT VERIFIED or refused as corrupt, never a traceback.
    """
    src, rng = ctx.source, ctx.rng
    kinds = ("tool", "intent", "outcome", "end")
    picks = [0, 1, *(next(i for i, d in enumerate(src.docs) if d.get("kind") == k)
                     for k in kinds)]
    picks.insert(2, next(i for i, d in enumerate(src.docs[2:], 2) if d.get("kind") == "model"))

    def signed(docs: list[Line]) -> tuple[bytes, str]:
        docs[0]["argv"], name = ctx.marker()
        return join(resign(docs, ATTACKER_KEY)), name

    data, name = signed([src.doc(i) for i in range(len(src))])
    yield Mutant("foreign", "re-signed whole, argv replaced", data, Expect.UNVERIFIED,
                 marker=name)
    for index in picks:
        for path, _value in paths(src.docs[index]):
            if path[0] in ("sig", "argv") or (index == 0 and path == ("key_id",)):
                continue
            for value in rng.sample(_FUZZ, per_path):
                docs = [src.doc(i) for i in range(len(src))]
                put(docs[index], path, copy.deepcopy(value))
                data, name = signed(docs)
                yield Mutant("foreign", f"line {index + 1}: {_show(path)} = {value!r:.20}",
                             data, Expect.UNVERIFIED, marker=name)


GENERATORS: dict[str, Callable[[Context], Gen]] = {
    "edit": _edits, "insert": _inserts, "delete": _deletes, "reorder": _reorders,
    "duplicate": _duplicates, "splice": _splices, "header": _headers, "cut": _cuts,
    "hostile": _hostiles,
}
KINDS = (*GENERATORS, "foreign")
DETERMINISTIC = ("delete", "duplicate", "header", "cut")  # the same for every seed


@dataclass
class Mutations:
    """The mutants of ``source``, made one at a time (each is a whole file) in a fixed
    order for the given seeds; unchanged and repeated files are skipped and counted."""

    source: Source
    other: Source
    marker_dir: Path
    seeds: tuple[int, ...] = (0,)
    foreign_per_path: int = 1
    unchanged: int = 0  # a generator gave back the original bytes
    repeated: int = 0  # the same bytes as an earlier mutant

    def __iter__(self) -> Iterator[Mutant]:
        seen: set[bytes] = set()
        ctx = Context(self.source, self.other, self.marker_dir, random.Random(0))
        for kind in KINDS:
            for seed in self.seeds:
                if seed != self.seeds[0] and kind in DETERMINISTIC:
                    continue
                ctx.rng = random.Random(f"{seed}:{kind}")
                gen = (_foreign(ctx, self.foreign_per_path) if kind == "foreign"
                       else GENERATORS[kind](ctx))
                for mutant in gen:
                    if mutant.data == self.source.data:
                        self.unchanged += 1
                        continue
                    digest = hashlib.sha256(mutant.data).digest()
                    if digest in seen:
                        self.repeated += 1
                        continue
                    seen.add(digest)
                    yield mutant
