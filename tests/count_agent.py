"""A small tool agent for the count, report and progress tests, steered by the environment.

``AGENT_PROMPT`` changes its first request (a replay of it diverges at step 0),
``AGENT_TURNS`` caps its model turns, ``AGENT_EFFECTS`` adds that many effect steps
(a long run without a model), ``AGENT_STARTUP`` sleeps that many seconds before the first
call (a slow start-up), ``AGENT_DIE_AT`` kills the process (no end line) before that turn
and ``AGENT_CRASH`` raises the agent's own error after the first reply.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import anthropic

import recorder

PROMPT = "Where is the session refresh implemented?"
TOOLS = [{"name": "find", "description": "Find files by query.",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}},
                           "required": ["query"]}}]
# The stub's answers, chosen by conversation position: a resumed or forked run gets the
# same ones.
SCRIPT = {"select": "conversation", "turns": [
    {"text": "Searching.", "tool_use": {"name": "find", "input": {"query": "session refresh"}},
     "usage": {"input_tokens": 120, "output_tokens": 20}},
    {"text": "Narrowing it down.", "tool_use": {"name": "find", "input": {"query": "auth/"}},
     "usage": {"input_tokens": 180, "output_tokens": 22}},
    {"text": "Checking the tests.", "tool_use": {"name": "find", "input": {"query": "tests/"}},
     "usage": {"input_tokens": 220, "output_tokens": 18}},
    {"text": "It is in auth/session.py.", "usage": {"input_tokens": 260, "output_tokens": 9}}]}


@recorder.tool
def find(query: str) -> list[str]:
    recorder.uuid4()  # an effect inside the tool's body: a step the replay serves with it
    return ["auth/session.py"] if "session" in query else ["auth/session.py", "auth/token.py"]


def main() -> int:
    time.sleep(float(os.environ.get("AGENT_STARTUP", "0")))
    for i in range(int(os.environ.get("AGENT_EFFECTS", "0"))):
        print(f"effect {i}: {recorder.randint(0, 9)}", flush=True)
        time.sleep(0.003)
    turns = int(os.environ.get("AGENT_TURNS", "6"))
    if not turns:
        return 0
    url = os.environ.get("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")  # a replay needs none
    # closed when the run ends: a client left open leaks its socket into whatever runs next
    # in the process (the pytest plugin's tests run this agent in their own process)
    with anthropic.Anthropic(base_url=url, api_key="sk-test", max_retries=0) as client:
        return _converse(client, turns)


def _converse(client: anthropic.Anthropic, turns: int) -> int:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": os.environ.get("AGENT_PROMPT", PROMPT)}]
    die_at = int(os.environ.get("AGENT_DIE_AT", "-1"))
    for turn in range(turns):
        if turn == die_at:
            os._exit(9)  # a crash: no end line, the run stays open
        reply = client.messages.create(model="claude-sonnet-4-6", max_tokens=256, tools=TOOLS,
                                       messages=messages)
        print(f"turn {turn}: {reply.content[0].text}", flush=True)
        if os.environ.get("AGENT_CRASH"):
            raise ValueError("the agent's own bug")
        content = [b.model_dump(exclude_none=True) for b in reply.content]
        messages.append({"role": "assistant", "content": content})
        if reply.stop_reason != "tool_use":
            return 0
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": json.dumps(find(**b.input))}
            for b in reply.content if b.type == "tool_use"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
