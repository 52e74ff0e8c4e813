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

This runs on every model request body, which repeats the conversation and so grows each
turn. The built-in rules are one compiled regular expression run over the raw bytes, and
a body that extends one scanned before (the next turn of a conversation) is only scanned
from where it differs: no rule looks past the third quote after where it starts, so what
the regex found in the shared prefix stays valid (see :class:`_Scanner`).
"""

from __future__ import annotations

import base64
import functools
import json
import re
import threading
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from recorder.errors import ConfigError

REDACTED = "[redacted]"
_MARK = REDACTED.encode("ascii")
_URL_MARK = b"%5Bredacted%5D"  # the marker in URL userinfo, where brackets would not parse

# The built-in rule set. 0: secret headers only (cassettes made before the other rules);
# 1: headers, URL userinfo, query parameters by name (SECRET_QUERY_1) and secret shapes;
# 2: also values named like secrets (JSON keys, ``name=value``, ``name: value``), more
# shapes (Slack app, Stripe webhook, Google OAuth, Hugging Face, npm, GitLab, PyPI tokens),
# ``Basic`` credentials, more query names (SECRET_QUERY) and ``-p PASSWORD`` in a command.
# A change to what the built-in rules replace in a request (a shape, a query name) changes
# fingerprints: it needs a new number, with the old rules kept for replaying older
# cassettes. SECRET_HEADERS may grow freely: headers are never fingerprinted.
RULES = 2

SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "cookie", "set-cookie", "api-key",
     "x-goog-api-key", "x-amz-security-token", "x-auth-token", "x-access-token",
     "x-csrf-token", "x-xsrf-token"})

# Query parameters (and form fields) whose value is a secret, compared without case: those
# of rules 1, and the current set.
SECRET_QUERY_1 = frozenset(
    {"key", "api_key", "api-key", "apikey", "access_token", "refresh_token", "id_token",
     "token", "auth", "auth_token", "password", "passwd", "pwd", "secret", "client_secret",
     "private_token", "session_token", "signature", "sig", "jwt", "x-amz-signature",
     "x-amz-credential", "x-amz-security-token", "x-goog-signature", "x-goog-credential"})
SECRET_QUERY = SECRET_QUERY_1 | {
    "access_key", "accesskey", "access-key", "secret_key", "secretkey", "secret-key",
    "api_token", "apitoken", "api-token", "passphrase", "private_key", "client_key",
    "oauth_token", "oauth_signature", "security_token", "x-api-key", "code_verifier"}

# Command-line options whose value is a secret: the last word of the option name (or the
# last two, for ``...-key``), e.g. --api-key, --github-token, --db-password, --auth.
_SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "pwd", "credential",
                           "credentials", "apikey", "auth"})
_KEY_QUALIFIERS = frozenset({"api", "access", "secret", "private", "signing", "auth",
                             "client", "license"})


# ------------------------------------------------------------------ the built-in regex
#
# Every branch of the built-in regex starts with one literal character, so that the regex
# engine skips quickly to the positions where one of them appears; rules are anchored on
# an uncommon character of their literal (the ``-`` of ``sk-``, the ``_`` of ``ghp_``) and
# look behind for the rest. A rule that keeps a part of its match (the ``sk-`` before the
# marker, the name of a query parameter) says so with groups ``c<n>`` (keep the anchor) or
# ``p<n>`` (keep the anchor and this group).

_RUN = r"[A-Za-z0-9_-]"


def _word(literal: str) -> str:
    """``literal``, just read, starts a word (a JSON escape such as ``\\n`` before it counts
    as a separator)."""
    return rf"(?:(?<![A-Za-z0-9_-]{literal})|(?<=\\[nrtbf]{literal}))"


def _named(names: frozenset[str]) -> list[str]:
    """Lookbehinds for ``[?&;]<name>=`` ending here, one per name length (a lookbehind has
    one width), without case."""
    by_length: dict[int, list[str]] = {}
    for name in sorted(names):
        by_length.setdefault(len(name), []).append(re.escape(name))
    return [rf"(?<=[?&;](?i:{'|'.join(group)})=)" for _, group in sorted(by_length.items())]


def _builtin_source(query: frozenset[str], rules: int = RULES) -> str:
    value = r"(?!\[redacted\])[^&#\s\"'<>\\]+"
    token = r"(?:[A-Za-z0-9._~+/-]{16,}|(?=[A-Za-z._~+/-]*[0-9])[A-Za-z0-9._~+/-]{8,})=*"
    dash = more_underscore = ""
    if rules >= 2:
        dash = (rf"|(?<=xapp-){_word('xapp-')}(?P<c7>)[A-Za-z0-9-]{{10,}}"  # Slack app
                rf"|(?<=glpat-){_word('glpat-')}(?P<c8>)[A-Za-z0-9_-]{{20,}}"  # GitLab
                rf"|(?<=pypi-){_word('pypi-')}(?P<c9>)AgE[A-Za-z0-9_-]{{40,}}")  # PyPI
        more_underscore = (
            rf"|(?<=whsec_){_word('whsec_')}(?P<c10>)[A-Za-z0-9+/=]{{16,}}"  # Stripe webhook
            rf"|(?<=hf_){_word('hf_')}(?P<c11>)[A-Za-z0-9]{{30,}}"  # Hugging Face
            rf"|(?<=npm_){_word('npm_')}(?P<c12>)[A-Za-z0-9]{{30,}}")  # npm
    branches = [
        # sk-ant-... (Anthropic), sk-... and sk-proj-... (OpenAI); xoxb-... (Slack); PEM keys
        "-(?:"
        rf"(?<=sk-){_word('sk-')}(?P<c1>)(?:ant-{_RUN}{{8,}}|{_RUN}{{20,}})"
        rf"|(?<=xox[abprs]-){_word('xox[abprs]-')}(?P<c2>)[A-Za-z0-9-]{{10,}}"
        rf"{dash}"
        r"|----BEGIN[A-Z ]{0,40}PRIVATE KEY-----(?:[^\"]*?-----END[A-Z ]{0,40}PRIVATE KEY-----"
        r"|(?:\\[nr]|[A-Za-z0-9+/= \t\r\n])*))",
        # sk_live_... (Stripe), ghp_... gho_... (GitHub), github_pat_..., and the value of
        # aws_secret_access_key = ... (in env, ini, JSON or escaped JSON; the name is kept)
        "_(?:"
        rf"(?<=[sr]k_){_word('[sr]k_')}(?P<c3>)(?:live|test)_[A-Za-z0-9]{{16,}}"
        rf"|(?<=gh[pousr]_){_word('gh[pousr]_')}(?P<c4>)[A-Za-z0-9]{{20,}}"
        rf"|(?<=github_){_word('github_')}(?P<c5>)pat_[A-Za-z0-9_]{{20,}}"
        rf"{more_underscore}"
        r"|(?<=[aA][wW][sS]_)(?P<p1>(?i:secret_access_key)\\?[\"']?[ \t]*[=:][ \t]*"
        r"\\?[\"']?)[A-Za-z0-9/+=]{16,})",
        # AKIA... ASIA... (AWS access key ids), AIza... (Google API keys)
        rf"A{_word('A')}(?:(?:KIA|SIA)[A-Z0-9]{{16}}(?![A-Za-z0-9])|Iza[0-9A-Za-z_-]{{30,}})",
        # JWTs: eyJ<header>.eyJ<payload>.<signature>
        rf"J(?<=eyJ){_word('eyJ')}(?P<c6>)[A-Za-z0-9_-]{{5,}}\.eyJ[A-Za-z0-9_-]{{5,}}"
        r"\.[A-Za-z0-9_-]*",
        rf"B(?P<p2>earer[ \t]+){token}",
        rf"b(?P<p4>earer[ \t]+){token}",  # as some clients and logs write it
        r"""/(?<=:/)(?P<p3>/)[^\s/?#@"'<>\\]+(?P<s1>@)""",        # URL userinfo
        # the value of a query parameter (or form field) named like a secret: ?key=...
        "=(?:" + "|".join(_named(query)) + rf"){value}",
    ]
    if rules >= 2:
        branches += [
            # ya29.... (Google OAuth access tokens)
            rf"\.(?<=ya29\.){_word('ya29[.]')}(?P<c13>)[A-Za-z0-9_-]{{20,}}",
            # Basic credentials: base64 of user:password, a whole number of quads, mixed
            rf"B(?P<k1>asic[ \t]+){_BASIC}",
            rf"b(?P<k2>asic[ \t]+){_BASIC}",
        ]
    return "|".join(branches)


