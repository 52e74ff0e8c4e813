"""Reading a cassette: verify the chain, parse every line once, keep what a replay needs.

:func:`load` reads the file and its header, decides which key to verify with
(:mod:`recorder.cassette.trust`), then takes each observation line through four steps
(:func:`_body`): its signature checked over its bytes and parsed (:func:`_parsed_v2`; in
``deja/1`` :func:`_parsed`, then :func:`_verified`), checked in its place
(:func:`_checked`), and noted (:meth:`~recorder.cassette.lines.Reading.note`: what a
replay matches it on); last, an unfinished file is refused unless allowed
(:func:`_report_unfinished`). The lines themselves are restored from the file's bytes
when they are read (:mod:`recorder.cassette.lines`), and the model lines' requests
rebuilt, in file order, for their fingerprints, when a replay or a reader first needs
them (:mod:`recorder.cassette._fingerprints`).

What a power loss leaves after the last whole line (zeros, a fragment of a line, bytes
that are no line at all) is refused like any fault, with the remedy named: ``deja repair``
cuts it (:mod:`recorder.cassette.repair`), keeping :func:`verified_prefix`, the lines from
the start that verify.
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from recorder.cassette import _validate, trust
from recorder.cassette._fingerprints import no_cycle_collection
from recorder.cassette.format import KINDS, READABLE_FORMATS, V1
from recorder.cassette.keys import Keyring, load_keyring
from recorder.cassette.lines import Lines, Reading, Replies, Requests, Sigs, Store
from recorder.cassette.schema import EndLine, Header, Kind, Observation
from recorder.cassette.signing import check_bytes, check_sig, line_bytes, split_signed
from recorder.errors import (
    CassetteError,
    CassetteNotFound,
    CorruptCassette,
    SignatureError,
    TornCassette,
    UnsupportedFormat,
)


@dataclass(frozen=True)
class Cassette:
    """A loaded cassette: header, observations (``end`` excluded) and what loading found.

    :func:`load` gives the observations as :class:`~recorder.cassette.lines.Lines`, each
    restored from the file's bytes when it is read, and the requests and replies as
    mappings that rebuild an entry when it is read (:mod:`recorder.cassette.lines`)."""

    path: Path
    header: Header
    observations: Sequence[Observation]
    end: EndLine | None
    verified: bool
    verify_note: str
    torn_offset: int | None = None
    requests: Mapping[int, Any] = field(default_factory=dict, repr=False)
    # seq -> the message its response gives the conversation (requests refer to it)
    replies: Mapping[int, Any] = field(default_factory=dict, repr=False)
    sigs: Sequence[str] = field(default=(), repr=False)  # header's first, then each line's
    size: int = 0  # bytes in the file when it was read
    end_offset: int | None = None  # where the end line starts

    @property
    def run(self) -> str:
        return str(self.header.get("run"))

    def request_of(self, seq: int) -> Any:
        """The full request body of the model observation ``seq``."""
        return self.requests[seq]

    def __iter__(self) -> Iterator[Observation]:
        return iter(self.observations)

    def __len__(self) -> int:
        return len(self.observations)


def peek_header(path: str | Path) -> Header | None:
    """A file's first line as a header, unchecked and unverified (None: no file, or not a
    JSON object): enough to name a run or find a fork's parent, never to trust it."""
    try:
        with Path(path).open("rb") as f:
            header = json.loads(f.readline())
    except (OSError, ValueError, RecursionError):  # not a cassette, or a hostile one
        return None
    return cast(Header, header) if isinstance(header, dict) else None


PEEK_CHUNK = 65536  # bytes read at a time, backwards from a file's end, by peek_end


def peek_end(path: str | Path) -> EndLine | None:
    """A file's last line as an end line, unchecked and unverified (None: no file, no end
    line, or a last line not written whole), read backwards from the end of the file: a
    status costs as much for a run of ten lines as of a million. Never to trust it."""
    try:
        with Path(path).open("rb") as f:
            pos = f.seek(0, os.SEEK_END) - 1  # the newline that ends the last line
            if pos < 0:
                return None
            f.seek(pos)
            if f.read(1) != b"\n":  # torn: the last line was not written whole
                return None
            chunks: list[bytes] = []
            while pos > 0:
                start = f.seek(max(0, pos - PEEK_CHUNK))
                block = f.read(pos - start)
                cut = block.rfind(b"\n")
                chunks.append(block[cut + 1:])
                if cut >= 0:
                    break
                pos = start
        end = json.loads(b"".join(reversed(chunks)))
    except (OSError, ValueError, RecursionError):  # not a cassette, or a hostile one
        return None
    return cast(EndLine, end) if isinstance(end, dict) and end.get("kind") == Kind.END \
        else None


