"""The OpenAI Responses API tool loop recorded in ``v2_responses_agent.jsonl``.

One run through the openai SDK: a Responses call whose ``input`` is a list of items, the
``get_weather`` tool through ``@recorder.tool`` for each ``function_call`` of the reply, and
the next call with the reply's items and a ``function_call_output`` added; the second call
is streamed, the others are not. Three calls, the last one answering in text.

The cassette was written (by ``make_golden.py``) by a deja that stored every Responses
request whole, before Responses requests were stored as deltas; the tests load, verify and
replay it to prove that such cassettes keep working. ``agent_changed_prompt`` is the same
agent with another user prompt: replaying the golden cassette with it must diverge.

Do not change what ``agent`` sends: the golden cassette was recorded from it.
"""

from __future__ import annotations

import json
from typing import Any

import openai

import recorder

MODEL = "gpt-4.1"
PROMPT = "What is the weather in Paris and in Lyon right now?"
CHANGED_PROMPT = "What is the weather in Rome right now?"
ANSWER = "It is 18 degrees and clear in both."
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather for a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]

# What the stub server answers while make_golden.py records the run.
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Let me look up Paris.",
     "tool_use": {"name": "get_weather", "input": {"city": "Paris"}}},
    {"text": "Now Lyon.", "tool_use": {"name": "get_weather", "input": {"city": "Lyon"}}},
    {"text": ANSWER},
]}


@recorder.tool
def get_weather(city: str) -> dict[str, Any]:
    """The tool: a fixed answer, so that a recording does not depend on the outside world."""
    return {"city": city, "temp_c": 18, "sky": "clear"}


def agent(base_url: str, prompt: str = PROMPT) -> str:
    """Ask, run the tools the model calls, ask again with everything so far; returns the
    final answer's text."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-test", max_retries=0)
    try:
        items: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        for turn in range(5):
            if turn == 1:
                with client.responses.stream(model=MODEL, input=items, tools=TOOLS) as s:
                    reply = s.get_final_response()
            else:
                reply = client.responses.create(model=MODEL, input=items, tools=TOOLS)
            calls = [o for o in reply.output if o.type == "function_call"]
            items.append({"role": "assistant", "content": reply.output_text})
            if not calls:
                return reply.output_text
            for call in calls:  # spelled out, so that a newer SDK does not change them
                items.append({"type": "function_call", "call_id": call.call_id,
                              "name": call.name, "arguments": call.arguments})
                items.append({"type": "function_call_output", "call_id": call.call_id,
                              "output": json.dumps(get_weather(**json.loads(call.arguments)))})
        raise AssertionError("no final answer")
    finally:
        client.close()


def agent_changed_prompt(base_url: str) -> str:
    """The same agent with another user prompt: its first request differs."""
    return agent(base_url, prompt=CHANGED_PROMPT)