# ``Basic <base64>``: at least two quads that look like base64 rather than a word (a digit,
# +, / or =, or a lower-case letter followed by an upper-case one), then not a base64 char.
_B64 = "[A-Za-z0-9+/]"
_BASIC = (rf"(?=[A-Za-z0-9+/]*(?:[0-9+/]|[a-z][A-Z])|(?:{_B64}{{4}})+{_B64}{{0,3}}=)"
          rf"(?:{_B64}{{4}}){{2,}}(?:{_B64}{{2}}==|{_B64}{{3}}=)?(?![A-Za-z0-9+/=])")

# Values named like secrets (rules 2): ``"password": "..."``, ``'client_secret': '...'``,
# ``SecretAccessKey=...``, ``api-key: ...``, ``DB_PASSWORD=...``, in JSON, escaped JSON,
# Python reprs, env files, headers written as text and prose. A second, small pass: its
# regex finds a ``:`` or ``=`` right after one of these words (and an optional closing
# quote or space) and the value after it; :func:`_named_replacement` then reads the whole
# name and decides. Being a pass of its own, a candidate it leaves alone never hides a
# secret shape from the first pass.
_NAME_WORDS = ("password", "passwd", "passphrase", "secret", "pwd", "credential",
               "credentials", "token", "auth", "authorization", "cookie", "key")