@dataclass(frozen=True)
class _File:
    """A file read whole: its bytes, where each whole line starts and ends (without the
    newline, or a CR before it), where a torn last line starts (None: none is)."""

    data: bytes
    starts: array[int]
    ends: array[int]
    torn: int | None

    def __len__(self) -> int:
        return len(self.starts)

    def raw(self, index: int) -> bytes:
        return self.data[self.starts[index]:self.ends[index]]

    def raws(self, start: int = 0) -> Iterator[bytes]:
        return (self.raw(index) for index in range(start, len(self)))


def _lines(path: Path) -> _File:
    """The file's whole lines, and where its torn last line starts, if it has one."""
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise CorruptCassette(f"{path} is a directory, not a cassette file", path=path) from None
    except OSError as exc:
        raise CorruptCassette(f"cannot read {path}: {exc.strerror or exc}", path=path) from None
    starts, ends = array("q"), array("q")
    pos, size, find = 0, len(data), data.find
    torn: int | None = None
    while pos < size:
        nl = find(b"\n", pos)
        if nl < 0:
            torn = pos
            break
        starts.append(pos)
        # a line ending in CR LF (a checkout that converts line endings) reads as written
        ends.append(nl - 1 if nl > pos and data[nl - 1] == 0x0D else nl)
        pos = nl + 1
    return _File(data, starts, ends, torn)


def _signed(key: bytes, prev: str, line: Mapping[str, Any], sig: object, path: Path,
            seq: int | None) -> bool:
    """Does ``sig`` sign ``line`` by the rules of ``deja/1`` (its canonical form)?"""
    try:
        return check_sig(key, prev, line, sig)
    except UnicodeEncodeError:
        where = "the header" if seq is None else f"seq {seq}"
        raise CorruptCassette(f"{path}: {where} holds text that is not valid Unicode (a lone "
                              "surrogate); deja never writes such a line", path=path,
                              seq=seq) from None
    except (ValueError, TypeError, RecursionError) as exc:
        where = "the header" if seq is None else f"seq {seq}"
        raise CorruptCassette(f"{path}: {where} holds a value deja never writes ({exc})",
                              path=path, seq=seq) from None


def _check_v2(key: bytes, prev: str, line: dict[str, Any] | bytes, sig: object) -> bool:
    """Does ``sig`` sign ``line`` by the rules of ``deja/2``: its signed bytes as read, or a
    parsed line (a header with its ``key_id`` restored, a line whose bytes were re-spaced)
    serialised as the writer does, fields in their order, and with ``key_id`` last, where
    the writer puts it (a header whose ``key_id`` was moved)."""
    if isinstance(line, bytes):  # a whole line as read: its signed bytes, or as parsed
        split = split_signed(line)
        if split is not None and check_bytes(key, prev, split[0], sig):
            return True
        try:
            parsed = _validate.decode(line)
        except _validate.BadLine:
            return False
        if not isinstance(parsed, dict):
            return False
        parsed.pop("sig", None)
        line = parsed
    if check_bytes(key, prev, line_bytes(line), sig):
        return True
    if "key_id" not in line:
        return False
    last = {k: v for k, v in line.items() if k != "key_id"}
    last["key_id"] = line["key_id"]
    return check_bytes(key, prev, line_bytes(last), sig)


