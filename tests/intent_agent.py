"""A tiny agent for the resume tests (run by `deja record` / `deja resume`, not collected).

Three pure tool calls, one side-effecting ``charge``, one more pure call. Environment:

- ``INTENT_SETTLE``: ``none`` (default: ``charge`` has no settle function), ``unknown``
  (its settle function answers ``Settled.unknown``), ``done`` or ``not_done``;
- ``INTENT_CRASH=1``: SIGKILL this process inside ``charge``, after its intent line.
"""

from __future__ import annotations

import os
import signal

import recorder
from recorder import Settled

SETTLE = os.environ.get("INTENT_SETTLE", "none")


def check_bank(intent: recorder.Intent) -> Settled:
    if SETTLE == "unknown":
        return Settled.unknown("the bank's status API timed out")
    if SETTLE == "done":
        return Settled.done({"charged": intent.args["amount"], "key": intent.key})
    return Settled.not_done()


@recorder.tool
def step(i: int) -> dict:
    return {"i": i, "square": i * i}


@recorder.tool(side_effect=True, settle=None if SETTLE == "none" else check_bank)
def charge(amount: int, idempotency_key: str | None = None) -> dict:
    if os.environ.get("INTENT_CRASH") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return {"charged": amount, "key": idempotency_key}


def main() -> int:
    for i in range(3):
        print("step", step(i))
    print("charge", charge(amount=5))
    print("step", step(99))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
