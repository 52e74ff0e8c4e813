"""The cassette: one run's observation log, JSON Lines, signed with an HMAC chain.

- :mod:`.schema`: what each line holds, and the rules every reader of a line shares;
- :mod:`.format`: the format version, the fsync policy, which ends can be resumed;
- :mod:`.writer`: the append-only writer (one ``write`` per line, group commit);
  :mod:`.whole`: a line is written whole even when a stop signal lands mid-append;
- :mod:`.reader`: :func:`load`, which parses, verifies and restores a cassette;
- :mod:`.signing`: the chain of signatures; :mod:`.keys`: where keys come from;
  :mod:`.trust`: whether a loaded cassette can be trusted; :mod:`.lock`: one writer
  per cassette;
- :mod:`.compact`: what a model line leaves out on disk, and how the reader restores it;
- :mod:`.rows`: a cassette as rows (steps, totals, summaries) for every reader;
- :mod:`.repair`: ``deja repair``, which cuts what a power loss left after the lines that
  verify (never an edit), keeping a copy of the file as it was.

Requests are fingerprinted in :mod:`recorder.canonical`'s byte form; a ``deja/2`` line is
signed over its exact bytes (:mod:`recorder.cassette.signing`), a ``deja/1`` line over that
canonical form.
"""

from recorder.cassette.format import FORMAT, KINDS, READABLE_FORMATS, RESUMABLE_ENDS, Fsync
from recorder.cassette.reader import Cassette, load
from recorder.cassette.signing import check_sig, encode_sig, sign
from recorder.cassette.writer import CassetteWriter

__all__ = [
    "FORMAT",
    "KINDS",
    "READABLE_FORMATS",
    "RESUMABLE_ENDS",
    "Cassette",
    "CassetteWriter",
    "Fsync",
    "check_sig",
    "encode_sig",
    "load",
    "sign",
]