# Words that end any name (``PGPASSWORD``, ``clientsecret``, ``SecretAccessKey``) ...
_ANY_ENDING = ("password", "passwd", "passphrase", "secret")
# ... words that only count as a whole word: ``access_token``, ``sessionToken``, ``x-auth``
# (not ``mytoken``); ``key`` after one of these qualifiers (``api_key``, ``AccessKey``).
_WHOLE_WORDS = ("pwd", "credential", "credentials", "token", "auth", "authorization",
                "cookie")
_KEY_QUALIFIERS_2 = ("api", "access", "secret", "private", "signing", "client", "encryption",
                     "master", "account", "license", "auth", "subscription", "session")
# A token named by one of these is no secret: a page cursor, a tokenizer's special token.
_NOT_SECRET_TOKENS = frozenset({
    "page", "next", "prev", "previous", "continuation", "pagination", "sync", "cursor",
    "resume", "eos", "bos", "pad", "unk", "sep", "cls", "mask", "max", "min", "num", "total",
    "start", "end", "stop", "special", "input", "output", "cache", "cancellation",
    "reasoning"})
_SCHEMES = r"(?i:basic|bearer|token|digest|bot)[ \t]+"
_NAME_SPLIT = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|[0-9]+")


def _named_source() -> str:
    """The candidates of the second pass (groups: ``q`` the kept space and opening quote,
    ``v`` a quoted value; ``b`` the kept space and auth scheme, ``w`` a bare value)."""
    by_width: dict[int, list[str]] = {}
    for word in _NAME_WORDS:
        for suffix, extra in (('"', 1), ("'", 1), (r"\\\"", 2), ("", 0), (" ", 1)):
            by_width.setdefault(len(word) + extra, []).append(f"(?i:{word}){suffix}")
    names = "|".join(rf"(?<=(?:{'|'.join(g)})[:=])" for _, g in sorted(by_width.items()))
    ending = "dDeEtTyYsSlLnNhH"  # the words' last letters: most separators stop here
    quick = (rf"(?:(?<=[{ending}][:=])|(?<=[{ending}][\"' ][:=])"
             rf"|(?<=[{ending}]\\\"[:=]))")
    # possessive: a value is read once, in runs, and never given back
    quoted = r"(?!\[redacted\])(?:[^\"\\\n]++|\\[^\"\n])++"
    single = r"(?!\[redacted\])(?:[^'\\\n]++|\\[^'\n])++"
    bare = r"(?!\[redacted\])[^\s\"'<>\\&,;()\[\]{}]++"
    return (rf"[:=]{quick}(?:{names})(?:(?P<q>[ \t]*\\?\")(?P<v>{quoted})"
            rf"|(?P<q1>[ \t]*\\?')(?P<v1>{single})"
            rf"|(?P<b>[ \t]*(?:{_SCHEMES})?)(?!{_SCHEMES})(?P<w>{bare}))")


