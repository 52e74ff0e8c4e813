"""The small tool-using agent recorded in ``v1_tool_agent.jsonl`` (see ``make_golden.py``).

One run: a ``recorder.uuid4()`` effect (used as the request's ``metadata.user_id``), a model
turn that asks for the ``get_weather`` tool, the tool call through ``@recorder.tool``, and a
second model turn that answers from the tool result. ``agent_changed_prompt`` is the same
agent with another user prompt: replaying the golden cassette with it must diverge.

Do not change what ``agent`` sends: the golden cassette was recorded from it, and the tests
replay it against that file.
"""

from __future__ import annotations

from typing import Any

import anthropic

import recorder

MODEL = "claude-sonnet-4-6"
PROMPT = "What is the weather in Paris right now?"
CHANGED_PROMPT = "What is the weather in Rome right now?"
TOOLS = [{
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]},
}]

# What the stub server answers while make_golden.py records the run.
SCRIPT = {"turns": [
    {"text": "Let me look that up.",
     "tool_use": {"id": "toolu_golden_01", "name": "get_weather", "input": {"city": "Paris"}}},
    {"text": "It is 18 degrees and clear in Paris."},
]}


@recorder.tool
def get_weather(city: str) -> dict[str, Any]:
    """The tool: a fixed answer, so that a recording does not depend on the outside world."""
    return {"city": city, "temp_c": 18, "sky": "clear"}


def agent(base_url: str, prompt: str = PROMPT) -> str:
    """Ask, run the tools the model asks for, ask again; returns the final answer's text."""
    client = anthropic.Anthropic(base_url=base_url, api_key="sk-test", max_retries=0)
    try:
        trace = str(recorder.uuid4())
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        while True:
            reply = client.messages.create(model=MODEL, max_tokens=256, tools=TOOLS,
                                           messages=messages, metadata={"user_id": trace})
            messages.append({"role": "assistant", "content": [_block(b) for b in reply.content]})
            uses = [block for block in reply.content if block.type == "tool_use"]
            if not uses:
                return "".join(block.text for block in reply.content if block.type == "text")
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id,
                 "content": repr(get_weather(**use.input))}
                for use in uses]})
    finally:
        client.close()


def _block(block: Any) -> dict[str, Any]:
    """An assistant content block as the request sends it back (fields spelled out, so
    that a newer SDK adding fields to its models does not change the request)."""
    if block.type == "tool_use":
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    return {"type": "text", "text": block.text}


def agent_changed_prompt(base_url: str) -> str:
    """The same agent with another user prompt: its first model request differs."""
    return agent(base_url, prompt=CHANGED_PROMPT)
