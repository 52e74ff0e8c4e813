"""An agent on the anthropic SDK's tool runner (``client.beta.messages.tool_runner``), as its
documentation writes one: a ``@beta_tool`` function, the runner loops until the model stops
asking for it, the final answer is printed.

The client finds the server through ``ANTHROPIC_BASE_URL`` and its key in
``ANTHROPIC_API_KEY``. ``AGENT_PROMPT`` changes the question; ``AGENT_TOOL_STEPS=1`` also
wraps the tool in ``@recorder.tool`` (under ``@beta_tool``), so that its calls are tool
steps of the cassette.
"""

from __future__ import annotations

import os

import anthropic
from anthropic import beta_tool

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

lookup_tool = beta_tool(lookup)


def main() -> None:
    with anthropic.Anthropic() as client:
        runner = client.beta.messages.tool_runner(
            model=MODEL, max_tokens=256, tools=[lookup_tool],
            messages=[{"role": "user", "content": os.environ.get("AGENT_PROMPT", PROMPT)}])
        final = runner.until_done()
    print("answer:", "".join(b.text for b in final.content if b.type == "text"))


if __name__ == "__main__":
    main()