def _chain(lines: _File, path: Path, header_sig: object, v1: bool
           ) -> Iterator[tuple[str, Any, object]]:
    """Each observation line as its signature covers it (``deja/1``: parsed, without its
    sig; ``deja/2``: its signed bytes) with the stored sig of the line before it and its
    own, for the trust decision; stops at the first line that cannot be read."""
    prev = header_sig
    for index, raw in enumerate(lines.raws(1), start=1):
        payload: Any
        split = None if v1 else split_signed(raw)
        if split is not None:  # the line as read; _check_v2 also tries it re-serialised
            payload, sig = raw, split[1]
        else:  # deja/1, or re-spaced or reordered: as parsed (for the writer's form of it)
            try:
                payload = _validate.parse_line(raw, path, f"line {index + 1}", index - 1)
            except CorruptCassette:
                return
            if not isinstance(payload, dict):
                return
            sig = payload.pop("sig", None)
        if isinstance(prev, str):
            yield prev, payload, sig
        prev = sig


def _not_found(path: Path) -> CassetteNotFound:
    """The error for a path with no cassette, naming the closest files that exist."""
    import difflib

    folder = path.parent
    if path.is_dir():
        return CassetteNotFound(f"{path} is a directory, not a cassette; name one of its "
                                "<run>.jsonl files", path=path)
    if not folder.is_dir():
        return CassetteNotFound(f"no cassette at {path}: the directory {folder} does not "
                                "exist", path=path)
    try:  # an empty file is no cassette to suggest
        names = sorted(p.name for p in folder.iterdir()
                       if p.suffix == ".jsonl" and p.is_file() and p.stat().st_size > 0)
    except OSError:
        names = []
    stems = {Path(name).stem: name for name in names}
    close = difflib.get_close_matches(path.stem, list(stems), n=3, cutoff=0.6)
    if close:
        hint = "did you mean " + ", ".join(str(folder / stems[s]) for s in close) + "?"
    elif names:
        hint = f"{folder} holds {len(names)} other cassette(s), e.g. {folder / names[0]}"
    else:
        hint = f"{folder} holds no cassettes (*.jsonl)"
    return CassetteNotFound(f"no cassette at {path}; {hint}", path=path)


def load(path: str | Path, *, keyring: Keyring | None = None, require_signature: bool = False,
         allow_unverified: bool | None = None, allow_torn: bool = False,
         allow_incomplete: bool = True) -> Cassette:
    """Read and check a cassette.

    The signature chain is verified with the key the header names, from ``keyring`` (by
    default this environment's keys). A cassette whose key nobody here has is refused
    (:class:`UnverifiedCassette`) unless ``allow_unverified`` (default: the
    ``DEJA_ALLOW_UNVERIFIED`` environment variable); it then loads with ``verified``
    False and a ``verify_note`` that starts with ``NOT VERIFIED``. ``require_signature``
    refuses it even then. An edited or removed ``key_id`` is a :class:`SignatureError`;
    see :mod:`recorder.cassette.trust`. The structure (strict JSON, dense seq, kinds, one end
    line at the end) is always checked, and so are the field types of every line, verified
    or not (:func:`_checked`). A torn last line is refused unless ``allow_torn``; a
    missing end line unless ``allow_incomplete``.

    The lines go through the steps below one at a time (each line is parsed, verified and
    checked before the next is read: :func:`_body`), so the first fault in the file is the
    one reported. The model lines' requests are rebuilt later, in file order, when a
    replay's index, a request or a whole line first needs them
    (:mod:`recorder.cassette._fingerprints`); a signed line deja never wrote that cannot
    be rebuilt is a :class:`CorruptCassette` then (``deja verify`` restores every line).
    """
    path = Path(path)
    if keyring is None:
        keyring = load_keyring(create=False)
    if allow_unverified is None:
        allow_unverified = trust.allow_unverified_from_env()
    lines = _read(path)
    header, header_sig = _header(lines.raw(0), path)
    v1 = header["format"] == V1
    verdict = trust.decide(path, header, header_sig,
                           lambda: _chain(lines, path, header_sig, v1), keyring,
                           check_sig if v1 else _check_v2, allow_unverified=allow_unverified,
                           require_signature=require_signature)
    key = verdict.key
    _verify_header(key, header, header_sig, lines.raw(0), v1, path)
    with no_cycle_collection():
        body = _body(lines, key, header_sig, v1, path)
        _report_unfinished(path, body, len(lines), lines.torn, len(lines.data),
                           verified=key is not None, allow_torn=allow_torn,
                           allow_incomplete=allow_incomplete)
        store = body.store
        observations = Lines(store)
        if key is None:  # not what deja's writer made: every reference checked now
            for _ in observations:
                pass
    return Cassette(path=path, header=header, observations=observations, end=body.end,
                    verified=key is not None, verify_note=verdict.note,
                    torn_offset=lines.torn, requests=Requests(store), replies=Replies(store),
                    sigs=Sigs(store, body.count, body.odd), size=len(lines.data),
                    end_offset=body.end_offset)


