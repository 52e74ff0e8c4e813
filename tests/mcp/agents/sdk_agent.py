"""An agent that uses the ledger MCP server through the official MCP SDK itself: a
``ClientSession`` over ``stdio_client`` (the command ``ledger-server``), or over
``streamable_http_client`` when ``LEDGER_URL`` is set, or over the legacy ``sse_client``
when ``LEDGER_SSE_URL`` is.

It reads the ledger's policy and a prompt, looks the order up and refunds it, with a
progress callback, printing what it gets. ``LEDGER_ORDER`` and ``LEDGER_TOOL`` change the
order it looks up and the tool it calls first (a replay then asks for what the recording
does not hold).
"""

from __future__ import annotations

import os

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client


def transport():  # the agent's own choice of transport, as a program would make it
    if os.environ.get("LEDGER_SSE_URL"):
        return sse_client(os.environ["LEDGER_SSE_URL"])
    if os.environ.get("LEDGER_URL"):
        return streamable_http_client(os.environ["LEDGER_URL"])
    return stdio_client(StdioServerParameters(
        command="ledger-server", env={"LEDGER_DB": os.environ["LEDGER_DB"]}))


async def run() -> None:
    order = os.environ.get("LEDGER_ORDER", "A-1")
    async with transport() as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = await session.list_tools()
        print("tools:", ", ".join(tool.name for tool in tools.tools))
        policy = await session.read_resource("ledger://policy")
        print("policy:", policy.contents[0].text)
        prompt = await session.get_prompt("apology", {"order": order})
        print("prompt:", prompt.messages[0].content.text)
        found = await session.call_tool(os.environ.get("LEDGER_TOOL", "lookup"), {"order": order})
        print("lookup:", found.content[0].text + (" (error)" if found.is_error else ""))
        progress: list[tuple[float, float | None, str | None]] = []

        async def on_progress(done: float, total: float | None, message: str | None) -> None:
            progress.append((done, total, message))

        paid = await session.call_tool("refund", {"order": order, "amount": 40},
                                       progress_callback=on_progress)
        print("refund:", paid.content[0].text + (" (error)" if paid.is_error else ""))
        print("progress:", progress)


def main() -> None:
    anyio.run(run)


if __name__ == "__main__":
    main()
