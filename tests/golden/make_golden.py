"""Record a golden cassette: ``tests/golden/v<N>_<agent>.jsonl`` in this deja's format.

Usage (from the repository root)::

    .venv/bin/python tests/golden/make_golden.py v2_tool_agent.jsonl
    .venv/bin/python tests/golden/make_golden.py v2_responses_agent.jsonl
    .venv/bin/python tests/golden/make_golden.py v2_gemini_agent.jsonl
    .venv/bin/python tests/golden/make_golden.py v2_bedrock_agent.jsonl

It starts the stub model server (``recorder.testing.server.StubServer``) with the agent's
``SCRIPT``, records one run of its ``agent`` against it, signed with the fixed key
``DEJA_KEY=golden-key-deja-v1``, and overwrites the cassette. The agent is named by the
file: ``*_tool_agent.jsonl`` is ``agent.py`` (the Messages API), ``*_responses_agent.jsonl``
is ``responses_agent.py`` (OpenAI's Responses API), ``*_gemini_agent.jsonl``
``gemini_agent.py`` (Gemini through google-genai) and ``*_bedrock_agent.jsonl``
``bedrock_agent.py`` (Claude on Bedrock). Nothing leaves the machine.

A golden cassette is a fixed artefact of one format (``v1_tool_agent.jsonl``: ``deja/1``;
``v2_tool_agent.jsonl``: ``deja/2``; ``v2_responses_agent.jsonl``: ``deja/2`` as written
before Responses requests were stored as deltas; ``v2_gemini_agent.jsonl`` and
``v2_bedrock_agent.jsonl``: ``deja/2`` as the first deja that read those providers wrote
it): the tests load, verify and replay it to
prove that the format keeps loading in later versions of deja. Run this script once when a
new format is released, to make that format's file; never to "fix" a test after a format
change.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN_KEY = "golden-key-deja-v1"
# what follows v<N>_ in a golden file's name -> the module of the agent it records
AGENTS = {"tool_agent": "agent", "responses_agent": "responses_agent",
          "gemini_agent": "gemini_agent", "bedrock_agent": "bedrock_agent"}


def main() -> int:
    named = re.fullmatch(r"v\d+_(\w+)\.jsonl", sys.argv[1]) if len(sys.argv) == 2 else None
    if named is None or named.group(1) not in AGENTS:
        print(f"usage: make_golden.py v<N>_<agent>.jsonl (agent: {', '.join(AGENTS)})",
              file=sys.stderr)
        return 2
    out = HERE / sys.argv[1]
    # A throwaway key home, so that no key file is created or read in the user's ~/.deja.
    os.environ["DEJA_HOME"] = tempfile.mkdtemp(prefix="deja-golden-")
    os.environ["DEJA_KEY"] = GOLDEN_KEY
    os.environ.pop("DEJA_OLD_KEYS", None)
    sys.path.insert(0, str(HERE))
    agent = importlib.import_module(AGENTS[named.group(1)])  # importable from HERE

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
