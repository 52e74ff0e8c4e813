"""The cassette format's constants: its version, its line kinds, when lines reach the disk.

The kinds, end statuses and control events themselves are named in
:mod:`recorder.cassette.schema`; the tuples and sets here are derived from them.
"""

from __future__ import annotations

import enum

from recorder._fastjson import LINE_DEPTH as LINE_DEPTH
from recorder._fastjson import nests_deeper as nests_deeper
from recorder._fastjson import text_nests_deeper as text_nests_deeper
from recorder.cassette.schema import EndStatus, Kind
from recorder.errors import (
    ConfigError,
)

FORMAT = "deja/2"  # what the writer writes: each line signed over its exact bytes
V1 = "deja/1"  # signed over each line's canonical JSON; still read, and continued by a resume
READABLE_FORMATS = (FORMAT, V1)
# Optional features of deja/2 a cassette uses, named in its header's ``features``: a reader
# refuses a cassette that names one it does not know. A cassette without the field uses
# none (a run resumed goes on without them).
# - reply_shapes: a request resends a response's items in another key order ("shape");
# - header_edits: response headers stored as edits of an earlier line's;
# - tool_calls: a tool's line (or outcome) whose body made lines names its call (``call``,
#   the ``within`` of those lines), and an intent names the call it opens: a call no tool
#   line or outcome names was under way where the log ends.
FEATURES: tuple[str, ...] = ("reply_shapes", "header_edits", "tool_calls")
KINDS: tuple[str, ...] = tuple(kind.value for kind in Kind)
# LINE_DEPTH: how deep a line may nest, its reader refusing a deeper one; nests_deeper(doc,
# n): whether a document (JSON as parsed) is deeper than n levels; text_nests_deeper(text,
# n): whether JSON text is.


class Fsync(enum.StrEnum):
    """When the writer forces a line to disk."""

    SYNC = "sync"
    TURN = "turn"
    EXIT = "exit"

    @classmethod
    def parse(cls, value: str | Fsync) -> Fsync:
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown fsync policy {value!r}; valid: {valid}") from None


TURN_SYNC_KINDS = frozenset({Kind.INTENT, Kind.OUTCOME, Kind.CONTROL, Kind.END})
# End statuses a resume may continue after (the end line is cut first): a run stopped by a
# signal ends ``interrupted`` with an end line, and is meant to be picked up again; one
# stopped for a person (``needs_attention``: a side effect's fate unknown) is picked up
# once the person has checked, with settle=, a fixed program or ``--resend``.
RESUMABLE_ENDS = frozenset({EndStatus.INTERRUPTED, EndStatus.NEEDS_ATTENTION})