def _secret_name(name: str) -> str | None:
    """What a value named ``name`` must look like to be redacted: ``any`` value, a value
    that looks like a ``token`` (a bare ``token`` or ``auth``: 8 characters or more), an
    ``auth`` header's; None when the name is not a secret's."""
    lowered = name.lower()
    if lowered.endswith(_ANY_ENDING):
        return "any"
    words = [w.lower() for w in _NAME_SPLIT.findall(name)]
    if not words:
        return None
    last = words[-1]
    if last.endswith("key") and (last[:-3] in _KEY_QUALIFIERS_2 or (
            last == "key" and len(words) > 1 and words[-2] in _KEY_QUALIFIERS_2)):
        return "any"
    if last not in _WHOLE_WORDS:
        return None
    if last in ("token", "auth"):
        if len(words) == 1:
            return "token"
        return None if words[-2] in _NOT_SECRET_TOKENS else "any"
    return "auth" if last == "authorization" else last if last == "cookie" else "any"


def _named_replacement(m: re.Match[Any]) -> Any:
    """The second pass's replacement: the separator, the kept prefix and the marker when
    the name and the value are a secret's, else the match unchanged."""
    data = m.string
    binary = isinstance(data, (bytes, bytearray))
    start = m.start()
    before = data[max(0, start - 80):start]
    text = before.decode("latin-1") if binary else before
    quoted_name = text[-1:] in ("\"", "'")
    end = len(text) - (1 if quoted_name or text[-1:] == " " else 0)
    if quoted_name and text[end - 1:end] == "\\":
        end -= 1
    begin = end
    while begin > 0 and (text[begin - 1].isalnum() or text[begin - 1] in "_-.") \
            and text[begin - 1].isascii():
        begin -= 1
    kind = _secret_name(text[begin:end])
    found = m.groupdict()
    value = found["v"] if found["v"] is not None else found["v1"]
    kept = found["q"] if found["q"] is not None else found["q1"]
    if value is None:  # a bare value: after a bare name, one that looks like a secret
        value, kept = found["w"], found["b"]
        raw = value.decode("latin-1") if binary else value
        long_enough = 8 if kind == "token" else 1
        if quoted_name or kind == "cookie" or (kind != "auth" and not (
                len(raw) >= long_enough and (len(raw) >= 16 or any(c.isdigit() for c in raw)))):
            kind = None
        elif kind != "auth" and kept.strip():  # a scheme word only goes with authorization
            kind = None
    elif kind == "token":  # a bare "token": one word of 8 characters or more
        raw = value.decode("latin-1") if binary else value
        if len(raw) < 8 or any(c.isspace() for c in raw):
            kind = None
    if kind is None:
        return m.group(0)
    mark: Any = _MARK if binary else REDACTED
    return m.group(0)[:1] + kept + mark


_KEEP_ANCHOR = ("c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8", "c9", "c10", "c11", "c12",
                "c13")
_KEEP_PREFIX = ("p1", "p2", "p4")


@functools.lru_cache(maxsize=32)
def _compiled(query: frozenset[str], rules: int = RULES
              ) -> tuple[re.Pattern[bytes], re.Pattern[str], re.Pattern[bytes], re.Pattern[str]]:
    """(bytes, str) versions of the built-in regex, and of the form-field rule, which
    only applies at the very start of a text (a form-encoded body)."""
    source = _builtin_source(query, rules)
    names = "|".join(re.escape(n) for n in sorted(query, key=lambda n: (-len(n), n)))
    start = rf"(?P<p0>(?i:{names})=)(?!\[redacted\])[^&#\s\"'<>\\]+"
    return (re.compile(source.encode("ascii")), re.compile(source, re.ASCII),
            re.compile(start.encode("ascii")), re.compile(start, re.ASCII))


