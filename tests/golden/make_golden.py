"""Record the golden cassette ``tests/golden/v1_tool_agent.jsonl``.

Usage (from the repository root)::

    .venv/bin/python tests/golden/make_golden.py

It starts the stub Anthropic server (``recorder.testing.server.StubServer``) with
``agent.SCRIPT``, records one run of ``agent.agent`` against it, signed with the fixed key
``DEJA_KEY=golden-key-deja-v1``, and overwrites the cassette. Nothing leaves the machine.

The golden cassette is a fixed artefact in format ``deja/1``: the tests load, verify and
replay it to prove that this format keeps loading in later versions of deja. Re-run this
script only when the agent itself must change, never to "fix" a test after a format change;
a new format gets a new golden file next to this one.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN_KEY = "golden-key-deja-v1"
OUT = HERE / "v1_tool_agent.jsonl"


def main() -> int:
    # A throwaway key home, so that no key file is created or read in the user's ~/.deja.
    os.environ["DEJA_HOME"] = tempfile.mkdtemp(prefix="deja-golden-")
    os.environ["DEJA_KEY"] = GOLDEN_KEY
    os.environ.pop("DEJA_OLD_KEYS", None)
    sys.path.insert(0, str(HERE))
    import agent  # tests/golden/agent.py, importable now that HERE is on the path

    from recorder import Keyring, RecordSession
    from recorder.testing.server import StubServer

    with StubServer(agent.SCRIPT) as server:
        run = RecordSession(OUT, argv=["tests/golden/make_golden.py"], overwrite=True,
                            labels={"golden": "v1_tool_agent"},
                            keyring=Keyring.of(GOLDEN_KEY)).start()
        try:
            answer = agent.agent(server.url)
        except BaseException as exc:
            run.close("error", exc)
            raise
        run.close("completed")
    print(f"recorded {OUT} ({run.run_id}): {answer!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
