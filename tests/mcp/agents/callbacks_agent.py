"""An agent whose MCP server asks it things during a tool call: ``summarize`` asks the
client's model for a summary (``sampling/createMessage``), ``confirm`` asks its user
(``elicitation/create``). The agent answers through the ``ClientSession``'s callbacks,
printing each question it is asked, then each tool's result.

``LEDGER_APPROVE`` (``yes`` by default) is the user's answer to the confirmation.
"""

from __future__ import annotations

import os

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.types import CreateMessageResult, ElicitResult, TextContent


async def sample(context, params) -> CreateMessageResult:  # the client's model, canned
    print("asked to sample:", params.messages[0].content.text)
    return CreateMessageResult(role="assistant", model="stub-model", stop_reason="endTurn",
                               content=TextContent(type="text", text="A-1 paid, not refunded"))


async def elicit(context, params) -> ElicitResult:  # the client's user
    print("asked to confirm:", params.message)
    return ElicitResult(action="accept", content={
        "approved": os.environ.get("LEDGER_APPROVE", "yes") == "yes"})


async def run() -> None:
    params = StdioServerParameters(command="ledger-server",
                                   env={"LEDGER_DB": os.environ["LEDGER_DB"]})
    async with stdio_client(params) as (read, write), \
            ClientSession(read, write, sampling_callback=sample,
                          elicitation_callback=elicit) as session:
        await session.initialize()
        await session.list_tools()
        summary = await session.call_tool("summarize", {"order": "A-1"})
        print("summarize:", summary.content[0].text)
        confirmed = await session.call_tool("confirm", {"order": "A-1"})
        print("confirm:", confirmed.content[0].text)


def main() -> None:
    anyio.run(run)


if __name__ == "__main__":
    main()
