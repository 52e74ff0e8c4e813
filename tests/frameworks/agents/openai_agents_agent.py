"""An agent on the OpenAI Agents SDK, as its documentation writes one: an ``Agent`` with a
``@function_tool``, run by ``Runner.run_sync`` on its default model API (Responses), the
final output printed.

The SDK's client finds the server through ``OPENAI_BASE_URL`` and its key in
``OPENAI_API_KEY``; its tracing is turned off by its own switch,
``OPENAI_AGENTS_DISABLE_TRACING=1``, which the caller sets. ``AGENT_PROMPT`` changes the
question; ``AGENT_TOOL_STEPS=1`` also wraps the tool in ``@recorder.tool`` (under
``@function_tool``), so that its calls are tool steps of the cassette.
"""

from __future__ import annotations

import os

from agents import Agent, Runner, function_tool

MODEL = "gpt-4.1"
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

agent = Agent(name="Dictionary", instructions="Answer in one sentence.", model=MODEL,
              tools=[function_tool(lookup)])


def main() -> None:
    result = Runner.run_sync(agent, os.environ.get("AGENT_PROMPT", PROMPT))
    print("answer:", result.final_output)


if __name__ == "__main__":
    main()
