"""A month-end reconciliation agent: it looks invoices up and pays the open ones.

Paying is a real side effect on an external ledger (a SQLite file). A crash in the middle
of the run (a deploy, an OOM kill, ``kill -9``) must not pay anything twice when the run
is resumed. Run it against the bundled stub model (no key, no network)::

    deja stub --script examples/reconciliation.stub.json --port 8765 &
    ANTHROPIC_BASE_URL=http://127.0.0.1:8765 deja record -o cassettes/demo/recon.jsonl \\
        -- python examples/reconciliation.py                  # killed somewhere
    ANTHROPIC_BASE_URL=http://127.0.0.1:8765 deja resume cassettes/demo/recon.jsonl

The agent knows nothing of deja except ``@recorder.tool`` on its tools. ``pay`` is
declared a side effect with a settle function: deja writes an intent line before it runs
and hands it an idempotency key, which the ledger stores as its primary key; on resume,
``settle_payment`` looks that key up to tell whether the payment went through.

Environment: ``RECON_LEDGER`` the ledger file (default ``ledger.sqlite`` in the current
directory); ``RECON_CRASH="<n>:<where>"`` kills this process with SIGKILL inside the
n-th call of ``pay``, ``where`` being ``before_ledger`` or ``after_ledger`` (crash tests);
``RECON_DELAY`` seconds to wait after each turn (to stop a run by hand, or by signal tests).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import anthropic

import recorder
from recorder import Settled

MODEL = "claude-sonnet-4-6"
MAX_TURNS = 100

# The accounts-payable system, as far as this agent can see it: 20 open invoices to pay
# and 10 settled last month, referred to while cross-checking remittances.
INVOICES: dict[str, dict] = {
    **{f"INV-{1001 + j}": {"vendor": f"vendor-{(j * 7) % 13:02d}",
                           "amount": 150 + (j * 7919) % 4850, "status": "open"}
       for j in range(20)},
    **{f"INV-{901 + j}": {"vendor": f"vendor-{(j * 5) % 13:02d}",
                          "amount": 200 + (j * 3571) % 2800, "status": "paid"}
       for j in range(10)},
}

TOOLS = [
    {"name": "lookup_invoice",
     "description": "Look an invoice up: vendor, amount (whole dollars) and status.",
     "input_schema": {"type": "object", "properties": {"invoice": {"type": "string"}},
                      "required": ["invoice"]}},
    {"name": "pay",
     "description": "Pay an open invoice through the payments ledger.",
     "input_schema": {"type": "object",
                      "properties": {"invoice": {"type": "string"},
                                     "amount": {"type": "integer"}},
                      "required": ["invoice", "amount"]}},
]


def ledger_path() -> Path:
    return Path(os.environ.get("RECON_LEDGER") or Path.cwd() / "ledger.sqlite")


def open_ledger() -> None:
    """Create the ledger if this is its first use (an existing file is left alone)."""
    path = ledger_path()
    if path.exists():
        return
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("CREATE TABLE IF NOT EXISTS payments (key TEXT PRIMARY KEY, "
                   "invoice TEXT NOT NULL, amount INTEGER NOT NULL, confirmation TEXT NOT NULL)")


def confirmation_of(invoice: str) -> str:
    """The payment processor's confirmation number: a function of the invoice alone."""
    return "CONF-" + hashlib.sha256(invoice.encode()).hexdigest()[:12].upper()


def receipt(invoice: str, amount: int, confirmation: str) -> dict:
    return {"invoice": invoice, "amount": amount, "status": "paid",
            "confirmation": confirmation}


_pay_calls = 0


def _maybe_crash(where: str) -> None:
    spec = os.environ.get("RECON_CRASH", "")
    n, _, point = spec.partition(":")
    if spec and int(n) == _pay_calls and point == where:
        os.kill(os.getpid(), signal.SIGKILL)


@recorder.tool
def lookup_invoice(invoice: str) -> dict:
    """A pure read of the accounts-payable table."""
    row = INVOICES.get(invoice)
    if row is None:
        return {"invoice": invoice, "error": "no such invoice"}
    return {"invoice": invoice, **row}


def settle_payment(intent: recorder.Intent) -> Settled:
    """Asked by ``deja resume`` when the run stopped inside ``pay``: did it go through?"""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{ledger_path()}?mode=ro",
                                                uri=True)) as db:
            row = db.execute("SELECT invoice, amount, confirmation FROM payments "
                             "WHERE key = ?", (intent.key,)).fetchone()
    except sqlite3.Error as exc:
        return Settled.unknown(f"ledger {ledger_path()} is unreadable: {exc}")
    if row is None:
        return Settled.not_done()
    return Settled.done(receipt(*row))


@recorder.tool(side_effect=True, settle=settle_payment)
def pay(invoice: str, amount: int, idempotency_key: str | None = None) -> dict:
    """Pay ``invoice``: one ledger row, keyed by the idempotency key."""
    global _pay_calls
    _pay_calls += 1
    key = idempotency_key or f"local:{invoice}"
    _maybe_crash("before_ledger")
    confirmation = confirmation_of(invoice)
    with contextlib.closing(sqlite3.connect(ledger_path())) as db, db:
        db.execute("INSERT INTO payments (key, invoice, amount, confirmation) "
                   "VALUES (?, ?, ?, ?)", (key, invoice, amount, confirmation))
    _maybe_crash("after_ledger")
    return receipt(invoice, amount, confirmation)


def run_tool(name: str, args: dict) -> tuple[str, bool]:
    if name == "lookup_invoice":
        return json.dumps(lookup_invoice(**args)), False
    if name == "pay":
        return json.dumps(pay(**args)), False
    return f"unknown tool {name}", True


def main() -> int:
    open_ledger()
    client = anthropic.Anthropic(api_key=os.environ.get("ANTHROPIC_API_KEY", "sk-stub"))
    messages = [{"role": "user", "content": "Month-end close: reconcile the open invoices "
                                            "against the remittances and pay the ones due."}]
    for turn in range(1, MAX_TURNS + 1):
        reply = client.messages.create(model=MODEL, max_tokens=1024, tools=TOOLS,
                                       messages=messages)
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        text = "".join(b.text for b in reply.content if b.type == "text")
        print(f"turn {turn}: {reply.stop_reason}: {text}", flush=True)
        if reply.stop_reason != "tool_use":
            return 0
        results = []
        for block in reply.content:
            if block.type == "tool_use":
                output, is_error = run_tool(block.name, block.input)
                results.append({"type": "tool_result", "tool_use_id": block.id,
                                "content": output, "is_error": is_error})
        messages.append({"role": "user", "content": results})
        time.sleep(float(os.environ.get("RECON_DELAY") or 0))
    print(f"gave up after {MAX_TURNS} turns")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
