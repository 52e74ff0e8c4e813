"""What never reaches disk: secrets, found by name or by shape, replaced before any write.

A cassette, the index built from it and a run's status record hold everything an agent
sent and received, and they get committed, attached to issues and copied between
machines. So a secret is replaced by ``[redacted]`` before anything is written, wherever
it turns up:

- **headers by name**: ``authorization``, ``x-api-key``, cookies, ... (:data:`SECRET_HEADERS`)
  plus any configured header; the whole value goes;
- **URL userinfo**: ``https://user:pass@host`` becomes ``https://%5Bredacted%5D@host`` (the
  marker, percent-encoded so that the URL still parses);
- **query parameters by name**: ``?key=``, ``&access_token=``, ``X-Amz-Signature=`` ...
  (:data:`SECRET_QUERY` plus configured names, any case); the value goes, in URLs and in
  form-encoded text alike;
- **well-known secret shapes, anywhere in any text**: Anthropic and OpenAI keys (``sk-``),
  AWS access key ids (``AKIA``/``ASIA``) and secret keys written as
  ``aws_secret_access_key=...``, GitHub tokens (``ghp_`` ... ``github_pat_``), Google API
  keys (``AIza``), Slack tokens (``xoxb-`` ...), Stripe keys, JWTs, ``Bearer <token>`` and
  PEM private key blocks;
- **configured patterns** (regular expressions; a pattern with a capturing group has only
  that group replaced) and **JSON pointers** into JSON request bodies.

The same rules run on request and response bodies (SSE streams included: a secret that
the model streams in pieces across several deltas is found in the assembled text and
taken out of every piece), URLs, header values, tool arguments, results and errors,
effect values, control lines, the launch command and the status record.

Replacing is idempotent (redacting a redacted text changes nothing) and keeps JSON text
valid: the marker holds no quote or backslash, and no rule matches across a quote or
inside an escape sequence. Recording and replay redact a request the same way before
computing its fingerprint, so a redacted call still matches; the cassette header names
the rules (:meth:`Redaction.to_header`, never a value) and a replay applies exactly those.
``RULES`` numbers the built-in rule set, so that a cassette recorded before a rule
existed is matched without it.

The built-in rules (what looks like a secret, and how it is found fast in a long body)
are :mod:`recorder.capture._secrets`; this module holds the rules of a run and applies
them.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from recorder.canonical import CODINGS, CodingError, compress, content_coding, decompress
from recorder.capture._secrets import (
    _MARK,
    REDACTED,
    RULES,
    SECRET_HEADERS,
    SECRET_QUERY,
    _builtin_query,
    _password_like,
    _Scanner,
    _scanner,
    _secret_option,
)
from recorder.errors import ConfigError

# ------------------------------------------------------------------ configured patterns


def compile_patterns(patterns: Iterable[str], *, where: str = "redact pattern"
                     ) -> tuple[re.Pattern[str], ...]:
    """Compile configured patterns; a bad one is a ConfigError naming it."""
    out = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{where} {pattern!r} must be a non-empty string (a regular "
                              "expression)")
        try:
            out.append(re.compile(pattern))
        except re.error as exc:
            raise ConfigError(f"{where} {pattern!r} is not a valid regular expression: "
                              f"{exc}") from None
    return tuple(out)


def _pattern_sub(pattern: re.Pattern[str], text: str) -> str:
    if not pattern.groups:
        return pattern.sub(REDACTED, text)

    def keep_outside(m: re.Match[str]) -> str:
        start, end = m.span(1)
        if start < 0:
            return m.group(0)
        return m.string[m.start():start] + REDACTED + m.string[end:m.end()]

    return pattern.sub(keep_outside, text)


# ------------------------------------------------------------------ the rules of a run


@dataclass(frozen=True)
class Redaction:
    """The redaction rules of one run: built in (``rules``) plus configured ones."""

    headers: frozenset[str] = SECRET_HEADERS
    body_paths: tuple[str, ...] = ()  # JSON pointers, e.g. "/metadata/user_id"
    patterns: tuple[str, ...] = ()  # regular expressions
    query: frozenset[str] = SECRET_QUERY
    rules: int = RULES
    _patterns_re: tuple[re.Pattern[str], ...] = field(default=(), init=False, repr=False,
                                                   compare=False)

    def __post_init__(self) -> None:
        if self.rules not in range(RULES + 1) or isinstance(self.rules, bool):
            raise ConfigError(f"redaction rules version {self.rules} is not known to this "
                              f"deja (it applies versions 0-{RULES}); upgrade deja to "
                              "replay this cassette")
        object.__setattr__(self, "_patterns_re", compile_patterns(self.patterns))

    @classmethod
    def of(cls, headers: Iterable[str] = (), body_paths: Iterable[str] = (),
           patterns: Iterable[str] = (), query: Iterable[str] = ()) -> Redaction:
        """The built-in rules plus these; anything malformed is a ConfigError."""
        return cls._of(headers, body_paths, patterns, query, RULES)

    @classmethod
    def _of(cls, headers: Iterable[str], body_paths: Iterable[str], patterns: Iterable[str],
            query: Iterable[str], rules: int) -> Redaction:
        headers, body_paths = list(headers), list(body_paths)
        patterns, query = list(patterns), list(query)
        for what, items in (("header", headers), ("query parameter", query)):
            for item in items:
                if not isinstance(item, str) or not item.strip():
                    raise ConfigError(f"redact {what} {item!r} must be a non-empty name")
        for pointer in body_paths:
            if not isinstance(pointer, str) or not pointer.startswith("/"):
                raise ConfigError(f"redact body path {pointer!r} must be a JSON pointer "
                                  "such as /metadata/user_id")
        return cls(SECRET_HEADERS | {h.strip().lower() for h in headers},
                   tuple(dict.fromkeys(body_paths)), tuple(dict.fromkeys(patterns)),
                   _builtin_query(rules) | {q.strip().lower() for q in query}, rules=rules)

    @classmethod
    def from_header(cls, redact: dict[str, Any] | None) -> Redaction:
        """The rules a cassette was recorded with (its header's ``redact``); a header
        without ``rules`` predates the built-in shapes and is replayed without them."""
        redact = redact if isinstance(redact, dict) else {}
        rules = redact.get("rules", 0)
        if rules not in range(RULES + 1) or isinstance(rules, bool):
            return cls(rules=rules)  # refused, with the message saying why
        return cls._of(redact.get("headers", ()), redact.get("body_paths", ()),
                       redact.get("patterns", ()), redact.get("query", ()), rules)

    def latest(self) -> Redaction:
        """These rules with today's built-in ones (what is shown or exported from an older
        cassette: nothing is matched against it)."""
        return Redaction.of(self.headers - SECRET_HEADERS, self.body_paths, self.patterns,
                            self.query - _builtin_query(self.rules))

    def to_header(self) -> dict[str, Any]:
        """Names and patterns, never a value: what a replay needs to redact the same way."""
        return {"headers": sorted(self.headers - SECRET_HEADERS),
                "body_paths": list(self.body_paths), "patterns": list(self.patterns),
                "query": sorted(self.query - _builtin_query(self.rules)), "rules": self.rules}

    # -- applying them

    @property
    def _scanner(self) -> _Scanner | None:
        return _scanner(self.query, self.rules) if self.rules >= 1 else None

    def text(self, text: str) -> str:
        """``text`` with every secret replaced."""
        scanner = self._scanner
        if scanner is not None:
            text = scanner.text(text)
        for pattern in self._patterns_re:
            text = _pattern_sub(pattern, text)
        return text

    def data(self, data: bytes, *, remember: bool = False) -> bytes:
        """Raw bytes with every secret replaced (UTF-8, else read byte for byte).

        ``remember`` keeps the text for a later one that extends it (model requests).
        """
        if not data:
            return data
        scanner = self._scanner
        if scanner is not None:
            data = scanner.data(data, remember=remember)
        if self._patterns_re:
            try:
                text, codec = data.decode("utf-8"), "utf-8"
            except UnicodeDecodeError:
                text, codec = data.decode("latin-1"), "latin-1"
            redacted = text
            for pattern in self._patterns_re:
                redacted = _pattern_sub(pattern, redacted)
            if redacted != text:
                data = redacted.encode(codec, "surrogateescape")
        return data

    def url(self, url: str) -> str:
        return self.text(url) if (self.rules or self._patterns_re) else url

    def header_pairs(self, headers: Iterable[tuple[str, str]]) -> list[list[str]]:
        """Headers as stored: secret ones by name, secrets in any other by shape."""
        pairs = [[k, (_set_cookie(v) if k.lower() == "set-cookie" else REDACTED)
                  if k.lower() in self.headers else v] for k, v in headers]
        if self.rules or self._patterns_re:
            joined = "\n".join(v for _, v in pairs)
            if self.text(joined) != joined:
                pairs = [[k, self.text(v)] for k, v in pairs]
        return pairs

    def body(self, body: Any) -> Any:
        """A parsed JSON body with the configured JSON pointers redacted."""
        if not self.body_paths or not isinstance(body, (dict, list)):
            return body
        body = json.loads(json.dumps(body))
        for pointer in self.body_paths:
            _redact_pointer(body, pointer)
        return body

    def value(self, value: Any) -> Any:
        """A JSON-like value (tool arguments, results, effect values, control details)
        with every secret in its strings replaced, keys and ``$bytes`` included."""
        if not (self.rules or self._patterns_re):
            return value
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            return self._walk(value)
        if '"$bytes"' in text:
            return self._walk(value)
        redacted = self.text(text)
        if redacted == text:
            return value
        try:
            return json.loads(redacted)
        except ValueError:  # a configured pattern matched across JSON syntax
            return self._walk(value)

    def _walk(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self._walk(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self._walk(v) for v in value)
        if isinstance(value, dict):
            if len(value) == 1 and isinstance(value.get("$bytes"), str):
                try:
                    raw = base64.b64decode(value["$bytes"], validate=True)
                except ValueError:
                    return {"$bytes": self.text(value["$bytes"])}
                clean = self.data(raw)
                return value if clean == raw else {
                    "$bytes": base64.b64encode(clean).decode("ascii")}
            return {(self.text(k) if isinstance(k, str) else k): self._walk(v)
                    for k, v in value.items()}
        return value

    def json_text(self, text: str) -> str:
        """JSON text with every secret replaced, still valid JSON."""
        redacted = self.text(text)
        if redacted == text:
            return text
        try:
            json.loads(redacted)
            return redacted
        except ValueError:
            return json.dumps(self._walk(json.loads(text)), ensure_ascii=False)

    def argv(self, argv: Iterable[str]) -> list[str]:
        """A command line with secrets replaced: by shape, and the values of options
        named like secrets (``--api-key X``, ``--token=X``, ``DB_PASSWORD=X``, and with
        rules 2 ``-p X`` / ``-pX`` when X looks like a password rather than a port, a
        count, a path or a plugin)."""
        out: list[str] = []
        secret_next = password_next = False
        for arg in argv:
            arg = str(arg)
            if (secret_next and not arg.startswith("-")) or (password_next
                                                             and _password_like(arg)):
                out.append(REDACTED)
                secret_next = password_next = False
                continue
            secret_next = password_next = False
            if self.rules >= 2 and arg.startswith("-p") and not arg.startswith("--"):
                if arg == "-p":  # mysql -p PASSWORD, sshpass -p PASSWORD
                    password_next = True
                elif _password_like(arg[2:]):  # mysql -pPASSWORD
                    out.append(f"-p{REDACTED}")
                    continue
            name, sep, value = arg.partition("=")
            if sep and value and _secret_option(name):
                out.append(f"{name}={REDACTED}")
                continue
            if arg.startswith("-") and not sep and _secret_option(arg):
                secret_next = True
            out.append(self.text(arg) if self.rules or self._patterns_re else arg)
        return out

    def response_body(self, body: bytes, headers: list[tuple[str, str]]
                      ) -> tuple[bytes, list[tuple[str, str]]]:
        """A response body and its headers as stored: secrets out of the body (an SSE
        stream's assembled deltas included; a gzip, deflate, br or zstd body is redacted
        decoded and encoded again), ``content-length`` matching what is stored.

        A body that does not decompress as its header says, or one in a coding deja does
        not read that is UTF-8 text, is redacted as it is (a client that decodes a body
        itself, requests, urllib3 or aiohttp, has it compressed again before it gets
        here: :mod:`recorder.capture.vcr`)."""
        if not body or not (self.rules or self._patterns_re):
            return body, headers
        coding = content_coding(headers)
        plain = body
        if coding in CODINGS:
            try:
                plain = decompress(body, coding)
            except CodingError:
                pass
        elif coding not in ("", "identity") and not _is_text(body):
            return body, headers  # a coding deja cannot read: stored as received
        from recorder import providers

        # A stream is read as its text (its events, whatever the framing), redacted there
        # and framed again: a piece alone may hold only part of a secret, and a binary
        # framing (Bedrock's) hides text from a scan of its bytes.
        carriage = providers.stream_carriage(headers)
        view = carriage.view(plain) if carriage is not None else plain
        clean = self.data(self._sse(view) if carriage is not None else view)
        if clean == view:
            return body, headers
        if carriage is not None:
            clean = carriage.restream(plain, clean)
        stored = clean if plain is body else compress(clean, coding)
        fixed = [(k, str(len(stored)) if k.lower() == "content-length" else v)
                 for k, v in headers]
        return stored, fixed

    # -- SSE: secrets streamed in pieces

    def _finders(self) -> list[Any]:
        finders: list[Any] = []
        scanner = self._scanner
        if scanner is not None:
            finders.extend(one.find for one in scanner.passes)
        finders.extend(functools.partial(_pattern_spans, p) for p in self._patterns_re)
        return finders

    def _sse(self, data: bytes) -> bytes:
        """Take out secrets that only show once a streamed value's pieces are joined (a
        content block's deltas, a choice's content chunks, a tool call's arguments): each
        provider says where its stream's pieces are (``Provider.stream_pieces``)."""
        from recorder import providers

        values = [spans for form in providers.formats() for spans in form.stream_pieces(data)]
        edits: list[tuple[int, int, bytes]] = []
        for spans in values:
            if len(spans) < 2:
                continue
            original = pieces = [data[s:e] for s, e in spans]
            for find in self._finders():
                found = [f for f in find(b"".join(pieces)) if f[1] > f[0]]
                if found:
                    pieces = _spread(pieces, found)
            for (start, end), old, new in zip(spans, original, pieces, strict=True):
                if new != old:
                    try:
                        json.loads(b'"' + new + b'"')
                    except ValueError:  # a configured pattern cut an escape sequence
                        new = _MARK
                    edits.append((start, end, new))
        if not edits:
            return data
        parts, pos = [], 0
        for start, end, new in sorted(edits):
            parts += [data[pos:start], new]
            pos = end
        parts.append(data[pos:])
        return b"".join(parts)


