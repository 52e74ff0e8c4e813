"""Record a golden cassette: ``tests/golden/v<N>_tool_agent.jsonl`` in this deja's format.

Usage (from the repository root)::

    .venv/bin/python tests/golden/make_golden.py v2_tool_agent.jsonl

It starts the stub Anthropic server (``recorder.testing.server.StubServer``) with
``agent.SCRIPT``, records one run of ``agent.agent`` against it, signed with the fixed key
``DEJA_KEY=golden-key-deja-v1``, and overwrites the cassette. Nothing leaves the machine.

A golden cassette is a fixed artefact of one format (``v1_tool_agent.jsonl``: ``deja/1``;
``v2_tool_agent.jsonl``: ``deja/2``): the tests load, verify and replay it to prove that
the format keeps loading in later versions of deja. Run this script once when a new format
is released, to make that format's file; never to "fix" a test after a format change.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN_KEY = "golden-key-deja-v1"


def main() -> int:
    if len(sys.argv) != 2 or not sys.argv[1].endswith("_tool_agent.jsonl"):
        print("usage: make_golden.py v<N>_tool_agent.jsonl", file=sys.stderr)
        return 2
    out = HERE / sys.argv[1]
    # A throwaway key home, so that no key file is created or read in the user's ~/.deja.
    os.environ["DEJA_HOME"] = tempfile.mkdtemp(prefix="deja-golden-")
    os.environ["DEJA_KEY"] = GOLDEN_KEY
    os.environ.pop("DEJA_OLD_KEYS", None)
    sys.path.insert(0, str(HERE))
    import agent  # tests/golden/agent.py, importable now that HERE is on the path

    from recorder import Keyring, RecordSession
    from recorder.testing.server import StubServer

    with StubServer(agent.SCRIPT) as server:
        run = RecordSession(out, argv=["tests/golden/make_golden.py"], overwrite=True,
                            labels={"golden": out.stem},
                            keyring=Keyring.of(GOLDEN_KEY)).start()
        try:
            answer = agent.agent(server.url)
        except BaseException as exc:
            run.close("error", exc)
            raise
        run.close("completed")
    print(f"recorded {out} ({run.run_id}): {answer!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
