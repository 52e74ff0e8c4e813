"""The built-in rules: what looks like a secret, by name or by shape.

:mod:`recorder.capture.redact` says what is replaced and applies a run's rules; this module
is how the built-in ones find a secret and what they put in its place (:data:`REDACTED`):
the names (:data:`SECRET_HEADERS`, :data:`SECRET_QUERY`, the words that name a secret
value or a command-line option), one regular expression for the shapes, a second pass for
values named like secrets (:class:`_Scanner`), and ``RULES``, the number of the set.

This runs on every model request body, which repeats the conversation and so grows each
turn. The built-in rules are one compiled regular expression run over the raw bytes, and
a body that extends one scanned before (the next turn of a conversation) is only scanned
from where it differs: no rule looks past the third quote after where it starts, so what
the regex found in the shared prefix stays valid (see :class:`_Scanner`).
"""

from __future__ import annotations

import functools
import re
import threading
from collections import deque
from typing import Any

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


def _builtin_query(rules: int) -> frozenset[str]:
    return SECRET_QUERY if rules >= 2 else SECRET_QUERY_1


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
    # the words' last two letters, before the suffix: most separators stop here, before the
    # lookbehinds of every name are tried (a JSON body has a ':' after each of its keys)
    ending = "(?i:" + "|".join(sorted({word[-2:] for word in _NAME_WORDS})) + ")"
    quick = (rf"(?:(?<={ending}[:=])|(?<={ending}[\"' ][:=])"
             rf"|(?<={ending}\\\"[:=]))")
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
            if len(entry[0]) <= shared:  # it cannot share more (an earlier turn, say)
                continue
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


# ------------------------------------------------------------------ command lines


# Command-line options whose value is a secret: the last word of the option name (or the
# last two, for ``...-key``), e.g. --api-key, --github-token, --db-password, --auth.
_SECRET_WORDS = frozenset({"token", "secret", "password", "passwd", "pwd", "credential",
                           "credentials", "apikey", "auth"})
_KEY_QUALIFIERS = frozenset({"api", "access", "secret", "private", "signing", "auth",
                             "client", "license"})


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
