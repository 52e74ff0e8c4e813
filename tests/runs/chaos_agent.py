"""The paying agent of the chaos table (run by ``deja record`` / ``deja resume`` under a
worker; not collected).

It pays ``CHAOS_INVOICES`` invoices (default 6): for each, a model turn asks to look it up
(a pure tool), the next asks to pay it. ``pay`` is a side effect with a settle function:
deja writes an intent line before it runs and hands it an idempotency key. The payments
service is a ledger file (``CHAOS_LEDGER``, JSON Lines on an ordinary disk, the outside
world) to which every payment is appended, with its key, run and process, whatever
happened before: it never deduplicates, so a payment made twice shows as two lines.
``settle_payment`` looks the key up to tell whether a payment went through.

The model is called over plain ``httpx`` (the Messages API, recorded as model steps like
any SDK's calls): a run's processes start in a fraction of the time the SDK's import
takes, so that a table of hundreds of runs fits in minutes. ``CHAOS_DELAY``: seconds to
wait after each turn (so that faults land mid-run).
:func:`script` is the stub model's script for this agent (``"select": "conversation"``:
turn i answers the request carrying i assistant messages, so a resumed run gets the same
answer at the same place).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

import recorder
from recorder import Settled

MODEL = "claude-sonnet-4-6"
COUNT = int(os.environ.get("CHAOS_INVOICES") or 6)
INVOICES = {f"INV-{2001 + i}": 120 + (i * 7919) % 4000 for i in range(COUNT)}
TOOLS = [
    {"name": "lookup", "description": "Look an invoice up: amount and status.",
     "input_schema": {"type": "object", "properties": {"invoice": {"type": "string"}},
                      "required": ["invoice"]}},
    {"name": "pay", "description": "Pay an open invoice.",
     "input_schema": {"type": "object", "properties": {"invoice": {"type": "string"},
                                                       "amount": {"type": "integer"}},
                      "required": ["invoice", "amount"]}},
]


def script(count: int = COUNT) -> dict[str, Any]:
    """The stub model's script: look up, then pay, each invoice; then a summary."""
    turns: list[dict[str, Any]] = []
    invoices = {f"INV-{2001 + i}": 120 + (i * 7919) % 4000 for i in range(count)}
    for j, (invoice, amount) in enumerate(invoices.items()):
        turns.append({"text": f"Looking up {invoice}.",
                      "tool_use": {"id": f"toolu_chaos_{2 * j:03d}", "name": "lookup",
                                   "input": {"invoice": invoice}},
                      "usage": {"input_tokens": 400 + 30 * j, "output_tokens": 20}})
        turns.append({"text": f"{invoice} is open for ${amount}; paying it.",
                      "tool_use": {"id": f"toolu_chaos_{2 * j + 1:03d}", "name": "pay",
                                   "input": {"invoice": invoice, "amount": amount}},
                      "usage": {"input_tokens": 415 + 30 * j, "output_tokens": 24}})
    turns.append({"text": f"Done: {count} invoices paid.",
                  "usage": {"input_tokens": 400 + 30 * count, "output_tokens": 12}})
    return {"model": MODEL, "select": "conversation", "turns": turns}


def ledger_path() -> Path:
    return Path(os.environ.get("CHAOS_LEDGER") or "ledger.jsonl")


def ledger_lines(path: Path) -> list[dict[str, Any]]:
    """Every payment the ledger holds (a torn last line is left out)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for line in data.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


@recorder.tool
def lookup(invoice: str) -> dict[str, Any]:
    return {"invoice": invoice, "amount": INVOICES.get(invoice), "status": "open"}


def settle_payment(intent: recorder.Intent) -> Settled:
    """Did the payment of ``intent`` go through? The ledger knows its key."""
    for row in ledger_lines(ledger_path()):
        if row.get("key") == intent.key:
            return Settled.done({"invoice": row["invoice"], "paid": row["amount"]})
    return Settled.not_done()


@recorder.tool(side_effect=True, settle=settle_payment)
def pay(invoice: str, amount: int, idempotency_key: str | None = None) -> dict[str, Any]:
    """Append the payment to the ledger (one write, flushed to disk) and confirm it."""
    run = recorder.active().run_id
    line = json.dumps({"key": idempotency_key, "run": run, "invoice": invoice,
                       "amount": amount, "pid": os.getpid(), "t": time.time()}) + "\n"
    fd = os.open(ledger_path(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"invoice": invoice, "paid": amount}


def main() -> int:
    base = (os.environ.get("ANTHROPIC_BASE_URL") or "https://api.anthropic.com").rstrip("/")
    headers = {"x-api-key": os.environ.get("ANTHROPIC_API_KEY", "sk-stub"),
               "anthropic-version": "2023-06-01"}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Pay the open invoices."}]
    delay = float(os.environ.get("CHAOS_DELAY") or 0)
    with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
        for _ in range(2 * COUNT + 5):
            response = client.post("/v1/messages", json={
                "model": MODEL, "max_tokens": 512, "tools": TOOLS, "messages": messages})
            reply = response.raise_for_status().json()
            messages.append({"role": "assistant", "content": reply["content"]})
            if reply["stop_reason"] != "tool_use":
                return 0
            results = []
            for block in reply["content"]:
                if block["type"] == "tool_use":
                    args = block["input"]
                    out = lookup(**args) if block["name"] == "lookup" else pay(**args)
                    results.append({"type": "tool_result", "tool_use_id": block["id"],
                                    "content": json.dumps(out)})
            messages.append({"role": "user", "content": results})
            time.sleep(delay)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
