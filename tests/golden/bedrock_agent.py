"""Claude on Amazon Bedrock, the tool loop recorded in ``v2_bedrock_agent.jsonl``.

One run through the anthropic SDK's Bedrock client (SigV4-signed with fixed example
credentials): ``/model/{id}/invoke`` with a tool, the ``get_weather`` tool through
``@recorder.tool`` for each ``tool_use`` of the reply, and the next call with the reply and
its ``tool_result`` added; the second call is streamed
(``/invoke-with-response-stream``, AWS's binary event stream, stored as base64), the
others are not. Three calls, the last one answering in text.

``agent_changed_prompt`` is the same agent with another user prompt: replaying the golden
cassette with it must diverge. Do not change what ``agent`` sends: the golden cassette was
recorded from it.
"""

from __future__ import annotations

from typing import Any

import anthropic

import recorder

MODEL = "us.anthropic.claude-sonnet-4-20250514-v1:0"
PROMPT = "What is the weather in Paris and in Lyon right now?"
CHANGED_PROMPT = "What is the weather in Rome right now?"
ANSWER = "It is 18 degrees and clear in both."
# AWS's documented example credentials: the stub checks no signature
CREDENTIALS = {"aws_access_key": "AKIDEXAMPLE",
               "aws_secret_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
               "aws_region": "us-east-1"}
TOOLS = [{"name": "get_weather", "description": "Current weather for a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
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
    client = anthropic.AnthropicBedrock(base_url=base_url, max_retries=0, **CREDENTIALS)
    try:
        messages: list[Any] = [{"role": "user", "content": prompt}]
        for turn in range(5):
            if turn == 1:
                with client.messages.stream(model=MODEL, max_tokens=256, tools=TOOLS,
                                            messages=messages) as s:
                    reply = s.get_final_message()
            else:
                reply = client.messages.create(model=MODEL, max_tokens=256, tools=TOOLS,
                                               messages=messages)
            calls = [b for b in reply.content if b.type == "tool_use"]
            messages.append({"role": "assistant", "content": reply.content})
            if not calls:
                return "".join(b.text for b in reply.content if b.type == "text")
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.id,
                 "content": str(get_weather(**b.input))} for b in calls]})
        raise AssertionError("no final answer")
    finally:
        client.close()


def agent_changed_prompt(base_url: str) -> str:
    """The same agent with another user prompt: its first request differs."""
    return agent(base_url, prompt=CHANGED_PROMPT)
