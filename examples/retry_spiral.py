"""The incident: a tool agent whose search tool returns a malformed response, and a model
that retries the same call with the same arguments again and again.

Run it against the bundled stub model (no key, no network)::

    deja stub --script examples/retry_spiral.stub.json --port 8765 &
    ANTHROPIC_BASE_URL=http://127.0.0.1:8765 deja record -o cassettes/demo/spiral.jsonl \\
        -- python examples/retry_spiral.py

The agent knows nothing of deja except ``@recorder.tool`` on its tool and the harness's
``RunStopped`` it reports. Recorded with deja's default guards, the loop guard stops it
before the third identical search; with ``--no-loop-guard`` it spirals to the end.
"""

from __future__ import annotations

import json
import os

import anthropic

import recorder

MODEL = "claude-sonnet-4-6"
MAX_TURNS = 12
TOOLS = [{
    "name": "search",
    "description": "Search the code base; returns JSON {results: [{path, snippet}]}.",
    "input_schema": {"type": "object", "properties": {"query": {"type": "string"}},
                     "required": ["query"]},
}]


@recorder.tool
def search(query: str) -> str:
    """The flaky search backend: its response is cut off mid-object."""
    return '{"results": [{"path": "auth/session.py", "snippet": "def refresh_tok'


def run_tool(name: str, args: dict) -> tuple[str, bool]:
    if name != "search":
        return f"unknown tool {name}", True
    raw = search(**args)
    try:
        hits = json.loads(raw)["results"]
    except (ValueError, KeyError) as exc:
        return f"search failed: malformed response ({exc})", True
    return json.dumps(hits), False


def main() -> int:
    try:
        return run()
    except recorder.RunStopped as stop:  # deja's harness ended the run (loop, budget, cancel)
        print(f"stopped by the harness: {stop}")
        return 3


def run() -> int:
    client = anthropic.Anthropic(api_key=os.environ.get("ANTHROPIC_API_KEY", "sk-stub"))
    messages = [{"role": "user", "content": "Refactor the session refresh in the auth "
                                            "module. Find it first."}]
    for turn in range(1, MAX_TURNS + 1):
        reply = client.messages.create(model=MODEL, max_tokens=1024, tools=TOOLS,
                                       messages=messages)
        content = [b.model_dump(exclude_none=True) for b in reply.content]
        messages.append({"role": "assistant", "content": content})
        text = "".join(b.text for b in reply.content if b.type == "text")
        print(f"turn {turn}: {reply.stop_reason}: {text}")
        if reply.stop_reason != "tool_use":
            return 0
        results = []
        for block in reply.content:
            if block.type == "tool_use":
                output, is_error = run_tool(block.name, block.input)
                print(f"  tool {block.name}({json.dumps(block.input)}) -> {output[:60]}")
                results.append({"type": "tool_result", "tool_use_id": block.id,
                                "content": output, "is_error": is_error})
        messages.append({"role": "user", "content": results})
    print(f"gave up after {MAX_TURNS} turns")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
