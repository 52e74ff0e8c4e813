"""A streaming agent: text arrives event by event, tool input as input_json_delta.

    deja stub --script examples/streaming_agent.stub.json --port 8765 &
    ANTHROPIC_BASE_URL=http://127.0.0.1:8765 deja record -- python examples/streaming_agent.py
"""

from __future__ import annotations

import json
import os
import sys

import anthropic

import recorder

MODEL = "claude-sonnet-4-6"
TOOLS = [{
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]},
}]


@recorder.tool
def get_weather(city: str) -> dict:
    return {"city": city, "temp_c": 14, "sky": "overcast", "observed_at": recorder.now()}


def main() -> int:
    client = anthropic.Anthropic(api_key=os.environ.get("ANTHROPIC_API_KEY", "sk-stub"))
    messages = [{"role": "user", "content": "Should I take an umbrella in Lyon today?"}]
    for _ in range(4):
        with client.messages.stream(model=MODEL, max_tokens=512, tools=TOOLS,
                                    messages=messages) as stream:
            for text in stream.text_stream:
                sys.stdout.write(text)
                sys.stdout.flush()
            reply = stream.get_final_message()
        print()
        content = [b.model_dump(exclude_none=True) for b in reply.content]
        messages.append({"role": "assistant", "content": content})
        if reply.stop_reason != "tool_use":
            return 0
        results = [{"type": "tool_result", "tool_use_id": b.id,
                    "content": json.dumps(get_weather(**b.input))}
                   for b in reply.content if b.type == "tool_use"]
        messages.append({"role": "user", "content": results})
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
