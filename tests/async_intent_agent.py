"""A small async agent with side-effecting tools (run by `deja record` / `deja fork` /
`deja replay` in tests/replayer/test_fork.py; not collected).

An async ``lookup``, an async side-effecting ``charge`` that returns its idempotency key,
an async side-effecting ``refund`` that fails (the agent catches it), an effect, and one
more ``lookup``. What ``lookup`` returns is only printed, so a fork that edits the first
``lookup`` makes the same calls after it.
"""

from __future__ import annotations

import asyncio

import recorder


@recorder.tool
async def lookup(invoice: str) -> dict:
    await asyncio.sleep(0)
    return {"invoice": invoice, "due": 120}


@recorder.tool(side_effect=True)
async def charge(invoice: str, amount: int, idempotency_key: str | None = None) -> dict:
    await asyncio.sleep(0)
    return {"charged": amount, "invoice": invoice, "key": idempotency_key}


@recorder.tool(side_effect=True)
async def refund(invoice: str, idempotency_key: str | None = None) -> dict:
    await asyncio.sleep(0)
    raise ValueError(f"invoice {invoice} has nothing to refund")


async def main() -> int:
    print("lookup", await lookup("INV-7"))
    print("charge", await charge("INV-7", 120))
    try:
        await refund("INV-7")
    except ValueError as exc:
        print("refund failed:", exc)
    print("receipt", recorder.uuid4())
    print("lookup", await lookup("INV-8"))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
