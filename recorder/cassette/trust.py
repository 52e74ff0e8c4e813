"""Whether a cassette can be trusted: the one decision every reader of a cassette makes.

A cassette is untrusted input. It arrives from another machine, a pull request, an
attacker; its header even names the command that replays it. So before anything in it is
served, shown as fact, run or re-signed, its HMAC chain is checked with the key its header
names (``key_id``). The outcomes:

- **verified**: this machine has the key and every line checks out;
- **tampered** (:class:`SignatureError`): a line does not check out, or the header's
  ``key_id`` was edited or removed (one of this machine's keys signed the file, but the
  header names another key or none), which is how a naive reader is talked into skipping
  verification;
- **unverified** (:class:`UnverifiedCassette`): nobody here has the key it names. When this
  machine has keys, such a file is *suspect*: it was made elsewhere, or re-signed by
  someone who does not have the team's key. It is refused unless the user allows
  unverified cassettes, explicitly: ``--allow-unverified`` on the command line,
  ``allow_unverified=True`` in the API, or ``DEJA_ALLOW_UNVERIFIED=1`` in the environment
  (a CI job that was never given the key replays this way). Every report then says
  ``NOT VERIFIED``, and the command the header names still never runs unless the user
  gives it (``-- CMD``) or asks for it by name (``--run-recorded-command``).

Nothing is ever *re-signed* from an unverified file: a fork and a resume need the key.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recorder.cassette.keys import Keyring, key_id
from recorder.cassette.schema import Header
from recorder.errors import SignatureError, UnverifiedCassette

ALLOW_ENV = "DEJA_ALLOW_UNVERIFIED"
UNVERIFIED_MARK = "NOT VERIFIED"
_TRUE = frozenset({"1", "true", "yes", "on"})


def allow_unverified_from_env() -> bool:
    """``DEJA_ALLOW_UNVERIFIED`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(ALLOW_ENV, "").strip().lower() in _TRUE


@dataclass(frozen=True)
class Verdict:
    """The key to check the chain with (None: load unverified) and what to tell the user."""

    key: bytes | None
    note: str

    @property
    def verified(self) -> bool:
        return self.key is not None


# (key, previous sig, line without sig, sig) -> does it verify? The line is parsed (deja/1,
# or a deja/2 line whose bytes are not as written), or a deja/2 line's signed bytes.
Check = Callable[[bytes, str, Any, object], bool]


def decide(path: Path, header: Header, header_sig: object,
           chain: Callable[[], Iterable[tuple[str, dict[str, Any], object]]],
           keyring: Keyring, check: Check, *, allow_unverified: bool,
           require_signature: bool) -> Verdict:
    """Which key verifies ``path``, or why none can; raises when the file must be refused.

    ``chain()`` gives the observation lines (without their sigs), each with the stored sig
    of the line before it and its own: a header whose ``key_id`` was edited no longer
    checks out under the real key, but the lines after it still chain from one another's
    stored signatures, even when the header's own signature was replaced too. It is only
    read when the header names a key this machine does not have. A line that was edited
    as well (in deja/2: its fields reordered, not only re-spaced) no longer chains, so an
    edit of every line can make a file of this machine's look merely unverified: refused
    all the same unless unverified cassettes are allowed, and never verified.
    """
    def signs(key: bytes, prev: str, line: Any, sig: object) -> bool:
        try:
            return check(key, prev, line, sig)
        except (ValueError, TypeError, RecursionError):  # hostile content: not ours either
            return False

    kid = header.get("key_id")
    key = keyring.get(kid) if isinstance(kid, str) else None
    if key is not None:
        return Verdict(key, f"verified with key {kid}")
    lines = list(chain()) if keyring.accepted else []
    for ours in keyring.accepted.values():
        restored = {**header, "key_id": key_id(ours)}
        chained = any(signs(ours, prev, line, sig) for prev, line, sig in lines)
        if signs(ours, "", restored, header_sig) or chained:
            named = f"names key {kid!r}" if "key_id" in header else "names no key"
            raise SignatureError(
                f"{path}: the header {named}, but the cassette was signed with this "
                f"machine's key {key_id(ours)}: its key_id was edited to turn verification "
                "off. Do not trust this cassette; restore it from where it was committed",
                path=path, seq=None)
    if not keyring.accepted:
        why = (f"no signing key on this machine to check it with (it names key {kid!r}; "
               "set DEJA_KEY or DEJA_OLD_KEYS to that key)")
    elif isinstance(kid, str):
        ids = ", ".join(sorted(keyring.accepted))
        why = (f"it is signed with key {kid!r}, which is not one of this machine's keys "
               f"({ids}): it was made elsewhere, or re-signed by someone without your key")
    else:
        why = "its header names no signing key"
    note = f"{UNVERIFIED_MARK}: {why}"
    if require_signature or not allow_unverified:
        if require_signature:
            hint = ("this needs a verified cassette: give this machine the key it was "
                    "signed with (DEJA_KEY or DEJA_OLD_KEYS)")
        else:
            hint = ("deja does not serve, show or run an unverified cassette unless you say "
                    "so: to use it anyway, unchecked, pass --allow-unverified (or set "
                    f"{ALLOW_ENV}=1, or allow_unverified=True)")
        raise UnverifiedCassette(
            f"{path}: refused, signature cannot be checked: {why}. {hint}", path=path)
    return Verdict(None, note)
