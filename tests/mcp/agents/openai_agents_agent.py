"""An agent on the OpenAI Agents SDK with its tools from the ledger MCP server, as the SDK's
documentation writes one: an ``Agent`` given an ``MCPServerStdio`` (the command
``ledger-server``), run by ``Runner.run`` on the Responses API (``OPENAI_BASE_URL``), the
final output printed. Each run opens a client of its own, since each runs on an event loop
of its own; the caller turns tracing off (``OPENAI_AGENTS_DISABLE_TRACING=1``)."""

from __future__ import annotations

import asyncio
import os

from agents import Agent, OpenAIResponsesModel, Runner
from agents.mcp import MCPServerStdio
from openai import AsyncOpenAI

PROMPT = "Refund order A-1 if it was not refunded yet."


async def run() -> str:
    params = {"command": "ledger-server", "args": [], "env": {"LEDGER_DB": os.environ["LEDGER_DB"]}}
    async with AsyncOpenAI() as client, MCPServerStdio(params=params, name="ledger") as ledger:
        agent = Agent(name="Refunds", instructions="Be brief.", mcp_servers=[ledger],
                      model=OpenAIResponsesModel("gpt-4.1", openai_client=client))
        result = await Runner.run(agent, PROMPT)
        return str(result.final_output)


def main() -> None:
    print("answer:", asyncio.run(run()))


if __name__ == "__main__":
    main()
