"""Resume a crashed or interrupted run.

Resume::

    with replayer.resume("cassettes/r_2.jsonl"):
        agent()                      # everything recorded replays, then the run goes on

Everything recorded replays (no live call, no side effect repeated); a torn last line is
cut first and reported; an intent without an outcome is settled; then the run continues
live, appending to the same cassette after a ``resumed`` control line.

Every input is checked before anything is written.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from recorder.capture.session import Scope
from recorder.cassette import RESUMABLE_ENDS, Cassette, CassetteWriter, load
from recorder.cassette.keys import Keyring, load_keyring
from recorder.cassette.schema import Control
from recorder.errors import NotResumable
from replayer import continuation
from replayer.continuation import ContinuationSession
from replayer.tool_policy import ToolPolicy

log = logging.getLogger("deja.replayer")


def plan_resume(cassette: str | Path, *, keyring: Keyring | None = None) -> Cassette:
    """Check that ``cassette`` can be resumed: it verifies and has no end line."""
    ring = keyring or load_keyring(create=False)
    loaded = load(cassette, keyring=ring, require_signature=True, allow_torn=True,
                  allow_incomplete=True)
    if loaded.end is not None and loaded.end.get("status") not in RESUMABLE_ENDS:
        raise NotResumable(f"{loaded.path}: the run already ended with status "
                           f"{loaded.end.get('status')!r}; there is nothing to resume (only a "
                           "crashed or interrupted run, or one stopped for a person "
                           "(needs_attention), can be resumed)")
    continuation.signing_key(loaded, ring)
    return loaded


def resume(cassette: str | Path, *, keyring: Keyring | None = None,
           fsync: str = "turn", resend: Iterable[str] = ()) -> Scope[ContinuationSession]:
    """Resume a crashed run; see the module docstring. ``resend``: the tools that, when
    the run stopped inside one and nothing can settle it (a destructive MCP tool; a side
    effect with no settle function), are sent or run again, with the same key, rather
    than stop the run for a person: name one only once you know it did not take effect."""
    ring = keyring or load_keyring(create=False)
    loaded = plan_resume(cassette, keyring=ring)
    return continuation.scope(
        lambda: start_resume(loaded, keyring=ring, fsync=fsync, resend=resend),
        abandon_on_divergence=True, name=f"resume({cassette})")


def start_resume(loaded: Cassette, *, keyring: Keyring | None = None,
                 fsync: str = "turn", resend: Iterable[str] = ()) -> ContinuationSession:
    ring = keyring or load_keyring(create=False)
    torn = loaded.torn_offset
    if torn is not None:
        log.warning("%s: cutting the torn last line at byte %d before resuming",
                    loaded.path, torn)
    writer = CassetteWriter.reopen(loaded, continuation.signing_key(loaded, ring), fsync)
    served = len(loaded.observations)
    detail: dict[str, Any] = {"replayed": served, "torn_cut_at": torn}
    if loaded.end is not None:  # interrupted or needs_attention: its end line cut, kept here
        detail["after_end"] = {k: v for k, v in loaded.end.items() if k != "seq"}

    def on_live(session: ContinuationSession) -> None:
        session.log_control(Control.RESUMED, detail)

    # a fork resumed keeps its tool policy (a side effect stays not live unless named);
    # any other run continues as it was recorded, every tool live
    try:
        return ContinuationSession(loaded, writer, on_live=on_live, fsync=fsync, keyring=ring,
                                   mode="resume", resend=resend,
                                   tool_policy=ToolPolicy.from_header(loaded.header))
    except BaseException:  # bad settings ([tool.deja]): the cassette stays as it was found
        writer.discard()  # what reopen cut, put back
        raise
