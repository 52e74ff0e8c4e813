"""Reading a cassette: parse every line, verify the chain, restore the compact fields."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recorder.cassette import _compact, _delta, _validate, trust
from recorder.cassette.format import KINDS, READABLE_FORMATS
from recorder.cassette.keys import Keyring, load_keyring
from recorder.cassette.signing import check_sig
from recorder.errors import (
    CassetteNotFound,
    CorruptCassette,
    SignatureError,
    TornCassette,
    UnsupportedFormat,
)


@dataclass(frozen=True)
class Cassette:
    """A loaded cassette: header, observations (``end`` excluded) and what loading found."""

    path: Path
    header: dict[str, Any]
    observations: tuple[dict[str, Any], ...]
    end: dict[str, Any] | None
    verified: bool
    verify_note: str
    torn_offset: int | None = None
    requests: dict[int, Any] = field(default_factory=dict, repr=False)
    sigs: tuple[str, ...] = field(default=(), repr=False)  # header's first, then each line's
    size: int = 0  # bytes in the file when it was read
    end_offset: int | None = None  # where the end line starts

    @property
    def run(self) -> str:
        return str(self.header.get("run"))

    def request_of(self, seq: int) -> Any:
        """The full request body of the model observation ``seq``."""
        return self.requests[seq]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.observations)

    def __len__(self) -> int:
        return len(self.observations)


def _lines(path: Path) -> tuple[list[tuple[int, bytes]], int | None, int]:
    """Split the file into (offset, line) pairs; the offset of a torn last line, if any;
    the file's size."""
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise CorruptCassette(f"{path} is a directory, not a cassette file", path=path) from None
    except OSError as exc:
        raise CorruptCassette(f"cannot read {path}: {exc.strerror or exc}", path=path) from None
    out: list[tuple[int, bytes]] = []
    pos = 0
    torn: int | None = None
    while pos < len(data):
        nl = data.find(b"\n", pos)
        if nl < 0:
            torn = pos
            break
        out.append((pos, data[pos:nl]))
        pos = nl + 1
    return out, torn, len(data)


def _signed(key: bytes, prev: str, line: dict[str, Any], sig: object, path: Path,
            seq: int | None) -> bool:
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


