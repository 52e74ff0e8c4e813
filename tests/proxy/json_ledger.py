"""The MCP tests' ledger server (tests/mcp/ledger_server.py) over Streamable HTTP, answering
each request with a plain JSON body instead of an event stream (the transport's other
answer): ``python json_ledger.py --http PORT``, its ledger in ``LEDGER_DB``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SERVER = Path(__file__).resolve().parents[1] / "mcp" / "ledger_server.py"

if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location("ledger_server", SERVER)
    assert spec is not None and spec.loader is not None
    ledger = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ledger)
    ledger.server.run("streamable-http", port=int(sys.argv[2]), json_response=True)
