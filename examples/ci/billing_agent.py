"""An invoice assistant: today's date in its system prompt, one tool. The incident of
docs/ci.md: recorded once, then replayed in CI on every push.

    deja stub --script examples/ci/billing_agent.stub.json --port 8781 &
    ANTHROPIC_BASE_URL=http://127.0.0.1:8781 deja record -- python examples/ci/billing_agent.py
"""

from __future__ import annotations

import datetime
import json
import os

import anthropic

import recorder

MODEL = "claude-sonnet-4-6"
TOOLS = [{
    "name": "open_invoices",
    "description": "The open invoices of a customer.",
    "input_schema": {"type": "object", "properties": {"customer": {"type": "string"}},
                     "required": ["customer"]},
}]


@recorder.tool
def open_invoices(customer: str) -> list[dict]:
    return [{"id": "INV-7", "customer": customer, "amount_eur": 120, "due": "2026-12-10"}]


def main() -> str:
    """Ask what ACME owes (or $QUESTION; $STYLE says how to answer, with the tool's
    results); the model's last answer."""
    today = os.environ.get("TODAY") or datetime.datetime.now(datetime.UTC).date().isoformat()
    question = os.environ.get("QUESTION", "What does ACME owe?")
    with anthropic.Anthropic() as client:
        messages: list = [{"role": "user", "content": question}]
        for _ in range(4):
            reply = client.messages.create(
                model=MODEL, max_tokens=256, tools=TOOLS, messages=messages,
                system=f"Today is {today}. You are a billing assistant.")
            messages.append({"role": "assistant",
                             "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            if reply.stop_reason != "tool_use":
                return "".join(b.text for b in reply.content if b.type == "text")
            results: list = [{"type": "tool_result", "tool_use_id": b.id,
                              "content": json.dumps(open_invoices(**b.input))}
                             for b in reply.content if b.type == "tool_use"]
            if os.environ.get("STYLE"):  # how to answer, said with the results
                results.append({"type": "text", "text": os.environ["STYLE"]})
            messages.append({"role": "user", "content": results})
    return "gave up"


if __name__ == "__main__":
    print(main())
