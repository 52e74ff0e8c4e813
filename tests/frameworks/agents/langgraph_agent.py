"""An agent on LangGraph with langchain-anthropic, as LangGraph's tutorial builds one: a
``StateGraph`` of messages, a model node (``ChatAnthropic`` with the tool bound), a
``ToolNode``, and ``tools_condition`` looping between them; the final message printed.

``ChatAnthropic`` finds the server through ``ANTHROPIC_BASE_URL`` and its key in
``ANTHROPIC_API_KEY``. ``AGENT_PROMPT`` changes the question; ``AGENT_TOOL_STEPS=1`` also
wraps the tool function in ``@recorder.tool`` (under langchain's ``@tool``), so that its
calls are tool steps of the cassette.
"""

from __future__ import annotations

import os

from langchain_anthropic import ChatAnthropic
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

MODEL = "claude-sonnet-4-6"
PROMPT = "What does 'deja' mean?"


def lookup(word: str) -> str:
    """Look a word up in the dictionary.

    Args:
        word: The word to look up.
    """
    return f"{word}: French for 'already'"


if os.environ.get("AGENT_TOOL_STEPS"):
    import recorder

    lookup = recorder.tool(lookup)

tools = [tool(lookup, parse_docstring=True)]
model = ChatAnthropic(model_name=MODEL, max_tokens=256).bind_tools(tools)


def call_model(state: MessagesState) -> dict:
    return {"messages": [model.invoke(state["messages"])]}


builder = StateGraph(MessagesState)
builder.add_node("agent", call_model)
builder.add_node("tools", ToolNode(tools))
builder.add_edge(START, "agent")
builder.add_conditional_edges("agent", tools_condition)
builder.add_edge("tools", "agent")
graph = builder.compile()


def main() -> None:
    state = graph.invoke({"messages": [("user", os.environ.get("AGENT_PROMPT", PROMPT))]})
    print("answer:", state["messages"][-1].text)


if __name__ == "__main__":
    main()
