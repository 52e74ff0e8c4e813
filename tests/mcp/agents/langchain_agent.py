"""An agent on LangChain with its tools from the ledger MCP server, as LangChain's
documentation writes one: ``langchain.mcp``'s ``MCPAdapter`` over FastMCP's stdio transport
(the command ``ledger-server``), its tools given to ``create_agent`` with ``ChatAnthropic``
(``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``), run inside the adapter's context, the final
message printed.

``langchain.mcp`` warns that it is in beta when it is imported; the agent says it knows.
"""

from __future__ import annotations

import asyncio
import os
import warnings

from fastmcp.client.transports import StdioTransport
from langchain.agents import create_agent
from langchain_anthropic import ChatAnthropic
from langchain_core._api import LangChainBetaWarning

with warnings.catch_warnings():
    warnings.simplefilter("ignore", LangChainBetaWarning)
    from langchain.mcp import MCPAdapter

MODEL = "claude-sonnet-4-6"
PROMPT = "Refund order A-1 if it was not refunded yet."


async def run() -> str:
    transport = StdioTransport(command="ledger-server", args=[],
                               env={"LEDGER_DB": os.environ["LEDGER_DB"]})
    async with MCPAdapter(transport) as ledger:
        agent = create_agent(ChatAnthropic(model_name=MODEL, max_tokens=256),
                             await ledger.list_tools(), system_prompt="Be brief.")
        state = await agent.ainvoke({"messages": [{"role": "user", "content": PROMPT}]})
    return str(state["messages"][-1].text)


def main() -> None:
    print("answer:", asyncio.run(run()))


if __name__ == "__main__":
    main()
