"""Who may call ``deja serve``, and what a request body may hold.

``deja serve`` makes a worker run commands, so a request must come from someone who could
run them anyway: deja's own commands, or a script of the user who owns the install. A
web page must not be able to drive it, neither directly (a cross-origin ``fetch``, an
HTML form) nor by DNS rebinding (a page of ``attacker.example`` whose name is made to
resolve to 127.0.0.1), and neither may another user of the machine. Each request is
checked, in this order:

1. ``Host`` names this server: a loopback name (``localhost``, ``127.0.0.1``, ``[::1]``,
   any port), the address it binds, a name given with ``--allowed-host``, or, bound to
   every address (``0.0.0.0``), any IP address (an address cannot be rebound). Else
   **421** ``MisdirectedRequest``: a rebound page names its own host.
2. A browser's request comes from this server's own origin: an ``Origin`` header must
   equal the ``Host`` (scheme aside), and ``Sec-Fetch-Site``, when sent, must be
   ``same-origin`` or ``none``. Else **403** ``ForeignOrigin``. No answer carries a CORS
   header, so no other page can read one.
3. The route exists (**404**, **405**); ``/healthz`` stops here.
4. ``Authorization: Bearer TOKEN`` holds the server's token (compared in constant time),
   on loopback too: the per-install token of :mod:`deja.runs.auth`, or ``--token``. Else
   **401** ``Unauthorized``. Another user cannot read the token file.
5. A ``POST`` says ``Content-Type: application/json``, else **415**
   ``UnsupportedMediaType``. A browser can send only ``text/plain``, form or multipart
   bodies without asking first, and the API answers no preflight.

A body is strict UTF-8 JSON (:func:`parse_json`): nested at most :data:`MAX_DEPTH` deep,
no ``NaN`` or ``Infinity``, no key twice, no NUL character and no lone surrogate in any
string (the runs database and the command line cannot hold them). Else **400**
``BadJson``, before anything is stored.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from recorder.serving import is_loopback

__all__ = ["MAX_DEPTH", "ApiError", "Guard", "bad_text", "depth", "parse_json", "require_json",
           "safe_headers", "split_host"]

MAX_DEPTH = 32  # a submission nests 2 deep; the cassette reader allows 200
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BAD_CHAR = re.compile("[\x00\ud800-\udfff]")
_SAFE_HEADERS = [(b"x-content-type-options", b"nosniff"),
                 (b"cross-origin-resource-policy", b"same-origin"),
                 (b"cache-control", b"no-store")]


class ApiError(Exception):
    """An error the API answers with: an HTTP status and a named JSON error."""

    def __init__(self, status: int, type_: str, message: str,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message
        self.headers = headers or []

    def body(self) -> bytes:
        return json.dumps({"error": {"type": self.type, "message": self.message}}).encode()


def safe_headers() -> list[tuple[bytes, bytes]]:
    """Headers on every answer: not sniffed as a script, not readable by other origins
    (even through a ``no-cors`` request), never cached."""
    return list(_SAFE_HEADERS)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def split_host(value: str) -> tuple[str, int | None] | None:
    """``("127.0.0.1", 8977)`` of ``127.0.0.1:8977`` (``[::1]:80``, ``localhost``), the
    name lower-cased; None when it is not a host and optional port."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or not _is_ip(name) or ":" not in name:
            return None
    else:
        name, sep, port = value.partition(":")
        rest = sep + port
        if not name or not re.fullmatch(r"[a-z0-9._-]+", name):
            return None
    if not rest:
        return name, None
    if not rest.startswith(":") or not rest[1:].isdigit() or len(rest) > 6:
        return None
    return name, int(rest[1:])