def _chain(lines: list[tuple[int, bytes]], path: Path, header_sig: object
           ) -> Iterator[tuple[str, dict[str, Any], object]]:
    """Each observation line (without its sig) with the stored sig of the line before it
    and its own, for the trust decision; stops at the first line that cannot be read."""
    prev = header_sig
    for index, (_, raw) in enumerate(lines[1:], start=1):
        try:
            line = _validate.parse_line(raw, path, f"line {index + 1}", index - 1)
        except CorruptCassette:
            return
        if not isinstance(line, dict):
            return
        sig = line.pop("sig", None)
        if isinstance(prev, str):
            yield prev, line, sig
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
    try:
        names = sorted(p.name for p in folder.iterdir() if p.suffix == ".jsonl")
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
    see :mod:`recorder.cassette.trust`. The structure (strict JSON, field types, dense seq, kinds,
    one end line at the end) is always checked. A torn last line is refused unless
    ``allow_torn``; a missing end line unless ``allow_incomplete``.
    """
    path = Path(path)
    if keyring is None:
        keyring = load_keyring(create=False)
    if allow_unverified is None:
        allow_unverified = trust.allow_unverified_from_env()
    if not path.is_file():
        raise _not_found(path)
    lines, torn, size = _lines(path)
    if not lines:
        if torn is not None:
            raise TornCassette(f"{path}: the header line is torn (the recording crashed while "
                               "starting); nothing can be replayed", path=path, offset=0)
        raise CorruptCassette(f"{path} is empty; it is not a deja cassette", path=path)
    try:
        header = _validate.parse_line(lines[0][1], path, "line 1 (the header)", None)
    except CorruptCassette as exc:
        raise CorruptCassette(f"{exc}; not a deja cassette", path=path) from None
    if not isinstance(header, dict) or "format" not in header:
        raise CorruptCassette(f"{path}: line 1 has no 'format' field; not a deja cassette",
                              path=path)
    if not isinstance(header["format"], str) or header["format"] not in READABLE_FORMATS:
        raise UnsupportedFormat(
            f"{path}: cassette format {header['format']!r} is not supported by this deja "
            f"(it reads {', '.join(READABLE_FORMATS)}); upgrade deja to read it", path=path)
    header_sig = header.pop("sig", None)
    _validate.check_header(header, path)
    verdict = trust.decide(path, header, header_sig, lambda: _chain(lines, path, header_sig),
                           keyring, check_sig, allow_unverified=allow_unverified,
                           require_signature=require_signature)
    key = verdict.key
    if key is not None and not _signed(key, "", header, header_sig, path, None):
        raise SignatureError(
            f"{path}: signature check failed at the header (line 1): it was edited after "
            "it was written. Do not trust this cassette; restore it from where it was "
            "committed", path=path, seq=None)
    prev = header_sig if isinstance(header_sig, str) else ""
    observations: list[dict[str, Any]] = []
    end: dict[str, Any] | None = None
    end_offset: int | None = None
    requests: dict[int, Any] = {}
    sigs: list[str] = [prev]
    for index, (offset, raw) in enumerate(lines[1:], start=1):
        seq = index - 1
        line = _validate.parse_line(raw, path, f"line {index + 1} (seq {seq})", seq)
        sig = line.pop("sig", None) if isinstance(line, dict) else None
        if key is not None:
            if not _signed(key, prev, line, sig, path, seq):
                raise SignatureError(
                    f"{path}: signature check failed at seq {seq} (line {index + 1}): the "
                    "line was edited, inserted, deleted or moved after it was written. Do "
                    "not trust this cassette; restore it from where it was committed",
                    path=path, seq=seq)
        prev = sig if isinstance(sig, str) else ""
        sigs.append(prev)
        if not isinstance(line, dict) or line.get("seq") != seq:
            got = line.get("seq") if isinstance(line, dict) else None
            raise CorruptCassette(f"{path}: line {index + 1} has seq {got!r}, expected {seq}: "
                                  "lines were deleted, inserted or reordered", path=path, seq=seq)
        if not isinstance(line.get("kind"), str) or line["kind"] not in KINDS:
            raise CorruptCassette(f"{path}: seq {seq} has unknown kind {line.get('kind')!r}",
                                  path=path, seq=seq)
        if end is not None:
            raise CorruptCassette(f"{path}: seq {seq} follows the end line (seq {end['seq']})",
                                  path=path, seq=seq)
        _validate.check_line(line, path, seq)
        if line["kind"] == "end":
            end, end_offset = line, offset
            continue
        if line["kind"] == "model":
            try:
                requests[seq] = _delta.decode(line["request"], requests)
                _compact.expand(line, observations, requests.get(seq))
            except (KeyError, IndexError, TypeError, ValueError, AttributeError,
                    RecursionError) as exc:
                raise CorruptCassette(f"{path}: seq {seq}: it refers to an earlier line that "
                                      f"is missing or different ({exc!r})", path=path,
                                      seq=seq) from None
        observations.append(line)
    if torn is not None and not allow_torn:
        seq = len(lines) - 1
        checked = "verified" if key is not None else "well-formed (not verified)"
        raise TornCassette(
            f"{path}: the last line (seq {seq}, byte {torn}) is torn: the recording process "
            f"died while writing it. The {len(lines)} lines before it are {checked}. Resume "
            "the run to cut it (deja resume), or use the intact part (--allow-torn for deja "
            "replay, verify and fork; allow_torn=True in Python)",
            path=path, seq=seq, offset=torn)
    if end is None and not allow_incomplete and not (torn is not None and allow_torn):
        if not observations:
            raise CorruptCassette(
                f"{path} holds only its header: no observation and no end line (the run "
                "never got going, or everything after the header was cut off)", path=path,
                seq=0)
        last = len(observations) - 1
        raise CorruptCassette(
            f"{path}: no end line after seq {last}: the file was truncated or the run "
            "crashed. Resume the run, or allow an incomplete cassette (--allow-incomplete)",
            path=path, seq=last + 1)
    return Cassette(path=path, header=header, observations=tuple(observations), end=end,
                    verified=key is not None, verify_note=verdict.note, torn_offset=torn,
                    requests=requests, sigs=tuple(sigs), size=size, end_offset=end_offset)
