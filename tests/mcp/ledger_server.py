"""A small MCP server for deja's tests: a ledger of refunds kept in SQLite.

Written with the official MCP SDK (``MCPServer``, FastMCP's successor) and run as a real
process: over stdio by default, over Streamable HTTP on 127.0.0.1 with ``--http PORT``.
The ledger's file is ``LEDGER_DB``.

- ``lookup(order)``: reads the ledger (annotated ``readOnlyHint``);
- ``refund(order, amount)``: writes a row (annotated ``destructiveHint``), reporting
  progress and a log message on the way;
- ``summarize(order)``: asks the client's model for a one-line summary of the order
  (``sampling/createMessage``; annotated ``readOnlyHint``);
- ``confirm(order)``: asks the client's user whether to go on (``elicitation/create``);
  not annotated, so a client must take it to be destructive;
- the resource ``ledger://policy`` and the prompt ``apology``.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import warnings

from mcp.server.mcpserver import Context, MCPServer
from mcp.shared.exceptions import MCPDeprecationWarning
from mcp.types import SamplingMessage, TextContent, ToolAnnotations
from pydantic import BaseModel

warnings.filterwarnings("ignore", category=MCPDeprecationWarning)  # server logging: still sent

server = MCPServer("ledger", version="1.4.2", instructions="Refunds, with care.",
                   log_level="WARNING")


def ledger() -> sqlite3.Connection:
    conn = sqlite3.connect(os.environ["LEDGER_DB"])
    conn.execute("create table if not exists refunds (ord text, amount real)")
    return conn


def refunded(order: str) -> float:
    with ledger() as conn:
        row = conn.execute("select coalesce(sum(amount), 0) from refunds where ord = ?",
                           (order,)).fetchone()
    return float(row[0])


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def lookup(order: str) -> str:
    """Look an order up in the ledger."""
    return f"order {order}: 40.00 EUR paid, {refunded(order):.2f} EUR refunded"


@server.tool(annotations=ToolAnnotations(destructiveHint=True))
async def refund(order: str, amount: float, ctx: Context) -> str:
    """Refund an amount of an order: writes the ledger."""
    await ctx.report_progress(0.5, 1.0, "writing the ledger")
    await ctx.info(f"refunding {amount:.2f} EUR on {order}")
    with ledger() as conn:
        conn.execute("insert into refunds values (?, ?)", (order, amount))
    await ctx.report_progress(1.0, 1.0, "done")
    return f"refunded {amount:.2f} EUR on {order}"


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def summarize(order: str, ctx: Context) -> str:
    """Summarize an order in one line, written by the client's model."""
    asked = await ctx.session.create_message(
        [SamplingMessage(role="user", content=TextContent(
            type="text", text=f"Summarize in one line: {lookup(order)}"))],
        max_tokens=64, related_request_id=ctx.request_id)
    return f"summary: {asked.content.text}"


class Approval(BaseModel):
    approved: bool


@server.tool()
async def confirm(order: str, ctx: Context) -> str:
    """Ask the user whether to refund an order."""
    answer = await ctx.elicit(f"Refund order {order}?", Approval)
    approved = answer.action == "accept" and answer.data is not None and answer.data.approved
    return f"{order}: {'approved' if approved else 'not approved'}"


@server.resource("ledger://policy")
def policy() -> str:
    return "Refunds up to 50 EUR need no approval."


@server.prompt()
def apology(order: str) -> str:
    return f"Write a short apology for order {order}."


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http"]:
        server.run("streamable-http", port=int(sys.argv[2]))
    elif sys.argv[1:2] == ["--sse"]:
        server.run("sse", port=int(sys.argv[2]))
    else:
        server.run()
