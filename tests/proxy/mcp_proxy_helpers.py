"""What the tests of ``deja proxy --mcp`` share: the MCP tests' ledger server
(tests/mcp/ledger_server.py) as a real process over Streamable HTTP, answering with event
streams as it does by default or with plain JSON (``json_ledger.py``), and the Node.js MCP
client of examples/mcp-node-agent on the official TypeScript SDK.

:func:`start_ledger` starts a server on a free port with its own SQLite ledger and waits
until it listens; :func:`mcp_agent` runs the Node client against a URL (the proxy's
``/mcp``); :func:`read_answers` reads the file its ``--dump`` option writes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from click.testing import CliRunner

from deja.cli_wait import wait

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MCP_AGENT_DIR = ROOT / "examples" / "mcp-node-agent"
MCP_AGENT = MCP_AGENT_DIR / "agent.mjs"
JSON_LEDGER = HERE / "json_ledger.py"


def _mcp_helpers() -> ModuleType:
    """tests/mcp/mcp_helpers.py, imported by its path (the MCP tests' folder is not on
    this folder's path) under the name those tests import it by."""
    if "mcp_helpers" in sys.modules:
        return sys.modules["mcp_helpers"]
    spec = importlib.util.spec_from_file_location("mcp_helpers",
                                                  ROOT / "tests" / "mcp" / "mcp_helpers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mcp_helpers"] = module
    spec.loader.exec_module(module)
    return module


MCP = _mcp_helpers()
LEDGER_SERVER: Path = MCP.SERVER


@dataclass
class LedgerServer:
    """A ledger server process: its URL (``.../mcp``) and its SQLite ledger."""

    process: subprocess.Popen[bytes]
    url: str
    db: Path

    def rows(self) -> list[tuple[str, float]]:
        """The refunds its ledger holds."""
        if not self.db.exists():
            return []
        with sqlite3.connect(self.db) as conn:
            tables = conn.execute("select name from sqlite_master where name = 'refunds'")
            if tables.fetchone() is None:
                return []
            return [tuple(row) for row in conn.execute("select ord, amount from refunds")]

    def stop(self) -> None:
        MCP.stop(self.process)


def start_ledger(db: Path, *, json_response: bool = False) -> LedgerServer:
    """The ledger server over Streamable HTTP on a free port of 127.0.0.1, writing ``db``
    (``json_response``: answering with JSON bodies, not event streams), once it listens."""
    port = MCP.free_port()
    script = JSON_LEDGER if json_response else LEDGER_SERVER
    process = subprocess.Popen([sys.executable, str(script), "--http", str(port)],
                               env={**os.environ, "LEDGER_DB": str(db)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    waited = CliRunner().invoke(wait, [str(port), "--timeout", str(MCP.TIMEOUT)])  # polls
    assert waited.exit_code == 0 and process.poll() is None, "the ledger server never listened"
    return LedgerServer(process, f"http://127.0.0.1:{port}/mcp", db)


def mcp_agent(url: str, *args: str, env: dict[str, str] | None = None,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``MCP_URL=url node examples/mcp-node-agent/agent.mjs ARGS``: what it did (exit 0:
    done, 2: an MCP error reached it)."""
    return subprocess.run(["node", str(MCP_AGENT), *args], cwd=MCP_AGENT_DIR,
                          env={**os.environ, "MCP_URL": url, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def read_answers(path: Path) -> list[dict[str, Any]]:
    """The answers the agent's ``--dump`` wrote: ``{"what", "answer"}`` each."""
    return [json.loads(line) for line in path.read_text().splitlines() if line]