@dataclass(frozen=True)
class Prefix:
    """The lines of a cassette that verify, from its start, and what follows them: what
    ``deja repair`` keeps and what it cuts (:mod:`recorder.cassette.repair`)."""

    path: Path
    size: int  # bytes in the file
    keep: int  # bytes of the header and the lines that verify after it
    lines: int  # those lines, the header's included
    end: EndLine | None  # the end line among them
    fault: CassetteError | None  # why the next whole line is not kept (None: no such line)
    junk: bool  # the whole lines after them are junk (see :func:`junk`), not edited lines

    @property
    def last_seq(self) -> int | None:
        """The seq of the last line kept (None: only the header)."""
        return self.lines - 2 if self.lines > 1 else None


def verified_prefix(path: str | Path, *, keyring: Keyring | None = None) -> Prefix:
    """How much of ``path`` verifies from its start, with the key its header names (a
    cassette that cannot be verified here is refused, as by ``load(require_signature=True)``;
    so is one whose header does not verify)."""
    path = Path(path)
    if keyring is None:
        keyring = load_keyring(create=False)
    lines = _read(path)
    header, header_sig = _header(lines.raw(0), path)
    v1 = header["format"] == V1
    key = trust.decide(path, header, header_sig, lambda: _chain(lines, path, header_sig, v1),
                       keyring, check_sig if v1 else _check_v2, allow_unverified=False,
                       require_signature=True).key
    _verify_header(key, header, header_sig, lines.raw(0), v1, path)
    body = _reading(path, lines, header_sig)
    kept, fault = 1, None
    with no_cycle_collection():
        for index in range(1, len(lines)):
            try:
                _take(lines, index, key, v1, body, path)
                body.store.through(index - 1, more=True)  # its request rebuilds
            except (CorruptCassette, SignatureError) as exc:
                fault = exc
                break
            kept += 1
    size = len(lines.data)
    keep = lines.starts[kept] if kept < len(lines) else \
        lines.torn if lines.torn is not None else size
    return Prefix(path=path, size=size, keep=keep, lines=kept, end=body.end, fault=fault,
                  junk=junk(lines.raws(kept)))


def _read(path: Path) -> _File:
    """The file's lines (at least the header's), and its torn last line."""
    if not path.is_file():
        raise _not_found(path)
    lines = _lines(path)
    if not len(lines):
        if lines.torn is not None:
            raise TornCassette(f"{path}: the header line is torn (the recording crashed while "
                               "starting); nothing can be replayed", path=path, offset=0)
        raise CorruptCassette(f"{path} is empty; it is not a deja cassette", path=path)
    return lines


def _header(raw: bytes, path: Path) -> tuple[Header, object]:
    """Line 1, checked: a deja header of a format this deja reads; and its stored sig."""
    try:
        header = _validate.decode(raw)
    except _validate.BadLine as exc:
        raise CorruptCassette(f"{path}: line 1 (the header) {exc}; not a deja cassette",
                              path=path) from None
    if not isinstance(header, dict) or "format" not in header:
        raise CorruptCassette(f"{path}: line 1 has no 'format' field; not a deja cassette",
                              path=path)
    if not isinstance(header["format"], str) or header["format"] not in READABLE_FORMATS:
        raise UnsupportedFormat(
            f"{path}: cassette format {header['format']!r} is not supported by this deja "
            f"(it reads {', '.join(READABLE_FORMATS)}); upgrade deja to read it", path=path)
    header_sig = header.pop("sig", None)
    _validate.check_header(header, path)
    return cast(Header, header), header_sig


def _verify_header(key: bytes | None, header: Header, sig: object, raw: bytes,
                   v1: bool, path: Path) -> None:
    if key is None:
        return
    if v1:
        ok = _signed(key, "", header, sig, path, None)
    else:
        split = split_signed(raw)
        ok = split is not None and check_bytes(key, "", split[0], sig)
    if not ok:
        raise SignatureError(
            f"{path}: signature check failed at the header (line 1): it was edited after "
            "it was written. Do not trust this cassette; restore it from where it was "
            "committed", path=path, seq=None)