def _replacement(m: re.Match[Any]) -> Any:
    """The marker, with what the rule keeps (an anchor, a name, a scheme) around it."""
    mark: Any = _MARK if isinstance(m.string, (bytes, bytearray)) else REDACTED
    found = {k: v for k, v in m.groupdict().items() if v is not None}
    if "p0" in found:
        return found["p0"] + mark
    anchor = m.group(0)[:1]
    if "s1" in found:  # userinfo: the marker as a URL spells it, so the URL still parses
        url_mark: Any = _URL_MARK if isinstance(mark, bytes) else _URL_MARK.decode("ascii")
        return anchor + found["p3"] + url_mark + found["s1"]
    for name, kept in found.items():
        if name[0] == "k":  # rules 2: a separator (and its quote or scheme) kept
            return anchor + kept + mark
    for name in _KEEP_PREFIX:
        if name in found:
            return anchor + found[name] + mark
    if any(name in found for name in _KEEP_ANCHOR) or anchor in ("=", b"="):
        return anchor + mark
    return mark


@functools.lru_cache(maxsize=1)
def _named_compiled() -> tuple[re.Pattern[bytes], re.Pattern[str]]:
    source = _named_source()
    return re.compile(source.encode("ascii")), re.compile(source, re.ASCII)


class _Pass:
    """One regex pass over bytes, with a memory of recently scanned texts.

    A model request repeats the conversation before it, so most of a body's bytes were
    already scanned a turn ago. No built-in rule reads past the third quote after the
    position where it starts (their character classes exclude the quote; only the
    ``aws_secret_access_key": "`` prefix crosses two; a named value reads two), and what a
    match is replaced with depends only on what precedes its end: so the matches that
    start before the third-last quote of the prefix two texts share are the same in both.
    They are reused, and the scan resumes from there. The result is exactly that of a
    full scan.
    """

    MEMORY = 4  # recent texts to compare a new one with (conversations may interleave)
    MIN_SHARED = 2048  # below this a full scan is as cheap as comparing
    _CHUNK = 8192

    def __init__(self, pattern: re.Pattern[bytes], replace: Any) -> None:
        self.pattern, self.replace = pattern, replace
        self._lock = threading.Lock()
        self._recent: deque[tuple[bytes, list[tuple[int, int, bytes]]]] = deque(
            maxlen=self.MEMORY)

    def find(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """(start, end, replacement) of each match that changes something."""
        return [found for m in self.pattern.finditer(data)
                if (found := (m.start(), m.end(), self.replace(m)))[2] != m.group(0)]

    def apply(self, data: bytes, *, remember: bool = False) -> bytes:
        if not remember or len(data) < self.MIN_SHARED:
            return self.pattern.sub(self.replace, data)
        matches = self._matches(data)
        if not matches:
            return data
        parts, pos = [], 0
        for start, end, repl in matches:
            parts += [data[pos:start], repl]
            pos = end
        parts.append(data[pos:])
        return b"".join(parts)

    def _matches(self, data: bytes) -> list[tuple[int, int, bytes]]:
        with self._lock:
            recent = list(self._recent)
        best, shared = None, 0
        for entry in reversed(recent):
            n = _shared_prefix(entry[0], data, self._CHUNK)
            if n > shared:
                best, shared = entry, n
        kept: list[tuple[int, int, bytes]] = []
        resume = 0
        if best is not None and shared >= self.MIN_SHARED:
            safe = shared
            for _ in range(3):  # the third-last quote of the shared prefix
                safe = data.rfind(b'"', 0, safe)
                if safe < 0:
                    break
            if safe > 0:
                kept = [m for m in best[1] if m[0] < safe]
                resume = max(safe, kept[-1][1]) if kept else safe
        found = kept + [(m.start(), m.end(), self.replace(m))
                        for m in self.pattern.finditer(data, resume)]
        with self._lock:
            self._recent.append((data, found))
        return found


class _Scanner:
    """The built-in rules: the first pass (shapes, names of headers and query parameters,
    userinfo), the form-field rule at the very start of a text, and with rules 2 the
    second pass (values named like secrets)."""

    def __init__(self, query: frozenset[str], rules: int = RULES) -> None:
        self.pattern, self._str, self._start_bytes, self._start_str = _compiled(query, rules)
        self.passes = [_Pass(self.pattern, _replacement)]
        self._named_str: re.Pattern[str] | None = None
        if rules >= 2:
            named, self._named_str = _named_compiled()
            self.passes.append(_Pass(named, _named_replacement))

    def text(self, text: str) -> str:
        out = self._str.sub(_replacement, text)
        m = self._start_str.match(out)
        if m is not None:
            out = _replacement(m) + out[m.end():]
        if self._named_str is not None:
            out = self._named_str.sub(_named_replacement, out)
        return out

    def data(self, data: bytes, *, remember: bool = False) -> bytes:
        out = self.passes[0].apply(data, remember=remember)
        m = self._start_bytes.match(out)
        if m is not None:
            out = _replacement(m) + out[m.end():]
        for later in self.passes[1:]:
            out = later.apply(out, remember=remember)
        return out


def _shared_prefix(a: bytes, b: bytes, chunk: int) -> int:
    """The length of the common prefix of ``a`` and ``b`` (compared a chunk at a time)."""
    n = min(len(a), len(b))
    pos = 0
    while pos < n and a[pos:pos + chunk] == b[pos:pos + chunk]:
        pos += chunk
    if pos >= n:
        return n
    hi = min(pos + chunk, n)
    if a[pos:hi] == b[pos:hi]:  # the shorter one ends inside this chunk
        return hi
    lo = pos  # a[:lo] == b[:lo], and they differ before hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@functools.lru_cache(maxsize=32)
def _scanner(query: frozenset[str], rules: int) -> _Scanner:
    return _Scanner(query, rules)


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
        pairs = [[k, REDACTED if k.lower() in self.headers else v] for k, v in headers]
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
        stream's assembled deltas included; a gzip or deflate body is redacted decoded
        and encoded again), ``content-length`` matching what is stored."""
        if not body or not (self.rules or self._patterns_re):
            return body, headers
        lowered = {k.lower(): v for k, v in headers}
        coding = lowered.get("content-encoding", "").strip().lower()
        if coding in ("", "identity"):
            plain = body
        elif coding in ("gzip", "x-gzip", "deflate"):
            try:
                plain = _decompress(body, coding)
            except zlib.error:
                return body, headers
        else:  # br, zstd: not readable here; stored as received
            return body, headers
        clean = plain
        if "event-stream" in lowered.get("content-type", ""):
            clean = self._sse(clean)  # first: a piece alone may hold only part of a secret
        clean = self.data(clean)
        if clean == plain:
            return body, headers
        stored = clean if plain is body else _compress(clean, coding)
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

        values = [spans for name in providers.names()
                  for spans in providers.get(name).stream_pieces(data)]
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


def _decompress(body: bytes, coding: str) -> bytes:
    if coding == "deflate":
        try:
            return zlib.decompress(body)
        except zlib.error:
            return zlib.decompress(body, -zlib.MAX_WBITS)
    return zlib.decompress(body, 16 + zlib.MAX_WBITS)


def _compress(body: bytes, coding: str) -> bytes:
    if coding == "deflate":
        return zlib.compress(body)
    import gzip

    return gzip.compress(body, mtime=0)


def _builtin_query(rules: int) -> frozenset[str]:
    return SECRET_QUERY if rules >= 2 else SECRET_QUERY_1


def _password_like(value: str) -> bool:
    """Is the word after ``-p`` a password (``-p hunter2``, ``-pS3cret``) rather than a port,
    a count, a path or a plugin (``-p 8080:80``, ``-p 4``, ``-p no:cacheprovider``)?"""
    return (6 <= len(value) <= 256 and not value.startswith("-") and "/" not in value
            and not value.startswith("no:") and any(c.isalpha() for c in value)
            and any(c.isdigit() for c in value) and not any(c.isspace() for c in value))


def _secret_option(name: str) -> bool:
    words = [w for w in re.split(r"[-_.]+", name.lstrip("-").lower()) if w]
    if not words:
        return False
    if words[-1] in _SECRET_WORDS:
        return True
    return words[-1] == "key" and len(words) >= 2 and words[-2] in _KEY_QUALIFIERS


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