def _spread(pieces: list[bytes], found: list[tuple[int, int, bytes]]) -> list[bytes]:
    """Apply replacements found in the joined ``pieces`` to the pieces themselves: the
    piece where a replaced stretch starts gets the replacement, the others lose their
    share of the stretch."""
    out, a = [], 0
    for piece in pieces:
        b = a + len(piece)
        new, pos = bytearray(), a
        for start, end, repl in found:
            if end <= a or start >= b:
                continue
            if start >= a:
                new += piece[pos - a:start - a]
                new += repl
            pos = min(end, b)
        new += piece[pos - a:]
        out.append(bytes(new))
        a = b
    return out


def _pattern_spans(pattern: re.Pattern[str], data: bytes) -> list[tuple[int, int, bytes]]:
    """Where a configured pattern matches in ``data``, in bytes, with its replacement."""
    try:
        text, codec = data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, codec = data.decode("latin-1"), "latin-1"
    out = []
    for m in pattern.finditer(text):
        if pattern.groups and m.start(1) >= 0:
            repl = text[m.start():m.start(1)] + REDACTED + text[m.end(1):m.end()]
        elif pattern.groups:
            continue
        else:
            repl = REDACTED
        start = len(text[:m.start()].encode(codec, "surrogateescape"))
        end = start + len(m.group(0).encode(codec, "surrogateescape"))
        out.append((start, end, repl.encode(codec, "surrogateescape")))
    return out


_FOLDED = re.compile(r",\s*[^\s;,=]+=")  # a second cookie after a comma (not Expires')


def _set_cookie(value: str) -> str:
    """A ``Set-Cookie`` header with its cookie's value redacted and its name and attributes
    kept: a client reads it as the cookie it set, valued ``[redacted]`` (the whole header
    redacted made a cookie named ``[redacted]``, which httpx's cookie mapping could not
    read back)."""
    pair, sep, attributes = value.partition(";")
    name, equals, _ = pair.partition("=")
    if not equals or not name.strip() or _FOLDED.search(value):
        return REDACTED  # no name, or cookies folded into one header: all of it
    return f"{name}={REDACTED}{sep}{attributes}"


def _is_text(body: bytes) -> bool:
    """Is ``body`` UTF-8 text (compressed bytes, past a few, hardly ever are)?"""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _redact_pointer(doc: Any, pointer: str) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.strip("/").split("/")]
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return
    last = parts[-1]
    if isinstance(node, dict) and last in node:
        node[last] = REDACTED
    elif isinstance(node, list) and last.isdigit() and int(last) < len(node):
        node[int(last)] = REDACTED


NONE = Redaction(rules=0)  # secret headers only: cassettes recorded before the other rules
DEFAULT = Redaction()