@dataclass(frozen=True)
class Guard:
    """The checks of one server: its token and the host names it answers to."""

    token: str
    hosts: frozenset[str] = frozenset()  # beside the loopback names
    any_address: bool = False  # bound to 0.0.0.0 or ::, any IP address names it

    @classmethod
    def of(cls, token: str, bind: str, allowed: Iterable[str] = ()) -> Guard:
        """The guard of a server bound to ``bind`` that also answers to ``allowed``."""
        names = {name.strip().lower().strip("[]") for name in allowed if name.strip()}
        try:
            wildcard = ipaddress.ip_address(bind.strip("[]")).is_unspecified
        except ValueError:
            wildcard = False
        if not wildcard:
            names.add(bind.lower().strip("[]"))
        return cls(token, frozenset(names), wildcard)

    def names(self) -> str:
        shown = ["localhost", "127.0.0.1", "[::1]", *sorted(self.hosts - {
            "localhost", "127.0.0.1", "::1"})]
        if self.any_address:
            shown.append("any IP address of this machine")
        return ", ".join(shown)

    def host(self, headers: Mapping[str, str]) -> tuple[str, int | None]:
        """The request's ``Host``, if this server answers to it; else 421."""
        given = headers.get("host", "")
        parsed = split_host(given)
        if parsed is not None:
            name = parsed[0]
            if is_loopback(name) or name in self.hosts or (self.any_address and _is_ip(name)):
                return parsed
        raise ApiError(421, "MisdirectedRequest",
                       f"this is deja serve, and the request names the host {given!r}; it "
                       f"answers to {self.names()} only (a page whose name was made to "
                       "point here is refused). Reach it by one of those, or start it with "
                       "--allowed-host NAME for a name of its own")

    def origin(self, headers: Mapping[str, str], host: tuple[str, int | None]) -> None:
        """A browser's request from another origin (or site) is refused: 403."""
        site = headers.get("sec-fetch-site")
        origin = headers.get("origin")
        foreign = site is not None and site not in ("same-origin", "none")
        if origin is not None and not foreign:
            foreign = not _same_origin(origin, host)
        if foreign:
            raise ApiError(403, "ForeignOrigin",
                           f"a web page ({origin or site}) may not call deja serve: it runs "
                           "commands, so only deja's own commands and your scripts (which "
                           "send no Origin) may")

    def authorize(self, headers: Mapping[str, str]) -> None:
        """The request carries this server's token; else 401."""
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode("latin-1", "replace"), self.token.encode()):
            raise ApiError(401, "Unauthorized",
                           "deja serve needs its token, on every request: send "
                           "Authorization: Bearer TOKEN. deja's commands send it "
                           "themselves (from $DEJA_HOME/serve.token, or DEJA_TOKEN); "
                           "`deja serve --print-token` prints it",
                           [(b"www-authenticate", b'Bearer realm="deja"')])


def _same_origin(origin: str, host: tuple[str, int | None]) -> bool:
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path:
        return False
    default = 443 if parts.scheme == "https" else 80
    return (parts.hostname.lower(), port or default) == (host[0], host[1] or default)


def require_json(headers: Mapping[str, str]) -> None:
    """A body is declared JSON (UTF-8); a form or ``text/plain`` post is refused: 415."""
    kind, *params = [p.strip().lower() for p in headers.get("content-type", "").split(";")]
    charset = next((p.partition("=")[2].strip('"') for p in params
                    if p.startswith("charset=")), "utf-8")
    if kind != "application/json" or charset not in ("utf-8", "utf8"):
        raise ApiError(415, "UnsupportedMediaType",
                       f"a request to deja serve that sends or changes something is JSON: "
                       f"send Content-Type: application/json, not {kind or 'nothing'!r}"
                       + ("" if charset in ("utf-8", "utf8") else f" (charset {charset})"))


def _bad_json(why: str) -> ApiError:
    return ApiError(400, "BadJson", f"the request body {why}; send a JSON object, e.g. "
                    '{"command": ["python", "agent.py"]}')


def depth(text: str) -> int:
    """How deep the arrays and objects of JSON ``text`` nest (outside its strings), or
    at most: a text with few brackets at all is not looked into."""
    opened = text.count("[") + text.count("{")
    if opened <= MAX_DEPTH:
        return opened
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if len(brackets) <= 1:
        return len(brackets)
    deepest = level = 0
    for char in brackets:
        level += 1 if char in "[{" else -1
        deepest = max(deepest, level)
    return deepest


def bad_text(value: str) -> str | None:
    """What makes ``value`` unstorable (a NUL, a lone surrogate), or None."""
    found = _BAD_CHAR.search(value)
    if found is None:
        return None
    return "a NUL character" if found.group() == "\x00" else \
        f"a lone surrogate (U+{ord(found.group()):04X})"


def _check_strings(value: Any, where: str) -> None:
    if isinstance(value, str):
        why = bad_text(value)
        if why is not None:
            raise _bad_json(f"holds {why} at {where}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_strings(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            why = bad_text(key)
            if why is not None:
                raise _bad_json(f"holds {why} in a key of {where}")
            _check_strings(item, f"{where}.{key}")


def _constant(name: str) -> Any:
    raise _bad_json(f"holds {name}, which is not JSON")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _bad_json(f"has the key {key!r} twice in one object")
        out[key] = value
    return out


def parse_json(data: bytes) -> Any:
    """The JSON value of a request body; :class:`ApiError` 400 ``BadJson`` when it is not
    strict JSON deja can store."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad_json(f"is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    nested = depth(text)
    if nested > MAX_DEPTH:
        raise _bad_json(f"nests {nested} levels deep, more than the {MAX_DEPTH} allowed")
    try:
        value = json.loads(text, parse_constant=_constant, object_pairs_hook=_pairs)
    except ValueError as exc:
        raise _bad_json(f"is not JSON ({exc})") from None
    except RecursionError:  # cannot happen below MAX_DEPTH; a bound all the same
        raise _bad_json("nests too deep") from None
    _check_strings(value, "$")
    return value