def _reading(path: Path, lines: _File, header_sig: object) -> Reading:
    """Where the lines read go (:class:`~recorder.cassette.lines.Reading`)."""
    return Reading.start(Store(path, lines.data, lines.starts, lines.ends), header_sig)


def _body(lines: _File, key: bytes | None, header_sig: object, v1: bool, path: Path
          ) -> Reading:
    """The lines after the header, each through the steps in turn before the next one is
    read: parsed strictly and signed by the line before it (:func:`_parsed` and
    :func:`_verified`, or :func:`_parsed_v2` for ``deja/2``), in its place with the field
    types deja writes (:func:`_checked`), what a replay matches it on kept
    (:meth:`Reading.note`)."""
    body = _reading(path, lines, header_sig)
    for index in range(1, len(lines)):
        try:
            _take(lines, index, key, v1, body, path)
        except (CorruptCassette, SignatureError) as exc:
            if not junk(lines.raws(index)):
                raise
            raise _junk_error(exc, path, body, lines.starts[index]) from None
    return body


def _take(lines: _File, index: int, key: bytes | None, v1: bool, body: Reading,
          path: Path) -> None:
    """Line ``index`` (the header is 0) through the four steps, into ``body``."""
    raw, number, seq = lines.raw(index), index + 1, index - 1
    if v1:
        line, sig = _parsed(raw, number, seq, path)
        _verified(line, sig, key, body, index, path)
    else:
        line = _parsed_v2(raw, key, body, index, path)
    _checked(line, body, number, seq, path)
    body.note(line, lines.starts[index])
    body.count += 1


def junk(lines: Iterable[bytes]) -> bool:
    """None of ``lines`` looks like a line deja wrote (a ``seq`` or a ``sig`` in it, or a
    JSON object with either): they are what a power loss or a crash leaves (zeros, a
    fragment of a line), not lines of the run that were edited, which are never cut as
    junk."""
    for raw in lines:
        if b'"seq":' in raw or b'"sig":' in raw:
            return False
        try:
            doc = json.loads(raw)
        except RecursionError:  # nested past reading: hostile, not an accident
            return False
        except ValueError:
            continue
        if isinstance(doc, dict) and ("seq" in doc or "sig" in doc):
            return False
    return True


def _junk_error(exc: CassetteError, path: Path, body: Reading, offset: int) -> CorruptCassette:
    """The fault at byte ``offset`` with its remedy: everything from there is junk."""
    if body.end is not None:
        return CorruptCassette(
            f"{path}: after the end line (seq {body.end['seq']}) the file holds bytes that are "
            f"no cassette line (from byte {offset}): what a power loss or a crash while the "
            "file grew leaves. The run itself is whole. Cut them with deja repair "
            f"{path} (it keeps a copy of the file as it is)", path=path, seq=exc.seq)
    return CorruptCassette(
        f"{exc}. Everything from byte {offset} on is no cassette line (what a power loss "
        f"leaves): deja repair {path} cuts it (keeping a copy), then deja resume {path} "
        "continues the run", path=path, seq=exc.seq)


def _parsed(raw: bytes, number: int, seq: int, path: Path) -> tuple[Any, object]:
    """Step 1: the line parsed strictly, and its sig taken off it."""
    line = _validate.parse_line(raw, path, f"line {number} (seq {seq})", seq)
    sig = line.pop("sig", None) if isinstance(line, dict) else None
    return line, sig


def _verified(line: Any, sig: object, key: bytes | None, body: Reading, index: int,
              path: Path) -> None:
    """Step 2: the line signed by the one before it (with ``key``; unchecked without
    one); ``body`` gets its sig."""
    if key is not None and not _signed(key, body.prev, line, sig, path, index - 1):
        raise _tampered(path, index + 1, index - 1)
    body.signed(index, sig, tail=False)


