"""An agent on Pydantic AI, as its documentation writes one: an ``Agent`` on an Anthropic
model with one plain tool, run synchronously, the final output printed.

The model's client finds the server through ``ANTHROPIC_BASE_URL`` and its key in
``ANTHROPIC_API_KEY``. ``AGENT_PROMPT`` changes the question; ``AGENT_TOOL_STEPS=1`` also
wraps the tool in ``@recorder.tool`` (under Pydantic AI's registration), so that its calls
are tool steps of the cassette.
"""

from __future__ import annotations

import os

from pydantic_ai import Agent

MODEL = "anthropic:claude-sonnet-4-6"
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

agent = Agent(MODEL, tools=[lookup], instructions="Answer in one sentence.")


def main() -> None:
    result = agent.run_sync(os.environ.get("AGENT_PROMPT", PROMPT))
    print("answer:", result.output)


if __name__ == "__main__":
    main()
