"""A destructive MCP tool call in flight when the agent is killed is not sent again by a
resume.

The agent (the official MCP SDK over stdio, the ledger server a real process) calls
``refund``, which the server annotates ``destructiveHint``; its progress callback kills
the agent with SIGKILL once the server reports the refund written, before the answer
reaches the client. The cassette then holds the ``sending`` line deja forces to disk
before a destructive call goes out, and no line for its answer. A resume serves
everything before it and stops with ``needs_attention`` where the agent sends the refund
again: the ledger keeps one refund (a resume used to send it again, and refund twice).
Once a person has checked, ``deja resume --resend refund`` sends it again, as asked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mcp_helpers import Ledger, ledger_fixture  # noqa: F401

from recorder.cassette import load

CONNECTED = """\
import os, signal

import anyio
import recorder
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


async def run():
    params = StdioServerParameters(command="ledger-server",
                                   env={"LEDGER_DB": os.environ["LEDGER_DB"]})
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        await session.list_tools()
"""  # an agent connected to the ledger server

AGENT = CONNECTED + """\
        found = await session.call_tool("lookup", {"order": "A-1"})
        print("lookup:", found.content[0].text, flush=True)

        async def on_progress(done, total, message):
            if done == 1.0 and os.environ.get("DIE") == "in refund":  # written, not answered
                os.kill(os.getpid(), signal.SIGKILL)

        paid = await session.call_tool("refund", {"order": "A-1", "amount": 40},
                                       progress_callback=on_progress)
        print("refund:", paid.content[0].text, flush=True)


anyio.run(run)
if os.environ.get("DIE") == "at the end":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def deja(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deja", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env={**os.environ, **env})


def test_a_refund_in_flight_is_not_sent_again_unless_asked(ledger: Ledger,
                                                            tmp_path: Path) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    killed = deja("record", "-o", "run.jsonl", "--", sys.executable, "agent.py",
                  cwd=tmp_path, DIE="in refund")
    assert killed.returncode != 0 and "it can be resumed" in killed.stderr, killed.stderr
    assert ledger.rows() == [("A-1", 40.0)]
    lines = load(tmp_path / "run.jsonl", allow_incomplete=True).observations
    sent = lines[-1]
    assert sent["kind"] == "control" and sent["event"] == "sending", lines
    assert sent["detail"]["tool"] == "refund" and sent["detail"]["server"] == "ledger"
    assert not any(o.get("name") == "refund" for o in lines)

    stopped = deja("resume", "run.jsonl", cwd=tmp_path)
    assert stopped.returncode != 0, stopped.stdout
    assert "lookup: order A-1: 40.00 EUR paid, 0.00 EUR refunded" in stopped.stdout
    assert (f"destructive MCP tool 'refund' was sent to its server at step {sent['seq']} "
            "and the run stopped before its answer was logged") in stopped.stderr, \
        stopped.stderr
    assert ledger.rows() == [("A-1", 40.0)]  # not refunded twice
    run = load(tmp_path / "run.jsonl")
    assert run.end is not None and run.end["status"] == "needs_attention"

    resent = deja("resume", "--resend", "refund", "run.jsonl", cwd=tmp_path)
    assert resent.returncode == 0, resent.stdout + resent.stderr
    assert "refund: refunded 40.00 EUR on A-1" in resent.stdout
    assert ledger.rows() == [("A-1", 40.0)] * 2  # sent again, as asked
    run = load(tmp_path / "run.jsonl")
    assert run.end is not None and run.end["status"] == "completed"
    replayed = deja("replay", "run.jsonl", cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr


def test_a_refund_answered_is_served_by_a_resume(ledger: Ledger, tmp_path: Path) -> None:
    """The ``sending`` line of a call that was answered is matched by its tool line: a run
    killed after the refund resumes without stopping and without sending it."""
    (tmp_path / "agent.py").write_text(AGENT)
    killed = deja("record", "-o", "run.jsonl", "--", sys.executable, "agent.py",
                  cwd=tmp_path, DIE="at the end")
    assert killed.returncode != 0 and "it can be resumed" in killed.stderr, killed.stderr
    assert ledger.rows() == [("A-1", 40.0)]
    kinds = [(o["kind"], o.get("event") or o.get("name"))
             for o in load(tmp_path / "run.jsonl", allow_incomplete=True).observations]
    assert kinds[-2:] == [("control", "sending"), ("tool", "refund")], kinds
    resumed = deja("resume", "run.jsonl", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "refund: refunded 40.00 EUR on A-1" in resumed.stdout
    assert ledger.rows() == [("A-1", 40.0)]


IN_A_BODY = CONNECTED + """\

        @recorder.tool
        async def handle(order):
            paid = await session.call_tool("refund", {"order": order, "amount": 40})
            if os.environ.get("DIE") == "after refund":
                os.kill(os.getpid(), signal.SIGKILL)
            return paid.content[0].text

        print("handled:", await handle("A-1"), flush=True)


anyio.run(run)
"""


def test_a_refund_made_inside_a_tool_under_way_is_not_made_again(ledger: Ledger,
                                                                 tmp_path: Path) -> None:
    """A plain tool calls the destructive MCP tool and the agent is killed before the tool
    returns: the resume runs the tool's body again and answers the refund from its line."""
    (tmp_path / "agent.py").write_text(IN_A_BODY)
    killed = deja("record", "-o", "run.jsonl", "--", sys.executable, "agent.py",
                  cwd=tmp_path, DIE="after refund")
    assert killed.returncode != 0 and "it can be resumed" in killed.stderr, killed.stderr
    assert ledger.rows() == [("A-1", 40.0)]
    refund = next(o for o in load(tmp_path / "run.jsonl", allow_incomplete=True).observations
                  if o.get("name") == "refund")
    assert refund["within"] == "handle#0" and refund["mcp"]["destructive"] is True
    resumed = deja("resume", "run.jsonl", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "handled: refunded 40.00 EUR on A-1" in resumed.stdout
    assert ledger.rows() == [("A-1", 40.0)]  # refunded once