def _parsed_v2(raw: bytes, key: bytes | None, body: Reading, index: int, path: Path) -> Any:
    """Steps 1 and 2 of a ``deja/2`` line: its signed bytes checked first (no parsing is
    needed for that), then parsed. A line whose signature holds is bytes deja wrote, so a
    plain parse reads it exactly; anything else is parsed strictly, so a malformed line is
    reported as such before its signature is, as in ``deja/1``."""
    number, seq = index + 1, index - 1
    split = split_signed(raw)
    if key is not None and split is not None and check_bytes(key, body.prev, *split):
        line = _validate.decode_trusted(split[0], path, f"line {number} (seq {seq})", seq)
        body.signed(index, split[1], tail=True)
        return line
    line, sig = _parsed(raw, number, seq, path)
    if key is not None:  # well-formed, but not what was signed
        if isinstance(line, dict):  # a value with no JSON form deja writes: say so first
            _signed(key, body.prev, line, sig, path, seq)
        raise _tampered(path, number, seq)
    body.signed(index, sig, tail=split is not None and split[1] == sig)
    return line


def _tampered(path: Path, number: int, seq: int) -> SignatureError:
    return SignatureError(
        f"{path}: signature check failed at seq {seq} (line {number}): the "
        "line was edited, inserted, deleted or moved after it was written. Do "
        "not trust this cassette; restore it from where it was committed",
        path=path, seq=seq)


def _checked(line: Any, body: Reading, number: int, seq: int, path: Path) -> None:
    """Step 3: the line in its place (dense seq, a known kind, nothing after the end
    line) with the field types deja writes. The types are checked on every line, its
    signature holding or not: deja's writer checks them before it signs a line
    (:meth:`recorder.cassette.writer.CassetteWriter.append`), but a signed line is
    only as sound as whatever held the key, and what the readers make of a field of
    another type is a traceback, not a named refusal."""
    if not isinstance(line, dict) or line.get("seq") != seq or type(line["seq"]) is not int:
        got = line.get("seq") if isinstance(line, dict) else None  # (true is no seq 1)
        raise CorruptCassette(f"{path}: line {number} has seq {got!r}, expected "
                              f"{seq}: lines were deleted, inserted or reordered",
                              path=path, seq=seq)
    if not isinstance(line.get("kind"), str) or line["kind"] not in KINDS:
        raise CorruptCassette(f"{path}: seq {seq} has unknown kind {line.get('kind')!r}",
                              path=path, seq=seq)
    if body.end is not None:
        raise CorruptCassette(f"{path}: seq {seq} follows the end line (seq "
                              f"{body.end['seq']})", path=path, seq=seq)
    _validate.check_line(line, path, seq)


def _report_unfinished(path: Path, body: Reading, count: int, torn: int | None, size: int, *,
                       verified: bool, allow_torn: bool, allow_incomplete: bool) -> None:
    """Step 5: refuse a torn last line, or a missing end line, unless allowed. ``count``
    is the number of whole lines, the header's included."""
    if torn is not None and not allow_torn and body.end is not None:
        raise TornCassette(
            f"{path}: after the end line (seq {body.end['seq']}) the file ends in "
            f"{size - torn} bytes that are no whole line (from byte {torn}): what a power "
            "loss or a crash while the file grew leaves. The run itself is whole. Cut them "
            f"with deja repair {path} (it keeps a copy of the file as it is), or read the "
            "run as it is (--allow-torn)", path=path, seq=count - 1, offset=torn)
    if torn is not None and not allow_torn:
        seq = count - 1
        checked = "verified" if verified else "well-formed (not verified)"
        raise TornCassette(
            f"{path}: the last line (seq {seq}, byte {torn}) is torn: the recording process "
            f"died while writing it. The {count} lines before it are {checked}. Resume "
            "the run to cut it (deja resume), or use the intact part (--allow-torn for deja "
            "replay, verify and fork; allow_torn=True in Python)",
            path=path, seq=seq, offset=torn)
    if body.end is None and not allow_incomplete and not (torn is not None and allow_torn):
        if not body.store.heads:
            raise CorruptCassette(
                f"{path} holds only its header: no observation and no end line (the run "
                "never got going, or everything after the header was cut off)", path=path,
                seq=0)
        last = len(body.store.heads) - 1
        raise CorruptCassette(
            f"{path}: no end line after seq {last}: the file was truncated or the run "
            "crashed. Resume the run, or allow an incomplete cassette (--allow-incomplete)",
            path=path, seq=last + 1)
