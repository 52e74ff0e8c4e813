"""An agent on Pydantic AI with its tools from the ledger MCP server, as Pydantic AI's
documentation writes one: an ``MCPToolset`` over FastMCP's stdio transport (the command
``ledger-server``), an Anthropic model (``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``), run
inside the agent's context (which starts the server and closes the model's client after),
the final output printed."""

from __future__ import annotations

import asyncio
import os

from fastmcp.client.transports import StdioTransport
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset

PROMPT = "Refund order A-1 if it was not refunded yet."


def main() -> None:
    ledger = MCPToolset(StdioTransport(command="ledger-server", args=[],
                                       env={"LEDGER_DB": os.environ["LEDGER_DB"]}))
    agent = Agent("anthropic:claude-sonnet-4-6", toolsets=[ledger], instructions="Be brief.")

    async def run() -> str:
        async with agent:
            return str((await agent.run(PROMPT)).output)

    print("answer:", asyncio.run(run()))


if __name__ == "__main__":
    main()
